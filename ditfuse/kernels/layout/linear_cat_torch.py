"""Two linear projections written straight into their concatenation: the joint attention value.

``linear_cat(x_a, w_a, b_a, x_b, w_b, b_b)`` = ``torch.cat([F.linear(x_a, w_a, b_a),
F.linear(x_b, w_b, b_b)], dim=1)`` for batch 1: each projection's GEMM writes its rows of one
``[1, S_a + S_b, N]`` buffer (``torch.addmm(..., out=rows)``) and the cat's copy (FLUX.1's dual
blocks, Qwen-Image: ~16 µs per block at 1024², notes/layout.md) is gone.

Why the bits are the GEMM's: ``F.linear`` on a contiguous ``[1, S, K]`` input is
``addmm(bias, x.view(-1, K), w.t())`` (aten's ``_flatten_nd_linear``; without a bias ``mm``), the
same structured kernel the ``out=`` form runs, on a contiguous ``[S, N]`` result either way. What
could differ is cuBLASLt's heuristic, which is told each matrix pointer's alignment (capped at 256
bytes): the predicate asks for the second block of rows to start 256-byte aligned, as a fresh
allocation is. That is an argument about aten's dispatch and cuBLASLt's preferences, not a
construction, so the op runs under the bit-exact gate: the first call of each signature (both
shapes, dtypes) is checked against the cat of the two linears and a mismatch sends that
signature to it for good. Batch > 1: the rows of one sample are not one matrix of the buffer, and a
GEMM per sample changes M (another algorithm, other bits): not taken.
"""

from __future__ import annotations

import torch

from ditfuse.kernels.errors import UnsupportedInput

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 256  # bytes: the most alignment cuBLASLt is told about (a fresh allocation has it)


def one_buffer(x_a: torch.Tensor, x_b: torch.Tensor, n: int) -> bool:
    """Whether the two projections' rows can be one buffer's rows as the op writes them: batch 1,
    and the second block of rows (after ``x_a``'s ``S_a`` rows of ``n`` elements) starts 256-byte
    aligned, as a fresh allocation does. The predicate's shape rule; sites ask it first."""
    return (x_a.dim() == 3 and x_b.dim() == 3 and x_a.shape[0] == 1 and x_b.shape[0] == 1
            and (x_a.shape[1] * n * x_a.element_size()) % _ALIGN == 0)


def _unsupported_reason(x_a, w_a, b_a, x_b, w_b, b_b) -> str | None:
    for name, t in (("x_a", x_a), ("w_a", w_a), ("x_b", x_b), ("w_b", w_b)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor"
    if x_a.dim() != 3 or x_b.dim() != 3:
        return "inputs must be [B, S, K]"
    if w_a.dim() != 2 or w_b.dim() != 2 or w_a.shape[0] != w_b.shape[0]:
        return f"weights {tuple(w_a.shape)} / {tuple(w_b.shape)}: two [N, K] with one N"
    if w_a.shape[1] != x_a.shape[2] or w_b.shape[1] != x_b.shape[2]:
        return "an input's width is not its weight's K"
    if (b_a is None) != (b_b is None):
        return "both projections with a bias or neither"
    biases = [b for b in (b_a, b_b) if b is not None]
    for b in biases:
        if not isinstance(b, torch.Tensor) or b.dim() != 1 or b.shape[0] != w_a.shape[0] or not b.is_contiguous():
            return "a bias that is not a contiguous [N]"
    tensors = [x_a, w_a, x_b, w_b, *biases]
    dt = x_a.dtype
    if dt not in _DTYPES or any(t.dtype != dt for t in tensors):
        return "dtypes differ or are not bf16/fp16/fp32 (F.linear would promote or reject)"
    if not x_a.is_contiguous() or not x_b.is_contiguous():
        return "an input is not contiguous (F.linear would take another path)"
    if not one_buffer(x_a, x_b, w_a.shape[0]):
        return (f"batch {x_a.shape[0]}, or a second block of rows not 256-byte aligned: only batch 1 writes each "
                "GEMM's rows as one matrix, and cuBLASLt's heuristic sees the alignment")
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on"
    if torch.is_autocast_enabled("cuda"):
        return "CUDA autocast is on (eager would run another chain)"
    dev = x_a.device
    if dev.type != "cuda" or any(t.device != dev for t in tensors):
        return f"device {dev}: the op is about cuBLAS's GEMM on CUDA (all on one device)"
    return None


def can_use_linear_cat(x_a, w_a, b_a, x_b, w_b, b_b) -> bool:
    """True when :func:`linear_cat` takes these arguments. Rejected: non-tensors; inputs not
    3-D or batch > 1; weights not [N, K] with one N matching the inputs' K; one bias without the
    other, or a bias not a contiguous [N]; mixed dtypes or other than bf16/fp16/fp32; not CUDA or
    on different devices; a non-contiguous input; a second block of rows that would start less
    than 256-byte aligned; grad required with grad mode on; CUDA autocast on. (Whether the bits
    match is the gate's first-sight check.)"""
    return _unsupported_reason(x_a, w_a, b_a, x_b, w_b, b_b) is None


def _write(x, w, b, rows):
    x2 = x.view(-1, x.shape[-1])
    if b is None:
        torch.mm(x2, w.t(), out=rows)
    else:
        torch.addmm(b, x2, w.t(), out=rows)


def linear_cat_into(x_a, w_a, b_a, x_b, w_b, b_b) -> torch.Tensor:
    """The writes alone, on any device (no checks): the CPU tests run it against the reference."""
    s_a = x_a.shape[1]
    out = torch.empty((1, s_a + x_b.shape[1], w_a.shape[0]), dtype=x_a.dtype, device=x_a.device)
    _write(x_a, w_a, b_a, out[0, :s_a])
    _write(x_b, w_b, b_b, out[0, s_a:])
    return out


def linear_cat(x_a: torch.Tensor, w_a: torch.Tensor, b_a: torch.Tensor | None,
               x_b: torch.Tensor, w_b: torch.Tensor, b_b: torch.Tensor | None) -> torch.Tensor:
    """``torch.cat([F.linear(x_a, w_a, b_a), F.linear(x_b, w_b, b_b)], dim=1)`` with each GEMM
    writing its rows of the result; bit-exact where the gate's first-sight check says so. Raises
    UnsupportedInput where :func:`can_use_linear_cat` is False."""
    reason = _unsupported_reason(x_a, w_a, b_a, x_b, w_b, b_b)
    if reason is not None:
        raise UnsupportedInput(reason)
    return linear_cat_into(x_a, w_a, b_a, x_b, w_b, b_b)


__all__ = ["linear_cat", "can_use_linear_cat", "linear_cat_into", "one_buffer"]
