"""ditfuse: fused, by default bit-exact, kernels for diffusers pipelines on NVIDIA GPUs.

``ditfuse.accelerate(pipe)`` mounts the fused kernels onto a stock diffusers pipeline. Importing
``ditfuse`` imports no triton and no kernel module; everything heavy is resolved lazily.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "accelerate": "ditfuse.models:accelerate",
    "Quality": "ditfuse.contracts.quality:Quality",
    "gate": "ditfuse.contracts.bitexact:gate",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ditfuse' has no attribute {name!r}")
    import importlib

    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
