"""Op descriptors and kernel specs: metadata describing what is fused. Data only.

An :class:`OpDescriptor` is the one place an op exists: its id, the eager chain it replaces
(``reference``, a torch-only function), the fp64 math of that chain (``exact``), its numerical
contract, the gate's signature key, and its kernels (one :class:`Impl` per backend). It is
declared in its domain package's ``__init__`` beside the kernel files. The registry, the gate's
op table, the quality="high" op table, admission's candidates and the generated docs are all
derived from the descriptors. A :class:`KernelSpec` is one backend of one op, as the registry
selects it.

Importing this module imports neither torch nor triton: the registry, the CLI's
``ditfuse kernels`` and the generated docs page all work from metadata alone; a kernel module is
imported only when ``KernelSpec.load()`` is called.
"""

from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from typing import Any


class Backend(str, enum.Enum):
    TRITON = "triton"
    CUDA = "cuda"
    TORCH = "torch"

    def __str__(self) -> str:
        return self.value


class Contract(str, enum.Enum):
    """The numerical promise a kernel makes against the eager chain it replaces.

    BIT_EXACT: every output bit equals torch 2.11 CUDA eager (mounted under quality="lossless").
    CLOSE: differs only at rounding-order level and passed the fp64 admission test (mounted only
    under quality="high").
    """

    BIT_EXACT = "bit_exact"
    CLOSE = "close"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Capability:
    """One way a kernel can run: a device type and, for CUDA, a minimum compute capability.

    ``interpreter=True`` marks a CPU capability that exists only under ``TRITON_INTERPRET=1``
    (Triton's interpreter executes the kernel with numpy; used by the CPU tests).
    """

    device: str
    min_cc: tuple[int, int] | None = None
    interpreter: bool = False

    def describe(self) -> str:
        if self.device == "cuda" and self.min_cc is not None:
            return f"cuda sm_{self.min_cc[0]}{self.min_cc[1]}+"
        if self.interpreter:
            return f"{self.device} (TRITON_INTERPRET=1)"
        return self.device


def _load_target(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"target {target!r} is not of the form 'package.module:attr'")
    module = importlib.import_module(module_name)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel.

    op: ``"<domain>.<name>"``, e.g. ``"norm.layernorm_modulate"``.
    backend: which implementation technology.
    target: ``"module:attr"`` of the callable kernel; imported lazily by :meth:`load`.
    predicate: ``"module:attr"`` of ``can_use_<op>(...) -> bool`` (same lazy import).
    capabilities: any one of them suffices (an OR of requirements).
    contract: bit_exact or close.
    replaces: the eager chain it replaces, in words/formula.
    summary: one line for the inventory.
    exports: extra public names for the lazy facade (``name -> "module:attr"``).
    """

    op: str
    backend: Backend
    target: str
    capabilities: frozenset[Capability]
    contract: Contract
    replaces: str
    summary: str
    predicate: str | None = None
    exports: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        domain, dot, name = self.op.partition(".")
        if not dot or not domain or not name:
            raise ValueError(f"op id {self.op!r} must be '<domain>.<name>'")
        if not self.capabilities:
            raise ValueError(f"{self.op}: at least one capability is required")
        if not isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", Backend(self.backend))
        if not isinstance(self.contract, Contract):
            object.__setattr__(self, "contract", Contract(self.contract))
        if not isinstance(self.capabilities, frozenset):
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))

    @property
    def domain(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.op.split(".", 1)[1]

    @property
    def key(self) -> str:
        return f"{self.op}[{self.backend.value}]"

    def load(self) -> Any:
        """Import and return the kernel callable named by ``target``."""
        return _load_target(self.target)

    def load_predicate(self) -> Any:
        """Import and return ``can_use_<op>``; a spec without one accepts every input."""
        if self.predicate is None:
            return lambda *args, **kwargs: True
        return _load_target(self.predicate)

    def describe_capabilities(self) -> str:
        return " | ".join(sorted(c.describe() for c in self.capabilities))


# ------------------------------------------------------------------------------ descriptors


@dataclass(frozen=True)
class KeyArg:
    """One argument's share of the bit-exact gate's signature key.

    A tensor contributes its dtype, device type and strides class (always), the sizes of
    ``dims`` (the dims its arithmetic depends on, e.g. the reduced width ``-1``) and, with
    ``rank``, its number of dims (per-sample ``[B, D]`` vs per-token ``[B, S, D]`` operands take
    different code paths); with ``tail_shape`` all its sizes but the first. ``None`` contributes
    ``None``. A non-tensor argument contributes its
    value when ``value`` is set (eps, dtypes, flags), else nothing.
    """

    name: str
    dims: tuple[int, ...] = ()
    rank: bool = False
    value: bool = False
    # All sizes but the batch dim (ops whose reduction spans every non-batch dim, e.g. GroupNorm:
    # the per-group element count fixes torch's chain lengths and tree).
    tail_shape: bool = False


@dataclass(frozen=True)
class Impl:
    """One backend's kernel for an op: ``target`` / ``predicate`` are ``"module:attr"``."""

    backend: Backend
    target: str
    capabilities: frozenset[Capability]
    predicate: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.backend, Backend):
            object.__setattr__(self, "backend", Backend(self.backend))
        if not isinstance(self.capabilities, frozenset):
            object.__setattr__(self, "capabilities", frozenset(self.capabilities))


@dataclass(frozen=True)
class OpDescriptor:
    """Everything about one op, declared once.

    op: ``"<domain>.<name>"``; ``name`` is also the attribute models call it by
    (``ops.LOSSLESS.layernorm_modulate``).
    contract: BIT_EXACT (mounted under quality="lossless", verified by the gate) or CLOSE
    (quality="high" only, admitted by the fp64 test).
    replaces: the eager chain, as a formula; summary: one line for the inventory.
    reference: ``"module:attr"`` of the eager chain (kernels/reference.py); a CLOSE op defaults to
    its lossless sibling's.
    exact: ``"module:attr"`` of the chain's fp64 math (kernels/exact.py); CLOSE ops need one
    (their own or their sibling's).
    key: the gate's signature key (:class:`KeyArg` per argument that changes the arithmetic);
    key_note says why the other dims are left out.
    impls: the kernels, one per backend.
    lossless: for a CLOSE op, the bit-exact op it stands in for under quality="high".
    own_layout: the output's memory layout is part of what the op does, not eager's (a
    convolution on channels-last memory writes channels-last where its reference writes
    contiguous): the gate then compares values only, and every site calling the op keeps that
    layout inside its own region and hands eager's layout back where the region ends.
    per_signature: the op's exactness is an observation per problem, not a construction (cuDNN
    picks its convolution kernel per shape and layout): a bitwise mismatch sends that signature
    to eager for the rest of the process, not the whole op (the other signatures were or will be
    verified one by one, at first sight).
    """

    op: str
    contract: Contract
    replaces: str
    summary: str
    impls: tuple[Impl, ...]
    reference: str | None = None
    exact: str | None = None
    key: tuple[KeyArg, ...] = ()
    key_note: str = ""
    lossless: "OpDescriptor | None" = None
    own_layout: bool = False
    per_signature: bool = False

    def __post_init__(self) -> None:
        domain, dot, name = self.op.partition(".")
        if not dot or not domain or not name:
            raise ValueError(f"op id {self.op!r} must be '<domain>.<name>'")
        if not isinstance(self.contract, Contract):
            object.__setattr__(self, "contract", Contract(self.contract))
        if not self.impls:
            raise ValueError(f"{self.op}: at least one kernel (Impl) is required")
        if self.contract is Contract.CLOSE:
            if self.lossless is None or self.lossless.contract is not Contract.BIT_EXACT:
                raise ValueError(f"{self.op}: a close op names the bit-exact op it stands in for (lossless=...)")
            if self.exact_target is None:
                raise ValueError(f"{self.op}: a close op needs fp64 exact math (exact=...) for admission")
        elif self.lossless is not None:
            raise ValueError(f"{self.op}: only close ops have a lossless sibling")
        if self.reference_target is None:
            raise ValueError(f"{self.op}: no reference chain")

    @property
    def domain(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.op.split(".", 1)[1]

    @property
    def reference_target(self) -> str | None:
        return self.reference or (self.lossless.reference if self.lossless is not None else None)

    @property
    def exact_target(self) -> str | None:
        return self.exact or (self.lossless.exact if self.lossless is not None else None)

    def load_reference(self) -> Any:
        return _load_target(self.reference_target)

    def load_exact(self) -> Any:
        if self.exact_target is None:
            raise ValueError(f"{self.op} has no fp64 exact math")
        return _load_target(self.exact_target)

    def specs(self) -> tuple[KernelSpec, ...]:
        """The registry entries: one KernelSpec per backend."""
        return tuple(
            KernelSpec(
                op=self.op, backend=i.backend, target=i.target, capabilities=i.capabilities,
                contract=self.contract, replaces=self.replaces, summary=self.summary, predicate=i.predicate,
            )
            for i in self.impls
        )


def triton_impl(module: str, fn: str) -> Impl:
    """The Triton kernel ``fn`` (and its predicate ``can_use_<fn>``) in ``ditfuse.kernels.<module>``.

    Triton kernels here use bf16 loads/stores and are tuned for Hopper but need nothing newer than
    Ampere; the interpreter capability lets the CPU tests run them under TRITON_INTERPRET=1."""
    base = f"ditfuse.kernels.{module}"
    return Impl(Backend.TRITON, f"{base}:{fn}", TRITON_CAPS, f"{base}:can_use_{fn}")


TRITON_CAPS = frozenset({Capability("cuda", (8, 0)), Capability("cpu", interpreter=True)})
