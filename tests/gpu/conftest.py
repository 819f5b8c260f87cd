"""Everything under tests/gpu is marked ``gpu`` (root conftest) and skipped without CUDA.

Several pytest-xdist workers share one card in the GPU suite (scripts/gpu_suite.sh, ``-n 4``). Each
worker's caching allocator keeps the peak of every test it ran, so a worker that ran one
real-width model holds tens of GB it no longer uses while the others run out (round 19: 35 of 283
tests out of memory with eight workers; round 30: failures in bursts on three of six workers).
After each test a worker therefore hands its unused cached blocks back to the driver."""

from __future__ import annotations

import os

import pytest
import torch


def release_cached_gpu_memory() -> bool:
    """Free this process's unused cached CUDA blocks when it is one of several test workers;
    True if it did. Alone on the card, the cache stays (it only costs time to rebuild)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not torch.cuda.is_available():
        return False
    # no gc.collect(): ~50 ms a test in a process holding diffusers, and device time is scarce;
    # blocks still referenced (module-scoped models, cyclic garbage) stay until they are freed
    torch.cuda.empty_cache()
    return True


@pytest.fixture(autouse=True)
def _release_gpu_cache_after_each_test():
    yield
    release_cached_gpu_memory()
