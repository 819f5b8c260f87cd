"""SD3 / SD3.5 adapter: fast forwards for diffusers 0.42.1's SD3Transformer2DModel blocks.

``JointTransformerBlock`` is FLUX.1's dual block with SD3's details: image and text streams each
run adaLN-Zero (``layernorm_modulate``), joint attention (``JointAttnProcessor2_0``: diffusers'
own, with SD3.5's per-head diffusers RMSNorm on q/k and image-first concat — unchanged here), the
gated residual fused with norm2 + modulate (``gate_residual_layernorm_modulate``), the tanh-GELU
FeedForward (diffusers' own) and the FF gated residual (``gate_residual``). SD3.5-medium's dual
attention blocks (``SD35AdaLayerNormZeroX``: one LayerNorm, two modulations) add attn2 with its
own gated residual. The last block is ``context_pre_only``: its text stream stops after norm1
(an ``AdaLayerNormContinuous``, mounted by the ``norm_out`` site like the model's ``norm_out``).

Every op is bit-exact and gated at first sight; no quality="high" tier (admission was not
measured on SD3 activations).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from .adaln import ada_zero, ada_zero_applies, norm_out_site, plain_layernorm
from .base import Adapter, Site

DIFFUSERS_VERSIONS = ("0.42.1",)


def _ada_zero_x(norm, x: torch.Tensor, emb: torch.Tensor, _ops: OpSet):
    """SD35AdaLayerNormZeroX: ``chunk(9)`` = the six of AdaLayerNormZero, then shift/scale/gate of
    attn2. Both modulations normalise the same ``r(LN(x))``: two ``layernorm_modulate`` calls give
    exactly its bits (LayerNorm is deterministic)."""
    emb = norm.linear(norm.silu(emb))
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_msa2, scale_msa2, gate_msa2) = emb.chunk(9, dim=1)
    eps = norm.norm.eps
    n1 = _ops.layernorm_modulate(x, scale_msa, shift_msa, eps)
    n2 = _ops.layernorm_modulate(x, scale_msa2, shift_msa2, eps)
    return n1, gate_msa, shift_mlp, scale_mlp, gate_mlp, n2, gate_msa2


def joint_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
):
    """JointTransformerBlock: adaLN-Zero (LN + modulate), joint attention, gate + residual + norm2
    + modulate, FeedForward, FF gate residual, for both streams (text: not in the last block)."""
    if block._chunk_size is not None:  # chunked feed-forward: diffusers' own forward
        return original(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                        temb=temb, joint_attention_kwargs=joint_attention_kwargs)
    joint_attention_kwargs = joint_attention_kwargs or {}
    if block.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = _ada_zero_x(
            block.norm1, hidden_states, temb, _ops
        )
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_zero(block.norm1, hidden_states, temb, _ops)

    if block.context_pre_only:
        norm_encoder_hidden_states = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = ada_zero(
            block.norm1_context, encoder_hidden_states, temb, _ops
        )

    attn_output, context_attn_output = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        **joint_attention_kwargs,
    )

    if block.use_dual_attention:
        hidden_states = _ops.gate_residual(hidden_states, gate_msa, attn_output)
        attn_output2 = block.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs)
        hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
            hidden_states, gate_msa2, attn_output2, scale_mlp, shift_mlp, block.norm2.eps
        )
    else:
        hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
            hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp, block.norm2.eps
        )
    ff_output = block.ff(norm_hidden_states)
    hidden_states = _ops.gate_residual(hidden_states, gate_mlp, ff_output)

    if block.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    context_ff_output = block.ff_context(norm_encoder_hidden_states)
    encoder_hidden_states = _ops.gate_residual(encoder_hidden_states, c_gate_mlp, context_ff_output)
    return encoder_hidden_states, hidden_states


def _joint_applies(block) -> str | None:
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, SD35AdaLayerNormZeroX

    want = SD35AdaLayerNormZeroX if block.use_dual_attention else AdaLayerNormZero
    if type(block.norm1) is not want:
        return f"norm1 is {type(block.norm1).__name__}, not {want.__name__}"
    r = plain_layernorm(block.norm1.norm) if block.use_dual_attention else ada_zero_applies(block.norm1)
    if r is not None:
        return f"norm1: {r}"
    if block.context_pre_only:
        if type(block.norm1_context) is not AdaLayerNormContinuous:
            return f"norm1_context is {type(block.norm1_context).__name__}, not AdaLayerNormContinuous"
    else:
        if type(block.norm1_context) is not AdaLayerNormZero:
            return f"norm1_context is {type(block.norm1_context).__name__}, not AdaLayerNormZero"
        r = ada_zero_applies(block.norm1_context) or plain_layernorm(block.norm2_context)
        if r is not None:
            return f"text stream: {r}"
    r = plain_layernorm(block.norm2)
    if r is not None:
        return f"norm2: {r}"
    return None


SITES = (
    Site(
        name="sd3.joint_block",
        cls="diffusers.models.attention:JointTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "joint_attention_kwargs"),
        forward=joint_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=_joint_applies,
        high=False,
        description="joint block: adaLN-Zero (SD3.5 dual: one LN, two modulations), "
                    "gate+residual+norm2+modulate, FF gate residual",
    ),
    norm_out_site("sd3", high=False),
)

ADAPTER = Adapter(
    family="sd3",
    model_classes=("SD3Transformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
