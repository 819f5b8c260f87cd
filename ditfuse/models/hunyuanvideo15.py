"""HunyuanVideo 1.5 adapter: fast forwards for diffusers 0.42.1's ``HunyuanVideo15Transformer3DModel``.

``HunyuanVideo15TransformerBlock`` is FLUX.1's dual-stream block with another signature and
without the fp16 clip: ``AdaLayerNormZero`` on each stream (LN + modulate by the first chunks of
``linear(silu(temb))``), the joint attention, ``h + attn * gate_msa`` (the product commutes
bitwise with FLUX's ``gate * attn``), ``norm2`` + modulate, the GELU(tanh) FeedForward, ``h +
gate_mlp * ff``. So the block's fast forward is FLUX.1's chain on FLUX.1's ops
(``layernorm_modulate``, ``gate_residual_layernorm_modulate``, ``gate_residual``, and across the
block boundary the next block's opening: models/handoff.py), and ``norm_out`` is the shared
``AdaLayerNormContinuous`` site.

Not fused (notes/families.md §13): the attention's QK chain — diffusers' ``RMSNorm`` (two
roundings) on q / k of both streams, FLUX's real interleaved RoPE on the video stream only, an
image-first concat — is a combination no op reproduces yet (FLUX.1's op normalises with
``torch.nn.RMSNorm``, Qwen-Image's rotates complex); the token refiner (text only, once per
forward); the model forward's text reordering. Every op is bit-exact and gated at first sight; no
quality="high" tier.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from .adaln import ada_zero, ada_zero_applies, ada_zero_opening, norm_out_site, plain_layernorm
from .base import Adapter, Site
from .handoff import NO_LINK, Link, close_block

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_hunyuan_video15"


def block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HunyuanVideo15TransformerBlock: adaLN-Zero (LN + modulate) per stream, joint attention,
    gated residual + norm2 + modulate, FeedForward, gated residual (with the next block's
    adaLN-Zero when it follows directly); returns (video, text) as diffusers does."""
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb), _ops)
    if opened is None:
        opened = (ada_zero(block.norm1, hidden_states, temb, _ops),
                  ada_zero(block.norm1_context, encoder_hidden_states, temb, _ops))
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = opened[0]
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = opened[1]

    attn_output, context_attn_output = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )
    hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
        hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp, block.norm2.eps)
    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps)

    ff_output = block.ff(norm_hidden_states)
    context_ff_output = block.ff_context(norm_encoder_hidden_states)
    nxt = _link.next_block()
    hidden_states, img_next = close_block(_ops, hidden_states, gate_mlp, ff_output,
                                          None if nxt is None else ada_zero_opening(nxt.norm1, temb))
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, c_gate_mlp, context_ff_output,
                                                  None if nxt is None else ada_zero_opening(nxt.norm1_context, temb))
    _link.give((hidden_states, encoder_hidden_states, temb), None if nxt is None else (img_next, txt_next), _ops)
    return hidden_states, encoder_hidden_states


def _block_applies(block) -> str | None:
    for name in ("norm1", "norm1_context"):
        r = ada_zero_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    for name in ("norm2", "norm2_context"):
        r = plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


SITES = (
    Site(
        name="hunyuanvideo15.block",
        cls=f"{_TF}:HunyuanVideo15TransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis",
                "args", "kwargs"),
        forward=block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=_block_applies,
        high=False,
        description="dual-stream block: adaLN-Zero LN + modulate, gate + residual + norm2 + modulate, FF gate "
                    "residual (+ the next block's adaLN-Zero), both streams",
        chained=True,
    ),
    norm_out_site("hunyuanvideo15", high=False),
)

ADAPTER = Adapter(
    family="hunyuanvideo15",
    model_classes=("HunyuanVideo15Transformer3DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
