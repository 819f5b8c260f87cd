"""Quality tiers and request-gated sites.

``Quality.LOSSLESS`` (default): only bit-exact kernels run; output is bitwise equal to diffusers.
``Quality.HIGH``: lossless + the request-gated *close* kernels, which differ from eager at
rounding-order level and passed the fp64 admission test. Tiers are cumulative.

Request-gated kernels are installed at *sites*: a model adapter calls :func:`mark` on a module with
the kernel family, the static guards that must hold for it (dtype, bias present, no quantized or
offloaded weight ...) and a factory for the diffusers ``ModelHook`` that carries the fast forward.
:func:`mount` installs all of a transformer's sites or none: every guard of every site is checked
first, and the first failing guard is returned with its reason. Hooks go through diffusers'
``HookRegistry`` under the name ``ditfuse.high.<family>``, so they are named, removable and compose
with diffusers' own hooks; :func:`unmount` removes them and the module's original forward is back.
Mounting happens at batch boundaries only: the runtime never calls these while a batch runs.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

HOOK_PREFIX = "ditfuse.high."
_SITES_ATTR = "_ditfuse_sites"
_mount_lock = threading.Lock()


class Quality(str, enum.Enum):
    LOSSLESS = "lossless"
    HIGH = "high"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def allowed(cls) -> list[str]:
        return [q.value for q in cls]

    @classmethod
    def parse(cls, value: "str | Quality | None") -> "Quality":
        """Parse ``value`` (case- and whitespace-insensitive); None means the default, lossless."""
        if value is None:
            return cls.LOSSLESS
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            v = value.strip().lower()
            for q in cls:
                if q.value == v:
                    return q
        raise ValueError(f"unknown quality {value!r}; allowed values: {', '.join(cls.allowed())}")


@dataclass(frozen=True)
class Guard:
    """A static condition for mounting a site. ``check(module)`` returns None when it holds, else
    the reason it does not."""

    name: str
    check: Callable[[torch.nn.Module], "str | None"]


@dataclass
class Site:
    family: str
    guards: tuple[Guard, ...]
    hook_factory: Callable[[torch.nn.Module], Any]

    @property
    def hook_name(self) -> str:
        return HOOK_PREFIX + self.family


@dataclass
class GuardFailure:
    site: str
    family: str
    guard: str
    reason: str

    def __str__(self) -> str:
        return f"{self.site} ({self.family}): guard {self.guard!r} failed: {self.reason}"


@dataclass
class MountResult:
    quality: Quality
    mounted: list[str] = field(default_factory=list)  # "module.path:family"
    unmounted: list[str] = field(default_factory=list)
    failed: GuardFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None


def mark(
    module: torch.nn.Module,
    family: str,
    guards: Sequence[Guard],
    hook_factory: Callable[[torch.nn.Module], Any],
) -> Site:
    """Declare that ``module`` can run the request-gated kernel ``family`` when every guard holds.

    ``hook_factory(module)`` must return a diffusers ``ModelHook`` (typically with ``new_forward``).
    Marking installs nothing; :func:`mount` does.
    """
    site = Site(family=family, guards=tuple(guards), hook_factory=hook_factory)
    existing: list[Site] = module.__dict__.setdefault(_SITES_ATTR, [])
    existing[:] = [s for s in existing if s.family != family] + [site]
    return site


def sites(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module, Site]]:
    """Every marked site under ``root`` as (module path, module, site)."""
    out = []
    for name, mod in root.named_modules():
        for site in mod.__dict__.get(_SITES_ATTR, ()):
            out.append((name or "<root>", mod, site))
    return out


def _registry(module: torch.nn.Module):
    from diffusers.hooks import HookRegistry

    return HookRegistry.check_if_exists_or_initialize(module)


def mounted(root: torch.nn.Module) -> list[str]:
    """The sites of ``root`` whose hook is currently installed."""
    out = []
    for name, mod, site in sites(root):
        reg = getattr(mod, "_diffusers_hook", None)
        if reg is not None and reg.get_hook(site.hook_name) is not None:
            out.append(f"{name}:{site.family}")
    return out


def check_guards(root: torch.nn.Module) -> GuardFailure | None:
    """The first failing guard among all sites of ``root``, or None."""
    for name, mod, site in sites(root):
        for guard in site.guards:
            try:
                reason = guard.check(mod)
            except Exception as e:  # a guard that cannot decide says no
                reason = f"guard raised {type(e).__name__}: {e}"
            if reason is not None:
                return GuardFailure(name, site.family, guard.name, reason)
    return None


def unmount(root: torch.nn.Module) -> list[str]:
    """Remove every request-gated hook under ``root``; returns what was removed."""
    removed = []
    with _mount_lock:
        for name, mod, site in sites(root):
            reg = getattr(mod, "_diffusers_hook", None)
            if reg is not None and reg.get_hook(site.hook_name) is not None:
                reg.remove_hook(site.hook_name, recurse=False)
                removed.append(f"{name}:{site.family}")
        if removed:
            _registry(root).invalidate_child_registries_cache()
    return removed


def mount(root: torch.nn.Module, quality: "str | Quality") -> MountResult:
    """Bring ``root``'s request-gated sites to ``quality``: all of them (high) or none (lossless).

    With quality high, every guard of every site is checked before anything is installed; if one
    fails nothing is mounted (sites mounted earlier are removed too) and the failure is returned.
    Mounting an already mounted transformer is a no-op.
    """
    q = Quality.parse(quality)
    if q is Quality.LOSSLESS:
        return MountResult(q, unmounted=unmount(root))
    failure = check_guards(root)
    if failure is not None:
        return MountResult(q, unmounted=unmount(root), failed=failure)
    result = MountResult(q)
    with _mount_lock:
        installed: list[tuple[Any, str]] = []
        try:
            for name, mod, site in sites(root):
                reg = _registry(mod)
                if reg.get_hook(site.hook_name) is None:
                    reg.register_hook(site.hook_factory(mod), site.hook_name)
                    installed.append((reg, site.hook_name))
                result.mounted.append(f"{name}:{site.family}")
        except BaseException:
            for reg, hook_name in reversed(installed):  # all-or-nothing even on errors
                reg.remove_hook(hook_name, recurse=False)
            raise
        finally:
            _registry(root).invalidate_child_registries_cache()
    return result
