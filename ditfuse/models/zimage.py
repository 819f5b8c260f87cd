"""Z-Image adapter: the fast forward of diffusers 0.42.1's ``ZImageTransformerBlock`` (basic mode).

The block (modulated main and noise-refiner blocks; unmodulated context-refiner blocks) is four
diffusers ``RMSNorm`` s (``attention_norm1/2``, ``ffn_norm1/2``, one eps) around an attention
and a SwiGLU FeedForward; its eager chains map onto ops (notes/families.md §5)::

    adaLN_modulation(c).unsqueeze(1).chunk(4, dim=2)   scale_msa, gate_msa, scale_mlp, gate_mlp
    gate = tanh(gate)                                  (eager, as diffusers)
    n = attention_norm1(x) * (1 + scale_msa)           -> rms_norm_diffusers_scale
    a = attention(n, mask, freqs_cis)                  (site zimage.attention below)
    x = x + gate_msa * attention_norm2(a);
    n = ffn_norm1(x) * (1 + scale_mlp)                 -> gate_residual_rms_norm_diffusers_scale
    f = w2(silu(w1(n)) * w3(n))                        -> swiglu on the two projections
    x = x + gate_mlp * ffn_norm2(f)                    -> gate_residual_rms_norm_diffusers

Unmodulated blocks run the same ops with ``scale``/``gate`` None. ``1.0 + scale`` is computed
inside the ops (their reference takes the raw chunk, ``r(1 + scale)`` as eager rounds it). Omni
mode (``noise_mask``: per-token noisy/clean modulation) selects each token's chunks as diffusers
does and runs the same ops on [B, S, D] scales and gates (round 17; CPU-tested only).

The attention (``Attention`` + ``ZSingleStreamAttnProcessor``) is the processor's code with its QK
chain — per-head diffusers RMSNorm on q and k, then the complex RoPE with the per-sample
``freqs_cis`` [B, S, D/2] (``x.float()`` as complex64 times ``freqs_cis.unsqueeze(2)``, rounded
back) — as one op, ``qk_rmsnorm_diffusers_rope_complex`` with a single stream (Qwen-Image's op;
its tables may carry a batch axis). Projections, mask, ``dispatch_attention_fn`` (the processor's
backend and context-parallel config) and the output projection stay diffusers'. The final layer
is diffusers'. Every op is bit-exact and gated at first sight; no quality="high" tier.
"""

from __future__ import annotations

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import SWIGLU
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX
from ..kernels.norm import (
    GATE_RESIDUAL_RMS_NORM_DIFFUSERS,
    GATE_RESIDUAL_RMS_NORM_DIFFUSERS_SCALE,
    RMS_NORM_DIFFUSERS_SCALE,
)
from .base import Adapter, Site, attention_site, diffusers_rmsnorms, linear_module

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_z_image"
_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")


def block_forward(
    block,
    original,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None,
    freqs_cis: torch.Tensor | None,
    adaln_input: torch.Tensor | None = None,
    noise_mask: torch.Tensor | None = None,
    adaln_noisy: torch.Tensor | None = None,
    adaln_clean: torch.Tensor | None = None,
    *,
    _ops: OpSet = LOSSLESS,
) -> torch.Tensor:
    """ZImageTransformerBlock.forward with its norm chains and the SwiGLU on ops. Omni mode
    (``noise_mask``): each token's modulation is the noisy or the clean one, selected with
    diffusers' own ``select_per_token`` after the same ``tanh``; the scales are selected raw (the
    ops add the 1, ``r(1 + s)`` per element, as eager's ``1.0 + s`` before its select does)."""
    eps = block.attention_norm1.eps
    ff = block.feed_forward
    if block.modulation and noise_mask is not None:
        from diffusers.models.transformers.transformer_z_image import select_per_token

        seq_len = x.shape[1]
        noisy = block.adaLN_modulation(adaln_noisy).chunk(4, dim=1)
        clean = block.adaLN_modulation(adaln_clean).chunk(4, dim=1)
        scale_msa, scale_mlp = (select_per_token(noisy[i], clean[i], noise_mask, seq_len) for i in (0, 2))
        gate_msa, gate_mlp = (select_per_token(noisy[i].tanh(), clean[i].tanh(), noise_mask, seq_len) for i in (1, 3))
    elif block.modulation:
        scale_msa, gate_msa, scale_mlp, gate_mlp = block.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
        gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
    else:
        scale_msa = gate_msa = scale_mlp = gate_mlp = None
    n = _ops.rms_norm_diffusers_scale(x, block.attention_norm1.weight, scale_msa, eps)
    attn_out = block.attention(n, attention_mask=attn_mask, freqs_cis=freqs_cis)
    x, n = _ops.gate_residual_rms_norm_diffusers_scale(
        x, gate_msa, attn_out, block.attention_norm2.weight, block.ffn_norm1.weight, scale_mlp, eps
    )
    f = ff.w2(_ops.swiglu(ff.w1(n), ff.w3(n)))
    return _ops.gate_residual_rms_norm_diffusers(x, gate_mlp, f, block.ffn_norm2.weight, eps)


def attention_forward(
    attn,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    **kwargs,
) -> torch.Tensor:
    """Attention + ZSingleStreamAttnProcessor with q/k RMSNorm + complex RoPE as one gated op."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    processor = attn.processor
    if (type(processor) is not ZSingleStreamAttnProcessor or encoder_hidden_states is not None
            or not {"freqs_cis"}.issuperset(kwargs)):
        # A swapped processor, cross-attention inputs, or kwargs Attention.forward would filter
        # with a warning: diffusers' own path, its errors included.
        return original(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    freqs_cis = kwargs.get("freqs_cis")
    query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
    query, key = _ops.qk_rmsnorm_diffusers_rope_complex(
        query, key, attn.norm_q.weight, attn.norm_k.weight, freqs_cis, attn.norm_q.eps
    )
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask[:, None, None, :]
    hidden_states = dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
        backend=processor._attention_backend, parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
    output = attn.to_out[0](hidden_states)
    if len(attn.to_out) > 1:  # dropout
        output = attn.to_out[1](output)
    return output


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    if type(attn.processor) is not ZSingleStreamAttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not ZSingleStreamAttnProcessor"
    # qk_norm=False (norms None) is refused too: nothing to fuse but the RoPE
    return diffusers_rmsnorms(attn, ("norm_q", "norm_k"), attn.inner_dim // attn.heads)


def _block_applies(block) -> str | None:
    from diffusers.models.transformers.transformer_z_image import FeedForward

    reason = diffusers_rmsnorms(block, _NORMS, block.dim)
    if reason:
        return reason
    ff = block.feed_forward
    if type(ff) is not FeedForward:
        return f"feed_forward is {type(ff).__name__}, not Z-Image's FeedForward"
    for name in ("w1", "w2", "w3"):
        if linear_module(getattr(ff, name, None)) is None:
            return f"feed_forward.{name} is not a Linear (or a LoRA-wrapped one)"
    if block.modulation:
        mod = getattr(block, "adaLN_modulation", None)
        lin = linear_module(mod[0]) if isinstance(mod, torch.nn.Sequential) and len(mod) == 1 else None
        if lin is None:
            return "adaLN_modulation is not Sequential(Linear) (a LoRA-wrapped Linear counts)"
        if lin.out_features != 4 * block.dim:
            return f"adaLN_modulation gives {lin.out_features} features, not 4 * dim"
    return None


SITES = (
    Site(
        name="zimage.block",
        cls=f"{_TF}:ZImageTransformerBlock",
        params=("self", "x", "attn_mask", "freqs_cis", "adaln_input", "noise_mask", "adaln_noisy", "adaln_clean"),
        forward=block_forward,
        ops=(RMS_NORM_DIFFUSERS_SCALE, GATE_RESIDUAL_RMS_NORM_DIFFUSERS_SCALE, SWIGLU, GATE_RESIDUAL_RMS_NORM_DIFFUSERS),
        applies=_block_applies,
        high=False,
        description="main / refiner block: RMSNorm + scale, gate + residual + RMSNorm + scale, SwiGLU, "
                    "gate + residual + RMSNorm (modulated and unmodulated)",
    ),
    attention_site(
        "zimage.attention", attention_forward, (QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX,), _attn_applies,
        "attention (ZSingleStreamAttnProcessor): q/k RMSNorm + complex RoPE with per-sample "
        "freqs in one pass",
    ),
)

ADAPTER = Adapter(
    family="zimage",
    model_classes=("ZImageTransformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
