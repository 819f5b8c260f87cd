"""Wan's "Copied from" transformers in diffusers 0.42.1: SkyReels-V2, ChronoEdit, Wan-Animate.

diffusers builds these models from copies of transformer_wan's classes, each in its own module.
Sites match by class object (models/base.py), so Wan's sites never take the copies; the tables
below declare Wan's fast forwards (models/wan.py) on the copies wherever the copy's code is
Wan's, and nowhere else. tests/cpu/test_wan_variants.py pins, per class, the normalised source
diff against transformer_wan (empty for the exact copies, the known lines for the others), so a
diffusers change that makes a copy diverge fails there before it can mount.

Per model (diffusers 0.42.1):

ChronoEdit (``transformer_chronoedit``): ``WanTransformerBlock``, ``WanAttention`` +
``WanAttnProcessor`` and ``_get_qkv_projections`` are exact copies -> Wan's block and attention
sites. ``ChronoEditTransformer3DModel.forward`` is Wan's model forward without the
``.contiguous()`` after the patch embedding (its rope, ``ChronoEditRotaryPosEmbed``, differs,
but the forward only calls it) -> Wan's model site with ``_contiguous=False``: the stream stays
the transposed view, and the ops return eager's layout for it.

Wan-Animate (``transformer_wan_animate``): ``WanTransformerBlock`` (the copy lacks
``@maybe_allow_in_graph``, which only tells dynamo not to break the graph at the block),
``WanAttention`` + ``WanAttnProcessor`` and ``_get_qkv_projections`` are copies -> Wan's block and
attention sites. ``WanAnimateTransformer3DModel.forward`` is its own (pose patch embedding,
motion and face encoders, a face-adapter residual after every ``inject_face_latents_blocks``-th
block): it stays diffusers'. The face adapter's sum is a new tensor, so the block after it opens
itself (the hand-off from its predecessor is discarded, models/handoff.py).

SkyReels-V2 (``transformer_skyreels_v2``): ``SkyReelsV2AttnProcessor``'s self-attention path is
Wan's (its differences are in the image/cross-attention paths: ``parallel_config`` is passed
there too) and ``SkyReelsV2Attention.forward`` is Wan's -> Wan's attention site, with the
module's own ``_get_qkv_projections`` (its fused-projection test reads
``cross_attention_dim_head is None`` where Wan's reads ``not is_cross_attention``; SkyReels sets
``is_cross_attention = cross_attention_dim_head is not None``, so they agree).
``SkyReelsV2TransformerBlock.forward`` is Wan's block with two differences the fast forward takes
as parameters: the self-attention gets the model's causal ``attention_mask`` (diffusion forcing;
Wan passes None), and a 4-D ``temb`` is laid out [B, 6, S, D] (Wan: [B, S, 6, D]), chunked on
dim 1 -> :func:`skyreels_block_forward`. ``SkyReelsV2Transformer3DModel.forward`` is its own
(causal mask, fps embedding, diffusion-forcing timesteps, a [B, 6, S, D] tail): it stays
diffusers'.

Wan-Animate 2 (``transformer_wan_animate_2``): no class is a copy (its attention processors keep a
KV cache, its block and model differ): nothing is declared; it stays diffusers'.
"""

from __future__ import annotations

import functools

import torch

from ..contracts.ops import LOSSLESS, OpSet
from . import wan
from .adaln import table_plus_fp32
from .base import Adapter, Site
from .handoff import NO_LINK, Link

_D = "diffusers.models.transformers."
CHRONOEDIT = _D + "transformer_chronoedit"
WAN_ANIMATE = _D + "transformer_wan_animate"
SKYREELS_V2 = _D + "transformer_skyreels_v2"

_BLOCK_PARAMS = ("self", "hidden_states", "encoder_hidden_states", "temb", "rotary_emb")
_ATTN_PARAMS = ("self", "hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb", "kwargs")
_WAN = {s.name: s for s in wan.SITES}
_MODEL_PARAMS = ("self", "hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
                 "return_dict", "attention_kwargs")


def _block_site(family: str, cls: str, forward=wan.block_forward, params=_BLOCK_PARAMS, note: str = "") -> Site:
    return Site(
        name=f"{family}.block", cls=cls, params=params, forward=forward,
        ops=_WAN['wan.block'].ops, high_ops=_WAN['wan.block'].high_ops, applies=wan._block_applies, chained=True,
        description=f"Wan's block site{note}: " + _WAN['wan.block'].description,
    )


def _attention_site(family: str, module: str, attention: str, processor: str) -> Site:
    return Site(
        name=f"{family}.attention", cls=f"{module}:{attention}", params=_ATTN_PARAMS,
        forward=functools.partial(wan.attention_forward, _module=module, _processor=processor),
        ops=_WAN['wan.attention'].ops,
        applies=functools.partial(wan._attn_applies, _module=module, _processor=processor),
        description=f"Wan's attention site ({processor}): " + _WAN['wan.attention'].description,
    )


# -- SkyReels-V2: the block's modulation layout and causal mask ------------------------------


def _skyreels_modulation(block, temb: torch.Tensor, _ops: OpSet) -> wan.Modulation:
    """SkyReelsV2TransformerBlock's chunking of ``scale_shift_table + temb.float()``, as
    ``(chunks, rows)`` (wan._modulation): the sum's [B, 1, D] views for a 3-D temb (Wan's; the sum
    is ``modulate.table_add``, adaln.table_plus_fp32); for a 4-D [B, 6, S, D] one (diffusion
    forcing) temb's own per-token [B, S, D] views and the table's six [D] rows, summed inside the
    ops that read them."""
    if temb.dim() == 3:
        return table_plus_fp32(block.scale_shift_table, temb, _ops).chunk(6, dim=1), None
    return temb.unbind(1), block.scale_shift_table.reshape(6, -1).unbind(0)


def skyreels_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
) -> torch.Tensor:
    """SkyReelsV2TransformerBlock: Wan's block forward with the causal mask on the self-attention
    and SkyReels' modulation chunking. A temb of another rank (diffusers raises) takes diffusers'
    forward."""
    if temb.dim() not in (3, 4):
        return original(hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask)
    return wan.block_forward(block, original, hidden_states, encoder_hidden_states, temb, rotary_emb,
                             _ops=_ops, _link=_link, _attention_mask=attention_mask, _chunks=_skyreels_modulation)


# -- the tables --------------------------------------------------------------------------------

CHRONOEDIT_SITES = (
    Site(
        name="chronoedit.model", cls=f"{CHRONOEDIT}:ChronoEditTransformer3DModel", params=_MODEL_PARAMS,
        forward=functools.partial(wan.model_forward, _contiguous=False), ops=_WAN['wan.model'].ops,
        applies=wan._model_applies,
        description="Wan's model site (no .contiguous() after the patch embedding): " + _WAN['wan.model'].description,
    ),
    _block_site("chronoedit", f"{CHRONOEDIT}:WanTransformerBlock"),
    _attention_site("chronoedit", CHRONOEDIT, "WanAttention", "WanAttnProcessor"),
)

WAN_ANIMATE_SITES = (
    _block_site("wan_animate", f"{WAN_ANIMATE}:WanTransformerBlock"),
    _attention_site("wan_animate", WAN_ANIMATE, "WanAttention", "WanAttnProcessor"),
)

SKYREELS_V2_SITES = (
    _block_site("skyreels_v2", f"{SKYREELS_V2}:SkyReelsV2TransformerBlock", forward=skyreels_block_forward,
                params=(*_BLOCK_PARAMS, "attention_mask"),
                note=" (causal mask into the self-attention, [B, 6, S, D] per-token modulation)"),
    _attention_site("skyreels_v2", SKYREELS_V2, "SkyReelsV2Attention", "SkyReelsV2AttnProcessor"),
)

CHRONOEDIT_ADAPTER = Adapter(family="chronoedit", model_classes=("ChronoEditTransformer3DModel",),
                             diffusers_versions=wan.DIFFUSERS_VERSIONS, sites=CHRONOEDIT_SITES)
WAN_ANIMATE_ADAPTER = Adapter(family="wan_animate", model_classes=("WanAnimateTransformer3DModel",),
                              diffusers_versions=wan.DIFFUSERS_VERSIONS, sites=WAN_ANIMATE_SITES)
SKYREELS_V2_ADAPTER = Adapter(family="skyreels_v2", model_classes=("SkyReelsV2Transformer3DModel",),
                              diffusers_versions=wan.DIFFUSERS_VERSIONS, sites=SKYREELS_V2_SITES)
