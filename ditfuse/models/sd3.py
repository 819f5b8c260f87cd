"""SD3 / SD3.5 adapter: fast forwards for diffusers 0.42.1's SD3Transformer2DModel blocks.

``JointTransformerBlock`` is FLUX.1's dual block with SD3's details: image and text streams each
run adaLN-Zero (``layernorm_modulate``), joint attention (``JointAttnProcessor2_0``: the processor's code,
with SD3.5's per-head diffusers RMSNorm on q/k/q_txt/k_txt and the image-first q/k cats as one op,
``qk_rmsnorm_diffusers_cat``, writing the joint [B, H, S, D]; v's cat of two transposed views in
one copy pass, ``head_cat``, where aten runs a non-vectorized cat; SDPA's heads-first output
back in token rows, ``heads_to_tokens``, where aten runs a non-vectorized strided copy; SDPA and
the projections stay the processor's; SD3 without QK norm: its q / k / v cats through
``head_cat``), the
gated residual fused with norm2 + modulate (``gate_residual_layernorm_modulate``), the tanh-GELU
FeedForward (diffusers' own) and the FF gated residual (``gate_residual``). SD3.5-medium's dual
attention blocks (``SD35AdaLayerNormZeroX``: one LayerNorm, two modulations) add attn2 with its
own gated residual (its QK norm is the same op without text). An external ``attention_mask``,
extra attention kwargs or another processor run diffusers' forward. The last block is ``context_pre_only``: its text stream stops after norm1
(an ``AdaLayerNormContinuous``, mounted by the ``norm_out`` site like the model's ``norm_out``).

Every op is bit-exact and gated at first sight; no quality="high" tier (admission was not
measured on SD3 activations).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.layout import HEAD_CAT, HEADS_TO_TOKENS
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_CAT
from .adaln import ada_zero, ada_zero_applies, ada_zero_opening, norm_out_site, plain_layernorm
from .base import Adapter, Site, attention_site, diffusers_rmsnorms, feed_forward
from .handoff import NO_LINK, Link, Opening, close_block

DIFFUSERS_VERSIONS = ("0.42.1",)


# -- attention --------------------------------------------------------------------------------


def _attn_applies(attn) -> str | None:
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    if type(attn.processor) is not JointAttnProcessor2_0:
        return f"processor is {type(attn.processor).__name__}, not JointAttnProcessor2_0"
    if attn.norm_q is None and attn.norm_k is None:
        # SD3 (qk_norm=None): the q / k / v cats of the joint attention are all there is to fuse
        if attn.add_q_proj is None:
            return "no QK norm and no text stream: nothing to fuse"
        if getattr(attn, "norm_added_q", None) is not None or getattr(attn, "norm_added_k", None) is not None:
            return "text QK norm without image QK norm"
        return None
    names = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.add_q_proj is not None else ())
    reason = diffusers_rmsnorms(attn, names)
    if reason:
        return reason
    if attn.add_q_proj is None and getattr(attn, "norm_added_q", None) is not None:
        return "norm_added_q without add_q_proj"
    return None


def attention_forward(
    attn,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    **kwargs: Any,
):
    """Attention + JointAttnProcessor2_0 line for line, with the four RMSNorms and the q/k cats
    as one gated op (``qk_rmsnorm_diffusers_cat``) writing the joint [B, H, S_img + S_txt, D] and
    the v cat as another (``head_cat``, a copy), SDPA's output back in token rows as a third
    (``heads_to_tokens``, a copy); ``F.scaled_dot_product_attention`` and the output projections
    are the processor's."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    if (type(attn.processor) is not JointAttnProcessor2_0 or attention_mask is not None or kwargs
            or (attn.norm_q is None and encoder_hidden_states is None)):
        return original(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    F = torch.nn.functional
    residual = hidden_states
    batch_size = hidden_states.shape[0]

    query = attn.to_q(hidden_states)
    key = attn.to_k(hidden_states)
    value = attn.to_v(hidden_states)
    inner_dim = key.shape[-1]
    head_dim = inner_dim // attn.heads
    query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

    q_txt = k_txt = q_txt_weight = k_txt_weight = None
    if encoder_hidden_states is not None:
        q_txt = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        k_txt = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        v_txt = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
    if attn.norm_q is None:  # SD3 without QK norm: the cats of the transposed views, one copy pass each
        query, key = _ops.head_cat(query, q_txt), _ops.head_cat(key, k_txt)
    else:
        if encoder_hidden_states is not None:
            q_txt_weight, k_txt_weight = attn.norm_added_q.weight, attn.norm_added_k.weight
        query, key = _ops.qk_rmsnorm_diffusers_cat(
            query, key, attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps,
            q_txt, k_txt, q_txt_weight, k_txt_weight,
        )
    if encoder_hidden_states is not None:
        value = _ops.head_cat(value, v_txt)

    hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
    if attn.heads > 1 and head_dim > 1 and hidden_states.stride(1) != head_dim * hidden_states.stride(3):
        # the processor's transpose + reshape copies SDPA's heads-first output into token rows
        hidden_states = _ops.heads_to_tokens(hidden_states)
    else:  # heads and head dim merge: eager's reshape is a view
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
    hidden_states = hidden_states.to(query.dtype)

    if encoder_hidden_states is not None:
        hidden_states, encoder_hidden_states = (
            hidden_states[:, : residual.shape[1]],
            hidden_states[:, residual.shape[1] :],
        )
        if not attn.context_pre_only:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if encoder_hidden_states is not None:
        return hidden_states, encoder_hidden_states
    return hidden_states


def _ada_zero_x_opening(norm, emb: torch.Tensor) -> Opening:
    """SD35AdaLayerNormZeroX: ``chunk(9)`` = the six of AdaLayerNormZero, then shift/scale/gate of
    attn2. The opening is the first modulation; the block applies the second to its own input
    (both normalise the same ``r(LN(x))``: a second ``layernorm_modulate`` gives exactly its bits,
    LayerNorm is deterministic)."""
    emb = norm.linear(norm.silu(emb))
    (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
     shift_msa2, scale_msa2, gate_msa2) = emb.chunk(9, dim=1)
    return Opening(scale_msa, shift_msa, norm.norm.eps,
                   (gate_msa, shift_mlp, scale_mlp, gate_mlp, scale_msa2, shift_msa2, gate_msa2))


def _image_opening(block, temb: torch.Tensor) -> Opening:
    return (_ada_zero_x_opening if block.use_dual_attention else ada_zero_opening)(block.norm1, temb)


def joint_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
):
    """JointTransformerBlock: adaLN-Zero (LN + modulate), joint attention, gate + residual + norm2
    + modulate, FeedForward, FF gate residual, for both streams (text: not in the last block). The
    FF gated residuals also compute the next block's adaLN-Zero norms when it follows directly
    (:mod:`ditfuse.models.handoff`; the text stream's when the next block is not the last, whose
    text norm is an AdaLayerNormContinuous of its own); skip_layers and ControlNet residuals make
    the next block compute its own."""
    if block._chunk_size is not None:  # chunked feed-forward: diffusers' own forward
        return original(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                        temb=temb, joint_attention_kwargs=joint_attention_kwargs)
    joint_attention_kwargs = joint_attention_kwargs or {}
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb), _ops)
    if opened is None:
        opened = (_image_opening(block, temb).run(hidden_states, _ops),
                  None if block.context_pre_only else ada_zero(block.norm1_context, encoder_hidden_states, temb, _ops))
    if block.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, scale_msa2, shift_msa2, gate_msa2 = opened[0]
        norm_hidden_states2 = _ops.layernorm_modulate(hidden_states, scale_msa2, shift_msa2, block.norm1.norm.eps)
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = opened[0]

    if block.context_pre_only:
        norm_encoder_hidden_states = block.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = opened[1]

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
    ff_output = feed_forward(block.ff, norm_hidden_states, _ops)
    nxt = _link.next_block() if hidden_states.dtype != torch.float16 else None
    if nxt is not None and nxt._chunk_size is not None:
        nxt = None  # the next block runs diffusers' forward
    hidden_states, img_next = close_block(_ops, hidden_states, gate_mlp, ff_output,
                                          None if nxt is None else _image_opening(nxt, temb))

    if block.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    context_ff_output = feed_forward(block.ff_context, norm_encoder_hidden_states, _ops)
    txt_opening = None if nxt is None or nxt.context_pre_only else ada_zero_opening(nxt.norm1_context, temb)
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, c_gate_mlp, context_ff_output,
                                                  txt_opening)
    _link.give((hidden_states, encoder_hidden_states, temb), None if nxt is None else (img_next, txt_next), _ops)
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
                    "gate+residual+norm2+modulate, FF gate residual (+ the next block's adaLN-Zero)",
        chained=True,
    ),
    attention_site(
        "sd3.attention", attention_forward, (QK_RMSNORM_DIFFUSERS_CAT, HEAD_CAT, HEADS_TO_TOKENS), _attn_applies,
        "attention (JointAttnProcessor2_0): SD3.5's four QK RMSNorms + image-first q/k cats in one "
        "pass (attn and attn2), the v cat in one copy pass; SD3 without QK norm: the q/k/v cats; "
        "SDPA's output back in token rows in one copy pass",
    ),
    norm_out_site("sd3", high=False),
)

ADAPTER = Adapter(
    family="sd3",
    model_classes=("SD3Transformer2DModel", "SD3ControlNetModel", "SD3MultiControlNetModel"),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
