"""AutoencoderKLWan adapter (Wan 2.1 / 2.2 video VAE): diffusers 0.42.1's ``WanRMS_norm`` (+ the
SiLU after it) on the bit-exact ``norm.wan_rms_norm_silu``.

Eager ``WanRMS_norm`` is nine kernels (cast, norm reduction, clamp, divide, cast, three
elementwise ops) and the SiLU a tenth, ~38 bytes of traffic per bf16 element; the kernel reads x
once and writes once, with the reduction in ``F.normalize``'s CUDA order (notes/wan_vae.md).
Sites:

- ``WanResidualBlock``: ``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` each become one
  fused call; the causal convolutions, their feature cache and the shortcut stay diffusers' own.
- ``WanRMS_norm`` (every other one: the decoder/encoder ``norm_out`` before their SiLU, the
  attention block's ``norm``): the norm alone, same kernel with ``silu=False``.

The causal-conv ``cat``/``pad`` copies, the resample gathers and the decode's growing output
``cat`` are removable bit-exactly too (notes/wan_vae.md §3) but are not done here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels.norm import WAN_RMS_NORM_SILU
from .base import Adapter, Site

DIFFUSERS_VERSIONS = ("0.42.1",)
CACHE_T = 2  # diffusers.models.autoencoders.autoencoder_kl_wan.CACHE_T: frames kept per causal conv


def _rms_applies(norm: Any) -> str | None:
    if type(norm).__name__ != "WanRMS_norm":
        return f"{type(norm).__name__} is not WanRMS_norm"
    if not norm.channel_first:
        return "channel_first=False (normalised over the last dim: another reduction)"
    C = norm.gamma.shape[0]
    if norm.scale != C**0.5:
        return f"scale {norm.scale!r} is not sqrt({C})"
    return None


def rms_norm_forward(norm, original, x: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """WanRMS_norm.forward: ``F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma + bias``."""
    return _ops.wan_rms_norm_silu(x, norm.gamma, norm.bias, False)


def _causal_conv(conv, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int]) -> torch.Tensor:
    """diffusers' cache bookkeeping around one WanCausalConv3d call, as WanResidualBlock spells it."""
    if feat_cache is None:
        return conv(x)
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and feat_cache[idx] is not None:
        cache_x = torch.cat([feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def residual_forward(block, original, x: torch.Tensor, feat_cache: list | None = None,
                     feat_idx: list[int] = [0], *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: B006 (diffusers' default)
    """WanResidualBlock.forward with each ``WanRMS_norm -> SiLU`` fused."""
    h = block.conv_shortcut(x)
    x = _ops.wan_rms_norm_silu(x, block.norm1.gamma, block.norm1.bias, True)
    x = _causal_conv(block.conv1, x, feat_cache, feat_idx)
    x = _ops.wan_rms_norm_silu(x, block.norm2.gamma, block.norm2.bias, True)
    x = block.dropout(x)
    x = _causal_conv(block.conv2, x, feat_cache, feat_idx)
    return x + h


def _residual_applies(block: Any) -> str | None:
    if type(block.nonlinearity) is not torch.nn.SiLU:
        return f"nonlinearity is {type(block.nonlinearity).__name__}, not SiLU"
    for name in ("norm1", "norm2"):
        r = _rms_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


_VAE = "diffusers.models.autoencoders.autoencoder_kl_wan"

SITES = (
    Site(
        name="wan_vae.residual",
        cls=f"{_VAE}:WanResidualBlock",
        params=("self", "x", "feat_cache", "feat_idx"),
        forward=residual_forward,
        ops=(WAN_RMS_NORM_SILU,),
        applies=_residual_applies,
        high=False,  # the close variant is not admitted (no VAE activations captured yet)
        description="WanResidualBlock: norm1 + SiLU and norm2 + SiLU, each one RMS_norm+SiLU kernel",
    ),
    Site(
        name="wan_vae.rms_norm",
        cls=f"{_VAE}:WanRMS_norm",
        params=("self", "x"),
        forward=rms_norm_forward,
        ops=(WAN_RMS_NORM_SILU,),
        applies=_rms_applies,
        high=False,
        description="every other WanRMS_norm (norm_out before the head's SiLU, the attention block's norm)",
    ),
)

ADAPTER = Adapter(
    family="autoencoder_kl_wan",
    model_classes=("AutoencoderKLWan",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
