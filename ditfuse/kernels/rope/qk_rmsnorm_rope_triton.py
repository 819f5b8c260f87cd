"""QK RMSNorm + FLUX interleaved RoPE, written into the joint tensors; both contracts in one
kernel (``EXACT``): bit-exact vs torch 2.11 CUDA eager (diffusers 0.42.1 ``FluxAttnProcessor``),
or close (``qk_rmsnorm_rope_fp32``, quality="high": the same arithmetic without the rounding of
the normalised value to the input dtype before RoPE, so each output is rounded once).

For q and k alike, with ``x`` each text / image input and ``w`` its RMSNorm weight::

    n   = r(w * (rstd * x))      rstd = rsqrtf(sum(x*x) / D + eps), torch's reduction order
    y   = cat([n_txt, n_img], dim=1)                 (text first; copies bits)
    out[2i]   = r(r32(y[2i]   * cos[2i])   + r32(-y[2i+1] * sin[2i]))   (computed as a - b)
    out[2i+1] = r(r32(y[2i+1] * cos[2i+1]) + r32( y[2i]   * sin[2i+1]))

``r`` rounds to the input dtype (round-to-nearest-even), ``r32`` is an fp32 result. The norm is
``torch.nn.RMSNorm(D, eps)`` (``_fused_rms_norm`` on CUDA, one rounding; sum of squares in the
order of ``common.rms``); RoPE is diffusers' ``apply_rotary_emb(use_real=True,
use_real_unbind_dim=-1, sequence_dim=1)``: ``x.float() * cos + x_rotated.float() * sin`` as three
separate eager ops, so the products are rounded to fp32 before the add and the kernel is launched
with ``enable_fp_fusion=False`` (the sum of squares keeps its FMAs through explicit ``fma``).
The bf16 rounding of the norm output before RoPE is kept. Without cos/sin the kernel is
RMSNorm + cat; without text inputs (single blocks) it is RMSNorm (+ RoPE) of q and k alone.

One launch handles q and k, text and image: each program takes a block of output rows
(b, s, h) of the joint [B, S_txt + S_img, H, D] tensors, loads each row from the text or the image
input (any strides), and loads cos/sin once for q and k.

The same kernel body, with constexpr switches, is also ``qk_rmsnorm_diffusers_rope_complex``
(Qwen-Image's ``QwenDoubleStreamAttnProcessor2_0``: diffusers' own ``RMSNorm`` and complex RoPE
with per-stream tables, ``NORM=1, ROPE=2``)::

    ms  = r32(sum(r32(x*x)) * f)      sum in torch's generic reduce order (common.rms
                                      rms_sumsq_reduce_order), f = float(rows) / float(rows * D)
                                      in fp32 per stream (MeanOps' factor)
    h   = r32(x * rsqrtf(r32(ms + eps)))
    n   = r(r(h) * w)   (weight in the input dtype; n = r(h) without weight)
    (a, b) = (n[2i], n[2i+1]), (c, d) = (Re, Im) of the row's stream's freqs[s, i]:
    out[2i] = r(a*c - b*d), out[2i+1] = r(a*d + b*c) with the contraction of CMUL_MODE
    joint = cat([text, image], dim=1)

bit-exact vs torch 2.11 CUDA eager (diffusers 0.42.1) once the contraction (``CMUL_MODE``) is the
one nvcc chose for ``c10::complex<float>::operator*=``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..common.host import (cdiv, next_pow2, SUPPORTED_DTYPES, device_reason, grad_reason, in_eager_layout, interpreter_on,
                           tl_dtype, use_custom_op)
from ..common.plans import Recipes, call_key
from ..common.warp import lane_layout_ok
from ..common.rms import RMS_MAX_WIDTH, RMS_VEC_WIDTH, rms_fold_lanes, rms_rstd, rms_sumsq_reduce_order, rms_sumsq_torch_order
from ..common.rounding import INTERPRET, round_to, rround
from ..common.welford import fma_rn, rsqrt_approx
from ..env import env
from ..errors import UnsupportedInput
from ..common.launch import launch

_ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _load_rows(txt_ptr, img_ptr, b, s, h, row_ok, d, d_ok,
               t_sb, t_ss, t_sh, t_sd, i_sb, i_ss, i_sh, i_sd,
               S_TXT, HAS_TXT: tl.constexpr):
    """[R, DP] fp32: row (b, s, h) of the joint sequence from the text input (s < S_TXT) or the
    image input (s - S_TXT); masked columns and rows are 0."""
    in_txt = s < S_TXT
    img_row = b * i_sb + (s - S_TXT) * i_ss + h * i_sh
    m_img = (row_ok & (s >= S_TXT))[:, None] & d_ok[None, :]
    x = tl.load(img_ptr + img_row[:, None] + d[None, :] * i_sd, mask=m_img, other=0.0).to(tl.float32)
    if HAS_TXT:
        txt_row = b * t_sb + s * t_ss + h * t_sh
        m_txt = (row_ok & in_txt)[:, None] & d_ok[None, :]
        xt = tl.load(txt_ptr + txt_row[:, None] + d[None, :] * t_sd, mask=m_txt, other=0.0).to(tl.float32)
        x = tl.where(m_txt, xt, x)
    return x


@triton.jit
def _row_weight(wt_ptr, wi_ptr, s, d, d_ok, S_TXT,
                HAS_TXT: tl.constexpr, HAS_WT: tl.constexpr, HAS_WI: tl.constexpr):
    """[R, DP] fp32 weight of each row's source; 1.0 where that source has no weight
    (``1.0 * v == v`` bit for bit, so ``w * (rstd * x)`` then equals torch's gamma-less
    ``rstd * x``)."""
    if HAS_WI:
        wi = tl.load(wi_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        wi = tl.full(d.shape, 1.0, tl.float32)
    if HAS_TXT:
        if HAS_WT:
            wt = tl.load(wt_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        else:
            wt = tl.full(d.shape, 1.0, tl.float32)
        w = tl.where((s < S_TXT)[:, None], wt[None, :], wi[None, :])
    else:
        w = tl.broadcast_to(wi[None, :], [s.shape[0], d.shape[0]])
    return w


@triton.jit
def _neg(x):
    """Sign flip (eager's negation; Triton's ``-x`` is ``0 - x`` and loses -0)."""
    return (x.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)


@triton.jit
def _fma(a, b, c):
    """``fma.rn.f32``: one rounding. Under the interpreter ``tl.fma`` rounds twice and the fp64
    route of ``common.welford.fma_rn`` can double-round for fp32 products, so the fp64 sum is
    rounded to odd first (TwoSum error, as ``reference.fma32``): then fp64 -> fp32 is exact RNE."""
    if INTERPRET:
        p = a.to(tl.float64) * b.to(tl.float64)  # exact: 24 + 24 bits
        c64 = c.to(tl.float64)
        s = p + c64
        bp = s - c64
        err = (p - bp) + (c64 - (s - bp))
        bits = s.to(tl.int64, bitcast=True)
        nudge = (err != 0) & ((bits & 1) == 0) & (s == s) & (tl.abs(s) != float("inf"))
        step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
        s = tl.where(nudge, bits + step, bits).to(tl.float64, bitcast=True)
        return s.to(tl.float32)
    else:
        return tl.fma(a, b, c)


@triton.jit
def _cmul(a, b, c, d, CMUL: tl.constexpr):
    """``(a + ib) * (c + id)`` as ``c10::complex<float>::operator*=`` computes ``real = a*c - b*d;
    imag = a*d + b*c`` under each possible contraction (products r32 unless fused):
    0: none; 1: fma(a, c, -bd), fma(a, d, bc); 2: fma(-b, d, ac), fma(b, c, ad);
    3: fma(a, c, -bd), fma(b, c, ad); 4: fma(-b, d, ac), fma(a, d, bc)."""
    if CMUL == 0:
        re = a * c - b * d
        im = a * d + b * c
    elif CMUL == 1:
        re = _fma(a, c, _neg(b * d))
        im = _fma(a, d, b * c)
    elif CMUL == 2:
        re = _fma(_neg(b), d, a * c)
        im = _fma(b, c, a * d)
    elif CMUL == 3:
        re = _fma(a, c, _neg(b * d))
        im = _fma(b, c, a * d)
    else:
        tl.static_assert(CMUL == 4, "CMUL is 0..4")
        re = _fma(_neg(b), d, a * c)
        im = _fma(a, d, b * c)
    return re, im


@triton.jit
def _norm_rope_store(x, w, cos_e, cos_o, sin_e, sin_o, out_ptr, out_off, mask, eps,
                     in_txt, fac_img, fac_txt,
                     D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
                     ROPE: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr,
                     NORM: tl.constexpr, HAS_TXT: tl.constexpr, W_IMG: tl.constexpr,
                     W_TXT: tl.constexpr, VEC: tl.constexpr, CMUL: tl.constexpr):
    if NORM == 0:
        rstd = rms_rstd(rms_sumsq_torch_order(x, R, DP), D, eps)
        # torch: gamma * (rstd * x), one rounding to the dtype (the eager op's store); the close
        # variant keeps the fp32 value for RoPE.
        n = w * (rstd[:, None] * x)
        if EXACT:
            n = rround(n, DTYPE)
    else:
        # diffusers RMSNorm: pow(2), mean (torch's generic reduction; each stream is its own
        # mean call, hence its own lane count and factor), + eps, rsqrt, x * rstd in fp32, then
        # .to(weight dtype) and * weight: two roundings (w = 1.0 without weight: exact).
        sq = x * x
        ss = rms_sumsq_reduce_order(sq, R, DP, W_IMG, VEC)
        if HAS_TXT:
            if W_TXT != W_IMG:
                ss = tl.where(in_txt, rms_sumsq_reduce_order(sq, R, DP, W_TXT, VEC), ss)
            ms = ss * tl.where(in_txt, fac_txt, fac_img)
        else:
            ms = ss * fac_img
        rstd = rsqrt_approx(ms + eps)
        n = rround(rround(x * rstd[:, None], DTYPE) * w, DTYPE)
    if ROPE == 2:
        a, b = tl.split(tl.reshape(n, [R, DP // 2, 2]))
        re, im = _cmul(a, b, cos_e, sin_e, CMUL)
        out = tl.reshape(tl.join(re, im), [R, DP])
    elif ROPE == 1 or ROPE == 3:
        ye, yo = tl.split(tl.reshape(n, [R, DP // 2, 2]))
        # x.float() * cos, x_rotated.float() * sin, then their sum: three eager ops, three fp32
        # roundings (no FMA: the launch disables fp fusion). Eager's ``-x_imag`` is written as a
        # subtraction: a + (-y)*s == a - y*s bit for bit (signed zeros included), whereas
        # Triton's unary minus is ``0 - y`` and turns -0 into +0.
        oe = ye * cos_e - yo * sin_e
        oo = yo * cos_o + ye * sin_o
        out = tl.reshape(tl.join(oe, oo), [R, DP])
        if ROPE == 3:  # HunyuanVideo 1.5: the text rows are not rotated (an identity rotation
            # would not be one: -0 * 1 + 0 is +0)
            out = tl.where(in_txt[:, None], n, out)
    else:
        out = n
    tl.store(out_ptr + out_off, round_to(out, DTYPE), mask=mask)


@triton.jit
def _qk_rmsnorm_rope_kernel(
    q_img, k_img, q_txt, k_txt, wq_img, wk_img, wq_txt, wk_txt,
    cos_ptr, sin_ptr, q_out, k_out,
    qi_sb, qi_ss, qi_sh, qi_sd, ki_sb, ki_ss, ki_sh, ki_sd,
    qt_sb, qt_ss, qt_sh, qt_sd, kt_sb, kt_ss, kt_sh, kt_sd,
    c_ss, c_sd, s_ss, s_sd, c_sb, s_sb,
    n_rows, S_TXT, S_TOT, H, eps, fac_img, fac_txt,
    D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
    HAS_TXT: tl.constexpr, ROPE: tl.constexpr,
    HAS_WQI: tl.constexpr, HAS_WKI: tl.constexpr, HAS_WQT: tl.constexpr, HAS_WKT: tl.constexpr,
    DTYPE: tl.constexpr, EXACT: tl.constexpr,
    NORM: tl.constexpr = 0, W_IMG: tl.constexpr = 32, W_TXT: tl.constexpr = 32, VEC: tl.constexpr = 1,
    CMUL: tl.constexpr = 0, LAYOUT: tl.constexpr = 0,
):
    """ROPE 0: none; 1 (FLUX): ``cos_ptr``/``sin_ptr`` are cos/sin [S_tot, D] with strides
    (c_ss, c_sd)/(s_ss, s_sd); 3 (HunyuanVideo 1.5): the same rotation with cos/sin [S_img, D]
    on the image rows only; 2 (complex): ``cos_ptr`` is the image table and ``sin_ptr`` the
    text table, each fp32 [S, D/2, 2] (``view_as_real`` of complex64: re at +0, im at +1) with
    row/pair strides (c_ss, c_sd)/(s_ss, s_sd) and batch strides c_sb/s_sb (0: one table for
    every sample; Z-Image's per-sample [B, S, D/2] freqs otherwise). NORM 0: torch.nn.RMSNorm (``_fused_rms_norm``);
    1: diffusers RMSNorm (W_IMG/W_TXT lanes, VEC, per-stream mean factors fac_img/fac_txt)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < n_rows
    if LAYOUT == 0:
        h = rows % H
        bs = rows // H
        s = bs % S_TOT
        b = bs // S_TOT
    elif LAYOUT == 2:
        # Tokens-first, image-first output [B, S_TOT, H, D] (HunyuanVideo 1.5): output row
        # (b, so, h), mapped to the text-first joint index s the loaders take.
        h = rows % H
        bso = rows // H
        so = bso % S_TOT
        b = bso // S_TOT
        s_img = S_TOT - S_TXT
        s = tl.where(so < s_img, so + S_TXT, so - s_img)
    else:
        # Heads-first, image-first output [B, H, S_TOT, D] (SD3): output position so, mapped to
        # the text-first joint index s the loaders take (text rows s < S_TXT, image s - S_TXT).
        so = rows % S_TOT
        bh = rows // S_TOT
        h = bh % H
        b = bh // H
        s_img = S_TOT - S_TXT
        s = tl.where(so < s_img, so + S_TXT, so - s_img)
    d = tl.arange(0, DP)
    d_ok = d < D
    mask = row_ok[:, None] & d_ok[None, :]
    # Output rows are (b, s, h) of a contiguous [B, S_TOT, H, D] (LAYOUT 1: (b, h, so) of a
    # contiguous [B, H, S_TOT, D]; LAYOUT 2: (b, so, h)): row r starts at r * D.
    out_off = rows[:, None] * D + d[None, :]

    in_txt = s < S_TXT
    if ROPE == 2:
        # Each stream's own table: text rows s, image rows s - S_TXT (no joint table is built).
        pi = tl.arange(0, DP // 2)
        p_ok = (pi < D // 2)[None, :] & row_ok[:, None]
        m_img = p_ok & (~in_txt)[:, None]
        f_img = cos_ptr + (b * c_sb + (s - S_TXT) * c_ss)[:, None] + pi[None, :] * c_sd
        cos_e = tl.load(f_img, mask=m_img, other=0.0)
        sin_e = tl.load(f_img + 1, mask=m_img, other=0.0)
        if HAS_TXT:
            m_txt = p_ok & in_txt[:, None]
            f_txt = sin_ptr + (b * s_sb + s * s_ss)[:, None] + pi[None, :] * s_sd
            cos_e = tl.where(m_txt, tl.load(f_txt, mask=m_txt, other=0.0), cos_e)
            sin_e = tl.where(m_txt, tl.load(f_txt + 1, mask=m_txt, other=0.0), sin_e)
        cos_o = cos_e
        sin_o = sin_e
    elif ROPE == 3:
        # cos/sin [S_img, D] of the image stream, read at the image rows only
        de = tl.arange(0, DP // 2) * 2
        de_ok = (de < D)[None, :] & (row_ok & ~in_txt)[:, None]
        si = tl.where(in_txt, 0, s - S_TXT)
        c_row = si[:, None] * c_ss
        s_row = si[:, None] * s_ss
        cos_e = tl.load(cos_ptr + c_row + de[None, :] * c_sd, mask=de_ok, other=0.0).to(tl.float32)
        cos_o = tl.load(cos_ptr + c_row + (de[None, :] + 1) * c_sd, mask=de_ok, other=0.0).to(tl.float32)
        sin_e = tl.load(sin_ptr + s_row + de[None, :] * s_sd, mask=de_ok, other=0.0).to(tl.float32)
        sin_o = tl.load(sin_ptr + s_row + (de[None, :] + 1) * s_sd, mask=de_ok, other=0.0).to(tl.float32)
    elif ROPE == 1:
        de = tl.arange(0, DP // 2) * 2
        de_ok = (de < D)[None, :] & row_ok[:, None]
        c_row = s[:, None] * c_ss
        s_row = s[:, None] * s_ss
        cos_e = tl.load(cos_ptr + c_row + de[None, :] * c_sd, mask=de_ok, other=0.0).to(tl.float32)
        cos_o = tl.load(cos_ptr + c_row + (de[None, :] + 1) * c_sd, mask=de_ok, other=0.0).to(tl.float32)
        sin_e = tl.load(sin_ptr + s_row + de[None, :] * s_sd, mask=de_ok, other=0.0).to(tl.float32)
        sin_o = tl.load(sin_ptr + s_row + (de[None, :] + 1) * s_sd, mask=de_ok, other=0.0).to(tl.float32)
    else:
        cos_e = tl.zeros([R, DP // 2], tl.float32)
        cos_o = cos_e
        sin_e = cos_e
        sin_o = cos_e

    xq = _load_rows(q_txt, q_img, b, s, h, row_ok, d, d_ok,
                    qt_sb, qt_ss, qt_sh, qt_sd, qi_sb, qi_ss, qi_sh, qi_sd, S_TXT, HAS_TXT)
    wq = _row_weight(wq_txt, wq_img, s, d, d_ok, S_TXT, HAS_TXT, HAS_WQT, HAS_WQI)
    _norm_rope_store(xq, wq, cos_e, cos_o, sin_e, sin_o, q_out, out_off, mask, eps,
                     in_txt, fac_img, fac_txt, D, DP, R, ROPE, DTYPE, EXACT,
                     NORM, HAS_TXT, W_IMG, W_TXT, VEC, CMUL)

    xk = _load_rows(k_txt, k_img, b, s, h, row_ok, d, d_ok,
                    kt_sb, kt_ss, kt_sh, kt_sd, ki_sb, ki_ss, ki_sh, ki_sd, S_TXT, HAS_TXT)
    wk = _row_weight(wk_txt, wk_img, s, d, d_ok, S_TXT, HAS_TXT, HAS_WKT, HAS_WKI)
    _norm_rope_store(xk, wk, cos_e, cos_o, sin_e, sin_o, k_out, out_off, mask, eps,
                     in_txt, fac_img, fac_txt, D, DP, R, ROPE, DTYPE, EXACT,
                     NORM, HAS_TXT, W_IMG, W_TXT, VEC, CMUL)


# ---------------------------------------------------------------------------------------------
# The vector-per-lane kernel: the same row arithmetic without layout conversions
#
# The tile kernel above reshapes a row [R, DP] into torch's thread vectors and lane tree with
# reshape/split/sum-of-two steps, each of which Triton lowers to a round trip through shared
# memory: it ran at 44 % of copy bandwidth (notes/rope.md). Here rows are loaded as [T, R, 4]
# tiles with T = D / 4 lanes: lane l of a warp holds exactly torch's thread-l vector (elements
# 4l .. 4l + 3) of each of its rows in registers, so the per-thread chain is four in-register
# values, the lane tree is one ``tl.sum`` over axis 0 (butterfly shuffles T/2 .. 1: lane 0's
# result is the shfl-down tree's, and every lane holds it) and RoPE pairs (4l, 4l + 1),
# (4l + 2, 4l + 3) never leave the thread. The lane axis comes first because Triton's coalescing
# pass orders equally contiguous dims by index: [T, R, 4] gets threadsPerWarp [T, 32 / T, 1]
# and its warps along the rows (an [R, T, 4] tile got lanes split over rows). It covers the cases
# whose torch order is "one vector per lane, one warp": torch.nn.RMSNorm with D / 4 a power of
# two <= 32 (threads past T hold 0 in torch, and adding 0 to a sum of squares is exact), and
# diffusers' RMSNorm at D = 128 (the generic reduction's vectorized launch, 32 lanes). The host
# checks each compiled layout (common/warp.py ``lane_layout_ok``) before trusting a binary.


@triton.jit
def _quad(t):
    """[P, R, V, 4] -> its four [P, R, V] elements (in-register: the 4 is a thread's vector)."""
    t02, t13 = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], t.shape[2], 2, 2]))
    t0, t2 = tl.split(t02)
    t1, t3 = tl.split(t13)
    return t0, t1, t2, t3


@triton.jit
def _unquad(o0, o1, o2, o3):
    """Inverse of :func:`_quad`."""
    y = tl.join(tl.join(o0, o2), tl.join(o1, o3))
    return tl.reshape(y, [o0.shape[0], o0.shape[1], o0.shape[2], 4])


@triton.jit
def _fold_virtual(acc, P: tl.constexpr, R: tl.constexpr, V: tl.constexpr):
    """[P, R, V] per-virtual-lane sums -> [P, R]: the top levels of torch's lane tree, which pair
    virtual lanes held by one thread (thread p holds virtual lanes p + P * v). V = 2: the offset-P
    level, a_p + a_(p+P); V = 4: levels 2P and P, (a_p + a_(p+2P)) + (a_(p+P) + a_(p+3P))."""
    if V == 1:
        return tl.reshape(acc, [P, R])
    elif V == 2:
        a0, a1 = tl.split(acc)
        return a0 + a1
    else:
        tl.static_assert(V == 4, "V is 1, 2 or 4")
        a02, a13 = tl.split(tl.reshape(acc, [P, R, 2, 2]))
        a0, a2 = tl.split(a02)
        a1, a3 = tl.split(a13)
        return (a0 + a2) + (a1 + a3)


@triton.jit
def _lane_norm_rope_store(x, w, c, sn, out_ptr, out_off, mask, eps, in_txt, fac_img, fac_txt,
                          D: tl.constexpr, R: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
                          ROPE: tl.constexpr, DTYPE: tl.constexpr, EXACT: tl.constexpr,
                          NORM: tl.constexpr, HAS_TXT: tl.constexpr, CMUL: tl.constexpr):
    x0, x1, x2, x3 = _quad(x)
    if NORM == 0:
        acc = x0 * x0
        acc = fma_rn(x1, x1, acc)
        acc = fma_rn(x2, x2, acc)
        acc = fma_rn(x3, x3, acc)
        ss = rms_fold_lanes(_fold_virtual(acc, P, R, V), P, R)
        # torch's ``sum / float(D)``: D = 4 * T is a power of two here, so the quotient is the
        # product with the exact reciprocal bit for bit (one correctly rounded operation each),
        # and the IEEE division's instruction sequence is not needed.
        rstd = rsqrt_approx(ss * (1.0 / D) + eps)
        n = w * (rstd[None, :, None, None] * x)
        if EXACT:
            n = rround(n, DTYPE)
    else:
        # The generic reduction's vectorized lane: accumulator j holds element j of the lane's
        # one vector (0 + v == v), then ((a0 + a1) + a2) + a3.
        acc = ((x0 * x0 + x1 * x1) + x2 * x2) + x3 * x3
        ss = rms_fold_lanes(_fold_virtual(acc, P, R, V), P, R)
        if HAS_TXT:
            ms = ss * tl.where(in_txt, fac_txt, fac_img)
        else:
            ms = ss * fac_img
        rstd = rsqrt_approx(ms + eps)
        n = rround(rround(x * rstd[None, :, None, None], DTYPE) * w, DTYPE)
    if ROPE == 0:
        out = n
    else:
        n0, n1, n2, n3 = _quad(n)
        c0, c1, c2, c3 = _quad(c)
        s0, s1, s2, s3 = _quad(sn)
        if ROPE == 1 or ROPE == 3:
            # FLUX: cos/sin per element; see _norm_rope_store for why these are a - b and a + b.
            o0 = n0 * c0 - n1 * s0
            o1 = n1 * c1 + n0 * s1
            o2 = n2 * c2 - n3 * s2
            o3 = n3 * c3 + n2 * s3
        else:
            # Complex: ``c`` holds (re, im) of the lane's two pairs: (c0, c1) and (c2, c3).
            o0, o1 = _cmul(n0, n1, c0, c1, CMUL)
            o2, o3 = _cmul(n2, n3, c2, c3, CMUL)
        out = _unquad(o0, o1, o2, o3)
        if ROPE == 3:
            if in_txt:  # the program's stream: text rows are not rotated
                out = n
    if mask is None:
        tl.store(out_ptr + out_off, round_to(out, DTYPE))
    else:
        tl.store(out_ptr + out_off, round_to(out, DTYPE), mask=mask)


@triton.jit
def _lane_load(ptr, mask):
    if mask is None:
        return tl.load(ptr).to(tl.float32)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _lane_rows(txt_ptr, img_ptr, b, s, h, col, t_sb, t_ss, t_sh, t_sd, i_sb, i_ss, i_sh, i_sd,
               S_TXT, mask, HAS_TXT: tl.constexpr):
    """[P, R, V, 4] fp32: the heads ``h`` of token s of sample b of the joint sequence, from the text
    input (s < S_TXT) or the image input. The stream is the program's: a uniform branch, so each
    load keeps its own (specialised) strides and the per-element offsets stay 32-bit."""
    if HAS_TXT:
        if s < S_TXT:
            x = _lane_load(txt_ptr + (b * t_sb + s * t_ss) + (h[None, :, None, None] * t_sh + col * t_sd), mask)
        else:
            x = _lane_load(img_ptr + (b * i_sb + (s - S_TXT) * i_ss) + (h[None, :, None, None] * i_sh + col * i_sd),
                           mask)
    else:
        x = _lane_load(img_ptr + (b * i_sb + s * i_ss) + (h[None, :, None, None] * i_sh + col * i_sd), mask)
    return x


@triton.jit
def _lane_weight(wt_ptr, wi_ptr, in_txt, col, HAS_TXT: tl.constexpr, HAS_WT: tl.constexpr,
                 HAS_WI: tl.constexpr):
    """[P, R, V, 4] fp32 weight of the program's stream (1.0 for a stream without weight), loaded
    through the full-shape ``col`` (see the kernel)."""
    one = tl.full(col.shape, 1.0, tl.float32)
    if HAS_TXT:
        if in_txt:
            if HAS_WT:
                w = tl.load(wt_ptr + col).to(tl.float32)
            else:
                w = one
        else:
            if HAS_WI:
                w = tl.load(wi_ptr + col).to(tl.float32)
            else:
                w = one
    else:
        if HAS_WI:
            w = tl.load(wi_ptr + col).to(tl.float32)
        else:
            w = one
    return w


@triton.jit
def _qk_lanes_kernel(
    q_img, k_img, q_txt, k_txt, wq_img, wk_img, wq_txt, wk_txt,
    cos_ptr, sin_ptr, q_out, k_out,
    qi_sb, qi_ss, qi_sh, qi_sd, ki_sb, ki_ss, ki_sh, ki_sd,
    qt_sb, qt_ss, qt_sh, qt_sd, kt_sb, kt_ss, kt_sh, kt_sd,
    c_ss, c_sd, s_ss, s_sd, c_sb, s_sb,
    n_rows, S_TXT, S_TOT, H, eps, fac_img, fac_txt,
    D: tl.constexpr, T: tl.constexpr, R: tl.constexpr,
    HAS_TXT: tl.constexpr, ROPE: tl.constexpr,
    HAS_WQI: tl.constexpr, HAS_WKI: tl.constexpr, HAS_WQT: tl.constexpr, HAS_WKT: tl.constexpr,
    DTYPE: tl.constexpr, EXACT: tl.constexpr,
    NORM: tl.constexpr = 0, CMUL: tl.constexpr = 0, LAYOUT: tl.constexpr = 0, PACKED: tl.constexpr = False,
    EVEN_H: tl.constexpr = True, V: tl.constexpr = 1,
):
    """:func:`_qk_rmsnorm_rope_kernel`'s contract (same arguments and bits) on [P, R, V, 4] tiles:
    torch's T = D / 4 lanes as P = T / V threads, thread p holding the vectors of torch's lanes
    p, p + P, ..., p + (V - 1) P (``_fold_virtual`` adds those in-register at torch's top tree
    levels; the rest of the tree is the butterfly over the P threads), R heads of one token.
    Grid (B * S_TOT, cdiv(H, R)): program (bs, j) takes heads j*R .. j*R + R - 1 of token bs, so
    the token's sample, position, stream and cos/sin row are per-program scalars (no per-row
    64-bit division: at 128-wide rows that index arithmetic cost more instructions than the
    data). EVEN_H: R divides H (no row mask). PACKED (ROPE 2): both tables have c_sd = s_sd = 2."""
    P: tl.constexpr = T // V
    bs = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * R + tl.arange(0, R)
    b = bs // S_TOT
    s = bs % S_TOT
    in_txt = s < S_TXT
    p = tl.arange(0, P)[:, None, None, None]
    v = tl.arange(0, V)[None, None, :, None]
    e = tl.arange(0, 4)[None, None, None, :]
    zr = tl.zeros([1, R, 1, 1], tl.int32)
    # [P, R, V, 4]: every operand gets this shape (a smaller load would get a layout of its own
    # and a shared-memory conversion where it meets the rows)
    col = p * 4 + v * (4 * P) + e + zr
    if EVEN_H:
        mask = None
    else:
        mask = (h < H)[None, :, None, None] & (col >= 0)
    if LAYOUT == 0:
        out_base = (bs * H) * D
        out_off = h[None, :, None, None] * D + col
    elif LAYOUT == 2:
        # Tokens-first, image-first [B, S_TOT, H, D] (HunyuanVideo 1.5).
        so = tl.where(in_txt, s + (S_TOT - S_TXT), s - S_TXT)
        out_base = ((b * S_TOT + so) * H) * D
        out_off = h[None, :, None, None] * D + col
    else:
        # Heads-first, image-first [B, H, S_TOT, D] (SD3): text rows go after the image rows.
        so = tl.where(in_txt, s + (S_TOT - S_TXT), s - S_TXT)
        out_base = (b * H * S_TOT + so) * D
        out_off = h[None, :, None, None] * (S_TOT * D) + col

    if ROPE == 2:
        # Complex tables: a vector's pairs 2u, 2u + 1 (u = col / 4) -> (re, im, re, im) at
        # pair * c_sd + 0 / 1; PACKED (pairs 2 floats apart, a plain complex64 tensor): the 4
        # floats at col, one load.
        if PACKED:
            c_col = col
            s_col = col
        else:
            pair = (col // 4) * 2 + e // 2
            c_col = pair * c_sd + e % 2
            s_col = pair * s_sd + e % 2
        if HAS_TXT:
            if in_txt:
                c = tl.load(sin_ptr + (b * s_sb + s * s_ss) + s_col)
            else:
                c = tl.load(cos_ptr + (b * c_sb + (s - S_TXT) * c_ss) + c_col)
        else:
            c = tl.load(cos_ptr + (b * c_sb + s * c_ss) + c_col)
        sn = c
    elif ROPE == 1:
        c = tl.load(cos_ptr + s * c_ss + col * c_sd).to(tl.float32)
        sn = tl.load(sin_ptr + s * s_ss + col * s_sd).to(tl.float32)
    elif ROPE == 3:
        si = tl.where(in_txt, 0, s - S_TXT)  # text programs read row 0 and do not rotate
        c = tl.load(cos_ptr + si * c_ss + col * c_sd).to(tl.float32)
        sn = tl.load(sin_ptr + si * s_ss + col * s_sd).to(tl.float32)
    else:
        c = tl.zeros([P, R, V, 4], tl.float32)
        sn = c
    if not EVEN_H:
        h = tl.where(h < H, h, 0)  # masked rows read head 0 (valid memory), store nothing

    xq = _lane_rows(q_txt, q_img, b, s, h, col, qt_sb, qt_ss, qt_sh, qt_sd,
                    qi_sb, qi_ss, qi_sh, qi_sd, S_TXT, mask, HAS_TXT)
    xk = _lane_rows(k_txt, k_img, b, s, h, col, kt_sb, kt_ss, kt_sh, kt_sd,
                    ki_sb, ki_ss, ki_sh, ki_sd, S_TXT, mask, HAS_TXT)
    wq = _lane_weight(wq_txt, wq_img, in_txt, col, HAS_TXT, HAS_WQT, HAS_WQI)
    _lane_norm_rope_store(xq, wq, c, sn, q_out + out_base, out_off, mask, eps, in_txt, fac_img, fac_txt,
                          D, R, P, V, ROPE, DTYPE, EXACT, NORM, HAS_TXT, CMUL)
    wk = _lane_weight(wk_txt, wk_img, in_txt, col, HAS_TXT, HAS_WKT, HAS_WKI)
    _lane_norm_rope_store(xk, wk, c, sn, k_out + out_base, out_off, mask, eps, in_txt, fac_img, fac_txt,
                          D, R, P, V, ROPE, DTYPE, EXACT, NORM, HAS_TXT, CMUL)


# ---------------------------------------------------------------------------------------------
# Predicate


def _suggests_channels_last(t: torch.Tensor) -> bool:
    """c10's ``is_channels_last_strides_2d_s4`` for a 4-D tensor: ``F.rms_norm`` sends a tensor
    whose strides suggest channels-last to its composite (unfused) path."""
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return False
    lo = 0
    for dim in (1, 3, 2, 0):
        if sizes[dim] == 0 or strides[dim] < lo:
            return False
        if dim == 0 and lo == strides[1]:
            return False
        lo = strides[dim] * (sizes[dim] if sizes[dim] > 1 else 1)
    return True


def _vector_aligned(t: torch.Tensor) -> bool:
    """torch's vectorized kernel needs the row data (after ``expect_contiguous``, which copies a
    non-contiguous tensor into a fresh, aligned buffer) aligned to 4 elements."""
    if torch.compiler.is_compiling():  # no addresses while tracing
        return True
    return not t.is_contiguous() or t.data_ptr() % (RMS_VEC_WIDTH * t.element_size()) == 0


def _qk_inputs_reason(q, k, q_weight, k_weight, q_txt, k_txt, q_txt_weight, k_txt_weight,
                      tables: tuple) -> str | None:
    """The checks every QK op shares: q/k (and the text q/k) tensors of one [B, S, H, D] shape
    per stream with B, H, D in common, text weights only with text, one device, no grad, one
    supported dtype (``torch.cat`` would type-promote mixed ones). ``tables``: the op's RoPE
    tensors (or Nones), checked for device and grad only."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "q and k must be tensors"
    if (q_txt is None) != (k_txt is None):
        return "q_txt and k_txt must be given together"
    if q_txt is None and (q_txt_weight is not None or k_txt_weight is not None):
        return "text weights given without text inputs"
    inputs = [t for t in (q, k, q_txt, k_txt) if t is not None]
    tensors = inputs + [t for t in (q_weight, k_weight, q_txt_weight, k_txt_weight, *tables) if t is not None]
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if q.dim() != 4 or q.shape != k.shape:
        return f"q and k must be [B, S, H, D] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
    B, _, H, D = q.shape
    if q_txt is not None:
        if q_txt.dim() != 4 or q_txt.shape != k_txt.shape:
            return "q_txt and k_txt must be [B, S_txt, H, D] of one shape"
        if (q_txt.shape[0], q_txt.shape[2], q_txt.shape[3]) != (B, H, D):
            return "text and image inputs differ in B, H or D"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not bf16, fp16 or fp32"
    if any(t.dtype != q.dtype for t in inputs):
        return "q, k, q_txt, k_txt have different dtypes (torch.cat would type-promote)"
    return None


def _unsupported_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
    norm_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the kernel does not reproduce the chain (None: it does). ``norm_dtype``: the dtype
    torch normalises in when the chain upcasts first (``norm(q.float())``, FLUX.3): the weights
    must be of that dtype, and an input of another dtype reaches ``F.rms_norm`` as a fresh copy,
    whose alignment is the allocator's, not the input's."""
    if (cos is None) != (sin is None):
        return "cos and sin must be given together"
    reason = _qk_inputs_reason(q, k, q_weight, k_weight, q_txt, k_txt, q_txt_weight, k_txt_weight, (cos, sin))
    if reason:
        return reason
    B, S_img, H, D = q.shape
    inputs = [t for t in (q, k, q_txt, k_txt) if t is not None]
    weights = [t for t in (q_weight, k_weight, q_txt_weight, k_txt_weight) if t is not None]
    dtype = norm_dtype or q.dtype
    if D % RMS_VEC_WIDTH != 0:
        return f"head_dim {D} is not a multiple of 4 (torch takes its non-vectorized RMSNorm path)"
    if D > RMS_MAX_WIDTH:
        return f"head_dim {D} > {RMS_MAX_WIDTH} (torch's threads then sum several vectors each)"
    for w in weights:
        if w.dim() != 1 or w.shape[0] != D:
            return f"a weight has shape {tuple(w.shape)}, expected ({D},)"
        if w.dtype != dtype:
            return (f"a weight is {w.dtype}, the normalised input {dtype} (F.rms_norm then runs its "
                    "composite path)")
    for t in inputs:
        if _suggests_channels_last(t):
            return "an input's strides suggest channels-last (F.rms_norm then runs its composite path)"
    for t in [t for t in inputs if t.dtype == dtype] + weights:
        if not _vector_aligned(t):
            return "a contiguous input or weight is not 4-element aligned (torch's non-vectorized path)"
    if cos is not None:
        S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
        for t in (cos, sin):
            if t.dim() != 2 or tuple(t.shape) != (S_tot, D):
                return f"cos/sin must be [S_txt + S_img, D] = [{S_tot}, {D}], got {tuple(t.shape)}"
            if t.dtype not in _ROPE_DTYPES:
                return f"cos/sin dtype {t.dtype} is not fp32, bf16 or fp16 (the RoPE would not compute in fp32)"
    if not isinstance(eps, (int, float)):
        return "eps must be a Python number"
    return None


def can_use_qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> bool:
    """True when :func:`qk_rmsnorm_rope` reproduces the reference bit for bit on these inputs.

    Rejected (False), each a case torch computes differently or the kernel does not take:
    - tensors on different devices; a device other than CUDA (the CPU only under
      TRITON_INTERPRET=1); an input requiring grad while grad mode is on (no backward);
    - q/k not 4-D [B, S, H, D] of one shape; q_txt/k_txt (or cos/sin) given one without the
      other; text inputs whose B, H, D differ from the image inputs'; text weights without text;
    - dtype other than bf16/fp16/fp32, or mixed dtypes among q, k, q_txt, k_txt;
    - head_dim D not a multiple of 4 (torch's non-vectorized RMSNorm kernels, another order) or
      D > 512 (torch's threads then accumulate several vectors; not implemented);
    - a weight that is not [D] or whose dtype differs from the input's (F.rms_norm's composite
      path, several roundings);
    - an input whose strides suggest channels-last (F.rms_norm's composite path);
    - a contiguous input or weight not aligned to 4 elements (torch's non-vectorized path);
    - cos/sin not [S_txt + S_img, D] or not fp32/bf16/fp16.
    Strided inputs (e.g. chunks of a fused qkv projection) are accepted: torch copies them
    contiguous first, which changes no value.
    """
    return (
        _unsupported_reason(
            q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight
        )
        is None
    )


# ---------------------------------------------------------------------------------------------
# Custom op and launch


def _block_rows(D: int) -> int:
    # About 1K elements per tensor per program (8 rows of 128) with 2 warps: the fastest tiling
    # the H200 probe measured (bench/probe_qk_rmsnorm_rope.py, notes/rope.md).
    return max(1, 1024 // next_pow2(D))


QK_KERNELS = ("auto", "lanes", "tile")


def qk_kernel_mode() -> str:
    """``DITFUSE_QK_KERNEL``: ``auto`` (default) and ``lanes`` take the vector-per-lane kernel
    wherever it reproduces torch's order, ``tile`` the tile kernel always (the A/B). All give the
    same bits; an unknown value is an error."""
    v = env("DITFUSE_QK_KERNEL", "auto").strip().lower() or "auto"
    if v not in QK_KERNELS:
        raise ValueError(f"DITFUSE_QK_KERNEL={v!r}: expected one of {', '.join(QK_KERNELS)}")
    return v


def _lane_plan(D: int, extra: dict, kernel: str | None) -> int | None:
    """Lanes per row (T = D / 4) when the vector-per-lane kernel computes this launch's order,
    else None: torch.nn.RMSNorm with T a power of two from 8 to 32 (narrower rows: Triton then
    spreads a warp over more rows than the tilings below fill); diffusers' RMSNorm only at
    D = 128 with the vectorized 32-lane reduction in every stream."""
    mode = kernel or qk_kernel_mode()
    if mode == "tile" or D % 4:
        return None
    T = D // 4
    if T not in (8, 16, 32):
        return None
    if extra.get("NORM", 0) == 1 and not (D == 128 and extra.get("VEC") == 4
                                          and extra.get("W_IMG") == 32 and extra.get("W_TXT") == 32):
        return None
    return T


def _lane_tiling(T: int, H: int) -> tuple[int, int, int]:
    """(heads per program R, warps, virtual lanes per thread V) of the lane kernel for T lanes per
    row and H heads. V = 2 where T allows (each thread holds two of torch's lanes: half the
    butterfly and rstd work per element), R = 8 heads (fewer only when H is smaller); a warp
    spans 32 / (T / V) rows and gets at least that many (with fewer, or a single row per
    program, Triton's layout no longer puts one row's lanes in one warp: the guard would refuse
    the binary); at most four warps. Any tiling gives the same bits; the H200 probe
    (bench/probes/probe_qk_rmsnorm_rope.py) sweeps them."""
    V = 2 if T >= 16 else 1
    span = 32 // (T // V)
    R = max(min(8, next_pow2(H)), 2 * span)
    if interpreter_on():
        return R, 1, V
    return R, max(1, min(4, R // span)), V


def _table_strides(t: torch.Tensor) -> tuple[int, int]:
    """(row, column) strides of a [S, X] or [B, S, X] table."""
    return t.stride()[-2], t.stride()[-1]


def _batch_stride(t: torch.Tensor) -> int:
    """A [B, S, X] table's sample stride; 0 for a [S, X] or [1, S, X] table (shared by all samples)."""
    return t.stride(0) if t.dim() == 3 and t.shape[0] > 1 else 0


class _Recipe(NamedTuple):
    """Everything a QK launch computes from its inputs' geometry (cached per geometry by the
    public functions, common/plans.py): output shape, the scalar arguments after the pointers,
    and each kernel's grid and constexprs (the lane kernel's None where it does not apply)."""

    out_shape: tuple[int, ...]
    empty: bool
    has_txt: bool
    has_rope: bool
    scalars: tuple
    lanes: tuple | None  # (grid, kwargs, T // V)
    tile: tuple  # (grid, kwargs)


def _recipe(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
            exact: bool = True, rows_per_program: int | None = None, num_warps: int = 2,
            rope: int | None = None, diffusers: dict | None = None, kernel: str | None = None,
            lanes_tiling: tuple[int, int, int] | None = None) -> _Recipe:
    B, S_img, H, D = q.shape
    S_txt = q_txt.shape[1] if q_txt is not None else 0
    S_tot = S_txt + S_img
    out_shape = (B, H, S_tot, D) if (diffusers or {}).get("LAYOUT", 0) == 1 else (B, S_tot, H, D)
    n_rows = B * S_tot * H
    has_txt = q_txt is not None
    has_rope = cos is not None
    if n_rows == 0 or D == 0:
        return _Recipe(out_shape, True, has_txt, has_rope, (), None, ((0,), {}))
    if rope is None:
        rope = 1 if has_rope else 0
    extra = dict(diffusers or {})
    fac_img = extra.pop("fac_img", 1.0)
    fac_txt = extra.pop("fac_txt", 1.0)
    qt = q_txt if has_txt else q
    kt = k_txt if has_txt else k
    scalars = (
        *q.stride(), *k.stride(), *qt.stride(), *kt.stride(),
        *(_table_strides(cos) if has_rope else (0, 0)), *(_table_strides(sin) if has_rope else (0, 0)),
        _batch_stride(cos) if has_rope else 0, _batch_stride(sin) if has_rope else 0,
        n_rows, S_txt, S_tot, H, float(eps), fac_img, fac_txt,
    )
    consts = dict(HAS_TXT=has_txt, ROPE=rope,
                  HAS_WQI=q_weight is not None, HAS_WKI=k_weight is not None,
                  HAS_WQT=q_txt_weight is not None, HAS_WKT=k_txt_weight is not None,
                  DTYPE=tl_dtype(q.dtype), EXACT=exact)
    lanes = None
    T = _lane_plan(D, extra, kernel)
    if T is not None:
        R, nw, V = lanes_tiling or _lane_tiling(T, H)
        lane_consts = {k_: v for k_, v in extra.items() if k_ in ("NORM", "CMUL", "LAYOUT")}
        if rope == 2 and _table_strides(cos)[1] == 2 and _table_strides(sin)[1] == 2:
            lane_consts["PACKED"] = True
        if H % R:
            lane_consts["EVEN_H"] = False
        lanes = ((B * S_tot, cdiv(H, R)),
                 dict(D=D, T=T, R=R, V=V, **consts, **lane_consts, num_warps=nw, enable_fp_fusion=False), T // V)
    R = rows_per_program or _block_rows(D)
    tile = ((cdiv(n_rows, R),),
            dict(D=D, DP=next_pow2(D), R=R, **consts, **extra, num_warps=num_warps, enable_fp_fusion=False))
    return _Recipe(out_shape, False, has_txt, has_rope, scalars, lanes, tile)


def _fire(r: _Recipe, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight):
    """Allocate the joint outputs and launch recipe ``r`` on these tensors (the ones it was made
    for, or any of the same geometry)."""
    q_out = torch.empty(r.out_shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(r.out_shape, dtype=q.dtype, device=q.device)
    if r.empty:
        return q_out, k_out
    dummy = q
    args = (
        q, k, q_txt if r.has_txt else q, k_txt if r.has_txt else k,
        q_weight if q_weight is not None else dummy,
        k_weight if k_weight is not None else dummy,
        q_txt_weight if q_txt_weight is not None else dummy,
        k_txt_weight if k_txt_weight is not None else dummy,
        cos if r.has_rope else dummy, sin if r.has_rope else dummy,
        q_out, k_out, *r.scalars,
    )
    if r.lanes is not None:
        grid, kw, lanes = r.lanes
        compiled = launch(_qk_lanes_kernel, grid, *args, **kw)
        if lane_layout_ok(compiled, lanes):
            return q_out, k_out
    grid, kw = r.tile
    launch(_qk_rmsnorm_rope_kernel, grid, *args, **kw)
    return q_out, k_out


def _launch(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
            exact: bool = True, rows_per_program: int | None = None, num_warps: int = 2,
            rope: int | None = None, diffusers: dict | None = None, kernel: str | None = None,
            lanes_tiling: tuple[int, int, int] | None = None):
    """Allocate the joint outputs and launch. ``kernel``: ``lanes`` / ``tile`` / None (default:
    :func:`qk_kernel_mode`); the vector-per-lane kernel where it reproduces the launch (else, or
    when its compiled layout is refused, the tile kernel). ``rows_per_program`` / ``num_warps``
    tile the tile kernel, ``lanes_tiling`` = (rows, warps, virtual lanes) the lane kernel: tiling never changes
    a row's arithmetic, so any choice gives the same bits; bench/probes/probe_qk_rmsnorm_rope.py
    sweeps them. ``rope``: 0/1/2 (default: 1 with cos/sin, else 0); ``diffusers``: the NORM=1
    constexprs and factors (:func:`_launch_diffusers`). The public functions cache the recipe
    per input geometry (common/plans.py ``Recipes``); this uncached path is for tests and probes."""
    r = _recipe(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, exact,
                rows_per_program, num_warps, rope, diffusers, kernel, lanes_tiling)
    return _fire(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight)


@torch.library.custom_op("ditfuse::qk_rmsnorm_rope", mutates_args=())
def _qk_rmsnorm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
    exact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, exact)


@_qk_rmsnorm_rope_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, exact):
    B, S_img, H, D = q.shape
    S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
    return (
        q.new_empty((B, S_tot, H, D)),
        q.new_empty((B, S_tot, H, D)),
    )


def qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxAttnProcessor's QK-norm + concat + RoPE in one launch, bitwise equal to
    ``ditfuse.kernels.reference.qk_rmsnorm_rope`` on CUDA (torch 2.11).

    q, k: [B, S_img, H, D] (image tokens, or all tokens in single blocks), any strides;
    q_txt, k_txt: [B, S_txt, H, D] or None; weights: [D] in the input dtype or None
    (``elementwise_affine=False``); cos, sin: [S_txt + S_img, D] (fp32) or None (no RoPE).
    Returns contiguous (q_joint, k_joint), each [B, S_txt + S_img, H, D], text first.
    Formula: see the module docstring. Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_qk_rmsnorm_rope` is False.
    """
    return _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, True)


_STD_RECIPES = {True: Recipes(), False: Recipes()}  # exact, close
_FP32_NORM_RECIPES = Recipes()  # qk_fp32_rmsnorm_rope


def _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, exact: bool,
          key: tuple | None = None, norm_dtype: torch.dtype | None = None):
    args = (q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)
    if use_custom_op():
        reason = _unsupported_reason(*args, norm_dtype)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.qk_rmsnorm_rope(
            q, k, q_weight, k_weight, cos, sin, float(eps), q_txt, k_txt, q_txt_weight, k_txt_weight, exact)
    # The fp32-norm op has its own cache: its predicate accepts what the close op's refuses.
    cache = _FP32_NORM_RECIPES if norm_dtype is not None else _STD_RECIPES[exact]
    if key is None:
        key = call_key(args)
    r = cache.checked(key, lambda: _unsupported_reason(*args, norm_dtype), lambda: _recipe(*args, exact))
    return _fire(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight)


def _keyed_std(key, q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None,
               k_txt_weight=None):
    return _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, True, key)


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
qk_rmsnorm_rope.keyed = _keyed_std


def can_use_qk_rmsnorm_rope_fp32(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                                 q_txt_weight=None, k_txt_weight=None) -> bool:
    """True when :func:`qk_rmsnorm_rope_fp32` takes these inputs (the bit-exact predicate)."""
    return _unsupported_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight,
                               k_txt_weight) is None


def qk_rmsnorm_rope_fp32(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                         q_txt_weight=None, k_txt_weight=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Close (quality="high"): :func:`qk_rmsnorm_rope` without rounding the normalised q/k to the
    input dtype before RoPE; each output element is rounded once. Same arguments and rejections."""
    return _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, False)


# ---------------------------------------------------------------------------------------------
# qk_fp32_rmsnorm_rope (FLUX.3): the close variant's arithmetic is another chain's exact one


def can_use_qk_fp32_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                                 q_txt_weight=None, k_txt_weight=None) -> bool:
    """True when :func:`qk_fp32_rmsnorm_rope` is bit-exact for these inputs: those of
    :func:`can_use_qk_rmsnorm_rope`, except that the weights must be fp32 (torch normalises the
    fp32 copy; a weight of another dtype sends ``F.rms_norm`` to its composite path) and a bf16 /
    fp16 input's alignment does not matter (torch normalises a fresh copy)."""
    return _unsupported_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight,
                               k_txt_weight, torch.float32) is None


def qk_fp32_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                         q_txt_weight=None, k_txt_weight=None) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.3's QK chain (diffusers 0.42.1 ``Flux3AttnProcessor``) in one launch, bitwise equal
    to ``ditfuse.kernels.reference.qk_fp32_rmsnorm_rope`` on CUDA (torch 2.11)::

        n   = w * (rstd * x32)    x32 = q.float(), rstd = rsqrtf(sum(x32*x32) / D + eps): torch's
                                  ``_fused_rms_norm`` on the fp32 copy (fp32 weight), not rounded
        out = r(r32(r32(n[2i] * cos) - r32(n[2i+1] * sin)), ...)   the interleaved fp32 RoPE,
                                  then ``.to(q.dtype)``: one rounding

    That is the arithmetic of the close :func:`qk_rmsnorm_rope_fp32` (FLUX.1's chain without its
    mid rounding), which here is the eager chain itself: torch's reduction order is the same for
    fp32 rows (the vectorized kernel takes 4-element vectors in every dtype; docs/numerics.md).
    q, k: [B, S, H, D] bf16 / fp16 / fp32, any strides; weights fp32 [D] or None; cos, sin:
    [S_txt + S_img, D] fp32 or None. Returns contiguous (q, k) in q's dtype. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_qk_fp32_rmsnorm_rope` is False."""
    return _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, False,
                 norm_dtype=torch.float32)


def _keyed_fp32_norm(key, q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None,
                     k_txt_weight=None):
    return _call(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, False, key,
                 norm_dtype=torch.float32)


qk_fp32_rmsnorm_rope.keyed = _keyed_fp32_norm


# ---------------------------------------------------------------------------------------------
# qk_rmsnorm_diffusers_rope_complex (Qwen-Image): the same kernel with NORM=1, ROPE=2

# How nvcc contracted c10::complex<float>::operator*= in torch's CUDA mul kernel (see _cmul):
# re = fma(a, c, -bd), im = fma(a, d, bc), the only mode with 0 differences on the H200
# (bench/results/probe_diffusers_rms_h200.json); tests/gpu/test_qk_rmsnorm_diffusers.py reports all five.
CMUL_MODE = 1

# torch's reduce launch (Reduce.cuh): max_reduce_threads for fp32, warp size, vt0 / vector width.
_REDUCE_MAX_THREADS = 512
_REDUCE_WARP = 32
_REDUCE_VEC = 4


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _reduce_launch(D: int, rows: int) -> tuple[int, int, bool]:
    """(block_width W, vector width, warp split) of torch's ``setReduceConfig`` for the mean over
    the contiguous last dim of a fresh fp32 [rows, D] tensor (``x.float().pow(2)``). The warp
    split (several warps per row, shared-memory fold) is not implemented: the predicate rejects it."""
    vec = _REDUCE_VEC if D >= 128 else 1  # torch 2.11 vectorizes D = 128 (H200 probe)
    dim0 = D // vec
    mnt = _REDUCE_MAX_THREADS
    dim0_pow2 = _last_pow2(dim0) if dim0 < mnt else mnt
    dim1_pow2 = _last_pow2(rows) if rows < mnt else mnt
    width = min(dim0_pow2, _REDUCE_WARP)
    height = min(dim1_pow2, mnt // width)
    width = min(dim0_pow2, mnt // height)
    values_per_thread = -(-D // width)  # div_up(num_inputs, step_input)
    warp_split = values_per_thread >= min(height * 16, 256)
    return width, vec, warp_split


def _mean_factor(rows: int, D: int) -> float:
    """MeanOps' ``factor = static_cast<float>(num_output_elements) / numel`` (float / int64: the
    int64 converted to float, then an fp32 division), computed on the host as torch does."""
    if rows == 0:
        return 1.0
    return float(np.float32(rows) / np.float32(rows * D))


def _reduces_rows_in_place(t: torch.Tensor) -> bool:
    """True when ``t.float().pow(2)`` is a tensor whose last dim is its innermost (stride 1) with
    rows D elements apart, i.e. the mean reduces contiguous rows: the last dim has stride 1 and
    every other dim of size > 1 a stride >= D (so the fresh fp32 copy or ``pow`` output keeps the
    row innermost), and the strides do not suggest channels-last (``.float()`` of a non-dense
    tensor would then allocate channels-last, moving D outward)."""
    D = t.shape[-1]
    if D > 1 and t.stride(-1) != 1:
        return False
    if any(size > 1 and stride < D for size, stride in zip(t.shape[:-1], t.stride()[:-1])):
        return False
    return not _suggests_channels_last(t)


def _diffusers_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
    txt_freqs: torch.Tensor | None,
) -> str | None:
    if txt_freqs is not None and (q_txt is None or freqs is None):
        return "txt_freqs given without text inputs or without image freqs"
    if freqs is not None and q_txt is not None and txt_freqs is None:
        return "text inputs with image freqs need txt_freqs (each stream has its own table)"
    reason = _qk_inputs_reason(q, k, q_weight, k_weight, q_txt, k_txt, q_txt_weight, k_txt_weight,
                               (freqs, txt_freqs))
    if reason:
        return reason
    B, S_img, H, D = q.shape
    inputs = [t for t in (q, k, q_txt, k_txt) if t is not None]
    weights = [t for t in (q_weight, k_weight, q_txt_weight, k_txt_weight) if t is not None]
    dtype = q.dtype
    for w in weights:
        if w.dim() != 1 or w.shape[0] != D:
            return f"a weight has shape {tuple(w.shape)}, expected ({D},)"
        if w.dtype != dtype:
            return (f"a weight is {w.dtype} for {dtype} inputs (diffusers' RMSNorm output would be "
                    f"in the weight's dtype, or fp32 with an fp32 weight)")
    if D >= 128 and D % _REDUCE_VEC != 0:
        return f"head_dim {D} >= 128 is not a multiple of 4 (torch's vectorized mean then handles unaligned rows)"
    for t in inputs:
        if not _reduces_rows_in_place(t):
            return ("an input's head dim is not its innermost contiguous dim (torch's mean would "
                    "reduce along a strided dim, another launch)")
    rows = [B * S_img * H] + ([B * q_txt.shape[1] * H] if q_txt is not None else [])
    for n in rows:
        if n and _reduce_launch(D, n)[2]:
            return f"head_dim {D} with {n} rows: torch splits each row's mean across warps (not implemented)"
    if freqs is not None:
        if D % 2:
            return f"head_dim {D} is odd (complex RoPE pairs elements)"
        streams = [(freqs, S_img, "freqs")] + ([(txt_freqs, q_txt.shape[1], "txt_freqs")] if q_txt is not None else [])
        for f, S, name in streams:
            if f.dtype != torch.complex64:
                return f"{name} is {f.dtype}, not complex64"
            if not ((f.dim() == 2 and tuple(f.shape) == (S, D // 2))
                    or (f.dim() == 3 and f.shape[0] in (1, B) and tuple(f.shape[1:]) == (S, D // 2))):
                return (f"{name} must be [{S}, {D // 2}] or [{B} or 1, {S}, {D // 2}] (complex64 [S, D/2], "
                        f"or per sample), got {tuple(f.shape)}")
            # No conj bit under tracing (dynamo cannot trace is_conj; a traced conj view would
            # then fail in view_as_real inside the op, which the gate reports as an error).
            if not torch.compiler.is_compiling() and f.is_conj():
                return f"{name} has its conjugate bit set (resolve_conj() first)"
    if not isinstance(eps, (int, float)):
        return "eps must be a Python number"
    return None


def can_use_qk_rmsnorm_diffusers_rope_complex(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
    txt_freqs: torch.Tensor | None = None,
) -> bool:
    """True when :func:`qk_rmsnorm_diffusers_rope_complex` reproduces the reference on these inputs.

    Rejected (False):
    - tensors on different devices, a device other than CUDA (the CPU only under
      TRITON_INTERPRET=1), an input requiring grad while grad mode is on;
    - q/k not 4-D [B, S, H, D] of one shape; q_txt/k_txt given one without the other; text
      inputs whose B, H, D differ; text weights without text; txt_freqs without text or without
      freqs; freqs with text but no txt_freqs;
    - dtype other than bf16/fp16/fp32, or mixed dtypes among q, k, q_txt, k_txt;
    - a weight not [D] or not in the input dtype (diffusers would output the weight's dtype: an
      fp32 weight with bf16 inputs gives fp32 q/k);
    - head_dim >= 128 not a multiple of 4 (torch's vectorized mean with unaligned rows);
    - an input whose last dim is not stride 1 with the other dims >= D apart, or whose strides
      suggest channels-last (torch's mean would then run another launch);
    - a stream whose mean torch splits across warps (very wide rows with few rows; never for
      head dims <= 4096);
    - freqs / txt_freqs not complex64 [S, D/2] (or per sample [B or 1, S, D/2], Z-Image) of their
      stream, or conjugate views; D odd with RoPE.
    Strided inputs (unflattened projections, chunks of a fused qkv) and misaligned ones are
    accepted: torch's mean reads the fresh fp32 ``pow(2)`` tensor, never the input's memory.
    """
    return _diffusers_reason(q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight,
                             k_txt_weight, txt_freqs) is None


def _diffusers_params(q, q_txt, cmul: int, layout: int = 0, joint: bool = False) -> dict:
    """The NORM=1 constexprs and mean factors: per-stream reduce widths and factors from the shapes
    (``joint``: q and q_txt are two row ranges of one tensor torch normalises in one call, so both
    take that call's width and factor, from all the rows)."""
    B, S_img, H, D = q.shape
    S_txt = q_txt.shape[1] if q_txt is not None else 0
    rows_img, rows_txt = B * S_img * H, B * S_txt * H
    if joint:
        rows_img = rows_txt = rows_img + rows_txt
    w_img, vec, _ = _reduce_launch(D, max(rows_img, 1))
    w_txt = _reduce_launch(D, max(rows_txt, 1))[0] if q_txt is not None else w_img
    return dict(NORM=1, W_IMG=w_img, W_TXT=w_txt, VEC=vec, CMUL=cmul, **({"LAYOUT": layout} if layout else {}),
                fac_img=_mean_factor(rows_img, D), fac_txt=_mean_factor(rows_txt, D))


def _complex_tables(freqs, txt_freqs):
    """Complex tables as fp32 views of their real parts (imaginary at +1), no copies."""
    img_tab = torch.view_as_real(freqs)[..., 0] if freqs is not None else None
    txt_tab = torch.view_as_real(txt_freqs)[..., 0] if txt_freqs is not None else None
    if img_tab is not None and txt_tab is None:
        txt_tab = img_tab  # no text rows: never read
    return img_tab, txt_tab


def _launch_diffusers(q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                      txt_freqs, cmul: int = CMUL_MODE, rows_per_program: int | None = None,
                      num_warps: int = 2, layout: int = 0, lanes_tiling: tuple[int, int, int] | None = None):
    """Launch the NORM=1 kernel (uncached: tests and probes; the public functions cache the
    recipe per geometry)."""
    img_tab, txt_tab = _complex_tables(freqs, txt_freqs)
    return _launch(q, k, q_weight, k_weight, img_tab, txt_tab, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                   True, rows_per_program, num_warps, rope=2 if freqs is not None else 0,
                   diffusers=_diffusers_params(q, q_txt, cmul, layout), lanes_tiling=lanes_tiling)


_DIFF_RECIPES = Recipes()


def _diffusers_call(key, q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                    txt_freqs, layout: int = 0):
    """The cached launch: the predicate and the recipe once per call key, then views + launch."""
    r = _DIFF_RECIPES.checked(
        key, lambda: _diffusers_reason(q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight,
                                       k_txt_weight, txt_freqs),
        lambda: _recipe(q, k, q_weight, k_weight, *_complex_tables(freqs, txt_freqs), eps, q_txt, k_txt,
                        q_txt_weight, k_txt_weight, rope=2 if freqs is not None else 0,
                        diffusers=_diffusers_params(q, q_txt, CMUL_MODE, layout)))
    # the tables are views made per call (tensors, not geometry); the predicate has passed for them
    img_tab, txt_tab = _complex_tables(freqs, txt_freqs)
    return _fire(r, q, k, q_weight, k_weight, img_tab, txt_tab, q_txt, k_txt, q_txt_weight, k_txt_weight)


@torch.library.custom_op("ditfuse::qk_rmsnorm_diffusers_rope_complex", mutates_args=())
def _qk_rmsnorm_diffusers_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
    txt_freqs: torch.Tensor | None,
    cmul: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_diffusers(q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                             txt_freqs, cmul)


@_qk_rmsnorm_diffusers_op.register_fake
def _(q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, txt_freqs, cmul):
    B, S_img, H, D = q.shape
    S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
    return q.new_empty((B, S_tot, H, D)), q.new_empty((B, S_tot, H, D))


def qk_rmsnorm_diffusers_rope_complex(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
    txt_freqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image's QK chain in one launch: diffusers ``RMSNorm`` on each of q, k, q_txt, k_txt,
    complex RoPE with each stream's own table, text-first concat; equal to
    ``ditfuse.kernels.reference.qk_rmsnorm_diffusers_rope_complex_cat`` on CUDA (torch 2.11)
    bit for bit, given ``CMUL_MODE`` is nvcc's contraction of the complex multiply.

    q, k: [B, S_img, H, D], any strides with the head dim innermost; q_txt, k_txt:
    [B, S_txt, H, D] or None; weights: [D] in the input dtype or None (affine-free);
    freqs: complex64 [S_img, D/2] or [B or 1, S_img, D/2] (per sample: Z-Image) or None (no RoPE);
    txt_freqs: complex64 [S_txt, D/2] (or per sample), given
    exactly when there is text and freqs. Returns contiguous (q_joint, k_joint), each
    [B, S_txt + S_img, H, D], text first. Formula: the module docstring. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_qk_rmsnorm_diffusers_rope_complex` is False.
    """
    return _keyed_diffusers(None, q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                            txt_freqs)


def _keyed_diffusers(key, q, k, q_weight, k_weight, freqs, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None,
                     k_txt_weight=None, txt_freqs=None):
    args = (q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, txt_freqs)
    if use_custom_op():
        reason = _diffusers_reason(*args)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_complex(
            q, k, q_weight, k_weight, freqs, float(eps), q_txt, k_txt, q_txt_weight, k_txt_weight,
            txt_freqs, CMUL_MODE)
    return _diffusers_call(call_key(args) if key is None else key, *args)


qk_rmsnorm_diffusers_rope_complex.keyed = _keyed_diffusers


# ---------------------------------------------------------------------------------------------
# qk_rmsnorm_diffusers_cat (SD3.5): the same kernel with NORM=1, ROPE=0, LAYOUT=1


def _cat_reason(q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight) -> str | None:
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "q and k must be tensors"
    if (q_txt is None) != (k_txt is None):
        return "q_txt and k_txt must be given together"
    if q.dim() != 4 or q.shape != k.shape:
        return f"q and k must be [B, H, S, D] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
    if q_txt is not None:
        if not isinstance(q_txt, torch.Tensor) or not isinstance(k_txt, torch.Tensor):
            return "q_txt and k_txt must be tensors"
        if q_txt.dim() != 4 or q_txt.shape != k_txt.shape:
            return "q_txt and k_txt must be [B, H, S_txt, D] of one shape"
        if (q_txt.shape[0], q_txt.shape[1], q_txt.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
            return "text and image inputs differ in B, H or D"
    # diffusers normalises the [B, H, S, D] tensors themselves: the layout checks see them as given.
    for t in (q, k, q_txt, k_txt):
        if t is not None and not _reduces_rows_in_place(t):
            return ("an input's head dim is not its innermost contiguous dim, or its strides suggest "
                    "channels-last (torch's mean would run another launch)")
    tr = (lambda t: t.transpose(1, 2) if t is not None else None)
    return _diffusers_reason(tr(q), tr(k), q_weight, k_weight, None, eps, tr(q_txt), tr(k_txt),
                             q_txt_weight, k_txt_weight, None)


def can_use_qk_rmsnorm_diffusers_cat(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> bool:
    """True when :func:`qk_rmsnorm_diffusers_cat` reproduces the reference on these inputs.

    Rejected: the cases of :func:`can_use_qk_rmsnorm_diffusers_rope_complex` that apply without
    RoPE (device, grad, dtypes, weights not [D] in the input dtype, head_dim >= 128 not a multiple
    of 4, a head dim that is not innermost contiguous or strides suggesting channels-last, a warp
    split mean, eps not a number), with q/k [B, H, S, D] and text [B, H, S_txt, D]."""
    return _cat_reason(q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight) is None


def _launch_cat(q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                rows_per_program: int | None = None, num_warps: int = 2):
    tr = (lambda t: t.transpose(1, 2) if t is not None else None)
    return _launch_diffusers(tr(q), tr(k), q_weight, k_weight, None, eps, tr(q_txt), tr(k_txt), q_txt_weight,
                             k_txt_weight, None, CMUL_MODE, rows_per_program, num_warps, layout=1)


@torch.library.custom_op("ditfuse::qk_rmsnorm_diffusers_cat", mutates_args=())
def _qk_rmsnorm_diffusers_cat_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_cat(q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)


@_qk_rmsnorm_diffusers_cat_op.register_fake
def _(q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight):
    B, H, S_img, D = q.shape
    S_tot = S_img + (q_txt.shape[2] if q_txt is not None else 0)
    return q.new_empty((B, H, S_tot, D)), q.new_empty((B, H, S_tot, D))


def qk_rmsnorm_diffusers_cat(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3.5's QK chain (``JointAttnProcessor2_0`` with ``qk_norm="rms_norm"``) in one launch:
    diffusers ``RMSNorm`` on each of q, k, q_txt, k_txt (each stream its own mean call: own lane
    count and factor, rows B*H*S), then the **image-first** concat along the sequence:
    ``q_joint = cat([RMS_d(q), RMS_d(q_txt)], dim=2)``. No RoPE. Equal to
    ``ditfuse.kernels.reference.qk_rmsnorm_diffusers_cat_heads_first`` on CUDA (torch 2.11).

    q, k: [B, H, S_img, D] (transposed views of the [B, S, H*D] projections or any strides with
    the head dim innermost); q_txt, k_txt: [B, H, S_txt, D] or None (attn2: no text); weights:
    [D] in the input dtype or None. Returns (q_joint, k_joint), each [B, H, S_img + S_txt, D]:
    contiguous, or without text in the layout of q / k (eager's, see ``in_eager_layout``). Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_qk_rmsnorm_diffusers_cat` is False.
    """
    return _keyed_cat(None, q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)


_CAT_RECIPES = Recipes()


def _keyed_cat(key, q, k, q_weight, k_weight, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None, k_txt_weight=None):
    args = (q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)
    if use_custom_op():
        reason = _cat_reason(*args)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.qk_rmsnorm_diffusers_cat(
            q, k, q_weight, k_weight, float(eps), q_txt, k_txt, q_txt_weight, k_txt_weight)
    if key is None:
        key = call_key(args)
    tr = (lambda t: t.transpose(1, 2) if t is not None else None)
    # the transposed views only after the predicate has passed (it rejects non-tensors)
    r = _CAT_RECIPES.checked(
        key, lambda: _cat_reason(*args),
        lambda: _recipe(tr(q), tr(k), q_weight, k_weight, None, None, eps, tr(q_txt), tr(k_txt), q_txt_weight,
                        k_txt_weight, rope=0, diffusers=_diffusers_params(tr(q), tr(q_txt), CMUL_MODE, 1)))
    qi, ki, qt, kt = tr(q), tr(k), tr(q_txt), tr(k_txt)
    q_out, k_out = _fire(r, qi, ki, q_weight, k_weight, None, None, qt, kt, q_txt_weight, k_txt_weight)
    if q_txt is None:
        # attn2 (no text): eager's RMSNorm is elementwise on q / k and keeps their layout (the
        # transposed projections); with text, eager's cat writes a contiguous result as we do
        return in_eager_layout(q_out, q), in_eager_layout(k_out, k)
    return q_out, k_out


qk_rmsnorm_diffusers_cat.keyed = _keyed_cat


# ---------------------------------------------------------------------------------------------
# qk_rmsnorm_diffusers_rope_img_first (HunyuanVideo 1.5): NORM=1, ROPE=3, LAYOUT=2


def _img_first_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight,
                      k_txt_weight) -> str | None:
    if (cos is None) != (sin is None):
        return "cos and sin must be given together"
    reason = _diffusers_reason(q, k, q_weight, k_weight, None, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, None)
    if reason:
        return reason
    if cos is not None:
        reason = device_reason(q, cos, sin) or grad_reason(cos, sin)
        if reason:
            return reason
        B, S_img, H, D = q.shape
        if S_img == 0:
            return "no image tokens (the image table would be empty)"
        if D % 2:
            return f"head_dim {D} is odd (the rotation pairs elements)"
        for t in (cos, sin):
            if t.dim() != 2 or tuple(t.shape) != (S_img, D):
                return f"cos/sin must be [S_img, D] = [{S_img}, {D}], got {tuple(t.shape)}"
            if t.dtype not in _ROPE_DTYPES:
                return f"cos/sin dtype {t.dtype} is not fp32, bf16 or fp16 (the RoPE would not compute in fp32)"
    return None


def can_use_qk_rmsnorm_diffusers_rope_img_first(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> bool:
    """True when :func:`qk_rmsnorm_diffusers_rope_img_first` reproduces the reference on these
    inputs. Rejected: the cases of :func:`can_use_qk_rmsnorm_diffusers_rope_complex` without its
    complex tables, plus cos/sin given one without the other, not [S_img, D], not fp32 / bf16 /
    fp16, on another device or requiring grad; an empty image stream with RoPE; D odd."""
    return _img_first_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight,
                             k_txt_weight) is None


def _img_first_recipe(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                      **kw):
    return _recipe(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                   rope=3 if cos is not None else 0, diffusers=_diffusers_params(q, q_txt, CMUL_MODE, 2), **kw)


def _launch_img_first(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                      rows_per_program: int | None = None, num_warps: int = 2, kernel: str | None = None,
                      lanes_tiling: tuple[int, int, int] | None = None):
    """Uncached launch (tests and probes)."""
    r = _img_first_recipe(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight,
                          rows_per_program=rows_per_program, num_warps=num_warps, kernel=kernel,
                          lanes_tiling=lanes_tiling)
    return _img_first_out(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight)


def _img_first_out(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight):
    q_out, k_out = _fire(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight)
    if q_txt is None and cos is None:
        # RMSNorm alone is elementwise on q / k and keeps their layout; the RoPE and the cat
        # write contiguous results, as the kernel does
        return in_eager_layout(q_out, q), in_eager_layout(k_out, k)
    return q_out, k_out


@torch.library.custom_op("ditfuse::qk_rmsnorm_diffusers_rope_img_first", mutates_args=())
def _qk_rmsnorm_diffusers_rope_img_first_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None,
    k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None,
    k_txt_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_img_first(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)


@_qk_rmsnorm_diffusers_rope_img_first_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight):
    B, S_img, H, D = q.shape
    S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
    return q.new_empty((B, S_tot, H, D)), q.new_empty((B, S_tot, H, D))


def qk_rmsnorm_diffusers_rope_img_first(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HunyuanVideo 1.5's QK chain (``HunyuanVideo15AttnProcessor2_0``) in one launch: diffusers
    ``RMSNorm`` on each of q, k, q_txt, k_txt (each stream its own mean call: own lane count and
    factor, rows B*S*H), FLUX's real interleaved RoPE (``x.float() * cos + x_rotated.float() *
    sin``, fp32 roundings, then one to the input dtype) on the image stream only, then the
    **image-first** concat: ``q_joint = cat([rope(RMS_d(q)), RMS_d(q_txt)], dim=1)``. Equal to
    ``ditfuse.kernels.reference.qk_rmsnorm_diffusers_rope_img_first`` on CUDA (torch 2.11): the
    norm is :func:`qk_rmsnorm_diffusers_rope_complex`'s, the rotation :func:`qk_rmsnorm_rope`'s,
    each bitwise on the GPU in its own op; this op composes them per row (``NORM=1, ROPE=3,
    LAYOUT=2``).

    q, k: [B, S_img, H, D] (unflattened projections, head dim innermost); q_txt, k_txt: [B,
    S_txt, H, D] or None; weights: [D] in the input dtype or None; cos, sin: [S_img, D] (fp32,
    bf16 or fp16) or None. Returns (q_joint, k_joint), each a contiguous [B, S_img + S_txt, H, D]
    (without text and RoPE: in the layout of q / k). Raises :class:`UnsupportedInput` exactly
    where :func:`can_use_qk_rmsnorm_diffusers_rope_img_first` is False.
    """
    return _keyed_img_first(None, q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight,
                            k_txt_weight)


_IMG_FIRST_RECIPES = Recipes()


def _keyed_img_first(key, q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                     q_txt_weight=None, k_txt_weight=None):
    args = (q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)
    if use_custom_op():
        reason = _img_first_reason(*args)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_img_first(
            q, k, q_weight, k_weight, cos, sin, float(eps), q_txt, k_txt, q_txt_weight, k_txt_weight)
    if key is None:
        key = call_key(args)
    r = _IMG_FIRST_RECIPES.checked(key, lambda: _img_first_reason(*args), lambda: _img_first_recipe(*args))
    return _img_first_out(r, q, k, q_weight, k_weight, cos, sin, q_txt, k_txt, q_txt_weight, k_txt_weight)


qk_rmsnorm_diffusers_rope_img_first.keyed = _keyed_img_first


# ---------------------------------------------------------------------------------------------
# qk_rmsnorm_diffusers_rope_joint (HunyuanVideo 1.0's single blocks): the img-first kernel on the
# two row ranges of ONE joint tensor, with the joint tensor's reduction launch and mean factor for
# every row (NORM=1, ROPE=3, LAYOUT=2)


def _joint_split(q, k, n_txt: int):
    """The video rows and the trailing text rows of the joint q / k, as views."""
    s_img = q.shape[1] - n_txt
    if n_txt == 0:
        return q, k, None, None
    return q[:, :s_img], k[:, :s_img], q[:, s_img:], k[:, s_img:]


def _joint_reason(q, k, q_weight, k_weight, cos, sin, eps, n_txt) -> str | None:
    if not isinstance(n_txt, int) or isinstance(n_txt, bool):
        return "n_txt must be an int"
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() != 4:
        return "q and k must be [B, S, H, D] tensors"
    if not 0 < n_txt < q.shape[1]:
        return f"n_txt={n_txt} must leave text rows and video rows in S={q.shape[1]}"
    if cos is None or sin is None:
        return "cos and sin are required (without RoPE: the img-first op's norm-only form)"
    if k.shape != q.shape:
        return f"k has shape {tuple(k.shape)}, q {tuple(q.shape)}"
    # torch normalises the joint tensors: their rows must be what its mean reduces in place
    for t in (q, k):
        if not _reduces_rows_in_place(t):
            return ("an input's head dim is not its innermost contiguous dim (torch's mean would "
                    "reduce along a strided dim, another launch)")
    B, S, H, D = q.shape
    if _reduce_launch(D, B * S * H)[2]:
        return f"head_dim {D} with {B * S * H} rows: torch splits each row's mean across warps (not implemented)"
    qi, ki, qt, kt = _joint_split(q, k, n_txt)
    return _img_first_reason(qi, ki, q_weight, k_weight, cos, sin, eps, qt, kt, q_weight, k_weight)


def can_use_qk_rmsnorm_diffusers_rope_joint(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    n_txt: int = 1,
) -> bool:
    """True when :func:`qk_rmsnorm_diffusers_rope_joint` reproduces the reference on these inputs:
    :func:`can_use_qk_rmsnorm_diffusers_rope_img_first`'s conditions on the two row ranges, plus
    0 < n_txt < S, cos / sin given, q and k of one shape, and the joint rows reduced in place
    without torch's warp split."""
    return _joint_reason(q, k, q_weight, k_weight, cos, sin, eps, n_txt) is None


def _joint_recipe(q, k, q_weight, k_weight, cos, sin, eps, n_txt, **kw):
    qi, ki, qt, kt = _joint_split(q, k, n_txt)
    # one reduction launch and one factor for all rows, the joint tensor's, as torch's single
    # RMSNorm call over it computes them (the img-first op derives each stream's own)
    return _recipe(qi, ki, q_weight, k_weight, cos, sin, eps, qt, kt, q_weight, k_weight,
                   rope=3, diffusers=_diffusers_params(qi, qt, CMUL_MODE, 2, joint=True), **kw)


def _joint_out(r, q, k, q_weight, k_weight, cos, sin, n_txt):
    qi, ki, qt, kt = _joint_split(q, k, n_txt)
    return _fire(r, qi, ki, q_weight, k_weight, cos, sin, qt, kt, q_weight, k_weight)


def _launch_joint(q, k, q_weight, k_weight, cos, sin, eps, n_txt, rows_per_program: int | None = None,
                  num_warps: int = 2, kernel: str | None = None, lanes_tiling: tuple[int, int, int] | None = None):
    """Uncached launch (tests and probes)."""
    r = _joint_recipe(q, k, q_weight, k_weight, cos, sin, eps, n_txt, rows_per_program=rows_per_program,
                      num_warps=num_warps, kernel=kernel, lanes_tiling=lanes_tiling)
    return _joint_out(r, q, k, q_weight, k_weight, cos, sin, n_txt)


@torch.library.custom_op("ditfuse::qk_rmsnorm_diffusers_rope_joint", mutates_args=())
def _qk_rmsnorm_diffusers_rope_joint_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    n_txt: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_joint(q, k, q_weight, k_weight, cos, sin, eps, n_txt)


@_qk_rmsnorm_diffusers_rope_joint_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, n_txt):
    return q.new_empty(q.shape), q.new_empty(q.shape)


def qk_rmsnorm_diffusers_rope_joint(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    n_txt: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HunyuanVideo's single-block QK chain (``HunyuanVideoAttnProcessor2_0`` without
    ``add_q_proj``) in one launch: diffusers ``RMSNorm`` on the joint q and k (one mean call
    each over all B*S*H rows: that launch's lane count and factor for every row), then FLUX's real
    interleaved RoPE on the first ``S - n_txt`` (video) rows only and the re-concat:
    ``q_out = cat([rope(RMS_d(q)[:, :-n_txt]), RMS_d(q)[:, -n_txt:]], dim=1)``, same for k. Equal
    to ``ditfuse.kernels.reference.qk_rmsnorm_diffusers_rope_joint`` on CUDA (torch 2.11): the
    img-first op's kernel (each piece bitwise on the GPU) on the two row ranges of the joint
    tensor, with the joint tensor's reduction parameters for both.

    q, k: [B, S, H, D] (the unflattened joint projections, head dim innermost); weights [D] in
    the input dtype or None; cos, sin: [S - n_txt, D] (fp32, bf16 or fp16); 0 < n_txt < S.
    Returns (q_out, k_out), each a contiguous [B, S, H, D]. Raises :class:`UnsupportedInput`
    exactly where :func:`can_use_qk_rmsnorm_diffusers_rope_joint` is False.
    """
    return _keyed_joint(None, q, k, q_weight, k_weight, cos, sin, eps, n_txt)


_JOINT_RECIPES = Recipes()


def _keyed_joint(key, q, k, q_weight, k_weight, cos, sin, eps=1e-6, n_txt=1):
    args = (q, k, q_weight, k_weight, cos, sin, eps, n_txt)
    if use_custom_op():
        reason = _joint_reason(*args)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_joint(q, k, q_weight, k_weight, cos, sin, float(eps),
                                                                 n_txt)
    if key is None:
        key = call_key(args)
    r = _JOINT_RECIPES.checked(key, lambda: _joint_reason(*args), lambda: _joint_recipe(*args))
    return _joint_out(r, q, k, q_weight, k_weight, cos, sin, n_txt)


qk_rmsnorm_diffusers_rope_joint.keyed = _keyed_joint
