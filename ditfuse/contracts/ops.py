"""The op tables models call: derived from the op descriptors, one entry per op.

``LOSSLESS.<name>`` is a :class:`GatedOp`: the op's bit-exact kernel (selected through the
registry, loaded lazily on first call) under the bit-exact gate, keyed by the signature the
descriptor declares; wherever the kernel cannot run (not available on this device, disabled by
the environment, an input it does not take) the eager reference runs, which is the very chain
diffusers would have run, so the model's output is the same bits either way.

``HIGH.<name>`` is, for an op with a close variant, a :class:`CloseOp` running that variant (not
under the gate: it is not bitwise equal by design; whether it may run at all is decided before
mounting, by the site guards: admission record, availability), and the lossless op otherwise.

A fast forward takes one of these tables (``_ops=LOSSLESS`` or ``HIGH``) and calls
``_ops.layernorm_modulate(...)``; adding an op is adding a descriptor (kernels/) — the tables,
the registry, the docs and admission's candidates follow.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

from ..kernels import DESCRIPTORS, registry
from ..kernels.common.plans import MAX_ENTRIES, call_key
from ..kernels.errors import UnsupportedInput
from ..kernels.spec import Contract, KeyArg, OpDescriptor
from .bitexact import gate, tensor_signature
from .quality import Quality

logger = logging.getLogger("ditfuse.ops")


def _device_key(device: torch.device) -> str:
    return device.type if device.index is None else f"{device.type}:{device.index}"


class _KeyBinder:
    """Computes a descriptor's signature key from a call's (args, kwargs) without binding through
    ``inspect`` on every call: positions and defaults are resolved once from the reference."""

    def __init__(self, descriptor: OpDescriptor, reference: Callable[..., Any]) -> None:
        params = list(inspect.signature(reference).parameters.values())
        index = {p.name: i for i, p in enumerate(params)}
        self._parts: list[tuple[KeyArg, int, Any]] = []
        for k in descriptor.key:
            if k.name not in index:
                raise ValueError(f"{descriptor.op}: key argument {k.name!r} is not a parameter of its reference")
            p = params[index[k.name]]
            self._parts.append((k, index[k.name], None if p.default is inspect.Parameter.empty else p.default))

    def __call__(self, args: tuple, kwargs: dict) -> Hashable:
        key = []
        for k, i, default in self._parts:
            v = args[i] if i < len(args) else kwargs.get(k.name, default)
            if isinstance(v, torch.Tensor):
                part: Any = tensor_signature(v)
                if k.dims:
                    part = (part, *(v.shape[d] for d in k.dims))
                if k.rank:
                    part = (part, v.dim())
                if k.tail_shape:
                    part = (part, tuple(v.shape[1:]))
                key.append(part)
            elif v is None:
                key.append(None)
            elif k.value:
                key.append(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
        return tuple(key)


class _RegisteredOp:
    """An op's kernel for a device, selected through the registry and imported on first use."""

    def __init__(self, descriptor: OpDescriptor) -> None:
        self.descriptor = descriptor
        self.op = descriptor.op
        self._lock = threading.Lock()
        self._loaded: dict[str, Callable[..., Any] | str] = {}
        self._reference: Callable[..., Any] | None = None

    @property
    def reference(self) -> Callable[..., Any]:
        if self._reference is None:
            self._reference = self.descriptor.load_reference()
        return self._reference

    def _load(self, device: torch.device) -> Callable[..., Any] | str:
        """The kernel for ``device``, or why there is none (a string)."""
        key = _device_key(device)
        got = self._loaded.get(key)
        if got is not None:
            return got
        with self._lock:
            if key not in self._loaded:
                try:
                    self._loaded[key] = registry.select(self.op, device=key).load()
                except registry.KernelDisabledError as e:
                    return str(e)  # not cached: DITFUSE_DISABLE is read again on the next call
                except registry.CapabilityError as e:
                    self._loaded[key] = str(e)
                    logger.info("ditfuse: %s runs eager on %s: %s", self.op, key, e)
                except Exception as e:  # the kernel module failed to import: eager, loudly
                    self._loaded[key] = f"loading its kernel failed: {type(e).__name__}: {e}"
                    logger.warning("ditfuse: %s runs eager on %s: %s", self.op, key, self._loaded[key])
                    self._on_load_failure(key, self._loaded[key])
            return self._loaded[key]

    def _on_load_failure(self, device_key: str, reason: str) -> None:
        pass

    def problem(self, device: torch.device | str) -> str | None:
        """None when the kernel can run on ``device``, else why not (for a site guard)."""
        if registry.is_disabled(self.op):
            return f"{self.op} is disabled by DITFUSE_DISABLE"
        got = self._load(torch.device(device))
        return got if isinstance(got, str) else None

    def kernel(self, device: torch.device | str) -> Callable[..., Any]:
        """The kernel callable itself (RuntimeError when unavailable): for admission and benchmarks."""
        got = self._load(torch.device(device))
        if isinstance(got, str):
            raise RuntimeError(f"{self.op}: {got}")
        return got

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.op})"


class GatedOp(_RegisteredOp):
    """Bit-exact op ``descriptor`` under the gate; its eager reference wherever it cannot run."""

    def __init__(self, descriptor: OpDescriptor) -> None:
        if descriptor.contract is not Contract.BIT_EXACT:
            raise ValueError(f"{descriptor.op} is not bit-exact")
        super().__init__(descriptor)
        self._binder: _KeyBinder | None = None
        self._sigs: dict[tuple, Hashable] = {}
        if descriptor.own_layout:
            gate.owns_layout(descriptor.op)
        if descriptor.per_signature:
            gate.per_signature(descriptor.op)

    def signature(self, *args: Any, **kwargs: Any) -> Hashable:
        if self._binder is None:
            self._binder = _KeyBinder(self.descriptor, self.reference)
        return self._binder(args, kwargs)

    def _on_load_failure(self, device_key: str, reason: str) -> None:
        gate._fallback(self.op, device_key, reason)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kernel = self._load(args[0].device)
        if isinstance(kernel, str) or gate.is_disabled(self.op) or registry.is_disabled(self.op):
            return self.reference(*args, **kwargs)
        # The kernel checks its own inputs (UnsupportedInput): no separate predicate call here.
        keyed = getattr(kernel, "keyed", None)
        if keyed is not None:
            # One geometry key per call (kernels/common/plans.py): the gate's signature and the
            # kernel's predicate and launch recipe are all cached under it.
            key = call_key(args, kwargs)
            if key is not None:
                sig = self._sigs.get(key)
                if sig is None:
                    sig = self.signature(*args, **kwargs)
                    if len(self._sigs) >= MAX_ENTRIES:
                        self._sigs.clear()
                    self._sigs[key] = sig
                return gate.call(self.op, sig, functools.partial(keyed, key), self.reference, *args, **kwargs)
        return gate.call(self.op, self.signature(*args, **kwargs), kernel, self.reference, *args, **kwargs)


class CloseOp(_RegisteredOp):
    """Close op ``descriptor``: its kernel where it takes the input, the eager chain otherwise."""

    def __init__(self, descriptor: OpDescriptor) -> None:
        if descriptor.contract is not Contract.CLOSE:
            raise ValueError(f"{descriptor.op} is not a close op")
        super().__init__(descriptor)
        self.calls: Counter[str] = Counter()  # "kernel" / "eager"

    def exact(self) -> Callable[..., Any]:
        return self.descriptor.load_exact()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kernel = self._load(args[0].device)
        if not isinstance(kernel, str) and not registry.is_disabled(self.op):
            try:
                out = kernel(*args, **kwargs)
            except UnsupportedInput:
                pass
            else:
                self.calls["kernel"] += 1
                return out
        self.calls["eager"] += 1
        return self.reference(*args, **kwargs)


class OpSet:
    """The ops of one quality tier, by name: ``LOSSLESS.layernorm_modulate(...)``.

    ``optional``: names of ops whose path a fast forward takes only when its table says so
    (:meth:`runs`), e.g. the GEMM-GELU, off by default losslessly (slower than cuBLAS + GELU) and
    run by the quality="high" table of a site that declares it (``Site.high_ops``)."""

    def __init__(self, quality: Quality, ops: dict[str, Any], optional: frozenset[str] = frozenset()) -> None:
        self.quality = quality
        self.optional = frozenset(optional)
        self._ops = dict(ops)
        self.__dict__.update(self._ops)

    def runs(self, name: str) -> bool:
        """Whether a fast forward takes optional op ``name``'s path with this table."""
        return name in self.optional

    def __getattr__(self, name: str) -> Any:  # only reached for unknown names
        raise AttributeError(f"no op named {name!r} in the {self.quality.value} op set "
                             f"(ops: {', '.join(sorted(self._ops))})")

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __repr__(self) -> str:
        return f"OpSet({self.quality.value}: {', '.join(sorted(self._ops))})"


GATED: dict[str, GatedOp] = {d.op: GatedOp(d) for d in DESCRIPTORS if d.contract is Contract.BIT_EXACT}
CLOSE: dict[str, CloseOp] = {d.op: CloseOp(d) for d in DESCRIPTORS if d.contract is Contract.CLOSE}
_CLOSE_FOR: dict[str, CloseOp] = {c.descriptor.lossless.op: c for c in CLOSE.values()}

LOSSLESS = OpSet(Quality.LOSSLESS, {g.descriptor.name: g for g in GATED.values()})
HIGH = OpSet(Quality.HIGH, {g.descriptor.name: _CLOSE_FOR.get(g.op, g) for g in GATED.values()})
TIERS = {Quality.LOSSLESS: LOSSLESS, Quality.HIGH: HIGH}


_HIGH_TABLES: dict[tuple[frozenset[str], frozenset[str]], OpSet] = {}
_tables_lock = threading.Lock()


def high_table(ops: Iterable[OpDescriptor], optional: Iterable[OpDescriptor] = ()) -> OpSet:
    """The quality="high" table of a site that declares ``ops`` (and ``optional``, the ops it
    calls only under quality="high"): the close variant of each declared op that has one -- the
    ones the site's guards checked for admission -- and the lossless op for everything else, so a
    helper shared across sites never runs a close kernel a site did not declare. One table per
    combination, shared."""
    optional = tuple(optional)
    declared = frozenset(d.op for d in (*ops, *optional))
    key = (declared, frozenset(d.name for d in optional))
    table = _HIGH_TABLES.get(key)
    if table is None:
        with _tables_lock:
            table = _HIGH_TABLES.setdefault(key, OpSet(
                Quality.HIGH,
                {g.descriptor.name: (_CLOSE_FOR.get(g.op, g) if g.op in declared else g) for g in GATED.values()},
                optional=key[1]))
    return table


def close_variant(descriptor: OpDescriptor) -> CloseOp | None:
    """The close op standing in for bit-exact op ``descriptor`` under quality="high", if any."""
    return _CLOSE_FOR.get(descriptor.op)


def reset_counts() -> None:
    for c in CLOSE.values():
        c.calls.clear()


__all__ = ["GatedOp", "CloseOp", "OpSet", "LOSSLESS", "HIGH", "TIERS", "GATED", "CLOSE", "close_variant",
           "high_table", "reset_counts"]
