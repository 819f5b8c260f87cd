"""Close ops: what a quality="high" fast forward calls instead of an eager chain.

A :class:`CloseOp` ties one registered *close* kernel (selected through the registry, loaded
lazily) to its ``can_use_<op>`` predicate and to the eager reference chain. It is not run under the
bit-exact gate: a close kernel is not bitwise equal to eager by design. Whether it may run at all
is decided before mounting, by the site guards (admission record, availability on the device,
module configuration); at call time an input the predicate rejects runs the eager chain, which is
the lossless math, and is counted.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ..kernels import reference as ref
from ..kernels import registry


class CloseOp:
    """Callable running close op ``op``'s kernel where its predicate accepts, eager otherwise."""

    def __init__(self, op: str, reference: Callable[..., Any]) -> None:
        self.op = op
        self.reference = reference
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[Callable[..., Any], Callable[..., bool]] | str] = {}
        self.calls: Counter[str] = Counter()  # "kernel" / "eager"

    def _load(self, device: torch.device) -> tuple[Callable[..., Any], Callable[..., bool]] | str:
        key = device.type if device.index is None else f"{device.type}:{device.index}"
        got = self._loaded.get(key)
        if got is not None:
            return got
        with self._lock:
            if key not in self._loaded:
                try:
                    spec = registry.select(self.op, device=key)
                    self._loaded[key] = (spec.load(), spec.load_predicate())
                except (registry.KernelDisabledError, registry.CapabilityError) as e:
                    self._loaded[key] = str(e)
                except Exception as e:  # the kernel module failed to import
                    self._loaded[key] = f"loading the kernel failed: {type(e).__name__}: {e}"
            return self._loaded[key]

    def problem(self, device: torch.device | str) -> str | None:
        """None when the kernel can run on ``device``, else why not (for a site guard)."""
        if registry.is_disabled(self.op):
            return f"{self.op} is disabled by DITFUSE_DISABLE"
        got = self._load(torch.device(device))
        return got if isinstance(got, str) else None

    def available(self, device: torch.device | str) -> bool:
        return self.problem(device) is None

    def kernel(self, device: torch.device | str) -> Callable[..., Any]:
        """The kernel callable itself (raises RuntimeError when unavailable): for admission."""
        got = self._load(torch.device(device))
        if isinstance(got, str):
            raise RuntimeError(f"{self.op}: {got}")
        return got[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        got = self._load(args[0].device)
        if isinstance(got, str) or registry.is_disabled(self.op) or not got[1](*args, **kwargs):
            self.calls["eager"] += 1
            return self.reference(*args, **kwargs)
        self.calls["kernel"] += 1
        return got[0](*args, **kwargs)


linear_gelu_tanh = CloseOp("activation.linear_gelu_tanh", ref.linear_gelu_tanh)
layernorm_modulate_fp32 = CloseOp("norm.layernorm_modulate_fp32", ref.layernorm_modulate)
gate_residual_layernorm_modulate_fp32 = CloseOp(
    "norm.gate_residual_layernorm_modulate_fp32", ref.gate_residual_layernorm_modulate
)
qk_rmsnorm_rope_fp32 = CloseOp("rope.qk_rmsnorm_rope_fp32", ref.qk_rmsnorm_rope)

ALL: dict[str, CloseOp] = {
    c.op: c
    for c in (linear_gelu_tanh, layernorm_modulate_fp32, gate_residual_layernorm_modulate_fp32, qk_rmsnorm_rope_fp32)
}


def reset_counts() -> None:
    for c in ALL.values():
        c.calls.clear()
