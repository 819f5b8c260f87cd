"""A convolution's bias and the residual after it, bit-exact vs torch 2.11 CUDA eager, in one pass.

``bias_residual(x, bias, h)`` = ``r(r(x + bias[c]) + h)`` where x is a cuDNN convolution's output
before its bias: aten adds a cuDNN convolution's bias in a separate ``output.add_(bias.reshape(1,
C, 1, ...))`` (aten/src/ATen/native/cudnn/ConvShared.cpp: "cuDNN convolutions does not handle
bias. Bias is handled outside."), and WanResidualBlock then returns ``x + h``. Eager: two passes
over the tensor, the first a broadcast add that TensorIterator cannot vectorize on channels-last
memory; here one read of x and h, one write. Each add is computed in fp32 and rounded to the
dtype (round-to-nearest-even) as eager's bf16/fp16 adds are; launched with fp-fusion off (adds
only: nothing to contract, kept for uniformity).

x, h and the output share one dense layout with the channels innermost (channels-last, or any
[..., C] tensor): the kernel walks them as ``[N, C]`` rows. See :func:`can_use_bias_residual`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import load_f32
from ..common.host import cdiv, SUPPORTED_DTYPES, device_reason, grad_reason, tl_dtype, use_custom_op
from ..common.rounding import round_to, rround
from ..errors import UnsupportedInput

BLOCK = 4096


@triton.jit(do_not_specialize=["C"])
def _bias_residual_kernel(x_ptr, b_ptr, h_ptr, out_ptr, n, C, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c = (i % C).to(tl.int32)
    v = rround(load_f32(x_ptr + i, m) + load_f32(b_ptr + c, m), DTYPE)
    tl.store(out_ptr + i, round_to(v + load_f32(h_ptr + i, m), DTYPE), mask=m)


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
    if not _channels_innermost(x) or not _channels_innermost(h):
        return "x and h must both be dense with their channels innermost (channels-last memory)"
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on"
    return None


def can_use_bias_residual(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> bool:
    """True when :func:`bias_residual` takes these arguments. Rejected: non-tensors; not one device
    (CUDA, or CPU under TRITON_INTERPRET=1); grad required with grad mode on; dtypes not one of
    bf16/fp16/fp32 for all three; bias not ``[C]``; h not of x's shape; x or h not dense with its
    channels innermost; CUDA autocast on."""
    return _unsupported_reason(x, bias, h) is None


def _launch(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _bias_residual_kernel[(cdiv(n, BLOCK),)](x, bias.contiguous(), h, out, n, x.shape[1],
                                                        DTYPE=tl_dtype(x.dtype), BLOCK=BLOCK, num_warps=8,
                                                        enable_fp_fusion=False)
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


__all__ = ["bias_residual", "can_use_bias_residual"]
