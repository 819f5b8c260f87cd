"""models/: where fused kernels mount. One adapter per diffusers model family.

``accelerate(pipe_or_model, quality="lossless")`` walks a pipeline's components (or takes one
model), mounts every adapter that matches, and returns an :class:`Acceleration` handle.
Components without an adapter are left untouched and listed in the report, never half-patched.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..contracts.bitexact import gate
from ..contracts.quality import MountResult, Quality
from . import pos_cache
from .base import Adapter, AdapterMount, AdapterVersionError, capture_admission_batches, handoff_counts, mounted_high

logger = logging.getLogger("ditfuse.models")

# Adapters, by module:attr; imported on first use.
_ADAPTER_TARGETS: tuple[str, ...] = (
    "ditfuse.models.flux:ADAPTER", "ditfuse.models.wan:ADAPTER", "ditfuse.models.autoencoder_kl:ADAPTER",
    "ditfuse.models.autoencoder_kl_wan:ADAPTER", "ditfuse.models.flux2:ADAPTER", "ditfuse.models.sd3:ADAPTER",
    "ditfuse.models.qwenimage:ADAPTER", "ditfuse.models.zimage:ADAPTER", "ditfuse.models.flux3:ADAPTER",
    "ditfuse.models.autoencoder_kl_wan:QWENIMAGE_ADAPTER", "ditfuse.models.chroma:ADAPTER",
    "ditfuse.models.qwenimage21:ADAPTER", "ditfuse.models.hunyuanvideo15:ADAPTER",
    "ditfuse.models.ltx:ADAPTER", "ditfuse.models.hunyuanvideo:ADAPTER",
    "ditfuse.models.wan_variants:CHRONOEDIT_ADAPTER",
    "ditfuse.models.wan_variants:WAN_ANIMATE_ADAPTER", "ditfuse.models.wan_variants:SKYREELS_V2_ADAPTER",
)


def adapters() -> list[Adapter]:
    out = []
    for target in _ADAPTER_TARGETS:
        mod, _, attr = target.partition(":")
        out.append(getattr(importlib.import_module(mod), attr))
    return out


def coverage() -> list[dict[str, Any]]:
    """Rows of the model coverage table: one per adapter site."""
    rows = []
    for a in adapters():
        for s in a.sites:
            rows.append(
                {
                    "family": a.family,
                    "cls": s.cls_name,
                    "site": s.description or s.name,
                    "ops": [d.op for d in s.ops],
                    "high_ops": [c.op for c in s.close_ops()],
                    "versions": ", ".join(a.diffusers_versions),
                }
            )
    return rows


def _fused_ops_possible() -> str | None:
    """None when fused kernels can run in this process, else why not (one line)."""
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return None
    return "no CUDA device: fused ops are unavailable, every model runs its normal diffusers path"


@dataclass
class ComponentReport:
    component: str
    cls: str
    adapter: str | None
    status: str  # "mounted" | "untouched" | "refused"
    reason: str = ""
    sites: list[tuple[str, str]] = field(default_factory=list)  # (module path, site)
    skipped_sites: list[tuple[str, str]] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    high: MountResult | None = None
    # whether the adapter declares any close kernel; without one, quality="high" runs lossless
    high_capable: bool = False
    # cross-block hand-offs (models/handoff.py): {"links", "used", "discarded"}, live counts
    handoffs: dict[str, int] = field(default_factory=dict)
    # RoPE tables reused across steps (models/pos_cache.py): {"hits", "misses", "uncached"}, live counts
    pos_tables: dict[str, int] = field(default_factory=dict)


@dataclass
class AccelerationReport:
    quality: Quality
    components: list[ComponentReport]
    notes: list[str]
    gate: Any

    def summary(self) -> str:
        lines = [*self.notes]
        for c in self.components:
            if c.status == "mounted":
                extra = ""
                if c.skipped_sites:
                    extra = f"; {len(c.skipped_sites)} module(s) kept their own forward"
                hi = ""
                if c.high is not None and c.high.failed is not None:
                    hi = f"; quality=high not mounted: {c.high.failed}"
                elif c.high is not None and not c.high_capable:
                    hi = "; quality=high: no close kernels for this model, it runs lossless (bitwise)"
                ho = ""
                if c.handoffs.get("links"):
                    n = c.handoffs["links"]
                    ho = (f"; cross-block hand-offs: {n} link{'s' if n != 1 else ''}, {c.handoffs['used']} used, "
                          f"{c.handoffs['discarded']} discarded")
                pt = c.pos_tables
                if any(pt.values()):
                    ho += (f"; RoPE tables: {pt['hits']} reused, {pt['misses']} computed"
                           + (f", {pt['uncached']} uncached" if pt.get("uncached") else ""))
                lines.append(
                    f"{c.component} ({c.cls}): {c.adapter} adapter, {len(c.sites)} fast forwards "
                    f"[{', '.join(c.ops)}]{extra}{hi}{ho}"
                )
            else:
                lines.append(f"{c.component} ({c.cls}): {c.status} — {c.reason}")
        lines.append(f"quality: {self.quality.value}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quality": self.quality.value,
            "notes": list(self.notes),
            "components": [
                {
                    "component": c.component,
                    "class": c.cls,
                    "adapter": c.adapter,
                    "status": c.status,
                    "reason": c.reason,
                    "sites": [{"path": p, "site": s} for p, s in c.sites],
                    "skipped_sites": [{"path": p, "reason": r} for p, r in c.skipped_sites],
                    "ops": list(c.ops),
                    "handoffs": dict(c.handoffs),
                    "pos_tables": dict(c.pos_tables),
                    "high_failure": None if c.high is None or c.high.failed is None else str(c.high.failed),
                    "high_capable": c.high_capable,
                }
                for c in self.components
            ],
            "gate": self.gate.to_dict(),
        }


class Acceleration:
    """Handle returned by :func:`accelerate`."""

    def __init__(self, components: dict[str, torch.nn.Module], quality: Quality) -> None:
        self._components = components
        self._mounted: dict[str, tuple[Adapter, torch.nn.Module]] = {}
        self._reports: dict[str, ComponentReport] = {}
        self._notes: list[str] = []
        self._quality = Quality.LOSSLESS
        self._graphs: dict[str, Any] = {}
        self._requested_quality = quality

    @property
    def quality(self) -> Quality:
        return self._quality

    def _mount_all(self) -> None:
        why_not = _fused_ops_possible()
        if why_not is not None:
            self._notes.append(why_not)
        table = adapters()
        for name, model in self._components.items():
            cls = type(model).__name__
            adapter = next((a for a in table if a.handles(model)), None)
            if adapter is None:
                self._reports[name] = ComponentReport(name, cls, None, "untouched", "no ditfuse adapter for this class")
                continue
            if why_not is not None:
                self._reports[name] = ComponentReport(name, cls, adapter.family, "untouched", "fused ops unavailable here")
                continue
            try:
                m: AdapterMount = adapter.mount(model)
            except AdapterVersionError as e:
                logger.warning("ditfuse: %s", e)
                self._reports[name] = ComponentReport(name, cls, adapter.family, "refused", str(e))
                continue
            self._mounted[name] = (adapter, model)
            self._reports[name] = ComponentReport(
                name,
                cls,
                adapter.family,
                "mounted",
                sites=[(s.path, s.site) for s in m.mounted],
                skipped_sites=list(m.skipped),
                ops=list(adapter.ops()),
                high_capable=any(site.close_ops() for site in adapter.sites),
            )
            for path, reason in m.skipped:
                logger.info("ditfuse: %s.%s keeps its diffusers forward: %s", name, path, reason)

    def set_quality(self, quality: "str | Quality") -> dict[str, MountResult]:
        """Mount (high) or unmount (lossless) the request-gated sites of every mounted model.

        All-or-nothing per transformer: a failing guard leaves that transformer lossless and the
        result says which guard and why. Call between batches only.
        """
        q = Quality.parse(quality)
        results = {}
        for name, (adapter, model) in self._mounted.items():
            res = adapter.set_quality(model, q)
            results[name] = res
            if name in self._graphs and (res.mounted or res.unmounted):
                self._graphs[name].invalidate()  # graphs captured under the other tier
            self._reports[name].high = res if q is Quality.HIGH else None
            if not res.ok:
                logger.warning("ditfuse: %s stays lossless: %s", name, res.failed)
            elif q is Quality.HIGH and not self._reports[name].high_capable and self._quality is not Quality.HIGH:
                logger.info("ditfuse: %s (%s adapter) has no quality='high' kernels: it keeps running "
                            "its lossless ones, bitwise equal to diffusers", name, adapter.family)
        self._quality = q
        return results

    def report(self) -> AccelerationReport:
        for name, (_, model) in self._mounted.items():
            self._reports[name].handoffs = handoff_counts(model)
            self._reports[name].pos_tables = pos_cache.counts(model)
        return AccelerationReport(self._quality, list(self._reports.values()), list(self._notes), gate.report())

    def enable_cuda_graphs(self, max_graphs: int = 8) -> None:
        from .cuda_graph import install_graph_runner

        for name, (_, model) in self._mounted.items():
            self._graphs[name] = install_graph_runner(model, max_graphs=max_graphs)

    def unmount(self) -> None:
        """Remove everything ditfuse installed; the models behave exactly as before."""
        from .cuda_graph import remove_graph_runner

        for name, (adapter, model) in list(self._mounted.items()):
            if name in self._graphs:
                remove_graph_runner(model)
            adapter.unmount(model)
            self._reports[name].status = "untouched"
            self._reports[name].reason = "unmounted"
        self._graphs.clear()
        self._mounted.clear()
        self._quality = Quality.LOSSLESS


def _components(target: Any) -> dict[str, torch.nn.Module]:
    if isinstance(target, torch.nn.Module):
        return {type(target).__name__: target}
    comps = getattr(target, "components", None)
    if isinstance(comps, dict):
        return {k: v for k, v in comps.items() if isinstance(v, torch.nn.Module)}
    raise TypeError(f"accelerate() takes a diffusers pipeline or a torch.nn.Module, not {type(target).__name__}")


def accelerate(pipe_or_model: Any, quality: "str | Quality" = "lossless", cuda_graph: bool = False,
               max_cuda_graphs: int = 8) -> Acceleration:
    """Mount ditfuse's fused kernels on a diffusers pipeline or model.

    quality="lossless" (default): bit-exact kernels only; outputs are bitwise equal to diffusers.
    quality="high": also the request-gated close kernels (all-or-nothing per transformer).
    cuda_graph=True: capture each accelerated transformer's forward per static input shape (after
    one eager warm-up call that performs all first-sight verification); replays are bitwise equal.
    At most ``max_cuda_graphs`` shapes per transformer keep a graph (each holds about one
    forward's activations); the least recently used one is released for a new shape.
    """
    if max_cuda_graphs < 1:
        raise ValueError("max_cuda_graphs must be >= 1")
    q = Quality.parse(quality)
    handle = Acceleration(_components(pipe_or_model), q)
    handle._mount_all()
    if q is not Quality.LOSSLESS:
        handle.set_quality(q)
    if cuda_graph and handle._mounted:
        if torch.cuda.is_available():
            handle.enable_cuda_graphs(max_cuda_graphs)
        else:
            handle._notes.append("cuda_graph=True ignored: no CUDA device")
    return handle


def mounted_sites(model: torch.nn.Module) -> list[str]:
    """The sites of ``model`` running their quality="high" forward now ("path:site")."""
    return mounted_high(model)


__all__ = ["accelerate", "Acceleration", "AccelerationReport", "adapters", "coverage", "capture_admission_batches",
           "mounted_sites"]
