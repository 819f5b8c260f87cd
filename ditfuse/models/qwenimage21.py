"""Qwen-Image 2.1 adapter: fast forwards for diffusers 0.42.1's ``QwenImage21Transformer2DModel``.

``QwenImage21TransformerBlock`` is a *single-stream* block on the joint text/image sequence whose
modulation is not its own: the model computes one ``modulation = Linear(SiLU(temb))`` per forward
and every block reads the same four chunks of it (``chunk(2)`` then each ``chunk(2)``): scale1,
gate1, scale2, gate2. Each chunk is selected per token (``_select_modulation_rows``: with
``causal_condition`` the target image's tokens take their sample's row, text and condition-image
tokens the extra t = 0 row, a ``torch.where`` to [B, L, D]). The block's chains
(notes/families.md §12)::

    n1 = LN1(x) * (1 + scale1)                   -> layernorm_modulate, shift-free
    a  = attention(n1)                           (site qwenimage21.attention below)
    x  = x + tanh(gate1) * a;
    n2 = LN2(x) * (1 + scale2)                   -> gate_residual_layernorm_modulate, shift-free
    f  = out(silu(gate_layer(n2)) * proj(n2))    -> swiglu on the two projections
    x  = x + tanh(gate2) * f                     -> gate_residual (or fused with the next
                                                    block's n1: models/handoff.py)

The selected, tanh'd chunks are the same for every block of one forward, so they are made once
per (modulation, mask) pair and shared (:class:`_SharedRows`), where eager makes them in every
block: per block four ``torch.where`` s, two ``1 + scale`` s and two ``tanh`` s over [B, L, D].
``tanh`` is applied to the [B + 1, D] rows before the selection: elementwise, so the selected
values are the bits eager's ``where``-then-``tanh`` gives. When every token is a target token
(the KV-cached decode steps, the pipeline's default after its first step) the rows stay [B, 1, D]
(one device sync per forward to learn it; the model's forward already syncs several times).

The attention (``QwenImage21Attention`` + ``QwenImage21AttnProcessor``, the default processor)
is the processor's code — the prefix KV cache (``extract`` / ``cached``), the per-segment
block-causal prefill — with its QK chain (diffusers ``RMSNorm`` per head on q and k, the cast to
v's dtype, the complex RoPE on the joint table) as one op, ``qk_rmsnorm_diffusers_rope_complex``
with a single stream (Qwen-Image's and Z-Image's op). The flex-attention processor (compiled
models) keeps diffusers' forward. ``norm_out`` (scale only) is the shift-free
``layernorm_modulate``. The text projection's zero-centred RMSNorm, the RoPE table and the
modulation GEMM stay diffusers' (once per forward). Every op is bit-exact and gated at first
sight; no quality="high" tier (no admission measured on Qwen-Image 2.1 activations).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import SWIGLU
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from ..kernels.rope import QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX
from .adaln import plain_layernorm
from .base import Adapter, Site, diffusers_rmsnorms, linear_module
from .handoff import NO_LINK, Link, Opening, close_block
from .per_forward import IdentityCache

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_qwenimage21"


# -- the shared, selected modulation rows --------------------------------------------------------


def _select(params: torch.Tensor, mask: torch.Tensor | None, all_target: bool) -> torch.Tensor:
    """diffusers' ``_select_modulation_rows(params, mask)``: [B, 1, D] without a mask, else each
    token's row — its sample's (``mask`` True) or the trailing t = 0 row — as [B, L, D]; when
    every token is a target token (``all_target``) the sample rows as [B, 1, D], the same values."""
    if mask is None:
        return params.unsqueeze(1)
    if all_target:
        return params[:-1].unsqueeze(1)
    real, zero = params[:-1].unsqueeze(1), params[-1:].unsqueeze(0)
    return torch.where(mask.view(1, -1, 1), real, zero)


def _all_target(mask: torch.Tensor | None) -> bool:
    """Whether every token of ``mask`` is a target token (no sync while a CUDA graph is captured
    or torch.compile traces: then the rows are selected per token, the same values)."""
    if mask is None or torch.compiler.is_compiling():
        return False
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return bool(mask.all())


def select_rows(modulation: torch.Tensor, mask: torch.Tensor | None, sync: bool = True) -> tuple[torch.Tensor, ...]:
    """(scale1, tanh(gate1), scale2, tanh(gate2)) of the shared ``modulation`` as the blocks
    read them, selected per token by ``mask`` (:func:`_select`). The scales are raw: the ops add
    the 1 (``r(1 + scale)``, as eager does after its selection). ``sync=False``: never read the
    mask on the host (rows per token even when every token is a target token)."""
    mod1, mod2 = modulation.chunk(2, dim=-1)
    scale1, gate1 = mod1.chunk(2, dim=-1)
    scale2, gate2 = mod2.chunk(2, dim=-1)
    every = sync and _all_target(mask)
    return (_select(scale1, mask, every), _select(gate1.tanh(), mask, every),
            _select(scale2, mask, every), _select(gate2.tanh(), mask, every))


class _SharedRows:
    """:func:`select_rows` made once per (modulation, mask) pair and handed to every block of the
    forward (models/per_forward.py: the very tensor objects at the same versions; an entry dies
    with its modulation tensor)."""

    def __init__(self) -> None:
        self._cache = IdentityCache()

    def get(self, modulation: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if modulation.is_inference() or (mask is not None and mask.is_inference()):
            # not shared (no version counter): made in every block, so without the host sync
            return select_rows(modulation, mask, sync=False)
        return self._cache.get((modulation, mask), (), lambda: select_rows(modulation, mask))

    def __len__(self) -> int:
        return len(self._cache)


SHARED_ROWS = _SharedRows()


# -- blocks -----------------------------------------------------------------------------------


def _opening(block, rows: tuple[torch.Tensor, ...]) -> Opening:
    """The block's ``img_norm1`` + shift-free modulate by scale1; tanh(gate1), scale2, tanh(gate2)
    ride along."""
    scale1, tgate1, scale2, tgate2 = rows
    return Opening(scale1, None, block.img_norm1.eps, (tgate1, scale2, tgate2))


def block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    modulation: torch.Tensor,
    rotary_emb: torch.Tensor | None = None,
    attention_mask: Any | None = None,
    target_token_mask: torch.Tensor | None = None,
    layer_cache: Any | None = None,
    kv_cache_mode: str | None = None,
    cache_write_slice: slice | None = None,
    segments: list[tuple[int, int, bool]] | None = None,
    key_valid: torch.Tensor | None = None,
    *,
    _ops: OpSet = LOSSLESS,
    _link: Link = NO_LINK,
) -> torch.Tensor:
    """QwenImage21TransformerBlock: shift-free LN + modulate, attention, tanh-gated residual +
    norm2 + modulate, SwiGLU, tanh-gated residual (with the next block's opening when it follows
    directly). The modulation rows come from :data:`SHARED_ROWS`."""
    rows = SHARED_ROWS.get(modulation, target_token_mask)
    keys = (hidden_states, modulation) + (() if target_token_mask is None else (target_token_mask,))
    opened = _link.take(block, keys, _ops)
    if opened is None:
        opened = _opening(block, rows).run(hidden_states, _ops)
    img_modulated, tgate1, scale2, tgate2 = opened
    attn_output = block.attn(
        hidden_states=img_modulated,
        attention_mask=attention_mask,
        rotary_emb=rotary_emb,
        layer_cache=layer_cache,
        kv_cache_mode=kv_cache_mode,
        cache_write_slice=cache_write_slice,
        segments=segments,
        key_valid=key_valid,
    )
    hidden_states, img_modulated2 = _ops.gate_residual_layernorm_modulate(
        hidden_states, tgate1, attn_output, scale2, None, block.img_norm2.eps
    )
    mlp = block.img_mlp
    ff = mlp.out(_ops.swiglu(mlp.gate_layer(img_modulated2), mlp.proj(img_modulated2)))
    nxt = _link.next_block() if hidden_states.dtype != torch.float16 else None  # fp16 clips after the residual
    hidden_states, nxt_opened = close_block(_ops, hidden_states, tgate2, ff,
                                            None if nxt is None else _opening(nxt, rows))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    keys = (hidden_states, modulation) + (() if target_token_mask is None else (target_token_mask,))
    _link.give(keys, nxt_opened, _ops)
    return hidden_states


def _block_applies(block) -> str | None:
    from diffusers.models.transformers.transformer_qwenimage21 import (
        QwenImage21Attention,
        QwenImage21SwiGLUFeedForward,
    )

    for name in ("img_norm1", "img_norm2"):
        r = plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    if not isinstance(block.attn, QwenImage21Attention):
        return f"attn is {type(block.attn).__name__}, not QwenImage21Attention"
    mlp = block.img_mlp
    if type(mlp) is not QwenImage21SwiGLUFeedForward:
        return f"img_mlp is {type(mlp).__name__}, not QwenImage21SwiGLUFeedForward"
    if type(mlp.activation_fn) is not torch.nn.SiLU:
        return f"img_mlp.activation_fn is {type(mlp.activation_fn).__name__}, not SiLU"
    for name in ("proj", "out", "gate_layer"):
        if linear_module(getattr(mlp, name, None)) is None:
            return f"img_mlp.{name} is not a Linear (or a LoRA-wrapped one)"
    return None


# -- attention --------------------------------------------------------------------------------

_ATTN_KWARGS = frozenset(("attention_mask", "rotary_emb", "layer_cache", "kv_cache_mode", "cache_write_slice",
                          "segments", "key_valid"))


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    if type(attn.processor) is not QwenImage21AttnProcessor:
        return (f"processor is {type(attn.processor).__name__}, not QwenImage21AttnProcessor "
                "(the flex-attention processor runs as diffusers wrote it)")
    return diffusers_rmsnorms(attn, ("norm_q", "norm_k"), attn.inner_dim // attn.heads)


def attention_forward(attn, original, hidden_states: torch.Tensor, *, _ops: OpSet = LOSSLESS, **kwargs: Any):
    """QwenImage21Attention + QwenImage21AttnProcessor with the QK chain (per-head diffusers
    RMSNorm, ``.to(v.dtype)``, complex RoPE) as one gated op; the KV-cache bookkeeping, the
    prefill's per-segment attention and the decode's full attention are the processor's code."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    processor = attn.processor
    if type(processor) is not QwenImage21AttnProcessor or not _ATTN_KWARGS.issuperset(kwargs):
        return original(hidden_states, **kwargs)
    attention_mask = kwargs.get("attention_mask")
    rotary_emb = kwargs.get("rotary_emb")
    layer_cache = kwargs.get("layer_cache")
    kv_cache_mode = kwargs.get("kv_cache_mode")
    cache_write_slice = kwargs.get("cache_write_slice")
    segments = kwargs.get("segments")
    key_valid = kwargs.get("key_valid")

    # _qwenimage21_prepare_qkv
    query = attn.to_q(hidden_states)
    key = attn.to_k(hidden_states)
    value = attn.to_v(hidden_states)
    head_dim = attn.inner_dim // attn.heads
    query = query.unflatten(-1, (-1, head_dim))
    key = key.unflatten(-1, (-1, head_dim))
    value = value.unflatten(-1, (-1, head_dim))
    if all(n.weight is None or n.weight.dtype == value.dtype for n in (attn.norm_q, attn.norm_k)):
        # RMSNorm's output is then in v's dtype: the processor's .to(value.dtype) is the identity
        query, key = _ops.qk_rmsnorm_diffusers_rope_complex(
            query, key, attn.norm_q.weight, attn.norm_k.weight, rotary_emb, attn.norm_q.eps)
    else:  # e.g. fp32 norm weights under a bf16 model: the cast is a rounding the op does not have
        from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

        query = attn.norm_q(query).to(value.dtype)
        key = attn.norm_k(key).to(value.dtype)
        if rotary_emb is not None:
            query = apply_rotary_emb_qwen(query, rotary_emb, use_real=False)
            key = apply_rotary_emb_qwen(key, rotary_emb, use_real=False)
    if layer_cache is not None:
        if kv_cache_mode == "extract" and cache_write_slice is not None:
            layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
        elif kv_cache_mode == "cached":
            cached_k, cached_v = layer_cache.get()
            key = torch.cat([cached_k, key], dim=1)
            value = torch.cat([cached_v, value], dim=1)
    seq_len_q = query.shape[1]

    # QwenImage21AttnProcessor.__call__ from here on
    if segments is None:
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0,
            backend=processor._attention_backend, parallel_config=processor._parallel_config,
        )
    else:
        prefix_len = segments[-1][1] if segments else 0
        outputs = []
        for start, end, is_text in segments:
            seg_mask = None
            if is_text:
                seg_len = end - start
                seg_mask = torch.cat(
                    [
                        torch.ones(seg_len, start, dtype=torch.bool, device=query.device),
                        torch.tril(torch.ones(seg_len, seg_len, dtype=torch.bool, device=query.device)),
                    ],
                    dim=1,
                )[None, None]
            if key_valid is not None:
                seg_key_valid = key_valid[:, None, None, :end]
                seg_mask = seg_key_valid if seg_mask is None else (seg_mask & seg_key_valid)
            outputs.append(dispatch_attention_fn(
                query[:, start:end], key[:, :end], value[:, :end], attn_mask=seg_mask, dropout_p=0.0,
                backend=None, parallel_config=processor._parallel_config,
            ))
        outputs.append(dispatch_attention_fn(
            query[:, prefix_len:], key, value,
            attn_mask=None if key_valid is None else key_valid[:, None, None, :], dropout_p=0.0,
            backend=None, parallel_config=processor._parallel_config,
        ))
        hidden_states = torch.cat(outputs, dim=1)
    hidden_states = hidden_states[:, :seq_len_q]
    hidden_states = hidden_states.flatten(2, 3).type_as(query)
    hidden_states = attn.to_out[0](hidden_states)
    return attn.to_out[1](hidden_states)


# -- norm_out ---------------------------------------------------------------------------------


def norm_out_forward(norm, original, hidden_states: torch.Tensor, conditioning_embedding: torch.Tensor,
                     target_token_mask: torch.Tensor | None = None, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """QwenImage21AdaLayerNormContinuous: ``scale = linear(silu(c).to(x.dtype))`` selected per
    token, ``out = r(r(LN(x)) * r(1 + scale))`` (no shift)."""
    scale = norm.linear(norm.silu(conditioning_embedding).to(hidden_states.dtype))
    scale = _select(scale, target_token_mask, False)
    return _ops.layernorm_modulate(hidden_states, scale, None, norm.norm.eps)


def _norm_out_applies(norm) -> str | None:
    if linear_module(norm.linear) is None:
        return "linear is not a Linear (or a LoRA-wrapped one)"
    return plain_layernorm(norm.norm)


SITES = (
    Site(
        name="qwenimage21.block",
        cls=f"{_TF}:QwenImage21TransformerBlock",
        params=("self", "hidden_states", "modulation", "rotary_emb", "attention_mask", "target_token_mask",
                "layer_cache", "kv_cache_mode", "cache_write_slice", "segments", "key_valid"),
        forward=block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, SWIGLU, GATE_RESIDUAL),
        applies=_block_applies,
        high=False,
        description="single-stream block: shift-free LN + modulate, tanh-gated residual + norm2 + modulate, "
                    "SwiGLU, tanh-gated residual (+ the next block's LN + modulate); the per-token modulation "
                    "rows selected once per forward",
        chained=True,
    ),
    Site(
        name="qwenimage21.attention",
        cls=f"{_TF}:QwenImage21Attention",
        params=("self", "hidden_states", "kwargs"),
        forward=attention_forward,
        ops=(QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX,),
        applies=_attn_applies,
        high=False,
        description="attention (QwenImage21AttnProcessor, prefix KV cache): QK RMSNorm + complex RoPE in one pass",
    ),
    Site(
        name="qwenimage21.norm_out",
        cls=f"{_TF}:QwenImage21AdaLayerNormContinuous",
        params=("self", "hidden_states", "conditioning_embedding", "target_token_mask"),
        forward=norm_out_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_norm_out_applies,
        high=False,
        description="norm_out (scale only): shift-free LN + modulate",
    ),
)

ADAPTER = Adapter(
    family="qwenimage21",
    model_classes=("QwenImage21Transformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
