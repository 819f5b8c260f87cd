"""A convolution's bias and the residual after it, bit-exact vs torch 2.11 CUDA eager, in one pass.

``bias_residual(x, bias, h)`` = ``r(r(x + bias[c]) + h)`` where x is a cuDNN convolution's output
before its bias: aten adds a cuDNN convolution's bias in a separate ``output.add_(bias.reshape(1,
C, 1, ...))`` (aten/src/ATen/native/cudnn/ConvShared.cpp: "cuDNN convolutions does not handle
bias. Bias is handled outside."), and WanResidualBlock then returns ``x + h``. Eager: two passes
over the tensor, the first a broadcast add that TensorIterator cannot vectorize on channels-last
memory; here one read of x and h, one write. Each add is computed in fp32 and rounded to the
dtype (round-to-nearest-even) as eager's bf16/fp16 adds are; launched with fp-fusion off (adds
only: nothing to contract, kept for uniformity).

x, h and the output share one dense layout: channels innermost (channels-last, or any [..., C]
tensor; the Wan VAE's decode), walked as ``[N, C]`` rows, or contiguous NC... (AutoencoderKL's
NCHW decode), walked with the channel ``(i // HW) % C``. See :func:`can_use_bias_residual`.

:func:`conv_bias_residual` puts the convolution in front: ``r(r(conv(x) + bias[c]) + h)`` with
``F.conv2d(..., bias=None)`` (the same cuDNN call aten makes before its own bias pass), so the gate
compares the whole chain, convolution included, with eager's ``h + conv2d(x, w, b)`` at first
sight of each signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import load_f32
from ..common.host import cdiv, SUPPORTED_DTYPES, device_reason, grad_reason, tl_dtype, use_custom_op
from ..common.rounding import round_to, rround
from ..errors import UnsupportedInput
from ..common.launch import launch

BLOCK = 4096


@triton.jit(do_not_specialize=["C", "HW"])
def _bias_residual_kernel(x_ptr, b_ptr, h_ptr, out_ptr, n, C, HW, DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                          NCHW: tl.constexpr = False, HAS_H: tl.constexpr = True):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    if NCHW:  # contiguous [N, C, *spatial]: HW elements per channel plane
        c = ((i // HW) % C).to(tl.int32)
    else:  # channels innermost
        c = (i % C).to(tl.int32)
    if HAS_H:
        v = rround(load_f32(x_ptr + i, m) + load_f32(b_ptr + c, m), DTYPE)
        tl.store(out_ptr + i, round_to(v + load_f32(h_ptr + i, m), DTYPE), mask=m)
    else:  # the bias alone (out may be x: each element is read before the same lane writes it)
        tl.store(out_ptr + i, round_to(load_f32(x_ptr + i, m) + load_f32(b_ptr + c, m), DTYPE), mask=m)


@triton.jit(do_not_specialize=["C", "HW"])
def _bias_residual_mixed_kernel(y_ptr, b_ptr, h_ptr, out_ptr, C, HW, DTYPE: tl.constexpr, Y_CL: tl.constexpr,
                                BHW: tl.constexpr, BC: tl.constexpr, HAS_H: tl.constexpr = True):
    """``out = r(r(y + bias[c]) + h)`` where y and h have different layouts (one contiguous NCHW,
    the other channels innermost); out has h's. Without h: ``out = r(y + bias[c])`` in the other
    layout than y's (a transpose with the bias add). Tiles of BHW positions x BC channels, so both
    sides load coalesced (the compiler turns the tile around through shared memory)."""
    hw = tl.program_id(0) * BHW + tl.arange(0, BHW)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * HW * C
    m = (hw < HW)[:, None] & (c < C)[None, :]
    cl = base + hw[:, None].to(tl.int64) * C + c[None, :]
    nchw = base + c[None, :].to(tl.int64) * HW + hw[:, None]
    if Y_CL:
        y_off = cl
        h_off = nchw
    else:
        y_off = nchw
        h_off = cl
    if HAS_H:
        v = rround(load_f32(y_ptr + y_off, m) + load_f32(b_ptr + c, c < C)[None, :], DTYPE)
        tl.store(out_ptr + h_off, round_to(v + load_f32(h_ptr + h_off, m), DTYPE), mask=m)
    else:
        tl.store(out_ptr + h_off, round_to(load_f32(y_ptr + y_off, m) + load_f32(b_ptr + c, c < C)[None, :], DTYPE),
                 mask=m)


def _channels_innermost(t: torch.Tensor) -> bool:
    """t's memory is ``[N, *spatial, C]`` contiguous (channels-last, or a 2-D [N, C]): flat index
    i holds channel ``i % C``."""
    return t.dim() >= 2 and t.permute(0, *range(2, t.dim()), 1).is_contiguous()


def _unsupported_reason(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> str | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, bias, h)):
        return "x, bias and h must be tensors"
    r = device_reason(x, bias, h) or grad_reason(x, bias, h)
    if r is not None:
        return r
    if x.dtype not in SUPPORTED_DTYPES or bias.dtype != x.dtype or h.dtype != x.dtype:
        return f"dtypes {x.dtype}/{bias.dtype}/{h.dtype}: one of bf16, fp16, fp32 for all (eager would promote)"
    if bias.dim() != 1 or x.dim() < 2 or bias.shape[0] != x.shape[1]:
        return f"bias must be [C] for an x of shape [N, C, ...], got {tuple(bias.shape)} / {tuple(x.shape)}"
    if h.shape != x.shape:
        return "h must have x's shape"
    if not (_channels_innermost(x) and _channels_innermost(h)) and not (x.is_contiguous() and h.is_contiguous()):
        return "x and h must both be dense with their channels innermost (channels-last memory) or both contiguous"
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on"
    return None


def can_use_bias_residual(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> bool:
    """True when :func:`bias_residual` takes these arguments. Rejected: non-tensors; not one device
    (CUDA, or CPU under TRITON_INTERPRET=1); grad required with grad mode on; dtypes not one of
    bf16/fp16/fp32 for all three; bias not ``[C]``; h not of x's shape; x and h not both dense with
    their channels innermost and not both contiguous; CUDA autocast on."""
    return _unsupported_reason(x, bias, h) is None


def _fire(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = r(r(x + bias[c]) + h)``, or ``r(x + bias[c])`` without h (``out`` may then be x)."""
    n = x.numel()
    if n:
        # channels innermost takes that walk even when x is also contiguous ([N, C], or 1x1 spatial:
        # both walks give every element its channel there)
        nchw = not _channels_innermost(x) or (h is not None and not _channels_innermost(h))
        C = x.shape[1]
        launch(_bias_residual_kernel, (cdiv(n, BLOCK),),
               x, bias.contiguous(), x if h is None else h, out, n, C, n // (x.shape[0] * C) if nchw else 1,
               DTYPE=tl_dtype(x.dtype), BLOCK=BLOCK, NCHW=nchw, HAS_H=h is not None,
               num_warps=8, enable_fp_fusion=False)


def _launch(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _fire(x, bias, h, out)
    return out


@torch.library.custom_op("ditfuse::bias_residual", mutates_args=())
def _bias_residual_op(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return _launch(x, bias, h)


@_bias_residual_op.register_fake
def _(x, bias, h):
    return torch.empty_like(x)


def bias_residual(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``r(r(x + bias[c]) + h)``, bitwise equal to torch 2.11 CUDA eager ``x.add_(bias.reshape(1, C,
    1, ...)); x + h``; output in x's layout. Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_bias_residual` is False."""
    reason = _unsupported_reason(x, bias, h)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.bias_residual(x, bias, h)
    return _launch(x, bias, h)


def _conv_reason(x, weight, bias, h, stride, padding, dilation, groups) -> str | None:
    """Why conv_bias_residual (``h`` a tensor) / conv_bias (``h`` None) cannot take these."""
    hs = () if h is None else (h,)
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, bias, *hs)):
        return "x, weight, bias (and h) must be tensors"
    if x.dim() != 4 or weight.dim() != 4:
        return f"x and weight must be 4-D (Conv2d), got {x.dim()}-D and {weight.dim()}-D"
    if any(t.dtype != x.dtype for t in (weight, bias, *hs)):
        return f"dtypes {[str(t.dtype) for t in (x, weight, bias, *hs)]} differ"
    if x.device.type == "cuda" and not torch.backends.cudnn.enabled:
        return "cuDNN is disabled (aten's other convolution paths may add the bias inside)"
    if not all(t.is_contiguous() or _channels_innermost(t) for t in (x, *hs)):
        return "x (and h) must be contiguous (NCHW) or channels-last"
    r = device_reason(x, weight, bias, *hs) or grad_reason(x, weight, bias, *hs)
    if r is not None:
        return r
    if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
        return f"bias {tuple(bias.shape)} is not [out_channels] of weight {tuple(weight.shape)}"
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on"
    return None


def _unbiased_conv(x, weight, bias, h, stride, padding, dilation, groups, predicate=None) -> torch.Tensor:
    """The predicate (``_conv_reason`` unless another is given), then ``F.conv2d(x, weight, None,
    ...)``: the cuDNN call aten's ``_convolution`` makes before it adds a bias in a pass of its own."""
    reason = (predicate or _conv_reason)(x, weight, bias, h, stride, padding, dilation, groups)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.nn.functional.conv2d(x, weight, None, tuple(stride), tuple(padding), tuple(dilation), groups)


def can_use_conv_bias_residual(x, weight, bias, h, stride, padding, dilation, groups) -> bool:
    """True when :func:`conv_bias_residual` takes these arguments: 4-D x and h, each contiguous
    (NCHW) or channels-last,
    a 4-D weight and a ``[out_channels]`` bias, all one dtype, cuDNN enabled, one device (CUDA, or
    CPU under TRITON_INTERPRET=1), no grad in grad mode, no CUDA autocast. Whether the result equals
    eager's is the gate's first-sight comparison (the output shape must also match h's: checked
    after the convolution)."""
    return _conv_reason(x, weight, bias, h, stride, padding, dilation, groups) is None


def conv_bias_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, h: torch.Tensor,
                       stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                       groups: int) -> torch.Tensor:
    """``h + F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` (a ResnetBlock2D's
    ``conv2`` and residual) as ``r(r(conv2d(x, weight) + bias[c]) + h)``: cuDNN's convolution
    without the bias (aten's ``_convolution`` runs exactly this call and then
    ``output.add_(bias.reshape(1, C, 1, 1))``, ConvShared.cpp), then the bias and the residual in
    one pass (:func:`bias_residual`, NCHW or channels-last walk; where the convolution's output and
    h differ in layout, a tiled pass whose output takes h's layout, as eager's ``h + y`` does). Bit-exact vs torch 2.11 CUDA eager where the
    gate's first sight says so. Raises :class:`UnsupportedInput` where
    :func:`can_use_conv_bias_residual` is False or the convolution's output shape is not h's."""
    return _bias_residual_after_conv(_unbiased_conv(x, weight, bias, h, stride, padding, dilation, groups), bias, h)


def _bias_residual_after_conv(y: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``r(r(y + bias[c]) + h)`` for a convolution's unbiased output y (the predicates have checked
    dtypes, devices and h's layout), in h's layout."""
    if y.shape != h.shape:
        raise UnsupportedInput(f"convolution output {tuple(y.shape)} is not h's shape {tuple(h.shape)} (eager would broadcast)")
    if (y.is_contiguous() and h.is_contiguous()) or (_channels_innermost(y) and _channels_innermost(h)):
        if use_custom_op():
            return torch.ops.ditfuse.bias_residual(y, bias, h)
        return _launch(y, bias, h)
    if not (y.is_contiguous() or _channels_innermost(y)):
        raise UnsupportedInput(f"cuDNN returned strides {y.stride()} (neither NCHW nor channels-last)")
    # One layout each: in the NCHW decode the residual stream turns channels-last after the
    # mid-block attention (its output is a channels-last view) while conv2 reads the GroupNorm's
    # NCHW output. Eager's ``input_tensor + hidden_states`` then takes its first operand's layout.
    if use_custom_op():
        return torch.ops.ditfuse.bias_residual_mixed(y, bias, h)
    return _launch_mixed(y, bias, h)


def _launch_mixed(y: torch.Tensor, bias: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """h given: ``r(r(y + b) + h)`` in h's layout (y's is the other one); h None: ``r(y + b)`` from
    channels-last y into a new NCHW tensor."""
    out = torch.empty_like(h) if h is not None else torch.empty(y.shape, dtype=y.dtype, device=y.device)
    N, C = y.shape[0], y.shape[1]
    HW = y.numel() // (N * C) if y.numel() else 0
    if y.numel():
        BHW, BC = 64, min(64, max(16, 1 << (C - 1).bit_length()))
        launch(_bias_residual_mixed_kernel, (cdiv(HW, BHW), cdiv(C, BC), N),
            y, bias.contiguous(), y if h is None else h, out, C, HW, DTYPE=tl_dtype(y.dtype),
            Y_CL=not y.is_contiguous(), BHW=BHW, BC=BC, HAS_H=h is not None, num_warps=4, enable_fp_fusion=False)
    return out


@torch.library.custom_op("ditfuse::bias_add_to_nchw", mutates_args=())
def _bias_add_to_nchw_op(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _launch_mixed(y, bias, None)


@_bias_add_to_nchw_op.register_fake
def _(y, bias):
    return torch.empty(y.shape, dtype=y.dtype, device=y.device)


@torch.library.custom_op("ditfuse::bias_residual_mixed", mutates_args=())
def _bias_residual_mixed_op(y: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return _launch_mixed(y, bias, h)


@_bias_residual_mixed_op.register_fake
def _(y, bias, h):
    return torch.empty_like(h)


def can_use_conv_bias(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """True when :func:`conv_bias` takes these arguments: as :func:`can_use_conv_bias_residual`
    without h (4-D NCHW or channels-last x, 4-D weight, ``[out_channels]`` bias, one dtype, cuDNN enabled)."""
    return _conv_reason(x, weight, bias, None, stride, padding, dilation, groups) is None


def conv_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: tuple[int, int],
              padding: tuple[int, int], dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, dilation, groups)`` as ``r(conv2d(x, weight) +
    bias[c])``: the cuDNN call aten makes, then the bias in one vectorized pass (NCHW, or
    channels-last for a channels-last x: cuDNN's output follows it) written into the convolution's
    output (aten's ``output.add_(bias.reshape(1, C, 1, 1))`` is a broadcast add
    TensorIterator does not vectorize: ~43 % of copy bandwidth in an H100 VAE decode). Bit-exact vs
    torch 2.11 CUDA eager where the gate's first sight says so. Raises :class:`UnsupportedInput`
    where :func:`can_use_conv_bias` is False."""
    y = _unbiased_conv(x, weight, bias, None, stride, padding, dilation, groups)
    if not (y.is_contiguous() or _channels_innermost(y)):  # another layout: aten's own add keeps it
        return y.add_(bias.reshape(1, -1, 1, 1))
    return _bias_in_place(y, bias)


def channels_innermost(t: torch.Tensor) -> bool:
    """t's memory is ``[N, *spatial, C]`` contiguous (dense channels-last of any rank)."""
    return _channels_innermost(t)


def bias_add_inplace(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``r(y + bias[c])`` into a convolution's fresh output y (contiguous or channels innermost, y's
    dtype = bias's), in one vectorized pass: what aten's ``_convolution`` does after its cuDNN call
    with ``output.add_(bias.reshape(1, C, 1, ...))``, a broadcast add it does not vectorize."""
    return _bias_in_place(y, bias)


def _bias_in_place(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``r(y + bias[c])`` written into y (NCHW or channels-last); under torch.compile tracing one
    opaque functional node instead."""
    if use_custom_op():
        return torch.ops.ditfuse.bias_add_nchw(y, bias)
    _fire(y, bias, None, y)
    return y


@torch.library.custom_op("ditfuse::bias_add_nchw", mutates_args=())
def _bias_add_op(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(y)
    _fire(y, bias, None, out)
    return out


@_bias_add_op.register_fake
def _(y, bias):
    return torch.empty_like(y)


# The fewest input channels for which the channels-last convolution ops take a call. Their exactness
# is an observation (cuDNN runs an NCHW convolution as its NHWC kernel between transposes), and
# with few input channels it failed: round 24 (H100), the 8- and 16-channel ResnetBlock2D
# convolutions of tiny-flux's VAE (FLUX.1 Kontext's encode and decode) differed from the NCHW
# convolution by 1 bf16 ulp in 1 to 43 of 12k-260k elements, depending on the data, so a first
# sight could pass and a later call differ. Passing: 32 and 64 (tests/gpu/test_vae_gpu.py's tiny
# VAE), 128-512 (every FLUX.1 / SD3 VAE convolution, probe_vae_channels_last.py).
CL_MIN_IN_CHANNELS = 32


def _cl_conv_reason(x, weight, bias, h, stride, padding, dilation, groups) -> str | None:
    """Why conv_bias_cl / conv_bias_residual_cl cannot take these (their reference is the NCHW
    convolution: only a cuDNN NHWC run that the gate can hold against it)."""
    r = _conv_reason(x, weight, bias, h, stride, padding, dilation, groups)
    if r is not None:
        return r
    if x.dtype not in (torch.bfloat16, torch.float16):
        return (f"dtype {x.dtype}: bf16 / fp16 only (cuDNN's fp32 NHWC kernels accumulate unlike its NCHW path, "
                "layout.conv_channels_last's finding)")
    if groups != 1:
        return f"groups={groups} (only 1)"
    if weight.shape[1] < CL_MIN_IN_CHANNELS:
        return (f"{weight.shape[1]} input channels (fewer than {CL_MIN_IN_CHANNELS}: cuDNN's NCHW convolution "
                "may run another kernel than its NHWC one, CL_MIN_IN_CHANNELS)")
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark is on: cuDNN times algorithms per layout and may pick another kernel"
    return None


def can_use_conv_bias_cl(x, weight, bias, stride, padding, dilation, groups) -> bool:
    """True when :func:`conv_bias_cl` takes these arguments: :func:`can_use_conv_bias`'s rules with
    bf16 or fp16, one group, at least ``CL_MIN_IN_CHANNELS`` (32) input channels, ``cudnn.benchmark`` off (x channels-last saves the transposes; an
    NCHW x, where the norm before it ran its reference, is served as conv_bias would)."""
    return _cl_conv_reason(x, weight, bias, None, stride, padding, dilation, groups) is None


def conv_bias_cl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: tuple[int, int],
                 padding: tuple[int, int], dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """``F.conv2d(x.contiguous(), weight, bias, ...)`` (the NCHW convolution eager runs) computed on
    channels-last x: cuDNN's NHWC kernel without the NCHW <-> NHWC transposes it wraps around an
    NCHW convolution, then the bias in one tiled pass that writes NCHW (eager's layout: cuDNN's
    output transpose and aten's bias add in one pass); bit-exact vs
    torch 2.11 CUDA eager where the gate's first sight says so (an observation about cuDNN's
    heuristics: bench/probes/probe_vae_channels_last.py found all 35 AutoencoderKL decoder
    convolutions bitwise equal). Raises :class:`UnsupportedInput` where :func:`can_use_conv_bias_cl`
    is False."""
    y = _unbiased_conv(x, weight, bias, None, stride, padding, dilation, groups, _cl_conv_reason)
    if y.is_contiguous():  # an NCHW x (the norm fell back to its reference): conv_bias's pass
        return _bias_in_place(y, bias)
    if not _channels_innermost(y):
        raise UnsupportedInput(f"cuDNN returned strides {y.stride()} (neither NCHW nor channels-last)")
    if use_custom_op():
        return torch.ops.ditfuse.bias_add_to_nchw(y, bias)
    return _launch_mixed(y, bias, None)


def can_use_conv_bias_residual_cl(x, weight, bias, h, stride, padding, dilation, groups) -> bool:
    """True when :func:`conv_bias_residual_cl` takes these arguments: :func:`can_use_conv_bias_cl`'s
    rules for x, and h NCHW or channels-last."""
    return _cl_conv_reason(x, weight, bias, h, stride, padding, dilation, groups) is None


def conv_bias_residual_cl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, h: torch.Tensor,
                          stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                          groups: int) -> torch.Tensor:
    """``h + F.conv2d(x.contiguous(), weight, bias, ...)`` (ResnetBlock2D's tail as eager runs it
    on NCHW x) computed on channels-last x: the NHWC convolution without transposes, then the bias
    and the residual in one pass; output in h's layout (eager's). Bit-exact vs torch 2.11 CUDA eager
    where the gate's first sight says so. Raises :class:`UnsupportedInput` where
    :func:`can_use_conv_bias_residual_cl` is False."""
    y = _unbiased_conv(x, weight, bias, h, stride, padding, dilation, groups, _cl_conv_reason)
    return _bias_residual_after_conv(y, bias, h)


__all__ = ["conv_bias_cl", "can_use_conv_bias_cl", "conv_bias_residual_cl", "can_use_conv_bias_residual_cl",
           "bias_residual", "can_use_bias_residual", "conv_bias_residual", "can_use_conv_bias_residual",
           "conv_bias", "can_use_conv_bias", "bias_add_inplace", "channels_innermost"]
