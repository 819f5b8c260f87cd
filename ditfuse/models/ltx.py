"""LTX-Video adapter: fast forwards for diffusers 0.42.1's ``LTXVideoTransformer3DModel``.

LTX runs its chains in the model dtype (no upcast): the timestep embedding ``temb`` and the
``scale_shift_table`` are both in the model dtype, so ``ada = table[None, None] + temb`` and every
modulation product and sum rounds there, as FLUX.1's do. Per block (chains in diffusers' order,
``r`` a rounding to the dtype torch's promotion gives; bf16 throughout for a bf16 model, fp32 for
an fp32 one):

1. ``norm1(h) * (1 + scale_msa) + shift_msa``: diffusers ``RMSNorm`` without affine (``x *
   rsqrt(mean(x32^2) + eps)`` in fp32, one rounding to x's dtype), times ``r(1 + scale)``, plus the
   shift -> ``norm.rms_norm_diffusers_scale`` with its ``shift`` (``r(r(RMS_d(x) * r(1 + scale)) +
   shift)``: Z-Image's ``norm(x) * (1.0 + scale)``, ``1`` and ``1.0`` give the same bf16 sum, and
   one more add; round 35 took the shift into the op, before it was a separate eager add).
2. Self-attention (``attn1``, the ``ltx.attention`` site): ``norm_q`` / ``norm_k`` are
   ``torch.nn.RMSNorm(H * Dh)`` over all heads, then LTX's ``apply_rotary_emb`` on the flat
   [B, S, H * Dh] rows: ``(x.float() * cos + x_rot.float() * sin).to(x.dtype)`` with
   ``x_rot[2i] = -x[2i+1]``, ``x_rot[2i+1] = x[2i]`` and fp32 tables ``[B, S, H * Dh]`` that
   repeat each frequency twice (``cos[2i] == cos[2i+1]``, the cos=1 / sin=0 padding of width
   ``(H * Dh) % 6`` covers whole pairs for an even width). That is Wan's pair RoPE
   (``reference.rope_pairs``: ``r(r32(x[2i] c) - r32(x[2i+1] s))``, ``r(r32(x[2i] s) + r32(x[2i+1] c))``
   in fp32 for fp32 tables; ``a + (-b)`` is ``a - b`` and the odd sum commutes, bit for bit) with
   one difference: LTX's table spans all heads (each head has other frequencies). So
   ``rope.qk_rmsnorm_across_heads_rope`` is called with ``heads=1`` (one "head" of width H * Dh,
   table ``[1, S, 1, H * Dh]``) and the result viewed as [B, S, H, Dh]; the kernel takes a
   one-batch table, so a [B, S, D] table with B > 1 (CFG) is one call per sample and a ``cat``.
   Tables that are not fp32 (then LTX's fp32 formula and Wan's promoted one differ), not
   [B or 1, S, D], or an odd width: the op does the norms only (``cos=None``) and diffusers'
   ``apply_rotary_emb`` runs eagerly.
3. ``h + attn * gate_msa`` -> ``modulate.gate_residual`` (``r(h + r(gate * attn))``; the product
   commutes bitwise). Only where the sum keeps h's dtype (the op casts to the residual's dtype;
   eager would promote a wider gate): otherwise eager.
4. Cross-attention (``attn2``) and ``h + attn``: eager. ``attn2`` is also an ``LTXAttention`` (the
   site is mounted on it and hands every call with ``encoder_hidden_states`` to diffusers'
   processor): its q and k differ in length (the QK op wants one shape) and it has no RoPE; the
   plain add is one eager op (the gated-residual kernel refuses ``gate=None`` for that reason).
5. ``norm2(h) * (1 + scale_mlp) + shift_mlp`` -> ``norm.rms_norm_diffusers_scale`` (as 1).
6. ``ff``: diffusers' ``FeedForward`` (Linear, ``F.gelu(approximate="tanh")``, Linear), called as
   a module: eager (the GELU is one elementwise kernel already; no op saves a pass there).
7. ``h + ff * gate_mlp`` -> ``modulate.gate_residual`` (as 3).

Model forward (``ltx.model`` site): everything up to the blocks is diffusers' code (rope,
mask-to-bias, ``proj_in``, ``time_embed``, ``caption_projection`` as modules); the tail
``norm_out(h) * (1 + scale) + shift`` (``nn.LayerNorm`` without affine in the model dtype, the
table + embedded timestep in the model dtype) -> ``norm.layernorm_modulate`` with
``norm_dtype=None`` (FLUX.1's AdaLayerNormContinuous chain: ``r(r(r(LN(x)) * r(1 + scale)) +
shift)``); ``proj_out`` as a module.

Not fused, and why: the ``ada_values`` sum (per token for I2V / condition pipelines: the table +
temb sum in the model dtype, a [B, S, 6, D] tensor per block; the ops' table rows assume Wan's
fp32 sum), attention itself, the cross-attention path, the FF, and the block boundary (the
existing hand-off opens the next block with a LayerNorm, not diffusers' RMSNorm). Every op is bit-exact and gated at first sight; no
quality="high" tier (``high=False``: no close variant was admitted for LTX's shapes). LoRA scales
(``attention_kwargs``) and gradient checkpointing take diffusers' forward.

GPU (round 20, H100): tests/gpu/test_ltx_gpu.py passed (bitwise, every op verified, no fallback:
tiny, 0.9.x width 2048 and 13B width 4096, B=1 and 2); the 0.9.x-size step at 704x512x161 went
115.91 -> 80.81 ms (bench/results/ltx_step_round20_h100.csv). Round 35 (H100, the shift in the op):
the GPU tests again (with test_zimage_gpu's ``test_ltx_scale_shift_vs_eager``), and on one machine
round 34's tree 83.17 against this one's 81.16 ms lossless (bench/results/ltx_step_round35_a_h100.csv).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.modulate import GATE_RESIDUAL
from ..kernels.norm import LAYERNORM_MODULATE, RMS_NORM_DIFFUSERS_SCALE
from ..kernels.rope import QK_RMSNORM_ACROSS_HEADS_ROPE
from .base import Adapter, Site, diffusers_rmsnorms, feed_forward

DIFFUSERS_VERSIONS = ("0.42.1",)
_TL = "diffusers.models.transformers.transformer_ltx"


def _gate_residual(_ops: OpSet, h: torch.Tensor, gate: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """``h + update * gate`` (diffusers' spelling), through the op where its result dtype is
    eager's: the op returns h's dtype, eager the promotion of all three."""
    if torch.promote_types(h.dtype, torch.promote_types(gate.dtype, update.dtype)) != h.dtype:
        return h + update * gate
    return _ops.gate_residual(h, gate, update)


# -- blocks -----------------------------------------------------------------------------------


def block_forward(
    block,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    *,
    _ops: OpSet = LOSSLESS,
) -> torch.Tensor:
    """LTXVideoTransformerBlock with its modulated norms and gated residuals on ops (module
    docstring, chains 1-7)."""
    batch_size = hidden_states.size(0)
    num_ada_params = block.scale_shift_table.shape[0]
    ada_values = block.scale_shift_table[None, None].to(temb.device) + temb.reshape(
        batch_size, temb.size(1), num_ada_params, -1
    )
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)
    norm_hidden_states = _ops.rms_norm_diffusers_scale(hidden_states, block.norm1.weight, scale_msa,
                                                       block.norm1.eps, shift_msa)

    attn_hidden_states = block.attn1(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=None,
        image_rotary_emb=image_rotary_emb,
    )
    hidden_states = _gate_residual(_ops, hidden_states, gate_msa, attn_hidden_states)

    attn_hidden_states = block.attn2(
        hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        image_rotary_emb=None,
        attention_mask=encoder_attention_mask,
    )
    hidden_states = hidden_states + attn_hidden_states
    norm_hidden_states = _ops.rms_norm_diffusers_scale(hidden_states, block.norm2.weight, scale_mlp,
                                                       block.norm2.eps, shift_mlp)

    ff_output = feed_forward(block.ff, norm_hidden_states, _ops)
    return _gate_residual(_ops, hidden_states, gate_mlp, ff_output)


def _block_applies(block) -> str | None:
    # diffusers' RMSNorm (its mean is over the last dim whatever ``dim`` says), no bias
    return diffusers_rmsnorms(block, ("norm1", "norm2"))


# -- attention --------------------------------------------------------------------------------


def _rope_table_fits(query: torch.Tensor, cos: Any, sin: Any) -> bool:
    """LTX's tables can go to the QK op as one head of width D (module docstring, chain 2):
    fp32 tensors [1 or B, S, D] of one shape, D even."""
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return False
    B, S, D = query.shape
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape:
        return False
    return cos.dim() == 3 and cos.shape[0] in (1, B) and tuple(cos.shape[1:]) == (S, D) and D % 2 == 0


def _qk_norm_rope(attn, query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any, _ops: OpSet
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_q / norm_k + LTX's RoPE + the head split: [B, S, H * Dh] -> [B, S, H, Dh] each."""
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    heads, eps = attn.heads, attn.norm_q.eps
    wq, wk = attn.norm_q.weight, attn.norm_k.weight
    cos, sin = image_rotary_emb
    if not _rope_table_fits(query, cos, sin):
        # the norms on the op (one launch for q and k), LTX's RoPE as diffusers runs it
        q, k = _ops.qk_rmsnorm_across_heads_rope(query, key, wq, wk, None, None, heads, eps)
        q = apply_rotary_emb(q.flatten(2), image_rotary_emb).unflatten(2, (heads, -1))
        k = apply_rotary_emb(k.flatten(2), image_rotary_emb).unflatten(2, (heads, -1))
        return q, k
    B = query.shape[0]
    if cos.shape[0] == 1 or B == 1:
        q, k = _ops.qk_rmsnorm_across_heads_rope(query, key, wq, wk, cos[:, :, None], sin[:, :, None], 1, eps)
    else:
        # the kernel reads one [1, S, 1, D] table: one call per sample (rows are independent: the
        # norm's reduction tree is fixed by the width, the RoPE is per element)
        pairs = [_ops.qk_rmsnorm_across_heads_rope(query[b:b + 1], key[b:b + 1], wq, wk, cos[b:b + 1, :, None],
                                                   sin[b:b + 1, :, None], 1, eps) for b in range(B)]
        q = torch.cat([p[0] for p in pairs])
        k = torch.cat([p[1] for p in pairs])
    return q.unflatten(3, (heads, -1)).squeeze(2), k.unflatten(3, (heads, -1)).squeeze(2)


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
) -> torch.Tensor:
    """LTXAttention + LTXVideoAttnProcessor, self-attention with RoPE (``attn1``): the QK chain on
    ``rope.qk_rmsnorm_across_heads_rope`` (module docstring, chain 2). Every other call (the
    cross-attention ``attn2``, a mask, extra kwargs, another processor) runs diffusers' forward."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

    processor = attn.processor
    if (kwargs or encoder_hidden_states is not None or attention_mask is not None or image_rotary_emb is None
            or type(processor) is not LTXVideoAttnProcessor or hidden_states.dim() != 3):
        return original(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kwargs)

    query = attn.to_q(hidden_states)
    key = attn.to_k(hidden_states)
    value = attn.to_v(hidden_states)
    query, key = _qk_norm_rope(attn, query, key, image_rotary_emb, _ops)
    value = value.unflatten(2, (attn.heads, -1))

    hidden_states = dispatch_attention_fn(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        backend=processor._attention_backend,
        parallel_config=processor._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    hidden_states = hidden_states.to(query.dtype)

    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    return hidden_states


def _attn_applies(attn) -> str | None:
    from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

    if type(attn.processor) is not LTXVideoAttnProcessor:
        return f"processor is {type(attn.processor).__name__}, not LTXVideoAttnProcessor"
    for name in ("norm_q", "norm_k"):
        n = getattr(attn, name)
        if type(n) is not torch.nn.RMSNorm:
            return f"{name} is {type(n).__name__}, not torch.nn.RMSNorm"
        if n.eps is None:
            return f"{name} has eps=None (the dtype's epsilon, not reproduced)"
    if attn.norm_q.eps != attn.norm_k.eps:
        return "norm_q and norm_k have different eps"
    if attn.inner_dim != attn.inner_kv_dim:
        return "kv_heads differs from heads (q and k of different widths)"
    return None


# -- the model forward (tail: norm_out + modulate) ------------------------------------------


def model_forward(
    model,
    original,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_attention_mask: torch.Tensor,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    rope_interpolation_scale: tuple[float, float, float] | torch.Tensor | None = None,
    video_coords: torch.Tensor | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    return_dict: bool = True,
    *,
    _ops: OpSet = LOSSLESS,
):
    """LTXVideoTransformer3DModel.forward with the output norm + modulate on
    ``norm.layernorm_modulate``. LoRA scales (``attention_kwargs``) and gradient checkpointing
    take diffusers' own forward."""
    if attention_kwargs or (torch.is_grad_enabled() and model.gradient_checkpointing):
        # by keyword: diffusers' @apply_lora_scale reads the LoRA scale from kwargs only
        return original(hidden_states, encoder_hidden_states, timestep, encoder_attention_mask, num_frames,
                        height, width, rope_interpolation_scale, video_coords, attention_kwargs=attention_kwargs,
                        return_dict=return_dict)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    image_rotary_emb = model.rope(hidden_states, num_frames, height, width, rope_interpolation_scale, video_coords)

    if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
        encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

    batch_size = hidden_states.size(0)
    hidden_states = model.proj_in(hidden_states)

    temb, embedded_timestep = model.time_embed(
        timestep.flatten(),
        batch_size=batch_size,
        hidden_dtype=hidden_states.dtype,
    )

    temb = temb.view(batch_size, -1, temb.size(-1))
    embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))

    encoder_hidden_states = model.caption_projection(encoder_hidden_states)
    encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

    for block in model.transformer_blocks:
        hidden_states = block(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            temb=temb,
            image_rotary_emb=image_rotary_emb,
            encoder_attention_mask=encoder_attention_mask,
        )

    scale_shift_values = model.scale_shift_table[None, None] + embedded_timestep[:, :, None]
    shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]

    norm = model.norm_out
    hidden_states = _ops.layernorm_modulate(hidden_states, scale, shift, norm.eps, norm.weight, norm.bias)
    output = model.proj_out(hidden_states)

    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


def _model_applies(model) -> str | None:
    norm = model.norm_out
    if type(norm) is not torch.nn.LayerNorm:
        return f"norm_out is {type(norm).__name__}, not nn.LayerNorm"
    if len(norm.normalized_shape) != 1:
        return "norm_out over more than the last dim"
    return None


SITES = (
    Site(
        name="ltx.model",
        cls=f"{_TL}:LTXVideoTransformer3DModel",
        params=("self", "hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask",
                "num_frames", "height", "width", "rope_interpolation_scale", "video_coords", "attention_kwargs",
                "return_dict"),
        forward=model_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_model_applies,
        high=False,
        description="model tail: norm_out (LayerNorm, model dtype) + modulate",
    ),
    Site(
        name="ltx.block",
        cls=f"{_TL}:LTXVideoTransformerBlock",
        params=("self", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb",
                "encoder_attention_mask"),
        forward=block_forward,
        ops=(RMS_NORM_DIFFUSERS_SCALE, GATE_RESIDUAL),
        applies=_block_applies,
        high=False,
        description="block: norm1 / norm2 (diffusers RMSNorm) * (1 + scale) (the + shift eager), "
                    "attention and FF gated residuals",
    ),
    Site(
        name="ltx.attention",
        cls=f"{_TL}:LTXAttention",
        params=("self", "hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb", "kwargs"),
        forward=attention_forward,
        ops=(QK_RMSNORM_ACROSS_HEADS_ROPE,),
        applies=_attn_applies,
        high=False,
        description="self-attention: QK RMSNorm over all heads + LTX's all-heads RoPE (one head of width "
                    "H*Dh) + head split; cross-attention calls run diffusers' processor",
    ),
)

ADAPTER = Adapter(
    family="ltx",
    model_classes=("LTXVideoTransformer3DModel",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
