"""Test configuration shared by the CPU and GPU suites.

Without CUDA, Triton kernels run under Triton's interpreter. ``TRITON_INTERPRET`` must be set
before any kernel module (and so ``triton.jit``) is imported, hence at conftest import time.

The tiny-flux preset is built once into a cache shared by every test, subprocess and pytest-xdist
worker of a run, and kept across runs: ``$DITFUSE_CACHE`` when the caller set it, else pytest's
cache directory (``.pytest_cache/d/ditfuse``; ``pytest --cache-clear`` or ``make clean`` drops
it). Concurrent workers are safe: ``presets.ensure_tiny_flux`` builds into a private temporary
directory and renames it into place. The preset's version number in its path keeps a stale build
from being reused.
"""

import os
import tempfile
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    if not os.environ.get("DITFUSE_CACHE"):
        cache = getattr(config, "cache", None)  # absent with -p no:cacheprovider
        if cache is not None:
            path = cache.mkdir("ditfuse")
        else:
            path = Path(tempfile.gettempdir()) / f"ditfuse-test-cache-{os.getuid()}"
        os.environ["DITFUSE_CACHE"] = str(path)


@pytest.fixture(scope="session")
def tiny_cache() -> Path:
    """The preset cache of this test run (see the module docstring); ``DITFUSE_CACHE`` points
    there for this process and every subprocess it starts."""
    return Path(os.environ["DITFUSE_CACHE"])


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "/tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
        if not HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_kernel_env(monkeypatch):
    """Tests start without ditfuse pins/disables from the caller's environment."""
    for var in ("DITFUSE_DISABLE", "DITFUSE_BACKEND", "DITFUSE_VERIFY"):
        monkeypatch.delenv(var, raising=False)
    from ditfuse.contracts.bitexact import gate

    gate.reset()  # each test sees a fresh process-wide gate
    yield
