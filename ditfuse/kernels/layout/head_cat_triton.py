"""Head-row copies of the joint attention's [B, H, S, D] tensors, bit-exact (copies) vs torch 2.11
CUDA eager::

    head_cat:         out = torch.cat([a, b], dim=2)           a: [B, H, S_a, D], b: [B, H, S_b, D]
    heads_to_tokens:  out = x.transpose(1, 2).reshape(B, S, H * D)              x: [B, H, S, D]

SD3's ``JointAttnProcessor2_0`` builds the joint value with the cat, from ``to_v(x).view(B, S, H,
D).transpose(1, 2)`` and the text stream's ``add_v_proj``: both inputs are transposed views
(D contiguous, heads interleaved), the output is contiguous (torch.cat's output format is the
inputs' suggested format, which for these strides is the contiguous one). On such inputs aten
runs its non-vectorized ``CatArrayBatchedCopy`` (2-byte elements one by one): 2.29 ms for the 38
calls of an SD3.5-large step on an H100, about a quarter of copy bandwidth. After attention, the
processor turns SDPA's contiguous heads-first output back into token rows with the transpose +
reshape: aten's generic strided copy (``direct_copy_kernel``, not vectorized), ~28 µs per call at
SD3.5-large's [1, 38, 4429, 64] on the H100, 38 calls a step. Both are one kernel here: it moves
each token's D-element head row as a whole (its D elements are contiguous on both sides), from
any [B, H, S] strides to the output's.

Copies: the bits and NaN payloads go through unchanged, whatever the dtype (no arithmetic, no
conversion). The outputs are contiguous, as eager's are; inputs whose layout would make eager's
cat write another format (channels-last-like 4-D strides) are refused, and so is an input whose
transpose + reshape eager returns as a view (no copy to remove).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import fits_int32
from ..common.host import SUPPORTED_DTYPES, cdiv, device_reason, grad_reason, next_pow2, use_custom_op
from ..common.plans import Recipes, call_key
from ..errors import UnsupportedInput
from ..common.launch import launch


@triton.jit
def _head_cat_kernel(a_ptr, b_ptr, out_ptr, H, SA, SB, D,
                     sa0, sa1, sa2, sb0, sb1, sb2, so0, so1, so2,
                     NBA, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, I64: tl.constexpr):
    """Program (p, bh, db): rows ``p * BLOCK_S ..`` of a (p < NBA) or of b (p - NBA), sample and
    head ``bh = b * H + h``, head columns ``db * BLOCK_D ..``; each program reads from one input
    only, so the choice is a scalar branch. Row ``s`` of head ``h`` of sample ``n`` goes to
    ``out + n * so0 + h * so1 + s * so2`` (b's rows after a's: ``s = SA + s_b``); D is
    contiguous in the output. ``SB = 0``: a single input (heads_to_tokens)."""
    p = tl.program_id(0)
    bh = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_S)
    if I64:
        bh = bh.to(tl.int64)
        rows = rows.to(tl.int64)
    n = bh // H
    h = bh - n * H
    dmask = (d < D)[None, :]
    base = out_ptr + (n * so0 + h * so1)
    if p < NBA:
        s = p * BLOCK_S + rows
        m = (s < SA)[:, None] & dmask
        v = tl.load(a_ptr + (n * sa0 + h * sa1) + s[:, None] * sa2 + d[None, :], mask=m)
        dst = base + s[:, None] * so2 + d[None, :]
    else:
        s = (p - NBA) * BLOCK_S + rows
        m = (s < SB)[:, None] & dmask
        v = tl.load(b_ptr + (n * sb0 + h * sb1) + s[:, None] * sb2 + d[None, :], mask=m)
        dst = base + (SA + s)[:, None] * so2 + d[None, :]
    tl.store(dst, v, mask=m)


def _tile(D: int, S: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_D): ~4K elements per program (64 token rows of SD3's 64-wide heads)."""
    block_d = min(next_pow2(D), 256)
    return max(1, min(4096 // block_d, next_pow2(S))), block_d


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
    block_s, block_d = _tile(D, max(SA, SB))
    nba = cdiv(SA, block_s)
    grid = (nba + cdiv(SB, block_s), B * H, cdiv(D, block_d))
    sa, sb = a.stride(), b.stride()
    S = SA + SB
    # out: a new contiguous [B, H, S, D]
    return grid, (H, SA, SB, D, sa[0], sa[1], sa[2], sb[0], sb[1], sb[2], H * S * D, S * D, D, nba), \
        dict(BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)


def _fire(r: tuple | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    B, H, SA, D = a.shape
    out = torch.empty((B, H, SA + b.shape[2], D), dtype=a.dtype, device=a.device)
    if r is None:
        return out
    grid, scalars, consts = r
    launch(_head_cat_kernel, grid, a, b, out, *scalars, I64=not fits_int32(a, b, out), **consts)
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


def _tokens_reason(x) -> str | None:
    if not isinstance(x, torch.Tensor):
        return "input must be a tensor"
    if x.dim() != 4:
        return f"input must be 4-D [B, H, S, D] (got {x.dim()}-D)"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not bf16, fp16 or fp32"
    reason = device_reason(x) or grad_reason(x)
    if reason:
        return reason
    B, H, S, D = x.shape
    if D > 1 and x.stride(3) != 1:
        return "the head dim is not contiguous"
    if H == 1 or D == 1 or x.stride(1) == D * x.stride(3):
        # heads and head dim merge without a copy: eager's reshape returns a view of x
        return "eager's transpose + reshape is a view here (nothing to copy)"
    return None


def can_use_heads_to_tokens(x: torch.Tensor) -> bool:
    """True when :func:`heads_to_tokens` reproduces ``x.transpose(1, 2).reshape(B, S, H * D)``
    with the copy eager makes: a 4-D bf16/fp16/fp32 tensor with its last dim contiguous whose
    heads and head dim eager cannot merge into a view (SDPA's heads-first output), on CUDA (CPU
    only under TRITON_INTERPRET=1), no grad required in grad mode."""
    return _tokens_reason(x) is None


def _tokens_recipe(x: torch.Tensor) -> tuple | None:
    B, H, S, D = x.shape
    if B * H * S * D == 0:
        return None
    block_s, block_d = _tile(D, S)
    nba = cdiv(S, block_s)
    sx = x.stride()
    # out: a new contiguous [B, S, H * D], i.e. [B, H, S, D] with strides (S*H*D, D, H*D, 1)
    return (nba, B * H, cdiv(D, block_d)), (H, S, 0, D, sx[0], sx[1], sx[2], 0, 0, 0, S * H * D, D, H * D, nba), \
        dict(BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)


def _tokens_fire(r: tuple | None, x: torch.Tensor) -> torch.Tensor:
    B, H, S, D = x.shape
    out = torch.empty((B, S, H * D), dtype=x.dtype, device=x.device)
    if r is None:
        return out
    grid, scalars, consts = r
    launch(_head_cat_kernel, grid, x, x, out, *scalars, I64=not fits_int32(x, out), **consts)
    return out


@torch.library.custom_op("ditfuse::heads_to_tokens", mutates_args=())
def _heads_to_tokens_op(x: torch.Tensor) -> torch.Tensor:
    return _tokens_fire(_tokens_recipe(x), x)


@_heads_to_tokens_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    B, H, S, D = x.shape
    return x.new_empty((B, S, H * D))


_TOKENS_RECIPES = Recipes()


def _keyed_tokens(key: tuple | None, x: torch.Tensor) -> torch.Tensor:
    if use_custom_op():
        reason = _tokens_reason(x)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.heads_to_tokens(x)
    if key is None:
        key = call_key((x,))
    r = _TOKENS_RECIPES.checked(key, lambda: _tokens_reason(x), lambda: _tokens_recipe(x))
    return _tokens_fire(r, x)


def heads_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """``x.transpose(1, 2).reshape(B, S, H * D)`` of a heads-first [B, H, S, D] tensor (D
    contiguous; SDPA's output) into a new contiguous [B, S, H * D]: the copy eager's reshape makes,
    bitwise equal by construction. Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_heads_to_tokens` is False (also where eager's reshape is a view). Runs as the
    custom op ``ditfuse::heads_to_tokens`` under torch.compile tracing."""
    return _keyed_tokens(None, x)


heads_to_tokens.keyed = _keyed_tokens

__all__ = ["head_cat", "can_use_head_cat", "heads_to_tokens", "can_use_heads_to_tokens"]
