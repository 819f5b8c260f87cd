"""HunyuanVideo (1.0) adapter: fast forwards for diffusers 0.42.1's ``HunyuanVideoTransformer3DModel``.

Chains and what runs them (each compared with kernels/reference.py's chain, op order and
roundings; r = a rounding to the activation dtype):

- ``HunyuanVideoTransformerBlock`` (dual-stream): its ``forward`` is HunyuanVideo 1.5's
  ``HunyuanVideo15TransformerBlock.forward`` token for token (same signature, same lines), so the
  site runs :func:`ditfuse.models.hunyuanvideo15.block_forward`: ``AdaLayerNormZero`` per stream
  (``r(r(r(LN(x)) * r(1 + scale)) + shift)``: ``norm.layernorm_modulate``), ``h + attn *
  gate_msa`` (IEEE products commute bitwise: ``modulate.gate_residual``'s ``r(h + r(gate *
  attn))``) fused with ``norm2`` + modulate (``norm.gate_residual_layernorm_modulate``), the
  GELU(tanh) FeedForward (diffusers' module), ``h + gate_mlp * ff`` (``modulate.gate_residual``, or
  fused with the next dual block's adaLN-Zero across the boundary: models/handoff.py). No fp16
  clip (unlike FLUX.1), so the hand-off also runs in fp16.
- ``HunyuanVideoSingleTransformerBlock``: FLUX.1's single block with the video stream first:
  ``cat([video, text])`` (a view when the pieces are the previous single block's two views of one
  tensor, as FLUX's), ``AdaLayerNormZeroSingle`` (``norm.layernorm_modulate``), ``cat([attn,
  gelu_tanh(proj_mlp(n))], dim=2)`` (``activation.gelu_tanh_cat``; the attention's two outputs
  re-joined as a view first), ``gate * proj_out(..) + residual`` (sums commute bitwise:
  ``modulate.gate_residual``, or fused with the next single block's opening). The dual -> single
  boundary has no hand-off (another block class, another chain).
- Attention (``HunyuanVideoAttnProcessor2_0``), dual-stream blocks: diffusers ``RMSNorm`` (two
  roundings, one mean call per stream) on q / k of the video stream and ``norm_added_q/k`` of the
  text stream, FLUX's real interleaved RoPE (``apply_rotary_emb(use_real=True)``, fp32 math, cos /
  sin [S, D] from ``HunyuanVideoRotaryPosEmbed``) on the video stream only, the **video-first**
  concat: exactly ``rope.qk_rmsnorm_diffusers_rope_img_first`` (HunyuanVideo 1.5's processor runs
  the same lines). The [B, 1, 1, S] padding mask is built once by the model's forward and passed
  through: nothing to cache (1.5 builds [B, 1, S, S] per block).
- Attention, single-stream blocks (``pre_only``, no added projections): the processor projects
  the joint ``cat([video, text])``, normalises q / k with ``norm_q`` / ``norm_k`` in **one** call
  over all S_video + S_text rows, then rotates the video rows only and re-concatenates. Splitting q
  into a video and a text stream for the img-first op would **not** be bitwise: torch reduces with
  one launch configuration for the joint rows (below 16 rows a stream alone gets more lanes, and
  the mean factor ``float(rows) / float(rows * D)`` is per call). So the whole chain runs on
  ``rope.qk_rmsnorm_diffusers_rope_joint`` (round 20): the img-first kernel on the two row ranges
  of the joint tensor with the joint tensor's launch and factor for both. Without text rows
  (diffusers' ``[:, :-0]`` slices are empty) the norm runs on the img-first op's norm-only form
  and the rest stays diffusers'.
- ``norm_out`` (``AdaLayerNormContinuous``, scale first): the shared site
  (``norm.layernorm_modulate``).

Eager (not fused), and why:

- the token refiner (``HunyuanVideoIndividualTokenRefinerBlock``, text only, 2 layers, once per
  forward): affine ``nn.LayerNorm`` norms without modulation, gates already ``[B, 1, D]`` applied
  as ``h + x * gate``, its ``Attention`` on plain ``AttnProcessor2_0`` (the attention site skips it
  and says so). Small next to 60 blocks on the video tokens.
- the value concat of the dual attention, the model forward's mask / RoPE table / patchify.
- the image-to-video ``token_replace`` blocks (``HunyuanVideoTokenReplace*``): per-token-range
  modulation (first frame vs the rest) no op reproduces; those blocks keep their forward (their
  attention, the same processor, is still mounted).

Every op is bit-exact and gated at first sight; no quality="high" tier. GPU (round 20, H100):
tests/gpu/test_hunyuanvideo_gpu.py passed; the 848x480x33 step 993.86 -> 752.02 ms.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import GELU_TANH_CAT
from ..kernels.layout.joint_buffers_torch import cat_or_view
from ..kernels.linear import LINEAR_GELU_TANH
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST, QK_RMSNORM_DIFFUSERS_ROPE_JOINT
from .adaln import dual_block_applies, norm_out_site, single_block_applies
from .base import Adapter, Site, attention_site, diffusers_rmsnorms
from .flux import single_block_mix
from .handoff import NO_LINK, Link, Opening, close_block
from .hunyuanvideo15 import block_forward as dual_block_forward

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_hunyuan_video"


# -- single-stream block ------------------------------------------------------------------------


def _ada_zero_single(norm, emb: torch.Tensor) -> Opening:
    """AdaLayerNormZeroSingle's modulation: ``emb = linear(silu(emb))``, ``chunk(3)`` = shift,
    scale, gate; the norm is ``r(r(r(LN(x)) * r(1 + scale)) + shift)``, the gate rides along."""
    emb = norm.linear(norm.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return Opening(scale_msa, shift_msa, norm.norm.eps, (gate_msa,))


def single_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args: Any,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HunyuanVideoSingleTransformerBlock: ``x = cat([video, text])``, ``n, gate =
    AdaLayerNormZeroSingle(x)``, ``h = x + gate * proj_out(cat([attn(n), gelu_tanh(proj_mlp(n))],
    dim=2))``; returns (video, text) = views of ``h``. The opening may come from the previous
    single block, the closing may compute the next one's (models/handoff.py)."""
    text_seq_length = encoder_hidden_states.shape[1]
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb), _ops)
    # the previous single block returned two views of one tensor: re-joined without a copy
    hidden_states = cat_or_view((hidden_states, encoder_hidden_states), dim=1)
    residual = hidden_states
    if opened is None:
        opened = _ada_zero_single(block.norm, temb).run(hidden_states, _ops)
    norm_hidden_states, gate = opened

    def attention() -> tuple[torch.Tensor, torch.Tensor]:  # (video rows, text rows)
        return block.attn(
            hidden_states=norm_hidden_states[:, :-text_seq_length, :],
            encoder_hidden_states=norm_hidden_states[:, -text_seq_length:, :],
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )

    cat = single_block_mix(block, norm_hidden_states, attention, _ops)
    nxt = _link.next_block()
    hidden_states, opened_next = close_block(_ops, residual, gate, block.proj_out(cat),
                                             None if nxt is None else _ada_zero_single(nxt.norm, temb))
    hidden_states, encoder_hidden_states = (
        hidden_states[:, :-text_seq_length, :],
        hidden_states[:, -text_seq_length:, :],
    )
    _link.give((hidden_states, encoder_hidden_states, temb), opened_next, _ops)
    return hidden_states, encoder_hidden_states


# -- attention ------------------------------------------------------------------------------------


def attention_forward(attn, original, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None, *, _ops: OpSet = LOSSLESS, **kwargs: Any):
    """Attention + HunyuanVideoAttnProcessor2_0, line for line, with the QK chain through
    ``_ops.qk_rmsnorm_diffusers_rope_img_first``: the whole chain (both streams' RMSNorm, the video
    stream's RoPE, the video-first concat) for the dual blocks, the RMSNorm of the joint q / k for
    the single blocks (their RoPE on the video rows stays eager: module docstring)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    processor = attn.processor
    if (type(processor) is not HunyuanVideoAttnProcessor2_0 or encoder_hidden_states is None
            or not {"image_rotary_emb"}.issuperset(kwargs)):
        # a swapped processor, or inputs the blocks never pass: diffusers' own path
        return original(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    image_rotary_emb = kwargs.get("image_rotary_emb")
    joint = attn.add_q_proj is not None
    if not joint:
        # the single block's two views of one normed tensor: re-joined without a copy
        hidden_states = cat_or_view((hidden_states, encoder_hidden_states), dim=1)

    query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
    key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
    value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
    if joint:
        encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        # norm, the video stream's RoPE and the video-first cat of q and k in one op
        query, key = _ops.qk_rmsnorm_diffusers_rope_img_first(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
            encoder_query, encoder_key, attn.norm_added_q.weight, attn.norm_added_k.weight)
        value = torch.cat([value, encoder_value], dim=1)
    elif image_rotary_emb is not None and encoder_hidden_states.shape[1] > 0:
        # norm_q / norm_k over the joint rows (one mean launch, as torch's), the video rows'
        # RoPE and the re-concat in one op
        query, key = _ops.qk_rmsnorm_diffusers_rope_joint(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
            encoder_hidden_states.shape[1])
    else:
        # norm_q / norm_k over all rows in one pass (the img-first op's norm-only form: one stream)
        query, key = _ops.qk_rmsnorm_diffusers_rope_img_first(
            query, key, attn.norm_q.weight, attn.norm_k.weight, None, None, attn.norm_q.eps)
        if image_rotary_emb is not None:  # no text rows: diffusers' [:, :-0] slices are empty
            n_txt = encoder_hidden_states.shape[1]
            query = torch.cat([apply_rotary_emb(query[:, :-n_txt], image_rotary_emb, sequence_dim=1),
                               query[:, -n_txt:]], dim=1)
            key = torch.cat([apply_rotary_emb(key[:, :-n_txt], image_rotary_emb, sequence_dim=1),
                             key[:, -n_txt:]], dim=1)

    hidden_states = dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
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


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    if type(attn.processor) is not HunyuanVideoAttnProcessor2_0:
        return f"processor is {type(attn.processor).__name__}, not HunyuanVideoAttnProcessor2_0"
    # qk_norm="rms_norm", as every HunyuanVideo block is built: the op's norm, on both streams
    # where there are two
    names = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.add_q_proj is not None else ())
    return diffusers_rmsnorms(attn, names, attn.inner_dim // attn.heads)


SITES = (
    Site(
        name="hunyuanvideo.block",
        cls=f"{_TF}:HunyuanVideoTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "attention_mask", "freqs_cis",
                "args", "kwargs"),
        forward=dual_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=dual_block_applies,
        high=False,
        high_ops=(LINEAR_GELU_TANH,),
        description="dual-stream block: adaLN-Zero LN + modulate, gate + residual + norm2 + modulate, FF gate "
                    "residual (+ the next block's adaLN-Zero), both streams (quality=high: each FF's first "
                    "projection + GELU as one GEMM)",
        chained=True,
    ),
    Site(
        name="hunyuanvideo.single_block",
        cls=f"{_TF}:HunyuanVideoSingleTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "attention_mask", "image_rotary_emb",
                "args", "kwargs"),
        forward=single_block_forward,
        ops=(LAYERNORM_MODULATE, GELU_TANH_CAT, GATE_RESIDUAL, GATE_RESIDUAL_LAYERNORM_MODULATE),
        applies=single_block_applies,
        high=False,
        high_ops=(LINEAR_GELU_TANH,),
        description="single-stream block (video first): adaLN-Zero-Single, attention copy + GELU into proj_out's "
                    "input in one kernel, gate residual (+ the next block's adaLN-Zero-Single; quality=high, or "
                    "DITFUSE_GEMM_GELU=1 losslessly: proj_mlp + GELU as one GEMM writing proj_out's input)",
        chained=True,
    ),
    attention_site(
        "hunyuanvideo.attention", attention_forward,
        (QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST, QK_RMSNORM_DIFFUSERS_ROPE_JOINT), _attn_applies,
        "attention (HunyuanVideoAttnProcessor2_0): dual blocks QK RMSNorm + the video stream's RoPE + the "
        "video-first concat in one pass; single blocks the joint QK RMSNorm + the video rows' RoPE + the re-concat "
        "in one pass",
    ),
    norm_out_site("hunyuanvideo", high=False),
)

ADAPTER = Adapter(
    family="hunyuanvideo",
    model_classes=("HunyuanVideoTransformer3DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
