"""Cross-block fusion: a block's closing gated residual and its successor's opening LayerNorm +
modulate in one pass (``gate_residual_layernorm_modulate``), across the block boundary.

Every adaLN family ends a block with ``h = r(x + r(gate * ff))`` and opens the next one with
``n = r(r(r(LN(h)) * r(1 + scale)) + shift)`` on the successor's own modulation. Run apart, ``h``
is written by one kernel and read back by the next; fused, the producing block also computes the
successor's modulation (a function of ``temb`` and the successor's weights only) and writes ``n``
beside ``h``. Both halves are the same eager chain, so the fused op's bits are the unfused ops'
bits (the gate checks the fused op against that chain at first sight like any other).

The hand-off is speculation that checks itself. The producer cannot see what runs between the two
blocks — the model's loop, a ControlNet residual, a user's hook that replaces or skips a block —
so it leaves its payload in a slot with weak references to the tensors it returned (and their
version counters); the successor uses the payload only when it is called with exactly those
tensor objects, unmodified, under the same op table. Anything else discards the payload (logged
at debug level) and the successor computes its opening itself, from the tensors it was given.
A producer whose payload was discarded stops speculating until its successor is again called with
its outputs (so a ControlNet run costs one wasted LayerNorm per boundary, once).

When a producer does not speculate at all: the successor carries a foreign hook (offloading could
leave its weights off-device, a cache hook may skip it) or a torch forward pre-hook; autograd is
on; torch.compile is tracing; under ``torch.inference_mode`` (inference tensors have no version
counter, so an in-place edit between the blocks could not be seen: ``torch.no_grad`` keeps the
hand-off, and it is what diffusers' pipelines and ditfuse's engine use); ``DITFUSE_HANDOFF=0``. The blocks of one ``nn.ModuleList`` that
mount the same site form a chain (:func:`link_chains`); one slot per chain, so at most one payload
is alive per chain.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ..kernels.env import env

logger = logging.getLogger("ditfuse.models")

HOOK_PREFIX = "ditfuse."  # every ditfuse site hook's name (models/base.py); here, below base, for both


def enabled() -> bool:
    """``DITFUSE_HANDOFF`` is not ``0``/``off``/``false`` (default on)."""
    return env("DITFUSE_HANDOFF", "1").strip().lower() not in ("0", "off", "false", "no")


class _Slot:
    __slots__ = ("target", "producer", "refs", "versions", "ops", "payload")

    def __init__(self, target, producer, keys, ops, payload) -> None:
        self.target = target
        self.producer = producer
        self.refs = tuple(weakref.ref(t) for t in keys)
        self.versions = tuple(t._version for t in keys)
        self.ops = ops
        self.payload = payload

    def matches(self, keys: tuple[torch.Tensor, ...], ops: Any) -> bool:
        if self.ops is not ops or len(keys) != len(self.refs):
            return False
        for r, v, t in zip(self.refs, self.versions, keys):
            if r() is not t or t.is_inference() or t._version != v:
                return False
        return True


class Chain:
    """The blocks of one ModuleList that hand off to each other: one slot, at most one payload."""

    __slots__ = ("slot",)

    def __init__(self) -> None:
        self.slot: _Slot | None = None


class Link:
    """One block's place in its chain: where its payload goes (``successor``) and what it learnt.

    ``used`` / ``discarded``: payloads this block produced that its successor used / could not
    use. ``speculating``: whether it computes a payload on its next call."""

    __slots__ = ("chain", "successor", "speculating", "used", "discarded")

    def __init__(self, chain: Chain | None = None, successor: torch.nn.Module | None = None) -> None:
        self.chain = chain
        self.successor = successor
        self.speculating = True
        self.used = 0
        self.discarded = 0

    def take(self, block: torch.nn.Module, keys: tuple[torch.Tensor, ...], ops: Any) -> Any:
        """The payload a predecessor left for ``block`` if ``block`` was called with exactly the
        tensors it returned (``keys``, unmodified) under op table ``ops``; else None. Always
        empties the chain's slot."""
        chain = self.chain
        if chain is None or chain.slot is None:
            return None
        slot, chain.slot = chain.slot, None
        producer = slot.producer
        if slot.target is block and slot.matches(keys, ops):
            producer.speculating = True
            if slot.payload is not None:
                producer.used += 1
            return slot.payload
        # Its target was skipped (SD3's skip_layers, a hook), or it was called with other tensors
        # (a residual added between blocks, a hook): speculating did not pay.
        producer.speculating = False
        if slot.payload is not None:
            producer.discarded += 1
            logger.debug("ditfuse: cross-block hand-off discarded at a %s (%s); it computes its opening norm itself",
                         type(block).__name__,
                         "the payload's target block was not called" if slot.target is not block
                         else "its inputs are not the tensors its predecessor returned")
        return None

    def next_block(self) -> torch.nn.Module | None:
        """The successor whose opening this block may compute now, or None (module docstring)."""
        nxt = self.successor
        if (nxt is None or not self.speculating or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or torch.is_inference_mode_enabled()):
            return None
        if not enabled() or _foreign(nxt):
            return None
        return nxt

    def give(self, keys: tuple[torch.Tensor, ...], payload: Any, ops: Any) -> None:
        """Leave ``payload`` (None: nothing computed, the outputs are still recorded so the link
        learns whether speculating would pay) for the successor, keyed by the returned tensors."""
        if self.successor is None or self.chain is None:
            return
        if any(t.is_inference() for t in keys):
            # no version counter: an in-place write between the blocks could not be seen
            self.chain.slot = None
            return
        self.chain.slot = _Slot(self.successor, self, keys, ops, payload)


NO_LINK = Link()


class Opening:
    """A block's opening LayerNorm + modulate, as its modulation gives it: ``n =
    layernorm_modulate(x, scale, shift, eps, weight, bias, norm_dtype)`` plus ``extras`` (the
    block's other modulation chunks), so the opening can run on the block's input
    (:meth:`run`) or fused into its predecessor's closing residual (:func:`close_block`). Either
    way the block gets ``(n, *extras)``. ``tables``: None, or the (scale, shift) [D] table rows
    that make the operands ``table + scale.float()`` / ``table + shift.float()`` (Wan 2.2 TI2V's
    per-token modulation, summed inside the ops)."""

    __slots__ = ("scale", "shift", "eps", "extras", "weight", "bias", "norm_dtype", "tables")

    def __init__(self, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float,
                 extras: tuple[Any, ...] = (), weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, norm_dtype: torch.dtype | None = None,
                 tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.scale, self.shift, self.eps, self.extras = scale, shift, eps, extras
        self.weight, self.bias, self.norm_dtype, self.tables = weight, bias, norm_dtype, tables

    def run(self, x: torch.Tensor, ops: Any) -> tuple[Any, ...]:
        if self.tables is None:
            n = ops.layernorm_modulate(x, self.scale, self.shift, self.eps, self.weight, self.bias, self.norm_dtype)
        else:
            n = ops.layernorm_modulate(x, self.scale, self.shift, self.eps, self.weight, self.bias, self.norm_dtype,
                                       *self.tables)
        return (n, *self.extras)


def close_block(ops: Any, x: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
                opening: Opening | None,
                gate_table: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """A block's closing ``h = gate_residual(x, gate, update)``; with the successor's ``opening``
    also its ``(n, *extras)`` from the same pass (``gate_residual_layernorm_modulate``), else None.
    ``gate_table``: the gate's [D] table row (the gate is ``gate_table + gate.float()``)."""
    if opening is None:
        if gate_table is None:
            return ops.gate_residual(x, gate, update), None
        return ops.gate_residual(x, gate, update, gate_table), None
    o = opening
    if gate_table is None and o.tables is None:
        h, n = ops.gate_residual_layernorm_modulate(x, gate, update, o.scale, o.shift, o.eps, o.weight, o.bias,
                                                    o.norm_dtype)
    else:
        h, n = ops.gate_residual_layernorm_modulate(x, gate, update, o.scale, o.shift, o.eps, o.weight, o.bias,
                                                    o.norm_dtype, gate_table, *(o.tables or (None, None)))
    return h, (n, *o.extras)


def foreign_hook_names(module: torch.nn.Module) -> list[str]:
    """The diffusers hooks registered on ``module`` itself that are not ditfuse's."""
    reg = getattr(module, "_diffusers_hook", None)
    return [] if reg is None else [n for n in reg.hooks if not n.startswith(HOOK_PREFIX)]


def _foreign(block: torch.nn.Module) -> bool:
    return bool(block._forward_pre_hooks or hasattr(block, "_hf_hook") or foreign_hook_names(block))


def link_chains(model: torch.nn.Module, hooks: dict[int, Any]) -> int:
    """Give every chained site hook under ``model`` its :class:`Link`: consecutive members of one
    ``nn.ModuleList`` mounted with the same site hand off to each other. ``hooks``: id(module) ->
    its site hook. Returns the number of links with a successor."""
    n = 0
    for mod in model.modules():
        if not isinstance(mod, torch.nn.ModuleList):
            continue
        members = [hooks.get(id(child)) for child in mod]
        if not any(h is not None for h in members):
            continue
        chain = Chain()
        for i, h in enumerate(members):
            if h is None:
                continue
            nxt = members[i + 1] if i + 1 < len(members) else None
            successor = mod[i + 1] if nxt is not None and nxt.site is h.site else None
            h.link = Link(chain, successor)
            n += successor is not None
    return n


def counts(links: Iterable[Link]) -> dict[str, int]:
    """``{"links", "used", "discarded"}`` summed over ``links``."""
    out = {"links": 0, "used": 0, "discarded": 0}
    for lk in links:
        out["links"] += lk.successor is not None
        out["used"] += lk.used
        out["discarded"] += lk.discarded
    return out
