"""The eager reference chains: plain torch ops exactly as diffusers 0.42.1 runs them.

Each function is the contract a bit-exact kernel is held to: same op order, same dtypes, same
casts, so each intermediate is rounded where eager rounds it. Notation in the docstrings:
``r(.)`` is a rounding to the dtype the eager op stores (torch's type promotion decides it),
``r16`` / ``r32`` a rounding to bf16 / fp32. tests/cpu/test_reference.py proves every chain equal
(bitwise) to the diffusers module it stands for; tests/gpu repeats that on CUDA. Torch only: used
by tests, benchmarks and the bit-exact gate alike.

The families differ in where they upcast: FLUX.1 runs its chains in the model dtype (bf16:
``r16`` at every op), Wan upcasts to fp32 (``FP32LayerNorm`` on ``x.float()``, fp32 modulation
tables) and casts back with ``.type_as``. The chains take that as data (``norm_dtype``, the
dtypes of ``scale``/``shift``/``gate``) rather than as separate functions, and the kernels derive
their rounding points from the same dtypes with torch's promotion rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_token(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B, D] -> [B, 1, D] (diffusers' ``t[:, None]``); [B, 1, D] / [B, S, D] pass through."""
    return t[:, None] if t.dim() == 2 and ndim == 3 else t


def gate_residual(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor) -> torch.Tensor:
    """``h = r_res(residual + r(gate * update))`` (``gate=None``: ``r(residual + update)``).

    FLUX: ``residual + gate.unsqueeze(1) * attn`` in bf16 (two r16). Wan:
    ``(x.float() + attn * gate_fp32).type_as(x)``: the product and the sum in fp32, one r16 at the
    end (``x.float() + p`` has the value of ``x + p`` for fp32 ``p``, so the upcast is implicit
    here). The result always has the residual's dtype.
    """
    y = update if gate is None else _per_token(gate, update.dim()) * update
    return (residual + y).to(residual.dtype)


def layer_norm(
    x: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``nn.LayerNorm(D, eps)`` over the last dim: one rounding, to x's dtype. With
    ``norm_dtype`` (diffusers ``FP32LayerNorm(x.float())``): input and affine parameters cast to
    ``norm_dtype`` first, the result stays in ``norm_dtype``."""
    if norm_dtype is not None:
        x = x.to(norm_dtype)
        weight = None if weight is None else weight.to(norm_dtype)
        bias = None if bias is None else bias.to(norm_dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def modulate(n: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """adaLN modulate ``r(r(n * r(1 + scale)) + shift)``; ``1 + scale`` keeps scale's dtype, the
    product and the sum are promoted (bf16 * fp32 -> fp32)."""
    return n * (1 + _per_token(scale, n.dim())) + _per_token(shift, n.dim())


def layernorm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``.

    FLUX.1 (AdaLayerNormZero / ...Single / norm2 + modulate / AdaLayerNormContinuous, whose
    ``chunk`` yields scale first: pass the chunks by name): all bf16, ``norm_dtype=None``.
    Wan (``(norm(x.float()) * (1 + scale) + shift).type_as(x)``): ``norm_dtype=torch.float32``;
    the result is cast back to x's dtype. ``scale=shift=None``: the LayerNorm alone (Wan's affine
    ``norm2``: ``weight``/``bias``).
    """
    if (scale is None) != (shift is None):
        raise ValueError("scale and shift are given together")
    n = layer_norm(x, eps, weight, bias, norm_dtype)
    if scale is not None:
        n = modulate(n, scale, shift)
    return n if norm_dtype is None else n.to(x.dtype)


def gate_residual_layernorm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor | None,
    update: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add then the next LayerNorm (+ modulate): ``h = gate_residual(...)``,
    ``n = layernorm_modulate(h, ...)``; returns ``(h, n)``. FLUX's dual block middle; Wan's
    self-attention residual + affine ``norm2`` and cross-attention residual + ``norm3`` modulate."""
    h = gate_residual(residual, gate, update)
    return h, layernorm_modulate(h, scale, shift, eps, weight, bias, norm_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm(D, eps)`` over the last dim (``_fused_rms_norm`` on CUDA: one rounding)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers ``apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1,
    sequence_dim=1)`` for x [B, S, H, D] and fp32 cos/sin [S, D] (FLUX):
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
    [B, S_txt, H, D] or None (single blocks). Each is RMS-normalised per head with its own weight
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


def rope_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's ``apply_rotary_emb`` (WanAttnProcessor, diffusers 0.42.1) for x [B, S, H, D] and
    repeat-interleaved freqs [1, S, 1, D] (fp32, or bf16 after a plain ``.to(bf16)``)::

        o[2i]   = r(r_p(r_p(x[2i] * cos[2i]) - r_p(x[2i+1] * sin[2i+1])))
        o[2i+1] = r(r_p(r_p(x[2i] * sin[2i+1]) + r_p(x[2i+1] * cos[2i])))

    with ``r_p`` the promoted dtype of x and the freqs (fp32 freqs: fp32), ``r`` x's dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def qk_rmsnorm_across_heads_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    heads: int,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WanAttnProcessor from the projections to attention's q/k: ``norm_q``/``norm_k``
    (``torch.nn.RMSNorm(H * Dh)`` over all heads at once, one rounding), ``unflatten(2, (H, -1))``,
    then Wan's RoPE (:func:`rope_pairs`) when ``cos``/``sin`` are given. q, k: [B, S, H * Dh];
    returns [B, S, H, Dh] each."""
    q = rms_norm(q, q_weight, eps).unflatten(2, (heads, -1))
    k = rms_norm(k, k_weight, eps).unflatten(2, (heads, -1))
    if cos is not None:
        q = rope_pairs(q, cos, sin)
        k = rope_pairs(k, cos, sin)
    return q, k


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` (nn.GELU(approximate="tanh") / diffusers GELU): one
    rounding. With ``out`` the result is copied there (the copy a ``cat`` would make) and ``out``
    is returned."""
    y = F.gelu(x, approximate="tanh")
    if out is None:
        return y
    out.copy_(y)
    return out


def single_block_mlp_cat(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    """FluxSingleTransformerBlock: ``cat([attn, gelu_tanh(proj_mlp(n))], dim=2)``; mlp_pre is
    ``proj_mlp(n)``. The cat copies bits, so only the GELU rounds."""
    return torch.cat([attn, gelu_tanh(mlp_pre)], dim=2)


__all__ = [
    "gate_residual",
    "layer_norm",
    "modulate",
    "layernorm_modulate",
    "gate_residual_layernorm_modulate",
    "rms_norm",
    "rope_interleaved",
    "qk_rmsnorm_rope",
    "rope_pairs",
    "qk_rmsnorm_across_heads_rope",
    "gelu_tanh",
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
