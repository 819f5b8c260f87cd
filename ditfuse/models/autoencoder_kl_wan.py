"""AutoencoderKLWan adapter (Wan 2.1 / 2.2 video VAE), diffusers 0.42.1: the RMS_norm + SiLU
chains on one kernel, and the decoder run in channels-last memory (Wan 2.1's up blocks and Wan
2.2's residual up blocks, whose DupUp3D shortcut then runs on channels-last memory too). The same site table
(:func:`site_table`) mounts on AutoencoderKLQwenImage, Qwen-Image's VAE, which diffusers builds
from copies of the Wan 2.1 blocks (``QwenImage*`` classes; an image decodes as one 1-frame chunk).

Eager ``WanRMS_norm`` is nine kernels (cast, norm reduction, clamp, divide, cast, three
elementwise ops) and the SiLU a tenth, ~38 bytes of traffic per bf16 element; the kernel reads x
once and writes once, with the reduction in ``F.normalize``'s CUDA order (notes/wan_vae.md).

**Channels-last decode.** cuDNN runs every NCDHW convolution of the decoder as a transpose to
NDHWC, its NHWC kernel, and a transpose back (41.7 ms of a 480x832x17 decode on the H200). Fed
channels-last tensors it runs the same NHWC kernel without the transposes, so the bits are the
same (``layout.conv_channels_last``, verified per signature by the gate). The decoder site turns
the latent chunk channels-last; everything in between keeps that layout (views, elementwise ops,
nearest upsampling and the norm kernel all follow their input), and the chunk leaves the decoder
contiguous again. Sites:

- ``WanDecoder3d``: channels-last in, contiguous out, when the decode qualifies (:func:`_cl_problem`);
  its head (``norm_out -> SiLU -> conv_out``) runs like a residual block's norm and convolution.
- ``WanCausalConv3d``: on a channels-last input, the ``cat([cache, x])`` + ``F.pad`` of the causal
  padding become one zero-bordered channels-last buffer the convolution reads directly.
- Frame caches: where a norm feeds a causal convolution, the norm kernel stores the frames eager
  clones for the next chunk a second time (dense channels-last), and the next chunk's border launch
  copies them into the padded buffer's front (eager: ``clone``, then ``cat`` and ``F.pad``).
- ``nn.Conv2d`` (WanResample's and the attention block's): the channels-last convolution.
- ``WanResample`` (upsample3d): the frame interleave after the time convolution writes
  channels-last (eager's ``stack`` writes NCDHW, which would end the channels-last run).
- ``WanResidualBlock``: ``norm1 -> SiLU`` and ``norm2 -> SiLU``, each one RMS_norm+SiLU kernel.
- ``WanRMS_norm`` (every other one: ``norm_out``, the attention block's): the norm alone.

The norm's reduction order depends on its input's layout; the NCDHW decode hands it contiguous or
WanResample's T-major tensors, which reduce in the same order when the latent's H*W is a multiple
of 4 (the vector width of torch's reduce kernel), so the channels-last decode runs only then and
the kernel reproduces that order on channels-last memory.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ..contracts.ops import LOSSLESS, OpSet
from ..kernels import reference as ref
from ..kernels.env import env
from ..kernels.layout import CONV_CHANNELS_LAST, UPSAMPLE_NEAREST2X
from ..kernels.modulate import BIAS_RESIDUAL
from ..kernels.norm import WAN_RMS_NORM_SILU, WAN_RMS_NORM_SILU_PAD
from .base import Adapter, Site

DIFFUSERS_VERSIONS = ("0.42.1",)
CACHE_T = 2  # diffusers.models.autoencoders.autoencoder_kl_wan.CACHE_T: frames kept per causal conv
logger = logging.getLogger("ditfuse.models")


# ------------------------------------------------------------------------------ eager's layouts
#
# The NCDHW decode is not NCDHW throughout: the mid block's attention returns a channels-last view
# (its 1x1 projection runs channels-last), and every op after it keeps that layout until
# WanResample's frame interleave writes NCDHW again. Convolutions and norms read their input's
# layout: a channels-last input makes cuDNN skip its transposes and the norm reduce along the
# channels (another order). The channels-last decode must therefore know, for each norm and
# convolution call, which layout the NCDHW decode gave it. The first call of each chunk kind runs
# the NCDHW decode (our kernels, eager's layouts) and records them; later calls replay them:
# an input eager had channels-last runs eager's very call, an NCDHW one our channels-last ops.

NCDHW, CL, OTHER = "ncdhw", "channels-last", "other"


def _layout_class(x: torch.Tensor) -> str:
    if x.is_contiguous():
        return NCDHW
    if _is_cl(x):
        return CL
    if x.dim() == 5:
        B, C, T, Hh, Ww = x.shape
        sb, sc, st, sh, sw = x.stride()
        if (sw, sh, sc, st) == (1, Ww, Hh * Ww, C * Hh * Ww) and (B == 1 or sb == T * C * Hh * Ww):
            return NCDHW  # WanResample's T-major view: reduces like contiguous when H*W % 4 == 0
    return OTHER


class _Layouts:
    """The layouts one chunk kind of the NCDHW decode gave each norm / convolution call."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, tuple[int, ...]], str] = {}
        self.problem: str | None = None

    def record(self, module: Any, x: torch.Tensor, consumed: torch.Tensor | None = None) -> None:
        """``module`` was called with x and ran its computation on ``consumed`` (x by default;
        a causal convolution's padded copy of it)."""
        key, cls = (id(module), tuple(x.shape)), _layout_class(x if consumed is None else consumed)
        if self.seen.setdefault(key, cls) != cls:
            self.problem = f"{type(module).__name__} saw two layouts at one shape"
        elif cls == OTHER:
            self.problem = f"{type(module).__name__} input {tuple(x.shape)} strides {x.stride()}: not reproduced"

    def get(self, module: Any, x: torch.Tensor) -> str:
        cls = self.seen.get((id(module), tuple(x.shape)))
        if cls is None:  # a call the recording decode did not make: later chunks of this kind stay NCDHW
            self.problem = f"{type(module).__name__} called with {tuple(x.shape)}, unseen while recording"
            logger.warning("ditfuse: Wan decoder: %s", self.problem)
            return OTHER
        return cls


_state = threading.local()  # .recording / .replaying: the _Layouts of the decoder call under way
_TABLES: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, _Layouts]]" = weakref.WeakKeyDictionary()
_said: set[str] = set()


@contextmanager
def _active(name: str, layouts: _Layouts) -> Iterator[None]:
    prev = getattr(_state, name, None)
    setattr(_state, name, layouts)
    try:
        yield
    finally:
        setattr(_state, name, prev)


def _eager_layout(module: Any, x: torch.Tensor) -> str | None:
    """Recording: note x's layout, None. Replaying: the layout the NCDHW decode had here."""
    rec = getattr(_state, "recording", None)
    if rec is not None:
        rec.record(module, x)
        return None
    rep = getattr(_state, "replaying", None)
    return None if rep is None else rep.get(module, x)


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        logger.info("ditfuse: %s", msg)


def _norm(norm: Any, x: torch.Tensor, silu: bool, _ops: OpSet) -> torch.Tensor:
    """One WanRMS_norm (+ SiLU): the kernel on eager's layout; in the channels-last decode, on the
    layout the NCDHW decode had here (channels-last there: eager's own chain on channels-last
    memory; NCDHW there: the kernel in the NCDHW order, on whatever layout x has now)."""
    lay = _eager_layout(norm, x)
    if lay is None:
        if _is_cl(x):  # eager's own channels-last input (after the mid block's attention, B > 1)
            _say_once("a WanRMS_norm input is channels-last in eager itself: its reduction runs along the "
                      "channels, an order the kernel does not reproduce; eager's chain runs there")
            return ref.wan_rms_norm_silu(x, norm.gamma, norm.bias, silu)
        return _ops.wan_rms_norm_silu(x, norm.gamma, norm.bias, silu)
    if lay == CL:
        return ref.wan_rms_norm_silu(x if _is_cl(x) else _keep_cl(x), norm.gamma, norm.bias, silu)
    if not _is_cl(x) and _layout_class(x) == NCDHW:
        return _ops.wan_rms_norm_silu(x, norm.gamma, norm.bias, silu)
    return _ops.wan_rms_norm_silu(x if _is_cl(x) else _keep_cl(x), norm.gamma, norm.bias, silu, True)


# The class names of each role in the VAEs built from these blocks: diffusers 0.42.1's
# AutoencoderKLQwenImage (Qwen-Image's VAE) is AutoencoderKLWan's Wan 2.1 code under other names
# (the forwards differ only in spelling; tests/cpu/test_wan_vae_adapter.py compares their sources).
_RMS_NORMS = ("WanRMS_norm", "QwenImageRMS_norm")
_UP_BLOCKS = ("WanUpBlock", "QwenImageUpBlock", "WanResidualUpBlock")


@functools.lru_cache(maxsize=None)
def _forward_takes_first_chunk(cls: type) -> bool:
    return "first_chunk" in inspect.signature(cls.forward).parameters


def _takes_first_chunk(module: Any) -> bool:
    """Wan's decoder and up blocks take ``first_chunk`` (Wan 2.2's DupUp3D needs it); the
    Qwen-Image copies do not."""
    return _forward_takes_first_chunk(type(module))


def _rms_applies(norm: Any) -> str | None:
    if type(norm).__name__ not in _RMS_NORMS:
        return f"{type(norm).__name__} is not WanRMS_norm"
    if not norm.channel_first:
        return "channel_first=False (normalised over the last dim: another reduction)"
    C = norm.gamma.shape[0]
    if norm.scale != C**0.5:
        return f"scale {norm.scale!r} is not sqrt({C})"
    return None


def rms_norm_forward(norm, original, x: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """WanRMS_norm.forward: ``F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma + bias``."""
    return _norm(norm, x, False, _ops)


def _next_cache(cache_x: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """The frames a causal convolution keeps for the next chunk, as WanResidualBlock builds them:
    x's last CACHE_T frames (``cache_x``), with the old cache's last frame in front when x had one."""
    if cache_x.shape[2] < 2 and old is not None:
        return torch.cat([old[:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    return cache_x


def _cache_arg(cache: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """``cache`` where the padded buffer's border launch can copy it in (dense channels-last, x's
    dtype and device: every cache the channels-last decode makes); None: the caller copies it."""
    if (cache is None or cache.dim() != 5 or cache.dtype != x.dtype or cache.device != x.device
            or not ref.dense_channels_last(cache)):
        return None
    return cache


def _causal_conv(conv, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int]) -> torch.Tensor:
    """diffusers' cache bookkeeping around one WanCausalConv3d call, as WanResidualBlock spells it."""
    if feat_cache is None:
        return conv(x)
    idx = feat_idx[0]
    cache_x = _next_cache(x[:, :, -CACHE_T:, :, :].clone(), feat_cache[idx])
    x = conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return x


def _norm_conv(norm: Any, conv: Any, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int],
               _ops: OpSet, pre_bias: torch.Tensor | None = None,
               defer_bias: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv(silu(norm(x)))`` with WanResidualBlock's cache bookkeeping: (output, bias still to
    add). In the channels-last decode, where the NCDHW decode had both inputs NCDHW, the norm
    writes straight into the interior of the convolution's zero-padded channels-last input (eager:
    the norm's output, then ``cat`` with the cached frames and ``F.pad`` into a new tensor).

    ``pre_bias``: x is a convolution's output before its bias; ``defer_bias``: leave this
    convolution's bias to the caller (it goes into the next norm's loads). aten adds a cuDNN
    convolution's bias in a separate pass, so either way the values are eager's."""
    lay_n = _eager_layout(norm, x)
    fuse = (lay_n == NCDHW and feat_cache is not None and _is_cl(x) and x.dim() == 5
            and _eager_layout(conv, x) == NCDHW)
    if fuse:
        wl, wr, ht, hb, front, back = conv._padding
        idx = feat_idx[0]
        cache_in = feat_cache[idx]
        tc = cache_in.shape[2] if cache_in is not None and front > 0 else 0
        fuse = front >= tc and not back and (cache_in is None or (
            cache_in.shape[:2] == x.shape[:2] and cache_in.shape[3:] == x.shape[3:]))
    if not fuse:
        if pre_bias is not None:
            x = x + pre_bias.reshape(1, -1, *([1] * (x.dim() - 2)))
        return _causal_conv(conv, _norm(norm, x, True, _ops), feat_cache, feat_idx), None
    cache = _cache_arg(cache_in, x) if tc else None
    # the norm's last frames come back a second time, dense channels-last, as the next chunk's
    # cache (eager: y[:, :, -2:].clone()); the cached frames go in front of y in the same launches
    xp, kept = _ops.wan_rms_norm_silu_pad(x, norm.gamma, norm.bias, True, True, (wl, wr, ht, hb, front, 0),
                                          pre_bias, cache, min(CACHE_T, x.shape[2]))
    if not _is_cl(xp):  # whatever the gate hands back, the convolution gets channels-last
        xp = _keep_cl(xp)
    if tc and cache is None:
        H, W = x.shape[3], x.shape[4]
        xp[:, :, front - tc:front, ht:ht + H, wl:wl + W].copy_(cache_in.to(x.device))
    cache_x = _next_cache(kept, cache_in)
    bias = conv.bias if not defer_bias else None
    out = _keep_cl(_ops.conv_channels_last(xp, conv.weight, bias, conv.stride, (0, 0, 0)))
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    return out, (conv.bias if defer_bias else None)


def residual_forward(block, original, x: torch.Tensor, feat_cache: list | None = None,
                     feat_idx: list[int] = [0], *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: B006 (diffusers' default)
    """WanResidualBlock.forward with each ``WanRMS_norm -> SiLU`` fused (and, in the channels-last
    decode, written into the next causal convolution's padded input, conv1's bias added inside
    norm2's kernel, conv2's bias and the residual add in one pass)."""
    h = block.conv_shortcut(x)
    if block.training and block.dropout.p > 0:  # dropout sits between norm2 and conv2
        x = _norm_conv(block.norm1, block.conv1, x, feat_cache, feat_idx, _ops)[0]
        x = _causal_conv(block.conv2, block.dropout(_norm(block.norm2, x, True, _ops)), feat_cache, feat_idx)
        return x + h
    x, pending = _norm_conv(block.norm1, block.conv1, x, feat_cache, feat_idx, _ops, defer_bias=True)
    x, pending = _norm_conv(block.norm2, block.conv2, x, feat_cache, feat_idx, _ops, pre_bias=pending,
                            defer_bias=_is_cl(h))
    if pending is None:
        return x + h
    return _ops.bias_residual(x, pending, h)


def _residual_applies(block: Any) -> str | None:
    if type(block.nonlinearity) is not torch.nn.SiLU:
        return f"nonlinearity is {type(block.nonlinearity).__name__}, not SiLU"
    for name in ("norm1", "norm2"):
        r = _rms_applies(getattr(block, name))
        if r is not None:
            return f"{name}: {r}"
    return None


def _is_cl(x: torch.Tensor) -> bool:
    """x is dense channels-last(-3d) memory (and not also contiguous)."""
    return ref.channels_last_format(x) is not None


def _keep_cl(out: torch.Tensor) -> torch.Tensor:
    """Eager's own call on a channels-last input, its output kept channels-last (cuDNN returns it
    so; other backends may not)."""
    return out.contiguous(memory_format=torch.channels_last_3d if out.dim() == 5 else torch.channels_last)


def channels_last_decode_enabled() -> bool:
    """The channels-last decode of the Wan and Qwen-Image VAEs; on unless ``DITFUSE_WAN_VAE_CL=0``
    (the NCDHW decode, its RMS_norm kernels still fused). Wan 2.1 480x832x17, H200: 197.08 ms
    against 213.8 for the NCDHW decode of round 5 (notes/wan_vae.md); the Wan 2.2 and Qwen-Image
    decoders have not been timed either way (round 17)."""
    return env("DITFUSE_WAN_VAE_CL", "1").strip() not in ("", "0")


def _cl_problem(decoder: Any, x: torch.Tensor) -> str | None:
    """Why this decoder call keeps the NCDHW layout (None: it runs channels-last)."""
    if not channels_last_decode_enabled():
        return "DITFUSE_WAN_VAE_CL=0"
    if x.device.type != "cuda" or x.dim() != 5:
        return "not a 5-D CUDA latent"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return (f"{str(x.dtype).replace('torch.', '')}: cuDNN's channels-last fp32 convolutions are not its NCDHW "
                "ones' bits (measured on the H200)")
    if (x.shape[3] * x.shape[4]) % 4:
        return ("latent H*W is not a multiple of 4: the NCDHW decode's norms would reduce in two layout-"
                "dependent orders")
    if not torch.backends.cudnn.is_available() or not torch.backends.cudnn.enabled or torch.backends.cudnn.benchmark:
        return "cuDNN unavailable, disabled or in benchmark mode"
    for blk in decoder.up_blocks:
        if type(blk).__name__ not in _UP_BLOCKS:
            return f"{type(blk).__name__} up blocks are not mirrored"
    return None


def _chunk_kind(feat_cache: list | None) -> tuple:
    """Which cache entries are empty, "Rep" or frames: the first, second and later chunks of a
    decode take different branches (and shapes) through the causal convolutions and resamples."""
    if feat_cache is None:
        return (None,)
    return tuple(None if c is None else ("Rep" if isinstance(c, str) else "t") for c in feat_cache)


def decoder_forward(decoder, original, x: torch.Tensor, feat_cache: list | None = None,
                    feat_idx: list[int] = [0], first_chunk: bool = False,  # noqa: B006 (diffusers' default)
                    *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """WanDecoder3d.forward. The first call of each chunk kind (shape, dtype, cache state) runs the
    NCDHW decode and records its layouts; later ones run on a channels-last copy of the chunk,
    replaying them, and hand the output back contiguous (the decode's ``cat`` of chunks and its
    ``clamp`` then see eager's layout)."""
    def eager():
        if _takes_first_chunk(decoder):
            return original(x, feat_cache, feat_idx, first_chunk)
        return original(x, feat_cache, feat_idx)

    problem = _cl_problem(decoder, x)
    if problem is not None:
        _say_once(f"{type(decoder).__name__} stays NCDHW for latent chunks {tuple(x.shape)}: {problem}")
        return eager()
    tables = _TABLES.setdefault(decoder, {})
    key = (tuple(x.shape), x.dtype, x.device, _chunk_kind(feat_cache))
    layouts = tables.get(key)
    if layouts is None:
        layouts = _Layouts()
        with _active("recording", layouts):
            out = eager()
        tables[key] = layouts
        return out
    if layouts.problem is not None:
        _say_once(f"{type(decoder).__name__} stays NCDHW for latent chunks {tuple(x.shape)}: {layouts.problem}")
        return eager()
    with _active("replaying", layouts):
        out = _decoder_chunk(decoder, x.contiguous(memory_format=torch.channels_last_3d), feat_cache, feat_idx,
                             first_chunk, _ops)
    return out.contiguous()


def _decoder_chunk(decoder, x: torch.Tensor, feat_cache: list | None, feat_idx: list[int], first_chunk: bool,
                   _ops: OpSet) -> torch.Tensor:
    """WanDecoder3d.forward (diffusers 0.42.1) on a channels-last chunk, its head's
    ``norm_out -> SiLU -> conv_out`` run as a residual block's norm and convolution are (the norm
    writing into the convolution's padded input and the next cache; eager: the norm, a SiLU pass,
    a clone of the cached frames, the cat and the pad copy)."""
    x = _causal_conv(decoder.conv_in, x, feat_cache, feat_idx)
    x = decoder.mid_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    for up_block in decoder.up_blocks:
        if _takes_first_chunk(up_block):
            x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx, first_chunk=first_chunk)
        else:
            x = up_block(x, feat_cache=feat_cache, feat_idx=feat_idx)
    if type(decoder.nonlinearity) is torch.nn.SiLU and _rms_applies(decoder.norm_out) is None:
        return _norm_conv(decoder.norm_out, decoder.conv_out, x, feat_cache, feat_idx, _ops)[0]
    return _causal_conv(decoder.conv_out, decoder.nonlinearity(decoder.norm_out(x)), feat_cache, feat_idx)


def causal_conv_forward(conv, original, x: torch.Tensor, cache_x: torch.Tensor | None = None,
                        *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """WanCausalConv3d.forward on a channels-last x: ``F.pad(cat([cache_x, x], 2), causal padding)``
    built as one channels-last buffer (zero border, cache frames, x), then the convolution on it.
    Where the NCDHW decode had x channels-last too, its own call."""
    rec = getattr(_state, "recording", None)
    if rec is not None:  # diffusers' forward, spelled out to see the layout its convolution gets
        padding = list(conv._padding)
        if cache_x is not None and conv._padding[4] > 0:
            x_in = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        else:
            x_in = x
        x_in = F.pad(x_in, padding)
        rec.record(conv, x, x_in)
        return torch.nn.Conv3d.forward(conv, x_in)
    lay = _eager_layout(conv, x)
    if lay == CL and _is_cl(x):
        return _keep_cl(original(x, cache_x))
    if lay != NCDHW or not _is_cl(x) or (cache_x is not None and cache_x.shape[1:2] + cache_x.shape[3:] != x.shape[1:2] + x.shape[3:]):
        return original(x, cache_x)
    wl, wr, ht, hb, front, back = conv._padding
    tc = cache_x.shape[2] if cache_x is not None and front > 0 else 0
    front -= tc
    if front < 0 or back:
        return original(x, cache_x)
    B, C, T, H, W = x.shape
    if not (wl or wr or ht or hb or front or tc):
        xp = x  # F.pad with no padding only copies
    else:
        from ..kernels.layout.pad_channels_last_triton import padded_channels_last

        cache = _cache_arg(cache_x, x) if tc else None
        # the cache frames, when the border launch copies them, sit in the buffer's front frames
        xp = padded_channels_last((B, C, T, H, W), (wl, wr, ht, hb, front + tc, 0), x.dtype, x.device, cache) \
            if cache is not None else \
            padded_channels_last((B, C, tc + T, H, W), (wl, wr, ht, hb, front, 0), x.dtype, x.device)
        inner = xp[:, :, front:, ht:ht + H, wl:wl + W]
        if tc and cache is None:
            inner[:, :, :tc].copy_(cache_x.to(x.device))
        inner[:, :, tc:].copy_(x)
    # the gate hands back the reference's (contiguous) output on a signature's first call
    return _keep_cl(_ops.conv_channels_last(xp, conv.weight, conv.bias, conv.stride, (0, 0, 0)))


def conv2d_forward(conv, original, input: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: A002
    """nn.Conv2d.forward: the channels-last convolution on a channels-last input whose NCDHW-decode
    counterpart was contiguous (one that was channels-last there runs as it did)."""
    lay = _eager_layout(conv, input)
    if lay == CL and _is_cl(input):
        return _keep_cl(original(input))
    if lay != NCDHW or not _is_cl(input):
        return original(input)
    return _keep_cl(_ops.conv_channels_last(input, conv.weight, conv.bias, conv.stride, conv.padding))


def _conv2d_applies(conv: Any) -> str | None:
    if conv.padding_mode != "zeros" or conv.groups != 1 or tuple(conv.dilation) != (1, 1) or isinstance(conv.padding, str):
        return "only zero padding given as ints, groups=1, dilation 1 are mirrored"
    return None


def resample_forward(rs, original, x: torch.Tensor, feat_cache: list | None = None,
                     feat_idx: list[int] = [0], *, _ops: OpSet = LOSSLESS) -> torch.Tensor:  # noqa: B006
    """WanResample.forward (upsample3d, channels-last x): diffusers' cache bookkeeping, the time
    convolution, and the frame interleave (``reshape(b, 2, c, ...)`` + ``stack(.., 3)``) written
    channels-last; the 2-D upsampling and convolution then stay channels-last on their own."""
    if rs.mode != "upsample3d" or feat_cache is None or not _is_cl(x):
        return original(x, feat_cache, feat_idx)
    b, c, t, h, w = x.size()
    idx = feat_idx[0]
    if feat_cache[idx] is None:
        feat_cache[idx] = "Rep"
        feat_idx[0] += 1
    else:
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        if cache_x.shape[2] < 2 and feat_cache[idx] is not None and feat_cache[idx] != "Rep":
            cache_x = torch.cat([feat_cache[idx][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
        if cache_x.shape[2] < 2 and feat_cache[idx] is not None and feat_cache[idx] == "Rep":
            cache_x = torch.cat([torch.zeros_like(cache_x).to(cache_x.device), cache_x], dim=2)
        if feat_cache[idx] == "Rep":
            x = rs.time_conv(x)
        else:
            x = rs.time_conv(x, feat_cache[idx])
        feat_cache[idx] = cache_x
        feat_idx[0] += 1
        if _is_cl(x):
            # out[:, c', 2t'+j] = x[:, j*c + c', t']: [b, t, h, w, (2, c)] memory -> [b, t, 2, h, w, c]
            src = x.permute(0, 2, 3, 4, 1).reshape(b, t, h, w, 2, c)
            x = src.permute(0, 1, 4, 2, 3, 5).contiguous().view(b, 2 * t, h, w, c).permute(0, 4, 1, 2, 3)
        else:  # the convolution fell back to NCDHW: eager's interleave
            x = x.reshape(b, 2, c, t, h, w)
            x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
            x = x.reshape(b, c, t * 2, h, w)
    t = x.shape[2]
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = rs.resample(x)
    return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


def upsample_forward(up, original, x: torch.Tensor, *, _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """WanUpsample.forward (nearest-exact x2 between ``x.float()`` and ``.type_as(x)``) on a
    channels-last input: one pass (``layout.upsample_nearest2x``; eager's fp32 upsample writes
    four times the input at twice its width, and aten's channels-last upsample kernel is slow)."""
    if not _is_cl(x) or x.dim() != 4:
        return original(x)
    n, c, h, w = x.shape
    # the same elements under canonical channels-last strides (WanResample's reshape of a
    # one-frame chunk leaves a size-1 batch dim with stride c, for which eager's upsample would
    # write NCHW and end the channels-last run; the values do not depend on it)
    return _ops.upsample_nearest2x(x.as_strided(x.shape, (h * w * c, 1, w * c, c)))


def _upsample_applies(up: Any) -> str | None:
    sf = up.scale_factor
    sf = tuple(sf) if isinstance(sf, (tuple, list)) else (sf, sf)
    if up.mode != "nearest-exact" or tuple(float(v) for v in sf) != (2.0, 2.0) or up.size is not None \
            or up.recompute_scale_factor:
        return f"mode {up.mode!r}, scale {up.scale_factor!r}: only nearest-exact x2 is mirrored"
    return None


def dup_up_forward(mod, original, x: torch.Tensor, first_chunk: bool = False, *,
                   _ops: OpSet = LOSSLESS) -> torch.Tensor:
    """DupUp3D.forward (Wan 2.2's up-block shortcut) on a channels-last x: the same channel repeat
    and time/space shuffle, done on channels-last memory and left channels-last, so the block's
    ``x + shortcut`` adds two channels-last tensors (eager: ``repeat_interleave`` and a permuted
    copy of NCDHW memory). Data movement only: every output element is an input element::

        out[o, t*ft + a, h*fs + b, w*fs + c] = x[(((o*ft + a)*fs + b)*fs + c) // repeats, t, h, w]
    """
    if not _is_cl(x) or x.dim() != 5:
        return original(x, first_chunk)
    B, C, T, H, W = x.shape
    ft, fs, out = mod.factor_t, mod.factor_s, mod.out_channels
    y = x.permute(0, 2, 3, 4, 1).repeat_interleave(mod.repeats, dim=-1)  # [B, T, H, W, C * repeats]
    y = y.view(B, T, H, W, out, ft, fs, fs).permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()  # [B, T, ft, H, fs, W, fs, out]
    y = y.view(B, T * ft, H * fs, W * fs, out).permute(0, 4, 1, 2, 3)
    if first_chunk:
        y = y[:, :, ft - 1:, :, :]
    return y


def site_table(family: str, module: str, prefix: str, decoder_first_chunk: bool) -> tuple[Site, ...]:
    """The sites of a VAE built from these blocks: ``module`` its diffusers module, ``prefix`` its
    class-name prefix (``Wan``, ``QwenImage``), ``family`` the sites' name prefix;
    ``decoder_first_chunk``: its decoder's forward takes ``first_chunk`` (the Wan module, whose
    Wan 2.2 residual up blocks also have the DupUp3D shortcut)."""
    vae = f"diffusers.models.autoencoders.{module}"
    decoder_params = ("self", "x", "feat_cache", "feat_idx") + (("first_chunk",) if decoder_first_chunk else ())
    return (
        Site(
            name=f"{family}.residual",
            cls=f"{vae}:{prefix}ResidualBlock",
            params=("self", "x", "feat_cache", "feat_idx"),
            forward=residual_forward,
            ops=(WAN_RMS_NORM_SILU, WAN_RMS_NORM_SILU_PAD, CONV_CHANNELS_LAST, BIAS_RESIDUAL),
            applies=_residual_applies,
            description=f"{prefix}ResidualBlock: norm1 + SiLU and norm2 + SiLU, each one RMS_norm+SiLU kernel "
                        "(channels-last decode: written into the next causal conv's padded input)",
        ),
        Site(
            name=f"{family}.rms_norm",
            cls=f"{vae}:{prefix}RMS_norm",
            params=("self", "x"),
            forward=rms_norm_forward,
            ops=(WAN_RMS_NORM_SILU,),
            applies=_rms_applies,
            description=f"every other {prefix}RMS_norm (the attention block's; norm_out where the decoder runs NCDHW)",
        ),
        Site(
            name=f"{family}.decoder",
            cls=f"{vae}:{prefix}Decoder3d",
            params=decoder_params,
            forward=decoder_forward,
            ops=(CONV_CHANNELS_LAST, WAN_RMS_NORM_SILU, WAN_RMS_NORM_SILU_PAD),
            high=False,
            description="the decoder on channels-last memory (each latent chunk in, contiguous out; the head's "
                        "norm_out + SiLU written into conv_out's padded input)",
        ),
        Site(
            name=f"{family}.causal_conv",
            cls=f"{vae}:{prefix}CausalConv3d",
            params=("self", "x", "cache_x"),
            forward=causal_conv_forward,
            ops=(CONV_CHANNELS_LAST,),
            high=False,
            description=f"{prefix}CausalConv3d on channels-last input: cache frames + zero padding in one buffer, "
                        "NHWC conv",
        ),
        Site(
            name=f"{family}.conv2d",
            cls="torch.nn.modules.conv:Conv2d",
            params=("self", "input"),
            forward=conv2d_forward,
            ops=(CONV_CHANNELS_LAST,),
            applies=_conv2d_applies,
            high=False,
            description="nn.Conv2d (resample, attention) on channels-last input: NHWC conv, no transposes",
        ),
        Site(
            name=f"{family}.upsample",
            cls=f"{vae}:{prefix}Upsample",
            params=("self", "x"),
            forward=upsample_forward,
            ops=(UPSAMPLE_NEAREST2X,),
            applies=_upsample_applies,
            high=False,
            description=f"{prefix}Upsample (nearest-exact x2) on channels-last input: the repeat and the fp32 round "
                        "trip in one pass",
        ),
        Site(
            name=f"{family}.resample",
            cls=f"{vae}:{prefix}Resample",
            params=("self", "x", "feat_cache", "feat_idx"),
            forward=resample_forward,
            ops=(CONV_CHANNELS_LAST,),
            high=False,
            description=f"{prefix}Resample upsample3d: the frame interleave written channels-last",
        ),
    ) + ((
        Site(
            name=f"{family}.dup_up",
            cls=f"{vae}:DupUp3D",
            params=("self", "x", "first_chunk"),
            forward=dup_up_forward,
            ops=(),
            high=False,
            description="DupUp3D (Wan 2.2's up-block shortcut) on channels-last input: the channel repeat and "
                        "shuffle on channels-last memory (data movement only)",
        ),
    ) if decoder_first_chunk else ())


SITES = site_table("wan_vae", "autoencoder_kl_wan", "Wan", decoder_first_chunk=True)

ADAPTER = Adapter(
    family="autoencoder_kl_wan",
    model_classes=("AutoencoderKLWan",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=SITES,
)

# Qwen-Image's VAE: the same blocks under QwenImage* names (its decoder has no first_chunk).
QWENIMAGE_SITES = site_table("qwenimage_vae", "autoencoder_kl_qwenimage", "QwenImage", decoder_first_chunk=False)

QWENIMAGE_ADAPTER = Adapter(
    family="autoencoder_kl_qwenimage",
    model_classes=("AutoencoderKLQwenImage",),
    diffusers_versions=DIFFUSERS_VERSIONS,
    sites=QWENIMAGE_SITES,
)
