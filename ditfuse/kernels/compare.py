"""Bitwise comparison of tensors, shared by the gate, the tests and the benchmarks (torch only).

Two tensors are *bitwise equal* when their integer views are equal everywhere, except that two
NaNs in the same place count as equal whatever their payloads (eager kernels on different
devices quiet NaNs differently; a NaN where eager has a NaN is the behaviour we promise). -0.0
and +0.0 are different: eager can produce -0.0 and a bit-exact kernel must match it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@dataclass(frozen=True)
class Mismatch:
    """Where two tensors differ. ``index`` is the first differing element (multi-index)."""

    name: str
    count: int
    numel: int
    index: tuple[int, ...]
    actual: float
    expected: float
    actual_bits: int
    expected_bits: int
    nan_diff: int
    inf_diff: int
    first_indices: tuple[tuple[int, ...], ...]

    bits: int = 64

    def __str__(self) -> str:
        mask = (1 << self.bits) - 1
        return (
            f"{self.name}: {self.count} of {self.numel} elements differ bitwise; first at "
            f"{list(self.index)}: got {self.actual!r} (0x{self.actual_bits & mask:x}), "
            f"expected {self.expected!r} (0x{self.expected_bits & mask:x}); "
            f"NaN placement differs at {self.nan_diff}, Inf at {self.inf_diff}; "
            f"first indices {[list(i) for i in self.first_indices]}"
        )


def _as_list(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return list(x)
    return [x]


def first_mismatch(actual: torch.Tensor, expected: torch.Tensor, name: str = "output") -> Mismatch | None:
    """Compare bitwise; None when equal, else a :class:`Mismatch` describing the difference.

    Shapes and dtypes must match (a difference there is reported as a mismatch of all elements).
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Mismatch(
            name=f"{name} (shape/dtype {tuple(actual.shape)}/{actual.dtype} vs "
            f"{tuple(expected.shape)}/{expected.dtype})",
            count=max(actual.numel(), expected.numel()),
            numel=expected.numel(),
            index=(),
            actual=float("nan"),
            expected=float("nan"),
            actual_bits=0,
            expected_bits=0,
            nan_diff=0,
            inf_diff=0,
            first_indices=(),
        )
    if actual.device != expected.device:
        actual = actual.to(expected.device)
    itype = _INT_VIEW.get(expected.dtype)
    if itype is None:  # integer / bool tensors: plain equality
        diff = actual != expected
        a_bits, e_bits = actual, expected
        nan_a = nan_e = torch.zeros_like(diff)
    else:
        a = actual.contiguous()
        e = expected.contiguous()
        a_bits, e_bits = a.view(itype), e.view(itype)
        nan_a, nan_e = torch.isnan(a), torch.isnan(e)
        diff = (a_bits != e_bits) & ~(nan_a & nan_e)
    count = int(diff.sum().item())
    if count == 0:
        return None
    idx = diff.nonzero()
    first = tuple(int(v) for v in idx[0].tolist())
    firsts = tuple(tuple(int(v) for v in row) for row in idx[:5].tolist())
    if itype is None:
        nan_diff = inf_diff = 0
    else:
        nan_diff = int((nan_a != nan_e).sum().item())
        inf_diff = int((torch.isinf(actual) != torch.isinf(expected)).sum().item())
    return Mismatch(
        name=name,
        count=count,
        numel=expected.numel(),
        index=first,
        actual=float(actual[first].item()),
        expected=float(expected[first].item()),
        actual_bits=int(a_bits[first].item()),
        expected_bits=int(e_bits[first].item()),
        nan_diff=nan_diff,
        inf_diff=inf_diff,
        first_indices=firsts,
        bits=expected.element_size() * 8,
    )


def compare_outputs(actual: Any, expected: Any, name: str = "output") -> Mismatch | None:
    """Compare a tensor or a tuple/list of tensors (or None entries) bitwise."""
    a_list, e_list = _as_list(actual), _as_list(expected)
    if len(a_list) != len(e_list):
        raise ValueError(f"{name}: {len(a_list)} outputs vs {len(e_list)} expected")
    for i, (a, e) in enumerate(zip(a_list, e_list)):
        label = name if len(e_list) == 1 else f"{name}[{i}]"
        if a is None and e is None:
            continue
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            if a != e:
                raise AssertionError(f"{label}: non-tensor outputs differ: {a!r} vs {e!r}")
            continue
        mm = first_mismatch(a, e, label)
        if mm is not None:
            return mm
    return None


def effective_strides(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """(dim, stride) of every dim of size > 1: where the elements are in memory. A size-1 dim's
    stride addresses nothing (torch's own contiguity checks skip it)."""
    return tuple((d, st) for d, (n, st) in enumerate(zip(t.shape, t.stride())) if n > 1)


def layout_mismatch(actual: Any, expected: Any, name: str = "output") -> str | None:
    """Where the outputs' memory layouts differ (equal values in another layout change the bits
    of what reads them next: a GEMM picks its kernel by its operands' strides), or None."""
    for i, (a, e) in enumerate(zip(_as_list(actual), _as_list(expected))):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            if effective_strides(a) != effective_strides(e):
                label = name if not isinstance(expected, (tuple, list)) else f"{name}[{i}]"
                return (f"{label}: strides {tuple(a.stride())} where eager's output has {tuple(e.stride())} "
                        f"(shape {tuple(e.shape)})")
    return None


def assert_bitwise_equal(actual: Any, expected: Any, name: str = "output") -> None:
    """Assert bitwise equality (see module doc); the message gives count, first indices and
    values, and how NaN/Inf placement differs."""
    mm = compare_outputs(actual, expected, name)
    if mm is not None:
        raise AssertionError(str(mm))


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in fp32 (the benchmarks' "rel diff" of a close
    provider against eager)."""
    a, e = actual.float(), expected.float()
    return float(((a - e).norm() / e.norm().clamp_min(1e-30)).item())

