"""Environment reads on the per-call path of every fused op (torch-free: the registry imports it).

``os.environ.get`` encodes the key and decodes the value on each call (about 1 µs on a slow
host) and the call path reads several variables (DITFUSE_VERIFY, DITFUSE_DISABLE,
DITFUSE_BACKEND, TRITON_INTERPRET), so on POSIX :func:`env` looks the encoded key up in CPython's
underlying bytes mapping, which ``os.environ``'s setters keep current (``os.environ[k] = v``,
``monkeypatch.setenv``, ``del os.environ[k]``), and reuses the decoded value while the bytes are
unchanged. Elsewhere it is ``os.environ.get``.
"""

from __future__ import annotations

import os

_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_FAST = os.name == "posix" and isinstance(_ENV_DATA, dict)
_KEYS: dict[str, bytes] = {}
_DECODED: dict[bytes, str] = {}


def env(name: str, default: str = "") -> str:
    """``os.environ.get(name, default)``."""
    if not _ENV_FAST:
        return os.environ.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS.setdefault(name, os.fsencode(name))
    raw = _ENV_DATA.get(key)
    if raw is None:
        return default
    val = _DECODED.get(raw)
    if val is None:
        if len(_DECODED) > 256:  # values are few (a handful of settings); never grow without bound
            _DECODED.clear()
        val = _DECODED.setdefault(raw, os.fsdecode(raw))
    return val
