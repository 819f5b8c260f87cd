"""AutoencoderKL adapter (the FLUX.1 / SD3 / SD VAE): GroupNorm (+ SiLU) in diffusers 0.42.1's
ResnetBlock2D and every other GroupNorm of the model, on the bit-exact ``norm.group_norm_silu``.

aten's CUDA GroupNorm computes each (sample, group)'s statistics in one block, 32 blocks for a
batch-1 decoder with 32 groups on a 132-SM GPU; the kernel reproduces that order bit for bit
while spreading the chains over many SMs (kernels/norm/group_norm_silu_triton.py), and fuses the
SiLU that follows every ResnetBlock2D norm. Sites:

- ``ResnetBlock2D``: ``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` each become one
  fused call; convolutions, up/down sampling and the residual stay diffusers' own.
- ``GroupNorm`` (every other one: the decoder's ``conv_norm_out`` before ``conv_act``, the
  mid-block attention's ``group_norm``): the GroupNorm alone, same kernel with ``silu=False``.

Tiled and sliced decode call the same modules, so they take the fast path too (and stay bitwise
equal: each tile's GroupNorm is the eager one's, bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.norm import GROUP_NORM_SILU
from .base import Adapter, Site

DIFFUSERS_VERSIONS = ("0.42.1",)


def _group_norm_applies(norm: Any) -> str | None:
    if type(norm) is not torch.nn.GroupNorm:
        return f"{type(norm).__name__} is not torch.nn.GroupNorm"
    if (norm.weight is None) != (norm.bias is None):
        return "GroupNorm with only one of weight / bias"
    return None


def group_norm_forward(norm, original, input: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: A002
    """nn.GroupNorm.forward: ``F.group_norm(input, num_groups, weight, bias, eps)``."""
    return _ops.group_norm_silu(input, norm.num_groups, norm.weight, norm.bias, norm.eps, False)


def resnet_forward(block, original, input_tensor: torch.Tensor, temb: torch.Tensor | None = None, *args: Any,
                   _ops: OpSet = LOSSLESS, **kwargs: Any) -> torch.Tensor:
    """ResnetBlock2D.forward with each GroupNorm -> SiLU fused. Time embeddings (UNets; the VAE
    has none) and the deprecated ``scale`` argument take diffusers' own forward."""
    if args or kwargs or temb is not None or block.time_emb_proj is not None:
        return original(input_tensor, temb, *args, **kwargs)
    hidden_states = _ops.group_norm_silu(input_tensor, block.norm1.num_groups, block.norm1.weight, block.norm1.bias,
                                         block.norm1.eps, True)
    if block.upsample is not None:
        if hidden_states.shape[0] >= 64:
            input_tensor = input_tensor.contiguous()
            hidden_states = hidden_states.contiguous()
        input_tensor = block.upsample(input_tensor)
        hidden_states = block.upsample(hidden_states)
    elif block.downsample is not None:
        input_tensor = block.downsample(input_tensor)
        hidden_states = block.downsample(hidden_states)
    hidden_states = block.conv1(hidden_states)
    hidden_states = _ops.group_norm_silu(hidden_states, block.norm2.num_groups, block.norm2.weight, block.norm2.bias,
                                         block.norm2.eps, True)
    hidden_states = block.dropout(hidden_states)
    hidden_states = block.conv2(hidden_states)
    if block.conv_shortcut is not None:
        if block.training:
            input_tensor = input_tensor.contiguous()
        input_tensor = block.conv_shortcut(input_tensor)
    return (input_tensor + hidden_states) / block.output_scale_factor


def _resnet_applies(block: Any) -> str | None:
    if type(block.nonlinearity) is not torch.nn.SiLU:
        return f"nonlinearity is {type(block.nonlinearity).__name__}, not SiLU"
    if block.time_embedding_norm == "scale_shift":
        # without a time embedding diffusers raises for scale_shift; "default" and the decoder's
        # "group" (UpDecoderBlock2D passes the Decoder's norm_type) both run norm2 -> SiLU then
        return "time_embedding_norm='scale_shift' (needs a time embedding; the VAE has none)"
    for name in ("norm1", "norm2"):
        r = _group_norm_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


SITES = (
    Site(
        name="vae.resnet",
        cls="diffusers.models.resnet:ResnetBlock2D",
        params=("self", "input_tensor", "temb", "args", "kwargs"),
        forward=resnet_forward,
        ops=(GROUP_NORM_SILU,),
        applies=_resnet_applies,
        description="ResnetBlock2D: norm1 + SiLU and norm2 + SiLU, each one GroupNorm+SiLU kernel",
    ),
    Site(
        name="vae.group_norm",
        cls="torch.nn:GroupNorm",
        params=("self", "input"),
        forward=group_norm_forward,
        ops=(GROUP_NORM_SILU,),
        applies=_group_norm_applies,
        description="every other GroupNorm (decoder conv_norm_out, mid-block attention group_norm)",
    ),
)

ADAPTER = Adapter(
    family="autoencoder_kl",
    model_classes=("AutoencoderKL",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
