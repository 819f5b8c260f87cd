"""FLUX.3 adapter: fast forwards for diffusers 0.42.1's Flux3Transformer2DModel blocks.

Each fast forward is diffusers' forward, line for line, with the eager elementwise chains replaced
by ``_ops`` calls (the pattern of :mod:`ditfuse.models.flux2`; notes/families.md §7 reads the
model chain by chain). FLUX.3's modulation is per token: every ``temb_mod`` is a [B, S, 3D]
projection of the expanded timestep embedding, chunked into strided [B, S, D] views, which the
norm and residual kernels read in place.

- mode block (Flux3ModeTransformerBlock, per token mode): ``(1 + scale) * LN(x) + shift`` ->
  ``layernorm_modulate`` (the product commutes bitwise); ``x + gate * (attn + ff)`` -> eager's
  own ``attn + ff`` and ``gate_residual``.
- single block (Flux3SingleTransformerBlock): the two streams' LN + modulate, then eager's
  ``cat`` / ``attn + ff`` / ``split``, and each stream's gated residual -> ``gate_residual`` on
  its row slice of the sum.
- Flux3Attention + Flux3AttnProcessor: ``norm_q(q.float())`` / ``norm_k(k.float())`` (fp32
  ``torch.nn.RMSNorm``s, kept in fp32 by ``_keep_in_fp32_modules``), the interleaved RoPE in fp32
  and ``.to(value.dtype)`` -> ``qk_fp32_rmsnorm_rope``: one launch, no fp32 copies, one rounding.
- Flux3FeedForward: the SwiGLU of ``linear_in``'s two halves -> ``swiglu`` (FLUX.2's forward).
- norm_out (Flux3AdaLayerNorm): ``LN(x) * (1 + scale) + shift`` with per-token scale / shift.
- pos_embed (Flux3PosEmbed): the RoPE tables cached across steps (models/pos_cache.py).

Across block boundaries (round 18): every block of a mode, and every single block, reads the same
``temb_mod`` tensors, so a block's closing gated residual also computes its successor's LN +
modulate (``gate_residual_layernorm_modulate``, models/handoff.py), per stream.

Not fused (diffusers' own ops run): the ``attn + ff`` sums, the single block's text-first
``cat`` and ``split``, the model forward's per-token modulation projections and table concats.
No quality="high" tier (every site ``high=False``: no close kernel was
admitted on FLUX.3 activations). QK norms whose weights are not fp32 (a model cast with
``.to(dtype)`` instead of loaded with ``from_pretrained(torch_dtype=...)``) take torch's
composite RMSNorm, another chain: those attention modules keep diffusers' forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_FP32_RMSNORM_ROPE
from .adaln import plain_layernorm
from .base import Adapter, Site
from .flux2 import feed_forward_site, rms_norms_reason, swiglu_reason
from .handoff import NO_LINK, Link, Opening, close_block
from .pos_cache import embedder_site

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_flux3"


def _tf():
    from diffusers.models.transformers import transformer_flux3

    return transformer_flux3


# -- blocks -----------------------------------------------------------------------------------


def _opening(block, temb_mod: torch.Tensor) -> Opening:
    """A block's LN + modulate by the (shift, scale) chunks of ``temb_mod``; the gate rides along.
    Every block of a mode (and every single block) gets the same ``temb_mod`` from the model's
    forward, so a block can compute its successor's opening from its own modulation."""
    mod_shift, mod_scale, mod_gate = torch.chunk(temb_mod, 3, dim=-1)
    return Opening(mod_scale, mod_shift, block.norm.eps, (mod_gate,))


def mode_block_forward(block, original, hidden_states: torch.Tensor, temb_mod: torch.Tensor,
                       image_rotary_emb: tuple[torch.Tensor, torch.Tensor], *, _ops: OpSet = LOSSLESS,
                       _link: Link = NO_LINK) -> torch.Tensor:
    """Flux3ModeTransformerBlock: ``h = LN(x) * (1 + scale) + shift`` fused; attention and FF of
    ``h`` (parallel); ``x + gate * (attn + ff)`` as eager's sum and one gated-residual kernel,
    which also computes the next block's opening when it follows directly (models/handoff.py)."""
    opened = _link.take(block, (hidden_states, temb_mod), _ops)
    if opened is None:
        opened = _opening(block, temb_mod).run(hidden_states, _ops)
    norm_hidden_states, mod_gate = opened
    attn_output = block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb)
    ff_output = block.ff(norm_hidden_states)
    nxt = _link.next_block()
    hidden_states, nxt_opened = close_block(_ops, hidden_states, mod_gate, attn_output + ff_output,
                                            None if nxt is None else _opening(nxt, temb_mod))
    _link.give((hidden_states, temb_mod), nxt_opened, _ops)
    return hidden_states


def single_block_forward(block, original, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                         temb_mod: torch.Tensor, temb_mod_context: torch.Tensor,
                         image_rotary_emb: tuple[torch.Tensor, torch.Tensor], *,
                         _ops: OpSet = LOSSLESS, _link: Link = NO_LINK) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux3SingleTransformerBlock: each stream's LN + modulate fused; the text-first joint
    sequence, attention + FF and their sum as diffusers runs them; each stream's gated residual
    on its rows of the sum in one kernel (with the next block's opening of that stream when it
    follows directly)."""
    keys = (hidden_states, encoder_hidden_states, temb_mod, temb_mod_context)
    opened = _link.take(block, keys, _ops)
    if opened is None:
        opened = (_opening(block, temb_mod).run(hidden_states, _ops),
                  _opening(block, temb_mod_context).run(encoder_hidden_states, _ops))
    (norm_hidden_states, mod_gate), (norm_encoder_hidden_states, c_mod_gate) = opened
    combined = torch.cat([norm_encoder_hidden_states, norm_hidden_states], dim=1)
    attn_output = block.attn(hidden_states=combined, image_rotary_emb=image_rotary_emb)
    ff_output = block.ff(combined)
    output = attn_output + ff_output
    context_output, content_output = torch.split(
        output, [encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1
    )
    nxt = _link.next_block()
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, c_mod_gate, context_output,
                                                  None if nxt is None else _opening(nxt, temb_mod_context))
    hidden_states, img_next = close_block(_ops, hidden_states, mod_gate, content_output,
                                          None if nxt is None else _opening(nxt, temb_mod))
    _link.give((hidden_states, encoder_hidden_states, temb_mod, temb_mod_context),
               None if nxt is None else (img_next, txt_next), _ops)
    return encoder_hidden_states, hidden_states


def _block_applies(block) -> str | None:
    r = plain_layernorm(block.norm)
    return None if r is None else f"norm: {r}"


# -- feed-forward -----------------------------------------------------------------------------


def _ff_applies(ff) -> str | None:
    return swiglu_reason(ff.act_fn, _tf().Flux3SwiGLU)


# -- attention --------------------------------------------------------------------------------


def _attn_applies(attn) -> str | None:
    if type(attn.processor) is not _tf().Flux3AttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not Flux3AttnProcessor"
    reason = rms_norms_reason(attn, ("norm_q", "norm_k"))
    if reason:
        return reason
    for name in ("norm_q", "norm_k"):
        w = getattr(attn, name).weight
        if w is not None and w.dtype != torch.float32:
            return (f"{name}.weight is {str(w.dtype).replace('torch.', '')}, not fp32: torch then normalises "
                    "the fp32 query through its composite RMSNorm (another chain). from_pretrained(torch_dtype=...) "
                    "keeps the QK norms in fp32, as the model declares")
    return None


def attention_forward(attn, original, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                      _ops: OpSet = LOSSLESS, **kwargs: Any) -> torch.Tensor:
    """Flux3Attention + Flux3AttnProcessor with the fp32 QK norms, RoPE and the cast back in one
    gated op."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    tf = _tf()
    processor = attn.processor
    if kwargs or type(processor) is not tf.Flux3AttnProcessor:
        return original(hidden_states, attention_mask, image_rotary_emb, **kwargs)

    query, key, value = tf._get_qkv_projections(attn, hidden_states)
    if query.dtype != value.dtype:  # the op rounds to q's dtype, eager to v's
        return original(hidden_states, attention_mask, image_rotary_emb)
    query = query.unflatten(-1, (attn.heads, -1))
    key = key.unflatten(-1, (attn.heads, -1))
    value = value.unflatten(-1, (attn.heads, -1))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
    query, key = _ops.qk_fp32_rmsnorm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin,
                                           attn.norm_q.eps)

    hidden_states = dispatch_attention_fn(
        query, key, value,
        attn_mask=attention_mask,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(query.dtype)

    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    return hidden_states


# -- norm_out ---------------------------------------------------------------------------------


def norm_out_forward(norm, original, hidden_states: torch.Tensor, temb: torch.Tensor, *,
                     _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """Flux3AdaLayerNorm: ``emb = linear(silu(temb))``, ``chunk(2)`` = scale, shift (per token);
    ``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``."""
    emb = norm.linear(norm.act_fn(temb))
    scale, shift = torch.chunk(emb, 2, dim=-1)
    return _ops.layernorm_modulate(hidden_states, scale, shift, norm.norm.eps)


def _norm_out_applies(norm) -> str | None:
    if type(norm.act_fn) is not torch.nn.SiLU:
        return f"act_fn is {type(norm.act_fn).__name__}, not nn.SiLU"
    return plain_layernorm(norm.norm)


# -- the table --------------------------------------------------------------------------------

SITES = (
    Site(
        name="flux3.mode_block",
        cls=f"{_TF}:Flux3ModeTransformerBlock",
        params=("self", "hidden_states", "temb_mod", "image_rotary_emb"),
        forward=mode_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL, GATE_RESIDUAL_LAYERNORM_MODULATE),
        applies=_block_applies,
        high=False,
        description="per-mode block: LN + modulate (per token), gate residual of attn + ff (+ the next "
                    "block's LN + modulate)",
        chained=True,
    ),
    Site(
        name="flux3.single_block",
        cls=f"{_TF}:Flux3SingleTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb_mod", "temb_mod_context",
                "image_rotary_emb"),
        forward=single_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL, GATE_RESIDUAL_LAYERNORM_MODULATE),
        applies=_block_applies,
        high=False,
        description="joint block: both streams' LN + modulate, each stream's gate residual (+ the next "
                    "block's LN + modulate of that stream)",
        chained=True,
    ),
    feed_forward_site("flux3", f"{_TF}:Flux3FeedForward", _ff_applies),
    Site(
        name="flux3.attention",
        cls=f"{_TF}:Flux3Attention",
        params=("self", "hidden_states", "attention_mask", "image_rotary_emb"),
        forward=attention_forward,
        ops=(QK_FP32_RMSNORM_ROPE,),
        applies=_attn_applies,
        high=False,
        description="attention: fp32 QK RMSNorm + RoPE + the cast back in one pass (no fp32 copies)",
    ),
    Site(
        name="flux3.norm_out",
        cls=f"{_TF}:Flux3AdaLayerNorm",
        params=("self", "hidden_states", "temb"),
        forward=norm_out_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_norm_out_applies,
        high=False,
        description="norm_out (Flux3AdaLayerNorm, per-token scale / shift)",
    ),
    embedder_site("flux3.pos_embed", f"{_TF}:Flux3PosEmbed"),
)

ADAPTER = Adapter(
    family="flux3",
    model_classes=("Flux3Transformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
