"""The eager reference chains: plain torch ops exactly as diffusers 0.42.1 runs them.

Each function is the contract a bit-exact kernel is held to: same op order, same dtypes, same
casts, so each intermediate is rounded where eager rounds it. Notation in the docstrings:
``r(.)`` is a rounding to the input dtype (an eager op stored its result), ``r32(.)`` an fp32
intermediate. tests/cpu/test_reference.py proves every chain equal (bitwise) to the diffusers
module it stands for; tests/gpu repeats that on CUDA. Torch only: used by tests, benchmarks and
the bit-exact gate alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_token(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B, D] -> [B, 1, D] (diffusers' ``t[:, None]``); [B, S, D] passes through."""
    return t[:, None] if t.dim() == 2 and ndim == 3 else t


def scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``out = r(r(x * r(1 + scale)) + shift)`` — the adaLN modulate in AdaLayerNormZero(Single).

    x: [B, S, D]; scale, shift: [B, D] (per sample) or [B, S, D] (per token).
    """
    return x * (1 + _per_token(scale, x.dim())) + _per_token(shift, x.dim())


def gate_residual(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``out = r(residual + r(gate * update))`` — FLUX's gated residuals.

    diffusers writes ``gate.unsqueeze(1) * update`` then ``residual + that``; gate is [B, D] or
    [B, S, D].
    """
    return residual + _per_token(gate, update.dim()) * update


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Affine-free ``nn.LayerNorm(D, elementwise_affine=False, eps)``: one rounding."""
    return F.layer_norm(x, (x.shape[-1],), None, None, eps)


def layernorm_modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``: AdaLayerNormZero / AdaLayerNormZeroSingle /
    the dual block's norm2 + modulate / AdaLayerNormContinuous (there ``chunk`` yields scale first:
    pass the chunks in the right order, the arithmetic is the same)."""
    return scale_shift(layer_norm(x, eps), scale, shift)


def gate_residual_layernorm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor,
    update: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX dual block middle: ``h = r(residual + r(gate * update))``,
    ``n = r(r(r(LN(h)) * r(1 + scale)) + shift)``; returns ``(h, n)``."""
    h = gate_residual(residual, gate, update)
    return h, layernorm_modulate(h, scale, shift, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm(D, eps)`` as FluxAttention's norm_q/norm_k/norm_added_q/norm_added_k run it."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers ``apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1,
    sequence_dim=1)`` for x [B, S, H, D] and fp32 cos/sin [S, D]:
    ``o[2i] = r(r32(r32(x[2i]·c) + r32(-x[2i+1]·s)))``, ``o[2i+1] = r(r32(r32(x[2i+1]·c) + r32(x[2i]·s)))``.
    """
    cos = cos[None, :, None, :].to(x.device)
    sin = sin[None, :, None, :].to(x.device)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


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
    """FluxAttnProcessor from the unflattened projections to the tensors attention consumes.

    q, k: image (or, in single blocks, joint) tokens [B, S_img, H, D]; q_txt, k_txt: text tokens
    [B, S_txt, H, D] or None (single blocks). Each is RMS-normalised with its own weight
    (``torch.nn.RMSNorm``, one rounding), text and image are concatenated along the sequence (text
    first), then RoPE (if cos/sin given) is applied to the joint tensors. Returns (q_joint, k_joint),
    each [B, S_txt + S_img, H, D].
    """
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    if q_txt is not None:
        q = torch.cat([rms_norm(q_txt, q_txt_weight, eps), q], dim=1)
        k = torch.cat([rms_norm(k_txt, k_txt_weight, eps), k], dim=1)
    if cos is not None:
        q = rope_interleaved(q, cos, sin)
        k = rope_interleaved(k, cos, sin)
    return q, k


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` (nn.GELU(approximate="tanh") / diffusers GELU): one rounding."""
    return F.gelu(x, approximate="tanh")


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """diffusers ``GELU(approximate="tanh")`` (FeedForward's first layer, or the single block's
    ``proj_mlp`` + ``act_mlp``): ``r(gelu_tanh(r(x @ weight.T + bias)))``, two roundings."""
    return gelu_tanh(F.linear(x, weight, bias))


def single_block_mlp_cat(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    """FluxSingleTransformerBlock: ``cat([attn, gelu_tanh(proj_mlp(n))], dim=2)``; mlp_pre is
    ``proj_mlp(n)``. The cat copies bits, so only the GELU rounds."""
    return torch.cat([attn, gelu_tanh(mlp_pre)], dim=2)


__all__ = [
    "scale_shift",
    "gate_residual",
    "layer_norm",
    "layernorm_modulate",
    "gate_residual_layernorm_modulate",
    "rms_norm",
    "rope_interleaved",
    "qk_rmsnorm_rope",
    "gelu_tanh",
    "linear_gelu_tanh",
    "single_block_mlp_cat",
]


# ---------------------------------------------------------------------- VAE (issue 10), appended


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``nn.GroupNorm(num_groups, C, eps)`` (``F.group_norm``): one rounding, ``out = r(GN(x))``.
    diffusers' ResnetBlock2D norm1/norm2, the VAE decoder's conv_norm_out and the mid-block
    Attention's group_norm (on a contiguous ``[B, C, H*W]`` view) run exactly this."""
    return F.group_norm(x, num_groups, weight, bias, eps)


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> torch.Tensor:
    """``out = r(silu(r(GN(x))))``: ``nn.GroupNorm`` then ``nn.SiLU`` as two eager ops
    (ResnetBlock2D's ``norm1 -> nonlinearity``, ``norm2 -> nonlinearity``; the decoder's
    ``conv_norm_out -> conv_act``). ``silu=False`` is :func:`group_norm`."""
    y = group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


__all__ += ["group_norm", "group_norm_silu"]


def wan_rms_norm(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    """diffusers 0.42.1 ``WanRMS_norm`` (channel_first=True, AutoencoderKLWan), op for op:
    ``r(r(r(r(x32 / max(||x32||_2 over C, 1e-12)) * sqrt(C)) * gamma) + bias)`` with
    ``x32 = x.float()`` for bf16/fp16 inputs (x itself for fp32); the ``+ bias`` is a real op even
    when bias is the float 0.0 (it turns -0 into +0). x: [B, C, *spatial]; gamma [C, 1, ...]."""
    needs_fp32 = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if needs_fp32 else x, dim=1).to(x.dtype)
    return normalized * (x.shape[1] ** 0.5) * gamma + bias


def wan_rms_norm_silu(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0, silu: bool = True
) -> torch.Tensor:
    """``WanRMS_norm`` then ``nn.SiLU`` (WanResidualBlock's norm1/norm2 + nonlinearity, the Wan
    decoder's norm_out + nonlinearity): ``r(silu(wan_rms_norm(x)))``."""
    y = wan_rms_norm(x, gamma, bias)
    return F.silu(y) if silu else y


__all__ += ["wan_rms_norm", "wan_rms_norm_silu"]
