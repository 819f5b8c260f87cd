"""What every model adapter declares, and how its fast forwards are mounted.

An adapter is small and declarative: the diffusers model classes it handles, the exact diffusers
versions whose forward code its fast forwards mirror, and its sites — for each diffusers module
class, the fast forward that replaces its ``forward`` and the ops that forward uses (this is the
coverage table of the docs page). Fast forwards are installed as diffusers ``ModelHook``s with a
``new_forward`` under the name ``ditfuse.lossless.<site>``, so they are named, removable, and
compose with diffusers' own hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("ditfuse.models")

LOSSLESS_PREFIX = "ditfuse.lossless."


class AdapterVersionError(RuntimeError):
    """The installed diffusers is not a version the adapter's fast forwards mirror."""


@dataclass(frozen=True)
class SiteSpec:
    """One module class whose forward an adapter replaces.

    ``fast_forward(module, original_forward, *args, **kwargs)`` mirrors the diffusers forward of
    ``cls_name`` (``original_forward`` is the forward it replaces, for inputs it does not cover);
    ``applies(module)`` returns None when the fast forward reproduces this instance's
    configuration, else the reason it does not (the module then keeps its own forward).
    """

    name: str
    cls_name: str
    ops: tuple[str, ...]
    fast_forward: Callable[..., Any]
    applies: Callable[[torch.nn.Module], "str | None"] = lambda m: None
    description: str = ""


class FastForwardHook:
    """A diffusers ModelHook (duck-typed to avoid importing diffusers at module import) whose
    ``new_forward`` is ``fast_forward(module, original_forward, *args, **kwargs)``. Used for the
    lossless sites and, through :func:`hook_factory`, for the request-gated ones."""

    _is_stateful = False

    def __init__(self, name: str, fast_forward: Callable[..., Any]) -> None:
        self.name = name
        self.fast_forward = fast_forward
        self.fn_ref = None

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # diffusers' spelling
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def new_forward(self, module, *args, **kwargs):
        return self.fast_forward(module, self.fn_ref.original_forward, *args, **kwargs)

    def reset_state(self, module):
        return module

    def __repr__(self) -> str:
        return f"FastForwardHook({self.name})"


def make_forward_hook(name: str, fast_forward: Callable[..., Any]):
    """A real ``diffusers.hooks.ModelHook`` running ``fast_forward``."""
    from diffusers.hooks import ModelHook

    class _Hook(FastForwardHook, ModelHook):
        pass

    return _Hook(name, fast_forward)


def hook_factory(name: str, fast_forward: Callable[..., Any]) -> Callable[[torch.nn.Module], Any]:
    """``module -> ModelHook`` for :func:`ditfuse.contracts.quality.mark`."""
    return lambda module: make_forward_hook(name, fast_forward)


@dataclass
class MountedSite:
    path: str
    site: str
    ops: tuple[str, ...]


@dataclass
class AdapterMount:
    """What one adapter mounted on one model."""

    adapter: str
    mounted: list[MountedSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module path, reason)


@dataclass
class Adapter:
    family: str
    model_classes: tuple[str, ...]
    diffusers_versions: tuple[str, ...]
    sites: tuple[SiteSpec, ...]
    mark_high_sites: Callable[[torch.nn.Module], Any] | None = None

    def handles(self, model: torch.nn.Module) -> bool:
        return type(model).__name__ in self.model_classes

    def version_problem(self) -> str | None:
        import diffusers

        if diffusers.__version__ not in self.diffusers_versions:
            return (
                f"the {self.family} adapter mirrors diffusers {', '.join(self.diffusers_versions)} "
                f"forward code, but diffusers {diffusers.__version__} is installed; refusing to mount "
                f"(its fast forwards could silently diverge from this version's forwards)"
            )
        return None

    def ops(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for s in self.sites:
            for op in s.ops:
                seen.setdefault(op, None)
        return tuple(seen)

    def mount(self, model: torch.nn.Module) -> AdapterMount:
        problem = self.version_problem()
        if problem is not None:
            raise AdapterVersionError(problem)
        from diffusers.hooks import HookRegistry

        result = AdapterMount(self.family)
        by_cls = {s.cls_name: s for s in self.sites}
        for path, mod in model.named_modules():
            site = by_cls.get(type(mod).__name__)
            if site is None:
                continue
            path = path or "<root>"
            reason = site.applies(mod)
            if reason is not None:
                result.skipped.append((path, f"{site.name}: {reason}"))
                continue
            reg = HookRegistry.check_if_exists_or_initialize(mod)
            hook_name = LOSSLESS_PREFIX + site.name
            if reg.get_hook(hook_name) is None:
                reg.register_hook(make_forward_hook(site.name, site.fast_forward), hook_name)
            result.mounted.append(MountedSite(path, site.name, site.ops))
        HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        if self.mark_high_sites is not None:
            self.mark_high_sites(model)
        return result

    def unmount(self, model: torch.nn.Module) -> int:
        removed = 0
        names = {LOSSLESS_PREFIX + s.name for s in self.sites}
        for _, mod in model.named_modules():
            reg = getattr(mod, "_diffusers_hook", None)
            if reg is None:
                continue
            for name in list(reg.hooks):
                if name in names:
                    reg.remove_hook(name, recurse=False)
                    removed += 1
        if hasattr(model, "_diffusers_hook"):
            model._diffusers_hook.invalidate_child_registries_cache()
        return removed
