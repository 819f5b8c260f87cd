"""Sum of squares and rstd in the order of torch's CUDA ``_fused_rms_norm`` (torch 2.11).

``torch.nn.RMSNorm`` / ``F.rms_norm`` on CUDA with weight dtype == input dtype (or no weight)
calls ``_fused_rms_norm``, which runs the LayerNorm kernel template of
aten/src/ATen/native/cuda/layer_norm_kernel.cu in RMS mode. For a contiguous, aligned
fp32/fp16/bf16 row whose width N is a multiple of 4 that is ``vectorized_layer_norm_kernel``:
one CUDA block of 32 x 4 threads per row, fp32 accumulation, nvcc defaults (``-fmad=true``,
``-prec-div=true``, no flush-to-zero). In RMS mode the Welford state degenerates to a plain sum:

1. Thread ``t = lane + 32 * warp`` reads its 4-element vectors ``t, t + 128, ...`` and adds the
   elements in order: ``acc = acc + v * v``, which nvcc contracts to ``fma(v, v, acc)``.
2. Lanes fold with ``__shfl_down_sync`` at offsets 16, 8, 4, 2, 1 (lane l adds lane l + offset);
   warps then fold through shared memory at offsets 2, 1 (warp w adds warp w + offset).
3. ``ms = sum / float(N)`` (IEEE division), ``rstd = rsqrtf(ms + eps)`` (``rsqrt.approx.f32``,
   no ftz), output ``gamma * (rstd * x)`` in fp32, rounded once to the row dtype.

For bf16 and fp16 inputs ``v * v`` is exact in fp32, so the FMA only matters for fp32 rows.
Threads with no vector hold 0, and adding 0 to a sum of squares (never -0) changes nothing, so
a row padded with zeros to a power-of-two width folds exactly like the unpadded row in torch.

:func:`rms_sumsq_torch_order` reproduces steps 1-2 for N <= 512 (one vector per thread, rows
in an [R, N] tile: the FLUX per-head norm); :func:`rms_fold_rows` step 2 for per-thread sums laid
out [128, R] (any N: the kernel accumulates several vectors per thread first, the Wan norm over
all heads); :func:`rms_rstd` step 3's scalar part.

Under ``TRITON_INTERPRET=1`` inline PTX does not run and ``tl.fma`` rounds twice: :func:`fma_rn`
computes through fp64 there (exact for bf16/fp16 squares; for fp32 one fp64 rounding then one
fp32 rounding, correct except in rare double-rounding cases) and :func:`rsqrt_approx` is numpy's
``1 / sqrt`` (not the GPU's approximation: CPU tests compare against a simulation that does the
same, see tests/cpu/test_qk_rmsnorm_rope_interpret.py).
"""

import triton
import triton.language as tl

from .rounding import INTERPRET
from .welford import fma_rn, rsqrt_approx

# torch's launch: 32 lanes x 4 warps per row, 4-element vectors.
RMS_LANES: tl.constexpr = tl.constexpr(32)
RMS_WARPS: tl.constexpr = tl.constexpr(4)
RMS_VEC: tl.constexpr = tl.constexpr(4)
# Host-side copies: the widest row with one vector per thread (128 threads x 4 elements), and
# the vector width rows must be a multiple of.
RMS_MAX_WIDTH = 512
RMS_VEC_WIDTH = 4


@triton.jit
def _fold_half(s, A: tl.constexpr, L: tl.constexpr):
    """[A, L] -> [A, L // 2]: column i gets ``s[:, i] + s[:, i + L // 2]`` (a shfl-down by
    L // 2). A two-element sum has one possible rounding, so ``tl.sum`` over the size-2 axis is
    exactly that add."""
    return tl.sum(tl.reshape(s, [A, 2, L // 2]), axis=1)


@triton.jit
def rms_sumsq_torch_order(x, R: tl.constexpr, DP: tl.constexpr):
    """Sum of squares of each row of ``x`` ([R, DP] fp32, DP a power of two <= 512, padding
    columns zero) in torch's ``vectorized_layer_norm_kernel`` order; returns [R] fp32."""
    T: tl.constexpr = DP // RMS_VEC  # threads holding a vector (padded to a power of two)
    # Element e of thread t's vector is column 4t + e: split the vector into its four elements.
    x4 = tl.reshape(x, [R, T, 2, 2])
    x02, x13 = tl.split(x4)
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    acc = x0 * x0
    acc = fma_rn(x1, x1, acc)
    acc = fma_rn(x2, x2, acc)
    acc = fma_rn(x3, x3, acc)
    LANES: tl.constexpr = T if T < RMS_LANES else RMS_LANES
    W: tl.constexpr = T // LANES
    s = tl.reshape(acc, [R * W, LANES])
    if LANES >= 32:
        s = _fold_half(s, R * W, 32)
    if LANES >= 16:
        s = _fold_half(s, R * W, 16)
    if LANES >= 8:
        s = _fold_half(s, R * W, 8)
    if LANES >= 4:
        s = _fold_half(s, R * W, 4)
    if LANES >= 2:
        s = _fold_half(s, R * W, 2)
    # Warps with no vector hold 0: folding W (1, 2 or 4) warps halves like torch's 4.
    s = tl.reshape(s, [R, W])
    if W >= 4:
        s = _fold_half(s, R, 4)
    if W >= 2:
        s = _fold_half(s, R, 2)
    return tl.reshape(s, [R])


@triton.jit
def rms_rstd(sumsq, N: tl.constexpr, eps):
    """``rsqrtf(sum / float(N) + eps)`` with torch's IEEE division."""
    return rsqrt_approx(tl.math.div_rn(sumsq, tl.full(sumsq.shape, N, tl.float32)) + eps)


@triton.jit
def rms_fold_rows(acc, R: tl.constexpr):
    """Fold [128, R] per-thread sums of squares (thread ``t = lane + 32 * warp`` along axis 0)
    into per-row [R] sums in torch's order: shfl-down 16, 8, 4, 2, 1 inside each warp, then warps
    0+2, 1+3, 0+1.

    On the GPU one ``tl.sum`` over axis 0: for an operand with one element per thread along
    axis 0 (the [128, R, 4] tile layout of ditfuse/kernels/norm's loads), Triton lowers it to
    butterfly shuffles at 16, 8, 4, 2, 1 and a butterfly over the 4 warps' results at 2, 1; lane
    0's result is the shfl-down tree's (see welford_fold_rows; addition is commutative, so only
    the tree's shape matters). Under the interpreter ``tl.sum`` is a sequential fold, so the tree
    is spelled out with reshapes there."""
    if INTERPRET:
        s = tl.reshape(tl.permute(acc, (1, 0)), [R * 4, 32])
        s = _fold_half(s, R * 4, 32)
        s = _fold_half(s, R * 4, 16)
        s = _fold_half(s, R * 4, 8)
        s = _fold_half(s, R * 4, 4)
        s = _fold_half(s, R * 4, 2)
        s = tl.reshape(s, [R, 4])
        s = _fold_half(s, R, 4)
        s = _fold_half(s, R, 2)
        return tl.reshape(s, [R])
    else:
        return tl.sum(acc, axis=0)
