"""fp64 "exact math" of the eager chains, for the close kernels' admission test (torch only).

Each function takes the same arguments as the eager reference chain of the same name in
:mod:`ditfuse.kernels.reference` (inputs as the model holds them), upcasts every tensor to fp64
and evaluates the chain's *mathematics* once, with no intermediate rounding. The admission test
(:mod:`ditfuse.contracts.admission`) measures both the eager chain and a close kernel against
these values. Outputs are fp64 tensors shaped like the chain's outputs.
"""

from __future__ import annotations

import torch

from .reference import _per_token


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float64)


def layer_norm_fp64(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    x = _d(x)
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * _d(weight)
    if bias is not None:
        y = y + _d(bias)
    return y


def _tab(t: torch.Tensor | None, table: torch.Tensor | None) -> torch.Tensor | None:
    """A modulation operand with its optional [D] table row (reference.with_table), in fp64."""
    return _d(t) if table is None else _d(table) + _d(t)


def layernorm_modulate_fp64(
    x: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    scale_table: torch.Tensor | None = None, shift_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``LN(x) * (1 + scale) + shift`` (``shift`` None: no shift; or the affine LN alone) in fp64."""
    scale, shift = _tab(scale, scale_table), _tab(shift, shift_table)
    y = layer_norm_fp64(x, eps, weight, bias)
    if scale is None:
        return y
    y = y * (1 + _per_token(_d(scale), x.dim()))
    return y if shift is None else y + _per_token(_d(shift), x.dim())


def _residual_fp64(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
                   gate_table: torch.Tensor | None = None) -> torch.Tensor:
    u = _d(update)
    return _d(residual) + (u if gate is None else _per_token(_tab(gate, gate_table), update.dim()) * u)


def gate_residual_layernorm_modulate_fp64(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
    scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float = 1e-6,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
    gate_table: torch.Tensor | None = None, scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * update``; ``n = LN(h) (* (1 + scale) + shift)``; in fp64."""
    h = _residual_fp64(residual, gate, update, gate_table)
    return h, layernorm_modulate_fp64(h, scale, shift, eps, weight, bias, None, scale_table, shift_table)


def _rms_fp64(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = _d(x)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * _d(w)


def _rope_interleaved_fp64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = _d(cos)[None, :, None, :]
    sin = _d(sin)[None, :, None, :]
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return x * cos + rotated * sin


def qk_rmsnorm_rope_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float = 1e-6,
    q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (``x / sqrt(mean(x^2) + eps) * w``), text-first concat, interleaved RoPE; fp64."""
    q64, k64 = _rms_fp64(q, q_weight, eps), _rms_fp64(k, k_weight, eps)
    if q_txt is not None:
        q64 = torch.cat([_rms_fp64(q_txt, q_txt_weight, eps), q64], dim=1)
        k64 = torch.cat([_rms_fp64(k_txt, k_txt_weight, eps), k64], dim=1)
    if cos is not None:
        q64, k64 = _rope_interleaved_fp64(q64, cos, sin), _rope_interleaved_fp64(k64, cos, sin)
    return q64, k64


def _rope_pairs_fp64(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = _d(freqs_cos)[..., 0::2], _d(freqs_sin)[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


def qk_rmsnorm_across_heads_rope_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over all heads, head split, Wan's pair RoPE; fp64."""
    q64 = _rms_fp64(q, q_weight, eps).unflatten(2, (heads, -1))
    k64 = _rms_fp64(k, k_weight, eps).unflatten(2, (heads, -1))
    if cos is not None:
        q64, k64 = _rope_pairs_fp64(q64, cos, sin), _rope_pairs_fp64(k64, cos, sin)
    return q64, k64


def _rope_complex_fp64(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    # [S, D/2] (one table) or [B, S, D/2] (per sample): broadcast over the head axis
    f = freqs[None] if freqs.dim() == 2 else freqs
    c = f.real.to(torch.float64)[:, :, None, :]
    d = f.imag.to(torch.float64)[:, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(3)


def qk_rmsnorm_diffusers_rope_complex_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None, eps: float = 1e-6,
    q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
    txt_freqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm, complex RoPE with each stream's own table, text-first concat; fp64."""

    def one(x, w, f):
        y = _rms_fp64(x, w, eps)
        return y if f is None else _rope_complex_fp64(y, f)

    q64, k64 = one(q, q_weight, freqs), one(k, k_weight, freqs)
    if q_txt is not None:
        q64 = torch.cat([one(q_txt, q_txt_weight, txt_freqs), q64], dim=1)
        k64 = torch.cat([one(k_txt, k_txt_weight, txt_freqs), k64], dim=1)
    return q64, k64


def qk_rmsnorm_diffusers_cat_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    eps: float = 1e-6, q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of [B, H, S, D] streams, image-first concat along S; fp64."""
    q64, k64 = _rms_fp64(q, q_weight, eps), _rms_fp64(k, k_weight, eps)
    if q_txt is not None:
        q64 = torch.cat([q64, _rms_fp64(q_txt, q_txt_weight, eps)], dim=2)
        k64 = torch.cat([k64, _rms_fp64(k_txt, k_txt_weight, eps)], dim=2)
    return q64, k64


def qk_rmsnorm_diffusers_rope_img_first_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float = 1e-6,
    q_txt: torch.Tensor | None = None, k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None, k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm, interleaved RoPE on the image stream only, image-first concat; fp64."""
    q64, k64 = _rms_fp64(q, q_weight, eps), _rms_fp64(k, k_weight, eps)
    if cos is not None:
        q64, k64 = _rope_interleaved_fp64(q64, cos, sin), _rope_interleaved_fp64(k64, cos, sin)
    if q_txt is not None:
        q64 = torch.cat([q64, _rms_fp64(q_txt, q_txt_weight, eps)], dim=1)
        k64 = torch.cat([k64, _rms_fp64(k_txt, k_txt_weight, eps)], dim=1)
    return q64, k64


def qk_rmsnorm_diffusers_rope_joint_fp64(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6, n_txt: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of the joint rows, interleaved RoPE on the first S - n_txt rows; fp64 (per
    row, so the same as the img-first chain on the two row ranges)."""
    s = q.shape[1] - n_txt
    return qk_rmsnorm_diffusers_rope_img_first_fp64(q[:, :s], k[:, :s], q_weight, k_weight, cos, sin, eps,
                                                    q[:, s:], k[:, s:], q_weight, k_weight)


__all__ = [
    "qk_rmsnorm_diffusers_rope_img_first_fp64",
    "qk_rmsnorm_diffusers_rope_joint_fp64",
    "qk_rmsnorm_diffusers_cat_fp64",
    "layer_norm_fp64",
    "layernorm_modulate_fp64",
    "gate_residual_layernorm_modulate_fp64",
    "qk_rmsnorm_rope_fp64",
    "qk_rmsnorm_across_heads_rope_fp64",
    "qk_rmsnorm_diffusers_rope_complex_fp64",
]


# ---------------------------------------------------------------------- VAE (issue 10), appended


def group_norm_silu_fp64(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> torch.Tensor:
    """``silu(GN(x))`` (``GN(x)`` when ``silu`` is False) in fp64: per (sample, group) mean and
    population variance, ``(x - mean) / sqrt(var + eps) * weight + bias``, ``y / (1 + exp(-y))``."""
    x64 = _d(x)
    N, C = x64.shape[:2]
    g = x64.reshape(N, num_groups, -1)
    mean = g.mean(-1, keepdim=True)
    var = (g - mean).pow(2).mean(-1, keepdim=True)
    y = ((g - mean) / torch.sqrt(var + eps)).reshape(x64.shape)
    shape = [1, C] + [1] * (x64.dim() - 2)
    if weight is not None:
        y = y * _d(weight).reshape(shape)
    if bias is not None:
        y = y + _d(bias).reshape(shape)
    return y / (1 + torch.exp(-y)) if silu else y


__all__ += ["group_norm_silu_fp64"]


def wan_rms_norm_silu_fp64(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0, silu: bool = True,
    ncdhw: bool = False,
) -> torch.Tensor:
    """``x / max(||x||_2 over C, 1e-12) * sqrt(C) * gamma + bias`` (then SiLU) in fp64 (``ncdhw``
    only picks a rounding order, which exact math has none of)."""
    x64 = _d(x)
    y = x64 / torch.linalg.vector_norm(x64, dim=1, keepdim=True).clamp_min(1e-12) * (x.shape[1] ** 0.5)
    y = y * _d(gamma) + (_d(bias) if isinstance(bias, torch.Tensor) else bias)
    return y / (1 + torch.exp(-y)) if silu else y


__all__ += ["wan_rms_norm_silu_fp64"]


# ------------------------------------------------------------- Z-Image diffusers RMSNorm, appended


def _rms_d_fp64(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """diffusers ``RMSNorm`` in fp64: ``x / sqrt(mean(x^2) + eps) * w``."""
    return _rms_fp64(x, w, eps)


def rms_norm_diffusers_scale_fp64(
    x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """``RMS(x; w) * (1 + scale) + shift`` (``scale`` / ``shift`` None: left out) in fp64."""
    n = _rms_d_fp64(x, weight, eps)
    if scale is not None:
        n = n * (1 + _d(_per_token(scale, x.dim())))
    return n if shift is None else n + _d(_per_token(shift, x.dim()))


def gate_residual_rms_norm_diffusers_fp64(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor, weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """``residual + gate * RMS(update; w)`` in fp64."""
    n = _rms_d_fp64(update, weight, eps)
    if gate is not None:
        n = _d(_per_token(gate, update.dim())) * n
    return _d(residual) + n


def gate_residual_rms_norm_diffusers_scale_fp64(
    residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor, out_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * RMS(update; w)``, ``n = RMS(h; w2) * (1 + scale)``; fp64."""
    h = gate_residual_rms_norm_diffusers_fp64(residual, gate, update, out_weight, eps)
    return h, rms_norm_diffusers_scale_fp64(h, next_weight, scale, eps)


__all__ += ["rms_norm_diffusers_scale_fp64", "gate_residual_rms_norm_diffusers_fp64",
            "gate_residual_rms_norm_diffusers_scale_fp64"]


def linear_gelu_tanh_fp64(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``gelu_tanh(x @ weight^T + bias)`` in fp64 (``out`` is where the op writes; the math
    ignores it)."""
    y = x.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return 0.5 * y * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))
__all__ += ["linear_gelu_tanh_fp64"]
