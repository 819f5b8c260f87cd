"""AutoencoderKL adapter (the FLUX.1 / SD3 / SD VAE, and AutoencoderKLFlux2, the FLUX.2 / FLUX.3
VAE): GroupNorm (+ SiLU) in diffusers 0.42.1's ResnetBlock2D and every other GroupNorm of the
model, on the bit-exact ``norm.group_norm_silu``.

AutoencoderKLFlux2 decodes with the same ``vae.Decoder`` (32 latent channels; its BatchNorm over
the patchified latents belongs to the pipeline's latent scaling, not to ``decode``), so every
site below applies to it unchanged; only the model class differs.

aten's CUDA GroupNorm computes each (sample, group)'s statistics in one block, 32 blocks for a
batch-1 decoder with 32 groups on a 132-SM GPU; the kernel reproduces that order bit for bit
while spreading the chains over many SMs (kernels/norm/group_norm_silu_triton.py), and fuses the
SiLU that follows every ResnetBlock2D norm. Sites:

- ``ResnetBlock2D``: ``norm1 -> nonlinearity`` and ``norm2 -> nonlinearity`` each become one
  fused call; on CUDA ``conv2`` runs without its bias and ``modulate.conv_bias_residual`` adds
  the bias and the residual in one pass (aten adds a cuDNN convolution's bias in a broadcast pass
  of its own, then the block adds the residual, then divides by ``output_scale_factor``, which
  is 1: an exact copy, skipped); up/down sampling stays diffusers'. In bf16/fp16 on CUDA (the
  lossless decode) the block runs as a channels-last chain: each norm's epilogue writes
  channels-last (``norm.group_norm_silu_cl``: the statistics still walk NCHW memory in aten's
  order), conv1 and conv2 read it as cuDNN's NHWC kernel does (``modulate.conv_bias_cl``,
  ``conv_bias_residual_cl``: held against the NCHW convolution by the gate; the same kernel cuDNN
  wraps in NCHW <-> NHWC transposes, so the same bits), and the block's output keeps eager's
  layout. On by default; ``DITFUSE_VAE_CL=0`` keeps the NCHW path (:func:`channels_last_chain_enabled`).
- ``Conv2d`` (every other biased one, on CUDA: conv_in, conv1, the shortcuts, the up/down
  samplers' convolutions, conv_out): ``modulate.conv_bias``, cuDNN's convolution and then its
  bias in one vectorized pass instead of aten's broadcast add.
- ``Decoder``: its head ``conv_norm_out -> conv_act`` as one GroupNorm+SiLU call (lossless
  bf16/fp16: written channels-last for ``conv_out``, the image made NCHW again). Under
  quality="high" the decode runs in channels-last memory: the latent enters channels-last and
  every op keeps that layout (cuDNN's NHWC convolutions without the NCHW <-> NHWC transposes it
  wraps around an NCHW one, ~9 ms of an H100 1024² decode; the close GroupNorm reads and writes
  channels-last rows; nearest upsampling, the bias passes and the attention's views follow their
  input); the image leaves contiguous. Lossless cannot decode channels-last throughout: the
  exact GroupNorm's chains walk NCHW memory in aten's order, which channels-last memory would turn
  into strided reads; only its output is channels-last (above).
- ``Upsample2D`` (the up blocks' upsamplers): on channels-last memory (the high decode) the
  nearest x2 repeat as one Triton pass; NCHW (the lossless decode) keeps aten's kernel.
- ``GroupNorm`` (every other one: the mid-block attention's ``group_norm``): the GroupNorm alone,
  same kernel with ``silu=False``.

Tiled and sliced decode call the same modules, so they take the fast path too (and stay bitwise
equal: each tile's GroupNorm is the eager one's, bit for bit).
"""

from __future__ import annotations

from typing import Any

import torch

from ..contracts.ops import LOSSLESS, OpSet
from ..contracts.quality import Quality
from ..kernels.env import env
from ..kernels.layout import UPSAMPLE_NEAREST2D
from ..kernels.modulate import CONV_BIAS, CONV_BIAS_CL, CONV_BIAS_RESIDUAL, CONV_BIAS_RESIDUAL_CL
from ..kernels.norm import GROUP_NORM_SILU, GROUP_NORM_SILU_CL
from .base import Adapter, Site, plain_module

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
    if _ops.quality is Quality.LOSSLESS and _channels_last_chain(block, input_tensor):
        # (quality="high" decodes channels-last throughout: nothing to turn around there)
        return _resnet_channels_last(block, input_tensor, _ops)
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
    if _tail_applies(block, hidden_states):
        if block.conv_shortcut is not None:
            input_tensor = block.conv_shortcut(input_tensor)
        conv = block.conv2
        out = _ops.conv_bias_residual(hidden_states, conv.weight, conv.bias, input_tensor, conv.stride, conv.padding,
                                      conv.dilation, conv.groups)
        # r(y / 1.0) is y for every y (NaN payloads aside, which bit-exactness does not count):
        # eager's division by output_scale_factor = 1 is a copy pass, skipped
        return out if block.output_scale_factor == 1.0 else out / block.output_scale_factor
    hidden_states = block.conv2(hidden_states)
    if block.conv_shortcut is not None:
        if block.training:
            input_tensor = input_tensor.contiguous()
        input_tensor = block.conv_shortcut(input_tensor)
    return (input_tensor + hidden_states) / block.output_scale_factor


def _resnet_channels_last(block, input_tensor: torch.Tensor, _ops: OpSet) -> torch.Tensor:
    """The same block with each norm writing channels-last for the convolution after it
    (``norm.group_norm_silu_cl``) and conv1 / conv2 reading it as cuDNN's NHWC kernel does
    (``modulate.conv_bias_cl`` / ``conv_bias_residual_cl``, each held against the NCHW convolution
    by the gate): eager's four NCHW <-> NHWC transposes around conv1 and conv2 are gone. conv1's
    bias pass writes NCHW (cuDNN's output transpose and aten's bias add in one tiled pass), which
    norm2's exact statistics need; conv2's bias + residual pass writes the residual's layout, so
    the block's output has eager's."""
    n1, n2, c1, c2 = block.norm1, block.norm2, block.conv1, block.conv2
    h = _ops.group_norm_silu_cl(input_tensor, n1.num_groups, n1.weight, n1.bias, n1.eps, True)
    h = _ops.conv_bias_cl(h, c1.weight, c1.bias, c1.stride, c1.padding, c1.dilation, c1.groups)
    h = _ops.group_norm_silu_cl(h, n2.num_groups, n2.weight, n2.bias, n2.eps, True)
    h = block.dropout(h)
    if block.conv_shortcut is not None:
        input_tensor = block.conv_shortcut(input_tensor)
    out = _ops.conv_bias_residual_cl(h, c2.weight, c2.bias, input_tensor, c2.stride, c2.padding, c2.dilation,
                                     c2.groups)
    return out if block.output_scale_factor == 1.0 else out / block.output_scale_factor


def channels_last_chain_enabled() -> bool:
    """The lossless channels-last chain (:func:`_resnet_channels_last` and the decoder head); on
    unless ``DITFUSE_VAE_CL=0``. H100, 1024² decode: 38.38 ms against 41.78 for the NCHW path
    (2048²: 208.42 vs 221.00), bitwise (bench/results/vae_cl_chain_round15_f_h100.log). Its
    channels-last epilogue kernel is still ~3x slower than the NCHW apply (notes/runtime.md)."""
    return env("DITFUSE_VAE_CL", "1").strip() not in ("", "0")


def _channels_last_chain(block, x: torch.Tensor) -> bool:
    """The block may run :func:`_resnet_channels_last`: :func:`_channels_last_input`, inference,
    no up/down sampling between norm1 and conv1, both convolutions plain (the ops read their
    weights)."""
    return (_channels_last_input(x) and not block.training and block.upsample is None and block.downsample is None
            and _plain_conv(block.conv1) and _plain_conv(block.conv2))


def _channels_last_input(x: torch.Tensor) -> bool:
    """x may enter the channels-last chain: switched on (:func:`channels_last_chain_enabled`), CUDA,
    4-D bf16/fp16 (cuDNN's fp32 NHWC kernels are another computation), ``cudnn.benchmark`` off."""
    return (channels_last_chain_enabled() and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() == 4 and not torch.backends.cudnn.benchmark)


def decoder_forward(dec, original, sample: torch.Tensor, latent_embeds: torch.Tensor | None = None, *,
                    _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """Decoder.forward with ``conv_norm_out -> conv_act`` as one ``group_norm_silu`` call; under
    quality="high" in channels-last memory (module docstring). Spatial norms (``latent_embeds``)
    and gradient checkpointing take diffusers' forward."""
    if latent_embeds is not None or (torch.is_grad_enabled() and dec.gradient_checkpointing):
        return original(sample, latent_embeds)
    channels_last = _ops.quality is Quality.HIGH and sample.dim() == 4
    if channels_last:
        sample = sample.contiguous(memory_format=torch.channels_last)
    sample = dec.conv_in(sample)
    sample = dec.mid_block(sample, latent_embeds)
    for up_block in dec.up_blocks:
        sample = up_block(sample, latent_embeds)
    norm, conv = dec.conv_norm_out, dec.conv_out
    if not channels_last and _head_channels_last(dec, sample):
        # the norm writes channels-last, conv_out reads it without cuDNN's transposes; the image
        # (3 channels) leaves NCHW as eager's does
        sample = _ops.group_norm_silu_cl(sample, norm.num_groups, norm.weight, norm.bias, norm.eps, True)
        sample = _ops.conv_bias_cl(sample, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation,
                                   conv.groups)
        return sample.contiguous()
    sample = _ops.group_norm_silu(sample, norm.num_groups, norm.weight, norm.bias, norm.eps, True)
    sample = conv(sample)
    return sample.contiguous() if channels_last else sample


def _head_channels_last(dec, x: torch.Tensor) -> bool:
    return _channels_last_input(x) and _plain_conv(dec.conv_out)


def _decoder_applies(dec: Any) -> str | None:
    r = _group_norm_applies(dec.conv_norm_out)
    if r is not None:
        return f"conv_norm_out: {r} (norm_type='spatial' decoders take a SpatialNorm)"
    if type(dec.conv_act) is not torch.nn.SiLU:
        return f"conv_act is {type(dec.conv_act).__name__}, not SiLU"
    return None


def upsample_forward(up, original, hidden_states: torch.Tensor, output_size: int | None = None, *args: Any,
                     _ops: OpSet = LOSSLESS, **kwargs: Any) -> torch.Tensor:
    """Upsample2D.forward (nearest x2, then its convolution) with the repeat on channels-last
    memory as ``layout.upsample_nearest2d`` (the quality="high" decode's layout; aten's NHWC
    upsample kernel ran 2.84 ms of its 1024² H100 decode). Other layouts, an explicit
    ``output_size``, batches >= 64 and diffusers' ``scale`` argument take diffusers' forward."""
    x = hidden_states
    if args or kwargs or output_size is not None or not _canonical_channels_last(x) or x.shape[0] >= 64:
        return original(hidden_states, output_size, *args, **kwargs)
    h = _ops.upsample_nearest2d(x)
    return up.conv(h) if up.use_conv else h


def _canonical_channels_last(x: torch.Tensor) -> bool:
    if x.dim() != 4 or x.is_contiguous():
        return False
    N, C, H, W = x.shape
    return x.stride() == (H * W * C, 1, W * C, C) and x.numel() * 2 <= 2**31


def _upsample_applies(up: Any) -> str | None:
    if up.norm is not None:
        return "has a norm (applied before the interpolation)"
    if up.use_conv_transpose:
        return "use_conv_transpose (no interpolation)"
    if not up.interpolate:
        return "interpolate=False"
    if up.use_conv and up.name != "conv":
        return f"convolution named {up.name!r} (the fast forward calls .conv)"
    return None


def _plain_conv(conv: Any) -> bool:
    """A Conv2d the conv ops take (:func:`_conv_applies`) whose forward nothing but ditfuse's own
    site intercepts: its output is ``F.conv2d(x, weight, bias, ...)``, so an op may read its weight
    and bias instead of calling it."""
    return _conv_applies(conv) is None and plain_module(conv, torch.nn.Conv2d)


def _tail_applies(block, hidden_states: torch.Tensor) -> bool:
    """conv2 + the residual as one op (``modulate.conv_bias_residual``): on CUDA (aten's CPU
    convolutions add the bias inside, so the split would not be eager's there), conv2 a plain
    biased zero-padded Conv2d (the op reads its weight), inference."""
    return hidden_states.is_cuda and not block.training and _plain_conv(block.conv2)


def conv_forward(conv, original, input: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: A002
    """nn.Conv2d.forward on CUDA as ``modulate.conv_bias``: the convolution, then its bias in one
    vectorized pass (aten's is a broadcast add it cannot vectorize). Elsewhere: the module's own
    forward (aten's CPU convolutions add the bias inside)."""
    if not _conv_on_op(input):
        return original(input)
    return _ops.conv_bias(input, conv.weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)


def _conv_on_op(input: torch.Tensor) -> bool:  # noqa: A002
    # a strided view (a tiled decode's latent tile) runs eager: cuDNN copies it first, the op
    # takes NCHW or channels-last memory only
    return input.is_cuda and (input.is_contiguous() or input.is_contiguous(memory_format=torch.channels_last))


def _conv_applies(conv: Any) -> str | None:
    if type(conv) is not torch.nn.Conv2d:
        return f"{type(conv).__name__} is not torch.nn.Conv2d"
    if conv.bias is None:
        return "no bias (nothing to fuse)"
    if conv.padding_mode != "zeros":
        return f"padding_mode={conv.padding_mode!r} (the op pads with zeros, as F.conv2d does)"
    if isinstance(conv.padding, str):
        return f"padding={conv.padding!r} (the op takes explicit paddings)"
    return None


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
        ops=(GROUP_NORM_SILU, CONV_BIAS_RESIDUAL, GROUP_NORM_SILU_CL, CONV_BIAS_CL, CONV_BIAS_RESIDUAL_CL),
        applies=_resnet_applies,
        description="ResnetBlock2D: norm1 + SiLU and norm2 + SiLU, each one GroupNorm+SiLU kernel; "
                    "conv2's bias and the residual add in one pass",
    ),
    Site(
        name="vae.conv",
        cls="torch.nn:Conv2d",
        params=("self", "input"),
        forward=conv_forward,
        ops=(CONV_BIAS,),
        applies=_conv_applies,
        description="every biased Conv2d (CUDA): cuDNN's convolution, then its bias in one vectorized pass",
    ),
    Site(
        name="vae.decoder",
        cls="diffusers.models.autoencoders.vae:Decoder",
        params=("self", "sample", "latent_embeds"),
        forward=decoder_forward,
        ops=(GROUP_NORM_SILU, GROUP_NORM_SILU_CL, CONV_BIAS_CL),
        applies=_decoder_applies,
        description="Decoder: conv_norm_out + conv_act as one GroupNorm+SiLU kernel; quality=\"high\" "
                    "decodes in channels-last memory (no cuDNN layout transposes)",
    ),
    Site(
        name="vae.upsample",
        cls="diffusers.models.upsampling:Upsample2D",
        params=("self", "hidden_states", "output_size", "args", "kwargs"),
        forward=upsample_forward,
        ops=(UPSAMPLE_NEAREST2D,),
        applies=_upsample_applies,
        description="Upsample2D on channels-last memory (the quality=\"high\" decode): the nearest x2 "
                    "repeat as one Triton pass",
    ),
    Site(
        name="vae.group_norm",
        cls="torch.nn:GroupNorm",
        params=("self", "input"),
        forward=group_norm_forward,
        ops=(GROUP_NORM_SILU,),
        applies=_group_norm_applies,
        description="every other GroupNorm (the mid-block attention's group_norm)",
    ),
)

ADAPTER = Adapter(
    family="autoencoder_kl",
    model_classes=("AutoencoderKL", "AutoencoderKLFlux2"),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)
