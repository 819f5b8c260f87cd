"""The bit-exact gate: first-sight verification of every bit-exact kernel against its eager chain.

A bit-exact kernel reproduces every rounding of the eager chain on the torch version and GPU it
was verified on. The dispatch it mirrors can change under it (another torch, another GPU, another
cuBLAS), so the gate checks, per op and per *input signature*:

- first sight of (op, signature): run the kernel and the reference, compare bitwise (integer views;
  NaNs in the same places are equal, -0.0 != +0.0). Equal -> the signature is verified and later
  calls run the kernel alone. Different -> the op is disabled for the whole process, the
  reference's output is returned, and one warning names the op, the signature, the first differing
  index and both values.
- the kernel raises :class:`~ditfuse.kernels.errors.UnsupportedInput` -> that call runs the
  reference (an input the kernel does not reproduce, e.g. a width torch sends down another
  path; counted, logged once per op and reason, listed in the report). Any other exception ->
  fallback to the reference, the op is disabled, and the error is reported.
- while ``torch.compile`` traces or a CUDA graph is being captured no verification runs (a
  reference run inside a capture would be captured too): a verified signature runs the kernel, an
  unverified one runs the reference.

``DITFUSE_VERIFY``: ``first`` (default), ``always`` (verify every call), ``off`` (trust kernels;
never compare), ``strict`` (like ``first`` but a mismatch raises :class:`BitExactMismatch`; for
tests).

Contract for kernel/reference callables: pure functions of their inputs, except that they may write
into an ``out`` argument they are given. During verification the kernel runs first and its outputs
are cloned, then the reference runs and its outputs are returned (they are bitwise equal when
verification passes), so an ``out`` buffer ends up holding correct values either way.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.compare import Mismatch, compare_outputs, layout_mismatch
from ..kernels.env import env
from ..kernels.errors import UnsupportedInput

logger = logging.getLogger("ditfuse.gate")

VERIFY_MODES = ("first", "always", "off", "strict")


class BitExactMismatch(AssertionError):
    """Raised in DITFUSE_VERIFY=strict when a kernel differs from its reference."""


_verify_cache: tuple[str, str] | None = None


def verify_mode() -> str:
    global _verify_cache
    raw = env("DITFUSE_VERIFY", "first")
    cached = _verify_cache
    if cached is not None and cached[0] == raw:
        return cached[1]
    mode = raw.strip().lower() or "first"
    if mode not in VERIFY_MODES:
        raise ValueError(f"DITFUSE_VERIFY={mode!r} is not one of {', '.join(VERIFY_MODES)}")
    _verify_cache = (raw, mode)
    return mode


def _is_compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover - very old torch
        return False


@functools.lru_cache(maxsize=1)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _is_capturing() -> bool:
    try:
        return _cuda_available() and torch.cuda.is_current_stream_capturing()
    except Exception:  # pragma: no cover
        return False


def tensor_signature(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """dtype, device type and strides class of a tensor: the parts of a signature that change a
    kernel's code path without being a shape dimension. Shape dims are added by each op."""
    if t is None:
        return None
    if t.is_contiguous():
        layout = "contiguous"
    elif t.dim() and t.stride(-1) == 1:
        layout = "rows-strided"
    else:
        layout = "strided"
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES.setdefault(t.dtype, str(t.dtype).replace("torch.", ""))
    return (name, t.device.type, layout)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


@dataclass
class Fallback:
    op: str
    signature: Hashable
    reason: str


@dataclass
class GateReport:
    verified: dict[str, list[Hashable]] = field(default_factory=dict)
    disabled: dict[str, str] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    calls: dict[str, Counter] = field(default_factory=dict)

    def ops_verified(self) -> list[str]:
        return sorted(op for op, sigs in self.verified.items() if sigs)

    def kernel_calls(self, op: str) -> int:
        return self.calls.get(op, Counter())["kernel"]

    def summary(self) -> str:
        lines = []
        for op in sorted(set(self.verified) | set(self.calls) | set(self.disabled)):
            c = self.calls.get(op, Counter())
            state = f"DISABLED ({self.disabled[op]})" if op in self.disabled else "ok"
            lines.append(
                f"{op}: {len(self.verified.get(op, []))} verified signature(s); "
                f"kernel {c['kernel']}, reference {c['reference']}, verifications {c['verify']}; {state}"
            )
        return "\n".join(lines) if lines else "no gated op has run"

    def to_dict(self) -> dict[str, Any]:
        return {
            "verified": {op: [repr(s) for s in sigs] for op, sigs in self.verified.items()},
            "disabled": dict(self.disabled),
            "fallbacks": [{"op": f.op, "signature": repr(f.signature), "reason": f.reason} for f in self.fallbacks],
            "calls": {op: dict(c) for op, c in self.calls.items()},
        }


class BitExactGate:
    """Process-wide, thread-safe gate. Use the module-level :data:`gate`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, Hashable], threading.Lock] = {}
        self._verified: dict[str, set[Hashable]] = {}
        self._disabled: dict[str, str] = {}
        # signatures whose kernel output had eager's values in another layout: eager runs them
        self._eager_only: dict[str, set[Hashable]] = {}
        # ops whose output layout is their own by design (OpDescriptor.own_layout): values only
        self._own_layout: set[str] = set()
        # ops whose mismatch is a property of one signature (OpDescriptor.per_signature)
        self._per_signature: set[str] = set()
        self._fallbacks: list[Fallback] = []
        self._calls: dict[str, Counter] = {}
        self._unsupported_seen: set[tuple[str, str]] = set()
        # Overridable for tests (mocking the capture/compile predicates).
        self.is_compiling: Callable[[], bool] = _is_compiling
        self.is_capturing: Callable[[], bool] = _is_capturing

    # -- state -----------------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self._key_locks.clear()
            self._verified.clear()
            self._disabled.clear()
            self._eager_only.clear()
            self._fallbacks.clear()
            self._calls.clear()
            self._unsupported_seen.clear()

    def is_disabled(self, op: str) -> bool:
        return op in self._disabled

    def owns_layout(self, op: str) -> None:
        """Compare ``op``'s outputs by value only: its layout differs from eager's by design and
        the sites calling it own that layout (``OpDescriptor.own_layout``; kept across reset)."""
        with self._lock:
            self._own_layout.add(op)

    def per_signature(self, op: str) -> None:
        """A bitwise mismatch of ``op`` sends that signature to eager, not the whole op
        (``OpDescriptor.per_signature``; kept across reset)."""
        with self._lock:
            self._per_signature.add(op)

    def is_verified(self, op: str, signature: Hashable) -> bool:
        return signature in self._verified.get(op, ())

    def disable(self, op: str, reason: str) -> None:
        with self._lock:
            self._disabled.setdefault(op, reason)

    def _count(self, op: str, what: str) -> None:
        with self._lock:
            self._calls.setdefault(op, Counter())[what] += 1

    def _fallback(self, op: str, signature: Hashable, reason: str) -> None:
        with self._lock:
            self._fallbacks.append(Fallback(op, signature, reason))

    def report(self) -> GateReport:
        with self._lock:
            return GateReport(
                verified={op: sorted(sigs, key=repr) for op, sigs in self._verified.items()},
                disabled=dict(self._disabled),
                fallbacks=list(self._fallbacks),
                calls={op: Counter(c) for op, c in self._calls.items()},
            )

    # -- the call path ---------------------------------------------------------------------
    def _key_lock(self, op: str, signature: Hashable) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault((op, signature), threading.Lock())

    def call(
        self,
        op: str,
        signature: Hashable,
        kernel: Callable[..., Any],
        reference: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Run ``kernel(*args, **kwargs)`` under the bit-exact contract; see the module docstring."""
        if op in self._disabled or signature in self._eager_only.get(op, ()):
            self._count(op, "reference")
            return reference(*args, **kwargs)
        mode = verify_mode()
        if self.is_compiling() or self.is_capturing():
            if mode == "off" or self.is_verified(op, signature):
                return self._run_kernel(op, signature, kernel, reference, args, kwargs)
            self._count(op, "reference")
            self._count(op, "unverified_under_capture")
            return reference(*args, **kwargs)
        if mode == "off":
            return self._run_kernel(op, signature, kernel, reference, args, kwargs)
        if mode != "always" and self.is_verified(op, signature):
            return self._run_kernel(op, signature, kernel, reference, args, kwargs)
        with self._key_lock(op, signature):
            # Another thread may have verified (or disabled) while we waited.
            if op in self._disabled:
                self._count(op, "reference")
                return reference(*args, **kwargs)
            if mode != "always" and self.is_verified(op, signature):
                return self._run_kernel(op, signature, kernel, reference, args, kwargs)
            return self._verify(op, signature, kernel, reference, args, kwargs, strict=(mode == "strict"))

    def _run_kernel(self, op, signature, kernel, reference, args, kwargs):
        try:
            out = kernel(*args, **kwargs)
        except UnsupportedInput as e:
            self._note_unsupported(op, signature, e)
            self._count(op, "reference")
            return reference(*args, **kwargs)
        except Exception as e:  # a broken kernel must never take the model down
            self._kernel_failed(op, signature, e)
            self._count(op, "reference")
            return reference(*args, **kwargs)
        self._count(op, "kernel")
        return out

    def _note_layout(self, op: str, signature: Hashable, why: str) -> None:
        self._count(op, "layout")
        with self._lock:
            self._eager_only.setdefault(op, set()).add(signature)
        self._fallback(op, signature, f"output layout differs from eager's: {why}")
        logger.warning("ditfuse: %s runs eager for inputs like %r: its output layout differs from eager's (%s)",
                       op, signature, why)

    def _note_unsupported(self, op: str, signature: Hashable, e: UnsupportedInput) -> None:
        self._count(op, "unsupported")
        key = (op, e.reason)
        if key not in self._unsupported_seen:
            with self._lock:
                self._unsupported_seen.add(key)
            self._fallback(op, signature, f"unsupported input: {e.reason}")
            logger.warning("ditfuse: %s runs eager for inputs like %r: %s", op, signature, e.reason)

    def _kernel_failed(self, op: str, signature: Hashable, e: BaseException) -> None:
        reason = f"kernel raised {type(e).__name__}: {e}"
        self.disable(op, reason)
        self._fallback(op, signature, reason)
        logger.warning("ditfuse: %s disabled for this process (%r): %s", op, signature, reason)

    def _verify(self, op, signature, kernel, reference, args, kwargs, strict: bool):
        self._count(op, "verify")
        try:
            k_out = kernel(*args, **kwargs)
        except UnsupportedInput as e:
            self._note_unsupported(op, signature, e)
            self._count(op, "reference")
            return reference(*args, **kwargs)
        except Exception as e:
            if strict:
                raise
            self._kernel_failed(op, signature, e)
            self._count(op, "reference")
            return reference(*args, **kwargs)
        k_out = _clone_outputs(k_out, args, kwargs)
        r_out = reference(*args, **kwargs)
        self._count(op, "reference")
        mismatch: Mismatch | None = compare_outputs(k_out, r_out, name=op)
        if mismatch is None:
            layout = None if op in self._own_layout else layout_mismatch(k_out, r_out, name=op)
            if layout is not None:
                # Equal values in another memory layout: what reads them next may round
                # differently, so this signature runs eager; the kernel stays on for the others.
                if strict:
                    raise BitExactMismatch(f"layout differs for signature {signature!r}: {layout}")
                self._note_layout(op, signature, layout)
                return r_out
            with self._lock:
                self._verified.setdefault(op, set()).add(signature)
            return r_out
        reason = f"bitwise mismatch for signature {signature!r}: {mismatch}"
        if strict:
            raise BitExactMismatch(reason)
        if op in self._per_signature:
            self._count(op, "mismatch")
            with self._lock:
                self._eager_only.setdefault(op, set()).add(signature)
            self._fallback(op, signature, reason)
            logger.warning(
                "ditfuse: %s differs from eager for %r (first difference at %s: kernel %r, eager %r; %d of %d "
                "elements); this signature runs eager for the rest of this process (the op's other "
                "signatures are verified one by one)",
                op, signature, list(mismatch.index), mismatch.actual, mismatch.expected, mismatch.count, mismatch.numel,
            )
            return r_out
        self.disable(op, reason)
        self._fallback(op, signature, reason)
        logger.warning(
            "ditfuse: %s differs from eager for %r (first difference at %s: kernel %r, eager %r; "
            "%d of %d elements); %s now runs eager for the rest of this process",
            op, signature, list(mismatch.index), mismatch.actual, mismatch.expected,
            mismatch.count, mismatch.numel, op,
        )
        return r_out


def _clone_outputs(out: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
    """A copy of the kernel's outputs, taken before the reference overwrites what they alias.

    An output that *is* one of the call's tensor arguments (an ``out=`` buffer the op wrote in
    place, often a strided slice of a larger buffer) is copied with its strides: ``clone()`` of a
    non-dense view is contiguous, and the layout check would then see a difference the kernel did
    not make (the reference writes the same ``out`` and returns it with the slice's strides)."""
    given = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    return _clone(out, given)


def _clone(out: Any, given: list[torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        if not any(out is g for g in given):
            return out.clone()
        copy = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
        return copy.copy_(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_clone(o, given) for o in out)
    return out


gate = BitExactGate()
"""The process-wide gate every bit-exact fast path goes through."""


def report() -> GateReport:
    return gate.report()
