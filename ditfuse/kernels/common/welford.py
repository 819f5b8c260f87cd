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
    ``valid`` is False (the thread has no vector at this step)."""
    delta = v - mean
    coef = tl.math.div_rn(1.0, new_count)
    new_mean = fma_rn(delta, coef, mean)
    new_m2 = fma_rn(delta, v - new_mean, m2)
    return tl.where(valid, new_mean, mean), tl.where(valid, new_m2, m2)


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
