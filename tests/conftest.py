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

# Under pytest-xdist each worker is one process on a shared machine: give each its share of the
# cores, or N workers x N intra-op (OpenMP) threads spin against each other and every test slows
# down (measured on a 2-core machine). Results do not depend on it: every comparison in the suite
# is within one process.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)


def _threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


if _WORKERS > 1:
    torch.set_num_threads(_threads_per_worker(_WORKERS))

# Files whose tests run Triton kernels under the interpreter (or inspect their generated code):
# most of the suite's wall time. `make test-quick` leaves them out (marker "interpret").
_INTERPRET_FILES = ("_interpret.py", "_codegen.py")
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


def _host_line(workers: int) -> str:
    """What CPU eager arithmetic depends on (see ``verify_every_call``), so a bitwise failure seen
    on one host and not another can be traced to the host from the run's log."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    try:
        bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except Exception:  # pragma: no cover - builds without mkldnn
        bf16 = "n/a"
    # what each xdist worker set at import (module top); a run without workers keeps torch's default
    threads = _threads_per_worker(workers) if workers > 1 else torch.get_num_threads()
    return (f"host: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"oneDNN bf16 {bf16}, {os.cpu_count()} cores, {threads} intra-op thread(s) per test process; {model}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # at the end, where `pytest -q` (make test, CI) still prints it; workers use the same host
    if not hasattr(config, "workerinput"):
        n = getattr(config.option, "numprocesses", None)
        terminalreporter.write_line(_host_line(n if isinstance(n, int) else 0))


def _failure_record(report) -> str:
    """One failed phase as text: node id, phase, worker, free GPU memory (telling an allocation
    failure under concurrent workers from a wrong result), and the end of the traceback."""
    where = os.environ.get("PYTEST_XDIST_WORKER", "main")
    mem = ""
    if HAS_CUDA:
        try:
            free, total = torch.cuda.mem_get_info()
            mem = (f"; GPU free {free / 2**30:.1f} of {total / 2**30:.1f} GiB, this process reserves "
                   f"{torch.cuda.memory_reserved() / 2**30:.1f}")
        except Exception as e:  # a failed CUDA context is itself the clue
            mem = f"; GPU memory unreadable: {type(e).__name__}: {e}"
    text = str(report.longrepr).splitlines()
    tail = "\n".join(text[-40:])
    return f"=== FAILED {report.nodeid} ({report.when}, {where}{mem})\n{tail}\n"


def pytest_runtest_logreport(report):
    # DITFUSE_FAILURE_LOG (scripts/gpu_suite.sh sets it): each failure is appended the moment it
    # happens, so a run cut off by its time limit -- before pytest's summary, which is where the
    # tracebacks would appear -- still leaves which tests failed and why (round 30 lost both).
    path = os.environ.get("DITFUSE_FAILURE_LOG")
    if not path or not report.failed or getattr(report, "node", None) is not None:
        return  # report.node: the xdist controller's copy of a worker's report (the worker wrote it)
    data = _failure_record(report).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)  # one append per record: xdist workers do not interleave
    finally:
        os.close(fd)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        path = str(item.fspath).replace(os.sep, "/")
        if "/tests/gpu/" in path:
            item.add_marker(pytest.mark.gpu)
        if path.endswith(_INTERPRET_FILES):
            item.add_marker(pytest.mark.interpret)
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


@pytest.fixture
def verify_every_call(monkeypatch):
    """``DITFUSE_VERIFY=always`` for a test that compares a whole accelerated CPU forward bitwise
    with diffusers.

    Why not the default first-sight mode: on the CPU the kernels run under Triton's interpreter,
    which reproduces *CUDA's* reduction order in NumPy (the same on every machine), while the
    eager chain they are compared with is torch's CPU code, whose reduction widths and GEMM
    backend follow the host's ISA (AVX2 vs AVX-512 vector lengths, oneDNN bf16 GEMMs where the CPU
    has them). Interpreter and CPU eager agree after rounding for most rows, not by construction,
    so a signature verified on one block's data can differ by an ulp on a later block's — on one
    CI host and not on another (round 28: the HunyuanVideo adapter test, one token of the model's
    output one bf16 ulp off on the CI machine, equal here). Verifying every call makes the test's
    claim hold on any host: every op still runs its kernel and reaches the gate, the fast
    forwards, hand-offs and mounting are exercised, and the output is the reference chains'
    bits, which must equal diffusers'. Kernel-alone bitwise equality is a GPU claim (tests/gpu).
    The same host dependence means a verified call may find a 1-ulp mismatch and fall back: such a
    test checks the gate with ``tests.support.engaged.assert_gate_clean`` (interpreter mismatches
    allowed; a raised kernel, a declined input or a layout fallback never)."""
    monkeypatch.setenv("DITFUSE_VERIFY", "always")
    yield
