"""What the tests that start a ``ditfuse serve`` subprocess share."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120,
                 output: Callable[[], str] | None = None) -> None:
    """Poll ``url``/health until it answers 200. Fails with the server's output (``output()``, by
    default its piped stdout) if the process exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, (output or proc.stdout.read)()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
