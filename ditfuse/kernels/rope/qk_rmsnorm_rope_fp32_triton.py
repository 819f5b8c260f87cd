"""QK RMSNorm + FLUX interleaved RoPE without the intermediate rounding (contract: close).

Same signature and outputs as :func:`ditfuse.kernels.reference.qk_rmsnorm_rope`. For q and k,
with ``x`` each text / image row and ``w`` its RMSNorm weight (fp32 arithmetic throughout)::

    n         = w * (x * rstd),      rstd = 1 / sqrt(sum(x*x) / D + eps)
    y         = cat([n_txt, n_img], dim=1)                       (text first)
    out[2i]   = r(y[2i]   * cos[2i]   - y[2i+1] * sin[2i])
    out[2i+1] = r(y[2i+1] * cos[2i+1] + y[2i]   * sin[2i+1])

one rounding per element, where eager (``torch.nn.RMSNorm`` then ``apply_rotary_emb``) rounds the
normalised ``n`` to the input dtype before RoPE and rounds each RoPE product to fp32 separately.
FMAs are allowed. Not bit-exact: mounted only under quality="high", after the fp64 admission
test (ditfuse/contracts/admission.py).

One launch handles q and k, text and image: each program takes ``R`` output rows (b, s, h) of the
joint [B, S_txt + S_img, H, D] tensors, loads each from the text or the image input (any
strides) and loads cos/sin once for q and k.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..common.rounding import round_to
from ..errors import UnsupportedInput

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_ROPE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_D = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _rows(txt_ptr, img_ptr, b, s, h, row_ok, d, d_ok,
          t_sb, t_ss, t_sh, t_sd, i_sb, i_ss, i_sh, i_sd, S_TXT, HAS_TXT: tl.constexpr):
    m_img = (row_ok & (s >= S_TXT))[:, None] & d_ok[None, :]
    img_row = b * i_sb + (s - S_TXT) * i_ss + h * i_sh
    x = tl.load(img_ptr + img_row[:, None] + d[None, :] * i_sd, mask=m_img, other=0.0).to(tl.float32)
    if HAS_TXT:
        m_txt = (row_ok & (s < S_TXT))[:, None] & d_ok[None, :]
        txt_row = b * t_sb + s * t_ss + h * t_sh
        xt = tl.load(txt_ptr + txt_row[:, None] + d[None, :] * t_sd, mask=m_txt, other=0.0).to(tl.float32)
        x = tl.where(m_txt, xt, x)
    return x


@triton.jit
def _weights(wt_ptr, wi_ptr, s, d, d_ok, S_TXT,
             HAS_TXT: tl.constexpr, HAS_WT: tl.constexpr, HAS_WI: tl.constexpr):
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
def _norm_rope_store(x, w, cos_e, cos_o, sin_e, sin_o, out_ptr, out_off, mask, eps,
                     D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
                     HAS_ROPE: tl.constexpr, DTYPE: tl.constexpr):
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
    n = w * (x * rstd[:, None])
    if HAS_ROPE:
        ye, yo = tl.split(tl.reshape(n, [R, DP // 2, 2]))
        oe = ye * cos_e - yo * sin_e
        oo = yo * cos_o + ye * sin_o
        out = tl.reshape(tl.join(oe, oo), [R, DP])
    else:
        out = n
    tl.store(out_ptr + out_off, round_to(out, DTYPE), mask=mask)


@triton.jit
def _qk_rmsnorm_rope_fp32_kernel(
    q_img, k_img, q_txt, k_txt, wq_img, wk_img, wq_txt, wk_txt,
    cos_ptr, sin_ptr, q_out, k_out,
    qi_sb, qi_ss, qi_sh, qi_sd, ki_sb, ki_ss, ki_sh, ki_sd,
    qt_sb, qt_ss, qt_sh, qt_sd, kt_sb, kt_ss, kt_sh, kt_sd,
    c_ss, c_sd, s_ss, s_sd,
    n_rows, S_TXT, S_TOT, H, eps,
    D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
    HAS_TXT: tl.constexpr, HAS_ROPE: tl.constexpr,
    HAS_WQI: tl.constexpr, HAS_WKI: tl.constexpr, HAS_WQT: tl.constexpr, HAS_WKT: tl.constexpr,
    DTYPE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < n_rows
    h = rows % H
    bs = rows // H
    s = bs % S_TOT
    b = bs // S_TOT
    d = tl.arange(0, DP)
    d_ok = d < D
    mask = row_ok[:, None] & d_ok[None, :]
    out_off = rows[:, None] * D + d[None, :]

    if HAS_ROPE:
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

    xq = _rows(q_txt, q_img, b, s, h, row_ok, d, d_ok,
               qt_sb, qt_ss, qt_sh, qt_sd, qi_sb, qi_ss, qi_sh, qi_sd, S_TXT, HAS_TXT)
    wq = _weights(wq_txt, wq_img, s, d, d_ok, S_TXT, HAS_TXT, HAS_WQT, HAS_WQI)
    _norm_rope_store(xq, wq, cos_e, cos_o, sin_e, sin_o, q_out, out_off, mask, eps, D, DP, R, HAS_ROPE, DTYPE)
    xk = _rows(k_txt, k_img, b, s, h, row_ok, d, d_ok,
               kt_sb, kt_ss, kt_sh, kt_sd, ki_sb, ki_ss, ki_sh, ki_sd, S_TXT, HAS_TXT)
    wk = _weights(wk_txt, wk_img, s, d, d_ok, S_TXT, HAS_TXT, HAS_WKT, HAS_WKI)
    _norm_rope_store(xk, wk, cos_e, cos_o, sin_e, sin_o, k_out, out_off, mask, eps, D, DP, R, HAS_ROPE, DTYPE)


def _unsupported_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight) -> str | None:
    """Why the kernel does not take these inputs, or None.

    Rejected: q/k not 4-D [B, S, H, D] tensors of one shape; q_txt/k_txt or cos/sin given one
    without the other; text weights without text inputs; text inputs whose B, H, D differ from
    the image inputs'; dtype other than bf16/fp16/fp32 or mixed input dtypes; D odd (pairs) or
    > 1024; a weight not [D] of the input dtype; cos/sin not [S_txt + S_img, D] fp32/bf16/fp16;
    tensors on different devices; a device other than CUDA (CPU only under TRITON_INTERPRET=1);
    eps not a number; an input requiring grad in grad mode.
    """
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return "q and k must be tensors"
    if (q_txt is None) != (k_txt is None):
        return "q_txt and k_txt must be given together"
    if (cos is None) != (sin is None):
        return "cos and sin must be given together"
    if q_txt is None and (q_txt_weight is not None or k_txt_weight is not None):
        return "text weights given without text inputs"
    inputs = [t for t in (q, k, q_txt, k_txt) if t is not None]
    weights = [t for t in (q_weight, k_weight, q_txt_weight, k_txt_weight) if t is not None]
    rope = [t for t in (cos, sin) if t is not None]
    tensors = inputs + weights + rope
    dev = q.device
    if any(t.device != dev for t in tensors):
        return "tensors on different devices"
    if dev.type != "cuda" and not (dev.type == "cpu" and _interpreting()):
        return f"device {dev} is not CUDA (the CPU runs Triton only under TRITON_INTERPRET=1)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on (no backward)"
    if q.dim() != 4 or q.shape != k.shape:
        return f"q and k must be [B, S, H, D] of one shape, got {tuple(q.shape)} and {tuple(k.shape)}"
    B, S_img, H, D = q.shape
    if q_txt is not None:
        if q_txt.dim() != 4 or q_txt.shape != k_txt.shape:
            return "q_txt and k_txt must be [B, S_txt, H, D] of one shape"
        if (q_txt.shape[0], q_txt.shape[2], q_txt.shape[3]) != (B, H, D):
            return "text and image inputs differ in B, H or D"
    if q.dtype not in _TL_DTYPE:
        return f"dtype {q.dtype} is not bf16, fp16 or fp32"
    if any(t.dtype != q.dtype for t in inputs):
        return "q, k, q_txt, k_txt have different dtypes"
    if D == 0 or D % 2 or D > _MAX_D:
        return f"head_dim {D} must be even and in 2..{_MAX_D}"
    for w in weights:
        if w.dim() != 1 or w.shape[0] != D or w.dtype != q.dtype:
            return f"a weight is {tuple(w.shape)}/{w.dtype}, expected ({D},)/{q.dtype}"
    if cos is not None:
        S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
        for t in (cos, sin):
            if t.dim() != 2 or tuple(t.shape) != (S_tot, D):
                return f"cos/sin must be [S_txt + S_img, D] = [{S_tot}, {D}], got {tuple(t.shape)}"
            if t.dtype not in _ROPE_DTYPES:
                return f"cos/sin dtype {t.dtype} is not fp32, bf16 or fp16"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return "eps must be a Python number"
    return None


def _launch(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight):
    B, S_img, H, D = q.shape
    S_txt = q_txt.shape[1] if q_txt is not None else 0
    S_tot = S_txt + S_img
    q_out = torch.empty((B, S_tot, H, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((B, S_tot, H, D), dtype=q.dtype, device=q.device)
    n_rows = B * S_tot * H
    if n_rows == 0:
        return q_out, k_out
    has_txt = q_txt is not None
    has_rope = cos is not None
    qt = q_txt if has_txt else q
    kt = k_txt if has_txt else k
    DP = triton.next_power_of_2(D)
    R = max(1, 4096 // DP)
    _qk_rmsnorm_rope_fp32_kernel[(triton.cdiv(n_rows, R),)](
        q, k, qt, kt,
        q_weight if q_weight is not None else q,
        k_weight if k_weight is not None else q,
        q_txt_weight if q_txt_weight is not None else q,
        k_txt_weight if k_txt_weight is not None else q,
        cos if has_rope else q, sin if has_rope else q,
        q_out, k_out,
        *q.stride(), *k.stride(), *qt.stride(), *kt.stride(),
        *(cos.stride() if has_rope else (0, 0)), *(sin.stride() if has_rope else (0, 0)),
        n_rows, S_txt, S_tot, H, float(eps),
        D=D, DP=DP, R=R, HAS_TXT=has_txt, HAS_ROPE=has_rope,
        HAS_WQI=q_weight is not None, HAS_WKI=k_weight is not None,
        HAS_WQT=q_txt_weight is not None, HAS_WKT=k_txt_weight is not None,
        DTYPE=_TL_DTYPE[q.dtype], num_warps=4,
    )
    return q_out, k_out


@torch.library.custom_op("ditfuse::qk_rmsnorm_rope_fp32", mutates_args=())
def _qk_rmsnorm_rope_fp32_op(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float,
    q_txt: torch.Tensor | None, k_txt: torch.Tensor | None,
    q_txt_weight: torch.Tensor | None, k_txt_weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)


@_qk_rmsnorm_rope_fp32_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight):
    B, S_img, H, D = q.shape
    S_tot = S_img + (q_txt.shape[1] if q_txt is not None else 0)
    return q.new_empty((B, S_tot, H, D)), q.new_empty((B, S_tot, H, D))


def can_use_qk_rmsnorm_rope_fp32(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float = 1e-6,
    q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
) -> bool:
    """True when :func:`qk_rmsnorm_rope_fp32` takes these inputs (see ``_unsupported_reason``)."""
    return _unsupported_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight) is None


def qk_rmsnorm_rope_fp32(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float = 1e-6,
    q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QK RMSNorm + concat + RoPE in fp32 with one rounding (module docstring); returns
    contiguous (q_joint, k_joint) [B, S_txt + S_img, H, D]. Raises UnsupportedInput exactly where
    :func:`can_use_qk_rmsnorm_rope_fp32` is False."""
    reason = _unsupported_reason(q, k, q_weight, k_weight, cos, sin, eps, q_txt, k_txt, q_txt_weight, k_txt_weight)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.qk_rmsnorm_rope_fp32(
        q, k, q_weight, k_weight, cos, sin, float(eps), q_txt, k_txt, q_txt_weight, k_txt_weight
    )


__all__ = ["qk_rmsnorm_rope_fp32", "can_use_qk_rmsnorm_rope_fp32"]
