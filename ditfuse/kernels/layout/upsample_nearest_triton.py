"""WanUpsample (nearest-exact x2 between an fp32 upcast and the cast back) on channels-last
memory in one pass, bit-exact vs torch 2.11 CUDA eager.

``upsample_nearest2x(x)`` for a channels-last ``[N, C, H, W]`` x::

    out[n, c, i, j] = r(float(x[n, c, i // 2, j // 2]))        out: [N, C, 2H, 2W], channels-last

Eager (``WanUpsample.forward``: ``super().forward(x.float()).type_as(x)``) runs three kernels: the
upcast, ``upsample_nearest_exact2d`` on fp32 (nearest-exact at scale 2 reads input ``i // 2``: the
source index is ``floor((i + 0.5) * 0.5)``), and the cast back. For bf16 that is ~50 bytes of
traffic per input element (the fp32 output is four times the input); this kernel reads 2 and
writes 8. The upcast is exact and the cast back of an upcast value returns it, so the only
rounding that can show is NaN's: the cast back runs the instruction c10 runs
(``cvt.rn.bf16.f32`` / ``cvt.rn.f16.f32``, inline PTX, so the compiler cannot fold it with the
upcast into a plain copy), NaN payloads come out as eager's do. fp32 x: a copy.

Used by models/autoencoder_kl_wan.py's ``wan_vae.upsample`` site (the channels-last decode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.host import cdiv, interpreter_on, next_pow2, use_custom_op
from ditfuse.kernels.common.rounding import INTERPRET
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.reference import channels_last_format
from ditfuse.kernels.common.launch import launch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _cast_back(v, DTYPE: tl.constexpr):
    """``r(float(v))`` for a bf16/fp16 v: c10's cast of the upcast value (``__float2bfloat16`` /
    ``__float2half``: ``cvt.rn``), as inline PTX on the GPU."""
    v32 = v.to(tl.float32)
    if INTERPRET:
        # the round trip returns every non-NaN value unchanged; the interpreter's own conversions
        # would flush subnormals, and NaN payloads are the GPU test's to check
        return v
    else:
        if DTYPE == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [v32], dtype=tl.bfloat16,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [v32], dtype=tl.float16,
                                             is_pure=True, pack=1)


@triton.jit
def _up2_cl_kernel(x_ptr, out_ptr, W, C, CAST: tl.constexpr, BW: tl.constexpr, CB: tl.constexpr):
    """Program (r, wb, cb): input row r = n*H + h (its W*C elements contiguous), columns
    ``wb*BW ..``, channels ``cb*CB ..``; written to output rows 2r and 2r + 1 (n*2H + 2h + i),
    columns 2w and 2w + 1."""
    r = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    c = tl.program_id(2) * CB + tl.arange(0, CB)
    m = (w < W)[:, None] & (c < C)[None, :]
    v = tl.load(x_ptr + r * W * C + (w * C)[:, None] + c[None, :], mask=m)
    if CAST:
        v = _cast_back(v, x_ptr.dtype.element_ty)
    for i in tl.static_range(2):
        orow = out_ptr + (2 * r + i) * (2 * W) * C
        for j in tl.static_range(2):
            tl.store(orow + ((2 * w + j) * C)[:, None] + c[None, :], v, mask=m)


def _unsupported_reason(x) -> str | None:
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() != 4 or channels_last_format(x) is None:
        return f"input must be a 4-D channels-last tensor (got {tuple(x.shape)}, strides {tuple(x.stride())})"
    N, C, H, W = x.shape
    if x.stride() != (H * W * C, 1, W * C, C):
        # e.g. a size-1 batch dim with a small stride: eager's upsample then writes NCHW
        return f"strides {tuple(x.stride())} are not the canonical channels-last ones of {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreter_on()):
        return f"device {x.device} not supported (CUDA; CPU only under TRITON_INTERPRET=1)"
    if x.shape[3] * x.shape[1] * 2 >= 2**31:
        return "an output row has >= 2^31 elements"
    if torch.is_grad_enabled() and x.requires_grad:
        return "the input requires grad and grad mode is on (no backward)"
    return None


@torch.library.custom_op("ditfuse::upsample_nearest2x", mutates_args=())
def _upsample_nearest2x_op(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)


def _launch(x: torch.Tensor, cast: bool = True) -> torch.Tensor:
    N, C, H, W = x.shape
    out = torch.empty((N, C, 2 * H, 2 * W), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    CB = min(next_pow2(C), 128)
    BW = max(1, 2048 // CB)
    BW = min(BW, next_pow2(W))
    launch(_up2_cl_kernel, (N * H, cdiv(W, BW), cdiv(C, CB)),
        x, out, W, C, CAST=cast and x.dtype != torch.float32, BW=BW, CB=CB, num_warps=4)
    return out


@_upsample_nearest2x_op.register_fake
def _(x):
    N, C, H, W = x.shape
    return torch.empty((N, C, 2 * H, 2 * W), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


def can_use_upsample_nearest2x(x: torch.Tensor) -> bool:
    """True when :func:`upsample_nearest2x` takes x: a 4-D channels-last (not also contiguous)
    bf16/fp16/fp32 tensor with the canonical channels-last strides (for which eager's upsample
    writes channels-last too) on CUDA (CPU only under TRITON_INTERPRET=1), output rows under 2^31
    elements, no grad required in grad mode."""
    return _unsupported_reason(x) is None


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)``
    (WanUpsample) on a channels-last x, channels-last out, bit-exact vs torch 2.11 CUDA eager
    (kernels/reference.py:wan_upsample). Raises UnsupportedInput where
    :func:`can_use_upsample_nearest2x` is False."""
    reason = _unsupported_reason(x)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.upsample_nearest2x(x)
    return _launch(x)


@torch.library.custom_op("ditfuse::upsample_nearest2d", mutates_args=())
def _upsample_nearest2d_op(x: torch.Tensor) -> torch.Tensor:
    return _launch(x, cast=False)


_upsample_nearest2d_op.register_fake(lambda x: torch.empty(
    (x.shape[0], x.shape[1], 2 * x.shape[2], 2 * x.shape[3]), dtype=x.dtype, device=x.device,
    memory_format=torch.channels_last))


def can_use_upsample_nearest2d(x: torch.Tensor) -> bool:
    """True when :func:`upsample_nearest2d` takes x (the rules of :func:`can_use_upsample_nearest2x`)."""
    return _unsupported_reason(x) is None


def upsample_nearest2d(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=2.0, mode="nearest")`` (diffusers' Upsample2D) on a
    channels-last x: each value repeated 2x2, a bit copy; channels-last out, bit-exact vs torch
    2.11 CUDA eager (whose NHWC upsample kernel ran at ~35 % of copy bandwidth in the
    channels-last AutoencoderKL decode). Raises UnsupportedInput where
    :func:`can_use_upsample_nearest2d` is False."""
    reason = _unsupported_reason(x)
    if reason is not None:
        raise UnsupportedInput(reason)
    if use_custom_op():
        return torch.ops.ditfuse.upsample_nearest2d(x)
    return _launch(x, cast=False)


__all__ = ["upsample_nearest2x", "can_use_upsample_nearest2x", "upsample_nearest2d", "can_use_upsample_nearest2d"]
