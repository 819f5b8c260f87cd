"""Quality tiers and the all-or-nothing rule for request-gated sites (no diffusers here).

``Quality.LOSSLESS`` (default): only bit-exact kernels run; output is bitwise equal to diffusers.
``Quality.HIGH``: lossless + the request-gated *close* kernels, which differ from eager at
rounding-order level and passed the fp64 admission test. Tiers are cumulative.

A model adapter (ditfuse/models/) declares, per site, the static guards that must hold before a
site may run its quality="high" forward. :func:`check_all` evaluates every guard of every site of
a transformer and returns the first failure, so that a transformer is mounted high as a whole or
not at all; :class:`MountResult` says which sites moved and why not. How a site's forward is
swapped is the models layer's business (diffusers hooks); this module only decides.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


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
    check: Callable[[Any], "str | None"]


@dataclass
class GuardFailure:
    site: str  # module path
    family: str  # site name, e.g. "flux.dual_block"
    guard: str
    reason: str

    def __str__(self) -> str:
        return f"{self.site} ({self.family}): guard {self.guard!r} failed: {self.reason}"


@dataclass
class MountResult:
    quality: Quality
    mounted: list[str] = field(default_factory=list)  # "module.path:site"
    unmounted: list[str] = field(default_factory=list)
    failed: GuardFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None


def check_guards(path: str, site: str, module: Any, guards: Iterable[Guard]) -> GuardFailure | None:
    """The first failing guard of one site, or None. A guard that raises says no."""
    for guard in guards:
        try:
            reason = guard.check(module)
        except Exception as e:
            reason = f"guard raised {type(e).__name__}: {e}"
        if reason is not None:
            return GuardFailure(path, site, guard.name, reason)
    return None


def check_all(sites: Iterable[tuple[str, str, Any, Iterable[Guard]]]) -> GuardFailure | None:
    """The first failing guard over ``(path, site, module, guards)`` entries: all of a
    transformer's sites must pass before any is mounted."""
    for path, site, module, guards in sites:
        failure = check_guards(path, site, module, guards)
        if failure is not None:
            return failure
    return None


__all__ = ["Quality", "Guard", "GuardFailure", "MountResult", "check_guards", "check_all"]
