"""KernelSpec: metadata describing one fused kernel. Data only.

Importing this module imports neither torch nor triton: the registry, the CLI's
``ditfuse kernels`` and the generated docs page all work from metadata alone, and the kernel
module named by ``target`` is imported only when ``KernelSpec.load()`` is called.
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
