"""diffusers' WanRMS_norm (+ the SiLU after it), bit-exact vs torch 2.11 CUDA eager, in one pass.

``wan_rms_norm_silu(x, gamma, bias=0.0, silu=True)`` (AutoencoderKLWan; x ``[B, C, *spatial]``,
normalised over the channels)::

    x32 = x.float()                                    (x itself for fp32)
    n   = r(x32 / max(||x32||_2 over C, 1e-12))         F.normalize(..., dim=1).to(x.dtype)
    y   = r(r(r(n * float(sqrt(C))) * gamma) + bias)    "* self.scale * self.gamma + self.bias"
    out = r(silu(y))                                   (silu=True; nn.SiLU)  /  y  (silu=False)

``r`` rounds to x's dtype where an eager op stores; ``bias`` is the float 0.0 of
``WanRMS_norm(bias=False)`` (still an op: it turns -0 into +0) or a ``[C, 1, ...]`` tensor. Eager
runs 9 kernels for this (cast, norm reduction, clamp_min, div, cast, 3 elementwise, SiLU) and
moves ~38 bytes per bf16 element; this kernel reads x once (plus an L2 re-read) and writes once.

The norm reproduces ``gpu_reduce_kernel<NormTwoOps>`` (aten/src/ATen/native/cuda/Reduce.cuh) for a
reduction over the strided channel dim (notes/wan_vae.md): the host replicates
``setReduceConfig`` to get the block height ``bh`` and whether the channels are split across it;
thread y of bh walks channels ``y, y + H, ...`` (H = bh, or 1 without the split) with 4
interleaved accumulators (channel c -> accumulator ``(c // H) % 4``, ``fma(v, v, acc)``), combines
them ``((a0 + a1) + a2) + a3``, the bh partials fold at offsets bh/2..1, then ``sqrt.rn``. Here a
``[4H, BP]`` tile holds exactly those 4H chains for BP positions, channel block after channel block,
and the two folds are spelled out. ``clamp_min`` keeps NaN, division is ``div.rn``, every later op
rounds like eager; launched with ``enable_fp_fusion=False``. Channels-last inputs take
``_wan_rms_cl_kernel`` by default: the same chains with positions as the tile rows (each row 4H
contiguous channels), so its loads and stores are runs of contiguous channels (``CL_VARIANT``).

``EXACT`` False (``wan_rms_norm_silu_fp32``, quality="high"): fp32 sum of squares in any order,
``y = x * (sqrt(C) / max(norm, 1e-12)) * gamma + bias`` and SiLU in fp32, one rounding.

See :func:`can_use_wan_rms_norm_silu` for every rejection.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.elementwise import load_f32
from ditfuse.kernels.common.host import cdiv, interpreter_on, next_pow2, use_custom_op
from ditfuse.kernels.common.rounding import round_to, rround
from ditfuse.kernels.common.welford_ops import fma_exact
from ditfuse.kernels.env import env
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.layout.pad_channels_last_triton import padded_channels_last
from ditfuse.kernels.norm.group_norm_silu_triton import _silu
from ditfuse.kernels.reference import channels_last_format, dense_channels_last
from ditfuse.kernels.common.launch import launch

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
VT0 = 4  # gpu_reduce_kernel's accumulators per thread
MAX_H = 16  # largest channel split handled (bh <= 16 covers every shape with >= 32 outputs)
NORM_EPS = 1e-12  # F.normalize's default
# (chain blocks per step, positions per program, warps) for channels-last inputs: the launch
# bench/probes/probe_wan_rms_cl_tiling.py picked on the H200 (notes/wan_vae.md)
CL_LAUNCH = (2, 32, 8)
# which exact kernel takes channels-last inputs (DITFUSE_WAN_RMS_CL overrides): "pos"
# (_wan_rms_cl_kernel, positions as tile rows) or "chain" (_wan_rms_kernel, chains as tile rows);
# and "pos"'s (positions per program, channels per output step, warps). H100, round 21
# (bench/probes/probe_wan_rms_cost.py, probe_wan_rms_cost_round21_h100.csv): at the Wan 2.1
# decoder's 480x832 / 240x416 / 120x208 shapes 0.368 / 0.188 / 0.080 ms against the chain
# kernel's 0.525 / 0.248 / 0.079 (a copy of the same bytes: 0.204 / 0.103 / 0.027)
CL_VARIANT = "pos"
CL_POS_LAUNCH = (64, 32, 8)


@functools.lru_cache(maxsize=64)
def _sqrt_c_f32(C: int) -> float:
    """``float(C ** 0.5)`` rounded to fp32 (the CPU scalar eager multiplies by, in fp32 opmath)."""
    return float(torch.tensor(C ** 0.5, dtype=torch.float64).float())


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def reduce_layout(B: int, C: int, S: int, elem_offset: int = 0,
                  vec_divides: tuple[int, ...] | None = None) -> tuple[int, bool, int, int]:
    """What ``setReduceConfig`` (torch 2.11, sm_90: 512 max threads, warp 32) picks for the norm
    over C of an fp32 tensor with ``B * S`` output positions: returns
    ``(H, split, bh, values_per_thread)`` with H = bh when the channels are split over the
    block's bh warps, else 1. ``get_output_vec_size`` (4, halved until it divides the base
    element offset, the size of the iterator's first output dim and every other input stride)
    is computed from ``vec_divides``; the default is a contiguous ``[B, C, S]`` tensor."""
    vec = 4
    for n in (elem_offset, *(vec_divides if vec_divides is not None else (S, S * C))):
        while n % vec:
            vec //= 2
    max_threads = 512 // vec
    dim0 = (B * S) // vec
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(C) if C < max_threads else max_threads
    bw = min(d0, 32)
    bh = min(d1, max_threads // bw)
    split = C >= min(bh * 16, 256)
    H = bh if split else 1
    return H, split, bh, -(-C // H)


def channels_last(x: torch.Tensor) -> bool:
    """x is dense channels-last(-3d) memory and not also contiguous (the channels-last decode's)."""
    return channels_last_format(x) is not None


def _geometry(x: torch.Tensor, ncdhw: bool = False) -> tuple[int, int, int, int, int, int, int, int, tuple[int, ...]] | None:
    """(B, C, T, HW, sB, sC, sT, sP, vec_divides) for the layouts handled: contiguous
    ``[B, C, *spatial]`` (T = 1, HW = all spatial), the 5-D ``[B, C, T, H, W]`` view of
    ``[B, T, C, H, W]`` memory that WanResample's ``permute(0, 2, 1, 3, 4)`` returns, and
    channels-last(-3d) with ``ncdhw`` (channels innermost: ``sC = 1``, positions ``sP = C``
    apart; reduced in the contiguous layout's order). None for anything else (a channels-last x
    without ``ncdhw`` is eager's own channels-last chain, whose reduction runs along the fastest
    dim: another order, not reproduced). ``vec_divides`` follows TensorIterator's dim coalescing for the layout whose
    order is reproduced (the reduced C first, then output dims by stride, adjacent dims merged
    when their strides allow); for channels-last that is the contiguous layout (see
    :func:`wan_rms_norm_silu`)."""
    B, C = x.shape[0], x.shape[1]
    if x.is_contiguous():
        S = x.numel() // max(B * C, 1)
        return B, C, 1, S, C * S, S, S, 1, (S, S * C)
    if ncdhw and channels_last(x):
        S = x.numel() // max(B * C, 1)
        return B, C, 1, S, C * S, 1, C * S, C, (S, S * C)
    if x.dim() != 5:
        return None
    _, _, T, Hh, Ww = x.shape
    HW = Hh * Ww
    sb, sc, st, sh, sw = x.stride()
    if (sw, sh, sc, st) == (1, Ww, HW, C * HW) and (B == 1 or sb == T * C * HW):
        # iterator dims [C, HW, T (x B merged)]: vec divides HW, C's stride HW, T's stride C*HW
        return B, C, T, HW, sb, sc, st, 1, (HW, HW, C * HW)
    return None


def _tmajor_divides(x: torch.Tensor) -> tuple[int, ...]:
    """``vec_divides`` of the T-major ``[B, C, T, H, W]`` layout of x's shape."""
    return (x.shape[3] * x.shape[4],) * 2 + (x.shape[1] * x.shape[3] * x.shape[4],)


@triton.jit
def _split4(a, H: tl.constexpr, BP: tl.constexpr):
    """[H, BP, 4] -> the four [H, BP] slices along the last axis (index 0, 1, 2, 3)."""
    a = tl.reshape(a, [H, BP, 2, 2])  # last index i = 2 * hi + lo
    even, odd = tl.split(a)  # lo = 0 (i = 0, 2), lo = 1 (i = 1, 3)
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    return a0, a1, a2, a3


@triton.jit
def _fold_half_rows(p, h: tl.constexpr, BP: tl.constexpr):
    """[h, BP] -> [h/2, BP]: row y adds row y + h/2 (one block_y_reduce step)."""
    lo, hi = tl.split(tl.permute(tl.reshape(p, [2, h // 2, BP]), (1, 2, 0)))
    return lo + hi


@triton.jit
def _fold_threads(p, H: tl.constexpr, BP: tl.constexpr):
    """block_y_reduce: [H, BP] -> [BP]; at offset o = H/2, ..., 1 row y (< o) adds row y + o."""
    if H >= 16:
        p = _fold_half_rows(p, 16, BP)
    if H >= 8:
        p = _fold_half_rows(p, 8, BP)
    if H >= 4:
        p = _fold_half_rows(p, 4, BP)
    if H >= 2:
        p = _fold_half_rows(p, 2, BP)
    return tl.reshape(p, [BP])


@triton.jit
def _clamped_norm(ssq, eps):
    """``clamp_min(sqrt(ssq), eps)`` as eager: ``sqrt.rn``, and a clamp that keeps NaN."""
    norm = tl.math.sqrt_rn(ssq)
    eps32 = tl.cast(eps, tl.float32)  # the interpreter keeps Python floats in fp64
    return tl.where(norm != norm, norm, tl.where(norm < eps32, eps32, norm))


@triton.jit
def _exact_tail(x, d, scale32, gam, bet, DTYPE: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr):
    """Eager's chain after the norm, each stored op rounded to DTYPE: ``n = r(x / d)``,
    ``r(r(n * sqrt(C)) * gamma)``, ``+ bias`` (the float 0.0: ``-0 -> +0`` and no rounding, the
    operand already being of DTYPE), the SiLU; returns the value stored."""
    n = rround(tl.math.div_rn(x, d), DTYPE)
    y = rround(n * scale32, DTYPE)
    y = rround(y * gam, DTYPE)
    if HAS_B:
        y = rround(y + bet, DTYPE)
    else:
        y = y + 0.0
    if SILU:
        y = _silu(y, 0, 0)
    return round_to(y, DTYPE)


@triton.jit
def _padded_offsets(p, pmask, sP, FHW, W, PT, PH, PW, oT, oH, KT0, kT):
    """Position p (``t * FHW + hw`` of a channels-last x, positions ``sP`` elements apart) in the
    padded output (offset from its sample's base: frame t + PT, row h + PH, column w + PW) and in
    the kept frames (offset, and whether p is kept: ``t >= KT0``)."""
    t = p // FHW  # FHW = H*W of one frame (the channels-last geometry folds T into HW)
    hw = p - t * FHW
    hh = hw // W
    ooff = (t + PT).to(tl.int64) * oT + (hh + PH).to(tl.int64) * oH + (hw - hh * W + PW).to(tl.int64) * sP
    koff = (t - KT0).to(tl.int64) * kT + hw.to(tl.int64) * sP
    return ooff, pmask & (t >= KT0), koff


@triton.jit(do_not_specialize=["C", "T", "NBLK", "scale", "eps"])
def _wan_rms_kernel(
    x_ptr, g_ptr, b_ptr, pb_ptr, out_ptr, k_ptr, C, T, HW, sB, sC, sT, sP, NBLK, scale, eps,
    oB, oT, oH, W, FHW, PT, PH, PW, KT0, kB, kT,
    DTYPE: tl.constexpr, H: tl.constexpr, BP: tl.constexpr, EXACT: tl.constexpr,
    HAS_B: tl.constexpr, SILU: tl.constexpr, TMAJOR: tl.constexpr, KSUB: tl.constexpr,
    OUTPAD: tl.constexpr, HAS_PB: tl.constexpr, KEEP: tl.constexpr,
):
    """Program (b, j): positions ``j*BP ..`` of sample b (over T x HW), all channels (two passes).
    Element (b, c, t, hw) is at ``b*sB + c*sC + t*sT + hw`` (TMAJOR) or position p = t*HW + hw at
    ``b*sB + c*sC + p*sP``, in x and in out alike (channels-last: sC = 1, sP = C).

    Each step loads KSUB chain blocks of 4H channels (``[KSUB*4H, BP]``) and adds them to the
    chains in channel order: KSUB = 4 for channels-last, where a step then reads 64+ contiguous
    channels (whole cache lines) per position instead of 16.

    OUTPAD (channels-last only): out is a larger channels-last buffer (strides oB, oT, oH, C) and
    position (t, h, w) goes to (t + PT, h + PH, w + PW): the interior of a causal convolution's
    zero-padded input; W and FHW are a frame's width and H*W.

    KEEP (with OUTPAD): frames ``t >= KT0`` are also stored, a second time, into the dense
    channels-last ``[B, C, T - KT0, H, W]`` buffer at k_ptr (sample stride kB, frame stride kT):
    the frames a causal convolution caches for the next chunk (eager: ``x[:, :, -2:].clone()``).

    HAS_PB: x is a convolution's output before its bias (aten adds a cuDNN convolution's bias
    in a separate ``add_``): the kernel's input is ``r(x + pb[c])``, formed at each load."""
    R: tl.constexpr = 4 * H
    RK: tl.constexpr = KSUB * R
    bi = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = p < T * HW
    if TMAJOR:
        poff = (p // HW).to(tl.int64) * sT + p % HW
    else:
        poff = p.to(tl.int64) * sP  # positions evenly spaced: 1 (contiguous) or C (channels-last)
    base = x_ptr + bi * sB
    if OUTPAD:
        ooff, kept, koff = _padded_offsets(p, pmask, sP, FHW, W, PT, PH, PW, oT, oH, KT0, kT)
        obase = out_ptr + bi * oB
        kbase = k_ptr + bi * kB
    else:
        ooff = poff
        obase = out_ptr + bi * sB
    rows = tl.arange(0, RK)
    rows_r = tl.arange(0, R)
    acc = tl.zeros([R, BP], dtype=tl.float32)
    blk = 0
    while blk < NBLK:
        for k in tl.static_range(KSUB):  # sub-block k: channels blk*RK + k*R + r, chain r's next term
            c = blk * RK + k * R + rows_r
            cm = c < C
            m = cm[:, None] & pmask[None, :]
            v = load_f32(base + c.to(tl.int64)[:, None] * sC + poff[None, :], m)  # missing channels: +0
            if HAS_PB:
                v = tl.where(m, rround(v + load_f32(pb_ptr + c, cm)[:, None], DTYPE), 0.0)
            if EXACT:
                acc = fma_exact(v, v, acc)
            else:
                acc = acc + v * v
        blk += 1
    if EXACT:
        # row r = i * H + y: thread y's accumulator i; combine ((a0 + a1) + a2) + a3, then fold y
        a0, a1, a2, a3 = _split4(tl.permute(tl.reshape(acc, [4, H, BP]), (1, 2, 0)), H, BP)
        ssq = _fold_threads(((a0 + a1) + a2) + a3, H, BP)
    else:
        ssq = tl.sum(acc, axis=0)
    d = _clamped_norm(ssq, eps)
    scale32 = tl.cast(scale, tl.float32)
    if not EXACT:
        f = scale32 / d
    blk = 0
    while blk < NBLK:
        c = blk * RK + rows
        cm = c < C
        m = cm[:, None] & pmask[None, :]
        offs = c.to(tl.int64)[:, None] * sC + poff[None, :]
        x = load_f32(base + offs, m)
        if HAS_PB:
            x = rround(x + load_f32(pb_ptr + c, cm)[:, None], DTYPE)
        gam = load_f32(g_ptr + c, cm)[:, None]
        if HAS_B:
            bet = load_f32(b_ptr + c, cm)[:, None]
        else:
            bet = tl.zeros([RK, 1], dtype=tl.float32)
        if EXACT:
            yr = _exact_tail(x, d[None, :], scale32, gam, bet, DTYPE, HAS_B, SILU)
        else:
            y = x * f[None, :] * gam + bet
            if SILU:
                y = _silu(y, 0, 0)
            yr = round_to(y, DTYPE)
        tl.store(obase + c.to(tl.int64)[:, None] * sC + ooff[None, :], yr, mask=m)
        if OUTPAD:
            if KEEP:
                tl.store(kbase + c.to(tl.int64)[:, None] + koff[None, :], yr, mask=m & kept[None, :])
        blk += 1


@triton.jit
def _fold_half_cols(p, h: tl.constexpr, BP: tl.constexpr):
    """[BP, h] -> [BP, h/2]: column y adds column y + h/2 (one block_y_reduce step)."""
    lo, hi = tl.split(tl.permute(tl.reshape(p, [BP, 2, h // 2]), (0, 2, 1)))
    return lo + hi


@triton.jit
def _fold_chains_pos_major(acc, H: tl.constexpr, BP: tl.constexpr):
    """[BP, 4H] chains -> [BP] sums of squares. Column r = i * H + y is thread y's accumulator i:
    ``((a0 + a1) + a2) + a3`` per thread, then block_y_reduce at offsets H/2, ..., 1."""
    a = tl.reshape(tl.permute(tl.reshape(acc, [BP, 4, H]), (0, 2, 1)), [BP, H, 2, 2])  # i = 2 * hi + lo
    even, odd = tl.split(a)  # lo = 0 (i = 0, 2), lo = 1 (i = 1, 3)
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    p = ((a0 + a1) + a2) + a3
    if H >= 16:
        p = _fold_half_cols(p, 16, BP)
    if H >= 8:
        p = _fold_half_cols(p, 8, BP)
    if H >= 4:
        p = _fold_half_cols(p, 4, BP)
    if H >= 2:
        p = _fold_half_cols(p, 2, BP)
    return tl.reshape(p, [BP])


@triton.jit(do_not_specialize=["scale", "eps"])
def _wan_rms_cl_kernel(
    x_ptr, g_ptr, b_ptr, pb_ptr, out_ptr, k_ptr, C, S, sB, scale, eps,
    oB, oT, oH, W, FHW, PT, PH, PW, KT0, kB, kT,
    DTYPE: tl.constexpr, H: tl.constexpr, BP: tl.constexpr, CK: tl.constexpr,
    HAS_B: tl.constexpr, SILU: tl.constexpr, OUTPAD: tl.constexpr, HAS_PB: tl.constexpr,
    KEEP: tl.constexpr, EVEN_C: tl.constexpr, EVEN_P: tl.constexpr,
):
    """The channels-last (``sC = 1``, positions ``C`` apart) exact kernel, position-major: program
    (b, j) holds positions ``j*BP ..`` as the rows of ``[BP, 4H]`` chain tiles (each row 4H
    contiguous channels) and ``[BP, CK]`` output tiles, so every load and store is a run of
    contiguous channels and no tile is smaller than the program's threads. Same chains, folds,
    roundings and outputs as :func:`_wan_rms_kernel` (OUTPAD / KEEP / HAS_PB as there).

    C is specialised (not ``do_not_specialize``): the channel masks then have a known constancy
    and the loads vectorise; EVEN_C / EVEN_P drop the masks where the tiles divide the shape."""
    R: tl.constexpr = 4 * H
    bi = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BP + tl.arange(0, BP)
    pmask = p < S
    poff = p.to(tl.int64) * C
    base = x_ptr + bi * sB
    if OUTPAD:
        ooff, kept, koff = _padded_offsets(p, pmask, C, FHW, W, PT, PH, PW, oT, oH, KT0, kT)
        obase = out_ptr + bi * oB
        kbase = k_ptr + bi * kB
    else:
        ooff = poff
        obase = out_ptr + bi * sB
    cr = tl.arange(0, R)
    acc = tl.zeros([BP, R], dtype=tl.float32)
    c0 = 0
    while c0 < C:  # chain block after chain block: column r gets channel c0 + r
        c = c0 + cr
        if EVEN_C and EVEN_P:
            v = load_f32(base + poff[:, None] + c[None, :], None)
        else:
            m = pmask[:, None] & (c < C)[None, :]
            v = load_f32(base + poff[:, None] + c[None, :], m)  # missing channels: +0
        if HAS_PB:
            if EVEN_C:
                pbv = load_f32(pb_ptr + c, None)
            else:
                pbv = load_f32(pb_ptr + c, c < C)
            v = rround(v + pbv[None, :], DTYPE)
            if not (EVEN_C and EVEN_P):
                v = tl.where(m, v, 0.0)
        acc = fma_exact(v, v, acc)
        c0 += R
    ssq = _fold_chains_pos_major(acc, H, BP)
    d = _clamped_norm(ssq, eps)[:, None]
    scale32 = tl.cast(scale, tl.float32)
    ck = tl.arange(0, CK)
    c0 = 0
    while c0 < C:
        c = c0 + ck
        if EVEN_C:
            cm = None
            x = load_f32(base + poff[:, None] + c[None, :], None if EVEN_P else pmask[:, None])
            gam = load_f32(g_ptr + c, None)[None, :]
        else:
            cm = c < C
            x = load_f32(base + poff[:, None] + c[None, :], pmask[:, None] & cm[None, :])
            gam = load_f32(g_ptr + c, cm)[None, :]
        if HAS_PB:
            x = rround(x + load_f32(pb_ptr + c, cm)[None, :], DTYPE)
        if HAS_B:
            bet = load_f32(b_ptr + c, cm)[None, :]
        else:
            bet = gam  # not read
        yr = _exact_tail(x, d, scale32, gam, bet, DTYPE, HAS_B, SILU)
        if EVEN_C and EVEN_P:
            sm = None
        elif EVEN_C:
            sm = pmask[:, None]
        else:
            sm = pmask[:, None] & cm[None, :]
        tl.store(obase + ooff[:, None] + c[None, :], yr, mask=sm)
        if OUTPAD:
            if KEEP:
                km = kept[:, None] if sm is None else (sm & kept[:, None])
                tl.store(kbase + koff[:, None] + c[None, :], yr, mask=km)
        c0 += CK


def _launch(x: torch.Tensor, gamma: torch.Tensor, bias, silu: bool, exact: bool = True,
            block_positions: int | None = None, ncdhw: bool = False,
            pad: tuple[int, ...] | None = None, pre_bias: torch.Tensor | None = None,
            ksub: int | None = None, num_warps: int | None = None,
            cache: torch.Tensor | None = None, kept: torch.Tensor | None = None,
            variant: str | None = None, pos_launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Run the kernel (checks are the predicate's). The output has x's strides, as eager's chain
    (x.float(), the division and every later op keep a dense input's layout); with ``pad``
    (channels-last 5-D x), it is the zero-padded channels-last buffer ``F.pad(cat([cache, out], 2),
    pad less cache's frames in front)``, and ``kept`` (a dense channels-last ``[B, C, k, H, W]``
    buffer, k <= T) receives out's last k frames."""
    out = torch.empty_like(x) if pad is None else padded_channels_last(x.shape, pad, x.dtype, x.device, cache)
    if x.numel() == 0:
        return out
    geo = _geometry(x, ncdhw)
    assert geo is not None, "rejected by can_use_wan_rms_norm_silu"
    B, C, T, HW, sB, sC, sT, sP, vdiv = geo
    assert pad is not None or out.stride() == x.stride()
    if pad is not None:
        assert sC == 1 and x.dim() == 5
        oB, _, oT, oH, _ = out.stride()
        PT, PH, PW, Wd, FHW = pad[4], pad[2], pad[0], x.shape[4], x.shape[3] * x.shape[4]
    else:
        oB = oT = oH = PT = PH = PW = 0
        Wd = FHW = 1
    keep = 0 if kept is None else kept.shape[2]
    assert keep == 0 or (pad is not None and keep <= x.shape[2])
    off = x.storage_offset() % 4 if x.dtype == torch.float32 else 0  # bf16/fp16: fresh x.float()
    H = reduce_layout(B, C, T * HW, off, vdiv)[0] if exact else 4
    assert H <= MAX_H, "rejected by can_use_wan_rms_norm_silu"
    R = 4 * H
    S = T * HW
    cl = sC == 1 and C > 1
    if ksub is None:
        ksub = CL_LAUNCH[0] if cl else 1  # channels-last: several chain blocks (cache lines) per step
    if num_warps is None:
        num_warps = CL_LAUNCH[2] if cl else 4
    BP = block_positions or (max(16, min(next_pow2(S), CL_LAUNCH[1])) if cl
                             else max(16, min(next_pow2(S), 2048 // R)))
    has_b = isinstance(bias, torch.Tensor)
    g = gamma.reshape(C).contiguous()
    b = bias.reshape(C).contiguous() if has_b else g
    scale = _sqrt_c_f32(C)
    pb = pre_bias.reshape(C).contiguous() if pre_bias is not None else g
    kT = FHW * C
    if cl and exact and (variant or env("DITFUSE_WAN_RMS_CL", CL_VARIANT)) == "pos":
        bp, ck, nw = pos_launch or CL_POS_LAUNCH
        launch(_wan_rms_cl_kernel, (B, cdiv(S, bp)),
            x, g, b, pb, out, kept if keep else out, C, S, sB, scale,
            NORM_EPS, oB, oT, oH, Wd, FHW, PT, PH, PW, x.shape[2] - keep if keep else 0, keep * kT, kT,
            DTYPE=_DTYPES[x.dtype], H=H, BP=bp, CK=ck, HAS_B=has_b, SILU=bool(silu), OUTPAD=pad is not None,
            HAS_PB=pre_bias is not None, KEEP=keep > 0, EVEN_C=C % R == 0 and C % ck == 0, EVEN_P=S % bp == 0,
            num_warps=nw, enable_fp_fusion=False, enable_reflect_ftz=False,
        )
        return out
    launch(_wan_rms_kernel, (B, cdiv(S, BP)),
        x, g, b, pb, out, kept if keep else out, C, T, HW, sB, sC, sT, sP, cdiv(C, ksub * R), scale,
        NORM_EPS, oB, oT, oH, Wd, FHW, PT, PH, PW, x.shape[2] - keep if keep else 0, keep * kT, kT,
        DTYPE=_DTYPES[x.dtype], H=H, BP=BP, EXACT=exact, HAS_B=has_b, SILU=bool(silu),
        TMAJOR=(T > 1 and sT != HW), KSUB=ksub, OUTPAD=pad is not None, HAS_PB=pre_bias is not None,
        KEEP=keep > 0,
        num_warps=num_warps, enable_fp_fusion=not exact, enable_reflect_ftz=False,
    )
    return out


def _unsupported_reason(x, gamma, bias, silu, ncdhw=False) -> str | None:
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() < 3:
        return f"input must be [B, C, *spatial] with at least one spatial dim, got {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if x.device.type == "cuda":
        pass
    elif not (x.device.type == "cpu" and interpreter_on()):
        return f"device {x.device} not supported (CUDA; CPU only under TRITON_INTERPRET=1)"
    if _geometry(x, ncdhw) is None:
        return ("input layout neither contiguous, channels-last with ncdhw=True nor WanResample's [B, T, C, H, W] memory: x.float() "
                "keeps its strides and the norm's reduce kernel would iterate another way (not reproduced)")
    if x.numel() >= 2**31:
        return "input has >= 2^31 elements: the reduce kernel splits into 32-bit sub-iterators (not reproduced)"
    C = x.shape[1]
    if not isinstance(gamma, torch.Tensor) or gamma.numel() != C or gamma.shape[0] != C:
        return f"gamma must be a [C={C}, 1, ...] tensor"
    if gamma.dtype != x.dtype or gamma.device != x.device:
        return f"gamma {gamma.dtype}/{gamma.device} must match the input {x.dtype}/{x.device} (eager would promote)"
    if isinstance(bias, torch.Tensor):
        if bias.numel() != C or bias.shape[0] != C or bias.dtype != x.dtype or bias.device != x.device:
            return "bias tensor must be [C, 1, ...] with the input's dtype and device"
    elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or float(bias) != 0.0:
        return f"bias must be the float 0.0 (WanRMS_norm(bias=False)) or a [C] tensor, got {bias!r}"
    if not isinstance(silu, bool) or not isinstance(ncdhw, bool):
        return "silu and ncdhw must be bools"
    B, _, T, HW, _, _, _, _, vdiv = _geometry(x, ncdhw)
    off = x.storage_offset() % 4 if x.dtype == torch.float32 else 0
    H, split, bh, vpt = reduce_layout(B, C, T * HW, off, vdiv)
    if ncdhw and channels_last(x) and x.dim() == 5 and x.shape[2] > 1 and \
            reduce_layout(B, C, T * HW, off, _tmajor_divides(x))[0] != H:
        return ("channels-last input whose contiguous and T-major NCDHW layouts reduce in different orders "
                "(H*W not a multiple of 4): which one the NCDHW decoder had is not known here")
    if H > MAX_H:
        return f"the reduce kernel would split the channels over {H} warps (few outputs); only <= {MAX_H} reproduced"
    if split and vpt >= 256:
        return "the reduce kernel would split each norm across thread blocks (global reduce; not reproduced)"
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, gamma, bias)):
        return "an input requires grad and grad mode is on (no backward)"
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on (eager would run another chain)"
    return None


@torch.library.custom_op("ditfuse::wan_rms_norm_silu", mutates_args=())
def _wan_rms_norm_silu_op(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                          ncdhw: bool) -> torch.Tensor:
    return _launch(x, gamma, 0.0 if bias is None else bias, silu, exact=True, ncdhw=ncdhw)


@_wan_rms_norm_silu_op.register_fake
def _(x, gamma, bias, silu, ncdhw):
    return torch.empty_like(x)


@torch.library.custom_op("ditfuse::wan_rms_norm_silu_fp32", mutates_args=())
def _wan_rms_norm_silu_fp32_op(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                               ncdhw: bool) -> torch.Tensor:
    return _launch(x, gamma, 0.0 if bias is None else bias, silu, exact=False, ncdhw=ncdhw)


@_wan_rms_norm_silu_fp32_op.register_fake
def _(x, gamma, bias, silu, ncdhw):
    return torch.empty_like(x)


def can_use_wan_rms_norm_silu(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0,
                              silu: bool = True, ncdhw: bool = False) -> bool:
    """True when :func:`wan_rms_norm_silu` reproduces eager bit for bit.

    Rejected (False): not a tensor / fewer than 3 dims / dtype other than bf16, fp16, fp32; not
    on CUDA (CPU only under TRITON_INTERPRET=1); a layout other than contiguous, the
    ``[B, C, T, H, W]`` view of ``[B, T, C, H, W]`` memory that WanResample returns, or
    channels-last with ``ncdhw=True`` (``x.float()`` keeps the strides, so another layout makes
    the norm's reduction iterate another way); with ``ncdhw``, a 5-D channels-last x whose
    contiguous and T-major layouts would reduce in different orders; >= 2^31 elements
    (the reduction is split into 32-bit sub-iterators); gamma / bias not ``[C, ...]`` or of
    another dtype/device (eager would promote); a bias that is neither 0.0 nor a tensor; shapes
    for which torch's reduce config splits the channels over more than 16 warps (fewer than ~32
    output positions) or across thread blocks (a global reduction); grad required with grad mode
    on; CUDA autocast on."""
    return _unsupported_reason(x, gamma, bias, silu, ncdhw) is None


def wan_rms_norm_silu(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0,
                      silu: bool = True, ncdhw: bool = False) -> torch.Tensor:
    """``r(silu(WanRMS_norm(x)))`` (or ``WanRMS_norm(x)`` with silu=False), bit-exact vs torch 2.11
    CUDA eager diffusers 0.42.1 on x's layout, or with ``ncdhw=True`` on a channels-last x, on the
    contiguous tensor it stands in for (kernels/reference.py:wan_rms_norm_silu). Raises
    UnsupportedInput where :func:`can_use_wan_rms_norm_silu` is False."""
    reason = _unsupported_reason(x, gamma, bias, silu, ncdhw)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.wan_rms_norm_silu(x, gamma, bias if isinstance(bias, torch.Tensor) else None, silu,
                                                   ncdhw)
    return _launch(x, gamma, bias, silu, exact=True, ncdhw=ncdhw)


def _pad_reason(x, pad, pre_bias=None, cache=None, keep=0) -> str | None:
    if pre_bias is not None and not (isinstance(pre_bias, torch.Tensor) and pre_bias.numel() == x.shape[1]
                                     and pre_bias.dtype == x.dtype and pre_bias.device == x.device):
        return "pre_bias must be a [C] tensor of the input's dtype and device"
    if not (isinstance(pad, (tuple, list)) and len(pad) == 6 and all(isinstance(v, int) and v >= 0 for v in pad)):
        return "pad must be F.pad's 6 non-negative ints (w_left, w_right, h_top, h_bottom, t_front, t_back)"
    if not channels_last(x) or x.dim() != 5:
        return "the padded output is written from a channels-last-3d input only"
    if isinstance(keep, bool) or not isinstance(keep, int) or not 0 <= keep <= x.shape[2]:
        return f"keep must be an int in [0, T={x.shape[2]}], got {keep!r}"
    if cache is not None:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 5:
            return "cache must be a [B, C, tc, H, W] tensor"
        if cache.shape[:2] != x.shape[:2] or cache.shape[3:] != x.shape[3:] or cache.shape[2] > pad[4]:
            return (f"cache {tuple(cache.shape)} must match x {tuple(x.shape)} but in frames, and have at most "
                    f"t_front={pad[4]} frames")
        if cache.dtype != x.dtype or cache.device != x.device:
            return "cache must have the input's dtype and device"
        if not dense_channels_last(cache):
            return f"cache strides {cache.stride()} are not dense channels-last (copied in by the border launch)"
    return None


@torch.library.custom_op("ditfuse::wan_rms_norm_silu_pad", mutates_args=())
def _wan_rms_norm_silu_pad_op(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, silu: bool,
                              ncdhw: bool, pad: list[int], pre_bias: torch.Tensor | None,
                              cache: torch.Tensor | None, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _pad_launch(x, gamma, 0.0 if bias is None else bias, silu, ncdhw, pad, pre_bias, cache, keep)


def _pad_launch(x, gamma, bias, silu, ncdhw, pad, pre_bias, cache, keep) -> tuple[torch.Tensor, torch.Tensor]:
    kept = _kept_buffer(x, keep)
    out = _launch(x, gamma, bias, silu, exact=True, ncdhw=ncdhw, pad=tuple(pad), pre_bias=pre_bias,
                  cache=cache if cache is not None and cache.shape[2] else None, kept=kept if keep else None)
    return out, kept


def _kept_buffer(x: torch.Tensor, keep: int) -> torch.Tensor:
    B, C, _, Hh, Ww = x.shape
    return torch.empty((B, C, keep, Hh, Ww), dtype=x.dtype, device=x.device, memory_format=torch.channels_last_3d)


@_wan_rms_norm_silu_pad_op.register_fake
def _(x, gamma, bias, silu, ncdhw, pad, pre_bias, cache, keep):
    B, C, T, Hh, Ww = x.shape
    out = torch.empty((B, C, pad[4] + T + pad[5], pad[2] + Hh + pad[3], pad[0] + Ww + pad[1]), dtype=x.dtype,
                      device=x.device, memory_format=torch.channels_last_3d)
    return out, _kept_buffer(x, keep)


def can_use_wan_rms_norm_silu_pad(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float,
                                  silu: bool, ncdhw: bool, pad: tuple[int, ...],
                                  pre_bias: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                                  keep: int = 0) -> bool:
    """True when :func:`wan_rms_norm_silu_pad` takes these arguments: those of
    :func:`can_use_wan_rms_norm_silu`, a channels-last-3d x, ``pad`` as F.pad's six
    non-negative ints, ``pre_bias`` None or a [C] tensor like x, ``cache`` None or a dense
    channels-last ``[B, C, tc <= t_front, H, W]`` tensor like x, ``0 <= keep <= T``."""
    return (_pad_reason(x, pad, pre_bias, cache, keep) is None
            and _unsupported_reason(x, gamma, bias, silu, ncdhw) is None)


def wan_rms_norm_silu_pad(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float,
                          silu: bool, ncdhw: bool, pad: tuple[int, ...],
                          pre_bias: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                          keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal convolution's input and cache, made by the norm in front of it (WanResidualBlock:
    ``y = silu(norm(x))``; ``cache_x = y[:, :, -2:].clone()``; the convolution's
    ``F.pad(cat([cache, y], 2), padding)``)::

        y    = wan_rms_norm_silu(r(x + pre_bias), gamma, bias, silu, ncdhw)
        out  = F.pad(cat([cache, y], 2), pad with t_front reduced by cache's frames)
        kept = y[:, :, T - keep:]

    Both channels-last-3d. One border launch zeroes out's border and copies the cached frames in;
    the norm kernel writes y straight into out's interior and its last ``keep`` frames a second
    time into ``kept`` (eager: the norm's output, a ``clone`` of its last frames, ``cat`` and the
    pad copy). ``pre_bias``: the bias of the convolution that produced x, which aten adds in a
    separate pass. Bit-exact as :func:`wan_rms_norm_silu` (the rest is bit copies). Raises
    UnsupportedInput where :func:`can_use_wan_rms_norm_silu_pad` is False."""
    reason = _pad_reason(x, pad, pre_bias, cache, keep) or _unsupported_reason(x, gamma, bias, silu, ncdhw)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.wan_rms_norm_silu_pad(x, gamma, bias if isinstance(bias, torch.Tensor) else None,
                                                       silu, ncdhw, list(pad), pre_bias, cache, keep)
    return _pad_launch(x, gamma, bias, silu, ncdhw, pad, pre_bias, cache, keep)


def can_use_wan_rms_norm_silu_fp32(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0,
                                   silu: bool = True, ncdhw: bool = False) -> bool:
    """True when :func:`wan_rms_norm_silu_fp32` handles these arguments (the same rejections as
    :func:`can_use_wan_rms_norm_silu`)."""
    return _unsupported_reason(x, gamma, bias, silu, ncdhw) is None


def wan_rms_norm_silu_fp32(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0,
                           silu: bool = True, ncdhw: bool = False) -> torch.Tensor:
    """Close variant (quality="high"): one rounding at the end. Same rejections."""
    reason = _unsupported_reason(x, gamma, bias, silu, ncdhw)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.wan_rms_norm_silu_fp32(x, gamma, bias if isinstance(bias, torch.Tensor) else None,
                                                        silu, ncdhw)
    return _launch(x, gamma, bias, silu, exact=False, ncdhw=ncdhw)


__all__ = ["wan_rms_norm_silu", "can_use_wan_rms_norm_silu", "wan_rms_norm_silu_fp32", "can_use_wan_rms_norm_silu_fp32",
           "wan_rms_norm_silu_pad", "can_use_wan_rms_norm_silu_pad",
           "reduce_layout"]
