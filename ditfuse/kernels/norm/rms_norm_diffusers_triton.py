"""diffusers' ``RMSNorm`` (normalization.RMSNorm) over rows of width D, fused with what surrounds it
in the Z-Image block; bit-exact vs torch 2.11 CUDA eager (diffusers 0.42.1). One kernel body, a
constexpr ``MODE`` picks the chain:

MODE 0, ``rms_norm_diffusers_scale(x, weight, scale, eps, shift)`` (Z1; ``scale=None``: plain
RMS_d; LTX-Video's ``norm1(h) * (1 + scale) + shift`` with ``shift``)::

    out = r(RMS_d(x; w) * r(1 + scale))          (shift given: r(that + shift))

MODE 1, ``gate_residual_rms_norm_diffusers(residual, gate, update, weight, eps)`` (Z6)::

    h = r(residual + r(gate * RMS_d(update; w)))        (gate None: r(residual + RMS_d(update; w)))

MODE 2, ``gate_residual_rms_norm_diffusers_scale(residual, gate, update, w, w2, scale, eps)``
(Z3 + Z4): that ``h``, then ``n = r(RMS_d(h; w2) * r(1 + scale))``; returns ``(h, n)``.

``RMS_d(x; w)`` is diffusers' forward as CUDA runs it::

    x32  = x.float();  sq = r32(x32 * x32)               (pow(2): a plain multiply)
    ms   = r32(sum(sq) * factor)                         (mean(-1): Reduce.cuh + MeanOps)
    rstd = rsqrt.approx.f32(r32(ms + f32(eps)))          (torch.rsqrt)
    h32  = r32(x32 * rstd)
    w bf16/fp16: r(r(h32) * w);  w None: r(h32);  w fp32 (fp32 x only): r32(h32 * w)

``sum`` runs in the order of torch's generic reduce kernel for a contiguous last dim (measured on
the H200, torch 2.11: bench/results/probe_diffusers_rms_h200.json). The host replicates
``setReduceConfig``: W lanes per row (``block_width``: 32 once there are >= 16 rows, more for
fewer rows) and 4-element vectors for D >= 128 (D % 4 == 0; the squares are a fresh, aligned
tensor), lane-strided elements for D <= 96 (96 < D < 128 is rejected: unverified). Lane l reads
its vectors (elements) l, l + W, ...; four accumulators, accumulator j summing element j of each
vector in order from 0 (lane-strided: the lane's j-th element alone); the lane's value is
``((a0 + a1) + a2) + a3``; then lanes fold as a halving tree (lane i += lane i + W/2, ..., +1;
shared memory above 32 lanes, shfl_down below). Here that is a loop over chunks of ``VEC * W``
columns (chunk k holds every lane's k-th vector) accumulated in order into a ``[rows, VEC * W]``
tile, then the quarter split and the fold spelled out (:func:`_reduce_lanes`).

``factor`` is MeanOps' ``float(rows) / float(rows * D)`` for the rows of the eager call (B*S): it
is not ``1/D`` in fp32 for D = 3840 at Z-Image's row counts; it is computed on the host and passed
in. Every elementwise op rounds where eager stores; the kernel is launched with
``enable_fp_fusion=False``. By default MODE 2's last pass re-reads the ``h`` it stored (constexpr
``READBACK``, as eager's second norm reads the stored tensor; the stored bf16/fp16/fp32 value is
exactly the fp32 value a recompute gives, a NaN stays a NaN); ``_launch(..., readback=False)``
recomputes it from its inputs (the same ops, so the same bits: 1.3-1.6x slower on the H200).
How a program tiles its rows (``block_rows``, ``num_warps``) does not change any row's arithmetic
order: the chunk loop fixes it (tests/cpu/test_rms_norm_diffusers_tiling_interpret.py, GPU probe
bench/probes/probe_rms_diffusers_tiling.py).

Under ``TRITON_INTERPRET=1`` ``rsqrt.approx`` is numpy's ``1/sqrt``: CPU tests compare against a
simulation with the same rsqrt (tests/support/rms_diffusers_rows_sim.py); the GPU tests compare
against eager. See :func:`_unsupported_reason` / the ``can_use_*`` predicates for every rejection.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..common.elementwise import as_3d, load_f32
from ..common.host import cdiv, next_pow2, SUPPORTED_DTYPES, device_reason, grad_reason, tl_dtype, use_custom_op
from ..common.plans import Recipes, call_key
from ..common.rounding import round_to, rround
from ..common.welford import rsqrt_approx
from ..errors import UnsupportedInput
from ..common.launch import launch

_HALF = (torch.bfloat16, torch.float16)
_MAX_THREADS = 512  # Reduce.cuh's max threads per block for an fp32 reduction (sm_90)
_WARP = 32
# One program's tile: ~2K fp32 elements of one chunk (rows x VEC*W columns).
_TILE = 2048


def _last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def reduce_launch(D: int, rows: int) -> tuple[int, int, bool]:
    """``(W, VEC, warp_split)`` that torch's ``setReduceConfig`` picks for ``x.float().pow(2)
    .mean(-1)`` over ``rows`` contiguous rows of D: VEC = 4 for D >= 128 (``vectorize_input``;
    torch 2.11 vectorizes D = 128 too, H200 probe), else 1; ``set_block_dimension(dim0, rows)``
    with dim0 = D / VEC; ``warp_split``: each row would be split over the block's warps
    (``values_per_thread >= min(16 * block_height, 256)``: a shared-memory y-fold, not reproduced)."""
    vec = 4 if D >= 128 else 1
    dim0 = max(D // vec, 1)
    d0 = _last_pow2(dim0) if dim0 < _MAX_THREADS else _MAX_THREADS
    d1 = _last_pow2(max(rows, 1)) if rows < _MAX_THREADS else _MAX_THREADS
    width = min(d0, _WARP)
    height = min(d1, _MAX_THREADS // width)
    width = min(d0, _MAX_THREADS // height)
    values_per_thread = -(-D // width)
    return width, vec, values_per_thread >= min(height * 16, 256)


def mean_factor(rows: int, D: int) -> float:
    """MeanOps' ``static_cast<float>(num_outputs) / numel`` (both converted to fp32, fp32 division)."""
    if rows == 0:
        return 1.0
    return float(np.float32(rows) / np.float32(rows * D))


@triton.jit
def _fold_half(s, A: tl.constexpr, L: tl.constexpr):
    """[A, L] -> [A, L // 2]: lane i gets ``s[:, i] + s[:, i + L // 2]`` (one step of the halving
    tree; a two-element sum has one rounding, so ``tl.sum`` over the size-2 axis is that add)."""
    return tl.sum(tl.reshape(s, [A, 2, L // 2]), axis=1)


@triton.jit
def _reduce_lanes(acc, BR: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr):
    """[BR, VEC * W] per-lane accumulators (column ``VEC * l + j``: lane l's accumulator j) ->
    [BR] row sums: ``((a0 + a1) + a2) + a3`` per lane (VEC = 4; VEC = 1 holds the lane value),
    then the halving fold over the W lanes."""
    if VEC == 4:
        a = tl.reshape(acc, [BR, W, 2, 2])  # last two axes: j = 2 * hi + lo
        even, odd = tl.split(a)
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        s = ((a0 + a1) + a2) + a3
    else:
        s = acc
    if W >= 512:
        s = _fold_half(s, BR, 512)
    if W >= 256:
        s = _fold_half(s, BR, 256)
    if W >= 128:
        s = _fold_half(s, BR, 128)
    if W >= 64:
        s = _fold_half(s, BR, 64)
    if W >= 32:
        s = _fold_half(s, BR, 32)
    if W >= 16:
        s = _fold_half(s, BR, 16)
    if W >= 8:
        s = _fold_half(s, BR, 8)
    if W >= 4:
        s = _fold_half(s, BR, 4)
    if W >= 2:
        s = _fold_half(s, BR, 2)
    return tl.reshape(s, [BR])


@triton.jit
def _rstd(sumsq, factor, eps):
    ms = sumsq * factor
    return rsqrt_approx(ms + eps)


@triton.jit
def _apply_weight(h32, w_ptr, cols, cmask, WMODE: tl.constexpr, DTYPE: tl.constexpr):
    """diffusers' tail: WMODE 0 (no weight) ``r(h32)``; 1 (bf16/fp16 weight) ``r(r(h32) * w)``;
    2 (fp32 weight, fp32 rows) ``r32(h32 * w)``. Returns fp32 holding the stored value."""
    if WMODE == 0:
        return rround(h32, DTYPE)
    else:
        w = load_f32(w_ptr + cols, cmask)[None, :]
        if WMODE == 1:
            return rround(rround(h32, DTYPE) * w, DTYPE)
        else:
            return h32 * w


@triton.jit
def _gated_h(x_ptr, r_ptr, g_ptr, w_ptr, xrow, rrow, grow, cols, m, cmask, rstd, srd, sgd,
             HAS_GATE: tl.constexpr, WMODE: tl.constexpr, DTYPE: tl.constexpr):
    """``h = r(residual + r(gate * RMS_d(update)))`` for one chunk (fp32 holding the stored value)."""
    x = load_f32(x_ptr + xrow[:, None] + cols[None, :], m)
    n = _apply_weight(x * rstd[:, None], w_ptr, cols, cmask, WMODE, DTYPE)
    if HAS_GATE:
        g = load_f32(g_ptr + grow[:, None] + cols[None, :] * sgd, m)
        n = rround(g * n, DTYPE)
    res = load_f32(r_ptr + rrow[:, None] + cols[None, :] * srd, m)
    return rround(res + n, DTYPE)


# D stays specialized: with it in do_not_specialize Triton cannot prove the column mask and the
# row offsets 16-byte aligned, every access became a 2-byte ld/st and MODE 2 spilled at 255
# registers (notes/rms_diffusers_tiling.md); D is fixed per model, so this costs no recompiles.
@triton.jit(do_not_specialize=["n_rows", "S", "factor", "eps"])
def _rms_d_kernel(
    x_ptr, r_ptr, g_ptr, s_ptr, w_ptr, w2_ptr, h_ptr, o_ptr, t_ptr,
    n_rows, S, D,
    sxb, sxs, srb, srs, srd, sgb, sgs, sgd, ssb, sss, ssd, stb, sts, std,
    factor, eps,
    MODE: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr,
    WMODE: tl.constexpr, W2MODE: tl.constexpr, DTYPE: tl.constexpr,
    W: tl.constexpr, VEC: tl.constexpr, BR: tl.constexpr, NCH: tl.constexpr,
    READBACK: tl.constexpr = False,
):
    """Program p: rows ``p*BR ..`` of the flattened [B*S] rows; every pass walks the row in NCH
    chunks of ``VEC * W`` columns. Outputs are contiguous [B*S, D]. ``READBACK`` (MODE 2): the
    last pass loads the ``h`` stored in pass 2 instead of recomputing it from three operands."""
    CW: tl.constexpr = VEC * W
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    b = (rows // S).to(tl.int64)
    s = (rows % S).to(tl.int64)
    xrow = b * sxb + s * sxs
    orow = rows.to(tl.int64) * D
    lane_cols = tl.arange(0, CW)
    eps32 = tl.cast(eps, tl.float32)  # the interpreter keeps Python floats in fp64
    fac32 = tl.cast(factor, tl.float32)

    # pass 1: the sum of squares of x (update) in the reduce kernel's order
    acc = tl.zeros([BR, CW], dtype=tl.float32)
    for k in range(NCH):
        cols = k * CW + lane_cols
        m = rmask[:, None] & (cols < D)[None, :]
        v = load_f32(x_ptr + xrow[:, None] + cols[None, :], m)  # absent columns: 0
        acc = acc + v * v
    rstd = _rstd(_reduce_lanes(acc, BR, W, VEC), fac32, eps32)

    if MODE == 0:
        srow = b * ssb + s * sss
        trow = b * stb + s * sts
        for k in range(NCH):
            cols = k * CW + lane_cols
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            x = load_f32(x_ptr + xrow[:, None] + cols[None, :], m)
            n = _apply_weight(x * rstd[:, None], w_ptr, cols, cmask, WMODE, DTYPE)
            if HAS_SCALE:
                sc = load_f32(s_ptr + srow[:, None] + cols[None, :] * ssd, m)
                n = rround(n * rround(1.0 + sc, DTYPE), DTYPE)
            if HAS_SHIFT:
                sh = load_f32(t_ptr + trow[:, None] + cols[None, :] * std, m)
                n = rround(n + sh, DTYPE)
            tl.store(o_ptr + orow[:, None] + cols[None, :], round_to(n, DTYPE), mask=m)
    else:
        rrow = b * srb + s * srs
        grow = b * sgb + s * sgs
        acc2 = tl.zeros([BR, CW], dtype=tl.float32)
        for k in range(NCH):
            cols = k * CW + lane_cols
            cmask = cols < D
            m = rmask[:, None] & cmask[None, :]
            h = _gated_h(x_ptr, r_ptr, g_ptr, w_ptr, xrow, rrow, grow, cols, m, cmask, rstd, srd, sgd,
                         HAS_GATE, WMODE, DTYPE)
            tl.store(h_ptr + orow[:, None] + cols[None, :], round_to(h, DTYPE), mask=m)
            if MODE == 2:
                hm = tl.where(m, h, 0.0)
                acc2 = acc2 + hm * hm
        if MODE == 2:
            rstd2 = _rstd(_reduce_lanes(acc2, BR, W, VEC), fac32, eps32)
            srow = b * ssb + s * sss
            if READBACK:
                # Only this program wrote these rows of h, but not necessarily this thread: the
                # read-back tile has the store's shape, pointers and mask, yet Triton gives each
                # memory op its own layout. The sm_90a build of the default tiling (BR 16, 4 warps,
                # CW 128) stores h as 1 element x 32 lanes x 4 warps along the columns and
                # re-loads it as 8 elements x (2 x 16) lanes x 4 warps along the rows (the
                # layout-conversion pass rematerializes the load in its users' layout); a layout
                # with more threads than elements (BR 1, 8 warps) stores from one replica only.
                # So threads read other threads' (other warps') global writes: bar.sync makes the
                # CTA's writes visible to all its threads. One barrier per program, after pass 2.
                tl.debug_barrier()
            for k in range(NCH):
                cols = k * CW + lane_cols
                cmask = cols < D
                m = rmask[:, None] & cmask[None, :]
                if READBACK:
                    # the stored value widened exactly: the fp32 value pass 2 rounded and stored
                    h = load_f32(h_ptr + orow[:, None] + cols[None, :], m)
                else:
                    h = _gated_h(x_ptr, r_ptr, g_ptr, w_ptr, xrow, rrow, grow, cols, m, cmask, rstd, srd, sgd,
                                 HAS_GATE, WMODE, DTYPE)
                n = _apply_weight(h * rstd2[:, None], w2_ptr, cols, cmask, W2MODE, DTYPE)
                if HAS_SCALE:
                    sc = load_f32(s_ptr + srow[:, None] + cols[None, :] * ssd, m)
                    n = rround(n * rround(1.0 + sc, DTYPE), DTYPE)
                tl.store(o_ptr + orow[:, None] + cols[None, :], round_to(n, DTYPE), mask=m)


# ------------------------------------------------------------------------------------ host side


def _wmode(w: torch.Tensor | None) -> int:
    if w is None:
        return 0
    return 1 if w.dtype in _HALF else 2


def _row_operand(t: torch.Tensor, x: torch.Tensor):
    """``t`` broadcast to x's shape as eager broadcasts it (``[B, D]`` -> ``[B, 1, D]`` first, as
    the reference's ``_per_token``); None when it does not broadcast."""
    if t.dim() == 2 and x.dim() == 3:
        t = t[:, None]
    try:
        return t.expand(x.shape)
    except RuntimeError:
        return None


def _weight_reason(w, x: torch.Tensor, name: str) -> str | None:
    if w is None:
        return None
    if not isinstance(w, torch.Tensor):
        return f"{name} must be a tensor or None"
    D = x.shape[-1]
    if w.dim() != 1 or w.shape[0] != D:
        return f"{name} must be [D={D}], got {tuple(w.shape)}"
    if w.dtype in _HALF:
        if w.dtype != x.dtype:
            return f"{name} is {w.dtype} but the rows are {x.dtype} (eager would promote)"
    elif w.dtype == torch.float32:
        if x.dtype != torch.float32:
            return f"{name} is fp32 but the rows are {x.dtype} (the output would be fp32: not handled)"
    else:
        return f"{name} dtype {w.dtype} not supported"
    return None


def _unsupported_reason(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
    scale: torch.Tensor | None,
    weights: tuple,
    eps: float,
    shift: torch.Tensor | None = None,
) -> str | None:
    """Why the kernel does not reproduce eager for these arguments (None: it does). ``x`` is the
    normed input (update in the residual modes), ``residual`` None in MODE 0 (the only mode with a
    ``shift``)."""
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if not 1 <= x.dim() <= 3:
        return f"rows must be [D], [N, D] or [B, S, D], got {x.dim()} dims"
    tensors = [x]
    for name, t in (("residual", residual), ("gate", gate), ("scale", scale), ("shift", shift)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor or None"
        if t.dtype != x.dtype:
            return f"{name} is {t.dtype} but the rows are {x.dtype} (eager would promote)"
        tensors.append(t)
    for i, w in enumerate(weights):
        reason = _weight_reason(w, x, ("weight", "next_weight")[i])
        if reason:
            return reason
        if w is not None:
            tensors.append(w)
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "eps must be a Python number"
    D = x.shape[-1]
    if D == 0:
        return "rows of width 0"
    if 96 < D < 128:
        return f"width {D}: torch's reduce layout between 97 and 127 is not verified on the GPU"
    if D >= 128 and D % 4:
        return f"width {D} >= 128 is not a multiple of 4 (torch's vectorized mean needs 16-byte rows)"
    if x.numel() >= 2**31:
        return "input has >= 2^31 elements: the reduction is split into 32-bit sub-iterators (not reproduced)"
    if D > 1 and x.stride(-1) != 1:
        return "the normed rows are not contiguous (stride(-1) != 1): torch's mean would reduce another way"
    if any(n > 1 and st < D for n, st in zip(x.shape[:-1], x.stride()[:-1])):
        return "rows overlap or interleave (a leading stride < D): x.float() would keep that layout"
    rows = x.numel() // D
    if reduce_launch(D, rows)[2]:
        return f"width {D} with {rows} rows: torch splits each row's mean across warps (not reproduced)"
    if residual is not None and tuple(residual.shape) != tuple(x.shape):
        return f"residual {tuple(residual.shape)} and update {tuple(x.shape)} differ in shape"
    views = [x] + ([residual] if residual is not None else [])
    for name, t in (("gate", gate), ("scale", scale), ("shift", shift)):
        if t is None:
            continue
        e = _row_operand(t, x)
        if e is None:
            return f"{name} {tuple(t.shape)} does not broadcast to the rows {tuple(x.shape)}"
        views.append(e)
    if as_3d(*views) is None:
        return "leading dims of the operands cannot be viewed as two strided dims"
    return None


def _views(x, residual, gate, scale, shift=None) -> list:
    views = [x, residual if residual is not None else x]
    for t in (gate, scale, shift):
        views.append(_row_operand(t, x) if t is not None else x)
    return views


def _recipe(mode: int, x, residual, gate, scale, w, w2, eps: float, block_rows: int | None = None,
            num_warps: int | None = None, readback: bool | None = None, shift=None) -> tuple | None:
    """(grid, scalar arguments, constexprs) of a launch from its inputs' geometry; None for no
    rows (cached per geometry by the public functions, common/plans.py)."""
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if rows == 0:
        return None
    W, VEC, _ = reduce_launch(D, rows)
    (B, S, _), strides = as_3d(*_views(x, residual, gate, scale, shift))
    (sxb, sxs, _), (srb, srs, srd), (sgb, sgs, sgd), (ssb, sss, ssd), (stb, sts, std) = strides
    CW = VEC * W
    NCH = cdiv(D, CW)
    if block_rows is None:
        block_rows = 1 if mode == 2 else max(1, min(8, next_pow2(rows), _TILE * 8 // CW))
    if num_warps is None:
        num_warps = max(1, min(8, block_rows * CW // 128))
    if readback is None:
        readback = mode == 2
    BR = block_rows
    if BR & (BR - 1):
        raise ValueError(f"block_rows must be a power of two, got {BR}")
    scalars = (rows, S, D, sxb, sxs, srb, srs, srd, sgb, sgs, sgd, ssb, sss, ssd, stb, sts, std,
               mean_factor(rows, D), float(eps))
    consts = dict(MODE=mode, HAS_GATE=gate is not None, HAS_SCALE=scale is not None,
                  HAS_SHIFT=mode == 0 and shift is not None,
                  WMODE=_wmode(w), W2MODE=_wmode(w2), DTYPE=tl_dtype(x.dtype),
                  W=W, VEC=VEC, BR=BR, NCH=NCH, READBACK=mode == 2 and bool(readback),
                  num_warps=num_warps, enable_fp_fusion=False, enable_reflect_ftz=False)
    return (cdiv(rows, BR),), scalars, consts


def _fire(mode: int, r: tuple | None, x, residual, gate, scale, w, w2, shift=None):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if mode != 0 else out
    if r is None:
        return out, h
    grid, scalars, consts = r
    views = _views(x, residual, gate, scale, shift)
    wt = w.contiguous() if w is not None else x
    wt2 = w2.contiguous() if w2 is not None else x
    launch(_rms_d_kernel, grid, x, views[1], views[2], views[3], wt, wt2, h, out, views[4], *scalars, **consts)
    return out, h


def _launch(mode: int, x, residual, gate, scale, w, w2, eps: float, block_rows: int | None = None,
            num_warps: int | None = None, readback: bool | None = None, shift=None):
    """Run MODE ``mode``; returns ``(out, h)`` (``h is out`` in MODE 0). ``block_rows`` (a power of
    two), ``num_warps`` and ``readback`` (MODE 2 only: re-read the stored ``h`` instead of
    recomputing it) choose the tiling, never the bits. Defaults (None) are the fastest launches of
    the H200 sweep over Z-Image's shapes (bench/results/probe_rms_diffusers_tiling_h200.csv, D
    specialized): MODE 0/1 up to 8 rows on 8 warps (1 warp per 128-column chunk row), MODE 2 one
    row per program, one warp per 128 columns, with read-back."""
    return _fire(mode, _recipe(mode, x, residual, gate, scale, w, w2, eps, block_rows, num_warps, readback, shift),
                 x, residual, gate, scale, w, w2, shift)


_RECIPES = {mode: Recipes() for mode in (0, 1, 2)}


def _cached(mode: int, key: tuple | None, x, residual, gate, scale, w, w2, eps: float, shift=None):
    """The launch with its predicate and recipe cached per call key (common/plans.py)."""
    weights = (w,) if mode != 2 else (w, w2)
    r = _RECIPES[mode].checked(key, lambda: _unsupported_reason(x, residual, gate, scale, weights, eps, shift),
                               lambda: _recipe(mode, x, residual, gate, scale, w, w2, eps, shift=shift))
    return _fire(mode, r, x, residual, gate, scale, w, w2, shift)


# ---- custom ops (one opaque node for torch.compile)


@torch.library.custom_op("ditfuse::rms_norm_diffusers_scale", mutates_args=())
def _rms_scale_op(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
                  shift: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(0, x, None, None, scale, weight, None, eps, shift=shift)[0]


@_rms_scale_op.register_fake
def _(x, weight, scale, eps, shift=None):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("ditfuse::gate_residual_rms_norm_diffusers", mutates_args=())
def _gr_rms_op(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
               weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(1, update, residual, gate, None, weight, None, eps)[1]


@_gr_rms_op.register_fake
def _(residual, gate, update, weight, eps):
    return torch.empty(update.shape, dtype=update.dtype, device=update.device)


@torch.library.custom_op("ditfuse::gate_residual_rms_norm_diffusers_scale", mutates_args=())
def _gr_rms_scale_op(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
                     out_weight: torch.Tensor | None, next_weight: torch.Tensor | None,
                     scale: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, h = _launch(2, update, residual, gate, scale, out_weight, next_weight, eps)
    return h, out


@_gr_rms_scale_op.register_fake
def _(residual, gate, update, out_weight, next_weight, scale, eps):
    e = torch.empty(update.shape, dtype=update.dtype, device=update.device)
    return e, torch.empty_like(e)


# ---- public API


def can_use_rms_norm_diffusers_scale(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None,
                                     eps: float, shift: torch.Tensor | None = None) -> bool:
    """True when :func:`rms_norm_diffusers_scale` reproduces eager bit for bit. Rejected (False):
    a non-tensor input or dtype other than bf16/fp16/fp32; rows of more than 3 dims; a weight not
    [D], or bf16/fp16 of another dtype than the rows, or fp32 with bf16/fp16 rows (fp32 output),
    or of another dtype; a scale of another dtype or not broadcasting to the rows (``[B, D]``,
    ``[B, 1, D]``, ``[B, S, D]``); tensors on different devices / on the CPU without
    TRITON_INTERPRET=1; grad required with grad mode on; eps not a number; D = 0; 96 < D < 128
    (torch's reduce layout there is not verified); D >= 128 not a multiple of 4; >= 2^31
    elements; rows not contiguous (stride(-1) != 1) or leading strides < D; shapes for which torch
    splits a row's mean across warps (D of several thousand with few rows... e.g. D >= 8192);
    operand layouts whose leading dims are not two strided dims. A ``shift`` is rejected as the
    scale is (dtype, broadcast, layout)."""
    return _unsupported_reason(x, None, None, scale, (weight,), eps, shift) is None


def rms_norm_diffusers_scale(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None,
                             eps: float, shift: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r(RMS_d(x; weight) * r(1 + scale))`` (``scale=None``: ``RMS_d(x; weight)``), then
    with ``shift`` ``r(out + shift)``; bit-exact vs torch 2.11 CUDA eager Z-Image's
    ``attention_norm1(x) * (1.0 + scale)`` and LTX-Video's ``norm1(h) * (1 + scale) + shift``
    (module doc). ``scale`` / ``shift`` are raw modulation chunks ([B, D], [B, 1, D] or
    [B, S, D], any strides); the output is a new contiguous tensor of x's shape and dtype. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_rms_norm_diffusers_scale` is False."""
    return _keyed_scale(None, x, weight, scale, eps, shift)


def _keyed_scale(key, x, weight, scale, eps, shift=None):
    if use_custom_op():
        reason = _unsupported_reason(x, None, None, scale, (weight,), eps, shift)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.rms_norm_diffusers_scale(x, weight, scale, float(eps), shift)
    key = call_key((x, weight, scale, eps, shift)) if key is None else key
    return _cached(0, key, x, None, None, scale, weight, None, eps, shift)[0]


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
rms_norm_diffusers_scale.keyed = _keyed_scale


def can_use_gate_residual_rms_norm_diffusers(residual: torch.Tensor, gate: torch.Tensor | None,
                                             update: torch.Tensor, weight: torch.Tensor | None,
                                             eps: float) -> bool:
    """True when :func:`gate_residual_rms_norm_diffusers` reproduces eager bit for bit: the
    rejections of :func:`can_use_rms_norm_diffusers_scale` for ``update`` (and ``gate`` in the
    scale's place), plus a residual of another shape or dtype than ``update``."""
    return _unsupported_reason(update, residual, gate, None, (weight,), eps) is None


def gate_residual_rms_norm_diffusers(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
                                     weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``h = r(residual + r(gate * RMS_d(update; weight)))`` (``gate=None``:
    ``r(residual + RMS_d(update; weight))``), bit-exact vs torch 2.11 CUDA eager Z-Image
    ``x + gate * ffn_norm2(ffn_out)``. ``gate`` is the block's already rounded ``tanh(chunk)``.
    Returns a new contiguous tensor. Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_gate_residual_rms_norm_diffusers` is False."""
    return _keyed_gr(None, residual, gate, update, weight, eps)


def _keyed_gr(key, residual, gate, update, weight, eps):
    if use_custom_op():
        reason = _unsupported_reason(update, residual, gate, None, (weight,), eps)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.gate_residual_rms_norm_diffusers(residual, gate, update, weight, float(eps))
    key = call_key((residual, gate, update, weight, eps)) if key is None else key
    return _cached(1, key, update, residual, gate, None, weight, None, eps)[1]


gate_residual_rms_norm_diffusers.keyed = _keyed_gr


def can_use_gate_residual_rms_norm_diffusers_scale(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor, out_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
) -> bool:
    """True when :func:`gate_residual_rms_norm_diffusers_scale` reproduces eager bit for bit: the
    rejections of :func:`can_use_gate_residual_rms_norm_diffusers`, for both weights, and of the
    scale as in :func:`can_use_rms_norm_diffusers_scale`."""
    return _unsupported_reason(update, residual, gate, scale, (out_weight, next_weight), eps) is None


def gate_residual_rms_norm_diffusers_scale(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor, out_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = r(residual + r(gate * RMS_d(update; out_weight)))``, ``n = r(RMS_d(h; next_weight) *
    r(1 + scale))`` (``scale=None``: ``n = RMS_d(h; next_weight)``), one pass per row; returns
    ``(h, n)`` (new contiguous tensors), bit-exact vs torch 2.11 CUDA eager (Z-Image's attention
    residual + ``ffn_norm1(x) * scale_mlp``). Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_gate_residual_rms_norm_diffusers_scale` is False."""
    return _keyed_gr_scale(None, residual, gate, update, out_weight, next_weight, scale, eps)


def _keyed_gr_scale(key, residual, gate, update, out_weight, next_weight, scale, eps):
    if use_custom_op():
        reason = _unsupported_reason(update, residual, gate, scale, (out_weight, next_weight), eps)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.gate_residual_rms_norm_diffusers_scale(
            residual, gate, update, out_weight, next_weight, scale, float(eps))
    key = call_key((residual, gate, update, out_weight, next_weight, scale, eps)) if key is None else key
    out, h = _cached(2, key, update, residual, gate, scale, out_weight, next_weight, eps)
    return h, out


gate_residual_rms_norm_diffusers_scale.keyed = _keyed_gr_scale


__all__ = [
    "rms_norm_diffusers_scale", "can_use_rms_norm_diffusers_scale",
    "gate_residual_rms_norm_diffusers", "can_use_gate_residual_rms_norm_diffusers",
    "gate_residual_rms_norm_diffusers_scale", "can_use_gate_residual_rms_norm_diffusers_scale",
    "reduce_launch", "mean_factor",
]
