"""Launch helpers shared by the elementwise Triton kernels (modulate, activation).

Every elementwise kernel here sees its operands as 3-D strided views ``[B, S, D]``: a row is one
``(b, s)`` pair, ``D`` is the innermost (usually contiguous) dimension. Broadcast operands
(``scale[:, None]``) are plain 3-D views with stride 0 along the broadcast dimensions, so one kernel
body serves per-sample and per-token modulation, contiguous and strided inputs alike; Triton
specialises strides equal to 1, so the contiguous case still gets 16-byte vector accesses.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .rounding import INTERPRET

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TL_DTYPE[dtype]


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_reason(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot be launched on (None when they can): one device, CUDA, or the CPU
    only under ``TRITON_INTERPRET=1``."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            return f"tensors on different devices ({dev} and {t.device})"
    if dev.type == "cuda":
        return None
    if dev.type == "cpu" and interpreter_on():
        return None
    return f"device {dev} is not CUDA (the CPU runs Triton only under TRITON_INTERPRET=1)"


def grad_reason(*tensors: torch.Tensor) -> str | None:
    """The kernels have no backward: reject inputs that would need one."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on (the kernel has no backward)"
    return None


def as_3d(*tensors: torch.Tensor) -> tuple[tuple[int, int, int], list[tuple[int, int, int]]] | None:
    """Common ``[B, S, D]`` sizes (D = the last dim) and each tensor's strides for same-shaped
    tensors, or None when their leading dims cannot be expressed as at most two strided dims
    without a copy.

    Size-1 leading dims are dropped; adjacent leading dims merge when they are mergeable (as in
    ``view``: ``stride[i] == stride[i+1] * size[i+1]``) in *every* tensor. A 0-d tensor is [1, 1, 1].
    """
    shape = tuple(tensors[0].shape)
    if any(tuple(t.shape) != shape for t in tensors):
        return None
    if len(shape) == 0:
        return (1, 1, 1), [(0, 0, 1) for _ in tensors]
    keep = [i for i, n in enumerate(shape[:-1]) if n != 1]
    # groups of leading dims: list of (size, [stride per tensor])
    groups: list[tuple[int, list[int]]] = []
    for i in keep:
        n = shape[i]
        st = [t.stride(i) for t in tensors]
        if groups and all(gs == s * n for gs, s in zip(groups[-1][1], st)):
            groups[-1] = (groups[-1][0] * n, st)
        else:
            groups.append((n, st))
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.insert(0, (1, [0] * len(tensors)))
    (b, sb), (s_, ss) = groups
    strides = [(sb[k], ss[k], t.stride(-1)) for k, t in enumerate(tensors)]
    return (b, s_, shape[-1]), strides


def broadcast_3d(t: torch.Tensor, shape: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """Strides of a ``[B, D]`` / ``[B, 1, D]`` / ``[B, S, D]`` (or broadcastable) operand expanded to
    ``shape`` = (B, S, D), with diffusers' ``t[:, None]`` for 2-D operands (stride 0 along broadcast
    dims); None when it does not broadcast to exactly ``shape``. Integer arithmetic only (no view is
    created: this runs on every call)."""
    nd = t.dim()
    if nd == 2:
        sizes, strides = (t.shape[0], 1, t.shape[1]), (t.stride(0), 0, t.stride(1))
    elif nd == 3:
        sizes, strides = tuple(t.shape), t.stride()
    else:
        return None
    out = []
    for n, st, want in zip(sizes, strides, shape):
        if n == want and n != 1:
            out.append(int(st))
        elif n == 1:
            out.append(0)
        else:
            return None
    return out[0], out[1], out[2]


def tile(d: int, per_program: int = 8192) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): about ``per_program`` elements per program (8 warps), whole
    16-byte vectors. Memory-bound chains (modulate) use 8K (32 elements per thread); GELU's tanh
    keeps two branches live per element and uses 2K (8 per thread) to stay clear of spills."""
    block_d = min(triton.next_power_of_2(max(d, 1)), 1024)
    block_r = max(1, per_program // block_d)
    return block_r, block_d, 8 if block_r * block_d >= 2048 else 4


def overlap_reason(out: torch.Tensor, *inputs: torch.Tensor) -> str | None:
    """Reject an ``out`` that partially overlaps an input's memory (an identical view is fine:
    every element is read before it is written by the same program). Under torch.compile
    tracing, storage addresses do not exist; the check is skipped there (the kernel then sees the
    buffers functionalisation hands it)."""
    if out.numel() == 0 or torch.compiler.is_compiling():
        return None

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = t.data_ptr()
        hi = lo + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) * t.element_size()
        return lo, hi + t.element_size()

    olo, ohi = span(out)
    for t in inputs:
        if t.numel() == 0 or t.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            continue
        lo, hi = span(t)
        if lo < ohi and olo < hi:
            same = t.data_ptr() == out.data_ptr() and t.shape == out.shape and t.stride() == out.stride()
            if not same:
                return "out partially overlaps an input"
    return None


@triton.jit
def load_f32(ptr, mask):
    """Load and widen to fp32 exactly. Under TRITON_INTERPRET=1 the interpreter's bf16 -> fp32
    conversion flushes bf16 subnormals to zero (the GPU's widening is exact), so bf16 is widened
    from its bit pattern there."""
    v = tl.load(ptr, mask=mask, other=0.0)
    if INTERPRET:
        if v.dtype == tl.bfloat16:
            return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return v.to(tl.float32)
    else:
        return v.to(tl.float32)
