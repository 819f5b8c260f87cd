"""A cheaper Triton launch for kernels that are launched again and again with the same specialisation.

``kernel[grid](*args, **kw)`` goes through ``JITFunction.run`` on every call: it binds the
arguments to the signature, specialises each one (dtype, 16-byte alignment, ``== 1`` and
``% 16`` of ints, constexpr values), builds the cache key, finds the compiled kernel, checks the
globals it read, builds launch metadata for its (empty) hook chain, and only then calls the
compiled launcher. On the H100 host of round 16 (bench/probes/probe_host_cost.py, call b) a cached
LayerNorm + modulate launch with its two allocations (``_fire``) took 44.6 µs that way and 31.4 µs
through :func:`launch`; a whole gated LayerNorm + modulate call 111.5 and 56.6 µs; QK-norm + RoPE
76.4 and 57.7 µs. A step makes 200-300 such launches.

:func:`launch` does the same launch with what actually decides the compiled kernel read off the
arguments directly: each tensor's dtype and address mod 16, every other argument's value, the
grid, the keyword arguments (constexprs and compile options), the current device. The first call
with a new combination goes through ``kernel[grid]`` (compiling if needed) and keeps the compiled
kernel it returns; later calls hand the arguments in signature order straight to that kernel's
launcher, exactly as ``JITFunction.run`` would. Anything unusual takes the ordinary path: the
interpreter (``TRITON_INTERPRET=1``), a launch hook (profilers such as proton set one), an
unhashable argument, a non-strided tensor, a kernel object without a ``signature`` (a wrapper
standing in for the JITFunction). With no hook set the fast launch passes no launch
metadata and no hooks (Triton passes its empty hook chains and builds the metadata for them). ``DITFUSE_FAST_LAUNCH=0`` turns the fast path off.

The key holds more than Triton's own specialisation (every int's value, not just its
``== 1 / % 16`` class), so a fast launch never runs a kernel compiled for other arguments; the
cost is more entries (cleared past :data:`MAX_ENTRIES`). Works under CUDA-graph capture (the
launch goes to the current stream, as Triton's) and inside the custom ops torch.compile calls.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from triton import knobs

from ..env import env

MAX_ENTRIES = 8192

_TENSOR = torch.Tensor
_MISS = object()


class _Entry:
    __slots__ = ("kernel", "device", "defaults")

    def __init__(self, kernel: Any, device: int, defaults: tuple) -> None:
        self.kernel = kernel
        self.device = device
        self.defaults = defaults  # (name, default) of the signature's parameters after the positional ones


_CACHES: dict[int, dict] = {}  # id(JITFunction) -> {key: _Entry}
_SIGS: dict[int, list] = {}  # id(JITFunction) -> [(name, default or _MISS)] in signature order
_HOLD: dict[int, Any] = {}  # keeps each JITFunction alive while its id keys the caches
_stats = {"fast": 0, "slow": 0}


def _enabled() -> bool:
    return env("DITFUSE_FAST_LAUNCH", "1") not in ("0", "") and env("TRITON_INTERPRET", "0") in ("", "0")


def _hook_set(h: Any) -> bool:
    # Triton 3.6 keeps each launch hook as a HookChain (never None): set when it holds a call
    return h is not None and (not hasattr(h, "calls") or bool(h.calls))


def _hooks_set() -> bool:
    rt = knobs.runtime
    return _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)


def _params(fn: Any) -> list:
    sig = _SIGS.get(id(fn))
    if sig is None:
        sig = [(name, _MISS if p.default is inspect.Parameter.empty else p.default)
               for name, p in fn.signature.parameters.items()]
        _SIGS[id(fn)] = sig
        _HOLD[id(fn)] = fn
    return sig


def full_arguments(fn: Any, args: tuple, kw: dict) -> tuple:
    """The values ``JITFunction.run`` hands the compiled launcher (``bound_args.values()``): the
    signature's parameters in order, positional arguments first, then each later parameter from
    ``kw`` or its default. Raises TypeError like a call would for a missing one."""
    names = _params(fn)
    if len(args) > len(names):
        raise TypeError(f"{fn}: {len(args)} positional arguments for {len(names)} parameters")
    out = list(args)
    for name, default in names[len(args):]:
        v = kw.get(name, default)
        if v is _MISS:
            raise TypeError(f"{fn}: missing argument {name!r}")
        out.append(v)
    return tuple(out)


def _key(grid: tuple, args: tuple, kw: dict) -> tuple | None:
    parts = []
    for a in args:
        t = type(a)
        if t is int:
            parts.append(a)
        elif isinstance(a, _TENSOR):
            if a.layout is not torch.strided:
                return None
            parts.append((a.dtype, a.data_ptr() & 15))
        else:
            # typed: True == 1 == 1.0 as dict keys, but Triton specialises them apart (i1 / i32 / fp32)
            parts.append((t, a))
    return (grid, tuple(parts), tuple(kw.items()))


def launch(fn: Any, grid: tuple, *args: Any, **kw: Any) -> Any:
    """``fn[grid](*args, **kw)``, through the compiled kernel's launcher once this combination of
    specialising facts has been launched before (module docstring). Returns what ``fn[grid]``
    returns (the CompiledKernel on the GPU)."""
    if not _enabled() or type(grid) is not tuple or getattr(fn, "signature", None) is None:
        # a callable grid is Triton's to evaluate; an object without a signature is not a
        # JITFunction (a wrapper, e.g. tests/support/launch_count.py's): its [grid] must run
        _stats["slow"] += 1
        return fn[grid](*args, **kw)
    cache = _CACHES.get(id(fn))
    try:
        key = _key(grid, args, kw)
        if key is not None:
            hash(key)
        entry = cache.get(key) if (cache is not None and key is not None) else None
    except (TypeError, RuntimeError):  # an unhashable argument; a tensor without storage (fake, meta)
        key, entry = None, None
    if entry is not None and not _hooks_set():
        device = torch.cuda.current_device()
        if device == entry.device:
            k = entry.kernel
            full = args + tuple(kw.get(name, d) for name, d in entry.defaults)
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            k.run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(device), k.function,
                  k.packed_metadata, None, None, None, *full)
            _stats["fast"] += 1
            return k
    _stats["slow"] += 1
    k = fn[grid](*args, **kw)
    if (key is not None and hasattr(k, "function") and hasattr(k, "packed_metadata") and not _hooks_set()
            and not any(isinstance(v, _TENSOR) for v in kw.values())):  # a tensor by keyword: not keyed, never cached
        names = _params(fn)
        full_arguments(fn, args, kw)  # raises now rather than at a fast launch if the call is malformed
        if cache is None:
            cache = _CACHES.setdefault(id(fn), {})
        if len(cache) >= MAX_ENTRIES:
            cache.clear()
        cache[key] = _Entry(k, torch.cuda.current_device(), tuple(names[len(args):]))
    return k


def stats() -> dict[str, int]:
    """Launches taken by the fast path and by ``kernel[grid]`` since the process started (or the
    last :func:`clear`)."""
    return dict(_stats)


def clear() -> None:
    """Forget every cached compiled kernel (the next launch of each goes through ``kernel[grid]``)."""
    _CACHES.clear()
    _stats.update(fast=0, slow=0)


__all__ = ["MAX_ENTRIES", "clear", "full_arguments", "launch", "stats"]
