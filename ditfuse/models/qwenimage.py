"""Qwen-Image adapter: fast forwards for diffusers 0.42.1's QwenImageTransformer2DModel blocks.

``QwenImageTransformerBlock`` is a dual-stream adaLN block with FLUX.1's chain shapes written
differently: ``img_mod`` / ``txt_mod`` = Linear(SiLU(temb)) → ``chunk(2)`` → each ``chunk(3)`` =
shift, scale, gate; ``_modulate`` = ``x·(1 + scale[:, None]) + shift[:, None]`` on an affine-free
LayerNorm → ``layernorm_modulate``; ``h + gate[:, None]·attn`` then norm2 + modulate →
``gate_residual_layernorm_modulate`` (the product commutes bitwise); the tanh-GELU FeedForward
stays diffusers'; ``h + gate2[:, None]·mlp`` → ``gate_residual``; the fp16 clip as diffusers does
it. Attention (``QwenDoubleStreamAttnProcessor2_0``: per-head diffusers RMSNorm, complex RoPE per
stream, text-first concat) stays diffusers' — its fused op is future work (notes/families.md).
The Edit models' per-token modulation (``zero_cond_t`` / ``modulate_index``) keeps diffusers'
forward. Every op is bit-exact and gated at first sight; no quality="high" tier (admission was
not measured on Qwen-Image activations).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from .adaln import norm_out_site, plain_layernorm
from .base import Adapter, Site

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_qwenimage"


def block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: list[int] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
):
    """QwenImageTransformerBlock: LN + modulate, joint attention, gate + residual + norm2 +
    modulate, FeedForward, FF gate residual — image and text stream."""
    if modulate_index is not None:  # per-token modulation (Edit models): diffusers' own forward
        return original(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                        encoder_hidden_states_mask=encoder_hidden_states_mask, temb=temb,
                        image_rotary_emb=image_rotary_emb, joint_attention_kwargs=joint_attention_kwargs,
                        modulate_index=modulate_index)
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    img_shift1, img_scale1, img_gate1 = img_mod1.chunk(3, dim=-1)
    img_shift2, img_scale2, img_gate2 = img_mod2.chunk(3, dim=-1)
    txt_shift1, txt_scale1, txt_gate1 = txt_mod1.chunk(3, dim=-1)
    txt_shift2, txt_scale2, txt_gate2 = txt_mod2.chunk(3, dim=-1)

    img_modulated = _ops.layernorm_modulate(hidden_states, img_scale1, img_shift1, block.img_norm1.eps)
    txt_modulated = _ops.layernorm_modulate(encoder_hidden_states, txt_scale1, txt_shift1, block.txt_norm1.eps)

    joint_attention_kwargs = joint_attention_kwargs or {}
    img_attn_output, txt_attn_output = block.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    hidden_states, img_modulated2 = _ops.gate_residual_layernorm_modulate(
        hidden_states, img_gate1, img_attn_output, img_scale2, img_shift2, block.img_norm2.eps
    )
    encoder_hidden_states, txt_modulated2 = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, txt_gate1, txt_attn_output, txt_scale2, txt_shift2, block.txt_norm2.eps
    )
    hidden_states = _ops.gate_residual(hidden_states, img_gate2, block.img_mlp(img_modulated2))
    encoder_hidden_states = _ops.gate_residual(encoder_hidden_states, txt_gate2, block.txt_mlp(txt_modulated2))

    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _block_applies(block) -> str | None:
    if block.zero_cond_t:
        return "zero_cond_t (per-token modulation of the Edit models) keeps diffusers' forward"
    for name in ("img_mod", "txt_mod"):
        mod = getattr(block, name)
        if not (isinstance(mod, torch.nn.Sequential) and len(mod) == 2 and type(mod[0]) is torch.nn.SiLU
                and isinstance(mod[1], torch.nn.Linear)):
            return f"{name} is not Sequential(SiLU, Linear)"
    for name in ("img_norm1", "img_norm2", "txt_norm1", "txt_norm2"):
        r = plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


SITES = (
    Site(
        name="qwenimage.block",
        cls=f"{_TF}:QwenImageTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
                "image_rotary_emb", "joint_attention_kwargs", "modulate_index"),
        forward=block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=_block_applies,
        high=False,
        description="dual-stream block: LN + modulate, gate+residual+norm2+modulate, FF gate residual",
    ),
    norm_out_site("qwenimage", high=False),
)

ADAPTER = Adapter(
    family="qwenimage",
    model_classes=("QwenImageTransformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
