"""Qwen-Image adapter: fast forwards for diffusers 0.42.1's QwenImageTransformer2DModel blocks.

``QwenImageTransformerBlock`` is a dual-stream adaLN block with FLUX.1's chain shapes written
differently: ``img_mod`` / ``txt_mod`` = Linear(SiLU(temb)) → ``chunk(2)`` → each ``chunk(3)`` =
shift, scale, gate; ``_modulate`` = ``x·(1 + scale[:, None]) + shift[:, None]`` on an affine-free
LayerNorm → ``layernorm_modulate``; ``h + gate[:, None]·attn`` then norm2 + modulate →
``gate_residual_layernorm_modulate`` (the product commutes bitwise); the tanh-GELU FeedForward
stays diffusers'; ``h + gate2[:, None]·mlp`` → ``gate_residual``; the fp16 clip as diffusers does
it. The attention (``Attention`` + ``QwenDoubleStreamAttnProcessor2_0``) is the processor's code
with its QK chain — per-head diffusers RMSNorm on q/k of each stream, complex RoPE with each
stream's own freqs, text-first concat — as one op, ``qk_rmsnorm_diffusers_rope_complex``, that
writes the joint q/k; the two value projections write their rows of the joint value
(``layout.linear_cat``, batch 1, plain ``nn.Linear`` s, with ``DITFUSE_LINEAR_CAT=1``); the other projections, the joint text
mask, ``dispatch_attention_fn``
(the processor's backend and context-parallel config) and the output projections stay
diffusers'. Another processor, an external ``attention_mask`` or extra attention kwargs run
diffusers' forward. The Edit models' per-token modulation (``zero_cond_t`` /
``modulate_index``: each image token takes the timestep's or t = 0's modulation row) selects the
rows as diffusers does and feeds the same ops [B, L, D] tensors, handoff included (round 17;
CPU-tested only). Every op is bit-exact and gated at first sight; no
quality="high" tier: the close GEMM-GELU is admitted on Qwen-Image activations but its image FF
(4096 x 3072 -> 12288) ran slower than cuBLAS + the GELU pass in the step (round 30, H100: GPU
busy 130.65 ms lossless, 132.09 high), and the norms' close variants buy no time.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX
from .adaln import norm_out_site, plain_layernorm
from .base import (Adapter, Site, attention_site, diffusers_rmsnorms, feed_forward, linear_cat_applies, linear_module,
                   plain_linear)
from .handoff import NO_LINK, Link, Opening, close_block

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_qwenimage"


# -- attention --------------------------------------------------------------------------------

_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_ATTN_KWARGS = frozenset(("encoder_hidden_states_mask", "image_rotary_emb"))


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    if type(attn.processor) is not QwenDoubleStreamAttnProcessor2_0:
        return f"processor is {type(attn.processor).__name__}, not QwenDoubleStreamAttnProcessor2_0"
    reason = diffusers_rmsnorms(attn, _QK_NORMS, attn.inner_dim // attn.heads)
    if reason:
        return reason
    for name in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_out"):
        if getattr(attn, name, None) is None:
            return f"{name} is None (not a joint text/image attention)"
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
    """Attention + QwenDoubleStreamAttnProcessor2_0, with the QK chain — per-stream diffusers
    RMSNorm on q/k, complex RoPE with each stream's own freqs, text-first concat — as one gated
    op writing the joint q/k that attention consumes. Everything else is the processor's code."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    processor = attn.processor
    if (type(processor) is not QwenDoubleStreamAttnProcessor2_0 or encoder_hidden_states is None
            or attention_mask is not None or not _ATTN_KWARGS.issuperset(kwargs)):
        # A swapped processor, inputs the processor rejects (no text stream, an external mask) or
        # kwargs Attention.forward filters with a warning: diffusers' own path, errors included.
        return original(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    encoder_hidden_states_mask = kwargs.get("encoder_hidden_states_mask")
    image_rotary_emb = kwargs.get("image_rotary_emb")

    if encoder_hidden_states_mask is not None:
        seq_img = hidden_states.shape[1]
        image_mask = torch.ones((hidden_states.shape[0], seq_img), dtype=torch.bool, device=hidden_states.device)
        attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
        attention_mask = attention_mask[:, None, None, :]

    seq_txt = encoder_hidden_states.shape[1]

    img_query = attn.to_q(hidden_states)
    img_key = attn.to_k(hidden_states)
    txt_query = attn.add_q_proj(encoder_hidden_states)
    txt_key = attn.add_k_proj(encoder_hidden_states)
    head_dim = attn.inner_dim // attn.heads  # the processor's: -1 absorbs a tensor-parallel head shard
    if (plain_linear(attn.to_v) and plain_linear(attn.add_v_proj)
            and linear_cat_applies(encoder_hidden_states, hidden_states, attn.to_v.out_features)):
        # both value projections written straight into the joint value (text rows first): the
        # processor's cat without its copy
        joint_value = _ops.linear_cat(encoder_hidden_states, attn.add_v_proj.weight, attn.add_v_proj.bias,
                                      hidden_states, attn.to_v.weight, attn.to_v.bias).unflatten(-1, (-1, head_dim))
    else:
        img_value = attn.to_v(hidden_states).unflatten(-1, (-1, head_dim))
        txt_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
        joint_value = torch.cat([txt_value, img_value], dim=1)

    img_query = img_query.unflatten(-1, (-1, head_dim))
    img_key = img_key.unflatten(-1, (-1, head_dim))
    txt_query = txt_query.unflatten(-1, (-1, head_dim))
    txt_key = txt_key.unflatten(-1, (-1, head_dim))

    img_freqs, txt_freqs = image_rotary_emb if image_rotary_emb is not None else (None, None)
    joint_query, joint_key = _ops.qk_rmsnorm_diffusers_rope_complex(
        img_query, img_key, attn.norm_q.weight, attn.norm_k.weight, img_freqs, attn.norm_q.eps,
        txt_query, txt_key, attn.norm_added_q.weight, attn.norm_added_k.weight, txt_freqs,
    )

    joint_hidden_states = dispatch_attention_fn(
        joint_query,
        joint_key,
        joint_value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    joint_hidden_states = joint_hidden_states.flatten(2, 3)
    joint_hidden_states = joint_hidden_states.to(joint_query.dtype)

    txt_attn_output = joint_hidden_states[:, :seq_txt, :]
    img_attn_output = joint_hidden_states[:, seq_txt:, :]
    img_attn_output = attn.to_out[0](img_attn_output.contiguous())
    if len(attn.to_out) > 1:
        img_attn_output = attn.to_out[1](img_attn_output)  # dropout
    txt_attn_output = attn.to_add_out(txt_attn_output.contiguous())
    return img_attn_output, txt_attn_output


# -- blocks -----------------------------------------------------------------------------------


def _select(mod: torch.Tensor, index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock._modulate``'s (shift, scale, gate): the [B, D] chunks of ``mod``
    without ``index``; with it (the Edit models' ``zero_cond_t``: ``mod`` holds 2B rows, the
    timestep's then t = 0's) each token's row of the first or the second half, selected as its
    ``torch.where`` does ([B, L, D])."""
    shift, scale, gate = mod.chunk(3, dim=-1)
    if index is None:
        return shift, scale, gate
    b = shift.size(0) // 2
    idx = index.unsqueeze(-1)
    return tuple(torch.where(idx == 0, t[:b].unsqueeze(1), t[b:].unsqueeze(1)) for t in (shift, scale, gate))


def _opening(block, stream: str, temb: torch.Tensor, modulate_index: torch.Tensor | None = None) -> Opening:
    """``{stream}_mod(temb)`` -> ``chunk(2)`` -> each ``_modulate``'s shift, scale, gate
    (:func:`_select`: per token for the image stream of a ``zero_cond_t`` block, whose text stream
    takes the first half of ``temb``); the opening is ``{stream}_norm1`` + the first modulation, the
    other four chunks ride along."""
    index = None
    if stream == "img":
        index = modulate_index
    elif block.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    mod1, mod2 = getattr(block, f"{stream}_mod")(temb).chunk(2, dim=-1)
    shift1, scale1, gate1 = _select(mod1, index)
    shift2, scale2, gate2 = _select(mod2, index)
    return Opening(scale1, shift1, getattr(block, f"{stream}_norm1").eps, (gate1, shift2, scale2, gate2))


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
    _link: Link = NO_LINK,
):
    """QwenImageTransformerBlock: LN + modulate, joint attention, gate + residual + norm2 +
    modulate, FeedForward, FF gate residual — image and text stream. The FF gated residuals also
    compute the next block's LN + modulate when it follows directly (:mod:`ditfuse.models.handoff`).
    The Edit models' per-token modulation (``modulate_index``) runs the same ops on [B, L, D]
    chunks (:func:`_opening`)."""
    if block.zero_cond_t and modulate_index is None:  # diffusers would broadcast 2B rows over B samples
        return original(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                        encoder_hidden_states_mask=encoder_hidden_states_mask, temb=temb,
                        image_rotary_emb=image_rotary_emb, joint_attention_kwargs=joint_attention_kwargs,
                        modulate_index=modulate_index)
    # the index selects every block's rows: a payload is only for a call with the same one
    keys = (hidden_states, encoder_hidden_states, temb) + (() if modulate_index is None else (modulate_index,))
    opened = _link.take(block, keys, _ops)
    if opened is None:
        opened = (_opening(block, "img", temb, modulate_index).run(hidden_states, _ops),
                  _opening(block, "txt", temb).run(encoder_hidden_states, _ops))
    img_modulated, img_gate1, img_shift2, img_scale2, img_gate2 = opened[0]
    txt_modulated, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = opened[1]

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
    nxt = _link.next_block() if hidden_states.dtype != torch.float16 else None  # fp16 clips after the residuals
    hidden_states, img_next = close_block(_ops, hidden_states, img_gate2, feed_forward(block.img_mlp, img_modulated2, _ops),
                                          None if nxt is None else _opening(nxt, "img", temb, modulate_index))
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, txt_gate2,
                                                  feed_forward(block.txt_mlp, txt_modulated2, _ops),
                                                  None if nxt is None else _opening(nxt, "txt", temb))

    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    keys = (hidden_states, encoder_hidden_states, temb) + (() if modulate_index is None else (modulate_index,))
    _link.give(keys, None if nxt is None else (img_next, txt_next), _ops)
    return encoder_hidden_states, hidden_states


def _block_applies(block) -> str | None:
    for name in ("img_mod", "txt_mod"):
        mod = getattr(block, name)
        if not (isinstance(mod, torch.nn.Sequential) and len(mod) == 2 and type(mod[0]) is torch.nn.SiLU
                and linear_module(mod[1]) is not None):
            return f"{name} is not Sequential(SiLU, Linear) (a LoRA-wrapped Linear counts)"
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
        description="dual-stream block: LN + modulate, gate+residual+norm2+modulate, FF gate residual "
                    "(+ the next block's LN + modulate)",
        chained=True,
    ),
    attention_site(
        "qwenimage.attention", attention_forward, (QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX,), _attn_applies,
        "attention (QwenDoubleStreamAttnProcessor2_0): per-stream QK RMSNorm + complex RoPE + "
        "text-first concat in one pass (DITFUSE_LINEAR_CAT=1: the value projections written into the "
        "joint value, batch 1)",
    ),
    norm_out_site("qwenimage", high=False),
)

ADAPTER = Adapter(
    family="qwenimage",
    model_classes=("QwenImageTransformer2DModel", "QwenImageControlNetModel", "QwenImageMultiControlNetModel"),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
