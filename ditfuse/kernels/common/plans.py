"""Host-side decisions cached per call geometry: a fused call's CPU cost after its first call.

A fused op's Python does the same work on every step: its predicate (tens of attribute reads and
comparisons) and its launch arithmetic (strides, grids, constexprs, torch's reduce configuration,
rounding dtypes). Both are pure functions of the call's *geometry*: for each tensor its shape,
strides, dtype, device and data-pointer alignment (mod 16 bytes: all that any predicate or
kernel specialisation looks at), ``requires_grad`` in grad mode, the conj/neg bits of complex
tensors; the values of the non-tensor arguments with their types (``eps=1`` and ``eps=1.0`` are
different keys); and the process state they read (grad mode, ``TRITON_INTERPRET``, the
``DITFUSE_ROW_KERNEL`` / ``DITFUSE_QK_KERNEL`` / ``DITFUSE_GATE_RESIDUAL_FLAT`` switches). A
kernel module keeps its launch *recipes* in a :class:`Recipes` per :func:`call_key` and runs its
predicate only when it makes a new one; what is not geometry (the data pointers themselves, storage sizes for 32-bit
addressing, a compiled binary's layout verdict) is still read on every call.

The gate's op (contracts/ops.py ``GatedOp``) computes the key once per call and hands it to the
kernel's ``keyed`` entry, and keeps its own signature per key too. A call that cannot be keyed (a
non-strided tensor, an argument of another type) or one made while torch.compile traces takes
the uncached path: predicate, recipe, launch.

Cost on this project's 2-core CPU: a key is ~0.5-1 µs per tensor; a gated LayerNorm + modulate
call went from ~24 to ~16 µs, Qwen-Image's QK call from ~66 to ~31 µs (launches stubbed;
bench/probes/probe_host_cpu.py, bench/results/host_cpu_round11_cpu.txt).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..env import env
from ..errors import UnsupportedInput

MAX_ENTRIES = 4096  # geometries per function; a server sees a few per shape; cleared when exceeded

_SCALARS = (bool, int, float, str, torch.dtype)
_STRIDED = torch.strided
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MISS = object()
_ENV_SWITCHES = ("TRITON_INTERPRET", "DITFUSE_ROW_KERNEL", "DITFUSE_QK_KERNEL", "DITFUSE_GATE_RESIDUAL_FLAT")
_COMPLEX = frozenset((torch.complex32, torch.complex64, torch.complex128))


def geometry_key(args: tuple) -> tuple | None:
    """The key of ``args`` (module docstring), or None when one of them cannot be keyed.
    ``requires_grad`` only counts in grad mode and the conj/neg bits only on complex tensors:
    nothing looks at them otherwise (one attribute read is ~0.1 µs, and this runs per call)."""
    grad = torch.is_grad_enabled()
    parts: list[Any] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            # Plain tensors and parameters only: a subclass (DTensor, a fake or functional tensor)
            # may have no data pointer, or answer these reads differently.
            if type(a) not in _PLAIN or a.layout is not _STRIDED:
                return None
            dt = a.dtype
            part = (a.shape, a.stride(), dt, a.device, a.data_ptr() % 16)
            if grad:
                part += (a.requires_grad,)
            if dt in _COMPLEX:
                part += (a.is_conj(), a.is_neg())
            parts.append(part)
        elif a is None:
            parts.append(None)
        elif isinstance(a, _SCALARS):
            parts.append((type(a), a))
        elif isinstance(a, tuple):
            inner = geometry_key(a)
            if inner is None:
                return None
            parts.append(inner)
        else:
            return None
    return (tuple(parts), grad, *[env(v) for v in _ENV_SWITCHES])


def call_key(args: tuple, kwargs: dict[str, Any] | None = None) -> tuple | None:
    """:func:`geometry_key` of a call as written (keyword names included); None when unkeyable or
    while torch.compile traces."""
    if torch.compiler.is_compiling():
        return None
    if kwargs:
        key = geometry_key(args + tuple(kwargs.values()))
        return None if key is None else (key, tuple(kwargs))
    return geometry_key(args)


class Recipes:
    """Launch recipes (whatever a kernel module computes from geometry before it launches) per
    call key. ``get(None)`` is a miss and ``put(None, r)`` stores nothing (an unkeyable call)."""

    def __init__(self) -> None:
        self._d: dict[tuple, Any] = {}

    def get(self, key: tuple | None) -> Any:
        return None if key is None else self._d.get(key)

    def put(self, key: tuple | None, recipe: Any) -> Any:
        if key is not None:
            if len(self._d) >= MAX_ENTRIES:
                self._d.clear()
            self._d[key] = recipe
        return recipe

    def checked(self, key: tuple | None, reason: Callable[[], str | None], make: Callable[[], Any]) -> Any:
        """The recipe under ``key``; on a miss the predicate ``reason()`` first (a string raises
        :class:`UnsupportedInput`, nothing is cached), then ``make()``, cached (None too: an empty
        launch is a recipe)."""
        r = _MISS if key is None else self._d.get(key, _MISS)
        if r is _MISS:
            why = reason()
            if why is not None:
                raise UnsupportedInput(why)
            r = self.put(key, make())
        return r

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


__all__ = ["MAX_ENTRIES", "Recipes", "call_key", "geometry_key"]
