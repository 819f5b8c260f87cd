"""Gated bit-exact ops: what a model's fast forward calls instead of an eager chain.

A :class:`GatedOp` ties together, for one registered op: the kernel (selected through the
registry, loaded lazily on first call), its ``can_use_<op>`` predicate, the eager reference chain
(:mod:`ditfuse.kernels.reference`) and the signature the bit-exact gate keys verification on.
Calling it runs the kernel under :data:`ditfuse.contracts.bitexact.gate`; when the op is not
available on this device, disabled by the environment, or the predicate says no, it runs the
reference, which is the very eager chain diffusers would have run, so the model's output is the
same bits either way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from ..kernels import reference as ref
from ..kernels import registry
from .bitexact import gate, tensor_signature

logger = logging.getLogger("ditfuse.ops")

_sig = tensor_signature


def _scale_kind(t: torch.Tensor) -> str:
    return "per-sample" if t.dim() == 2 else "per-token"


# Signatures: only what changes the kernel's arithmetic or code path. Batch and sequence length
# are left out for per-row ops: every row runs the same reduction tree whatever their number.
def _sig_scale_shift(x, scale, shift) -> Hashable:
    return (_sig(x), x.shape[-1], _scale_kind(scale), _sig(scale), _sig(shift))


def _sig_gate_residual(residual, gate_, update) -> Hashable:
    return (_sig(residual), residual.shape[-1], _scale_kind(gate_), _sig(gate_), _sig(update))


def _sig_ln_mod(x, scale, shift, eps=1e-6) -> Hashable:
    # The width D fixes the per-thread vector count and the reduction tree.
    return (_sig(x), x.shape[-1], _scale_kind(scale), _sig(scale), _sig(shift), float(eps))


def _sig_gr_ln_mod(residual, gate_, update, scale, shift, eps=1e-6) -> Hashable:
    return (
        _sig(residual), residual.shape[-1], _scale_kind(gate_), _sig(gate_), _sig(update),
        _scale_kind(scale), _sig(scale), _sig(shift), float(eps),
    )


def _sig_qk(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
            q_txt_weight=None, k_txt_weight=None) -> Hashable:
    # head_dim fixes the RMS reduction; heads and sequence lengths only change the grid.
    return (
        _sig(q), _sig(k), q.shape[-1], q_weight is not None, cos is not None,
        _sig(cos) if cos is not None else None, q_txt is not None,
        _sig(q_txt) if q_txt is not None else None, None if eps is None else float(eps),
    )


def _sig_gelu(x, out=None) -> Hashable:
    return (_sig(x), None if out is None else _sig(out))


def _gelu_reference(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    y = ref.gelu_tanh(x)
    if out is None:
        return y
    out.copy_(y)
    return out


class GatedOp:
    """Callable running registered op ``op`` under the bit-exact gate, eager otherwise."""

    def __init__(self, op: str, reference: Callable[..., Any], signature: Callable[..., Hashable]) -> None:
        self.op = op
        self.reference = reference
        self.signature = signature
        self._lock = threading.Lock()
        self._loaded: dict[str, tuple[Callable[..., Any], Callable[..., bool]] | None] = {}
        self.predicate_rejections = 0

    def _kernel_for(self, device: torch.device) -> tuple[Callable[..., Any], Callable[..., bool]] | None:
        key = device.type if device.index is None else f"{device.type}:{device.index}"
        if key in self._loaded:
            return self._loaded[key]
        with self._lock:
            if key not in self._loaded:
                try:
                    spec = registry.select(self.op, device=key)
                    self._loaded[key] = (spec.load(), spec.load_predicate())
                except (registry.KernelDisabledError, registry.CapabilityError) as e:
                    logger.info("ditfuse: %s runs eager on %s: %s", self.op, key, e)
                    self._loaded[key] = None
                except Exception as e:  # the kernel module failed to import: eager, loudly
                    logger.warning("ditfuse: %s runs eager on %s: loading its kernel failed: %s: %s",
                                   self.op, key, type(e).__name__, e)
                    gate._fallback(self.op, key, f"kernel load failed: {type(e).__name__}: {e}")
                    self._loaded[key] = None
        return self._loaded[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0]
        loaded = self._kernel_for(first.device)
        if loaded is None or gate.is_disabled(self.op) or registry.is_disabled(self.op):
            return self.reference(*args, **kwargs)
        kernel, predicate = loaded
        if not predicate(*args, **kwargs):
            self.predicate_rejections += 1
            gate._count(self.op, "predicate_rejected")
            return self.reference(*args, **kwargs)
        return gate.call(self.op, self.signature(*args, **kwargs), kernel, self.reference, *args, **kwargs)


scale_shift = GatedOp("modulate.scale_shift", ref.scale_shift, _sig_scale_shift)
gate_residual = GatedOp("modulate.gate_residual", ref.gate_residual, _sig_gate_residual)
layernorm_modulate = GatedOp("norm.layernorm_modulate", ref.layernorm_modulate, _sig_ln_mod)
gate_residual_layernorm_modulate = GatedOp(
    "norm.gate_residual_layernorm_modulate", ref.gate_residual_layernorm_modulate, _sig_gr_ln_mod
)
qk_rmsnorm_rope = GatedOp("rope.qk_rmsnorm_rope", ref.qk_rmsnorm_rope, _sig_qk)
gelu_tanh = GatedOp("activation.gelu_tanh", _gelu_reference, _sig_gelu)

ALL: dict[str, GatedOp] = {
    g.op: g
    for g in (scale_shift, gate_residual, layernorm_modulate, gate_residual_layernorm_modulate, qk_rmsnorm_rope, gelu_tanh)
}
