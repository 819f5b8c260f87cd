"""adaLN modulate: ``out = r(r(x * r(1 + scale)) + shift)``, bit-exact vs torch 2.11 CUDA eager.

Eager (diffusers ``x * (1 + scale[:, None]) + shift[:, None]``) runs three kernels, each computing in
fp32 ("opmath") and rounding once to the tensor dtype when it stores: ``1 + scale`` (a bf16 tensor
plus a Python scalar stays bf16), the product, the sum. This kernel loads once, computes the same
three fp32 operations, rounds at the same three places (round-to-nearest-even, through
``common.rounding.rround``) and stores once. It is launched with ``enable_fp_fusion=False``: eager
never fuses the product of one op into the add of the next, and in fp32 (where the roundings are
identities) an FMA would change bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import (
    SUPPORTED_DTYPES,
    broadcast_3d,
    device_reason,
    grad_reason,
    load_f32,
    tile,
    tl_dtype,
)
from ..common.rounding import round_to, rround
from ..errors import UnsupportedInput


@triton.jit
def _scale_shift_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    R, S, D,
    sxb, sxs, sxd,
    scb, scs, scd,
    shb, shs, shd,
    sob, sos,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    b = rows // S
    s = rows - b * S
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    c = cols[None, :].to(tl.int64)
    x = load_f32(x_ptr + (b * sxb + s * sxs)[:, None] + c * sxd, mask)
    sc = load_f32(scale_ptr + (b * scb + s * scs)[:, None] + c * scd, mask)
    sh = load_f32(shift_ptr + (b * shb + s * shs)[:, None] + c * shd, mask)
    one_plus = rround(1.0 + sc, DTYPE)  # eager op 1: 1 + scale
    prod = rround(x * one_plus, DTYPE)  # eager op 2: x * (1 + scale)
    out = round_to(prod + sh, DTYPE)  # eager op 3: + shift
    tl.store(out_ptr + (b * sob + s * sos)[:, None] + c, out, mask=mask)


def _unsupported_reason(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> str | None:
    if not all(isinstance(t, torch.Tensor) for t in (x, scale, shift)):
        return "x, scale and shift must be tensors"
    if x.dim() != 3:
        return f"x must be 3-D [B, S, D], got {x.dim()}-D"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not bf16, fp16 or fp32"
    if scale.dtype != x.dtype or shift.dtype != x.dtype:
        # Eager would promote (e.g. bf16 x with fp32 scale computes and returns fp32).
        return f"scale/shift dtype ({scale.dtype}, {shift.dtype}) differs from x ({x.dtype})"
    reason = device_reason(x, scale, shift) or grad_reason(x, scale, shift)
    if reason:
        return reason
    shape = tuple(x.shape)
    for name, t in (("scale", scale), ("shift", shift)):
        if broadcast_3d(t, shape) is None:
            return (
                f"{name} of shape {tuple(t.shape)} is not [B, D], [B, 1, D] or [B, S, D] "
                f"broadcastable to x {shape} (without broadcasting x)"
            )
    return None


def can_use_scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> bool:
    """True when :func:`scale_shift` reproduces eager for these inputs. Rejected (False):
    non-tensors; x not 3-D; dtypes other than bf16/fp16/fp32; scale/shift dtype != x dtype (eager
    would type-promote); tensors on different devices or on the CPU without TRITON_INTERPRET=1;
    an input requiring grad while grad mode is on (no backward); scale/shift not [B, D],
    [B, 1, D] or [B, S, D] broadcastable to x (size-1 batch broadcasts) or broadcasting x itself.
    Any strides are handled (including stride-0 and non-contiguous last dims)."""
    return _unsupported_reason(x, scale, shift) is None


@torch.library.custom_op("ditfuse::scale_shift", mutates_args=())
def _scale_shift_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    sx = x.stride()
    sc = broadcast_3d(scale, (B, S, D))
    sh = broadcast_3d(shift, (B, S, D))
    assert sc is not None and sh is not None
    block_r, block_d, warps = tile(D)
    R = B * S
    grid = (triton.cdiv(R, block_r), triton.cdiv(D, block_d))
    _scale_shift_kernel[grid](
        x, scale, shift, out,
        R, S, D,
        sx[0], sx[1], sx[2],
        sc[0], sc[1], sc[2],
        sh[0], sh[1], sh[2],
        out.stride(0), out.stride(1),
        DTYPE=tl_dtype(x.dtype), BLOCK_R=block_r, BLOCK_D=block_d,
        num_warps=warps, enable_fp_fusion=False,
    )
    return out


@_scale_shift_op.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)


def scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``out = r(r(x * r(1 + scale)) + shift)``, bitwise equal to torch 2.11 CUDA eager
    ``x * (1 + scale[:, None]) + shift[:, None]`` (r = round to x's dtype, nearest-even).

    x: [B, S, D] (any strides); scale, shift: [B, D] / [B, 1, D] per sample or [B, S, D] per token,
    same dtype as x (bf16, fp16 or fp32). Returns a new contiguous [B, S, D] tensor. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_scale_shift` is False. Runs as the
    custom op ``ditfuse::scale_shift`` (one opaque node under torch.compile / CUDA graphs).
    """
    reason = _unsupported_reason(x, scale, shift)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.scale_shift(x, scale, shift)


__all__ = ["scale_shift", "can_use_scale_shift"]
