"""Pieces every adaLN transformer adapter shares: the affine-free LayerNorm check, diffusers'
``AdaLayerNormZero`` (FLUX.1's and SD3's norm1 / norm1_context) and ``AdaLayerNormContinuous`` (the ``norm_out`` of FLUX.1, FLUX.2, SD3, Qwen-Image), whose fast
forward is the same for each family — one :class:`~ditfuse.models.base.Site` per adapter is made
with :func:`norm_out_site`, so the hook names stay per family."""

from __future__ import annotations

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.norm import LAYERNORM_MODULATE
from .base import Site
from .handoff import Opening


def table_plus_fp32(table: torch.Tensor, temb: torch.Tensor, _ops: OpSet) -> torch.Tensor:
    """``table + temb.float()`` (Wan's and SkyReels-V2's fp32 modulation) as ``_ops.table_add``.

    With a bf16 / fp16 / fp32 table (fp32 as ``from_pretrained`` keeps it, bf16 after a plain
    ``.to(bf16)``) and a contiguous bf16 / fp16 / fp32 ``temb``, the op's kernel reads ``temb``
    once in its own dtype and writes the fp32 sum once: the same exact conversions eager makes and
    the same single fp32 add, bit for bit eager's, without an fp32 copy of ``temb``
    (kernels/modulate/table_add_triton.py). That copy matters where ``temb`` is per token (Wan 2.2
    TI2V-5B: [B, S, 6, D], 1 GB of bf16 at 1280x704x121, once per block). Any other input (a
    strided temb, an fp64 one) is one the kernel refuses, and the op runs its reference: eager's
    expression itself."""
    return _ops.table_add(table, temb)


def plain_layernorm(norm: torch.nn.Module) -> str | None:
    """None for ``nn.LayerNorm(D, elementwise_affine=False)`` over the last dim, else why not."""
    if type(norm) is not torch.nn.LayerNorm:
        return f"norm is {type(norm).__name__}, not torch.nn.LayerNorm"
    if norm.elementwise_affine or getattr(norm, "bias", None) is not None:
        return "LayerNorm has affine parameters (the adaLN norms are affine-free)"
    if len(norm.normalized_shape) != 1:
        return "LayerNorm over more than the last dim"
    return None


def ada_zero_applies(norm: torch.nn.Module) -> str | None:
    """None when :func:`ada_zero` reproduces this AdaLayerNormZero instance, else why not."""
    if getattr(norm, "emb", None) is not None:
        return "AdaLayerNormZero with its own timestep embedding"
    return plain_layernorm(norm.norm)


def dual_block_applies(block: torch.nn.Module) -> str | None:
    """None for a FLUX.1-style dual-stream block (``norm1`` / ``norm1_context`` plain
    AdaLayerNormZero, ``norm2`` / ``norm2_context`` affine-free LayerNorms), else why not: FLUX.1
    and HunyuanVideo 1.5."""
    for name in ("norm1", "norm1_context"):
        r = ada_zero_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    for name in ("norm2", "norm2_context"):
        r = plain_layernorm(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


def single_block_applies(block: torch.nn.Module) -> str | None:
    """None for a FLUX.1-style single-stream block (an affine-free LayerNorm inside its adaLN
    ``norm``, ``act_mlp`` the tanh GELU the GELU-into-cat op computes), else why not: FLUX.1,
    Chroma and HunyuanVideo."""
    r = plain_layernorm(block.norm.norm)
    if r is not None:
        return f"norm: {r}"
    act = block.act_mlp
    if type(act) is not torch.nn.GELU or act.approximate != "tanh":
        return "act_mlp is not nn.GELU(approximate='tanh')"
    return None


def ada_zero_opening(norm, emb: torch.Tensor) -> Opening:
    """AdaLayerNormZero's modulation: ``emb = linear(silu(emb))``, ``chunk(6)`` = shift, scale,
    gate (msa), shift, scale, gate (mlp); the norm is ``r(r(r(LN(x)) * r(1 + scale_msa)) +
    shift_msa)``, the other four chunks ride along."""
    emb = norm.linear(norm.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    return Opening(scale_msa, shift_msa, norm.norm.eps, (gate_msa, shift_mlp, scale_mlp, gate_mlp))


def ada_zero(norm, x: torch.Tensor, emb: torch.Tensor, _ops: OpSet):
    """AdaLayerNormZero(x, emb=emb) -> (x normed + modulated, gate_msa, shift_mlp, scale_mlp,
    gate_mlp) (:func:`ada_zero_opening`)."""
    return ada_zero_opening(norm, emb).run(x, _ops)


def norm_out_forward(
    norm, original, x: torch.Tensor, conditioning_embedding: torch.Tensor, *, _ops: OpSet = LOSSLESS
) -> torch.Tensor:
    """AdaLayerNormContinuous: ``emb = linear(silu(c).to(x.dtype))``; ``chunk(2)`` gives scale
    first, then shift; ``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``."""
    emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return _ops.layernorm_modulate(x, scale=scale, shift=shift, eps=norm.norm.eps)


def _norm_out_applies(norm) -> str | None:
    return plain_layernorm(norm.norm)


def norm_out_site(family: str, high: bool = True) -> Site:
    """The ``norm_out`` site of ``family``'s adapter (``high``: see :class:`Site`)."""
    return Site(
        name=f"{family}.norm_out",
        cls="diffusers.models.normalization:AdaLayerNormContinuous",
        params=("self", "x", "conditioning_embedding"),
        forward=norm_out_forward,
        ops=(LAYERNORM_MODULATE,),
        applies=_norm_out_applies,
        high=high,
        description="norm_out (AdaLayerNormContinuous, scale first)",
    )
