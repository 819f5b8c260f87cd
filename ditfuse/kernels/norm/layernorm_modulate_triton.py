"""LayerNorm (+ the residual add before it, + adaLN modulate after it), both contracts, one kernel.

``layernorm_modulate(x, scale, shift, eps, weight=None, bias=None, norm_dtype=None)``::

    n   = r_ln(LN(x) [* w + b])                       LN in torch's order, one rounding
    out = r_out(r_s(r_m(n * r_sc(1 + scale)) + shift))     (when scale/shift are given)
    out = r_out(r_m(n * r_sc(1 + scale)))                  (scale alone: Qwen-Image 2.1's
                                                            shift-free ``norm(x) * (1 + scale)``)

``gate_residual_layernorm_modulate(residual, gate, update, scale, shift, eps, ...)``::

    h = r_res(residual + r_p(gate * update))          (gate None: r_res(residual + update))
    n, out as above on h;  returns (h, out)

Each ``r_*`` is a rounding to the dtype the eager op stores, derived with torch's promotion
rules from the inputs' dtypes: ``r_p`` promote(gate, update), ``r_res`` the residual's dtype,
``r_ln`` the LayerNorm's input dtype (x's, or ``norm_dtype`` for diffusers' ``FP32LayerNorm`` on
``x.float()``), ``r_sc`` scale's dtype (``1 + scale`` keeps it), ``r_m`` promote(ln, scale),
``r_s`` promote(m, shift), ``r_out`` x's dtype when ``norm_dtype`` is given (diffusers'
``.type_as(x)``), else ``r_s``. FLUX.1 runs it all in bf16 (every ``r`` is r16); Wan in fp32
with one r16 at the end. The affine form is ``fma(w, rstd * (x - mean), b)``, as nvcc contracts
torch's ``gamma * (rstd * (x - mean)) + beta``.

``LN`` is torch 2.11's CUDA ``vectorized_layer_norm_kernel`` reproduced bit for bit: per-thread
Welford over 4-element vectors in element order, the shfl-down fold tree and the cross-warp tree,
IEEE ``m2 / N``, ``rsqrt.approx`` (common/welford.py documents each step). The 128 per-thread
states of a row are torch's 128 threads; each program handles R rows and folds them with one
``tl.reduce`` whose result at lane 0 is torch's tree (notes/layernorm.md, "v2 performance
design"). Launched with ``enable_fp_fusion=False``: eager never contracts ``a * b + c`` across
ops, and the FMAs torch's own code has are written out with ``fma_rn``.

Contracts: ``EXACT=True`` (the functions above) is bit-exact vs torch 2.11 CUDA eager.
``EXACT=False`` (``*_fp32``, contract close, quality="high" only) keeps torch's statistics but
drops every intermediate rounding: ``out = r_out(LN32(h32) * (1 + scale) + shift)`` with
``h32 = residual + gate * update`` unrounded (``h`` itself is still stored rounded, as the
residual stream is) — fewer roundings, admitted by the fp64 test (contracts/admission.py).

Shapes: x / residual / update [B, S, D] (any strides); scale, shift, gate [B, D], [B, 1, D] or
[B, S, D]; weight, bias [D]. Outputs are new contiguous tensors.
"""

from __future__ import annotations

import functools

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.elementwise import load_f32, load_row_tile
from ditfuse.kernels.common.host import (
    cdiv,
    SUPPORTED_DTYPES,
    device_reason,
    grad_reason,
    in_eager_layout,
    interpreter_on,
    held_steps,
    LN_WARP_MAX_STEPS,
    promote,
    rows_per_program,
    tl_dtype,
    use_custom_op,
    WARP_MAX_STEPS,
    warp_plan,
)
from ditfuse.kernels.common.launch import launch
from ditfuse.kernels.common.rounding import round_to, rround
from ditfuse.kernels.common.warp import warp_layout_ok, warp_rows
from ditfuse.kernels.common.welford import (
    LN_THREADS,
    LN_VEC,
    fma_rn,
    rsqrt_approx,
    welford_fold_4warps_in_registers,
    welford_fold_rows,
    welford_update,
)
from ditfuse.kernels.common.plans import Recipes, call_key
from ditfuse.kernels.env import env
from ditfuse.kernels.errors import UnsupportedInput

_MAX_N = 1 << 24  # torch: N <= 2**24 so that a float count is exact, else RowwiseMoments
# RES modes
_NO_RES, _ADD, _GATED = 0, 1, 2


@triton.jit
def _vec_tile(ptr, sd, vec, k4, valid_t):
    """A [D] parameter (LayerNorm weight or bias) as a [128, 1, 4] tile."""
    offs = (vec[:, None, None] * 4 + k4[None, None, :]).to(tl.int64) * sd
    return load_f32(ptr + offs, valid_t[:, None, None])


@triton.jit
def _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
              vec, k4, valid, RES: tl.constexpr, EXACT: tl.constexpr,
              P_DT: tl.constexpr, H_DT: tl.constexpr, gt_ptr, gtsd, G_TAB: tl.constexpr):
    """The LayerNorm input tile: x, or the residual sum h (rounded as eager stores it when EXACT,
    the fp32 sum otherwise). ``G_TAB``: the gate is ``f32(table[d]) + f32(gate)`` (one fp32 add:
    Wan's ``scale_shift_table + temb.float()`` chunk, formed here instead of read)."""
    x = load_row_tile(x_ptr, b, s, xsb, xss, xsd, vec, k4, valid)
    if RES != 0:
        u = load_row_tile(u_ptr, b, s, usb, uss, usd, vec, k4, valid)
        if RES == 2:
            g = load_row_tile(g_ptr, b, s, gsb, gss, gsd, vec, k4, valid)
            if G_TAB:
                g = load_row_tile(gt_ptr, b, s, 0, 0, gtsd, vec, k4, valid) + g
            u = g * u
            if EXACT:
                u = rround(u, P_DT)
        x = x + u
        if EXACT:
            x = rround(x, H_DT)
    return x


@triton.jit
def _pass2_input(x_ptr, g_ptr, u_ptr, h_ptr, b, s, out_row, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                 vec, k4, valid, RES: tl.constexpr, EXACT: tl.constexpr, P_DT: tl.constexpr, H_DT: tl.constexpr,
                 gt_ptr, gtsd, G_TAB: tl.constexpr):
    """The loop kernel's pass-2 tile. With a residual, the bit-exact kernel reads back the h it
    stored (the same threads wrote those elements in pass 1: same tile layout) instead of
    recomputing it from 2-3 inputs; the close kernel needs the unrounded sum and recomputes it."""
    if RES != 0 and EXACT:
        src = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
        return load_f32(h_ptr + src, valid)
    else:
        return _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                         vec, k4, valid, RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)


@triton.jit
def _welford4(mean, m2, x, j, valid, A0: tl.constexpr, A1: tl.constexpr):
    """Four Welford updates, in element order, with step j's [A0, A1, 4] tile (cuWelfordOnlineSum):
    [128 threads, R rows, 4] in the 128-thread kernel, [R rows, 32 lanes, 4] in the warp kernel.
    ``valid`` ([A0, A1]-broadcastable): which threads hold the step; None: all of them."""
    x02, x13 = tl.split(tl.reshape(x, [A0, A1, 2, 2]))
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    mean, m2 = welford_update(mean, m2, x0, j * 4 + 1.0, valid)
    mean, m2 = welford_update(mean, m2, x1, j * 4 + 2.0, valid)
    mean, m2 = welford_update(mean, m2, x2, j * 4 + 3.0, valid)
    mean, m2 = welford_update(mean, m2, x3, j * 4 + 4.0, valid)
    return mean, m2


@triton.jit
def _epilogue(n, w, bb, sc, sh, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr,
              EXACT: tl.constexpr, LN_DT: tl.constexpr, SC_DT: tl.constexpr, M_DT: tl.constexpr,
              S_DT: tl.constexpr, AFFINE_FMA: tl.constexpr):
    """The affine and eager's modulate roundings on the normalised fp32 tile ``n``; w, bb, sc, sh
    are the loaded weight / bias / scale / shift tiles (unused ones may be anything)."""
    if HAS_W:
        if HAS_B and AFFINE_FMA:
            n = fma_rn(w, n, bb)
        elif HAS_B:
            n = w * n + bb
        else:
            n = w * n
    elif HAS_B:
        n = n + bb
    if EXACT:
        n = rround(n, LN_DT)
    if MODULATE == 1:
        if EXACT:
            n = rround(rround(n * rround(1.0 + sc, SC_DT), M_DT) + sh, S_DT)
        else:
            n = n * (1.0 + sc) + sh
    elif MODULATE == 2:  # scale without shift
        if EXACT:
            n = rround(n * rround(1.0 + sc, SC_DT), M_DT)
        else:
            n = n * (1.0 + sc)
    return n


@triton.jit
def _apply(x, sc_ptr, sh_ptr, w_ptr, bias_ptr, out_ptr, b, s, out_row, vec, k4, valid_t, valid, mean_r, rstd,
           wsd, bsd, scsb, scss, scsd, shsb, shss, shsd,
           HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr, EXACT: tl.constexpr,
           LN_DT: tl.constexpr, SC_DT: tl.constexpr, M_DT: tl.constexpr, S_DT: tl.constexpr,
           OUT_DT: tl.constexpr, AFFINE_FMA: tl.constexpr,
           sct_ptr, sht_ptr, sctsd, shtsd, SC_TAB: tl.constexpr, SH_TAB: tl.constexpr):
    """Pass 2 on one tile: normalise (torch's one rounding), the affine, eager's modulate
    roundings, store. ``SC_TAB`` / ``SH_TAB``: scale / shift is ``f32(table[d]) + f32(operand)``
    (one fp32 add, as eager's ``scale_shift_table + temb.float()``)."""
    n = rstd * (x - mean_r)
    w = _vec_tile(w_ptr, wsd, vec, k4, valid_t) if HAS_W else 0.0
    bb = _vec_tile(bias_ptr, bsd, vec, k4, valid_t) if HAS_B else 0.0
    sc = load_row_tile(sc_ptr, b, s, scsb, scss, scsd, vec, k4, valid) if MODULATE else 0.0
    sh = load_row_tile(sh_ptr, b, s, shsb, shss, shsd, vec, k4, valid) if MODULATE == 1 else 0.0
    if SC_TAB:
        sc = load_row_tile(sct_ptr, b, s, 0, 0, sctsd, vec, k4, valid) + sc
    if SH_TAB:
        sh = load_row_tile(sht_ptr, b, s, 0, 0, shtsd, vec, k4, valid) + sh
    n = _epilogue(n, w, bb, sc, sh, HAS_W, HAS_B, MODULATE, EXACT, LN_DT, SC_DT, M_DT, S_DT, AFFINE_FMA)
    dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
    tl.store(out_ptr + dst, round_to(n, OUT_DT), mask=valid)


# R independent rows per program; per row the arithmetic is torch's, op for op. The per-thread
# Welford runs on [128, R] states, the reciprocal ``1 / count'`` is one scalar per step (count' is
# the same for every thread that holds data at that step; threads past the last vector keep
# their state through ``valid``), and the fold over the 128 threads is one ``tl.reduce``.
#
# Two ways over a row's J steps (same arithmetic, same bits):
# - ``JS`` = J > 0 (rows of at most 6 vectors per thread, D <= 3072): every step's tile is
#   loaded first, into a tuple, before the first Welford update -- all of a row's loads in
#   flight at once, one memory latency per row -- and pass 2 normalises the tiles still held in
#   registers (no second read). The held value is what the LayerNorm reads: x, or h as eager
#   stores it (kept in its storage dtype: exact, half the registers for bf16); the close kernel
#   holds the unrounded fp32 sum.
# - ``JS`` = 0: a ``while`` loop over the runtime J, one dependent load per step, and pass 2
#   reads the row again (x, or the h it stored). For wide rows, whose tiles would not fit in
#   registers; Triton 3.6's interpreter cannot index with a scalar argument under numpy 2 in
#   ``range(J)``, hence ``while``.
# S, N, NVEC, J are not specialised (one compile serves every token count); strides are, so
# contiguous rows get vector loads.
@triton.jit(do_not_specialize=["M", "S", "N", "NVEC", "J", "eps"])
def _ln_kernel(
    x_ptr, g_ptr, u_ptr, w_ptr, bias_ptr, sc_ptr, sh_ptr, h_ptr, out_ptr, gt_ptr, sct_ptr, sht_ptr,
    M, S, N, NVEC, J, eps,
    xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd, wsd, bsd,
    scsb, scss, scsd, shsb, shss, shsd, gtsd, sctsd, shtsd,
    RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr,
    EXACT: tl.constexpr,
    P_DT: tl.constexpr, H_DT: tl.constexpr, LN_DT: tl.constexpr, SC_DT: tl.constexpr,
    M_DT: tl.constexpr, S_DT: tl.constexpr, OUT_DT: tl.constexpr,
    R: tl.constexpr, AFFINE_FMA: tl.constexpr = True, JS: tl.constexpr = 0, FULL: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, G_TAB: tl.constexpr = False, SC_TAB: tl.constexpr = False,
    SH_TAB: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < M
    rows = tl.where(row_ok, rows, 0)
    b = rows // S
    s = rows % S
    # Output rows start at rows * N with N % 4 == 0 (the predicate guarantees it): telling
    # Triton lets the stores stay 4-element vectors in the load layout (no layout conversion).
    out_row = tl.multiple_of(rows * N, 4)
    t = tl.arange(0, LN_THREADS)
    k4 = tl.arange(0, LN_VEC)
    mean = tl.zeros([LN_THREADS, R], dtype=tl.float32)
    m2 = tl.zeros([LN_THREADS, R], dtype=tl.float32)

    if JS > 0:
        # Pass 1: all loads, then h's stores and the Welford updates in element order.
        held = ()
        for j in tl.static_range(JS):
            vec = j * LN_THREADS + t
            if FULL:  # every vector exists and tail rows read row 0 (clamped): no predicate
                x = _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                              vec, k4, None, RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            else:
                valid = (vec < NVEC)[:, None, None] & row_ok[None, :, None]
                x = _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                              vec, k4, valid, RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            if EXACT:
                x = round_to(x, H_DT)  # exact: x is a value of H_DT (x itself, or h rounded)
            held = held + (x,)
        for j in tl.static_range(JS):
            vec = j * LN_THREADS + t
            valid_t = vec < NVEC
            if RES != 0:
                dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
                hj = held[j] if EXACT else round_to(held[j], H_DT)  # exact: held in H_DT already
                tl.store(h_ptr + dst, hj, mask=valid_t[:, None, None] & row_ok[None, :, None])
            mean, m2 = _welford4(mean, m2, held[j].to(tl.float32), j, valid_t[:, None], LN_THREADS, R)
    else:
        # Pass 1: per-thread Welford, vectors t, t + 128, ... in element order. PREFETCH: step
        # j + 1's tile is loaded before step j's updates (two tiles live), so each row keeps a
        # load in flight while it computes; past the last step its mask is all false (no access).
        j = 0
        if PREFETCH:
            nxt = _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                            t, k4, (t < NVEC)[:, None, None] & row_ok[None, :, None], RES, EXACT, P_DT, H_DT,
                            gt_ptr, gtsd, G_TAB)
        while j < J:
            vec = j * LN_THREADS + t
            valid_t = vec < NVEC
            valid = valid_t[:, None, None] & row_ok[None, :, None]
            if PREFETCH:
                x = nxt
                nxt = _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                                vec + LN_THREADS, k4, (vec + LN_THREADS < NVEC)[:, None, None] & row_ok[None, :, None],
                                RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            else:
                x = _ln_input(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                              vec, k4, valid, RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            if RES != 0:
                dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
                tl.store(h_ptr + dst, round_to(x, H_DT), mask=valid)
            mean, m2 = _welford4(mean, m2, x, j, valid_t[:, None], LN_THREADS, R)
            j += 1
    nvecs_t = tl.maximum((NVEC - t + LN_THREADS - 1) // LN_THREADS, 0)
    count = tl.broadcast_to((nvecs_t * LN_VEC).to(tl.float32)[:, None], [LN_THREADS, R])

    # Shfl-down fold inside warps, then the shared-memory tree across the 4 warps.
    mean_r, m2_r, _ = welford_fold_rows(mean, m2, count, R)
    var = tl.math.div_rn(m2_r, N.to(tl.float32))
    rstd = rsqrt_approx(var + eps)
    mean_r = mean_r[None, :, None]
    rstd = rstd[None, :, None]

    # Pass 2: normalise, affine, modulate, store.
    if JS > 0:
        for j in tl.static_range(JS):
            vec = j * LN_THREADS + t
            valid_t = vec < NVEC
            valid = valid_t[:, None, None] & row_ok[None, :, None]
            _apply(held[j].to(tl.float32), sc_ptr, sh_ptr, w_ptr, bias_ptr, out_ptr, b, s, out_row, vec, k4,
                   valid_t, valid, mean_r, rstd, wsd, bsd, scsb, scss, scsd, shsb, shss, shsd,
                   HAS_W, HAS_B, MODULATE, EXACT, LN_DT, SC_DT, M_DT, S_DT, OUT_DT, AFFINE_FMA,
                   sct_ptr, sht_ptr, sctsd, shtsd, SC_TAB, SH_TAB)
    else:
        # Pass 2 over the row again (_pass2_input), prefetched like pass 1.
        j = 0
        if PREFETCH:
            nxt = _pass2_input(x_ptr, g_ptr, u_ptr, h_ptr, b, s, out_row, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                               t, k4, (t < NVEC)[:, None, None] & row_ok[None, :, None], RES, EXACT, P_DT, H_DT,
                               gt_ptr, gtsd, G_TAB)
        while j < J:
            vec = j * LN_THREADS + t
            valid_t = vec < NVEC
            valid = valid_t[:, None, None] & row_ok[None, :, None]
            if PREFETCH:
                x = nxt
                nxt = _pass2_input(x_ptr, g_ptr, u_ptr, h_ptr, b, s, out_row, xsb, xss, xsd, gsb, gss, gsd, usb, uss,
                                   usd, vec + LN_THREADS, k4,
                                   (vec + LN_THREADS < NVEC)[:, None, None] & row_ok[None, :, None],
                                   RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            else:
                x = _pass2_input(x_ptr, g_ptr, u_ptr, h_ptr, b, s, out_row, xsb, xss, xsd, gsb, gss, gsd, usb, uss,
                                 usd, vec, k4, valid, RES, EXACT, P_DT, H_DT, gt_ptr, gtsd, G_TAB)
            _apply(x, sc_ptr, sh_ptr, w_ptr, bias_ptr, out_ptr, b, s, out_row, vec, k4,
                   valid_t, valid, mean_r, rstd, wsd, bsd, scsb, scss, scsd, shsb, shss, shsd,
                   HAS_W, HAS_B, MODULATE, EXACT, LN_DT, SC_DT, M_DT, S_DT, OUT_DT, AFFINE_FMA,
                   sct_ptr, sht_ptr, sctsd, shtsd, SC_TAB, SH_TAB)
            j += 1


@triton.jit
def _wtile(ptr, b, s, sb, ss, sd, vec, k4):
    """One [R, 32, 4] tile (row x lane x vector element) as fp32, unpredicated: lane ``l`` of warp
    r reads 4-element vector ``vec[l]`` of row (b[r], s[r])."""
    base = b * sb + s * ss
    offs = base[:, None, None] + (vec[None, :, None] * 4 + k4[None, None, :]).to(tl.int64) * sd
    return load_f32(ptr + offs, None)


@triton.jit
def _wvec(ptr, sd, vec, k4):
    """A [D] parameter as a [1, 32, 4] tile."""
    return load_f32(ptr + (vec[None, :, None] * 4 + k4[None, None, :]).to(tl.int64) * sd, None)


# One warp per row, for rows that are whole 128-thread steps (D % 512 == 0) of at most
# common/host.py's WARP_MAX_STEPS steps (LN_WARP_MAX_STEPS without a residual): R rows per program, warp r takes row r (R = 1 on the GPU,
# see common/warp.py). torch's thread t = lane + 32 * w
# is register set w of lane ``lane``, so its vectors t, t + 128, ... are held tiles
# ``held[4 * j + w]``; the per-thread Welford, the four logical warps' shfl-down trees and the
# cross-warp tree are torch's, with every count a constant (common/welford.py, "one warp per
# row"). Against the 128-thread kernel above: a quarter of the fold's instructions per row (one
# warp runs it, not four, and its reciprocals fold), no shared memory and no barrier. Same
# arithmetic, same bits.
@triton.jit(do_not_specialize=["M", "S", "N", "eps"])
def _ln_warp_kernel(
    x_ptr, g_ptr, u_ptr, w_ptr, bias_ptr, sc_ptr, sh_ptr, h_ptr, out_ptr, gt_ptr, sct_ptr, sht_ptr,
    M, S, N, eps,
    xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd, wsd, bsd,
    scsb, scss, scsd, shsb, shss, shsd, gtsd, sctsd, shtsd,
    RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MODULATE: tl.constexpr,
    EXACT: tl.constexpr,
    P_DT: tl.constexpr, H_DT: tl.constexpr, LN_DT: tl.constexpr, SC_DT: tl.constexpr,
    M_DT: tl.constexpr, S_DT: tl.constexpr, OUT_DT: tl.constexpr,
    R: tl.constexpr, JS: tl.constexpr, AFFINE_FMA: tl.constexpr = True,
    G_TAB: tl.constexpr = False, SC_TAB: tl.constexpr = False, SH_TAB: tl.constexpr = False,
):
    row_ok, b, s, out_row = warp_rows(M, S, N, R)
    lane = tl.arange(0, 32)
    k4 = tl.arange(0, LN_VEC)
    keep = row_ok[:, None, None]

    # Pass 1: every tile of the row, then h's stores; tile 4 * j + w is torch's thread
    # lane + 32 * w at step j.
    held = ()
    for j in tl.static_range(JS):
        for w in tl.static_range(4):
            vec = j * LN_THREADS + w * 32 + lane
            x = _wtile(x_ptr, b, s, xsb, xss, xsd, vec, k4)
            if RES != 0:
                u = _wtile(u_ptr, b, s, usb, uss, usd, vec, k4)
                if RES == 2:
                    g = _wtile(g_ptr, b, s, gsb, gss, gsd, vec, k4)
                    if G_TAB:
                        g = _wtile(gt_ptr, b, s, 0, 0, gtsd, vec, k4) + g
                    u = g * u
                    if EXACT:
                        u = rround(u, P_DT)
                x = x + u
            if EXACT:
                x = round_to(x, H_DT)  # exact: x itself, or h as eager stores it
            held = held + (x,)
    if RES != 0:
        for j in tl.static_range(JS):
            for w in tl.static_range(4):
                vec = j * LN_THREADS + w * 32 + lane
                dst = out_row[:, None, None] + (vec[None, :, None] * 4 + k4[None, None, :])
                hj = held[4 * j + w] if EXACT else round_to(held[4 * j + w], H_DT)
                tl.store(h_ptr + dst, hj, mask=keep)

    # Per-thread Welford of the four logical warps, each over its steps in element order.
    z = tl.zeros([R, 32], dtype=tl.float32)
    mean0, m20, mean1, m21, mean2, m22, mean3, m23 = z, z, z, z, z, z, z, z
    for j in tl.static_range(JS):
        mean0, m20 = _welford4(mean0, m20, held[4 * j].to(tl.float32), j, None, R, 32)
        mean1, m21 = _welford4(mean1, m21, held[4 * j + 1].to(tl.float32), j, None, R, 32)
        mean2, m22 = _welford4(mean2, m22, held[4 * j + 2].to(tl.float32), j, None, R, 32)
        mean3, m23 = _welford4(mean3, m23, held[4 * j + 3].to(tl.float32), j, None, R, 32)
    mean_r, m2_r = welford_fold_4warps_in_registers(mean0, m20, mean1, m21, mean2, m22, mean3, m23,
                                                    JS * 4, R)
    var = tl.math.div_rn(m2_r, N.to(tl.float32))
    rstd = rsqrt_approx(var + eps)[:, :, None]
    mean_r = mean_r[:, :, None]

    # Pass 2 on the held tiles.
    for j in tl.static_range(JS):
        for w in tl.static_range(4):
            vec = j * LN_THREADS + w * 32 + lane
            n = rstd * (held[4 * j + w].to(tl.float32) - mean_r)
            wt = _wvec(w_ptr, wsd, vec, k4) if HAS_W else 0.0
            bt = _wvec(bias_ptr, bsd, vec, k4) if HAS_B else 0.0
            sc = _wtile(sc_ptr, b, s, scsb, scss, scsd, vec, k4) if MODULATE else 0.0
            sh = _wtile(sh_ptr, b, s, shsb, shss, shsd, vec, k4) if MODULATE == 1 else 0.0
            if SC_TAB:
                sc = _wtile(sct_ptr, b, s, 0, 0, sctsd, vec, k4) + sc
            if SH_TAB:
                sh = _wtile(sht_ptr, b, s, 0, 0, shtsd, vec, k4) + sh
            n = _epilogue(n, wt, bt, sc, sh, HAS_W, HAS_B, MODULATE, EXACT, LN_DT, SC_DT, M_DT, S_DT, AFFINE_FMA)
            dst = out_row[:, None, None] + (vec[None, :, None] * 4 + k4[None, None, :])
            tl.store(out_ptr + dst, round_to(n, OUT_DT), mask=keep)


# ----------------------------------------------------------------------------- predicate


def _check_mod(name: str, t: object, x: torch.Tensor) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if t.dtype not in SUPPORTED_DTYPES:
        return f"{name} dtype {t.dtype} not supported (bf16, fp16, fp32)"
    if t.device != x.device:
        return f"{name} is on {t.device}, input on {x.device}"
    B, S, D = x.shape
    if tuple(t.shape) not in ((B, D), (B, 1, D), (B, S, D)):
        return f"{name} shape {tuple(t.shape)} is none of [B, D], [B, 1, D], [B, S, D] for x {[B, S, D]}"
    return None


def _check_param(name: str, t: object, D: int, x: torch.Tensor, norm_dtype: torch.dtype | None) -> str | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if t.dim() != 1 or t.shape[0] != D:
        return f"{name} shape {tuple(t.shape)} is not [{D}]"
    if t.device != x.device:
        return f"{name} is on {t.device}, input on {x.device}"
    if t.dtype not in SUPPORTED_DTYPES:
        return f"{name} dtype {t.dtype} not supported"
    if norm_dtype is None and t.dtype != x.dtype:
        return f"{name} dtype {t.dtype} != input dtype {x.dtype} (F.layer_norm's mixed-dtype path is not reproduced)"
    return None


def _unsupported_reason(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
    gate: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
    gate_table: torch.Tensor | None = None,
    scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> str | None:
    """Why the kernel does not reproduce eager for these inputs, or None when it does.

    Rejected (each a case where torch takes a path the kernel does not reproduce, or an input
    outside the contract):
    - x (the residual) not a 3-D [B, S, D] tensor of bf16 / fp16 / fp32; ``norm_dtype`` other
      than None / fp32 / x's dtype;
    - scale / shift / gate not [B, D], [B, 1, D] or [B, S, D], not bf16/fp16/fp32, on another
      device; shift without scale; update not x's shape and device;
    - weight / bias not [D], or (without ``norm_dtype``) of another dtype than x: F.layer_norm's
      mixed-dtype path;
    - not on CUDA (on CPU only under TRITON_INTERPRET=1, for tests): the contract is CUDA eager;
    - D == 0, D % 4 != 0 or D > 2**24: torch's dispatcher uses RowwiseMomentsCUDAKernel
      (512-thread WelfordOps block reduce, a different order);
    - the LayerNorm's input is x itself (no residual, no upcast copy), x is contiguous and its
      data pointer is not aligned to 4 elements: torch passes it through unchanged and the
      misaligned pointer sends it to RowwiseMomentsCUDAKernel too. (A non-contiguous x is copied
      by F.layer_norm into a fresh, aligned buffer first, and so is ``x.float()``; the residual
      sum h is a fresh eager output: all handled.)
    - eps not a real number; an input requiring grad in grad mode (no backward);
    - a ``*_table`` row not [D] / not bf16, fp16 or fp32 / on another device, or given without
      its operand (the gate only with a gated residual).
    """
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() != 3:
        return f"input must be [B, S, D], got shape {tuple(x.shape)}"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if norm_dtype not in (None, torch.float32, x.dtype):
        return f"norm_dtype {norm_dtype} is neither None, float32 nor the input dtype"
    if scale is None and shift is not None:
        return "shift given without scale"
    mods = [("scale", scale)] if scale is not None else []
    if shift is not None:
        mods.append(("shift", shift))
    if update is not None and gate is not None:
        mods.append(("gate", gate))
    for name, t in mods:
        reason = _check_mod(name, t, x)
        if reason:
            return reason
    D = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        reason = _check_param(name, t, D, x, norm_dtype)
        if reason:
            return reason
    tables = []
    for name, tab, operand in (("gate_table", gate_table, gate if update is not None else None),
                               ("scale_table", scale_table, scale), ("shift_table", shift_table, shift)):
        if tab is None:
            continue
        if operand is None:
            return f"{name} given without its operand"
        reason = _check_param(name, tab, D, x, torch.float32)
        if reason:
            return reason
        tables.append(tab)
    tensors = [x] + [t for _, t in mods] + [t for t in (weight, bias) if t is not None] + tables
    if update is not None:
        if not isinstance(update, torch.Tensor):
            return "update is not a tensor"
        if update.dtype not in SUPPORTED_DTYPES or update.device != x.device or update.shape != x.shape:
            return (f"update {tuple(update.shape)}/{update.dtype}/{update.device} does not match "
                    f"residual {tuple(x.shape)}/{x.dtype}/{x.device}")
        tensors.append(update)
    elif gate is not None:
        return "gate given without update"
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps must be a float, got {type(eps).__name__}"
    if D == 0 or D % 4 != 0:
        return f"width D={D} is not a positive multiple of 4: torch uses RowwiseMomentsCUDAKernel (not reproduced)"
    if D > _MAX_N:
        return f"width D={D} > 2**24: torch uses RowwiseMomentsCUDAKernel (not reproduced)"
    ln_input_is_x = update is None and norm_dtype in (None, x.dtype)
    if (ln_input_is_x and x.is_contiguous() and not torch.compiler.is_compiling()  # no addresses while tracing
            and x.data_ptr() % (4 * x.element_size()) != 0):
        return (
            "contiguous input whose data pointer is not aligned to 4 elements: torch uses "
            "RowwiseMomentsCUDAKernel (not reproduced)"
        )
    return None


# ----------------------------------------------------------------------------- launch


def _mod_strides(t: torch.Tensor | None) -> tuple[int, int, int]:
    if t is None:
        return 0, 0, 0
    if t.dim() == 2:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), (0 if t.shape[1] == 1 else t.stride(1)), t.stride(2)


def ln_prefetch(residual: bool) -> bool:
    """``DITFUSE_LN_PREFETCH``: whether the runtime-loop LayerNorm kernel (rows wider than the held
    ones: D > 3072 in the 128-thread kernel) loads step j + 1 before step j's arithmetic, in both
    passes (``PREFETCH``; the same element order and arithmetic, so the same bits). ``auto``
    (default): with a residual add before the norm, ``1`` always, ``0`` never. Round 22 (H100,
    bench/probes/probe_ln_prefetch.py, one row per program): with a residual the prefetch gained
    2-4 % (FLUX gated LN at [2, 32760, 5120] 1.012 -> 0.972 ms, Wan-14B's norm2 / norm3 0.507 ->
    0.497 / 0.492 ms, FLUX.2's 6144 0.097 -> 0.093 ms), without one it lost 1-12 % (6144: 0.057 ->
    0.058 ms; 4096: 0.089 -> 0.100 ms)."""
    mode = env("DITFUSE_LN_PREFETCH", "auto")
    if mode == "auto":
        return residual
    return mode not in ("", "0")


def _rows_per_program(M: int, js: int = 0, residual: bool = False) -> int:
    """Rows per program (common/host.py ``rows_per_program``). Held rows get at most 6 held
    vectors per thread with a residual (its h stores keep more bytes in flight per row), 3
    without. From the H200 sweep (bench/probes/probe_held_rows.py,
    bench/results/probe_held_rows_h200.csv): Wan's 1536 (3 vectors) is fastest at R = 2 gated and
    R = 1 plain, FLUX's 3072 (6) at R = 1, and R = 4 at either costs 20-60 %. The runtime loop
    (wider rows) runs one row per program on the GPU: round 22 (H100, probe_ln_prefetch) measured
    R = 1 fastest at every width and chain it runs (4096, 5120, 6144; plain, gated, Wan's fp32
    chains), 6-13 % ahead of the R = 4 it had (FLUX gated at [2, 32760, 5120] 1.081 -> 1.012 ms
    without the prefetch)."""
    if js == 0 and not interpreter_on():
        return 1
    return rows_per_program(M, js, 6 if residual else 3)


@functools.lru_cache(maxsize=256)
def _rounding_plan(x_dt, gate_dt, update_dt, scale_dt, shift_dt, norm_dtype):
    """The eager chain's rounding dtypes (torch's promotion rules) as the kernel's constexprs, plus
    the dtypes of out and h. Cached: a handful of dtype combinations occur per process, and the
    promotions cost microseconds on every call otherwise."""
    h_dt = x_dt
    p_dt = promote(gate_dt, update_dt) if gate_dt is not None else x_dt
    ln_dt = norm_dtype or h_dt
    if scale_dt is not None:
        sc_dt = scale_dt
        m_dt = promote(ln_dt, sc_dt)
        s_dt = promote(m_dt, shift_dt) if shift_dt is not None else m_dt
    else:
        sc_dt = m_dt = s_dt = ln_dt
    out_dt = h_dt if norm_dtype is not None else s_dt
    consts = dict(P_DT=tl_dtype(p_dt), H_DT=tl_dtype(h_dt), LN_DT=tl_dtype(ln_dt), SC_DT=tl_dtype(sc_dt),
                  M_DT=tl_dtype(m_dt), S_DT=tl_dtype(s_dt), OUT_DT=tl_dtype(out_dt))
    return consts, out_dt, h_dt


class _Recipe(NamedTuple):
    """What a launch computes from its inputs' geometry (cached per geometry by the public
    functions, common/plans.py): output dtypes, the residual mode, and each kernel's grid,
    scalar arguments and constexprs (the warp kernel's None where it is not taken)."""

    res: int
    out_dt: torch.dtype
    h_dt: torch.dtype
    empty: bool
    warp: tuple | None  # (grid, scalars, kwargs)
    block: tuple  # (grid, scalars, kwargs)


def _operand_dtype(t: torch.Tensor | None, table: torch.Tensor | None) -> torch.dtype | None:
    """The dtype of a modulation operand as eager forms it: ``table + t.float()`` is fp32."""
    if t is None:
        return None
    return torch.float32 if table is not None else t.dtype


def _recipe(x, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact: bool,
            rows_per_program: int | None = None, affine_fma: bool = True,
            unroll: bool = True, warp: bool | None = None, prefetch: bool | None = None,
            tables: tuple = (None, None, None)) -> _Recipe:
    B, S, D = x.shape
    res = _NO_RES if update is None else (_ADD if gate is None else _GATED)
    gt, sct, sht = tables
    consts, out_dt, h_dt = _rounding_plan(
        x.dtype, None if res != _GATED else _operand_dtype(gate, gt), None if update is None else update.dtype,
        _operand_dtype(scale, sct), _operand_dtype(shift, sht), norm_dtype)
    M = B * S
    if M == 0:
        return _Recipe(res, out_dt, h_dt, True, None, ((0,), (), {}))
    nvec = D // 4
    J = cdiv(nvec, 128)
    u = update if update is not None else x
    g = gate if gate is not None else u
    strides = (*x.stride(), *_mod_strides(g if res == _GATED else None), *u.stride(),
               weight.stride(0) if weight is not None else 0, bias.stride(0) if bias is not None else 0,
               *_mod_strides(scale), *_mod_strides(shift),
               *(0 if t is None else t.stride(0) for t in (gt if res == _GATED else None, sct, sht)))
    flags = dict(RES=res, HAS_W=weight is not None, HAS_B=bias is not None, MODULATE=0 if scale is None else (1 if shift is not None else 2),
                 EXACT=exact, **consts, AFFINE_FMA=affine_fma, enable_fp_fusion=False,
                 G_TAB=res == _GATED and gt is not None, SC_TAB=sct is not None, SH_TAB=sht is not None)
    R = warp_plan(D, M, warp, unroll, rows_per_program, residual=res != _NO_RES,
                  max_steps=WARP_MAX_STEPS if res != _NO_RES else LN_WARP_MAX_STEPS)
    warp_launch = None
    if R is not None:
        warp_launch = ((cdiv(M, R),), (M, S, D, float(eps), *strides), dict(flags, R=R, JS=J, num_warps=R))
    JS = held_steps(J, unroll)
    R = rows_per_program or _rows_per_program(M, JS, res != _NO_RES)
    block = ((cdiv(M, R),), (M, S, D, nvec, J, float(eps), *strides),
             dict(flags, R=R, JS=JS, FULL=nvec % 128 == 0, PREFETCH=JS == 0 and (ln_prefetch(res != _NO_RES) if prefetch is None else prefetch), num_warps=4))
    return _Recipe(res, out_dt, h_dt, False, warp_launch, block)


def _fire(r: _Recipe, x, gate, update, scale, shift, weight, bias,
          tables: tuple = (None, None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate (h, out) and launch recipe ``r`` on these tensors; h is ``out`` when there is no
    residual. ``tables``: the (gate, scale, shift) table rows or None each."""
    out = torch.empty(x.shape, dtype=r.out_dt, device=x.device)
    h = torch.empty(x.shape, dtype=r.h_dt, device=x.device) if r.res != _NO_RES else out
    if r.empty:
        return h, out
    u = update if update is not None else x
    ptrs = (x, gate if gate is not None else u, u, weight if weight is not None else x,
            bias if bias is not None else x, scale if scale is not None else x,
            shift if shift is not None else x, h, out, *(x if t is None else t for t in tables))
    if r.warp is not None:
        grid, scalars, kw = r.warp
        compiled = launch(_ln_warp_kernel, grid, *ptrs, *scalars, **kw)
        # the binary's shuffle layout is checked before its result is used
        if warp_layout_ok(compiled, "norm.layernorm_modulate"):
            return _eager_h(r, h, x), out
        # refused: the 128-thread kernel below rewrites h and out completely
    grid, scalars, kw = r.block
    launch(_ln_kernel, grid, *ptrs, *scalars, **kw)
    return _eager_h(r, h, x), out


def _eager_h(r: _Recipe, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The residual sum in eager's layout (that of ``residual``, its first operand); the
    normalised output is contiguous in eager too (LayerNorm writes a contiguous result)."""
    return h if r.res == _NO_RES else in_eager_layout(h, residual)


def _launch(x, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact: bool,
            rows_per_program: int | None = None, affine_fma: bool = True,
            unroll: bool = True, warp: bool | None = None,
            prefetch: bool | None = None, tables: tuple = (None, None, None)) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate (h, out) and launch; h is ``out`` when there is no residual. ``rows_per_program``
    only tiles the work (benchmarks sweep it); any value gives the same bits. ``affine_fma=False``
    computes the affine without the contraction (for the order probe only). ``unroll=False`` keeps
    the runtime loop over a row's steps even for narrow rows; ``warp`` forces (True) or refuses
    (False) the warp-per-row kernel, by default taken where it measured faster (common/host.py
    ``warp_rows_enabled``; ``DITFUSE_ROW_KERNEL`` overrides; tests and benchmarks compare the ways;
    same bits). ``prefetch`` forces (True) or refuses (False) the runtime loop's prefetch
    (default :func:`ln_prefetch`: with a residual; same bits). The launch never
    contracts across ops (``enable_fp_fusion=False``), in the close variant too: its statistics
    then stay torch's, bit for bit, and only the epilogue's roundings go. ``tables``: the (gate,
    scale, shift) table rows (``*_table`` of the public functions)."""
    return _fire(_recipe(x, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact, rows_per_program,
                         affine_fma, unroll, warp, prefetch, tables), x, gate, update, scale, shift, weight, bias,
                 tables)


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("ditfuse::layernorm_modulate", mutates_args=())
def _layernorm_modulate_op(
    x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float,
    weight: torch.Tensor | None, bias: torch.Tensor | None, norm_dtype: torch.dtype | None, exact: bool,
    scale_table: torch.Tensor | None = None, shift_table: torch.Tensor | None = None,
) -> torch.Tensor:
    return _launch(x, None, None, scale, shift, eps, weight, bias, norm_dtype, exact,
                   tables=(None, scale_table, shift_table))[1]


def _out_dtype(x, scale, shift, norm_dtype, scale_table=None, shift_table=None):
    if norm_dtype is not None:
        return x.dtype
    if scale is None:
        return x.dtype
    sc, sh = _operand_dtype(scale, scale_table), _operand_dtype(shift, shift_table)
    return promote(x.dtype, sc) if shift is None else promote(x.dtype, sc, sh)


@_layernorm_modulate_op.register_fake
def _(x, scale, shift, eps, weight, bias, norm_dtype, exact, scale_table=None, shift_table=None):
    return torch.empty(x.shape, dtype=_out_dtype(x, scale, shift, norm_dtype, scale_table, shift_table),
                       device=x.device)


@torch.library.custom_op("ditfuse::gate_residual_layernorm_modulate", mutates_args=())
def _gate_residual_layernorm_modulate_op(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
    scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float,
    weight: torch.Tensor | None, bias: torch.Tensor | None, norm_dtype: torch.dtype | None, exact: bool,
    gate_table: torch.Tensor | None = None, scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact,
                   tables=(gate_table, scale_table, shift_table))


@_gate_residual_layernorm_modulate_op.register_fake
def _(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact, gate_table=None,
      scale_table=None, shift_table=None):
    return (torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
            torch.empty(residual.shape, dtype=_out_dtype(residual, scale, shift, norm_dtype, scale_table, shift_table),
                        device=residual.device))


# ----------------------------------------------------------------------------- public API


_RECIPES = {(gated, exact): Recipes() for gated in (False, True) for exact in (True, False)}


def _ln(x, scale, shift, eps, weight, bias, norm_dtype, exact: bool, key: tuple | None = None,
        scale_table=None, shift_table=None) -> torch.Tensor:
    if use_custom_op():
        reason = _unsupported_reason(x, scale, shift, eps, weight, bias, norm_dtype, None, None, None,
                                     scale_table, shift_table)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.layernorm_modulate(x, scale, shift, float(eps), weight, bias, norm_dtype, exact,
                                                    scale_table, shift_table)
    cache = _RECIPES[False, exact]
    tables = (None, scale_table, shift_table)
    if key is None:
        key = call_key((x, scale, shift, eps, weight, bias, norm_dtype)
                       + (() if scale_table is None and shift_table is None else (scale_table, shift_table)))
    r = cache.checked(key, lambda: _unsupported_reason(x, scale, shift, eps, weight, bias, norm_dtype, None, None,
                                                       None, scale_table, shift_table),
                      lambda: _recipe(x, None, None, scale, shift, eps, weight, bias, norm_dtype, exact,
                                      tables=tables))
    return _fire(r, x, None, None, scale, shift, weight, bias, tables)[1]


def _gr_ln(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact: bool,
           key: tuple | None = None, gate_table=None, scale_table=None, shift_table=None):
    if use_custom_op():
        reason = _unsupported_reason(residual, scale, shift, eps, weight, bias, norm_dtype, gate, update,
                                     gate_table, scale_table, shift_table)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.gate_residual_layernorm_modulate(
            residual, gate, update, scale, shift, float(eps), weight, bias, norm_dtype, exact,
            gate_table, scale_table, shift_table)
    cache = _RECIPES[True, exact]
    tables = (gate_table, scale_table, shift_table)
    if key is None:
        key = call_key((residual, gate, update, scale, shift, eps, weight, bias, norm_dtype)
                       + (() if tables == (None, None, None) else tables))
    r = cache.checked(
        key, lambda: _unsupported_reason(residual, scale, shift, eps, weight, bias, norm_dtype, gate, update, *tables),
        lambda: _recipe(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, exact, tables=tables))
    return _fire(r, residual, gate, update, scale, shift, weight, bias, tables)


def can_use_layernorm_modulate(
    x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    scale_table: torch.Tensor | None = None, shift_table: torch.Tensor | None = None,
) -> bool:
    """True when :func:`layernorm_modulate` reproduces eager bit for bit for these inputs
    (``_unsupported_reason`` lists every rejection)."""
    return _unsupported_reason(x, scale, shift, eps, weight, bias, norm_dtype, None, None, None,
                               scale_table, shift_table) is None


def layernorm_modulate(
    x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    scale_table: torch.Tensor | None = None, shift_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = r(r(r(LN(x)) * r(1 + scale)) + shift)`` (module docstring for the rounding dtypes),
    bit-exact vs torch 2.11 CUDA eager ``ditfuse.kernels.reference.layernorm_modulate``.

    x: [B, S, D]; scale, shift: [B, D], [B, 1, D] or [B, S, D] (both None: LayerNorm alone;
    shift None: ``r(r(LN(x)) * r(1 + scale))``, the shift-free modulate);
    weight, bias: [D] or None; ``norm_dtype=torch.float32`` for FP32LayerNorm + ``.type_as``.
    ``scale_table`` / ``shift_table`` ([D] rows, or None): the operand is ``table + scale.float()``
    (Wan 2.2 TI2V's per-token ``scale_shift_table + temb.float()`` chunk), that one fp32 add done
    in the kernel on the embedding as the model holds it (bf16, strided chunk views), so no fp32
    sum is written or read. For AdaLayerNormContinuous pass its first chunk as ``scale``. Raises
    UnsupportedInput where :func:`can_use_layernorm_modulate` is False.
    """
    return _ln(x, scale, shift, eps, weight, bias, norm_dtype, True, None, scale_table, shift_table)


def _keyed_ln(key, x, scale, shift, eps=1e-6, weight=None, bias=None, norm_dtype=None, scale_table=None,
              shift_table=None):
    return _ln(x, scale, shift, eps, weight, bias, norm_dtype, True, key, scale_table, shift_table)


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
layernorm_modulate.keyed = _keyed_ln


def can_use_layernorm_modulate_fp32(x, scale, shift, eps=1e-6, weight=None, bias=None, norm_dtype=None,
                                    scale_table=None, shift_table=None) -> bool:
    """True when :func:`layernorm_modulate_fp32` takes these inputs (the bit-exact predicate)."""
    return can_use_layernorm_modulate(x, scale, shift, eps, weight, bias, norm_dtype, scale_table, shift_table)


def layernorm_modulate_fp32(x, scale, shift, eps=1e-6, weight=None, bias=None, norm_dtype=None, scale_table=None,
                            shift_table=None) -> torch.Tensor:
    """Close (quality="high"): ``out = r_out(LN(x) * (1 + scale) + shift)``, torch's statistics,
    fp32 epilogue, one rounding. Same arguments and rejections as :func:`layernorm_modulate`."""
    return _ln(x, scale, shift, eps, weight, bias, norm_dtype, False, None, scale_table, shift_table)


def can_use_gate_residual_layernorm_modulate(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
    scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    gate_table: torch.Tensor | None = None, scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> bool:
    """True when :func:`gate_residual_layernorm_modulate` is bit-exact for these inputs."""
    return _unsupported_reason(residual, scale, shift, eps, weight, bias, norm_dtype, gate, update,
                               gate_table, scale_table, shift_table) is None


def gate_residual_layernorm_modulate(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
    scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    gate_table: torch.Tensor | None = None, scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + LayerNorm (+ modulate) in one pass: ``h = r(residual + r(gate * update))``
    (``gate=None``: ``r(residual + update)``), ``n = layernorm_modulate(h, ...)``; returns ``(h, n)``,
    both bit-exact vs eager. residual, update: [B, S, D]; gate, scale, shift: [B, D], [B, 1, D] or
    [B, S, D]; ``*_table``: [D] rows that make the operand ``table + operand.float()``, summed in
    the kernel (:func:`layernorm_modulate`). Raises UnsupportedInput where
    :func:`can_use_gate_residual_layernorm_modulate` is False.
    """
    return _gr_ln(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, True, None,
                  gate_table, scale_table, shift_table)


def _keyed_gr_ln(key, residual, gate, update, scale, shift, eps=1e-6, weight=None, bias=None, norm_dtype=None,
                 gate_table=None, scale_table=None, shift_table=None):
    return _gr_ln(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, True, key,
                  gate_table, scale_table, shift_table)


gate_residual_layernorm_modulate.keyed = _keyed_gr_ln


def can_use_gate_residual_layernorm_modulate_fp32(residual, gate, update, scale, shift, eps=1e-6, weight=None,
                                                  bias=None, norm_dtype=None, gate_table=None, scale_table=None,
                                                  shift_table=None) -> bool:
    """True when :func:`gate_residual_layernorm_modulate_fp32` takes these inputs."""
    return can_use_gate_residual_layernorm_modulate(residual, gate, update, scale, shift, eps, weight, bias,
                                                    norm_dtype, gate_table, scale_table, shift_table)


def gate_residual_layernorm_modulate_fp32(residual, gate, update, scale, shift, eps=1e-6, weight=None, bias=None,
                                          norm_dtype=None, gate_table=None, scale_table=None,
                                          shift_table=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Close (quality="high"): ``h = r(residual + gate * update)``, ``n`` the fp32 LayerNorm (+
    modulate) of the unrounded sum, one rounding each; returns ``(h, n)``."""
    return _gr_ln(residual, gate, update, scale, shift, eps, weight, bias, norm_dtype, False, None,
                  gate_table, scale_table, shift_table)


__all__ = [
    "layernorm_modulate",
    "can_use_layernorm_modulate",
    "layernorm_modulate_fp32",
    "can_use_layernorm_modulate_fp32",
    "gate_residual_layernorm_modulate",
    "can_use_gate_residual_layernorm_modulate",
    "gate_residual_layernorm_modulate_fp32",
    "can_use_gate_residual_layernorm_modulate_fp32",
]
