"""GroupNorm (+ the SiLU after it), bit-exact vs torch 2.11 CUDA eager, statistics over many SMs.

``group_norm_silu(x, num_groups, weight, bias, eps, silu=True)``::

    out = r(silu(r(GN(x))))        silu=True:  nn.GroupNorm -> nn.SiLU (ResnetBlock2D's
                                               norm1/norm2 + nonlinearity, the decoder's
                                               conv_norm_out + conv_act)
    out = r(GN(x))                 silu=False: nn.GroupNorm alone (the mid-block attention's
                                               group_norm)

``r`` rounds to x's dtype (bf16, fp16 or fp32) round-to-nearest-even where eager stores;
``silu(y) = y / (1 + exp(-y))`` in fp32 (libdevice ``expf``, IEEE division) like
``ActivationSiluKernel.cu``. ``GN`` is torch 2.11's CUDA GroupNorm reproduced bit for bit
(notes/groupnorm.md, docs/numerics.md "GroupNorm"):

- statistics of ``RowwiseMomentsCUDAKernel``: per (sample, group) ``THREADS = 32 if L < 512
  else 512`` threads (``L = C/G * HxW``), thread ``t`` running ``WelfordOps::reduce`` over
  elements ``t, t + THREADS, ...`` (``mean += div.rn(x - mean, n)``, ``m2 = fma(delta, x - mean',
  m2)``), lanes folded at shfl-down offsets 16..1 and warps at 8..1 with ``WelfordOps::combine``
  (ditfuse/kernels/common/welford_ops.py), ``var = m2 / n``, ``rstd = rsqrt.approx(var + T(eps))``
  — eps rounded to x's dtype first, as ``GroupNormKernelImpl`` does;
- mean and rstd are stored in the input dtype (``T* mean_data``) and read back, so for bf16/fp16
  the epilogue sees ``r(mean)``, ``r(rstd)`` (found on the H200: fp32 matched, bf16 did not);
- epilogue (HxW > 1): ``a = rstd * gamma``, ``b = r(r(-a * mean) + beta)`` (ComputeFusedParams is
  not contracted: an H200 probe, bench/probes/probe_group_norm_epilogue.py, found it), ``y = r(fma(a, x, b))``;
  without weight and bias ``r((x - mean) * rstd)``; for HxW == 1 ``GroupNorm1dForward``'s
  ``r(fma((x - mean) * rstd, gamma, beta))`` (and its weight-only / bias-only variants).

Where aten runs one block per (sample, group) — 32 blocks for a batch-1 VAE decoder — the first
kernel here runs one program per *aten warp* (grid ``N*G x THREADS/32``): each Triton thread runs
exactly one aten thread's chain (loads prefetched ``K`` steps ahead) and the program folds its
32 lanes in aten's order into one warp state. The second kernel (grid over chunks of each group)
folds a group's warp states in BlockReduce's order, then applies the epilogue and the SiLU.
Every chain, fold and operation is aten's, so the bits are too. Both kernels are launched with
``enable_fp_fusion=False`` (the FMAs aten has are written out) and ``enable_reflect_ftz=False``
(torch is built without ftz; it selects libdevice's non-ftz ``expf``).

``EXACT`` (a constexpr of both kernels) False gives ``group_norm_silu_fp32``, the close variant
for quality="high": single-pass fp32 ``out = r(silu(GN32(x)))`` (one rounding), statistics from
coalesced tiles merged with Chan's formula (``rstd = 1 / sqrt(var + eps)``, eps in fp32), FMA
contraction allowed. Same launch and validation code; admitted only through the fp64 admission
test (``ditfuse.kernels.exact.group_norm_silu_fp64``).

Inputs: x ``[N, C, *spatial]`` (any rank >= 2; HxW = product of the spatial dims), any strides:
a non-contiguous x is made contiguous first, which is what ``native_group_norm`` does on CUDA
(so channels-last inputs are handled, at the price of the same copy). weight / bias ``[C]`` or
None, x's dtype. Output: a new NCHW-contiguous tensor (as eager's). See
:func:`can_use_group_norm_silu` for every rejection.

The close variant alone also reads channels-innermost memory in place (quality="high"'s
channels-last AutoencoderKL decode; C and C/G powers of two, C <= 1024): per-row tiles reduced per
group, Chan-merged per program, folded per sample, then the apply pass; its output keeps x's
layout. Three launches (statistics, fold, apply), two reads of x and one write.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ditfuse.kernels.common.elementwise import load_f32
from ditfuse.kernels.common.host import cdiv, interpreter_on, next_pow2, sm_count, use_custom_op
from ditfuse.kernels.common.rounding import INTERPRET, round_to, rround
from ditfuse.kernels.common.welford import rsqrt_approx
from ditfuse.kernels.common.welford_ops import (
    div_fast,
    div_fast_unsafe,
    fma_exact,
    neg,
    rcp_refined,
    wops_combine,
    wops_fold,
    wops_reduce,
)
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.common.launch import launch

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

LANES = 32
BLOCK_REDUCE_THREADS = 512  # cuda_utils::kCUDABlockReduceNumThreads
CHAIN_STEPS = 32  # K: chain steps loaded ahead per thread (exact stats kernel)
TARGET_PROGRAMS = 1024  # apply / close-stats kernels: enough programs to fill 132 SMs several times

# Variant switches (constexprs) for the GPU order probe; defaults = torch's order as we read it.
CHAIN_VARIANTS = ("MEAN_MODE", "M2_FMA", "CMB_MEAN_FMA", "CMB_M2_MODE", "FAST_DIV")
APPLY_VARIANTS = ("CMB_MEAN_FMA", "CMB_M2_MODE", "RSQ", "B_FMA", "Y_FMA", "ONE_D_FMA", "SILU_EXP", "SILU_DIV")
# FAST_DIV: the chain's division by its branch-free fast path, block redone with div.rn when a
# dividend is outside the fast path's safe range (same bits by construction: inside that range
# div.rn's FCHK passes and div.rn *is* the fast path). On by default since the H200 runs of
# 2026-12-04: tests/gpu/test_group_norm.py::test_fast_division_variant bitwise at the decoder
# shapes and on special inputs in every full GPU suite, and bench/results/group_norm_h200.csv
# 1.2-2.6x faster chains (notes/groupnorm.md).
DEFAULT_VARIANT = dict(MEAN_MODE=0, M2_FMA=True, CMB_MEAN_FMA=True, CMB_M2_MODE=0, FAST_DIV=True,
                       RSQ=0, B_FMA=False, Y_FMA=True, ONE_D_FMA=True, SILU_EXP=0, SILU_DIV=0)


# ----------------------------------------------------------------------------- device code


@triton.jit
def _load_steps(ptr, rem, THREADS: tl.constexpr, K: tl.constexpr):
    """K chain steps of 32 threads: ``ptr`` points at each thread's element of the first step,
    ``rem`` is how many elements of the group remain from there (<= 0: none). Returns a tuple of
    K [32] fp32 tensors (0 past the end); all K loads are issued before any value is used, and
    share one base pointer (constant offsets ``kk * THREADS``)."""
    xs = ()
    for kk in tl.static_range(K):
        xs = xs + (load_f32(ptr + kk * THREADS, kk * THREADS < rem),)
    return xs


@triton.jit
def _block_fast(mean, m2, cur, rem, b, THREADS: tl.constexpr, K: tl.constexpr, M2_FMA: tl.constexpr,
                MASKED: tl.constexpr):
    """K WelfordOps::reduce steps with div.rn's fast path; redone with div.rn if any step's
    dividend is outside the fast path's safe range (ditfuse/kernels/common/welford_ops.py).
    MASKED False: every step is valid for every lane (all blocks but the last), so the state
    needs no select and the chain's critical path is sub -> 3 fma -> add per step."""
    rs = ()
    for kk in tl.static_range(K):
        rs = rs + (rcp_refined(tl.full([32], 1.0, tl.float32) * tl.cast(b * K + kk + 1, tl.float32)),)
    mean0 = mean
    m20 = m2
    bad = tl.zeros([32], dtype=tl.int1)
    for kk in tl.static_range(K):
        v = cur[kk]
        nf_new = tl.full([32], 1.0, tl.float32) * tl.cast(b * K + kk + 1, tl.float32)
        delta = v - mean
        new_mean = mean + div_fast(delta, nf_new, rs[kk])
        nd = v - new_mean
        if M2_FMA:
            new_m2 = fma_exact(delta, nd, m2)
        else:
            new_m2 = m2 + delta * nd
        if MASKED:
            valid = kk * THREADS < rem
            bad = bad | (valid & div_fast_unsafe(delta))
            mean = tl.where(valid, new_mean, mean)
            m2 = tl.where(valid, new_m2, m2)
        else:
            bad = bad | div_fast_unsafe(delta)
            mean = new_mean
            m2 = new_m2
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        mean = mean0
        m2 = m20
        for kk in tl.static_range(K):
            valid = kk * THREADS < rem
            nf_new = tl.full([32], 1.0, tl.float32) * tl.cast(b * K + kk + 1, tl.float32)
            mean, m2 = wops_reduce(mean, m2, cur[kk], nf_new, valid, 0, M2_FMA)
    return mean, m2


@triton.jit(do_not_specialize=["L", "NB", "NGW"])
def _gn_chain_kernel(
    x_ptr, ws_ptr, L, NB, NGW,
    THREADS: tl.constexpr, K: tl.constexpr,
    MEAN_MODE: tl.constexpr, M2_FMA: tl.constexpr, CMB_MEAN_FMA: tl.constexpr, CMB_M2_MODE: tl.constexpr,
    FAST_DIV: tl.constexpr,
):
    """Exact statistics, one program per aten warp: program (i, w) runs the chains of threads
    ``t = 32 w + lane`` of group i and stores the warp's folded (mean, m2, nf) at ``ws[:, i*W + w]``.

    FAST_DIV: each block of K steps first runs with div.rn's fast path (reciprocals computed
    before the block, off the chain's critical path); if any dividend of the block was outside
    the fast path's safe range, the block is recomputed from its saved state with div.rn."""
    W: tl.constexpr = THREADS // 32
    i = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    t = w * 32 + tl.arange(0, 32)
    ptr = x_ptr + i * L + t
    rem = L - t  # elements of the group from this thread's current step on
    STEP: tl.constexpr = K * THREADS
    mean = tl.zeros([32], dtype=tl.float32)
    m2 = tl.zeros([32], dtype=tl.float32)
    cur = _load_steps(ptr, rem, THREADS, K)
    b = 0
    while b < NB:
        nxt = _load_steps(ptr + STEP, rem - STEP, THREADS, K)
        if FAST_DIV:
            if b < NB - 1:  # not the last block: every step of every lane is an element
                mean, m2 = _block_fast(mean, m2, cur, rem, b, THREADS, K, M2_FMA, False)
            else:
                mean, m2 = _block_fast(mean, m2, cur, rem, b, THREADS, K, M2_FMA, True)
        else:
            for kk in tl.static_range(K):
                valid = kk * THREADS < rem
                nf_new = tl.full([32], 1.0, tl.float32) * tl.cast(b * K + kk + 1, tl.float32)
                mean, m2 = wops_reduce(mean, m2, cur[kk], nf_new, valid, MEAN_MODE, M2_FMA)
        cur = nxt
        ptr += STEP
        rem -= STEP
        b += 1
    nf = tl.maximum((L - t + THREADS - 1) // THREADS, 0).to(tl.float32)
    mean, m2, nf = wops_fold(mean, m2, nf, 32, CMB_MEAN_FMA, CMB_M2_MODE)
    dst = i * W + w + tl.arange(0, 1)
    tl.store(ws_ptr + dst, mean)
    tl.store(ws_ptr + NGW + dst, m2)
    tl.store(ws_ptr + 2 * NGW + dst, nf)


@triton.jit
def _chan_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Chan et al.'s merge of two (mean, M2, n) states (close variant; order-free)."""
    n = n_a + n_b
    wb = tl.where(n > 0, n_b / tl.where(n > 0, n, 1.0), 0.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * wb
    m2 = m2_a + m2_b + delta * delta * n_a * wb
    mean = tl.where(n_a == 0, mean_b, tl.where(n_b == 0, mean_a, mean))
    m2 = tl.where(n_a == 0, m2_b, tl.where(n_b == 0, m2_a, m2))
    return mean, m2, n


@triton.jit(do_not_specialize=["L", "TPP", "NGW"])
def _gn_stats_fp32_kernel(x_ptr, ws_ptr, L, TPP, NGW, W: tl.constexpr, BLOCK: tl.constexpr):
    """Close statistics: program (i, p) merges tiles ``p*TPP .. (p+1)*TPP - 1`` of group i (two
    passes over each tile in registers, Chan's merge across tiles)."""
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    row = x_ptr + i * L
    r = tl.arange(0, BLOCK)
    mean = 0.0
    m2 = 0.0
    n = 0.0
    it = 0
    while it < TPP:
        offs = tl.cast(p * TPP + it, tl.int64) * BLOCK + r
        mask = offs < L
        x = load_f32(row + offs, mask)
        nt = tl.sum(mask.to(tl.float32), axis=0)
        mt = tl.sum(x, axis=0) / tl.where(nt > 0, nt, 1.0)
        d = tl.where(mask, x - mt, 0.0)
        mean, m2, n = _chan_combine(mean, m2, n, mt, tl.sum(d * d, axis=0), nt)
        it += 1
    dst = i * W + p + tl.arange(0, 1)
    z = tl.zeros([1], tl.float32)
    tl.store(ws_ptr + dst, z + mean)
    tl.store(ws_ptr + NGW + dst, z + m2)
    tl.store(ws_ptr + 2 * NGW + dst, z + n)


@triton.jit
def _fold_group_states(ws_ptr, base, NGW, W: tl.constexpr, CMB_MEAN_FMA: tl.constexpr, CMB_M2_MODE: tl.constexpr):
    """Load a group's W warp states (``ws[:, base:base+W]``) and fold them in BlockReduce's
    second-stage order (offsets W/2, ..., 1; element j combines with j + offset, own first).
    Unrolled over scalars: every thread computes the same fold from uniform loads, without the
    layout conversions (or replicated per-register copies) a tensor-shaped fold costs."""
    ms = ()
    m2s = ()
    ns = ()
    for j in tl.static_range(W):
        ms = ms + (tl.load(ws_ptr + base + j),)
        m2s = m2s + (tl.load(ws_ptr + NGW + base + j),)
        ns = ns + (tl.load(ws_ptr + 2 * NGW + base + j),)
    for lvl in tl.static_range(5):  # offsets W/2, W/4, ..., 1 (W <= 32)
        if (W >> (lvl + 1)) >= 1:
            nm = ()
            nm2 = ()
            nn = ()
            for j in tl.static_range(W >> (lvl + 1)):
                m, q, n = wops_combine(ms[j], m2s[j], ns[j],
                                       ms[j + (W >> (lvl + 1))], m2s[j + (W >> (lvl + 1))],
                                       ns[j + (W >> (lvl + 1))], CMB_MEAN_FMA, CMB_M2_MODE)
                nm = nm + (m,)
                nm2 = nm2 + (q,)
                nn = nn + (n,)
            ms = nm
            m2s = nm2
            ns = nn
    return ms[0], m2s[0], ns[0]


@triton.jit
def _exp(x, SILU_EXP: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    elif SILU_EXP == 0:
        return libdevice.exp(x)  # __nv_expf = CUDA's precise expf
    else:  # __expf (fast-math), for the probe only
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _silu(y, SILU_EXP: tl.constexpr, SILU_DIV: tl.constexpr):
    """ActivationSiluKernel: ``y / (1 + expf(-y))`` in fp32."""
    den = 1.0 + _exp(neg(y), SILU_EXP)
    if SILU_DIV == 0:
        return tl.math.div_rn(y, den)
    else:
        return y * tl.math.div_rn(tl.full(y.shape, 1.0, tl.float32), den)


@triton.jit
def _rstd(var, eps, RSQ: tl.constexpr):
    # eps is an fp32 argument on the GPU; the interpreter keeps Python floats in fp64
    z = var + tl.cast(eps, tl.float32)
    if RSQ == 0:
        return rsqrt_approx(z)  # rsqrtf -> rsqrt.approx.f32, no ftz
    elif RSQ == 1:
        return tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), tl.math.sqrt_rn(z))
    else:
        return tl.math.rsqrt(z)


@triton.jit
def _fma_b(a, mean, beta):
    """``b = fma(-a, mean, beta)`` for a scalar or [BLOCK] ``a`` (mean a scalar, beta a scalar or
    like ``a``): operands brought to one shape exactly first (``tl.fma`` does not broadcast)."""
    na = neg(a)
    return fma_exact(na, tl.broadcast_to(mean, na.shape), tl.broadcast_to(beta, na.shape))


@triton.jit
def _affine_exact(x, mean, rstd, gam, bet, BLOCK: tl.constexpr,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, ONE_D: tl.constexpr,
                  B_FMA: tl.constexpr, Y_FMA: tl.constexpr, ONE_D_FMA: tl.constexpr):
    """aten's GroupNorm epilogue in fp32 (before the store's rounding). mean, rstd: scalars;
    gam, bet: scalars (one channel per block) or [BLOCK]; x: [BLOCK]. Scalars reach [BLOCK]
    through ``broadcast_to`` (a splat: exact, unlike adding a zero tensor, which turns -0 into +0)."""
    meanb = tl.broadcast_to(mean, [BLOCK])
    rstdb = tl.broadcast_to(rstd, [BLOCK])
    if ONE_D:  # GroupNorm1dForward: (x - mean) * rstd [* gamma] [+ beta]
        if HAS_W:
            tt = (x - meanb) * rstdb
            g = tl.broadcast_to(gam, [BLOCK])
            if HAS_B:
                if ONE_D_FMA:
                    y = fma_exact(tt, g, tl.broadcast_to(bet, [BLOCK]))
                else:
                    y = tt * g + tl.broadcast_to(bet, [BLOCK])
            else:
                y = tt * g
        elif HAS_B:
            if ONE_D_FMA:
                y = fma_exact(x - meanb, rstdb, tl.broadcast_to(bet, [BLOCK]))
            else:
                y = (x - meanb) * rstdb + tl.broadcast_to(bet, [BLOCK])
        else:
            y = (x - meanb) * rstdb
    elif HAS_W or HAS_B:  # ComputeFusedParams: a = rstd*gamma, b = -a*mean + beta; y = a*x + b
        if HAS_W:
            a = rstd * gam
        else:
            a = tl.broadcast_to(rstd, bet.shape)
        if HAS_B:
            b0 = bet
        else:
            b0 = tl.zeros_like(a)  # the kernel adds a literal 0 (-0 products become +0)
        if B_FMA:
            b = _fma_b(a, mean, b0)
        else:
            b = neg(a) * mean + b0
        ab = tl.broadcast_to(a, [BLOCK])
        bb = tl.broadcast_to(b, [BLOCK])
        if Y_FMA:
            y = fma_exact(ab, x, bb)
        else:
            y = ab * x + bb
    else:
        y = (x - meanb) * rstdb
    return y


# L and HxW stay specialised (divisibility by 16 lets the loads/stores of aligned rows vectorise);
# the other scalars are not, so one compile serves every size of a given alignment.
@triton.jit(do_not_specialize=["D", "G", "NGW", "NW", "ITERS", "eps"])
def _gn_apply_kernel(
    x_ptr, w_ptr, b_ptr, ws_ptr, out_ptr,
    L, HxW, D, G, NGW, NW, ITERS, eps,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr, EXACT: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ONE_D: tl.constexpr, CH_UNIFORM: tl.constexpr,
    SILU: tl.constexpr,
    CMB_MEAN_FMA: tl.constexpr, CMB_M2_MODE: tl.constexpr, RSQ: tl.constexpr,
    B_FMA: tl.constexpr, Y_FMA: tl.constexpr, ONE_D_FMA: tl.constexpr,
    SILU_EXP: tl.constexpr, SILU_DIV: tl.constexpr,
):
    """Program (i, p): fold group i's states, then normalise blocks ``p*ITERS ..`` of the group
    (BLOCK elements each) and store ``r(silu(r(y)))`` / ``r(y)`` (exact) or ``r(silu(y))`` (close)."""
    i = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    g = i % G
    if EXACT:
        mean, m2, nf = _fold_group_states(ws_ptr, i * W, NGW, W, CMB_MEAN_FMA, CMB_M2_MODE)
        rstd = _rstd(tl.math.div_rn(m2, nf), eps, RSQ)
        # torch 2.11's RowwiseMomentsCUDAKernel stores mean and rstd as T (the input dtype) and
        # the epilogue reads them back: for bf16/fp16 both are rounded before the affine.
        mean = round_to(mean, DTYPE).to(tl.float32)
        rstd = round_to(rstd, DTYPE).to(tl.float32)
    else:
        s = tl.arange(0, W)
        src = i * W + s
        ok = s < NW
        mean_s = tl.load(ws_ptr + src, mask=ok, other=0.0)
        m2_s = tl.load(ws_ptr + NGW + src, mask=ok, other=0.0)
        n_s = tl.load(ws_ptr + 2 * NGW + src, mask=ok, other=0.0)
        mean0, m20, n0 = tl.reduce((mean_s, m2_s, n_s), 0, _chan_combine)
        z1 = tl.zeros([1], tl.float32)
        mean = z1 + mean0
        rstd = z1 + 1.0 / tl.math.sqrt_rn(m20 / n0 + tl.cast(eps, tl.float32))
    row_in = x_ptr + i * L
    row_out = out_ptr + i * L
    r = tl.arange(0, BLOCK)
    it = 0
    while it < ITERS:
        start = tl.cast(p * ITERS + it, tl.int64) * BLOCK
        offs = start + r
        mask = offs < L
        x = load_f32(row_in + offs, mask)
        if CH_UNIFORM:  # the whole block lies in one channel: scalar gamma/beta, a and b
            c = g * D + start // HxW
            if HAS_W:
                gam = load_f32(w_ptr + c, True)
            else:
                gam = tl.cast(0.0, tl.float32)
            if HAS_B:
                bet = load_f32(b_ptr + c, True)
            else:
                bet = tl.cast(0.0, tl.float32)
        else:
            c = g * D + offs // HxW
            if HAS_W:
                gam = load_f32(w_ptr + c, mask)
            else:
                gam = tl.zeros([BLOCK], tl.float32)
            if HAS_B:
                bet = load_f32(b_ptr + c, mask)
            else:
                bet = tl.zeros([BLOCK], tl.float32)
        if EXACT:
            y = _affine_exact(x, mean, rstd, gam, bet, BLOCK, HAS_W, HAS_B, ONE_D, B_FMA, Y_FMA, ONE_D_FMA)
            if SILU:
                y = _silu(rround(y, DTYPE), SILU_EXP, SILU_DIV)
        else:
            if HAS_W:
                a = rstd * gam
            else:
                a = rstd + tl.zeros_like(gam)
            y = tl.broadcast_to(a, [BLOCK]) * (x - tl.broadcast_to(mean, [BLOCK])) + tl.broadcast_to(bet, [BLOCK])
            if SILU:
                y = _silu(y, 0, 0)
        tl.store(row_out + offs, round_to(y, DTYPE), mask=mask)
        it += 1


@triton.jit(do_not_specialize=["NGW", "eps"])
def _gn_stats_out_kernel(ws_ptr, mean_ptr, rstd_ptr, NGW, eps, W: tl.constexpr,
                         CMB_MEAN_FMA: tl.constexpr, CMB_M2_MODE: tl.constexpr, RSQ: tl.constexpr):
    """(mean, rstd) of each group, folded exactly as the apply kernel does (tests and probe)."""
    i = tl.program_id(0).to(tl.int64)
    mean, m2, nf = _fold_group_states(ws_ptr, i * W, NGW, W, CMB_MEAN_FMA, CMB_M2_MODE)
    tl.store(mean_ptr + i, mean)
    tl.store(rstd_ptr + i, _rstd(tl.math.div_rn(m2, nf), eps, RSQ))


# ----------------------------------------------------------------------------- channels-last output (exact)
#
# The lossless AutoencoderKL decode hands every ResnetBlock2D norm's output to a convolution that
# cuDNN runs as NCHW->NHWC transpose, NHWC kernel, NHWC->NCHW transpose. The exact statistics
# need NCHW memory (aten's chains walk it), but the epilogue may write anywhere: written
# channels-last, the convolution reads it as it is (layout.conv_channels_last's observation:
# same NHWC kernel, same bits, gated per signature) and the transposes are gone.


@triton.jit(do_not_specialize=["C", "HW", "D", "G", "NG"])
def _gn_apply_cl_out_kernel(
    x_ptr, w_ptr, b_ptr, stat_ptr, out_ptr, C, HW, D, G, NG,
    DTYPE: tl.constexpr, BHW: tl.constexpr, BC: tl.constexpr,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
    B_FMA: tl.constexpr, Y_FMA: tl.constexpr, SILU_EXP: tl.constexpr, SILU_DIV: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Program (hw tile, channel tile, n): the epilogue of ``_gn_apply_kernel`` (HxW > 1) on a
    ``[BC, BHW]`` tile of NCHW x (channel rows, positions contiguous: coalesced loads), turned
    around with ``tl.trans`` and stored as ``[BHW, BC]`` channels-last rows (coalesced stores).
    ``stat``: fp32 [2, N*G] mean / rstd as the exact fold computes them (``_gn_stats_out_kernel``).
    ``EVEN``: the tiles divide C and HxW (every decoder shape), so no load or store is masked;
    otherwise the store's mask is built in the stored orientation (not transposed: a transposed
    mask is a second trip through shared memory)."""
    hw = tl.program_id(0) * BHW + tl.arange(0, BHW)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    n = tl.program_id(2).to(tl.int64)
    grp = n * G + c // D
    x_at = x_ptr + n * C * HW + c[:, None].to(tl.int64) * HW + hw[None, :]
    out_at = out_ptr + n * HW * C + hw[:, None].to(tl.int64) * C + c[None, :]
    # RowwiseMomentsCUDAKernel stores mean / rstd as the input dtype
    if EVEN:
        mean = round_to(tl.load(stat_ptr + grp), DTYPE).to(tl.float32)
        rstd = round_to(tl.load(stat_ptr + NG + grp), DTYPE).to(tl.float32)
        x = load_f32(x_at, None)
        w = rstd
        b0 = rstd
        if HAS_W:
            w = load_f32(w_ptr + c, None)
        if HAS_B:
            b0 = load_f32(b_ptr + c, None)
    else:
        cm = c < C
        mean = round_to(tl.load(stat_ptr + grp, mask=cm, other=0.0), DTYPE).to(tl.float32)
        rstd = round_to(tl.load(stat_ptr + NG + grp, mask=cm, other=0.0), DTYPE).to(tl.float32)
        x = load_f32(x_at, cm[:, None] & (hw < HW)[None, :])
        w = rstd
        b0 = rstd
        if HAS_W:
            w = load_f32(w_ptr + c, cm)
        if HAS_B:
            b0 = load_f32(b_ptr + c, cm)
    if HAS_W or HAS_B:  # ComputeFusedParams per channel, then y = a*x + b
        if HAS_W:
            a = rstd * w
        else:
            a = rstd
        if not HAS_B:
            b0 = tl.zeros_like(a)  # the kernel adds a literal 0 (-0 products become +0)
        if B_FMA:
            b = _fma_b(a, mean, b0)
        else:
            b = neg(a) * mean + b0
        ab = tl.broadcast_to(a[:, None], [BC, BHW])
        bb = tl.broadcast_to(b[:, None], [BC, BHW])
        if Y_FMA:
            y = fma_exact(ab, x, bb)
        else:
            y = ab * x + bb
    else:
        y = (x - tl.broadcast_to(mean[:, None], [BC, BHW])) * tl.broadcast_to(rstd[:, None], [BC, BHW])
    if SILU:
        y = _silu(rround(y, DTYPE), SILU_EXP, SILU_DIV)
    out = tl.trans(round_to(y, DTYPE))
    if EVEN:
        tl.store(out_at, out)
    else:
        tl.store(out_at, out, mask=(hw < HW)[:, None] & (c < C)[None, :])


@triton.jit(do_not_specialize=["C", "HW"])
def _cl_to_nchw_kernel(x_ptr, out_ptr, C, HW, BHW: tl.constexpr, BC: tl.constexpr):
    """A bit copy of channels-last x (``[N, HW, C]`` rows) into NCHW: ``[BHW, BC]`` tiles loaded
    along the channels, stored along the positions (``tl.trans`` in between)."""
    hw = tl.program_id(0) * BHW + tl.arange(0, BHW)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * HW * C
    m = (hw < HW)[:, None] & (c < C)[None, :]
    v = tl.load(x_ptr + base + hw[:, None].to(tl.int64) * C + c[None, :], mask=m)
    tl.store(out_ptr + base + c[:, None].to(tl.int64) * HW + hw[None, :], tl.trans(v), mask=tl.trans(m))


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()`` (native_group_norm's first step: the same values in NCHW memory) with a
    channels-last 4-D x copied by a tiled Triton pass (aten's strided copy of a channels-last
    tensor ran at a few % of copy bandwidth in the AutoencoderKL decode)."""
    if x.is_contiguous() or x.dim() != 4 or x.numel() == 0:
        return x.contiguous()
    N, C, H, W = x.shape
    if x.stride() != (H * W * C, 1, W * C, C):
        return x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BHW, BC = 64, min(64, next_pow2(C))
    launch(_cl_to_nchw_kernel, (cdiv(H * W, BHW), cdiv(C, BC), N), x, out, C, H * W, BHW=BHW, BC=BC, num_warps=4)
    return out


# ----------------------------------------------------------------------------- channels-last (close)
#
# quality="high" decodes AutoencoderKL in channels-last memory (cuDNN's NHWC convolutions without
# its NCHW <-> NHWC transposes): x is then [N, S, C] rows, a group D = C/G adjacent channels of
# every row. The close kernels read whole rows (coalesced) and reduce each tile per group; the
# exact kernels cannot (aten's chain order walks NCHW memory), so this path is close-only.


@triton.jit(do_not_specialize=["S", "RPP", "NPG"])
def _gn_cl_stats_kernel(x_ptr, ws_ptr, S, RPP, NPG, C: tl.constexpr, G: tl.constexpr, BS: tl.constexpr):
    """Program (n, p): rows ``p*RPP .. (p+1)*RPP - 1`` of sample n, BS rows per tile; each tile's
    per-group (mean, M2) in registers (two passes), Chan-merged across tiles; stores its [G]."""
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    D: tl.constexpr = C // G
    rows = tl.arange(0, BS)
    cols = tl.arange(0, C)
    base = x_ptr + n * S * C
    mean = tl.zeros([G], tl.float32)
    m2 = tl.zeros([G], tl.float32)
    cnt = tl.zeros([G], tl.float32)
    r0 = tl.cast(p, tl.int64) * RPP
    r_end = tl.minimum(r0 + RPP, S)
    start = r0
    while start < r_end:
        rr = start + rows
        rm = rr < r_end
        x = load_f32(base + rr[:, None] * C + cols[None, :], rm[:, None])
        x3 = tl.reshape(x, [BS, G, D])
        nt = tl.sum(rm.to(tl.float32), axis=0) * D
        mt = tl.sum(tl.sum(x3, axis=2), axis=0) / nt
        d = tl.where(tl.reshape(rm, [BS, 1, 1]), x3 - tl.reshape(mt, [1, G, 1]), 0.0)
        q = tl.sum(tl.sum(d * d, axis=2), axis=0)
        mean, m2, cnt = _chan_combine(mean, m2, cnt, mt, q, tl.zeros([G], tl.float32) + nt)
        start += BS
    g = tl.arange(0, G)
    dst = (n * tl.num_programs(1) + p) * G + g
    tl.store(ws_ptr + dst, mean)
    tl.store(ws_ptr + NPG + dst, m2)
    tl.store(ws_ptr + 2 * NPG + dst, cnt)


@triton.jit(do_not_specialize=["P", "NPG", "eps"])
def _gn_cl_fold_kernel(ws_ptr, stat_ptr, P, NPG, eps, G: tl.constexpr, PB: tl.constexpr):
    """Program n: Chan-merge the P tile states of each group of sample n; store mean, rstd [G]."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, PB)
    g = tl.arange(0, G)
    mean = tl.zeros([G], tl.float32)
    m2 = tl.zeros([G], tl.float32)
    cnt = tl.zeros([G], tl.float32)
    p0 = 0
    while p0 < P:
        ok = (p0 + j) < P
        src = (n * P + p0 + j)[:, None] * G + g[None, :]
        mk = ok[:, None]
        a, b, c = tl.reduce((tl.load(ws_ptr + src, mask=mk, other=0.0), tl.load(ws_ptr + NPG + src, mask=mk, other=0.0),
                             tl.load(ws_ptr + 2 * NPG + src, mask=mk, other=0.0)), 0, _chan_combine)
        mean, m2, cnt = _chan_combine(mean, m2, cnt, a, b, c)
        p0 += PB
    tl.store(stat_ptr + n * 2 * G + g, mean)
    tl.store(stat_ptr + n * 2 * G + G + g, 1.0 / tl.math.sqrt_rn(m2 / cnt + tl.cast(eps, tl.float32)))


@triton.jit(do_not_specialize=["S", "RPP"])
def _gn_cl_apply_kernel(x_ptr, w_ptr, b_ptr, stat_ptr, out_ptr, S, RPP,
                        C: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, DTYPE: tl.constexpr,
                        HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr):
    """Program (n, p): rows ``p*RPP ..`` of sample n: ``r(silu(rstd*gamma*(x - mean) + beta))``."""
    n = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    D: tl.constexpr = C // G
    cols = tl.arange(0, C)
    grp = cols // D
    mean = tl.load(stat_ptr + n * 2 * G + grp)
    a = tl.load(stat_ptr + n * 2 * G + G + grp)
    if HAS_W:
        a = a * load_f32(w_ptr + cols, None)
    if HAS_B:
        bet = load_f32(b_ptr + cols, None)
    else:
        bet = tl.zeros([C], tl.float32)
    rows = tl.arange(0, BS)
    base = n * S * C
    r0 = tl.cast(p, tl.int64) * RPP
    r_end = tl.minimum(r0 + RPP, S)
    start = r0
    while start < r_end:
        rr = start + rows
        rm = (rr < r_end)[:, None]
        offs = base + rr[:, None] * C + cols[None, :]
        x = load_f32(x_ptr + offs, rm)
        y = a[None, :] * (x - mean[None, :]) + bet[None, :]
        if SILU:
            y = _silu(y, 0, 0)
        tl.store(out_ptr + offs, round_to(y, DTYPE), mask=rm)
        start += BS


# ----------------------------------------------------------------------------- host side


def _eps_for_kernel(dtype: torch.dtype, eps: float) -> float:
    """``static_cast<scalar_t>(eps)`` (double -> float -> dtype, round-to-nearest-even) widened
    back to fp32, exactly what RowwiseMomentsCUDAKernel adds to the variance."""
    return float(torch.tensor(float(eps), dtype=torch.float64).to(torch.float32).to(dtype).to(torch.float32))


def _threads(L: int) -> int:
    return LANES if L < BLOCK_REDUCE_THREADS else BLOCK_REDUCE_THREADS


def _apply_tiling(NG: int, L: int, HxW: int, block: int | None = None,
                  iters: int | None = None) -> tuple[int, int, int, bool, int]:
    """(BLOCK, ITERS, programs per group, CH_UNIFORM, num_warps) for the apply kernel: BLOCK
    elements per step, ITERS steps per program (enough programs to fill the GPU, few enough that
    the per-program fold of the group's states is amortised). Tiling never changes the bits."""
    block = block or min(4096, next_pow2(L))
    nblk = cdiv(L, block)
    iters = iters or max(1, min(nblk, (NG * nblk) // TARGET_PROGRAMS))
    per_group = cdiv(nblk, iters)
    uniform = HxW > 1 and HxW % block == 0
    warps = 8 if block >= 4096 else 4
    return block, iters, per_group, uniform, warps


def _launch(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu: bool,
    exact: bool = True,
    *,
    chain_steps: int | None = None,
    apply_block: int | None = None,
    apply_iters: int | None = None,
    variant: dict[str, Any] | None = None,
    eps_override: float | None = None,
) -> torch.Tensor:
    """Run the two kernels (no checks). ``chain_steps`` / ``apply_block`` / ``apply_iters``
    override the tiling (tests and benchmarks; the bits do not depend on them); ``variant`` /
    ``eps_override`` exist for the GPU order probe. The defaults are the bit-exact configuration."""
    if not exact and _cl_path(x, num_groups) and chain_steps is None and apply_block is None:
        return _launch_cl(x, num_groups, weight, bias, eps, silu)
    x = _contiguous(x)  # native_group_norm on CUDA: X.contiguous() (a bit copy)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    N, C = x.shape[0], x.shape[1]
    G = int(num_groups)
    D = C // G
    HxW = x.numel() // (N * C)
    L = D * HxW
    NG = N * G
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    v = dict(DEFAULT_VARIANT)
    if variant:
        unknown = set(variant) - set(DEFAULT_VARIANT)
        if unknown:
            raise ValueError(f"unknown variant switches {sorted(unknown)}")
        v.update(variant)
    block, iters, per_group, uniform, warps = _apply_tiling(NG, L, HxW, apply_block, apply_iters)
    if exact:
        threads = _threads(L)
        W = threads // LANES
        J = cdiv(L, threads)
        K = min(chain_steps or CHAIN_STEPS, next_pow2(J))
        ws = torch.empty((3, NG * W), dtype=torch.float32, device=x.device)
        launch(_gn_chain_kernel, (NG, W),
            x, ws, L, cdiv(J, K), NG * W,
            THREADS=threads, K=K, **{k: v[k] for k in CHAIN_VARIANTS},
            num_warps=1, enable_fp_fusion=False,
        )
        eps_k = _eps_for_kernel(x.dtype, eps) if eps_override is None else float(eps_override)
        nw = W
    else:
        block1 = min(4096, next_pow2(L))
        ntiles = cdiv(L, block1)
        p1 = min(ntiles, 64, max(1, TARGET_PROGRAMS // NG))
        tpp = cdiv(ntiles, p1)
        p1 = cdiv(ntiles, tpp)
        W = next_pow2(p1)
        ws = torch.empty((3, NG * W), dtype=torch.float32, device=x.device)
        launch(_gn_stats_fp32_kernel, (NG, p1),
            x, ws, L, tpp, NG * W, W=W, BLOCK=block1, num_warps=8 if block1 >= 4096 else 4,
        )
        eps_k = float(eps)
        nw = p1
    launch(_gn_apply_kernel, (NG, per_group),
        x, w, b, ws, out,
        L, HxW, D, G, NG * W, nw, iters, eps_k,
        DTYPE=_DTYPES[x.dtype], BLOCK=block, W=W, EXACT=exact,
        HAS_W=weight is not None, HAS_B=bias is not None, ONE_D=HxW == 1, CH_UNIFORM=uniform,
        SILU=bool(silu), **{k: v[k] for k in APPLY_VARIANTS},
        num_warps=warps, enable_fp_fusion=not exact, enable_reflect_ftz=False,
    )
    return out


def _channels_innermost(x: torch.Tensor) -> bool:
    return x.dim() >= 3 and x.permute(0, *range(2, x.dim()), 1).is_contiguous()


def _cl_path(x: torch.Tensor, num_groups: int) -> bool:
    """The close kernels read x in place as [N, S, C] rows: channels innermost (channels-last, or
    the mid-block attention's [N, C, L] view of [N, L, C] rows) and not also contiguous, C and
    C/G powers of two (a row is one tile), C <= 1024."""
    C = x.shape[1]
    G = int(num_groups)
    D = C // G
    return (not x.is_contiguous() and _channels_innermost(x) and 1 < C <= 1024 and C & (C - 1) == 0
            and D & (D - 1) == 0 and x.numel() > 0)


def _launch_cl(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float, silu: bool) -> torch.Tensor:
    """The close path on channels-innermost memory; output in x's layout (channels-last stays)."""
    out = torch.empty_like(x)
    N, C = x.shape[0], x.shape[1]
    G = int(num_groups)
    S = x.numel() // (N * C)
    BS = max(1, min(next_pow2(S), 8192 // C))
    warps = 8 if BS * C >= 4096 else 4
    ntiles = cdiv(S, BS)
    target = max(1, (4 * sm_count(x.device)) // N)
    P = min(ntiles, target)
    rpp = cdiv(ntiles, P) * BS
    P = cdiv(S, rpp)
    npg = N * P * G
    ws = torch.empty((3, npg), dtype=torch.float32, device=x.device)
    stat = torch.empty((N, 2, G), dtype=torch.float32, device=x.device)
    launch(_gn_cl_stats_kernel, (N, P), x, ws, S, rpp, npg, C=C, G=G, BS=BS, num_warps=warps)
    launch(_gn_cl_fold_kernel, (N,), ws, stat, P, npg, float(eps), G=G, PB=min(64, next_pow2(P)), num_warps=4)
    w = weight.contiguous() if weight is not None else x
    b = bias.contiguous() if bias is not None else x
    launch(_gn_cl_apply_kernel, (N, P), x, w, b, stat, out, S, rpp, C=C, G=G, BS=BS, DTYPE=_DTYPES[x.dtype],
           HAS_W=weight is not None, HAS_B=bias is not None, SILU=bool(silu), num_warps=warps)
    return out


def _launch_cl_out(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, silu: bool) -> torch.Tensor:
    """The exact GroupNorm (+ SiLU), output channels-last: the statistics as :func:`_launch`
    computes them (aten's chains on NCHW memory; a channels-last x is made contiguous first, as
    native_group_norm does), the epilogue from NCHW tiles into channels-last rows."""
    if x.dim() != 4 or x.numel() == 0 or x.shape[2] * x.shape[3] == 1:
        # nothing to turn around (a [N, C, 1, 1] tensor is channels-last already)
        return _launch(x, num_groups, weight, bias, eps, silu).contiguous(memory_format=torch.channels_last)
    x = _contiguous(x)
    G = int(num_groups)
    return _apply_cl_out(x, G, _exact_stats(x, G, eps), weight, bias, silu)


# (BHW, BC, num_warps) of the channels-last epilogue; bench/probes/probe_gn_cl_out.py sweeps them.
# H100, round 16 (bench/results/probe_gn_cl_out_round16_b_h100.csv): 16x256x4 (16x128x4 where
# C = 128) was the fastest of 13 tiles at every 1024² decoder shape but one (there 2 % behind),
# at 62-66 % of copy bandwidth; the round-15 tile 64x64x4 ran at 34-41 %, and the NCHW apply at
# ~90 %. Wide channel tiles make the channels-last stores long; short position tiles keep each
# channel's loads to one 32-byte sector and the transposed tile small.
CL_OUT_TILE = (16, 256, 4)


def _apply_cl_out(x: torch.Tensor, G: int, stat: torch.Tensor, weight: torch.Tensor | None,
                  bias: torch.Tensor | None, silu: bool,
                  tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The epilogue of :func:`_launch_cl_out` on contiguous NCHW ``x`` with its exact ``stat``
    (fp32 ``[2, N*G]``), into a new channels-last tensor. ``tile``: (BHW, BC, num_warps), default
    :data:`CL_OUT_TILE` (any tile gives the same bits: elements are independent)."""
    N, C, H, W = x.shape
    HxW = H * W
    BHW, BC, warps = tile or CL_OUT_TILE
    BC = min(BC, next_pow2(C))
    v = DEFAULT_VARIANT
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    launch(_gn_apply_cl_out_kernel, (cdiv(HxW, BHW), cdiv(C, BC), N),
        x, weight.contiguous() if weight is not None else x, bias.contiguous() if bias is not None else x,
        stat, out, C, HxW, C // G, G, N * G,
        DTYPE=_DTYPES[x.dtype], BHW=BHW, BC=BC, HAS_W=weight is not None, HAS_B=bias is not None,
        SILU=bool(silu), B_FMA=v["B_FMA"], Y_FMA=v["Y_FMA"], SILU_EXP=v["SILU_EXP"], SILU_DIV=v["SILU_DIV"],
        EVEN=(HxW % BHW == 0 and C % BC == 0), num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False,
    )
    return out


def group_stats(
    x: torch.Tensor,
    num_groups: int,
    eps: float,
    *,
    chain_steps: int | None = None,
    variant: dict[str, Any] | None = None,
    eps_override: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact kernels' per-group (mean, rstd), fp32 ``[N, G]`` — what ``native_group_norm``
    returns as its 2nd and 3rd outputs for an fp32 input (for bf16/fp16 it returns them rounded
    to the input dtype). For tests and the GPU order probe; no checks."""
    x = x.contiguous()
    stat = _exact_stats(x, int(num_groups), eps, chain_steps=chain_steps, variant=variant, eps_override=eps_override)
    return stat[0].reshape(x.shape[0], -1), stat[1].reshape(x.shape[0], -1)


def _exact_stats(x: torch.Tensor, G: int, eps: float, *, chain_steps: int | None = None,
                 variant: dict[str, Any] | None = None, eps_override: float | None = None) -> torch.Tensor:
    """Per-group (mean, rstd) of contiguous x as the exact kernels compute them (aten's chains, the
    apply kernel's fold written out by ``_gn_stats_out_kernel``), fp32 ``[2, N*G]``."""
    N, C = x.shape[0], x.shape[1]
    L = (C // G) * (x.numel() // (N * C))
    NG = N * G
    v = dict(DEFAULT_VARIANT, **variant) if variant else DEFAULT_VARIANT
    threads = _threads(L)
    W = threads // LANES
    J = cdiv(L, threads)
    K = min(chain_steps or CHAIN_STEPS, next_pow2(J))
    ws = torch.empty((3, NG * W), dtype=torch.float32, device=x.device)
    launch(_gn_chain_kernel, (NG, W),
        x, ws, L, cdiv(J, K), NG * W,
        THREADS=threads, K=K, **{k: v[k] for k in CHAIN_VARIANTS},
        num_warps=1, enable_fp_fusion=False,
    )
    stat = torch.empty((2, NG), dtype=torch.float32, device=x.device)
    eps_k = _eps_for_kernel(x.dtype, eps) if eps_override is None else float(eps_override)
    launch(_gn_stats_out_kernel, (NG,),
        ws, stat[0], stat[1], NG * W, eps_k, W=W, CMB_MEAN_FMA=v["CMB_MEAN_FMA"],
        CMB_M2_MODE=v["CMB_M2_MODE"], RSQ=v["RSQ"], num_warps=1, enable_fp_fusion=False,
    )
    return stat


# ----------------------------------------------------------------------------- validation


def _unsupported_reason(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu: bool,
) -> str | None:
    """Why the kernels do not reproduce eager for these arguments (None when they do)."""
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() < 2:
        return f"input must be [N, C, *spatial], got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32; fp64 accumulates in double)"
    if x.device.type == "cuda":
        pass
    elif x.device.type == "cpu" and interpreter_on():
        pass
    else:
        return f"device {x.device} not supported (CUDA; CPU only under TRITON_INTERPRET=1)"
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        return f"num_groups must be a positive int, got {num_groups!r}"
    C = x.shape[1]
    if C % num_groups != 0:
        return f"C={C} is not divisible by num_groups={num_groups} (torch raises)"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
        if t.dim() != 1 or t.numel() != C:
            return f"{name} must be a [C={C}] vector, got shape {tuple(t.shape)} (torch raises)"
        if t.dtype != x.dtype:
            return (
                f"{name} dtype {t.dtype} != input dtype {x.dtype}: the CUDA kernel reads the "
                "parameters as the input dtype (mixed types are the CPU kernel's path); not reproduced"
            )
        if t.device != x.device:
            return f"{name} is on {t.device}, input on {x.device}"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(float(eps)):
        return f"eps must be a finite float, got {eps!r}"
    if not isinstance(silu, bool):
        return f"silu must be a bool, got {type(silu).__name__}"
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, bias)
    ):
        return "an input requires grad and grad mode is on (the kernels have no backward)"
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on: eager casts group_norm's inputs to fp32 (another chain)"
    return None


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("ditfuse::group_norm_silu", mutates_args=())
def _group_norm_silu_op(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, silu: bool,
) -> torch.Tensor:
    return _launch(x, num_groups, weight, bias, eps, silu, exact=True)


@_group_norm_silu_op.register_fake
def _(x, num_groups, weight, bias, eps, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("ditfuse::group_norm_silu_fp32", mutates_args=())
def _group_norm_silu_fp32_op(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, silu: bool,
) -> torch.Tensor:
    return _launch(x, num_groups, weight, bias, eps, silu, exact=False)


@_group_norm_silu_fp32_op.register_fake
def _(x, num_groups, weight, bias, eps, silu):
    if _cl_path(x, num_groups):
        return torch.empty_like(x)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _cl_out_fake(x, num_groups, weight, bias, eps, silu):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


@torch.library.custom_op("ditfuse::group_norm_silu_cl", mutates_args=())
def _group_norm_silu_cl_op(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float, silu: bool,
) -> torch.Tensor:
    return _launch_cl_out(x, num_groups, weight, bias, eps, silu)


_group_norm_silu_cl_op.register_fake(_cl_out_fake)



# ----------------------------------------------------------------------------- public API


def can_use_group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> bool:
    """True when :func:`group_norm_silu` reproduces eager bit for bit for these arguments (the
    same test guards :func:`group_norm_silu_fp32`).

    Rejected (False), each with the reason torch takes another path or the input is outside
    the contract:

    - x not a tensor, fewer than 2 dims, or a dtype other than bf16 / fp16 / fp32 (fp64 runs
      the kernel with double accumulation, not reproduced);
    - not on CUDA (on the CPU only under TRITON_INTERPRET=1, for the tests): the contract is
      CUDA eager;
    - num_groups not a positive int, or C not divisible by it (torch raises);
    - weight / bias not a ``[C]`` tensor (torch raises), on another device, or of another dtype
      than x: torch's CUDA kernel reads gamma/beta as the input dtype (the mixed-type handling
      of native_group_norm serves the CPU kernel), so that case is not reproduced;
    - eps not a finite real number; silu not a bool;
    - an input requiring grad with grad mode on (no backward);
    - CUDA autocast enabled: eager runs group_norm in fp32 under autocast, another chain.

    Accepted and exact: any strides (non-contiguous and channels-last inputs are made
    contiguous first, as native_group_norm does on CUDA), any spatial rank including HxW == 1
    (GroupNorm1dForward's epilogue), weight and/or bias None, empty tensors.
    """
    return _unsupported_reason(x, num_groups, weight, bias, eps, silu) is None


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> torch.Tensor:
    """``out = r(silu(r(GN(x))))`` (``silu=True``) or ``out = r(GN(x))``, bit-exact vs torch 2.11
    CUDA eager ``F.silu(F.group_norm(x, num_groups, weight, bias, eps))`` /
    ``F.group_norm(...)``. Raises UnsupportedInput where :func:`can_use_group_norm_silu` is False.
    Returns a new NCHW-contiguous tensor."""
    reason = _unsupported_reason(x, num_groups, weight, bias, eps, silu)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.group_norm_silu(x, num_groups, weight, bias, float(eps), silu)
    return _launch(x, num_groups, weight, bias, float(eps), silu, exact=True)


def can_use_group_norm_silu_fp32(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> bool:
    """True when :func:`group_norm_silu_fp32` handles these arguments (the same rejections as
    :func:`can_use_group_norm_silu`)."""
    return _unsupported_reason(x, num_groups, weight, bias, eps, silu) is None


def group_norm_silu_fp32(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> torch.Tensor:
    """Close (quality="high"): ``out = r(silu(GN32(x)))`` with one rounding (``r(GN32(x))`` when
    ``silu`` is False), fp32 statistics by Chan-merged tiles. Not bit-exact vs eager. A
    channels-last x (or any x with its channels innermost, e.g. ``[N, L, C]`` rows viewed as
    ``[N, C, L]``) with C and C/G powers of two is read in place and the output keeps its layout;
    every other x is made contiguous and the output is NCHW. Raises UnsupportedInput where
    :func:`can_use_group_norm_silu_fp32` is False."""
    reason = _unsupported_reason(x, num_groups, weight, bias, eps, silu)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.group_norm_silu_fp32(x, num_groups, weight, bias, float(eps), silu)
    return _launch(x, num_groups, weight, bias, float(eps), silu, exact=False)


def _cl_out_reason(x, num_groups, weight, bias, eps, silu) -> str | None:
    r = _unsupported_reason(x, num_groups, weight, bias, eps, silu)
    if r is None and x.dim() != 4:
        return f"a channels-last output needs a 4-D [N, C, H, W] input, got {x.dim()}-D"
    return r


def can_use_group_norm_silu_cl(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float = 1e-6, silu: bool = True,
) -> bool:
    """True when :func:`group_norm_silu_cl` takes these arguments: those
    of :func:`can_use_group_norm_silu` with a 4-D x."""
    return _cl_out_reason(x, num_groups, weight, bias, eps, silu) is None


def group_norm_silu_cl(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
    eps: float = 1e-6, silu: bool = True,
) -> torch.Tensor:
    """:func:`group_norm_silu` (``out = r(silu(r(GN(x))))``, bit-exact vs torch 2.11 CUDA eager:
    the same statistics kernels, the same epilogue arithmetic) with the output written
    channels-last, for a convolution to read without cuDNN's NCHW -> NHWC transpose. The values
    are eager's; the layout is the op's own. Raises UnsupportedInput where
    :func:`can_use_group_norm_silu_cl` is False."""
    reason = _cl_out_reason(x, num_groups, weight, bias, eps, silu)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.group_norm_silu_cl(x, num_groups, weight, bias, float(eps), silu)
    return _launch_cl_out(x, num_groups, weight, bias, float(eps), silu)


__all__ = [
    "group_norm_silu_cl",
    "can_use_group_norm_silu_cl",
    "group_norm_silu",
    "can_use_group_norm_silu",
    "group_norm_silu_fp32",
    "can_use_group_norm_silu_fp32",
]
