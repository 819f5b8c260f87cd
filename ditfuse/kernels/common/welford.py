"""Welford numerics that mirror PyTorch's CUDA ``vectorized_layer_norm_kernel`` bit for bit.

torch 2.11 (aten/src/ATen/native/cuda/layer_norm_kernel.cu) computes LayerNorm statistics for
a contiguous, aligned fp32/fp16/bf16 row whose width N is a multiple of 4 like this (one CUDA
block of 32 x 4 threads per row, fp32 accumulation, nvcc defaults: ``-fmad=true``,
``-prec-div=true``, no flush-to-zero):

1. Thread ``t = lane + 32 * warp`` reads its 4-element vectors ``t, t + 128, t + 256, ...`` and
   feeds the elements, in order, to ``cuWelfordOnlineSum``::

       delta = v - mean;  count' = count + 1
       mean' = mean + delta * (1.f / count')        -> fma(delta, rcp_rn(count'), mean)
       m2'   = m2 + delta * (v - mean')             -> fma(delta, v - mean', m2)

   ``1.f / count'`` is an IEEE (correctly rounded) reciprocal: with ``-prec-div=true`` nvcc
   emits ``rcp.rn.f32``, which SASS implements as a guarded MUFU.RCP + Newton sequence that
   returns the correctly rounded result. :func:`welford_update` uses ``div_rn(1, count')``, the
   same value. The two adds each absorb the product before them into an FMA (nvcc contracts
   ``a + b * c``); :func:`fma_rn` reproduces that.
2. Lanes fold with ``__shfl_down_sync`` at offsets 16, 8, 4, 2, 1; the lower lane calls
   ``cuWelfordCombine(dataB = own state, dataA = state of lane + offset)``::

       delta = B.mean - A.mean;  count = A.count + B.count
       if count > 0:
           coef = 1.f / count                                     (IEEE reciprocal)
           nA = A.count * coef;  nB = B.count * coef
           mean  = nA * A.mean + nB * B.mean                      -> fma(nA, A.mean, nB * B.mean)
           m2    = A.m2 + B.m2 + delta * delta * A.count * nB     -> fma((delta*delta)*A.count, nB, A.m2 + B.m2)
       else: mean = m2 = 0

   (:func:`welford_combine`; the contraction choices are the ones the H200 probe matched,
   see notes/layernorm.md.)
3. Lane 0 of each warp holds its warp's state; warps fold through shared memory at offsets 2
   then 1 (warp w combines with warp w + offset, again own state as ``dataB``).
4. ``var = m2 / float(N)`` (IEEE division), ``rstd = rsqrt(var + eps)`` (``rsqrtf`` ->
   ``rsqrt.approx.f32``, no ftz), output ``rstd * (x - mean)`` rounded once to the row dtype.

Under ``TRITON_INTERPRET=1`` Triton's own ``tl.fma`` rounds twice and inline PTX does not run,
so :func:`fma_rn` computes through fp64 there (one fp64 rounding then one fp32 rounding:
correct except in the rare double-rounding case, identical to the pure-torch simulation in
tests/layernorm_sim.py) and :func:`rsqrt_approx` is numpy's ``1 / sqrt``.
"""

import triton
import triton.language as tl

from .rounding import INTERPRET
from .warp import lane0_broadcast, shfl_bfly

# Threads per row in torch's launch (warp_size x num_threads() / warp_size = 32 x 4) and
# elements per vector (``vec_size``).
LN_THREADS: tl.constexpr = tl.constexpr(128)
LN_VEC: tl.constexpr = tl.constexpr(4)


@triton.jit
def fma_rn(a, b, c):
    """``fma.rn.f32(a, b, c)``: the FFMA nvcc emits when it contracts ``c + a * b``."""
    if INTERPRET:
        return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def rsqrt_approx(x):
    """``rsqrtf`` as nvcc compiles it without fast-math: ``rsqrt.approx.f32`` (no ftz, unlike
    ``tl.math.rsqrt`` whose libdevice path is built with ftz reflection on)."""
    if INTERPRET:
        return tl.math.rsqrt(x)
    else:
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def welford_update(mean, m2, v, new_count, valid):
    """``cuWelfordOnlineSum``: add one element ``v`` to a thread's state.

    ``new_count`` is the (exact, fp32) count after the update; the state is kept where
    ``valid`` is False (the thread has no vector at this step); ``valid=None``: no thread is idle.""" 
    delta = v - mean
    coef = tl.math.div_rn(1.0, new_count)
    new_mean = fma_rn(delta, coef, mean)
    new_m2 = fma_rn(delta, v - new_mean, m2)
    if valid is None:  # every thread holds this element (whole 128-thread steps)
        mean, m2 = new_mean, new_m2
    else:
        mean, m2 = tl.where(valid, new_mean, mean), tl.where(valid, new_m2, m2)
    return mean, m2


@triton.jit
def welford_combine(mean_b, m2_b, n_b, mean_a, m2_a, n_a, MEAN_MODE: tl.constexpr = 0, M2_FMA: tl.constexpr = True):
    """``cuWelfordCombine(dataB, dataA)``: B is the caller's own state, A the one it received.

    MEAN_MODE / M2_FMA select where the contraction happens (0: ``fma(nA, A.mean, nB*B.mean)``,
    1: ``fma(nB, B.mean, nA*A.mean)``, 2: no FMA; M2_FMA: ``fma(d*d*A.count, nB, A.m2+B.m2)``
    or separate ops). The defaults are what matches torch on the H200; the others exist for
    the order probe (tests/gpu/probe_layernorm_order.py)."""
    delta = mean_b - mean_a
    n = n_a + n_b
    coef = tl.math.div_rn(1.0, tl.where(n > 0, n, 1.0))
    na = n_a * coef
    nb = n_b * coef
    if MEAN_MODE == 0:
        mean = fma_rn(na, mean_a, nb * mean_b)
    elif MEAN_MODE == 1:
        mean = fma_rn(nb, mean_b, na * mean_a)
    else:
        mean = na * mean_a + nb * mean_b
    if M2_FMA:
        m2 = fma_rn(delta * delta * n_a, nb, m2_a + m2_b)
    else:
        m2 = m2_a + m2_b + delta * delta * n_a * nb
    nonempty = n > 0
    return tl.where(nonempty, mean, 0.0), tl.where(nonempty, m2, 0.0), n


@triton.jit
def _combine_own_first(mean_b, m2_b, n_b, mean_a, m2_a, n_a):
    """``tl.reduce`` combine: Triton calls it as ``combine(accumulator, received)``, i.e. the
    lane's own state first, which is ``cuWelfordCombine(dataB = own, dataA = received)``."""
    return welford_combine(mean_b, m2_b, n_b, mean_a, m2_a, n_a)


@triton.jit
def _fold_half_rows(mean, m2, n, R: tl.constexpr, W: tl.constexpr):
    """[R, W] -> [R, W // 2] (interpreter path of :func:`welford_fold_rows`): column i combines with column i + W // 2 (own state first)."""
    mean_lo, mean_hi = tl.split(tl.permute(tl.reshape(mean, [R, 2, W // 2]), (0, 2, 1)))
    m2_lo, m2_hi = tl.split(tl.permute(tl.reshape(m2, [R, 2, W // 2]), (0, 2, 1)))
    n_lo, n_hi = tl.split(tl.permute(tl.reshape(n, [R, 2, W // 2]), (0, 2, 1)))
    return welford_combine(mean_lo, m2_lo, n_lo, mean_hi, m2_hi, n_hi)


@triton.jit
def welford_fold_rows(mean, m2, n, R: tl.constexpr):
    """Fold [128, R] per-thread states (thread ``t = lane + 32 * warp`` along axis 0, R
    independent rows) into per-row [R] (mean, m2, count), in compute_stats' order: shfl-down
    16, 8, 4, 2, 1 inside each warp, then warps 0+2, 1+3 and 0+1 (own state first each time).

    On the GPU this is one ``tl.reduce`` over axis 0. Triton 3.6 lowers it, for an operand
    whose axis 0 is one element per thread with ``t = lane + 32 * warp`` (the layout the
    [128, R, 4] loads get; tests/cpu/test_layernorm_v2_codegen.py asserts it on the sm_90
    TTGIR), as butterfly shuffles ``shfl.sync.bfly`` at lane offsets 16, 8, 4, 2, 1 calling
    ``combine(own, received)``, then the 4 per-warp results through shared memory and a
    butterfly at offsets 2, 1, result read from lane 0 of warp 0. At a butterfly step with
    offset ``o``, lane ``i < o`` combines its state with lane ``i + o``'s, which is what
    ``__shfl_down_sync`` hands it; lane 0's inputs come only from lanes ``< o`` at every step,
    so lane 0 ends with the same value as torch's shfl-down tree (other lanes differ, and are
    not used). Across warps: ``(w0 + w2) + (w1 + w3)``, torch's order.

    Under the interpreter ``tl.reduce`` is a sequential left fold, so the same tree is spelled
    out with reshapes there (the CPU tests check it against tests/layernorm_sim.py)."""
    if INTERPRET:
        # [128, R] -> [R, 4 warps, 32 lanes] -> [R * 4, 32]: t = lane + 32 * warp stays in order.
        mean = tl.reshape(tl.permute(mean, (1, 0)), [R * 4, 32])
        m2 = tl.reshape(tl.permute(m2, (1, 0)), [R * 4, 32])
        n = tl.reshape(tl.permute(n, (1, 0)), [R * 4, 32])
        mean, m2, n = _fold_half_rows(mean, m2, n, R * 4, 32)
        mean, m2, n = _fold_half_rows(mean, m2, n, R * 4, 16)
        mean, m2, n = _fold_half_rows(mean, m2, n, R * 4, 8)
        mean, m2, n = _fold_half_rows(mean, m2, n, R * 4, 4)
        mean, m2, n = _fold_half_rows(mean, m2, n, R * 4, 2)
        mean = tl.reshape(mean, [R, 4])
        m2 = tl.reshape(m2, [R, 4])
        n = tl.reshape(n, [R, 4])
        mean, m2, n = _fold_half_rows(mean, m2, n, R, 4)
        mean, m2, n = _fold_half_rows(mean, m2, n, R, 2)
        return tl.reshape(mean, [R]), tl.reshape(m2, [R]), tl.reshape(n, [R])
    else:
        return tl.reduce((mean, m2, n), 0, _combine_own_first)


# ----------------------------------------------------------------------------- one warp per row
#
# The warp-per-row LayerNorm (norm/layernorm_modulate_triton.py ``_ln_warp_kernel``) runs torch's
# 128 threads of a row as 4 "logical warps" held in the registers of one real warp: logical
# thread ``t = lane + 32 * w`` is register set ``w`` of lane ``lane``. The shfl-down fold inside a
# logical warp is a real butterfly over the 32 lanes (lane 0 ends with torch's tree, as above);
# the cross-warp tree (w0 + w2) + (w1 + w3) is three combines inside each thread, no shared
# memory and no barrier. Only rows that are whole 128-thread steps take it: every thread then
# holds the same count, so each level's counts, and therefore its reciprocal and coefficients,
# are compile-time constants (the same IEEE values the runtime ``welford_combine`` computes).


@triton.jit
def welford_combine_counts(mean_b, m2_b, mean_a, m2_a, NB: tl.constexpr, NA: tl.constexpr):
    """:func:`welford_combine` (defaults) when both counts are known constants ``NB``, ``NA`` > 0:
    the same operations on the same values, so the same bits; the reciprocal and coefficients
    fold at compile time and the count needs no shuffle."""
    n_a = tl.full([], NA, tl.float32)
    n_b = tl.full([], NB, tl.float32)
    coef = tl.math.div_rn(tl.full([], 1.0, tl.float32), n_a + n_b)
    na = n_a * coef
    nb = n_b * coef
    delta = mean_b - mean_a
    mean = fma_rn(na, mean_a, nb * mean_b)
    m2 = fma_rn(delta * delta * n_a, nb, m2_a + m2_b)
    return mean, m2


@triton.jit
def welford_warp_fold(mean, m2, C: tl.constexpr, R: tl.constexpr):
    """One logical warp's shfl-down fold (offsets 16, 8, 4, 2, 1, own state first) on [R, 32]
    states that each hold ``C`` elements; lane 0 ends with torch's warp result (other lanes hold
    other orders and are not used)."""
    for lvl in tl.static_range(5):
        mean_a = shfl_bfly(mean, 16 >> lvl, R)
        m2_a = shfl_bfly(m2, 16 >> lvl, R)
        mean, m2 = welford_combine_counts(mean, m2, mean_a, m2_a, C * (1 << lvl), C * (1 << lvl))
    return mean, m2


@triton.jit
def welford_fold_4warps_in_registers(mean0, m20, mean1, m21, mean2, m22, mean3, m23,
                                     C: tl.constexpr, R: tl.constexpr):
    """torch's whole row fold for 4 logical warps held as register sets 0..3 of one warp, every
    logical thread holding ``C`` elements: each warp's shfl-down tree, then (w0 + w2) + (w1 + w3)
    as compute_stats' shared-memory tree does it. Returns [R, 32] (mean, m2), every lane holding
    lane 0's (torch's) value."""
    mean0, m20 = welford_warp_fold(mean0, m20, C, R)
    mean1, m21 = welford_warp_fold(mean1, m21, C, R)
    mean2, m22 = welford_warp_fold(mean2, m22, C, R)
    mean3, m23 = welford_warp_fold(mean3, m23, C, R)
    W: tl.constexpr = C * 32
    mean02, m202 = welford_combine_counts(mean0, m20, mean2, m22, W, W)
    mean13, m213 = welford_combine_counts(mean1, m21, mean3, m23, W, W)
    mean, m2 = welford_combine_counts(mean02, m202, mean13, m213, 2 * W, 2 * W)
    return lane0_broadcast(mean, R), lane0_broadcast(m2, R)
