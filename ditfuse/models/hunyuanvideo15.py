"""HunyuanVideo 1.5 adapter: fast forwards for diffusers 0.42.1's ``HunyuanVideo15Transformer3DModel``.

``HunyuanVideo15TransformerBlock`` is FLUX.1's dual-stream block with another signature and
without the fp16 clip: ``AdaLayerNormZero`` on each stream (LN + modulate by the first chunks of
``linear(silu(temb))``), the joint attention, ``h + attn * gate_msa`` (the product commutes
bitwise with FLUX's ``gate * attn``), ``norm2`` + modulate, the GELU(tanh) FeedForward, ``h +
gate_mlp * ff``. So the block's fast forward is FLUX.1's chain on FLUX.1's ops
(``layernorm_modulate``, ``gate_residual_layernorm_modulate``, ``gate_residual``, and across the
block boundary the next block's opening: models/handoff.py), and ``norm_out`` is the shared
``AdaLayerNormContinuous`` site.

The attention site runs the processor's code with two changes: its QK chain — diffusers'
``RMSNorm`` (two roundings) on q / k of both streams, FLUX's real interleaved RoPE on the video
stream only, the video-first concat — is one op, ``rope.qk_rmsnorm_diffusers_rope_img_first``
(round 18: the diffusers-RMSNorm QK kernel with FLUX's rotation on one stream); and its
[B, 1, S, S] joint mask (S = video tokens + the joint text sequence, which always holds the 729
image-embedding slots; 236 MB per sample at 480p x 33 frames with a 256-token prompt), the
same for every block of a forward, is built once (models/per_forward.py) instead of 54 times.

Not fused (notes/families.md §13): the value concat, the token refiner (text only, once per
forward), the model forward's text reordering. Every op is bit-exact and gated at first sight; no
quality="high" tier.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST
from .adaln import ada_zero, ada_zero_opening, dual_block_applies, norm_out_site
from .base import Adapter, Site, attention_site, diffusers_rmsnorms, feed_forward
from .handoff import NO_LINK, Link, close_block
from .per_forward import IdentityCache

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

    ff_output = feed_forward(block.ff, norm_hidden_states, _ops)
    context_ff_output = feed_forward(block.ff_context, norm_encoder_hidden_states, _ops)
    nxt = _link.next_block()
    hidden_states, img_next = close_block(_ops, hidden_states, gate_mlp, ff_output,
                                          None if nxt is None else ada_zero_opening(nxt.norm1, temb))
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, c_gate_mlp, context_ff_output,
                                                  None if nxt is None else ada_zero_opening(nxt.norm1_context, temb))
    _link.give((hidden_states, encoder_hidden_states, temb), None if nxt is None else (img_next, txt_next), _ops)
    return hidden_states, encoder_hidden_states


# -- attention: the processor's code, its [B, 1, S, S] mask built once per forward ---------------

_MASKS = IdentityCache()


def joint_mask(attention_mask: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """The processor's mask: the padding mask left-padded with True to ``seq_len`` (the video
    tokens), then ``m[i] & m[j]`` for every pair, [B, 1, S, S] bool."""
    m = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
    m1 = m.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
    return (m1 & m1.transpose(2, 3)).bool()


def attention_forward(attn, original, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, *, _ops: OpSet = LOSSLESS, **kwargs: Any):
    """Attention + HunyuanVideo15AttnProcessor2_0, line for line, except that the joint mask —
    the same for every block of a forward, from the same padding-mask tensor — is taken from
    :data:`_MASKS` after the first block built it (models/per_forward.py). The QK chain is
    diffusers' (module docstring)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    processor = attn.processor
    if (type(processor) is not HunyuanVideo15AttnProcessor2_0 or attention_mask is None
            or encoder_hidden_states is None or not {"image_rotary_emb"}.issuperset(kwargs)):
        # a swapped processor, or inputs the blocks never pass: diffusers' own path
        return original(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    image_rotary_emb = kwargs.get("image_rotary_emb")
    query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
    encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
    # norm, the video stream's RoPE and the video-first cat of q and k in one op
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
    query, key = _ops.qk_rmsnorm_diffusers_rope_img_first(
        query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
        encoder_query, encoder_key, attn.norm_added_q.weight, attn.norm_added_k.weight)
    value = torch.cat([value, encoder_value], dim=1)
    batch_size, seq_len, heads, dim = query.shape
    mask = _MASKS.get((attention_mask,), (batch_size, seq_len),
                      lambda: joint_mask(attention_mask, batch_size, seq_len))
    hidden_states = dispatch_attention_fn(
        query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False,
        backend=processor._attention_backend, parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
    hidden_states, encoder_hidden_states = (
        hidden_states[:, : -encoder_hidden_states.shape[1]],
        hidden_states[:, -encoder_hidden_states.shape[1]:],
    )
    if getattr(attn, "to_out", None) is not None:
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
    if getattr(attn, "to_add_out", None) is not None:
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    return hidden_states, encoder_hidden_states


_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    if type(attn.processor) is not HunyuanVideo15AttnProcessor2_0:
        return f"processor is {type(attn.processor).__name__}, not HunyuanVideo15AttnProcessor2_0"
    # the qk_norm="rms_norm" every HunyuanVideo 1.5 block is built with: the op's norm
    return diffusers_rmsnorms(attn, _QK_NORMS, attn.inner_dim // attn.heads)


SITES = (
    Site(
        name="hunyuanvideo15.block",
        cls=f"{_TF}:HunyuanVideo15TransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis",
                "args", "kwargs"),
        forward=block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=dual_block_applies,
        high=False,
        description="dual-stream block: adaLN-Zero LN + modulate, gate + residual + norm2 + modulate, FF gate "
                    "residual (+ the next block's adaLN-Zero), both streams",
        chained=True,
    ),
    attention_site(
        "hunyuanvideo15.attention", attention_forward, (QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST,), _attn_applies,
        "attention (HunyuanVideo15AttnProcessor2_0): QK RMSNorm + the video stream's RoPE + the video-first "
        "concat in one pass; the [B, 1, S, S] mask built once per forward instead of in every block",
    ),
    norm_out_site("hunyuanvideo15", high=False),
)

ADAPTER = Adapter(
    family="hunyuanvideo15",
    model_classes=("HunyuanVideo15Transformer3DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
