"""A 2-D / 3-D convolution run by cuDNN on channels-last memory, bit-exact vs the same convolution
on contiguous NCHW / NCDHW tensors (torch 2.11 CUDA eager, cuDNN 9, ``cudnn.benchmark`` off).

``conv_channels_last(x, weight, bias, stride, padding)`` = ``F.conv{2,3}d(x, weight, bias, stride,
padding)`` with x in channels-last(-3d) memory and the weight converted to it; the output is
channels-last. bf16/fp16 only. ``DITFUSE_CONV_BIAS_PASS=1`` (off by default): the bias goes in as
aten's ``_convolution`` adds it (the unbiased cuDNN call, then ``r(y + bias[c])``), but in one
vectorized pass (modulate/bias_residual_triton.py) instead of aten's broadcast ``add_``. Round 21
(H100, 480x832x17 Wan decode): 1.9 ms less GPU time, but a decode 5 ms slower than on other
machines, with host-bound idle 6 -> 18 ms on a machine whose eager idle was also higher; off
until an A/B on one machine says which (notes/wan_vae.md §9).

Why it is exact, and why it is faster: on the H200, cuDNN runs a bf16 NCDHW convolution as
``nchwToNhwcKernel`` (input) -> an ``..._nhwckrsc_nhwc`` implicit-GEMM kernel -> ``nhwcToNchwKernel``
(output). Given channels-last tensors, its heuristic picks that same NHWC kernel and skips both
transposes, so the accumulation is the same and so are the bits: bench/probes/probe_wan_vae_layout.py
found every one of the 25 convolution shapes of the Wan 2.1 VAE decode at 480x832 bitwise equal,
41.7 ms of transposes per decode gone. That is an observation about cuDNN's heuristics, not a
construction, so the op runs under the bit-exact gate like every other: the first call of each
signature (shapes, stride, padding, dtype) is checked against the contiguous convolution
(kernels/reference.py:conv_channels_last) and a mismatch sends that signature to it for good.

The weight is converted per call (``weight.contiguous(memory_format=...)``: a copy of at most a
few MB, no state to keep in sync with the module); see :func:`can_use_conv_channels_last` for
every rejection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ditfuse.kernels.env import env
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.modulate.bias_residual_triton import bias_add_inplace, channels_innermost

_DTYPES = (torch.bfloat16, torch.float16)


def _format(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last_3d if x.dim() == 5 else torch.channels_last


def _unsupported_reason(x, weight, bias, stride, padding) -> str | None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "input and weight must be tensors"
    if x.dim() not in (4, 5) or weight.dim() != x.dim():
        return f"a [N, C, (D,) H, W] input with a weight of the same rank is needed, got {tuple(x.shape)} / {tuple(weight.shape)}"
    if x.device.type != "cuda":
        return f"device {x.device}: the op is cuDNN's NHWC convolution (CUDA only)"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return (f"dtypes {x.dtype}/{weight.dtype}: bf16 or fp16, all alike (fp32: cuDNN's NHWC fp32 kernels "
                "accumulate unlike its NCHW path; 768 of 8192 elements differed on the H200)")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        return "weight/bias on another device"
    if not x.is_contiguous(memory_format=_format(x)):
        return "input is not dense in channels-last memory"
    if weight.shape[1] != x.shape[1]:
        return f"groups: weight takes {weight.shape[1]} channels, input has {x.shape[1]} (only groups=1)"
    nsp = x.dim() - 2
    if len(tuple(stride)) != nsp or len(tuple(padding)) != nsp or isinstance(padding, str):
        return f"stride/padding must be {nsp}-tuples of ints"
    if not torch.backends.cudnn.is_available() or not torch.backends.cudnn.enabled:
        return "cuDNN is unavailable or disabled (aten's fallback convolution is another computation)"
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark is on: cuDNN times algorithms per layout and may pick another kernel"
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (x, weight, bias)):
        return "an input requires grad and grad mode is on"
    if torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on (eager would run another chain)"
    return None


def can_use_conv_channels_last(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               stride: tuple[int, ...], padding: tuple[int, ...]) -> bool:
    """True when :func:`conv_channels_last` takes these arguments. Rejected: non-tensors; ranks
    other than 4/5 or differing; not CUDA; dtypes other than bf16/fp16 (fp32 was not bitwise on
    the H200) or mixed; an input not dense in channels-last(-3d) memory; grouped convolutions;
    stride/padding not int tuples of the spatial rank; cuDNN unavailable/disabled or
    ``cudnn.benchmark`` on; grad required with grad mode on; CUDA autocast on. (Whether the bits
    match is the gate's first-sight check.)"""
    return _unsupported_reason(x, weight, bias, stride, padding) is None


def conv_channels_last(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       stride: tuple[int, ...], padding: tuple[int, ...]) -> torch.Tensor:
    """``F.conv{2,3}d(x, weight, bias, stride, padding)`` on channels-last x (output channels-last);
    bit-exact vs the contiguous convolution where the gate's first-sight check says so. Raises
    UnsupportedInput where :func:`can_use_conv_channels_last` is False."""
    reason = _unsupported_reason(x, weight, bias, stride, padding)
    if reason is not None:
        raise UnsupportedInput(reason)
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    w = weight.contiguous(memory_format=_format(x))
    if bias is None or env("DITFUSE_CONV_BIAS_PASS", "0") in ("", "0"):
        return conv(x, w, bias, tuple(stride), tuple(padding))
    # aten's _convolution makes this very cuDNN call and then adds the bias with a broadcast add_
    # it does not vectorize; the same r(y + b[c]) in one vectorized pass
    y = conv(x, w, None, tuple(stride), tuple(padding))
    if y.dtype == bias.dtype and bias.dim() == 1 and channels_innermost(y):
        return bias_add_inplace(y, bias)
    return y.add_(bias.reshape(1, -1, *([1] * (y.dim() - 2))))


__all__ = ["conv_channels_last", "can_use_conv_channels_last"]
