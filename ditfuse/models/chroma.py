"""Chroma adapter: fast forwards for diffusers 0.42.1's ChromaTransformer2DModel blocks.

Chroma is FLUX.1-schnell's architecture with the per-block modulation Linear pruned: one
approximator computes every block's modulation up front (``pooled_temb``), and each block gets its
slice (``temb``: [B, 12, D] for a dual block, image then text; [B, 3, D] for a single block;
[B, 2, D] for norm_out). Its blocks therefore run FLUX.1's chains on those slices, and its attention
is FLUX.1's own ``FluxAttention`` + ``FluxAttnProcessor`` (the same site as FLUX.1's), with the
text-padding attention mask Chroma passes::

    dual block   (1 + scale_msa) * LN(x) + shift_msa        -> layernorm_modulate (per stream)
                 x + gate_msa * attn, then LN + modulate    -> gate_residual_layernorm_modulate
                 x + gate_mlp * ff                           -> gate_residual
    single block (1 + scale) * LN(x) + shift                 -> layernorm_modulate
                 cat([attn, gelu_tanh(proj_mlp(n))], dim=2)  -> gelu_tanh_cat (one kernel)
                 x + gate * proj_out(cat)                    -> gate_residual
    norm_out     LN(x) * (1 + scale) + shift (shift first)   -> layernorm_modulate

Each block builds the same [B, 1, S, S] joint attention mask from the one padding-mask tensor
the model hands every block; the fast forwards build it once per mask tensor (models/per_forward.py:
the same tensor object at the same version gives the same product) and share it.

The timestep embedder (ChromaCombinedTimestepTextProjEmbeddings) projects a constant
``torch.tensor([0] * B)`` on the CPU and copies it to the GPU on every forward: a host sync per step
and a copy CUDA graph capture refuses. Its site keeps those rows on the device per (B, dtype,
device); no kernel, the same ops on the same values.

Every op is one FLUX.1 runs; every site is bit-exact and gated at first sight. Not done: the
cross-block handoff (each block has its own modulation slice; the FLUX.1 handoff would need the
next block's slice from the model's forward), a quality="high" tier (no admission on Chroma
activations: every site ``high=False``), and every GPU run (round 17: CPU-tested only).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.activation import GELU_TANH_CAT
from ..kernels.linear import LINEAR_GELU_TANH
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE
from .adaln import dual_block_applies, plain_layernorm, single_block_applies
from .base import Adapter, Site, feed_forward
from .flux import flux_attention_site, ids_scope_site, single_block_mix
from .handoff import Opening
from .per_forward import IdentityCache
from .pos_cache import embedder_site

DIFFUSERS_VERSIONS = ("0.42.1",)
_TF = "diffusers.models.transformers.transformer_chroma"
_FLUX = "diffusers.models.transformers.transformer_flux"


def _pruned_opening(norm, emb: torch.Tensor) -> Opening:
    """ChromaAdaLayerNormZeroPruned: ``emb.flatten(1, 2).chunk(6, dim=1)`` = shift, scale, gate
    (msa), shift, scale, gate (mlp); the norm is ``r(r(r(LN(x)) * r(1 + scale_msa)) + shift_msa)``,
    the other four chunks ride along."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.flatten(1, 2).chunk(6, dim=1)
    return Opening(scale_msa, shift_msa, norm.norm.eps, (gate_msa, shift_mlp, scale_mlp, gate_mlp))


def joint_mask_value(attention_mask: torch.Tensor) -> torch.Tensor:
    """The blocks' ``mask[:, None, None, :] * mask[:, None, :, None]`` ([B, 1, S, S])."""
    return attention_mask[:, None, None, :] * attention_mask[:, None, :, None]


# Every block of a forward gets the same attention-mask tensor and builds the same [B, 1, S, S]
# product from it (57 products of S² elements per Chroma1-HD step). Made once and shared while
# the mask is the same tensor object at the same version (models/per_forward.py).
_MASKS = IdentityCache()


def _joint_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    return _MASKS.get((attention_mask,), (), lambda: joint_mask_value(attention_mask))


def dual_block_forward(block, original, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None,
                       joint_attention_kwargs: dict[str, Any] | None = None, *,
                       _ops: OpSet = LOSSLESS) -> tuple[torch.Tensor, torch.Tensor]:
    """ChromaTransformerBlock: both streams' pruned adaLN-Zero (fused LN + modulate), attention,
    the fused gate-residual + norm2 + modulate, FeedForward, the gated residual."""
    img = _pruned_opening(block.norm1, temb[:, :6]).run(hidden_states, _ops)
    txt = _pruned_opening(block.norm1_context, temb[:, 6:]).run(encoder_hidden_states, _ops)
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = img
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = txt
    joint_attention_kwargs = joint_attention_kwargs or {}
    attention_outputs = block.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        attention_mask=_joint_mask(attention_mask),
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
    hidden_states = _ops.gate_residual(hidden_states, gate_mlp, feed_forward(block.ff, norm_hidden_states, _ops))
    if ip_attn_output is not None:
        hidden_states = hidden_states + ip_attn_output

    encoder_hidden_states, norm_encoder_hidden_states = _ops.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_scale_mlp, c_shift_mlp, block.norm2_context.eps
    )
    encoder_hidden_states = _ops.gate_residual(encoder_hidden_states, c_gate_mlp,
                                               feed_forward(block.ff_context, norm_encoder_hidden_states, _ops))
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def single_block_forward(block, original, hidden_states: torch.Tensor, temb: torch.Tensor,
                         image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                         attention_mask: torch.Tensor | None = None,
                         joint_attention_kwargs: dict[str, Any] | None = None, *,
                         _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """ChromaSingleTransformerBlock: fused LN + modulate, attention, ``cat([attn, gelu(mlp)])`` in
    one kernel (``DITFUSE_GEMM_GELU=1``: the GEMM writes the GELU; flux.single_block_mix), the
    gated residual."""
    residual = hidden_states
    shift_msa, scale_msa, gate = temb.flatten(1, 2).chunk(3, dim=1)
    norm_hidden_states = _ops.layernorm_modulate(hidden_states, scale_msa, shift_msa, block.norm.norm.eps)
    joint_attention_kwargs = joint_attention_kwargs or {}

    def attention() -> tuple[torch.Tensor]:
        return (block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                           attention_mask=_joint_mask(attention_mask), **joint_attention_kwargs),)

    hidden_states = _ops.gate_residual(residual, gate, block.proj_out(single_block_mix(block, norm_hidden_states,
                                                                                        attention, _ops)))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


def norm_out_forward(norm, original, x: torch.Tensor, emb: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """ChromaAdaLayerNormContinuousPruned: ``chunk(emb.flatten(1, 2).to(x.dtype), 2)`` = shift,
    scale (shift first); ``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``."""
    shift, scale = torch.chunk(emb.flatten(1, 2).to(x.dtype), 2, dim=1)
    return _ops.layernorm_modulate(x, scale, shift, norm.norm.eps)


def _norm_out_applies(norm) -> str | None:
    return plain_layernorm(norm.norm)


_GUIDANCE_ATTR = "_ditfuse_guidance_rows"


def _guidance_rows(embed, batch_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """``guidance_proj(torch.tensor([0] * B)).to(dtype, device)`` made once per (B, dtype, device)
    and the projection's settings: diffusers builds that CPU tensor, projects it on the CPU and
    copies it to the GPU on every forward, a blocking copy from pageable memory (a host sync per
    step) that also makes CUDA graph capture fail. The value is a deterministic function of the
    key, so a kept copy is the same bits. None (compute as diffusers does) while torch.compile
    traces and on a miss during CUDA graph capture (the copy is what capture cannot hold)."""
    if torch.compiler.is_compiling():
        return None
    p = embed.guidance_proj
    key = (batch_size, dtype, str(device), p.num_channels, p.flip_sin_to_cos, p.downscale_freq_shift, p.scale)
    rows = embed.__dict__.setdefault(_GUIDANCE_ATTR, {})
    hit = rows.get(key)
    if hit is not None or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return hit
    value = p(torch.tensor([0] * batch_size)).to(dtype=dtype, device=device)
    rows[key] = value
    return value


def timestep_embed_forward(embed, original, timestep: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """ChromaCombinedTimestepTextProjEmbeddings, with the constant guidance rows kept on the device
    (:func:`_guidance_rows`); every other op is diffusers' own, in its order. No kernel runs here,
    so the contract is trivially bit-exact: the same ops on the same values."""
    mod_index_length = embed.mod_proj.shape[0]
    batch_size = timestep.shape[0]
    timesteps_proj = embed.time_proj(timestep).to(dtype=timestep.dtype)
    guidance_proj = _guidance_rows(embed, batch_size, timestep.dtype, timestep.device)
    if guidance_proj is None:
        return original(timestep)
    mod_proj = embed.mod_proj.to(dtype=timesteps_proj.dtype, device=timesteps_proj.device).repeat(batch_size, 1, 1)
    timestep_guidance = (
        torch.cat([timesteps_proj, guidance_proj], dim=1).unsqueeze(1).repeat(1, mod_index_length, 1)
    )
    input_vec = torch.cat([timestep_guidance, mod_proj], dim=-1)
    return input_vec.to(timestep.dtype)


def _release_guidance_rows(embed) -> None:
    embed.__dict__.pop(_GUIDANCE_ATTR, None)


_TRANSFORMER_PARAMS = (
    "self", "hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "attention_mask",
    "joint_attention_kwargs", "controlnet_block_samples", "controlnet_single_block_samples", "return_dict",
    "controlnet_blocks_repeat",
)


SITES = (
    Site(
        name="chroma.dual_block",
        cls=f"{_TF}:ChromaTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb", "attention_mask",
                "joint_attention_kwargs"),
        forward=dual_block_forward,
        ops=(LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, GATE_RESIDUAL),
        applies=dual_block_applies,
        high=False,
        high_ops=(LINEAR_GELU_TANH,),
        description="dual block: pruned adaLN-Zero, gate+residual+norm2+modulate, FF gate residual "
                    "(quality=high: the FF's first projection + tanh-GELU as one GEMM)",
    ),
    Site(
        name="chroma.single_block",
        cls=f"{_TF}:ChromaSingleTransformerBlock",
        params=("self", "hidden_states", "temb", "image_rotary_emb", "attention_mask", "joint_attention_kwargs"),
        forward=single_block_forward,
        ops=(LAYERNORM_MODULATE, GELU_TANH_CAT, GATE_RESIDUAL),
        applies=single_block_applies,
        high=False,
        high_ops=(LINEAR_GELU_TANH,),
        description="single block: pruned adaLN-Zero-Single, attention copy + GELU into proj_out's input in one "
                    "kernel, gate residual (quality=high, or DITFUSE_GEMM_GELU=1 losslessly: proj_mlp + GELU as one "
                    "GEMM writing proj_out's input)",
    ),
    flux_attention_site("chroma", high=False),
    Site(
        name="chroma.norm_out",
        cls=f"{_TF}:ChromaAdaLayerNormContinuousPruned",
        params=("self", "x", "emb"),
        forward=norm_out_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_norm_out_applies,
        high=False,
        description="norm_out (ChromaAdaLayerNormContinuousPruned, shift first)",
    ),
    ids_scope_site("chroma", f"{_TF}:ChromaTransformer2DModel", _TRANSFORMER_PARAMS),
    Site(
        name="chroma.timestep_embed",
        cls=f"{_TF}:ChromaCombinedTimestepTextProjEmbeddings",
        params=("self", "timestep"),
        forward=timestep_embed_forward,
        ops=(),
        high=False,
        release=_release_guidance_rows,
        description="timestep embedder: the constant guidance rows kept on the device (no per-step CPU "
                    "projection and blocking host-to-device copy; CUDA graph capture works)",
    ),
    embedder_site("chroma.pos_embed", f"{_FLUX}:FluxPosEmbed"),
)

ADAPTER = Adapter(
    family="chroma",
    model_classes=("ChromaTransformer2DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
