"""Values a model's blocks would each recompute from the same tensors, made once and shared.

Some forwards hand every block the same tensor objects and let each block derive the same thing
from them: Qwen-Image 2.1's blocks each select and ``tanh`` the rows of the one shared modulation,
HunyuanVideo 1.5's attention processors each build the same [B, 1, S, S] mask from the padding
mask. A derivation of fixed tensors by deterministic ops is the same bits every time, so a block
may take the value an earlier block made — as long as the inputs are provably the same: the very
tensor objects (weak references), at the same version counters (an in-place write bumps them),
with the same extra key (shapes, lengths). An entry dies with its first key tensor (the forward
that made it ends), so a cache holds at most the values of live tensors.

Not shared (computed per call): inference tensors (no version counter), while torch.compile traces.
Values must not be views of the keys (a view's ``_base`` would keep the key alive, and the entry
with it): :meth:`IdentityCache.get` copies any value that is a view.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch


def _own(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.clone() if v._base is not None else v
    if isinstance(v, tuple):
        return tuple(_own(x) for x in v)
    return v


class IdentityCache:
    """``get(keys, extra, compute)``: ``compute()``'s value, reused while ``keys`` (tensors or
    None) are the same objects at the same versions and ``extra`` is equal (module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}
        self._lock = threading.Lock()

    def get(self, keys: tuple[torch.Tensor | None, ...], extra: tuple, compute: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling() or any(k is not None and k.is_inference() for k in keys):
            return compute()
        first = keys[0]
        e = self._entries.get(id(first))
        if e is not None and self._matches(e, keys, extra):
            return e[3]
        value = _own(compute())
        ref = weakref.ref(first, lambda r, key=id(first): self._drop(key, r))
        refs = tuple(None if k is None else weakref.ref(k) for k in keys[1:])
        entry = ((ref,) + refs, tuple(None if k is None else k._version for k in keys), extra, value)
        with self._lock:
            self._entries[id(first)] = entry
        return value

    @staticmethod
    def _matches(e: tuple, keys: tuple, extra: tuple) -> bool:
        refs, versions, e_extra, _ = e
        if e_extra != extra or len(refs) != len(keys):
            return False
        for r, v, k in zip(refs, versions, keys):
            if r is None or k is None:
                if r is not k:
                    return False
            elif r() is not k or k._version != v:
                return False
        return True

    def _drop(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e[0][0] is ref:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
