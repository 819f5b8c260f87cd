"""Wan's QK RMSNorm over all heads + pair RoPE, both contracts in one kernel body.

diffusers 0.42.1 ``WanAttnProcessor`` (self-attention): ``norm_q`` / ``norm_k`` are
``torch.nn.RMSNorm(H * Dh)`` over the whole projection (``_fused_rms_norm`` on CUDA: one
rounding), then ``unflatten(2, (H, -1))`` and Wan's ``apply_rotary_emb`` with the
repeat-interleaved freqs ``[1, S, 1, Dh]``. For each row x of q (and of k), with ``w`` its weight::

    n          = r(w * (rstd * x))          rstd = rsqrtf(sum(x*x) / D + eps), torch's order
    out[2i]    = r(r_p(r_p(n[2i] * cos[2i]) - r_p(n[2i+1] * sin[2i+1])))
    out[2i+1]  = r(r_p(r_p(n[2i] * sin[2i+1]) + r_p(n[2i+1] * cos[2i])))

``r`` rounds to the input dtype, ``r_p`` to promote(input, freqs) — fp32 for the fp32 freqs a
``from_pretrained`` load keeps (``rope`` is in ``_keep_in_fp32_modules``), bf16 after a plain
``.to(bf16)`` — round-to-nearest-even, where the eager ops store (the RoPE's products, its
sum/difference, and the copy into ``out[..., 0::2]``). Pair index i counts within a head.

torch's order for the sum of squares (D = H * Dh, several 4-element vectors per thread when
D > 512): thread t (of 128) accumulates its vectors t, t + 128, ... in element order with FMAs
(common/rms.py), then the shfl-down tree and the cross-warp tree (``rms_fold_rows``). Each
program handles R rows as [128, R, 4] tiles (the LayerNorm kernel's layout), two passes over the
row (sum, then normalise + RoPE + store). Launched with ``enable_fp_fusion=False``.

``EXACT=False`` (``*_fp32``, contract close, quality="high"): the normalised value is not rounded
before RoPE and the RoPE's products and sums stay fp32; one rounding per output element.

q, k: [B, S, H * Dh] (any strides); weights [H * Dh] or None; cos, sin: [1, S, 1, Dh]. Returns
contiguous [B, S, H, Dh] each. Rows are independent: where the warp-per-row kernel takes the rows,
q and k are one launch (a program normalises row m of each and reads the token's cos/sin once);
otherwise two launches of one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import load_f32, load_row_tile
from ..common.host import (
    cdiv,
    SUPPORTED_DTYPES,
    device_reason,
    grad_reason,
    held_steps,
    promote,
    tl_dtype,
    use_custom_op,
    warp_plan,
)
from ..common.host import rows_per_program as common_rows_per_program
from ..common.rms import RMS_VEC_WIDTH, fma_rn, rms_fold_4warps_in_registers, rms_fold_rows, rsqrt_approx
from ..common.rounding import round_to, rround
from ..common.warp import warp_layout_ok, warp_rows
from ..errors import UnsupportedInput
from ..common.launch import launch

_THREADS: tl.constexpr = tl.constexpr(128)
_VEC: tl.constexpr = tl.constexpr(4)


@triton.jit
def _sumsq4(acc, x, A0: tl.constexpr, A1: tl.constexpr):
    """A thread's four FMAs for its 4-element vector, in element order, on an [A0, A1, 4] tile
    ([128 threads, R rows, 4] or, in the warp kernel, [R rows, 32 lanes, 4])."""
    x02, x13 = tl.split(tl.reshape(x, [A0, A1, 2, 2]))
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    acc = fma_rn(x0, x0, acc)  # fma(v, v, 0) == v * v for the first element: no special case
    acc = fma_rn(x1, x1, acc)
    acc = fma_rn(x2, x2, acc)
    acc = fma_rn(x3, x3, acc)
    return acc


@triton.jit
def _rope_pairs(n, c, sn, A0: tl.constexpr, A1: tl.constexpr, EXACT: tl.constexpr, P_DT: tl.constexpr):
    """RoPE on an [A0, A1, 4] tile of normalised values whose last axis is two (even, odd) pairs;
    c and sn are cos and sin at each element's own position, so the pair's operands are cos at
    the even position and sin at the odd one (eager's ``cos[..., 0::2]``, ``sin[..., 1::2]``)."""
    ne, no = tl.split(tl.reshape(n, [A0, A1, 2, 2]))
    ce, _co = tl.split(tl.reshape(c, [A0, A1, 2, 2]))
    _se, so = tl.split(tl.reshape(sn, [A0, A1, 2, 2]))
    if EXACT:
        oe = rround(rround(ne * ce, P_DT) - rround(no * so, P_DT), P_DT)
        oo = rround(rround(ne * so, P_DT) + rround(no * ce, P_DT), P_DT)
    else:
        oe = ne * ce - no * so
        oo = ne * so + no * ce
    return tl.reshape(tl.join(oe, oo), [A0, A1, 4])


@triton.jit
def _norm_rope_store(x, rstd, w_ptr, cos_ptr, sin_ptr, out_ptr, s, out_row, vec, k4, valid_t, valid,
                     wsd, css, csd, sss, ssd, DH: tl.constexpr, HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr,
                     EXACT: tl.constexpr, DTYPE: tl.constexpr, P_DT: tl.constexpr, R: tl.constexpr):
    """Pass 2 on one [128, R, 4] tile: normalise, RoPE within each head, store [B, S, H, Dh]
    contiguous. cos and sin are read at each element's own position in its head (one 4-element
    vector when 4 | Dh; Dh is even, so a column's parity is its position's)."""
    n = rstd * x
    if HAS_W:
        w_off = (vec[:, None, None] * 4 + k4[None, None, :]).to(tl.int64) * wsd
        n = load_f32(w_ptr + w_off, valid_t[:, None, None]) * n
    if EXACT:
        n = rround(n, DTYPE)
    if HAS_ROPE:
        pos = (vec[:, None, None] * 4 + k4[None, None, :]) % DH
        c = load_f32(cos_ptr + (s[None, :, None] * css + pos.to(tl.int64) * csd), valid)
        sn = load_f32(sin_ptr + (s[None, :, None] * sss + pos.to(tl.int64) * ssd), valid)
        n = _rope_pairs(n, c, sn, _THREADS, R, EXACT, P_DT)
    dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
    tl.store(out_ptr + dst, round_to(n, DTYPE), mask=valid)


# Two ways over a row's J steps, as in the LayerNorm kernel (norm/layernorm_modulate_triton.py):
# JS = J > 0 loads every tile first (a tuple held in registers, unpredicated when FULL: every
# vector exists, tail rows are clamped to row 0), then sums, then normalises the held tiles;
# JS = 0 loops over the runtime J and reads the row twice. Same arithmetic, same bits.
@triton.jit(do_not_specialize=["M", "S", "N", "NVEC", "J", "eps"])
def _rms_rope_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    M, S, N, NVEC, J, eps,
    xsb, xss, xsd, wsd, css, csd, sss, ssd,
    DH: tl.constexpr, HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr, EXACT: tl.constexpr,
    DTYPE: tl.constexpr, P_DT: tl.constexpr, R: tl.constexpr, JS: tl.constexpr = 0, FULL: tl.constexpr = False,
):
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < M
    rows = tl.where(row_ok, rows, 0)
    b = rows // S
    s = rows % S
    out_row = tl.multiple_of(rows * N, 4)
    t = tl.arange(0, _THREADS)
    k4 = tl.arange(0, _VEC)

    # Pass 1: per-thread sums of squares over the thread's vectors, in element order.
    acc = tl.zeros([_THREADS, R], dtype=tl.float32)
    if JS > 0:
        held = ()
        for j in tl.static_range(JS):
            vec = j * _THREADS + t
            if FULL:
                x = load_row_tile(x_ptr, b, s, xsb, xss, xsd, vec, k4, None)
            else:
                x = load_row_tile(x_ptr, b, s, xsb, xss, xsd, vec, k4,
                                  (vec < NVEC)[:, None, None] & row_ok[None, :, None])
            held = held + (x.to(DTYPE),)  # exact: a value of the input dtype
        for j in tl.static_range(JS):
            acc = _sumsq4(acc, held[j].to(tl.float32), _THREADS, R)
    else:
        j = 0
        while j < J:
            vec = j * _THREADS + t
            valid = (vec < NVEC)[:, None, None] & row_ok[None, :, None]
            acc = _sumsq4(acc, load_row_tile(x_ptr, b, s, xsb, xss, xsd, vec, k4, valid), _THREADS, R)
            j += 1
    rstd = rsqrt_approx(tl.math.div_rn(rms_fold_rows(acc, R), N.to(tl.float32)) + eps)
    rstd = rstd[None, :, None]

    # Pass 2: normalise, RoPE within each head, store [B, S, H, Dh] contiguous.
    if JS > 0:
        for j in tl.static_range(JS):
            vec = j * _THREADS + t
            valid_t = vec < NVEC
            valid = valid_t[:, None, None] & row_ok[None, :, None]
            _norm_rope_store(held[j].to(tl.float32), rstd, w_ptr, cos_ptr, sin_ptr, out_ptr, s, out_row, vec, k4,
                             valid_t, valid, wsd, css, csd, sss, ssd, DH, HAS_W, HAS_ROPE, EXACT, DTYPE, P_DT, R)
    else:
        j = 0
        while j < J:
            vec = j * _THREADS + t
            valid_t = vec < NVEC
            valid = valid_t[:, None, None] & row_ok[None, :, None]
            x = load_row_tile(x_ptr, b, s, xsb, xss, xsd, vec, k4, valid)
            _norm_rope_store(x, rstd, w_ptr, cos_ptr, sin_ptr, out_ptr, s, out_row, vec, k4,
                             valid_t, valid, wsd, css, csd, sss, ssd, DH, HAS_W, HAS_ROPE, EXACT, DTYPE, P_DT, R)
            j += 1


# One warp per row (one row per one-warp program on the GPU, common/warp.py) for rows that are
# whole 128-thread steps (D % 512 == 0), as the LayerNorm's
# warp-per-row kernel (norm/layernorm_modulate_triton.py ``_ln_warp_kernel``): torch's thread
# t = lane + 32 * w is register set w of lane ``lane`` (tile ``held[4 * j + w]`` at step j), the
# four warps' shfl-down trees are butterflies and the cross-warp tree stays in registers
# (common/rms.py ``rms_fold_4warps_in_registers``). Same sums in the same order, same bits.
# PAIR: the program also takes the same row of a second tensor (k beside q: one launch for both),
# so the cos/sin of the row's token are loaded once for the two.
@triton.jit
def _warp_hold(x_ptr, base, xsd, lane, k4, DTYPE: tl.constexpr, JS: tl.constexpr):
    """A row's JS steps x 4 register sets of [R, 32, 4] tiles, held in the input dtype (exact)."""
    held = ()
    for j in tl.static_range(JS):
        for w in tl.static_range(4):
            vec = j * _THREADS + w * 32 + lane
            offs = base[:, None, None] + (vec[None, :, None] * 4 + k4[None, None, :]).to(tl.int64) * xsd
            held = held + (load_f32(x_ptr + offs, None).to(DTYPE),)
    return held


@triton.jit
def _warp_rstd(held, N, eps, R: tl.constexpr, JS: tl.constexpr):
    """[R, 32, 1] rstd of held rows: torch's per-thread FMA chains and fold trees."""
    z = tl.zeros([R, 32], dtype=tl.float32)
    a0, a1, a2, a3 = z, z, z, z
    for j in tl.static_range(JS):
        a0 = _sumsq4(a0, held[4 * j].to(tl.float32), R, 32)
        a1 = _sumsq4(a1, held[4 * j + 1].to(tl.float32), R, 32)
        a2 = _sumsq4(a2, held[4 * j + 2].to(tl.float32), R, 32)
        a3 = _sumsq4(a3, held[4 * j + 3].to(tl.float32), R, 32)
    total = rms_fold_4warps_in_registers(a0, a1, a2, a3, R)
    return rsqrt_approx(tl.math.div_rn(total, N.to(tl.float32)) + eps)[:, :, None]


@triton.jit
def _warp_norm(h, rstd, w_ptr, wsd, col, HAS_W: tl.constexpr, EXACT: tl.constexpr, DTYPE: tl.constexpr):
    n = rstd * h.to(tl.float32)
    if HAS_W:
        n = load_f32(w_ptr + col.to(tl.int64) * wsd, None) * n
    if EXACT:
        n = rround(n, DTYPE)
    return n


@triton.jit(do_not_specialize=["M", "S", "N", "eps"])
def _rms_rope_warp_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr,
    M, S, N, eps,
    xsb, xss, xsd, wsd, css, csd, sss, ssd,
    DH: tl.constexpr, HAS_W: tl.constexpr, HAS_ROPE: tl.constexpr, EXACT: tl.constexpr,
    DTYPE: tl.constexpr, P_DT: tl.constexpr, R: tl.constexpr, JS: tl.constexpr,
    x2_ptr=None, w2_ptr=None, out2_ptr=None, x2sb=0, x2ss=0, x2sd=0, w2sd=0,
    PAIR: tl.constexpr = False, HAS_W2: tl.constexpr = False,
):
    row_ok, b, s, out_row = warp_rows(M, S, N, R)
    lane = tl.arange(0, 32)
    k4 = tl.arange(0, _VEC)
    held = _warp_hold(x_ptr, b * xsb + s * xss, xsd, lane, k4, DTYPE, JS)
    if PAIR:
        held2 = _warp_hold(x2_ptr, b * x2sb + s * x2ss, x2sd, lane, k4, DTYPE, JS)
    rstd = _warp_rstd(held, N, eps, R, JS)
    if PAIR:
        rstd2 = _warp_rstd(held2, N, eps, R, JS)
    keep = row_ok[:, None, None]
    for j in tl.static_range(JS):
        for w in tl.static_range(4):
            vec = j * _THREADS + w * 32 + lane
            col = vec[None, :, None] * 4 + k4[None, None, :]
            n = _warp_norm(held[4 * j + w], rstd, w_ptr, wsd, col, HAS_W, EXACT, DTYPE)
            if PAIR:
                n2 = _warp_norm(held2[4 * j + w], rstd2, w2_ptr, w2sd, col, HAS_W2, EXACT, DTYPE)
            if HAS_ROPE:
                pos = (col % DH).to(tl.int64)
                c = load_f32(cos_ptr + (s[:, None, None] * css + pos * csd), None)
                sn = load_f32(sin_ptr + (s[:, None, None] * sss + pos * ssd), None)
                n = _rope_pairs(n, c, sn, R, 32, EXACT, P_DT)
                if PAIR:
                    n2 = _rope_pairs(n2, c, sn, R, 32, EXACT, P_DT)
            tl.store(out_ptr + (out_row[:, None, None] + col), round_to(n, DTYPE), mask=keep)
            if PAIR:
                tl.store(out2_ptr + (out_row[:, None, None] + col), round_to(n2, DTYPE), mask=keep)


# ----------------------------------------------------------------------------- predicate


def _freqs_reason(t: object, S: int, Dh: int) -> str | None:
    if not isinstance(t, torch.Tensor):
        return "cos/sin must be tensors"
    if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != S or t.shape[2] != 1 or t.shape[3] != Dh:
        return f"cos/sin must be [1, S, 1, Dh] = [1, {S}, 1, {Dh}], got {tuple(t.shape)}"
    if t.dtype not in SUPPORTED_DTYPES:
        return f"cos/sin dtype {t.dtype} is not fp32, bf16 or fp16"
    return None


def _unsupported_reason(q, k, q_weight, k_weight, cos, sin, heads, eps) -> str | None:
    """Why the kernel does not reproduce eager for these inputs, or None.

    Rejected: q/k not 3-D [B, S, D] tensors of one shape and dtype (bf16/fp16/fp32); ``heads``
    not a positive int dividing D into an even head_dim; D % 4 != 0 (torch's non-vectorized RMS
    kernel, another order); a weight not [D] or of another dtype than the input (F.rms_norm's
    composite path, several roundings); a contiguous input or weight not 4-element aligned
    (torch's non-vectorized path); cos/sin given one without the other, not [1, S, 1, Dh] or of
    different dtypes; tensors on different devices or a device other than CUDA (CPU only under
    TRITON_INTERPRET=1); eps not a number; an input requiring grad in grad mode (no backward).
    """
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "q and k must be tensors"
    if q.dim() != 3 or q.shape != k.shape:
        return f"q and k must be [B, S, D] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype:
        return f"q/k dtypes {q.dtype}/{k.dtype}: need one of bf16, fp16, fp32"
    if (cos is None) != (sin is None):
        return "cos and sin must be given together"
    B, S, D = q.shape
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or D % heads:
        return f"heads={heads!r} does not divide the width {D}"
    Dh = D // heads
    if Dh % 2:
        return f"head_dim {Dh} is odd (RoPE pairs)"
    if D == 0 or D % RMS_VEC_WIDTH:
        return f"width {D} is not a positive multiple of 4 (torch's non-vectorized RMSNorm path)"
    weights = [w for w in (q_weight, k_weight) if w is not None]
    for w in weights:
        if not isinstance(w, torch.Tensor) or w.dim() != 1 or w.shape[0] != D:
            return f"a weight is not a [{D}] tensor"
        if w.dtype != q.dtype:
            return "a weight dtype differs from the input dtype (F.rms_norm then runs its composite path)"
    rope = []
    if cos is not None:
        for t in (cos, sin):
            reason = _freqs_reason(t, S, Dh)
            if reason:
                return reason
        if cos.dtype != sin.dtype:
            return "cos and sin dtypes differ"
        rope = [cos, sin]
    tensors = [q, k, *weights, *rope]
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    for t in (q, k, *weights) if not torch.compiler.is_compiling() else ():  # no addresses while tracing
        if t.is_contiguous() and t.data_ptr() % (RMS_VEC_WIDTH * t.element_size()):
            return "a contiguous input or weight is not 4-element aligned (torch's non-vectorized path)"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "eps must be a Python number"
    return None


# ----------------------------------------------------------------------------- launch


def _warp_launch(x, w, out, cos, sin, heads, eps, exact: bool, R: int, second: tuple | None = None) -> bool:
    """Launch the warp-per-row kernel on x (rows of [B, S, D]) into ``out``; ``second`` =
    (x2, w2, out2): the same rows of a second tensor in the same programs (PAIR). False when the
    compiled binary's layout is refused (common/warp.py): the caller then writes the outputs with
    the 128-thread kernel."""
    B, S, D = x.shape
    M = B * S
    has_rope = cos is not None
    p_dt = promote(x.dtype, cos.dtype) if has_rope else x.dtype
    pair = {}
    if second is not None:
        x2, w2, out2 = second
        pair = dict(x2_ptr=x2, w2_ptr=w2 if w2 is not None else x2, out2_ptr=out2,
                    x2sb=x2.stride(0), x2ss=x2.stride(1), x2sd=x2.stride(2),
                    w2sd=w2.stride(0) if w2 is not None else 0, PAIR=True, HAS_W2=w2 is not None)
    compiled = launch(_rms_rope_warp_kernel, (cdiv(M, R),),
        x, w if w is not None else x, cos if has_rope else x, sin if has_rope else x, out,
        M, S, D, float(eps),
        *x.stride(), w.stride(0) if w is not None else 0,
        cos.stride(1) if has_rope else 0, cos.stride(3) if has_rope else 0,
        sin.stride(1) if has_rope else 0, sin.stride(3) if has_rope else 0,
        DH=D // heads, HAS_W=w is not None, HAS_ROPE=has_rope, EXACT=exact,
        DTYPE=tl_dtype(x.dtype), P_DT=tl_dtype(p_dt), R=R, JS=cdiv(D // 4, 128), **pair,
        num_warps=R, enable_fp_fusion=False,
    )
    return warp_layout_ok(compiled, "rope.qk_rmsnorm_across_heads_rope")


def _launch_one(x, w, cos, sin, heads, eps, exact: bool, rows_per_program: int | None = None,
                unroll: bool = True, warp: bool | None = None) -> torch.Tensor:
    """One tensor (q or k). ``rows_per_program``, ``unroll`` (False: the runtime loop) and
    ``warp`` (the warp-per-row kernel; default: common/host.py ``warp_plan``, i.e. whole-step
    rows unless DITFUSE_ROW_KERNEL=block) only choose how
    the work is laid out: same bits (tests and the probes compare them)."""
    B, S, D = x.shape
    out = torch.empty((B, S, heads, D // heads), dtype=x.dtype, device=x.device)
    M = B * S
    if M == 0:
        return out
    nvec = D // 4
    J = cdiv(nvec, 128)
    has_rope = cos is not None
    R = warp_plan(D, M, warp, unroll, rows_per_program)
    if R is not None and _warp_launch(x, w, out, cos, sin, heads, eps, exact, R):
        return out
    # 128-thread kernel (also after a refused warp binary: it rewrites out completely)
    JS = held_steps(J, unroll)
    # held rows: at most 6 held vectors per thread (Wan's 1536: R = 2; the H200 sweep in
    # bench/results/probe_held_rows_h200.csv found R = 1, 2, 4 within 1 %)
    R = rows_per_program or common_rows_per_program(M, JS, 6)
    p_dt = promote(x.dtype, cos.dtype) if has_rope else x.dtype
    launch(_rms_rope_kernel, (cdiv(M, R),),
        x, w if w is not None else x, cos if has_rope else x, sin if has_rope else x, out,
        M, S, D, nvec, J, float(eps),
        *x.stride(), w.stride(0) if w is not None else 0,
        cos.stride(1) if has_rope else 0, cos.stride(3) if has_rope else 0,
        sin.stride(1) if has_rope else 0, sin.stride(3) if has_rope else 0,
        DH=D // heads, HAS_W=w is not None, HAS_ROPE=has_rope, EXACT=exact,
        DTYPE=tl_dtype(x.dtype), P_DT=tl_dtype(p_dt), R=R, JS=JS,
        FULL=nvec % 128 == 0, num_warps=4, enable_fp_fusion=False,
    )
    return out


def _launch_pair(q, k, q_weight, k_weight, cos, sin, heads, eps, exact: bool,
                 rows_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q and k in one warp-per-row launch (each program: row m of q and row m of k, one read of
    the token's cos/sin); None where the warp kernel does not take these rows (or its binary is
    refused), and the caller launches q and k separately. Same bits as two launches."""
    B, S, D = q.shape
    R = warp_plan(D, B * S, None, True, rows_per_program)
    if R is None or B * S == 0:
        return None
    qo = torch.empty((B, S, heads, D // heads), dtype=q.dtype, device=q.device)
    ko = torch.empty_like(qo)
    if not _warp_launch(q, q_weight, qo, cos, sin, heads, eps, exact, R, second=(k, k_weight, ko)):
        return None
    return qo, ko


def _launch(q, k, q_weight, k_weight, cos, sin, heads, eps, exact: bool):
    if q.dtype == k.dtype:
        pair = _launch_pair(q, k, q_weight, k_weight, cos, sin, heads, eps, exact)
        if pair is not None:
            return pair
    return (_launch_one(q, q_weight, cos, sin, heads, eps, exact),
            _launch_one(k, k_weight, cos, sin, heads, eps, exact))


@torch.library.custom_op("ditfuse::qk_rmsnorm_across_heads_rope", mutates_args=())
def _op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
        cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int, eps: float,
        exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, q_weight, k_weight, cos, sin, heads, eps, exact)


@_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, heads, eps, exact):
    B, S, D = q.shape
    return q.new_empty((B, S, heads, D // heads)), k.new_empty((B, S, heads, D // heads))


def _call(q, k, q_weight, k_weight, cos, sin, heads, eps, exact: bool):
    reason = _unsupported_reason(q, k, q_weight, k_weight, cos, sin, heads, eps)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.qk_rmsnorm_across_heads_rope(q, k, q_weight, k_weight, cos, sin, heads,
                                                               float(eps), exact)
    return _launch(q, k, q_weight, k_weight, cos, sin, heads, eps, exact)


def can_use_qk_rmsnorm_across_heads_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int, eps: float = 1e-6,
) -> bool:
    """True when :func:`qk_rmsnorm_across_heads_rope` is bitwise equal to the reference for these
    inputs (``_unsupported_reason`` lists every rejection)."""
    return _unsupported_reason(q, k, q_weight, k_weight, cos, sin, heads, eps) is None


def qk_rmsnorm_across_heads_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's ``norm_q``/``norm_k`` + head split + RoPE, bitwise equal to torch 2.11 CUDA eager
    ``ditfuse.kernels.reference.qk_rmsnorm_across_heads_rope`` (module docstring). q, k:
    [B, S, H * Dh]; returns contiguous [B, S, H, Dh] each. Raises UnsupportedInput exactly where
    :func:`can_use_qk_rmsnorm_across_heads_rope` is False."""
    return _call(q, k, q_weight, k_weight, cos, sin, heads, eps, True)


def can_use_qk_rmsnorm_across_heads_rope_fp32(q, k, q_weight, k_weight, cos, sin, heads, eps=1e-6) -> bool:
    """True when :func:`qk_rmsnorm_across_heads_rope_fp32` takes these inputs (the bit-exact predicate)."""
    return _unsupported_reason(q, k, q_weight, k_weight, cos, sin, heads, eps) is None


def qk_rmsnorm_across_heads_rope_fp32(q, k, q_weight, k_weight, cos, sin, heads, eps=1e-6):
    """Close (quality="high"): the same chain with no rounding between the norm and the RoPE and
    fp32 RoPE arithmetic; one rounding per output element."""
    return _call(q, k, q_weight, k_weight, cos, sin, heads, eps, False)


__all__ = [
    "qk_rmsnorm_across_heads_rope",
    "can_use_qk_rmsnorm_across_heads_rope",
    "qk_rmsnorm_across_heads_rope_fp32",
    "can_use_qk_rmsnorm_across_heads_rope_fp32",
]
