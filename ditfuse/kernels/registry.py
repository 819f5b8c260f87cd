"""The process-wide kernel registry: query, select, pin and disable kernels.

Environment (read at first use, so a bad value fails loudly where a kernel is first wanted):

- ``DITFUSE_DISABLE``: comma-separated op ids or globs (``modulate.scale_shift,rope.*``) or ``all``.
- ``DITFUSE_BACKEND``: comma-separated ``op=backend`` pins (``norm.layernorm_modulate=triton``).

Naming an op or backend that does not exist is an error (:class:`KernelConfigError`), not ignored:
a typo in a pin would otherwise silently measure the wrong thing.

This module imports neither torch nor triton at import time; capability checks import torch
lazily when a selection is made.
"""

from __future__ import annotations

import fnmatch
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from .env import env
from .spec import Backend, Capability, KernelSpec

# Preference when no backend is requested or pinned: hand-written GPU code first.
_BACKEND_PREFERENCE = (Backend.TRITON, Backend.CUDA, Backend.TORCH)


class KernelError(RuntimeError):
    """Base class of registry errors."""


class UnknownOpError(KernelError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class KernelConfigError(KernelError, ValueError):
    """DITFUSE_DISABLE / DITFUSE_BACKEND names something that does not exist."""


class KernelDisabledError(KernelError):
    """The op is disabled through DITFUSE_DISABLE."""


class CapabilityError(KernelError):
    """No registered backend of the op can run on this machine."""


@dataclass(frozen=True)
class DeviceInfo:
    """What a capability is checked against."""

    device: str  # "cuda" or "cpu"
    cc: tuple[int, int] | None = None
    name: str = ""
    interpreter: bool = False

    def describe(self) -> str:
        if self.device == "cuda" and self.cc is not None:
            return f"{self.name or 'cuda'} (sm_{self.cc[0]}{self.cc[1]})"
        extra = ", TRITON_INTERPRET=1" if self.interpreter else ", no TRITON_INTERPRET"
        return f"{self.device} (no CUDA device{extra})"


def _interpreter_on() -> bool:
    return env("TRITON_INTERPRET", "0") not in ("", "0")


def current_device(device: str | None = None) -> DeviceInfo:
    """Describe ``device`` ("cuda", "cuda:1", "cpu") or, if None, the default CUDA device when
    one exists, else the CPU."""
    import torch  # lazy: importing the registry must stay torch-free

    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return DeviceInfo("cuda", None, "cuda unavailable")
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return DeviceInfo(
            "cuda", tuple(torch.cuda.get_device_capability(idx)), torch.cuda.get_device_name(idx)
        )
    return DeviceInfo(dev.type, None, dev.type, _interpreter_on())


def capability_met(cap: Capability, dev: DeviceInfo) -> bool:
    if cap.device != dev.device:
        return False
    if cap.interpreter and not dev.interpreter:
        return False
    if cap.min_cc is not None:
        return dev.cc is not None and tuple(dev.cc) >= tuple(cap.min_cc)
    return True


class Registry:
    def __init__(self, specs: Iterable[KernelSpec] = ()) -> None:
        self._specs: dict[str, list[KernelSpec]] = {}
        self._lock = threading.Lock()
        self._env_cache: tuple[tuple[str, str], tuple[frozenset[str], dict[str, Backend]]] | None = None
        for spec in specs:
            self.register(spec)

    # -- inventory -------------------------------------------------------------------------
    def register(self, spec: KernelSpec) -> None:
        with self._lock:
            existing = self._specs.setdefault(spec.op, [])
            if any(s.backend == spec.backend for s in existing):
                raise ValueError(f"{spec.key} is registered twice")
            existing.append(spec)
            self._env_cache = None

    def ops(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[KernelSpec]:
        return [s for op in self.ops() for s in self._specs[op]]

    def get(self, op: str) -> list[KernelSpec]:
        """All registered backends of ``op`` (in registration order)."""
        try:
            return list(self._specs[op])
        except KeyError:
            raise UnknownOpError(f"unknown op {op!r}; registered ops: {', '.join(self.ops())}") from None

    # -- environment -----------------------------------------------------------------------
    def _parse_env(self) -> tuple[frozenset[str], dict[str, Backend]]:
        raw = (env("DITFUSE_DISABLE"), env("DITFUSE_BACKEND"))
        cached = self._env_cache
        if cached is not None and cached[0] == raw:
            return cached[1]
        disable_raw, backend_raw = raw
        ops = self.ops()
        disabled: set[str] = set()
        for item in filter(None, (p.strip() for p in disable_raw.split(","))):
            if item == "all":
                disabled.update(ops)
                continue
            matched = fnmatch.filter(ops, item)
            if not matched:
                raise KernelConfigError(
                    f"DITFUSE_DISABLE names {item!r}, which matches no registered op "
                    f"(registered: {', '.join(ops)}; or use 'all')"
                )
            disabled.update(matched)
        pins: dict[str, Backend] = {}
        for item in filter(None, (p.strip() for p in backend_raw.split(","))):
            op, eq, backend = (s.strip() for s in item.partition("="))
            if not eq or not op or not backend:
                raise KernelConfigError(f"DITFUSE_BACKEND entry {item!r} is not of the form op=backend")
            if op not in self._specs:
                raise KernelConfigError(
                    f"DITFUSE_BACKEND pins unknown op {op!r} (registered: {', '.join(ops)})"
                )
            try:
                b = Backend(backend)
            except ValueError:
                raise KernelConfigError(
                    f"DITFUSE_BACKEND pins {op} to unknown backend {backend!r} "
                    f"(backends: {', '.join(x.value for x in Backend)})"
                ) from None
            have = [s.backend for s in self._specs[op]]
            if b not in have:
                raise KernelConfigError(
                    f"DITFUSE_BACKEND pins {op} to {b.value}, but {op} has only "
                    f"{', '.join(x.value for x in have)}"
                )
            pins[op] = b
        result = (frozenset(disabled), pins)
        self._env_cache = (raw, result)
        return result

    def validate_env(self) -> None:
        """Raise KernelConfigError if DITFUSE_DISABLE / DITFUSE_BACKEND name unknown things."""
        self._parse_env()

    def is_disabled(self, op: str) -> bool:
        if op not in self._specs:  # on every fused call: no list copy of the specs just to check
            self.get(op)
        return op in self._parse_env()[0]

    def pinned_backend(self, op: str) -> Backend | None:
        self.get(op)
        return self._parse_env()[1].get(op)

    # -- selection -------------------------------------------------------------------------
    def select(self, op: str, backend: str | Backend | None = None, device: str | None = None) -> KernelSpec:
        """Pick the spec to run ``op`` with on ``device`` (default: the default CUDA device, else CPU).

        Order: an explicit ``backend`` argument, else a DITFUSE_BACKEND pin, else the preference
        triton > cuda > torch among the backends whose capabilities this device meets. The
        capability check applies to every selection, single-backend ops included; the error names
        what is missing.
        """
        specs = self.get(op)
        disabled, pins = self._parse_env()
        if op in disabled:
            raise KernelDisabledError(f"{op} is disabled by DITFUSE_DISABLE={os.environ.get('DITFUSE_DISABLE', '')!r}")
        want = Backend(backend) if backend is not None else pins.get(op)
        if want is not None:
            candidates = [s for s in specs if s.backend == want]
            if not candidates:
                raise KernelConfigError(
                    f"{op} has no {want.value} backend (has: {', '.join(s.backend.value for s in specs)})"
                )
        else:
            candidates = sorted(specs, key=lambda s: _BACKEND_PREFERENCE.index(s.backend))
        dev = current_device(device)
        for spec in candidates:
            if any(capability_met(c, dev) for c in spec.capabilities):
                return spec
        needs = "; ".join(f"{s.key} needs {s.describe_capabilities()}" for s in candidates)
        raise CapabilityError(f"no usable backend for {op} on {dev.describe()}: {needs}")

    def available(self, op: str, device: str | None = None) -> bool:
        """True when :meth:`select` would succeed (not disabled, some capability met)."""
        try:
            self.select(op, device=device)
        except (KernelDisabledError, CapabilityError):
            return False
        return True


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.Lock()


def default_registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        with _REGISTRY_LOCK:
            if _REGISTRY is None:
                from . import _SPECS  # data only; no kernel module is imported

                _REGISTRY = Registry(_SPECS)
    return _REGISTRY


def ops() -> list[str]:
    return default_registry().ops()


def specs() -> list[KernelSpec]:
    return default_registry().specs()


def get(op: str) -> list[KernelSpec]:
    return default_registry().get(op)


def select(op: str, backend: str | Backend | None = None, device: str | None = None) -> KernelSpec:
    return default_registry().select(op, backend=backend, device=device)


def available(op: str, device: str | None = None) -> bool:
    return default_registry().available(op, device=device)


def is_disabled(op: str) -> bool:
    return default_registry().is_disabled(op)


def validate_env() -> None:
    default_registry().validate_env()
