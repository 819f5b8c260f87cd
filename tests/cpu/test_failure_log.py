"""tests/conftest.py's failure log (``DITFUSE_FAILURE_LOG``, set by scripts/gpu_suite.sh): every
failed test is appended as it fails -- node id, phase, worker and the end of its traceback -- once,
with and without pytest-xdist workers. Round 30's GPU calls ended at their time limit before
pytest's summary and lost which tests had failed; this is what would have named them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails_with_a_message():
    assert [1, 2, 3] == [1, 2, 4], "the third element differs"

@pytest.fixture
def broken():
    raise RuntimeError("fixture setup broke")

def test_setup_error(broken):
    pass
'''


def _env(**extra: str) -> dict[str, str]:
    # this test may itself run in an xdist worker: the probe run must not inherit its worker id
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "DITFUSE_FAILURE_LOG"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return dict(env, **extra)


def _run(tmp_path: Path, *args: str, log: bool = True) -> tuple[subprocess.CompletedProcess, str]:
    """The probe file under a conftest that has only the failure-log hook; ``log``: with
    DITFUSE_FAILURE_LOG pointing into ``tmp_path``."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_logreport  # noqa: F401\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    path = tmp_path / "failures.log"
    env = _env(DITFUSE_FAILURE_LOG=str(path)) if log else _env()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_probe.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc, path.read_text() if path.exists() else ""


@pytest.mark.parametrize("workers", [0, 2], ids=["serial", "xdist"])
def test_each_failure_logged_once_as_it_happens(tmp_path, workers):
    proc, text = _run(tmp_path, *(["-n", str(workers)] if workers else []))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    heads = [ln for ln in text.splitlines() if ln.startswith("=== FAILED ")]
    assert len(heads) == 2, text
    fails = next(h for h in heads if "test_fails_with_a_message" in h)
    assert "(call, " in fails and ("gw" in fails) == bool(workers), fails
    assert "the third element differs" in text
    setup = next(h for h in heads if "test_setup_error" in h)
    assert "(setup, " in setup and "fixture setup broke" in text
    assert "test_passes" not in text


def test_nothing_written_without_the_variable(tmp_path):
    proc, _ = _run(tmp_path, log=False)
    assert proc.returncode == 1
    assert list(tmp_path.glob("*.log")) == []


def test_gpu_workers_release_cached_memory(monkeypatch):
    """tests/gpu/conftest.py: under xdist on CUDA each test ends with the worker's cached blocks
    handed back; alone on the card, or without CUDA, nothing is freed."""
    from tests.gpu import conftest as gpu_conftest

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert gpu_conftest.release_cached_gpu_memory() and calls == ["empty"]
    calls.clear()
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert not gpu_conftest.release_cached_gpu_memory() and calls == []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gpu_conftest.release_cached_gpu_memory() and calls == []
