"""FLUX.1 adapter: fast forwards for diffusers 0.42.1's FluxTransformer2DModel blocks.

Each fast forward is diffusers' forward, line for line, with the eager elementwise chains replaced
by calls into an op table (``_ops``: :data:`ditfuse.contracts.ops.LOSSLESS` — gated bit-exact
kernels — or ``HIGH`` — their close variants where admitted; the shared machinery in
:mod:`ditfuse.models.base` swaps the table, there is one fast forward per site). Every step that
is not fused stays diffusers' own module or function (Linear layers, FeedForward,
``dispatch_attention_fn`` with the attention backend chosen through diffusers). Where an instance
is configured differently from what a fast forward reproduces (IP-adapter processors, fp32
LayerNorm variants, unknown attention kwargs), that module keeps its own forward and the report
says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import GELU_TANH_CAT
from ..kernels.layout.joint_buffers_torch import cat_or_view, copy_bits
from ..kernels.linear import LINEAR_GELU_TANH
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_ROPE
from .adaln import (ada_zero, ada_zero_opening, dual_block_applies, norm_out_forward,  # noqa: F401 (re-exported)
                    norm_out_site, single_block_applies)
from .base import Adapter, Site, feed_forward, gemm_gelu_runs, linear_cat_applies, plain_linear, plain_module
from .handoff import NO_LINK, Link, Opening, close_block
from .pos_cache import embedder_site, transformer_scope

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_flux"


def single_attn_mlp_cat(attn_output: torch.Tensor, mlp: torch.Tensor, _ops: OpSet) -> torch.Tensor:
    """``cat([attn, gelu_tanh(mlp_pre)], dim=2)`` as one kernel writing the [B, S, D + mlp] buffer:
    the attention half copied, the MLP half through the GELU (round 6 wrote the GELU into the
    buffer and copied the attention half with a second kernel)."""
    if attn_output.dim() == 4:
        attn_output = attn_output.flatten(2, 3)
    return _ops.gelu_tanh_cat(attn_output, mlp)


def _single_mlp_gemm_gelu(block, _ops: OpSet) -> torch.nn.Linear | None:
    """The FLUX single block's ``proj_mlp`` when ``act_mlp(proj_mlp(n))`` may run as one
    GEMM-GELU written into proj_out's input (:func:`~ditfuse.models.base.gemm_gelu_runs`, plain
    modules, tanh-GELU)."""
    if not gemm_gelu_runs(_ops) or not plain_linear(block.proj_mlp) or not plain_module(block.act_mlp, torch.nn.GELU):
        return None
    if block.act_mlp.approximate != "tanh" or not plain_linear(block.proj_out):
        return None
    if block.proj_out.in_features <= block.proj_mlp.out_features:
        return None
    return block.proj_mlp


def single_block_mix(block, n: torch.Tensor, attention: Callable[[], tuple[torch.Tensor, ...]],
                     _ops: OpSet) -> torch.Tensor:
    """proj_out's input in a FLUX.1-style single block (FLUX.1, Chroma, HunyuanVideo):
    ``cat([cat(attention(), dim=1), act_mlp(proj_mlp(n))], dim=2)``, ``act_mlp`` the tanh GELU
    (the site's ``applies`` checked it), ``attention()`` the attention output as row pieces
    ([B, S_i, D] or [B, S_i, H, Dh]) covering n's rows in order.

    Default: ``proj_mlp`` as diffusers' Linear, then one kernel writes the buffer (GELU of the MLP
    half, copy of the attention half: ``activation.gelu_tanh_cat``). Where ``_ops`` runs the
    GEMM-GELU (the FLUX.1 site's quality="high" table: its close variant; ``DITFUSE_GEMM_GELU=1``:
    the exact one) with plain modules: ``proj_mlp`` + GELU as one GEMM writing the buffer's MLP
    columns (``_ops.linear_gelu_tanh``), the attention pieces copied into the rest. Copies are exact, so
    both are diffusers' bits wherever their ops are. ``proj_mlp`` runs before the attention, as in
    diffusers."""
    proj_mlp = _single_mlp_gemm_gelu(block, _ops)
    if proj_mlp is None:
        mlp = block.proj_mlp(n)
        pieces = attention()
        return single_attn_mlp_cat(pieces[0] if len(pieces) == 1 else cat_or_view(pieces, dim=1), mlp, _ops)
    B, S, _ = n.shape
    width = block.proj_out.in_features - proj_mlp.out_features
    buf = n.new_empty((B, S, block.proj_out.in_features))
    _ops.linear_gelu_tanh(n, proj_mlp.weight, proj_mlp.bias, buf[:, :, width:])
    row = 0
    for piece in attention():
        if piece.dim() == 4:
            piece = piece.flatten(2, 3)
        copy_bits(buf[:, row:row + piece.shape[1], :width], piece)
        row += piece.shape[1]
    if row != S:
        raise RuntimeError(f"single block: the attention returned {row} rows for {S} input rows")
    return buf


# -- AdaLayerNormZeroSingle (AdaLayerNormZero and AdaLayerNormContinuous: models/adaln.py) -------


def _ada_zero_single(norm, emb: torch.Tensor) -> Opening:
    emb = norm.linear(norm.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return Opening(scale_msa, shift_msa, norm.norm.eps, (gate_msa,))


# -- attention --------------------------------------------------------------------------------


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    if type(attn.processor) is not FluxAttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not FluxAttnProcessor"
    for name in ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if attn.added_kv_proj_dim is not None else ()):
        n = getattr(attn, name)
        if type(n) is not torch.nn.RMSNorm:
            return f"{name} is {type(n).__name__}, not torch.nn.RMSNorm"
    return None


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
    """FluxAttention + FluxAttnProcessor with QK RMSNorm, the text/image concat and RoPE fused into
    one gated op that writes the joint q/k attention consumes."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections

    processor = attn.processor
    if kwargs or type(processor) is not FluxAttnProcessor:
        # IP-adapter inputs or a swapped processor: diffusers' own path (incl. its kwarg checks).
        return original(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)

    joint = attn.added_kv_proj_dim is not None
    if (joint and encoder_hidden_states is not None and not attn.fused_projections
            and plain_linear(attn.to_v) and plain_linear(attn.add_v_proj)
            and linear_cat_applies(encoder_hidden_states, hidden_states, attn.to_v.out_features)):
        # _get_projections' six linears, the two value projections written straight into the
        # joint value (text rows first): the cat below without its copy
        query, key = attn.to_q(hidden_states), attn.to_k(hidden_states)
        encoder_query = attn.add_q_proj(encoder_hidden_states)
        encoder_key = attn.add_k_proj(encoder_hidden_states)
        value = _ops.linear_cat(encoder_hidden_states, attn.add_v_proj.weight, attn.add_v_proj.bias,
                                hidden_states, attn.to_v.weight, attn.to_v.bias)
        encoder_value = None
    else:
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
    query = query.unflatten(-1, (-1, attn.head_dim))
    key = key.unflatten(-1, (-1, attn.head_dim))
    value = value.unflatten(-1, (-1, attn.head_dim))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)

    if joint:
        encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
        encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
        query, key = _ops.qk_rmsnorm_rope(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
            encoder_query, encoder_key, attn.norm_added_q.weight, attn.norm_added_k.weight,
        )
        if encoder_value is not None:
            value = torch.cat([encoder_value.unflatten(-1, (-1, attn.head_dim)), value], dim=1)
    else:
        query, key = _ops.qk_rmsnorm_rope(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps
        )

    hidden_states = dispatch_attention_fn(
        query,
        key,
        value,
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
        hidden_states = attn.to_out[0](hidden_states.contiguous())
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states
    return hidden_states


# -- blocks -----------------------------------------------------------------------------------


def dual_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
):
    """FluxTransformerBlock: adaLN-Zero (fused LN+modulate), attention, then the fused
    gate-residual + norm2 + modulate, FeedForward, gated residual — for both streams. The FF
    gated residuals also compute the next dual block's adaLN-Zero norms when it follows directly
    (:mod:`ditfuse.models.handoff`); this block takes its own from its predecessor likewise."""
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb), _ops)
    if opened is None:
        opened = (ada_zero(block.norm1, hidden_states, temb, _ops),
                  ada_zero(block.norm1_context, encoder_hidden_states, temb, _ops))
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = opened[0]
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = opened[1]
    joint_attention_kwargs = joint_attention_kwargs or {}
    attention_outputs = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    if len(attention_outputs) == 2:
        attn_output, context_attn_output = attention_outputs
        ip_attn_output = None
    else:
        attn_output, context_attn_output, ip_attn_output = attention_outputs

    hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
        hidden_states, gate_msa, attn_output, scale_mlp, shift_mlp, block.norm2.eps
    )
    ff_output = feed_forward(block.ff, norm_hidden_states, _ops)
    # fp16 clips the text stream after its residual; an IP-adapter adds after the image one.
    nxt = _link.next_block() if ip_attn_output is None and hidden_states.dtype != torch.float16 else None
    hidden_states, img_next = close_block(_ops, hidden_states, gate_mlp, ff_output,
                                          None if nxt is None else ada_zero_opening(nxt.norm1, temb))
    if ip_attn_output is not None:
        hidden_states = hidden_states + ip_attn_output

    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    context_ff_output = feed_forward(block.ff_context, norm_encoder_hidden_states, _ops)
    encoder_hidden_states, txt_next = close_block(_ops, encoder_hidden_states, c_gate_mlp, context_ff_output,
                                                  None if nxt is None else ada_zero_opening(nxt.norm1_context, temb))
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    _link.give((hidden_states, encoder_hidden_states, temb), None if nxt is None else (img_next, txt_next), _ops)
    return encoder_hidden_states, hidden_states


def single_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
):
    """FluxSingleTransformerBlock. ``cat([attn, gelu(proj_mlp(n))], dim=2)`` is one kernel
    (lossless): the attention output is copied and the GELU written into proj_out's input
    (:func:`single_block_mix`; ``DITFUSE_GEMM_GELU=1``: the GEMM itself writes the GELU). The
    closing gated residual also computes the next single block's adaLN-Zero-Single norm when it
    follows directly (:mod:`ditfuse.models.handoff`)."""
    text_seq_len = encoder_hidden_states.shape[1]
    opened = _link.take(block, (hidden_states, encoder_hidden_states, temb), _ops)
    # The previous single block returned two views of one tensor: re-joining them needs no copy.
    hidden_states = cat_or_view((encoder_hidden_states, hidden_states), dim=1)
    residual = hidden_states
    if opened is None:
        opened = _ada_zero_single(block.norm, temb).run(hidden_states, _ops)
    norm_hidden_states, gate = opened
    joint_attention_kwargs = joint_attention_kwargs or {}

    def attention() -> tuple[torch.Tensor]:
        return (block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                           **joint_attention_kwargs),)

    cat = single_block_mix(block, norm_hidden_states, attention, _ops)
    nxt = _link.next_block() if residual.dtype != torch.float16 else None  # fp16 clips after the residual
    hidden_states, opened_next = close_block(_ops, residual, gate, block.proj_out(cat),
                                             None if nxt is None else _ada_zero_single(nxt.norm, temb))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    _link.give((hidden_states, encoder_hidden_states, temb), opened_next, _ops)
    return encoder_hidden_states, hidden_states


# -- the transformer: names the position ids' sources for the embedder's cache -----------------

_TRANSFORMER_PARAMS = (
    "self", "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids",
    "guidance", "joint_attention_kwargs", "controlnet_block_samples", "controlnet_single_block_samples",
    "return_dict", "controlnet_blocks_repeat",
)


def _transformer_applies(model) -> str | None:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    if type(getattr(model, "pos_embed", None)) is not FluxPosEmbed:
        return "pos_embed is not FluxPosEmbed"
    return None


def ids_scope_site(family: str, cls: str, params: tuple[str, ...]) -> Site:
    """The site on a FLUX.1-style transformer (``cls``, whose ``forward`` has ``params``) that runs
    diffusers' forward unchanged, with its ``txt_ids`` / ``img_ids`` named as the sources of the ids
    its FluxPosEmbed gets (``cat((txt_ids, img_ids))``), so the embedder's tables are reused across
    steps (models/pos_cache.py). FLUX.1 and Chroma."""
    img_at, txt_at = params.index("img_ids") - 1, params.index("txt_ids") - 1

    def transformer_forward(model, original, *args: Any, _ops: OpSet = LOSSLESS, **kwargs: Any):
        img_ids = args[img_at] if len(args) > img_at else kwargs.get("img_ids")
        txt_ids = args[txt_at] if len(args) > txt_at else kwargs.get("txt_ids")
        with transformer_scope(model.pos_embed, txt_ids, img_ids):
            return original(*args, **kwargs)

    return Site(
        name=f"{family}.transformer",
        cls=cls,
        params=params,
        forward=transformer_forward,
        ops=(),
        applies=_transformer_applies,
        high=False,
        description="the transformer's own forward, unchanged, with its txt_ids/img_ids named as the sources of "
                    "pos_embed's ids (for the table cache)",
    )


_BLOCK_PARAMS = ("self", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs")


def flux_attention_site(family: str, high: bool = True) -> Site:
    """The FluxAttention site (:func:`attention_forward`) for ``family``'s adapter (FLUX.1 and the
    models built on its attention, such as Chroma; ``high``: see :class:`Site`)."""
    return Site(
        name=f"{family}.attention",
        cls=f"{_TF}:FluxAttention",
        params=("self", "hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "kwargs"),
        forward=attention_forward,
        ops=(QK_RMSNORM_ROPE,),
        applies=_attn_applies,
        high=high,
        description="attention: QK RMSNorm + text/image concat + RoPE in one pass (DITFUSE_LINEAR_CAT=1: "
                    "the value projections written into the joint value, batch 1)",
    )


SITES = (
    Site(
        name="flux.dual_block",
        cls=f"{_TF}:FluxTransformerBlock",
        params=_BLOCK_PARAMS,
        forward=dual_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=dual_block_applies,
        description="dual block: adaLN-Zero, gate+residual+norm2+modulate, FF gate residual "
                    "(+ the next block's adaLN-Zero across the boundary; quality=high, or DITFUSE_GEMM_GELU=1 "
                    "losslessly: the FF's first projection + tanh-GELU as one GEMM)",
        chained=True,
        high_ops=(LINEAR_GELU_TANH,),
    ),
    Site(
        name="flux.single_block",
        cls=f"{_TF}:FluxSingleTransformerBlock",
        params=_BLOCK_PARAMS,
        forward=single_block_forward,
        ops=(LAYERNORM_MODULATE, GELU_TANH_CAT, GATE_RESIDUAL, GATE_RESIDUAL_LAYERNORM_MODULATE),
        applies=single_block_applies,
        description="single block: adaLN-Zero-Single, attention copy + GELU into proj_out's input in one kernel, "
                    "gate residual (+ the next block's adaLN-Zero-Single across the boundary; quality=high, or "
                    "DITFUSE_GEMM_GELU=1 losslessly: proj_mlp + GELU as one GEMM writing proj_out's input)",
        chained=True,
        high_ops=(LINEAR_GELU_TANH,),
    ),
    flux_attention_site("flux"),
    norm_out_site("flux"),
    ids_scope_site("flux", f"{_TF}:FluxTransformer2DModel", _TRANSFORMER_PARAMS),
    embedder_site("flux.pos_embed", f"{_TF}:FluxPosEmbed"),
)

ADAPTER = Adapter(
    family="flux",
    model_classes=("FluxTransformer2DModel", "FluxControlNetModel", "FluxMultiControlNetModel"),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
