"""Two heads-first views joined along the sequence, bit-exact (a copy) vs torch 2.11 CUDA eager::

    out = torch.cat([a, b], dim=2)      a: [B, H, S_a, D], b: [B, H, S_b, D]  ->  out: [B, H, S_a + S_b, D]

SD3's ``JointAttnProcessor2_0`` builds the joint value this way from ``to_v(x).view(B, S, H,
D).transpose(1, 2)`` and the text stream's ``add_v_proj``: both inputs are transposed views
(D contiguous, heads interleaved), the output is contiguous (torch.cat's output format is the
inputs' suggested format, which for these strides is the contiguous one). On such inputs aten
runs its non-vectorized ``CatArrayBatchedCopy`` (2-byte elements one by one): 2.29 ms for the 38
calls of an SD3.5-large step on an H100, about a quarter of copy bandwidth. This kernel moves
each token's D-element head row as a whole (its D elements are contiguous on both sides).

A copy: the bits and NaN payloads go through unchanged, whatever the dtype (no arithmetic, no
conversion). The output is contiguous, as eager's is; inputs whose layout would make eager's cat
write another format (channels-last-like 4-D strides) are refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import fits_int32
from ..common.host import SUPPORTED_DTYPES, cdiv, device_reason, grad_reason, next_pow2, use_custom_op
from ..common.plans import Recipes, call_key
from ..errors import UnsupportedInput


@triton.jit
def _head_cat_kernel(a_ptr, b_ptr, out_ptr, H, SA, SB, D,
                     sa0, sa1, sa2, sb0, sb1, sb2,
                     NBA, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, I64: tl.constexpr):
    """Program (p, bh, db): rows ``p * BLOCK_S ..`` of a (p < NBA) or of b (p - NBA), sample and
    head ``bh = b * H + h``, head columns ``db * BLOCK_D ..``; each program reads from one input
    only, so the choice is a scalar branch."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_S)
    if I64:
        bh = bh.to(tl.int64)
        rows = rows.to(tl.int64)
    n = bh // H
    h = bh - n * H
    S = SA + SB
    dmask = (d < D)[None, :]
    if p < NBA:
        s = p * BLOCK_S + rows
        m = (s < SA)[:, None] & dmask
        v = tl.load(a_ptr + (n * sa0 + h * sa1) + s[:, None] * sa2 + d[None, :], mask=m)
        dst = out_ptr + (bh * S + s)[:, None] * D + d[None, :]
    else:
        s = (p - NBA) * BLOCK_S + rows
        m = (s < SB)[:, None] & dmask
        v = tl.load(b_ptr + (n * sb0 + h * sb1) + s[:, None] * sb2 + d[None, :], mask=m)
        dst = out_ptr + (bh * S + SA + s)[:, None] * D + d[None, :]
    tl.store(dst, v, mask=m)


def _unsupported_reason(a, b) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return "inputs must be tensors"
    if a.dim() != 4 or b.dim() != 4:
        return f"inputs must be 4-D [B, H, S, D] (got {a.dim()}-D and {b.dim()}-D)"
    if a.shape[:2] != b.shape[:2] or a.shape[3] != b.shape[3]:
        return f"shapes {tuple(a.shape)} and {tuple(b.shape)} differ outside the sequence dim"
    if a.dtype != b.dtype or a.dtype not in SUPPORTED_DTYPES:
        return f"dtypes ({a.dtype}, {b.dtype}) are not one of bf16, fp16, fp32 (cat would promote mixed ones)"
    reason = device_reason(a, b) or grad_reason(a, b)
    if reason:
        return reason
    if a.shape[3] > 1 and (a.stride(3) != 1 or b.stride(3) != 1):
        return "the head dim is not contiguous in both inputs"
    for t in (a, b):
        if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
            # cat keeps a format every input suggests: eager's output would be channels-last
            return f"input strides {tuple(t.stride())} are channels-last: eager's cat would write that format"
    return None


def can_use_head_cat(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when :func:`head_cat` reproduces ``torch.cat([a, b], dim=2)``: two 4-D tensors of one
    dtype (bf16, fp16, fp32) equal in B, H and D, the last dim contiguous in both (any other
    strides), neither channels-last (eager's cat would then write channels-last), on CUDA (CPU
    only under TRITON_INTERPRET=1), no grad required in grad mode."""
    return _unsupported_reason(a, b) is None


def _recipe(a: torch.Tensor, b: torch.Tensor) -> tuple | None:
    B, H, SA, D = a.shape
    SB = b.shape[2]
    if B * H * (SA + SB) * D == 0:
        return None
    block_d = min(next_pow2(D), 256)
    # ~4K elements per program: 64 token rows of SD3's 64-wide heads
    block_s = max(1, min(4096 // block_d, next_pow2(max(SA, SB))))
    nba = cdiv(SA, block_s)
    grid = (nba + cdiv(SB, block_s), B * H, cdiv(D, block_d))
    sa, sb = a.stride(), b.stride()
    return grid, (H, SA, SB, D, sa[0], sa[1], sa[2], sb[0], sb[1], sb[2], nba), \
        dict(BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)


def _fire(r: tuple | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    B, H, SA, D = a.shape
    out = torch.empty((B, H, SA + b.shape[2], D), dtype=a.dtype, device=a.device)
    if r is None:
        return out
    grid, scalars, consts = r
    _head_cat_kernel[grid](a, b, out, *scalars, I64=not fits_int32(a, b, out), **consts)
    return out


@torch.library.custom_op("ditfuse::head_cat", mutates_args=())
def _head_cat_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _fire(_recipe(a, b), a, b)


@_head_cat_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    B, H, SA, D = a.shape
    return a.new_empty((B, H, SA + b.shape[2], D))


_RECIPES = Recipes()


def _keyed(key: tuple | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if use_custom_op():
        reason = _unsupported_reason(a, b)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.head_cat(a, b)
    if key is None:
        key = call_key((a, b))
    r = _RECIPES.checked(key, lambda: _unsupported_reason(a, b), lambda: _recipe(a, b))
    return _fire(r, a, b)


def head_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.cat([a, b], dim=2)`` of two [B, H, S_i, D] tensors (any strides with D contiguous)
    into a new contiguous [B, H, S_a + S_b, D]: a copy, bitwise equal to eager by construction.
    Raises :class:`UnsupportedInput` exactly where :func:`can_use_head_cat` is False. Runs as the
    custom op ``ditfuse::head_cat`` under torch.compile tracing."""
    return _keyed(None, a, b)


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
head_cat.keyed = _keyed

__all__ = ["head_cat", "can_use_head_cat"]
