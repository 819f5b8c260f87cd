"""Test configuration shared by the CPU and GPU suites.

Without CUDA, Triton kernels run under Triton's interpreter. ``TRITON_INTERPRET`` must be set
before any kernel module (and so ``triton.jit``) is imported, hence at conftest import time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
