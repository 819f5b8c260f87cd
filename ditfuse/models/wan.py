"""Wan 2.1 / 2.2 adapter: fast forwards for diffusers 0.42.1's WanTransformer3DModel.

Wan upcasts: every modulated LayerNorm is ``FP32LayerNorm`` on ``x.float()`` with fp32
modulation (``scale_shift_table + temb.float()``), every gated residual is computed in fp32 and
cast back with ``.type_as``; the QK norm is ``torch.nn.RMSNorm`` over all heads before the head
split; RoPE multiplies bf16 activations by the rotary table, fp32 when loaded with
``from_pretrained(torch_dtype=...)`` (``rope`` is in ``_keep_in_fp32_modules``) or bf16 after a
plain ``.to(bf16)``. The ops take those dtypes as data and derive eager's rounding points from
them, so one fast forward serves both load paths and every Wan config (2.1 T2V/I2V, 2.2 A14B
experts, 2.2 TI2V-5B with per-token modulation).

Per block: the modulation sum ``scale_shift_table + temb.float()`` (one pass, no fp32 copy of
temb); norm1 + modulate (one pass); self-attention with norm_q/norm_k + head split + RoPE in
one pass per tensor; the gated residual fused with norm2 (affine) when cross_attn_norm, else
alone; the cross-attention residual fused with norm3 + modulate; the FF gated residual. The model
forward's tail (norm_out + modulate) is fused too. Everything else is diffusers' own modules and
``dispatch_attention_fn`` with the attention backend chosen through diffusers.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.linear import LINEAR_GELU_TANH
from ..kernels.modulate import GATE_RESIDUAL, TABLE_ADD
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_ACROSS_HEADS_ROPE
from .adaln import table_plus_fp32
from .base import Adapter, Site, feed_forward
from .handoff import NO_LINK, Link, Opening, close_block

DIFFUSERS_VERSIONS = ("0.42.1",)
_TW = "diffusers.models.transformers.transformer_wan"
_F32 = torch.float32


def _fp32_layernorm(norm: torch.nn.Module, affine: bool) -> str | None:
    from diffusers.models.normalization import FP32LayerNorm

    if type(norm) is not FP32LayerNorm:
        return f"norm is {type(norm).__name__}, not FP32LayerNorm"
    if len(norm.normalized_shape) != 1:
        return "LayerNorm over more than the last dim"
    has = norm.weight is not None
    if has != affine or (norm.bias is not None) != affine:
        return f"FP32LayerNorm {'with' if has else 'without'} affine parameters (expected {'' if affine else 'no '}affine)"
    return None


# -- blocks -----------------------------------------------------------------------------------


Modulation = tuple[tuple[torch.Tensor, ...], "tuple[torch.Tensor, ...] | None"]


def _modulation(block, temb: torch.Tensor, _ops: OpSet) -> Modulation:
    """diffusers' six chunks of ``scale_shift_table + temb.float()`` as ``(chunks, rows)``.

    Per sample (Wan 2.1, 2.2 A14B: ``temb`` [B, 6, D]): the sum's [B, 1, D] views, ``rows`` None;
    the sum is ``modulate.table_add`` (adaln.table_plus_fp32), a few KB. Per token (2.2 TI2V:
    ``temb`` [B, S, 6, D], 1 GB of bf16 at 1280x704x121): ``chunks`` are temb's own [B, S, D]
    views and ``rows`` the table's six [D] rows. The ops that read a chunk then form ``row +
    chunk.float()`` in registers (their ``*_table`` arguments) -- the same single fp32 add, so the
    same bits -- and the fp32 sum (2 GB a block) is never written or read."""
    if temb.ndim == 4:
        return temb.unbind(2), block.scale_shift_table.reshape(6, -1).unbind(0)
    return table_plus_fp32(block.scale_shift_table, temb, _ops).chunk(6, dim=1), None


def _row(rows: tuple[torch.Tensor, ...] | None, i: int) -> tuple[torch.Tensor, ...]:
    """Chunk i's table row as a trailing op argument, or nothing (the chunk is the whole operand)."""
    return () if rows is None else (rows[i],)


def _opening(block, temb: torch.Tensor, _ops: OpSet, chunks=_modulation) -> Opening:
    """norm1 + modulate in fp32 on the block's modulation; the six chunks (and rows) ride along."""
    mod, rows = chunks(block, temb, _ops)
    return Opening(mod[1], mod[0], block.norm1.eps, ((mod, rows),), norm_dtype=_F32,
                   tables=None if rows is None else (rows[1], rows[0]))


def block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
    _attention_mask: torch.Tensor | None = None,
    _chunks=_modulation,
) -> torch.Tensor:
    """WanTransformerBlock with its five elementwise chains fused (module docstring). The FF
    gated residual also computes the next block's norm1 + modulate when it follows directly
    (:mod:`ditfuse.models.handoff`); this block takes its own from its predecessor likewise.

    For Wan's "Copied from" variants (models/wan_variants.py): ``_attention_mask`` is what the
    self-attention gets as its mask (Wan passes None), ``_chunks(block, temb, _ops)`` the six
    modulation chunks and their table rows (Wan's :func:`_modulation`)."""
    opened = _link.take(block, (hidden_states, temb), _ops)
    if opened is None:
        opened = _opening(block, temb, _ops, _chunks).run(hidden_states, _ops)
    norm_hidden_states, (mod, rows) = opened
    _shift_msa, _scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mod

    # 1. Self-attention
    attn_output = block.attn1(norm_hidden_states, None, _attention_mask, rotary_emb)
    if isinstance(block.norm2, torch.nn.Identity):
        # norm2(h.float()).type_as(h) is h itself: an fp32 round trip of bf16 values.
        hidden_states = _ops.gate_residual(hidden_states, gate_msa, attn_output, *_row(rows, 2))
        norm_hidden_states = hidden_states
    else:
        hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
            hidden_states, gate_msa, attn_output, None, None, block.norm2.eps,
            block.norm2.weight, block.norm2.bias, _F32, *_row(rows, 2),
        )

    # 2. Cross-attention
    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states, norm_hidden_states = _ops.gate_residual_layernorm_modulate(
        hidden_states, None, attn_output, c_scale_msa, c_shift_msa, block.norm3.eps, None, None, _F32,
        *(() if rows is None else (None, rows[4], rows[3])),
    )

    # 3. Feed-forward
    ff_output = feed_forward(block.ffn, norm_hidden_states, _ops)
    nxt = _link.next_block()
    hidden_states, opened_next = close_block(_ops, hidden_states, c_gate_msa, ff_output,
                                             None if nxt is None else _opening(nxt, temb, _ops, _chunks),
                                             *_row(rows, 5))
    _link.give((hidden_states, temb), opened_next, _ops)
    return hidden_states


def _block_applies(block) -> str | None:
    for name, affine in (("norm1", False), ("norm3", False)):
        r = _fp32_layernorm(getattr(block, name), affine)
        if r is not None:
            return f"{name}: {r}"
    if not isinstance(block.norm2, torch.nn.Identity):
        r = _fp32_layernorm(block.norm2, True)
        if r is not None:
            return f"norm2: {r}"
    return None


# -- attention --------------------------------------------------------------------------------


def attention_forward(
    attn,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _module: str = _TW,
    _processor: str = "WanAttnProcessor",
    **kwargs: Any,
) -> torch.Tensor:
    """WanAttention + WanAttnProcessor, self-attention: norm_q/norm_k over all heads, the head
    split and RoPE fused into one op that writes the [B, S, H, Dh] q/k attention consumes.

    ``_module`` / ``_processor``: the diffusers module whose ``_get_qkv_projections`` and
    processor class ``_processor`` this attention runs (a "Copied from" variant's own,
    models/wan_variants.py; the self-attention path of its processor is Wan's)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    mod = importlib.import_module(_module)
    processor = attn.processor
    if (kwargs or encoder_hidden_states is not None or rotary_emb is None
            or type(processor) is not getattr(mod, _processor)):
        return original(hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)

    query, key, value = mod._get_qkv_projections(attn, hidden_states, None)
    query, key = _ops.qk_rmsnorm_across_heads_rope(
        query, key, attn.norm_q.weight, attn.norm_k.weight, rotary_emb[0], rotary_emb[1], attn.heads, attn.norm_q.eps
    )
    value = value.unflatten(2, (attn.heads, -1))
    hidden_states = dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.type_as(query)
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    return hidden_states


def _attn_applies(attn, _module: str = _TW, _processor: str = "WanAttnProcessor") -> str | None:
    if attn.is_cross_attention or attn.add_k_proj is not None:
        return "cross-attention: its norms have no RoPE after them (nothing to fuse)"
    if type(attn.processor) is not getattr(importlib.import_module(_module), _processor):
        return f"processor is {type(attn.processor).__name__}, not {_module}.{_processor}"
    for name in ("norm_q", "norm_k"):
        n = getattr(attn, name)
        if type(n) is not torch.nn.RMSNorm:
            return f"{name} is {type(n).__name__}, not torch.nn.RMSNorm"
        if n.eps is None:
            return f"{name} has eps=None (the dtype's epsilon, not reproduced)"
    if attn.norm_q.eps != attn.norm_k.eps:
        return "norm_q and norm_k have different eps"
    return None


# -- the model forward (tail: norm_out + modulate) ------------------------------------------


def model_forward(
    model,
    original,
    hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    return_dict: bool = True,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _contiguous: bool = True,
):
    """WanTransformer3DModel.forward with the output norm + modulate fused. LoRA scales
    (``attention_kwargs``) and gradient checkpointing take diffusers' own forward.
    ``_contiguous=False``: the patch-embedded stream stays the transposed view (ChronoEdit's
    copy of this forward has no ``.contiguous()`` there; the ops keep eager's layout)."""
    if attention_kwargs or (torch.is_grad_enabled() and model.gradient_checkpointing):
        # by keyword: diffusers' @apply_lora_scale reads the LoRA scale from kwargs only, so a
        # positional attention_kwargs would silently drop it
        return original(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                        return_dict=return_dict, attention_kwargs=attention_kwargs)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    batch_size, num_channels, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = model.config.patch_size
    post_patch_num_frames = num_frames // p_t
    post_patch_height = height // p_h
    post_patch_width = width // p_w

    rotary_emb = model.rope(hidden_states)

    hidden_states = model.patch_embedding(hidden_states)
    hidden_states = hidden_states.flatten(2).transpose(1, 2)
    if _contiguous:
        hidden_states = hidden_states.contiguous()

    if timestep.ndim == 2:
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None

    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = model.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len
    )
    if ts_seq_len is not None:
        timestep_proj = timestep_proj.unflatten(2, (6, -1))
    else:
        timestep_proj = timestep_proj.unflatten(1, (6, -1))

    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    for block in model.blocks:
        hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

    if temb.ndim == 3:
        shift, scale = (model.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift = shift.squeeze(2)
        scale = scale.squeeze(2)
    else:
        shift, scale = (model.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift = shift.to(hidden_states.device)
    scale = scale.to(hidden_states.device)

    hidden_states = _ops.layernorm_modulate(hidden_states, scale, shift, model.norm_out.eps, norm_dtype=_F32)
    hidden_states = model.proj_out(hidden_states)

    hidden_states = hidden_states.reshape(
        batch_size, post_patch_num_frames, post_patch_height, post_patch_width, p_t, p_h, p_w, -1
    )
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _model_applies(model) -> str | None:
    return _fp32_layernorm(model.norm_out, False)


SITES = (
    Site(
        name="wan.model",
        cls=f"{_TW}:WanTransformer3DModel",
        params=("self", "hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image",
                "return_dict", "attention_kwargs"),
        forward=model_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_model_applies,
        description="model tail: norm_out (FP32LayerNorm) + modulate",
    ),
    Site(
        name="wan.block",
        cls=f"{_TW}:WanTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "rotary_emb"),
        forward=block_forward,
        ops=(TABLE_ADD, LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=_block_applies,
        description="block: the fp32 modulation sum in one pass, norm1 + modulate, gated residual + affine norm2, "
                    "residual + norm3 + modulate, "
                    "FF gated residual + the next block's norm1 + modulate (fp32 modulation, as diffusers upcasts; "
                    "quality=high: the FF's first projection + tanh-GELU as one GEMM)",
        chained=True,
        high_ops=(LINEAR_GELU_TANH,),
    ),
    Site(
        name="wan.attention",
        cls=f"{_TW}:WanAttention",
        params=("self", "hidden_states", "encoder_hidden_states", "attention_mask", "rotary_emb", "kwargs"),
        forward=attention_forward,
        ops=(QK_RMSNORM_ACROSS_HEADS_ROPE,),
        applies=_attn_applies,
        description="self-attention: QK RMSNorm over all heads + head split + RoPE in one pass",
    ),
)

ADAPTER = Adapter(
    family="wan",
    model_classes=("WanTransformer3DModel", "WanVACETransformer3DModel"),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
