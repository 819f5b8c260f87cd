"""FLUX.2 adapter: fast forwards for diffusers 0.42.1's Flux2Transformer2DModel blocks.

Each fast forward is diffusers' forward, line for line, with the eager elementwise chains replaced
by ``_ops`` calls (see :mod:`ditfuse.models.flux`, the same pattern; notes/families.md §4 has the
chain-by-chain reading of this model):

- double block (Flux2TransformerBlock): ``(1 + scale) * LN(x) + shift`` -> ``layernorm_modulate``
  (the product commutes bitwise), the gated residual + norm2 + modulate ->
  ``gate_residual_layernorm_modulate``, the FF's gated residual -> ``gate_residual``. The
  modulation tensors are the [B, 1, D] (or per-token [B, S, D]) chunks ``Flux2Modulation.split``
  makes of the once-per-forward modulation output.
- Flux2FeedForward: ``Flux2SwiGLU`` -> ``swiglu`` on the two column halves of ``linear_in``.
- Flux2Attention: the four QK ``torch.nn.RMSNorm`` s, the text-first concat and the interleaved
  fp32 RoPE -> ``qk_rmsnorm_rope`` (FLUX.1's op: the same chain).
- Flux2ParallelSelfAttention (single blocks): QK RMSNorm + RoPE on the strided q/k column views of
  the fused ``to_qkv_mlp_proj`` output (eager makes them contiguous first) -> ``qk_rmsnorm_rope``;
  ``cat([attn, swiglu(mlp)], -1)`` -> ``swiglu_cat``, one kernel (the attention half copied bit
  for bit, the SwiGLU computed into the other).
- single block (Flux2SingleTransformerBlock): LN + modulate, the gated residual.
- norm_out (AdaLayerNormContinuous): as FLUX.1's.

Everything else stays diffusers' own (Linear layers, ``dispatch_attention_fn`` with the backend
chosen through diffusers). No quality="high" tier yet (every site ``high=False``): the close
kernels' admission records were measured on FLUX.1 and Wan activations, not FLUX.2's. The
KV-cache processors (reference-image editing) and any extra
attention kwargs run diffusers' own forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import SWIGLU, SWIGLU_CAT
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_ROPE
from .adaln import norm_out_site, plain_layernorm
from .pos_cache import embedder_site
from .base import Adapter, Site
from .handoff import NO_LINK, Link, Opening, close_block

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_flux2"


def _tf():
    from diffusers.models.transformers import transformer_flux2

    return transformer_flux2


# -- blocks -----------------------------------------------------------------------------------


def double_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb_mod_img: torch.Tensor,
    temb_mod_txt: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
):
    """Flux2TransformerBlock: fused LN + modulate for both streams, attention, then per stream the
    fused gate-residual + norm2 + modulate, the FF and its gated residual. The modulation is the
    model's, shared by every double block: the FF gated residuals also compute the next double
    block's LN + modulate when it follows directly (:mod:`ditfuse.models.handoff`)."""
    joint_attention_kwargs = joint_attention_kwargs or {}
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt), _ops)
    if opened is None:
        img, txt = _double_openings(block, temb_mod_img, temb_mod_txt)
        opened = (img.run(hidden_states, _ops), txt.run(encoder_hidden_states, _ops))
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = opened[0]
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = opened[1]
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )

    hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
        hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp, block.norm2.eps
    )
    # fp16 clips the text stream after its residual.
    nxt = _link.next_block() if encoder_hidden_states.dtype != torch.float16 else None
    nxt_img, nxt_txt = (None, None) if nxt is None else _double_openings(nxt, temb_mod_img, temb_mod_txt)
    hidden_states, img_next = close_block(_ops, hidden_states, gate_mlp, block.ff(norm_hidden_states), nxt_img)

    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    encoder_hidden_states, txt_next = close_block(
        _ops, encoder_hidden_states, c_gate_mlp, block.ff_context(norm_encoder_hidden_states), nxt_txt
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    _link.give((hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt),
               None if nxt is None else (img_next, txt_next), _ops)
    return encoder_hidden_states, hidden_states


def _double_openings(block, temb_mod_img: torch.Tensor, temb_mod_txt: torch.Tensor) -> tuple[Opening, Opening]:
    """``Flux2Modulation.split(mod, 2)`` = (shift, scale, gate) of msa, then of mlp, per stream;
    the openings are norm1 / norm1_context + the msa modulation, the other four chunks ride along."""
    split = _tf().Flux2Modulation.split
    out = []
    for mod, norm in ((temb_mod_img, block.norm1), (temb_mod_txt, block.norm1_context)):
        (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = split(mod, 2)
        out.append(Opening(scale_msa, shift_msa, norm.eps, (gate_msa, shift_mlp, scale_mlp, gate_mlp)))
    return out[0], out[1]


def _double_applies(block) -> str | None:
    for name in ("norm1", "norm1_context", "norm2", "norm2_context"):
        r = plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


def single_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    temb_mod: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    split_hidden_states: bool = False,
    text_seq_len: int | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
):
    """Flux2SingleTransformerBlock: fused LN + modulate, the parallel attention+MLP, fused gated
    residual (+ the next single block's LN + modulate when it follows directly and the stream stays
    joint, :mod:`ditfuse.models.handoff`)."""
    opened = _link.take(block, (hidden_states, temb_mod), _ops)
    if encoder_hidden_states is not None:
        opened = None  # the payload was for the joint stream, this call joins a new one
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    if opened is None:
        opened = _single_opening(block, temb_mod).run(hidden_states, _ops)
    norm_hidden_states, mod_gate = opened
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = block.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    nxt = _link.next_block() if hidden_states.dtype != torch.float16 and not split_hidden_states else None
    hidden_states, opened_next = close_block(_ops, hidden_states, mod_gate, attn_output,
                                             None if nxt is None else _single_opening(nxt, temb_mod))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    _link.give((hidden_states, temb_mod), opened_next, _ops)
    return hidden_states


def _single_opening(block, temb_mod: torch.Tensor) -> Opening:
    mod_shift, mod_scale, mod_gate = _tf().Flux2Modulation.split(temb_mod, 1)[0]
    return Opening(mod_scale, mod_shift, block.norm.eps, (mod_gate,))


def _single_applies(block) -> str | None:
    r = plain_layernorm(block.norm)
    return None if r is None else f"norm: {r}"


# -- feed-forward -----------------------------------------------------------------------------


def feed_forward_forward(ff, original, x: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """Flux2FeedForward: ``linear_out(swiglu(linear_in(x)))``, the SwiGLU over the two column
    halves of ``linear_in``'s output (gate first) in one pass."""
    x = ff.linear_in(x)
    half = x.shape[-1] // 2
    x = _ops.swiglu(x[..., :half], x[..., half:])
    return ff.linear_out(x)


def swiglu_reason(act, cls: type | None = None) -> str | None:
    """None when ``act`` is a ``Flux2SwiGLU`` (or ``cls``, a copy of it such as FLUX.3's) with its
    ``nn.SiLU`` gate, the chain :func:`feed_forward_forward` replaces; else why not."""
    cls = cls or _tf().Flux2SwiGLU
    if type(act) is not cls:
        return f"activation is {type(act).__name__}, not {cls.__name__}"
    if type(act.gate_fn) is not torch.nn.SiLU:
        return f"{cls.__name__}.gate_fn is {type(act.gate_fn).__name__}, not nn.SiLU"
    return None


def _ff_applies(ff) -> str | None:
    return swiglu_reason(ff.act_fn)


def feed_forward_site(family: str, cls: str, applies) -> Site:
    """The SwiGLU feed-forward site (:func:`feed_forward_forward`) for ``family``'s copy ``cls`` of
    Flux2FeedForward (``applies``: its activation check)."""
    return Site(
        name=f"{family}.feed_forward",
        cls=cls,
        params=("self", "x"),
        forward=feed_forward_forward,
        ops=(SWIGLU,),
        applies=applies,
        high=False,
        description="feed-forward: SwiGLU of the two halves of linear_in in one pass",
    )


# -- attention --------------------------------------------------------------------------------


def rms_norms_reason(attn, names: tuple[str, ...]) -> str | None:
    """The QK norms are torch.nn.RMSNorm over the head dim with one eps (the op takes one)."""
    eps = set()
    for name in names:
        n = getattr(attn, name)
        if type(n) is not torch.nn.RMSNorm:
            return f"{name} is {type(n).__name__}, not torch.nn.RMSNorm"
        if n.eps is None:
            return f"{name} has eps=None (torch's dtype-dependent default)"
        if tuple(n.normalized_shape) != (attn.head_dim,):
            return f"{name} normalises {tuple(n.normalized_shape)}, not the head dim"
        eps.add(n.eps)
    if len(eps) > 1:
        return f"the QK norms have different eps {sorted(eps)}"
    return None


def _attn_applies(attn) -> str | None:
    if type(attn.processor) is not _tf().Flux2AttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not Flux2AttnProcessor"
    names = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.added_kv_proj_dim is not None else ())
    return rms_norms_reason(attn, names)


def attention_forward(
    attn,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    **kwargs: Any,
):
    """Flux2Attention + Flux2AttnProcessor with the QK RMSNorms, the text-first concat and RoPE in
    one gated op writing the joint q/k."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    tf = _tf()
    processor = attn.processor
    if kwargs or type(processor) is not tf.Flux2AttnProcessor:
        return original(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)

    query, key, value, encoder_query, encoder_key, encoder_value = tf._get_qkv_projections(
        attn, hidden_states, encoder_hidden_states
    )
    query = query.unflatten(-1, (-1, attn.head_dim))
    key = key.unflatten(-1, (-1, attn.head_dim))
    value = value.unflatten(-1, (-1, attn.head_dim))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
    if attn.added_kv_proj_dim is not None:
        encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
        encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
        encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
        query, key = _ops.qk_rmsnorm_rope(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
            encoder_query, encoder_key, attn.norm_added_q.weight, attn.norm_added_k.weight,
        )
        value = torch.cat([encoder_value, value], dim=1)
    else:
        query, key = _ops.qk_rmsnorm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps)

    hidden_states = dispatch_attention_fn(
        query, key, value,
        attn_mask=attention_mask,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(query.dtype)

    if encoder_hidden_states is not None:
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
        )
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if encoder_hidden_states is not None:
        return hidden_states, encoder_hidden_states
    return hidden_states


def _parallel_applies(attn) -> str | None:
    if type(attn.processor) is not _tf().Flux2ParallelSelfAttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not Flux2ParallelSelfAttnProcessor"
    if attn.mlp_mult_factor != 2:
        return f"mlp_mult_factor is {attn.mlp_mult_factor}, not 2 (SwiGLU halves)"
    return rms_norms_reason(attn, ("norm_q", "norm_k")) or swiglu_reason(attn.mlp_act_fn)


def parallel_attention_forward(
    attn,
    original,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    **kwargs: Any,
) -> torch.Tensor:
    """Flux2ParallelSelfAttention + Flux2ParallelSelfAttnProcessor: QK RMSNorm + RoPE on the
    strided q/k views in one op; ``cat([attn, swiglu(mlp)], -1)`` by one kernel (the attention
    half copied, the SwiGLU computed into the other)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    processor = attn.processor
    if kwargs or type(processor) is not _tf().Flux2ParallelSelfAttnProcessor:
        return original(hidden_states, attention_mask, image_rotary_emb, **kwargs)

    hidden_states = attn.to_qkv_mlp_proj(hidden_states)
    qkv_dim = 3 * attn.inner_dim
    mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
    local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
    qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
    query, key, value = qkv.chunk(3, dim=-1)
    query = query.unflatten(-1, (-1, attn.head_dim))
    key = key.unflatten(-1, (-1, attn.head_dim))
    value = value.unflatten(-1, (-1, attn.head_dim))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)
    query, key = _ops.qk_rmsnorm_rope(query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps)

    attn_output = dispatch_attention_fn(
        query, key, value,
        attn_mask=attention_mask,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    attn_output = attn_output.flatten(2, 3)
    attn_output = attn_output.to(query.dtype)

    half = mlp_hidden_states.shape[-1] // 2
    return attn.to_out(_ops.swiglu_cat(attn_output, mlp_hidden_states[..., :half], mlp_hidden_states[..., half:]))


# -- the table --------------------------------------------------------------------------------

_ATTN_PARAMS = ("self", "hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "kwargs")

SITES = (
    Site(
        name="flux2.double_block",
        cls=f"{_TF}:Flux2TransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb_mod_img", "temb_mod_txt",
                "image_rotary_emb", "joint_attention_kwargs"),
        forward=double_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=_double_applies,
        high=False,
        description="double block: LN + modulate, gate+residual+norm2+modulate, FF gate residual "
                    "(+ the next block's LN + modulate)",
        chained=True,
    ),
    Site(
        name="flux2.single_block",
        cls=f"{_TF}:Flux2SingleTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb_mod", "image_rotary_emb",
                "joint_attention_kwargs", "split_hidden_states", "text_seq_len"),
        forward=single_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL, GATE_RESIDUAL_LAYERNORM_MODULATE),
        applies=_single_applies,
        high=False,
        description="single block: LN + modulate, gate residual (+ the next block's LN + modulate)",
        chained=True,
    ),
    feed_forward_site("flux2", f"{_TF}:Flux2FeedForward", _ff_applies),
    Site(
        name="flux2.attention",
        cls=f"{_TF}:Flux2Attention",
        params=_ATTN_PARAMS,
        forward=attention_forward,
        ops=(QK_RMSNORM_ROPE,),
        applies=_attn_applies,
        high=False,
        description="double-block attention: QK RMSNorm + text/image concat + RoPE in one pass",
    ),
    Site(
        name="flux2.parallel_attention",
        cls=f"{_TF}:Flux2ParallelSelfAttention",
        params=("self", "hidden_states", "attention_mask", "image_rotary_emb", "kwargs"),
        forward=parallel_attention_forward,
        ops=(QK_RMSNORM_ROPE, SWIGLU_CAT),
        applies=_parallel_applies,
        high=False,
        description="single-block attention + MLP: QK RMSNorm + RoPE on the fused projection's views, "
                    "SwiGLU into the to_out buffer (no cat)",
    ),
    norm_out_site("flux2", high=False),
    embedder_site("flux2.pos_embed", f"{_TF}:Flux2PosEmbed"),
)

ADAPTER = Adapter(
    family="flux2",
    model_classes=("Flux2Transformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
