"""ditfuse.kernels: what is fused.

The op descriptors (:class:`~ditfuse.kernels.spec.OpDescriptor`, data only) are declared in each
domain package beside their kernels and collected here into ``DESCRIPTORS``; ``_SPECS``, the
registry's inventory, is derived from them. Public kernels and predicates are resolved lazily
(PEP 562): ``ditfuse.kernels.layernorm_modulate`` imports its Triton module on first access, so
``import ditfuse`` / ``import ditfuse.kernels`` import no kernel module and no triton.
"""

from __future__ import annotations

from typing import Any

from . import activation, layout, linear, modulate, norm, rope
from .errors import UnsupportedInput
from .spec import Backend, Capability, Contract, Impl, KernelSpec, KeyArg, OpDescriptor

DESCRIPTORS: tuple[OpDescriptor, ...] = (
    *norm.DESCRIPTORS, *modulate.DESCRIPTORS, *rope.DESCRIPTORS, *activation.DESCRIPTORS, *layout.DESCRIPTORS,
    *linear.DESCRIPTORS,
)


def _check(descriptors: tuple[OpDescriptor, ...]) -> None:
    ops = [d.op for d in descriptors]
    dup = {o for o in ops if ops.count(o) > 1}
    if dup:
        raise ValueError(f"op ids declared twice: {sorted(dup)}")
    names = [d.name for d in descriptors]
    dup = {n for n in names if names.count(n) > 1}
    if dup:  # models call ops by name (ops.LOSSLESS.<name>): names are unique across domains
        raise ValueError(f"op names declared twice: {sorted(dup)}")


_check(DESCRIPTORS)

_SPECS: tuple[KernelSpec, ...] = tuple(s for d in DESCRIPTORS for s in d.specs())

# Public facade: name -> "module:attr". Every spec exports its kernel and its predicate.
_EXPORTS: dict[str, str] = {}
for _spec in _SPECS:
    for _target in (_spec.target, _spec.predicate):
        if _target is not None:
            _EXPORTS.setdefault(_target.partition(":")[2], _target)
    _EXPORTS.update(dict(_spec.exports))
del _spec, _target

__all__ = sorted(
    ["Backend", "Capability", "Contract", "DESCRIPTORS", "Impl", "KernelSpec", "KeyArg", "OpDescriptor",
     "UnsupportedInput", *_EXPORTS]
)


def descriptor(op: str) -> OpDescriptor:
    """The descriptor of op id ``op`` (KeyError naming the registered ops otherwise)."""
    for d in DESCRIPTORS:
        if d.op == op:
            return d
    raise KeyError(f"unknown op {op!r}; registered ops: {', '.join(d.op for d in DESCRIPTORS)}")


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'ditfuse.kernels' has no attribute {name!r}")
    from .spec import _load_target

    value = _load_target(target)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
