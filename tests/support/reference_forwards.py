"""Run a model with its adapter's fast forwards on the eager reference chains (CPU tests).

Each op of the reference table is its descriptor's reference (kernels/reference.py: the eager
chains diffusers runs), so a model whose fast forwards run on it must compute diffusers' own
output bit for bit: this proves each fast forward re-spells diffusers' forward faithfully,
independently of any kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ReferenceOps:
    """An op table (``_ops``) whose every op is the eager reference chain."""

    @property
    def quality(self):
        from ditfuse.contracts.ops import LOSSLESS

        return LOSSLESS.quality

    def runs(self, name: str) -> bool:
        """No optional path (``OpSet.runs``) but by its environment switch, as the lossless table."""
        return False

    def __getattr__(self, name: str) -> Any:
        from ditfuse.kernels import DESCRIPTORS

        for d in DESCRIPTORS:
            if d.name == name:
                return d.load_reference()
        raise AttributeError(name)


@contextmanager
def reference_forwards(model: torch.nn.Module, sites: Iterable[Any], require_applies: bool = False
                       ) -> Iterator[list[torch.nn.Module]]:
    """Within the block, every module of ``model`` whose class a site names runs that site's fast
    forward with :class:`ReferenceOps` (``require_applies``: assert the site applies to each);
    yields the patched modules; restores their forwards on exit."""
    by_cls = {s.cls_name: s for s in sites}
    ops = ReferenceOps()
    saved = []
    try:
        for mod in model.modules():
            site = by_cls.get(type(mod).__name__)
            if site is None:
                continue
            if require_applies:
                assert site.applies(mod) is None, site.applies(mod)
            orig = mod.forward
            saved.append((mod, orig))
            mod.forward = (lambda site, mod, orig: lambda *a, **k: site.forward(mod, orig, *a, _ops=ops, **k))(
                site, mod, orig)
        yield [m for m, _ in saved]
    finally:
        for mod, orig in saved:
            mod.forward = orig
