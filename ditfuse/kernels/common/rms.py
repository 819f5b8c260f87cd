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

:func:`rms_sumsq_reduce_order` is the other order torch uses for a sum of squares: its generic
reduction (``x.float().pow(2).mean(-1)``, diffusers' ``RMSNorm``): lane-strided elements below
128, 4-element vectors from 128, a halving lane tree.

Under ``TRITON_INTERPRET=1`` inline PTX does not run and ``tl.fma`` rounds twice: :func:`fma_rn`
computes through fp64 there (exact for bf16/fp16 squares; for fp32 one fp64 rounding then one
fp32 rounding, correct except in rare double-rounding cases) and :func:`rsqrt_approx` is numpy's
``1 / sqrt`` (not the GPU's approximation: CPU tests compare against a simulation that does the
same, see tests/cpu/test_qk_rmsnorm_rope_interpret.py).
"""

import triton
import triton.language as tl

from .rounding import INTERPRET
from .warp import lane0_broadcast, shfl_bfly
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
def rms_fold_lanes(acc, T: tl.constexpr, R: tl.constexpr):
    """[T, R] per-lane sums (lane l of row r holding thread l's sum, the T <= 32 lanes of one warp
    along axis 0) -> [R]: torch's shfl-down tree at offsets T/2 .. 1. On the GPU one ``tl.sum``
    over the lane axis, which Triton lowers to butterfly shuffles at the same offsets when axis 0
    is T lanes with one element each (the callers check the compiled layout); under the
    interpreter the tree is spelled out."""
    if INTERPRET:
        s = tl.permute(acc, (1, 0))
        if T >= 32:
            s = _fold_half(s, R, 32)
        if T >= 16:
            s = _fold_half(s, R, 16)
        if T >= 8:
            s = _fold_half(s, R, 8)
        if T >= 4:
            s = _fold_half(s, R, 4)
        if T >= 2:
            s = _fold_half(s, R, 2)
        return tl.reshape(s, [R])
    else:
        return tl.sum(acc, axis=0)


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


@triton.jit
def _warp_sum(a, R: tl.constexpr):
    for lvl in tl.static_range(5):
        a = a + shfl_bfly(a, 16 >> lvl, R)
    return a


@triton.jit
def rms_fold_4warps_in_registers(a0, a1, a2, a3, R: tl.constexpr):
    """:func:`rms_fold_rows` for the warp-per-row kernels: torch's 4 warps are register sets
    0..3 of one warp ([R, 32] sums each, row r in warp r). Each set folds with butterflies at 16,
    8, 4, 2, 1 (lane 0's sum is the shfl-down tree's), then (w0 + w2) + (w1 + w3) in registers;
    returns [R, 32] with every lane holding lane 0's (torch's) sum."""
    a0 = _warp_sum(a0, R)
    a1 = _warp_sum(a1, R)
    a2 = _warp_sum(a2, R)
    a3 = _warp_sum(a3, R)
    return lane0_broadcast((a0 + a2) + (a1 + a3), R)


# ---------------------------------------------------------------------------------------------
# torch's generic reduction order (``x.pow(2).mean(-1)``: diffusers' RMSNorm)


@triton.jit
def _quarters(t, A: tl.constexpr, M: tl.constexpr):
    """[A, M, 4] -> four [A, M]: element 0, 1, 2, 3 of the last axis."""
    t02, t13 = tl.split(tl.reshape(t, [A, M, 2, 2]))
    t0, t2 = tl.split(t02)
    t1, t3 = tl.split(t13)
    return t0, t1, t2, t3


@triton.jit
def rms_sumsq_reduce_order(sq, R: tl.constexpr, DP: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr):
    """Row sums of ``sq`` ([R, DP] fp32 squares, padding columns zero) in the order of torch's
    generic CUDA reduction (aten/src/ATen/native/cuda/Reduce.cuh) over a contiguous last dim,
    as ``x.float().pow(2).mean(-1)`` runs it (MeanOps: plain adds, ``ident = 0``); returns [R].

    Launch (``setReduceConfig``, reduction on the fastest-striding dim): ``dim0 = D`` inputs per
    output, or ``D / 4`` 4-element vectors (``vectorize_input``) when D >= 128 (torch 2.11 on the
    H200 vectorizes D = 128: bench/results/probe_diffusers_rms_h200.json); ``dim1`` = the number
    of outputs (rows). ``set_block_dimension``: ``block_width = min(last_pow2(dim0), 32)``,
    ``block_height = min(last_pow2(dim1), 512 / block_width)``, then ``block_width =
    min(last_pow2(dim0), 512 / block_height)``: W = 32 lanes per row once there are >= 16 rows,
    up to 512 for fewer rows. The input is split across the W lanes (``step_input = W``); the
    host rejects the warp split (``values_per_thread >= min(16 * block_height, 256)``), so each
    row is reduced by W lanes of one block row. W is computed on the host (``W`` here).

    Per lane l (``VEC == 1``, ``thread_reduce_impl``, vt0 = 4 accumulators): the lane's elements
    l, l + W, l + 2W, ... go to accumulator ``j % 4`` in turn, each starting from 0; below 128 a
    lane has at most four, so ``acc = ((e0 + e1) + e2) + e3`` (missing ones are 0).
    ``VEC == 4`` (``input_vectorized_thread_reduce_impl``; rows start 16-byte aligned because the
    squares are a fresh contiguous fp32 tensor and D % 4 == 0): the lane reads vectors
    l, l + W, ... (vector v = elements 4v .. 4v + 3); accumulator j sums element j of each in
    order; then ``acc = ((a0 + a1) + a2) + a3``.

    Lanes then fold (``block_x_reduce``) as a halving tree: lane i adds lane i + offset for
    offsets W/2, ..., 2, 1 (shared memory above 32 lanes, shfl-down below; the H200 probe matched
    the halving tree for 16- to 3840-wide rows, not the adjacent-lane tree of offsets 1, 2, 4).
    Lane 0 holds the row's sum. Padding zeros only ever add 0 to a non-negative (or NaN) sum:
    exact. For D = 128 this is the order of :func:`rms_sumsq_torch_order` (without its FMAs)."""
    if VEC == 1:
        NJ: tl.constexpr = DP // W  # elements per lane (<= 4 for D < 128)
        if NJ == 1:
            lane = tl.reshape(sq, [R, W])
        elif NJ == 2:
            a0, a1 = tl.split(tl.permute(tl.reshape(sq, [R, 2, W]), (0, 2, 1)))
            lane = a0 + a1
        else:
            tl.static_assert(NJ == 4, "more than 4 elements per lane (D >= 128 is vectorized)")
            a0, a1, a2, a3 = _quarters(tl.permute(tl.reshape(sq, [R, 4, W]), (0, 2, 1)), R, W)
            lane = ((a0 + a1) + a2) + a3
    else:
        NV: tl.constexpr = DP // (4 * W)  # vectors per lane, padded
        if NV == 1:
            acc = tl.reshape(sq, [R, W * 4])
        else:
            t = tl.reshape(sq, [R, NV, W * 4])
            m = tl.arange(0, NV)
            acc = tl.zeros([R, W * 4], tl.float32)
            for v in tl.static_range(NV):
                # The lane's v-th vector: a sum of one element and zeros, exact.
                acc = acc + tl.sum(tl.where((m == v)[None, :, None], t, 0.0), axis=1)
        a0, a1, a2, a3 = _quarters(tl.reshape(acc, [R, W, 4]), R, W)
        lane = ((a0 + a1) + a2) + a3
    s = lane
    if W >= 512:
        s = _fold_half(s, R, 512)
    if W >= 256:
        s = _fold_half(s, R, 256)
    if W >= 128:
        s = _fold_half(s, R, 128)
    if W >= 64:
        s = _fold_half(s, R, 64)
    if W >= 32:
        s = _fold_half(s, R, 32)
    if W >= 16:
        s = _fold_half(s, R, 16)
    if W >= 8:
        s = _fold_half(s, R, 8)
    if W >= 4:
        s = _fold_half(s, R, 4)
    if W >= 2:
        s = _fold_half(s, R, 2)
    return tl.reshape(s, [R])
