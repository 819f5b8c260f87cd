"""FLUX.1 adapter: fast forwards for diffusers 0.42.1's FluxTransformer2DModel blocks.

Each fast forward is diffusers' forward, line for line, with the eager elementwise chains replaced
by gated bit-exact ops (:mod:`ditfuse.contracts.ops`); every step that is not fused stays
diffusers' own module or function (Linear layers, FeedForward, ``dispatch_attention_fn`` with the
attention backend chosen through diffusers). Where an instance is configured differently from
what a fast forward reproduces (IP-adapter processors, fp32 LayerNorm variants, unknown attention
kwargs), that module keeps its own forward and the report says why.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..contracts import ops
from ..kernels.layout.joint_buffers_torch import SingleBlockBuffer, cat_or_view
from .base import Adapter, SiteSpec

DIFFUSERS_VERSIONS = ("0.42.1",)


def _plain_layernorm(norm: torch.nn.Module) -> str | None:
    if type(norm) is not torch.nn.LayerNorm:
        return f"norm is {type(norm).__name__}, not torch.nn.LayerNorm"
    if norm.elementwise_affine or getattr(norm, "bias", None) is not None:
        return "LayerNorm has affine parameters (FLUX's are affine-free)"
    if len(norm.normalized_shape) != 1:
        return "LayerNorm over more than the last dim"
    return None


def _ada_zero_applies(norm: torch.nn.Module) -> str | None:
    if getattr(norm, "emb", None) is not None:
        return "AdaLayerNormZero with its own timestep embedding"
    return _plain_layernorm(norm.norm)


# -- the ops a fast forward calls ---------------------------------------------------------------


def _single_mlp_pre(block, norm_hidden_states: torch.Tensor) -> torch.Tensor:
    return block.proj_mlp(norm_hidden_states)


def _single_attn_mlp_cat(block, attn_output: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    """``cat([attn, gelu_tanh(mlp_pre)], dim=2)`` without the cat: the attention output is copied
    into, and the GELU written straight into, one preallocated [B, S, D + mlp] buffer."""
    buf = SingleBlockBuffer.allocate(
        attn_output.shape[0], attn_output.shape[1], attn_output.shape[-1], mlp.shape[-1],
        attn_output.dtype, attn_output.device,
    )
    buf.write_attention(attn_output)
    ops.gelu_tanh(mlp, out=buf.mlp)
    return buf.buf


@dataclass(frozen=True)
class FluxOps:
    """The op callables the fast forwards below call. :data:`LOSSLESS` holds the gated bit-exact
    ops; ditfuse.models.flux_high builds the quality="high" set by swapping in close kernels.

    ``single_mlp(block, n)`` computes the single block's MLP branch up to what
    ``single_attn_mlp_cat(block, attn, mlp)`` turns into ``cat([attn, gelu(proj_mlp(n))], dim=2)``.
    """

    layernorm_modulate: Callable[..., torch.Tensor]
    gate_residual_layernorm_modulate: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gate_residual: Callable[..., torch.Tensor]
    qk_rmsnorm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    single_mlp: Callable[..., torch.Tensor]
    single_attn_mlp_cat: Callable[..., torch.Tensor]


LOSSLESS = FluxOps(
    layernorm_modulate=ops.layernorm_modulate,
    gate_residual_layernorm_modulate=ops.gate_residual_layernorm_modulate,
    gate_residual=ops.gate_residual,
    qk_rmsnorm_rope=ops.qk_rmsnorm_rope,
    single_mlp=_single_mlp_pre,
    single_attn_mlp_cat=_single_attn_mlp_cat,
)


# -- AdaLayerNormZero / AdaLayerNormZeroSingle / AdaLayerNormContinuous --------------------------


def _ada_zero(norm, x: torch.Tensor, emb: torch.Tensor, _ops: FluxOps = LOSSLESS):
    emb = norm.linear(norm.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = _ops.layernorm_modulate(x, scale_msa, shift_msa, norm.norm.eps)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_zero_single(norm, x: torch.Tensor, emb: torch.Tensor, _ops: FluxOps = LOSSLESS):
    emb = norm.linear(norm.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return _ops.layernorm_modulate(x, scale_msa, shift_msa, norm.norm.eps), gate_msa


def norm_out_forward(
    norm, original, x: torch.Tensor, conditioning_embedding: torch.Tensor, *, _ops: FluxOps = LOSSLESS
) -> torch.Tensor:
    """AdaLayerNormContinuous: ``chunk(2)`` gives scale first, then shift."""
    emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return _ops.layernorm_modulate(x, scale, shift, norm.norm.eps)


def _norm_out_applies(norm) -> str | None:
    return _plain_layernorm(norm.norm)


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
    _ops: FluxOps = LOSSLESS,
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

    query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
        attn, hidden_states, encoder_hidden_states
    )
    query = query.unflatten(-1, (-1, attn.head_dim))
    key = key.unflatten(-1, (-1, attn.head_dim))
    value = value.unflatten(-1, (-1, attn.head_dim))
    cos, sin = image_rotary_emb if image_rotary_emb is not None else (None, None)

    joint = attn.added_kv_proj_dim is not None
    if joint:
        encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
        encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
        encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
        query, key = _ops.qk_rmsnorm_rope(
            query, key, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
            encoder_query, encoder_key, attn.norm_added_q.weight, attn.norm_added_k.weight,
        )
        value = torch.cat([encoder_value, value], dim=1)
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
    _ops: FluxOps = LOSSLESS,
):
    """FluxTransformerBlock: adaLN-Zero (fused LN+modulate), attention, then the fused
    gate-residual + norm2 + modulate, FeedForward, gated residual — for both streams."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = _ada_zero(block.norm1, hidden_states, temb, _ops)
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _ada_zero(
        block.norm1_context, encoder_hidden_states, temb, _ops
    )
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
    ff_output = block.ff(norm_hidden_states)
    hidden_states = _ops.gate_residual(hidden_states, gate_mlp, ff_output)
    if ip_attn_output is not None:
        hidden_states = hidden_states + ip_attn_output

    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    context_ff_output = block.ff_context(norm_encoder_hidden_states)
    encoder_hidden_states = _ops.gate_residual(encoder_hidden_states, c_gate_mlp, context_ff_output)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _dual_applies(block) -> str | None:
    for name in ("norm1", "norm1_context"):
        r = _ada_zero_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    for name in ("norm2", "norm2_context"):
        r = _plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


def single_block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    *,
    _ops: FluxOps = LOSSLESS,
):
    """FluxSingleTransformerBlock. ``cat([attn, gelu(proj_mlp(n))], dim=2)`` disappears (lossless):
    the attention output and the GELU are written into one preallocated [B, S, D + mlp] buffer."""
    text_seq_len = encoder_hidden_states.shape[1]
    # The previous single block returned two views of one tensor: re-joining them needs no copy.
    hidden_states = cat_or_view((encoder_hidden_states, hidden_states), dim=1)
    residual = hidden_states
    norm_hidden_states, gate = _ada_zero_single(block.norm, hidden_states, temb, _ops)
    mlp = _ops.single_mlp(block, norm_hidden_states)
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = block.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    cat = _ops.single_attn_mlp_cat(block, attn_output, mlp)
    hidden_states = _ops.gate_residual(residual, gate, block.proj_out(cat))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


def _single_applies(block) -> str | None:
    r = _plain_layernorm(block.norm.norm)
    if r is not None:
        return f"norm: {r}"
    act = block.act_mlp
    if type(act) is not torch.nn.GELU or act.approximate != "tanh":
        return "act_mlp is not nn.GELU(approximate='tanh')"
    return None


# The signatures of the forwards we replace must not have changed under us.
def _signature_problem() -> str | None:
    from diffusers.models.transformers import transformer_flux as tf

    want = {
        tf.FluxTransformerBlock: ["self", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs"],
        tf.FluxSingleTransformerBlock: ["self", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "joint_attention_kwargs"],
        tf.FluxAttention: ["self", "hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "kwargs"],
    }
    for cls, params in want.items():
        got = list(inspect.signature(cls.forward).parameters)
        if got != params:
            return f"{cls.__name__}.forward has parameters {got}, expected {params}"
    return None


SITES = (
    SiteSpec(
        name="flux.dual_block",
        cls_name="FluxTransformerBlock",
        ops=("norm.layernorm_modulate", "norm.gate_residual_layernorm_modulate", "modulate.gate_residual"),
        fast_forward=dual_block_forward,
        applies=_dual_applies,
        description="dual block: adaLN-Zero, gate+residual+norm2+modulate, FF gate residual",
    ),
    SiteSpec(
        name="flux.single_block",
        cls_name="FluxSingleTransformerBlock",
        ops=("norm.layernorm_modulate", "activation.gelu_tanh", "modulate.gate_residual"),
        fast_forward=single_block_forward,
        applies=_single_applies,
        description="single block: adaLN-Zero-Single, GELU into the joint buffer (no cat), gate residual",
    ),
    SiteSpec(
        name="flux.attention",
        cls_name="FluxAttention",
        ops=("rope.qk_rmsnorm_rope",),
        fast_forward=attention_forward,
        applies=_attn_applies,
        description="attention: QK RMSNorm + text/image concat + RoPE in one pass",
    ),
    SiteSpec(
        name="flux.norm_out",
        cls_name="AdaLayerNormContinuous",
        ops=("norm.layernorm_modulate",),
        fast_forward=norm_out_forward,
        applies=_norm_out_applies,
        description="norm_out (AdaLayerNormContinuous, scale first)",
    ),
)


def _mark_high_sites(model: torch.nn.Module) -> Any:
    from .flux_high import mark_high_sites  # flux_high imports this module: import at call time

    return mark_high_sites(model)


class FluxAdapter(Adapter):
    def version_problem(self) -> str | None:
        return super().version_problem() or _signature_problem()


ADAPTER = FluxAdapter(
    family="flux",
    model_classes=("FluxTransformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
    mark_high_sites=_mark_high_sites,
)
