"""Data parallelism: one engine worker per device, each its own OS process with its own pipeline.

``ditfuse serve --gpus N`` (or ``--devices cuda:0,cuda:1`` / ``--devices cpu,cpu``) starts a
:class:`WorkerPool`; the :class:`~ditfuse.runtime.engine.Engine` in the server process keeps the
one queue and the scheduler and hands each worker (a *lane*) one batch at a time.

A worker process (``multiprocessing`` "spawn": a fresh interpreter, no CUDA state inherited)
    1. sets its environment before it imports torch: for ``cuda:i`` it sets
       ``CUDA_VISIBLE_DEVICES`` to the parent's i-th visible device and uses ``cuda``; a ``cpu``
       worker sees no GPU (``CUDA_VISIBLE_DEVICES=""``); every worker sets
       ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
       (NVLink multicast stays off on our machines, in spawned processes too);
    2. loads the model (:func:`~ditfuse.runtime.presets.load_model`) on its device and mounts
       ``ditfuse.accelerate(pipe, quality=default)`` unless acceleration is off;
    3. reports ready (device, pid, tier, the acceleration summary, the model's description) and
       then serves batch jobs one at a time: switch the tier when the job's differs (the same
       transition record the in-process engine keeps), run the batch (:func:`run_batch`, or the
       pool's ``runner``), send the images back (PIL images and uint8 clips pickle as they are).
       Video jobs send one progress message per denoising step; the engine stops a batch whose
       requests are all gone by setting the worker's stop flag, which the worker's step callback
       checks (raising :class:`~ditfuse.runtime.engine.BatchAbandoned` at the next step).
    4. ignores SIGINT and SIGTERM (Ctrl-C reaches the whole process group, and systemd signals
       every process of the service; the server drains its batches and then stops the workers
       itself) and exits when told to stop or when the server's end of its pipe closes (the
       server process is gone).

Failures
    A pipeline error in a worker comes back as :class:`WorkerBatchError` (the exception's type name
    and message, the worker and device). A worker that dies (killed, crashed) fails its in-flight
    batch with :class:`WorkerDied` naming the worker, device, pid and exit code; its lane is dead
    and requests go to the live ones (the engine raises ``NoLiveWorkers``, 503, once none is
    left). A worker that fails to start, or does not report ready within ``start_timeout_s``,
    makes :meth:`WorkerPool.start` stop every worker and raise :class:`WorkerStartupError`.

Shutdown
    :meth:`WorkerPool.close` asks every live worker to stop, joins it, kills (SIGKILL: workers
    ignore SIGTERM) one that does not exit within ``stop_timeout_s``, and joins the reader threads:
    no process is left.
    Worker processes are also reaped when the server process exits without closing the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection as mpc
import os
import re
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..contracts.quality import Quality
from .distributed import MULTICAST_OFF
from .engine import BatchAbandoned, EngineError
from .params import SamplingParams

# Set in every worker process, whatever the caller's environment says: NVLink multicast (NVLS)
# must stay off on our machines, and a spawned process reads its own environment. The same set
# as every process `ditfuse generate --gpus N` starts.
MULTICAST_OFF_ENV: dict[str, str] = dict(MULTICAST_OFF)

_DEVICE_RE = re.compile(r"^(cpu|cuda(?::(\d+))?)$")


class WorkerStartupError(RuntimeError):
    """A worker process could not load or accelerate the model (or never reported ready)."""


class WorkerDied(EngineError):
    """The worker process running a batch exited (killed or crashed) before it answered."""

    status = 500
    code = "worker_died"


class WorkerBatchError(EngineError):
    """The pipeline raised in a worker process; ``type_name`` is the exception's class name there."""

    status = 500
    code = "worker_error"

    def __init__(self, message: str, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name


def parse_device(device: str) -> str:
    """Check one device name (``cpu``, ``cuda``, ``cuda:N``); returns it stripped."""
    d = device.strip()
    if not _DEVICE_RE.match(d):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N")
    return d


def visible_cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without CUDA). Imports torch; creates no
    CUDA context, so spawned workers can still pick their device."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_devices(gpus: int = 1, devices: str | Sequence[str] | None = None, device: str | None = None) -> list[str] | None:
    """The devices ``ditfuse serve`` runs on: None when neither ``--devices`` nor ``--gpus`` > 1
    was given (one in-process engine on ``--device``, as always), else the list. One entry also
    means one in-process engine (on that device); two or more mean one worker process each.

    ``devices`` (comma-separated or a list) overrides ``gpus``; ``gpus > 1`` means
    ``cuda:0 .. cuda:N-1``. Raises ValueError for a bad name, a CUDA index past the visible
    devices, or ``gpus`` above the visible device count."""
    if devices is not None:
        names = [d for d in (devices.split(",") if isinstance(devices, str) else devices)]
        names = [parse_device(d) for d in names if d.strip()]
        if not names:
            raise ValueError("--devices: no device given (e.g. --devices cuda:0,cuda:1 or --devices cpu,cpu)")
        indices = [int(m.group(2)) for m in map(_DEVICE_RE.match, names) if m.group(2) is not None]
        cuda = any(n.startswith("cuda") for n in names)
        if cuda:
            n = visible_cuda_devices()
            if n == 0:
                raise ValueError(f"--devices {','.join(names)}: no CUDA device is visible")
            if indices and max(indices) >= n:
                raise ValueError(f"--devices {','.join(names)}: cuda:{max(indices)} does not exist, "
                                 f"{n} CUDA device{'s are' if n != 1 else ' is'} visible (cuda:0..cuda:{n - 1})")
        return names
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1 (got {gpus})")
    if gpus == 1:
        return None
    if device is not None and parse_device(device) != "cuda":
        raise ValueError(f"--gpus {gpus} runs one worker per GPU, which contradicts --device {device}; "
                         "use --devices to list the devices instead")
    n = visible_cuda_devices()
    if gpus > n:
        raise ValueError(f"--gpus {gpus}: only {n} CUDA device{'s are' if n != 1 else ' is'} visible"
                         f"{' (CUDA_VISIBLE_DEVICES=' + repr(os.environ['CUDA_VISIBLE_DEVICES']) + ')' if 'CUDA_VISIBLE_DEVICES' in os.environ else ''}; "
                         "ask for fewer, or list devices with --devices (e.g. --devices cpu,cpu)")
    return [f"cuda:{i}" for i in range(gpus)]


def worker_environment(device: str, parent_env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The environment variables a worker for ``device`` sets before importing torch, and the
    device name it then loads the model on.

    ``cuda:i`` is the parent's i-th visible device: ``CUDA_VISIBLE_DEVICES`` becomes that one
    entry of the parent's list (or ``i`` when the parent sets none) and the worker uses ``cuda``.
    ``cpu`` hides every GPU. Plain ``cuda`` keeps the parent's visibility."""
    env = os.environ if parent_env is None else parent_env
    m = _DEVICE_RE.match(parse_device(device))
    assert m is not None
    out = dict(MULTICAST_OFF_ENV)
    if m.group(1) == "cpu":
        out["CUDA_VISIBLE_DEVICES"] = ""
        return out, "cpu"
    if m.group(2) is None:
        return out, "cuda"
    i = int(m.group(2))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        if i >= len(entries):
            raise ValueError(f"{device}: CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} device(s)")
        out["CUDA_VISIBLE_DEVICES"] = entries[i]
    else:
        out["CUDA_VISIBLE_DEVICES"] = str(i)
    return out, "cuda"


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------------------------
# The worker process.


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to start (pickled to it: plain data only)."""

    index: int
    model: str
    device: str  # as the caller named it: "cpu", "cuda", "cuda:1"
    dtype: str | None = None
    accelerate: bool = True
    default_quality: str = "lossless"
    threads: int | None = None  # torch.set_num_threads in the worker; None: torch's default
    # "module:function" with run_batch's signature, imported in the worker after its environment
    # is set (a function object would be unpickled, and its module imported, before that).
    runner: str | None = None
    # Extra environment for the worker (None removes a variable); applied before the device and
    # multicast variables, which always win.
    env: tuple[tuple[str, str | None], ...] = ()
    # A member of a context-parallel group (ContextPool): (rank, world size, the process group's
    # init_method, the attention mode "ulysses" | "ring"); None for a data-parallel worker.
    group: tuple[int, int, str, str] | None = None
    # accelerate(cuda_graph=, max_cuda_graphs=) in the worker (a bool, or "auto"/"on"/"off":
    # presets.cuda_graphs_for, resolved once the worker has loaded the model)
    cuda_graph: "bool | str" = False
    max_cuda_graphs: int = 4
    # presets.LoraSpec each (plain frozen dataclasses: they pickle), and --fuse-lora
    loras: tuple = ()
    fuse_lora: bool = False


def _resolve(path: str) -> Callable[..., Any]:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"runner {path!r}: expected 'module:function'")
    return getattr(importlib.import_module(module), attr)


def _worker_main(spec: WorkerSpec, conn: Any, stop: Any) -> None:
    """Entry point of a worker process (see the module docstring). ``stop``: a shared integer,
    the id of the batch the server wants stopped."""
    for key, value in spec.env:
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    env, load_device = worker_environment(spec.device)
    os.environ.update(env)
    # Ctrl-C goes to the whole process group, and a service manager may SIGTERM every process of
    # the service: the server finishes the running batches and then stops us, so a worker must not
    # die of either mid-batch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import torch

        # CUDA_VISIBLE_DEVICES counts only if CUDA was not initialised yet (spawn re-imports the
        # server's main module here; ditfuse's CLI imports no torch, an embedding program might).
        if torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialised in the worker before it could pick its device")

        if spec.threads:
            torch.set_num_threads(spec.threads)
        from .engine import run_batch
        from .presets import load_model

        runner = _resolve(spec.runner) if spec.runner else run_batch
        if spec.group is not None:
            from .distributed import join_group

            rank, world, init_method, _mode = spec.group
            join_group(rank, world, load_device, init_method)
        loaded = load_model(spec.model, device=load_device, dtype=spec.dtype, loras=spec.loras,
                            fuse_lora=spec.fuse_lora)
        if spec.group is not None:
            from .distributed import enable_context_parallel

            enable_context_parallel(loaded.pipe, mode=spec.group[3], world=spec.group[1])
        handle = None
        summary = "nothing (acceleration disabled)"
        if spec.accelerate:
            from ..models import accelerate

            from .presets import cuda_graphs_for

            handle = accelerate(loaded.pipe, quality=spec.default_quality,
                                cuda_graph=cuda_graphs_for(spec.cuda_graph, loaded),
                                max_cuda_graphs=spec.max_cuda_graphs)
            summary = handle.report().summary()
        summary = loaded.lora_lines() + summary
    except BaseException as e:  # noqa: BLE001 - every startup failure is reported, then we exit
        _send(conn, ("failed", type(e).__name__, str(e), traceback.format_exc()))
        return
    meta = dataclasses.replace(loaded, pipe=None)
    ready = {
        "pid": os.getpid(),
        "summary": summary,
        "quality": None if handle is None else handle.quality.value,
        "loaded": meta,
        "dtype": str(loaded.dtype).replace("torch.", ""),
    }
    if not _send(conn, ("ready", ready)):
        return
    _serve(conn, stop, loaded, handle, runner, group=spec.group is not None)


def _send(conn: Any, msg: tuple) -> bool:
    try:
        conn.send(msg)
        return True
    except (OSError, EOFError):  # the server's end is gone
        return False


def _serve(conn: Any, stop: Any, loaded: Any, handle: Any, runner: Callable[..., Any], group: bool = False) -> None:
    """The batch loop. ``group``: this worker is one rank of a context-parallel group, whose
    members stop a batch together (the stop check is a collective, see distributed.any_rank)."""
    from .engine import mounted_sites, transition_info

    if group:
        from .distributed import any_rank

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the server process is gone: nothing will read our answers
        if msg[0] == "stop":
            return
        _, batch_id, quality, slots, pad_to, progress = msg
        info: dict[str, Any] = {"transition": None}
        try:
            q = Quality.parse(quality)
            if handle is not None and handle.quality != q:
                before = handle.quality
                info["transition"] = transition_info(before, q, handle.set_quality(q))
            info["mounted"] = mounted_sites(loaded.pipe)
            info["handle_quality"] = None if handle is None else handle.quality.value
            kw: dict[str, Any] = {}
            if progress:

                def on_step(i: int, total: int, _id: int = batch_id) -> None:
                    conn.send(("progress", _id, i, total))
                    stopped = stop.value == _id
                    if group:
                        stopped = any_rank(stopped)
                    if stopped:
                        raise BatchAbandoned("stopped by the server")

                kw["on_step"] = on_step
            t0 = time.perf_counter()
            images = runner(loaded, slots, pad_to=pad_to, **kw)
            info["seconds"] = time.perf_counter() - t0
            info["padded_to"] = max(len(slots), pad_to or 0)
            reply: tuple = ("result", batch_id, list(images), info, _tier(handle))
            if not _send(conn, reply):
                return
        except BaseException as e:  # noqa: BLE001 - reported to the server, the worker lives on
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            # The tier switch (if any) happened before the pipeline failed: the engine counts it.
            if not _send(conn, ("error", batch_id, type(e).__name__, str(e), info["transition"], _tier(handle))):
                return


def _tier(handle: Any) -> str | None:
    return None if handle is None else handle.quality.value


# ---------------------------------------------------------------------------------------------
# The server side.


@dataclass
class _Job:
    batch_id: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    on_step: Callable[[int, int], None] | None
    stop_reason: str | None = None


class Worker:
    """The server's handle on one worker process: the engine's lane for that device.

    ``run`` is called on the engine's event loop, one batch at a time; a reader thread receives
    the worker's messages and settles the batch's future on that loop."""

    def __init__(self, index: int, device: str, process: Any, conn: Any, stop: Any) -> None:
        self.index = index
        self.device = device
        self.process = process
        self.pid: int | None = process.pid
        self.summary = ""
        self.dtype = ""
        self.quality: Quality | None = None  # the tier the worker has mounted (None: no acceleration)
        self.loaded: Any = None  # the model's description (no pipeline), from its ready message
        self.alive = True
        self.exitcode: int | None = None
        self._conn = conn
        self._stop = stop
        self._lock = threading.Lock()
        self._job: _Job | None = None
        self._reader: threading.Thread | None = None
        self._listeners: list[Callable[[Worker], None]] = []

    def __repr__(self) -> str:
        return f"Worker({self.index}, {self.device!r}, pid={self.pid}, alive={self.alive})"

    @property
    def name(self) -> str:
        return f"worker {self.index} ({self.device}, pid {self.pid})"

    def exit_description(self) -> str:
        if self.alive:
            return f"{self.name} is alive"
        return f"{self.name} exited with {_exit_text(self.exitcode)}"

    # -- running batches (on the engine's loop) ------------------------------------------------

    async def run(
        self,
        batch_id: int,
        quality: Quality,
        slots: Sequence[tuple[SamplingParams, int]],
        pad_to: int | None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> tuple[list[Any], dict[str, Any]]:
        """Run one batch on this worker: ``(images, info)`` as the in-process engine builds them
        (transition, mounted, handle_quality, seconds, padded_to). ``on_step(i, total)`` is
        called on the reader thread after each step of a video batch; if it raises
        BatchAbandoned the worker stops at its next step. Raises WorkerDied, WorkerBatchError, or
        BatchAbandoned."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if not self.alive:
                raise WorkerDied(f"{self.exit_description()}; batch {batch_id} did not run")
            if self._job is not None:
                raise RuntimeError(f"{self.name} is already running batch {self._job.batch_id}")
            self._job = _Job(batch_id, fut, loop, on_step)
        try:
            self._conn.send(("batch", batch_id, quality.value, list(slots), pad_to, on_step is not None))
        except (OSError, ValueError):
            pass  # the worker died: the reader thread sees it and fails the job
        return await fut

    def stop(self, batch_id: int, reason: str) -> None:
        """Ask the worker to stop ``batch_id`` at its next step (every request in it is gone)."""
        with self._lock:
            job = self._job
            if job is not None and job.batch_id == batch_id and job.stop_reason is None:
                job.stop_reason = reason
        self._stop.value = batch_id

    # -- the reader thread ---------------------------------------------------------------------

    def _start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, name=f"ditfuse-worker{self.index}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        sentinel = self.process.sentinel
        while True:
            ready = mpc.wait([self._conn, sentinel])
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    break
                self._dispatch(msg)
                continue
            # The process ended: read what it sent before it did, then stop.
            try:
                while self._conn.poll():
                    self._dispatch(self._conn.recv())
            except (EOFError, OSError):
                pass
            break
        self._exited()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        job = self._job
        if job is None or msg[1] != job.batch_id:
            return  # not the batch we are waiting for (cannot happen; one job at a time)
        if kind == "progress":
            if job.on_step is not None:
                try:
                    job.on_step(msg[2], msg[3])
                except BatchAbandoned as e:
                    self.stop(job.batch_id, str(e))
            return
        self.quality = None if msg[-1] is None else Quality.parse(msg[-1])
        with self._lock:
            self._job = None
        if kind == "result":
            _, _, images, info, _ = msg
            _settle(job, result=(images, info))
        elif kind == "error":
            _, _, type_name, message, transition, _ = msg
            if type_name == "BatchAbandoned":
                err: BaseException = BatchAbandoned(job.stop_reason or message)
            else:
                err = WorkerBatchError(f"{type_name}: {message} (on {self.name})", type_name)
            err.transition = transition  # type: ignore[attr-defined]  # counted by the engine
            _settle(job, error=err)

    def _exited(self) -> None:
        self.process.join(5)
        with self._lock:
            self.alive = False
            self.exitcode = self.process.exitcode
            job, self._job = self._job, None
        if job is not None:
            _settle(job, error=WorkerDied(f"{self.exit_description()} while running batch {job.batch_id}"))
        for listener in list(self._listeners):
            try:
                listener(self)
            except RuntimeError:  # the engine's loop is closed: nobody to tell
                pass


def _settle(job: _Job, result: Any = None, error: BaseException | None = None) -> None:
    def done() -> None:
        if job.future.done():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: the engine is gone
        pass


def _reap(processes: list[Any]) -> None:
    """A pool collected without :meth:`WorkerPool.close`: kill what is still running."""
    for p in processes:
        try:
            if p.is_alive():
                p.kill()
                p.join(5)
        except (OSError, ValueError, AssertionError):
            pass


# Pools not closed yet. At interpreter exit multiprocessing joins every non-daemonic child, and a
# worker waits for its next job until its pipe closes: without this hook an exit that skipped
# close() would hang. Registered after multiprocessing.util's own hook, so it runs first (LIFO).
_OPEN_POOLS: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()
_atexit_registered = False


def _close_open_pools() -> None:
    for pool in list(_OPEN_POOLS):
        pool.close(timeout_s=5.0)


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        import atexit
        import multiprocessing.util  # noqa: F401 - its exit hook must be registered before ours

        atexit.register(_close_open_pools)
        _atexit_registered = True


class WorkerPool:
    """N worker processes, one per device, each holding its own pipeline (module docstring).

    ``devices``: e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``. ``runner``:
    ``"module:function"`` run in the workers instead of :func:`~ditfuse.runtime.engine.run_batch`
    (same signature). ``env``: extra environment for the workers (None removes a variable).
    ``threads``: ``torch.set_num_threads`` in each worker. Start with :meth:`start` (blocks until
    every worker is ready); hand it to :class:`~ditfuse.runtime.engine.Engine` (``pool=``), which
    closes it at shutdown; or use it as a context manager."""

    def __init__(
        self,
        model: str,
        devices: Sequence[str],
        *,
        dtype: str | None = None,
        accelerate: bool = True,
        default_quality: str = "lossless",
        threads: int | None = None,
        runner: str | None = None,
        env: Mapping[str, str | None] | None = None,
        start_timeout_s: float = 1800.0,
        stop_timeout_s: float = 30.0,
        cuda_graph: "bool | str" = False,
        max_cuda_graphs: int = 4,
        loras: tuple = (),
        fuse_lora: bool = False,
    ) -> None:
        if not devices:
            raise ValueError("WorkerPool needs at least one device")
        if max_cuda_graphs < 1:
            raise ValueError("max_cuda_graphs must be >= 1")
        Quality.parse(default_quality)
        env_items = tuple((env or {}).items())
        self.devices = [parse_device(d) for d in devices]
        for d in self.devices:
            worker_environment(d)  # a CUDA index past CUDA_VISIBLE_DEVICES fails here, not in a child
        self.model = model
        self.specs = [
            WorkerSpec(i, model, d, dtype, accelerate, default_quality, threads, runner, env_items,
                       cuda_graph=cuda_graph, max_cuda_graphs=max_cuda_graphs, loras=tuple(loras),
                       fuse_lora=fuse_lora)
            for i, d in enumerate(self.devices)
        ]
        self.start_timeout_s = float(start_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.workers: list[Worker] = []
        self.loaded: Any = None
        self._closed = False
        self._close_lock = threading.Lock()  # the engine's shutdown and the exit hook may race
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn every worker and wait until each has loaded (and accelerated) the model. Raises
        WorkerStartupError, after stopping every worker, if one fails or is not ready within
        ``start_timeout_s``."""
        if self.workers:
            raise RuntimeError("WorkerPool.start: already started")
        ctx = multiprocessing.get_context("spawn")
        _register_atexit()
        _OPEN_POOLS.add(self)
        try:
            for spec in self.specs:
                parent, child = ctx.Pipe(duplex=True)
                # Lock-free: one writer (this process), one reader (the worker) of an aligned 8-byte
                # int, checked once per step. A locked Value would also start multiprocessing's
                # resource tracker process for its semaphore.
                stop = ctx.RawValue("q", 0)
                proc = ctx.Process(
                    target=_worker_main, args=(spec, child, stop), name=f"ditfuse-worker{spec.index}", daemon=False
                )
                proc.start()
                child.close()  # the worker holds its end; ours must close so EOF shows when it dies
                self.workers.append(Worker(spec.index, spec.device, proc, parent, stop))
            self._finalizer = weakref.finalize(self, _reap, [w.process for w in self.workers])
            self._finalizer.atexit = False  # exit is _close_open_pools' job
            self._wait_ready()
        except BaseException:
            self.close(timeout_s=5.0)
            raise
        for w in self.workers:
            w._start_reader()
        self.loaded = dataclasses.replace(self.workers[0].loaded, device=",".join(self.devices))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = {w.index: w for w in self.workers}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                w = next(iter(waiting.values()))
                raise WorkerStartupError(
                    f"{w.name} did not report ready within {self.start_timeout_s:g} s (loading {self.model!r})"
                )
            handles: dict[Any, Worker] = {}
            for w in waiting.values():
                handles[w._conn] = w
                handles[w.process.sentinel] = w
            for h in mpc.wait(list(handles), timeout=left):
                w = handles[h]
                if w.index not in waiting:
                    continue
                msg = None
                try:
                    if w._conn.poll():
                        msg = w._conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is None:
                    if h is w._conn and w.process.is_alive():
                        continue  # spurious wake-up
                    w.process.join(5)
                    w.alive, w.exitcode = False, w.process.exitcode
                    raise WorkerStartupError(f"{w.name} exited with {_exit_text(w.exitcode)} before it was ready "
                                             f"(loading {self.model!r} on {w.device})")
                if msg[0] == "failed":
                    _, type_name, message, _tb = msg
                    raise WorkerStartupError(f"{w.name} failed to start: {type_name}: {message}")
                info = msg[1]
                w.pid = info["pid"]
                w.summary = info["summary"]
                w.dtype = info["dtype"]
                w.loaded = info["loaded"]
                w.quality = None if info["quality"] is None else Quality.parse(info["quality"])
                del waiting[w.index]

    def live(self) -> list[Worker]:
        """The workers whose process is alive (the lanes the engine may use)."""
        return [w for w in self.workers if w.alive]

    def add_exit_listener(self, listener: Callable[[Worker], None]) -> None:
        """Call ``listener(worker)`` (on that worker's reader thread) when a worker process ends."""
        for w in self.workers:
            w._listeners.append(listener)

    def summary(self) -> str:
        """One block per worker: its device, dtype, pid and what ditfuse mounted there."""
        out = []
        for w in self.workers:
            out.append(f"worker {w.index}: {w.device} ({w.dtype}), pid {w.pid}")
            out += [f"  {line}" for line in w.summary.strip().splitlines()]
        return "\n".join(out)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop every worker: ask, wait up to ``timeout_s`` (default ``stop_timeout_s``), then kill
        (workers ignore SIGTERM); join the reader threads. Idempotent. Call after the engine drained
        (:meth:`Engine.shutdown` does): a batch still running fails with WorkerDied."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.stop_timeout_s if timeout_s is None else timeout_s
        for w in self.workers:
            try:
                w._conn.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
                w.process.join(10)
        for w in self.workers:
            if w._reader is not None:
                w._reader.join(10)
            w.alive = False
            # The reader thread's join can lose the race to reap the process to ours above (its
            # waitpid then fails and it records no exit code): ours has it.
            if w.exitcode is None:
                w.exitcode = w.process.exitcode
            try:
                w._conn.close()
            except OSError:
                pass
        if self._finalizer is not None:
            self._finalizer.detach()
        _OPEN_POOLS.discard(self)

    def __enter__(self) -> "WorkerPool":
        if not self.workers:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Context parallelism in serve: one request spread over every device.


class GroupLane:
    """One engine lane made of the N member workers of a context-parallel group (ContextPool).

    Every batch goes to every member (each runs the whole pipeline with the same seeds; diffusers'
    hooks split the transformer's sequence across them and gather its output), and rank 0's
    images are the batch's result. The members stop a cancelled video batch at the same step (the
    stop check is a collective). A member that dies leaves the others blocked in the group's next
    collective, so the lane kills them all: the group is dead, and its batch fails with
    WorkerDied naming the member that died first."""

    def __init__(self, members: list[Worker]) -> None:
        self.members = members
        self.index = 0
        self.device = ",".join(m.device for m in members)
        self._listeners: list[Callable[[Any], None]] = []
        self._first_dead: Worker | None = None
        self._dead_lock = threading.Lock()
        for m in members:
            m._listeners.append(self._member_exited)

    # the attributes the engine reads from a lane
    @property
    def alive(self) -> bool:
        return all(m.alive for m in self.members)

    @property
    def quality(self) -> Quality | None:
        return self.members[0].quality

    @property
    def pid(self) -> int | None:
        return self.members[0].pid

    @property
    def exitcode(self) -> int | None:
        return None if self._first_dead is None else self._first_dead.exitcode

    @property
    def name(self) -> str:
        return f"context-parallel group ({self.device}; pids {', '.join(str(m.pid) for m in self.members)})"

    def exit_description(self) -> str:
        if self._first_dead is None:
            return f"{self.name} is alive"
        return f"{self.name} stopped: {self._first_dead.exit_description()}"

    def _member_exited(self, member: Worker) -> None:
        with self._dead_lock:
            first = self._first_dead is None
            if first:
                self._first_dead = member
        if not first:
            return
        for m in self.members:  # the others would wait forever in the group's next collective
            if m is not member and m.process.is_alive():
                m.process.kill()
        for listener in list(self._listeners):
            try:
                listener(self)
            except RuntimeError:  # the engine's loop is closed
                pass

    async def run(
        self,
        batch_id: int,
        quality: Quality,
        slots: Sequence[tuple[SamplingParams, int]],
        pad_to: int | None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> tuple[list[Any], dict[str, Any]]:
        """Run the batch on every member; rank 0's ``(images, info)``. Raises as Worker.run."""
        if not self.alive:
            raise WorkerDied(f"{self.exit_description()}; batch {batch_id} did not run")
        # Every member must install the per-step callback (it holds the collective stop check);
        # progress is reported from rank 0 only.
        quiet = None if on_step is None else (lambda i, total: None)
        runs = [m.run(batch_id, quality, slots, pad_to, on_step if r == 0 else quiet) for r, m in enumerate(self.members)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        dead = next((m for m, r in zip(self.members, results) if isinstance(r, WorkerDied)), None)
        if dead is not None:
            # The member's reader thread settles its job before it calls its exit listeners, so
            # the gather can finish before _member_exited ran: record the death here (idempotent;
            # a member we killed ourselves is never first, _first_dead was set before the kill).
            self._member_exited(dead)
            raise WorkerDied(f"{self.exit_description()} while running batch {batch_id}")
        if isinstance(results[0], BaseException):
            raise results[0]
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:  # rank 0 finished, another rank failed: the ranks disagree
            raise WorkerBatchError(f"a rank of {self.name} failed where rank 0 did not: {failed}", type(failed).__name__)
        return results[0]

    def stop(self, batch_id: int, reason: str) -> None:
        for m in self.members:
            m.stop(batch_id, reason)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ContextPool(WorkerPool):
    """``ditfuse serve --parallel context``: the N devices form one torch.distributed group (NCCL
    on GPUs, gloo on CPU, rendezvous on a loopback TCP port) and serve as ONE lane: each batch runs
    on all of them with diffusers' context parallelism (``mode``: ulysses or ring) on every
    transformer, ditfuse mounted in every member. For one large request (a long video) at a
    time; ``--parallel data`` serves more requests at once instead. See :class:`GroupLane`."""

    def __init__(self, model: str, devices: Sequence[str], *, mode: str = "ulysses", **kw: Any) -> None:
        super().__init__(model, devices, **kw)
        if len(self.devices) < 2:
            raise ValueError("context parallelism needs at least 2 devices")
        kinds = {d.split(":")[0] for d in self.devices}
        if len(kinds) > 1:
            raise ValueError(f"a context-parallel group takes devices of one kind, got {', '.join(self.devices)}")
        if mode not in ("ulysses", "ring"):
            raise ValueError(f"--parallel-mode must be ulysses or ring, got {mode!r}")
        if mode == "ring" and kinds == {"cpu"}:
            raise ValueError("ring attention needs a GPU attention backend that returns the log-sum-exp; "
                             "on CPU use --parallel-mode ulysses")
        self.mode = mode
        init = f"tcp://127.0.0.1:{_free_port()}"
        world = len(self.devices)
        self.specs = [dataclasses.replace(spec, group=(spec.index, world, init, mode)) for spec in self.specs]
        self.members: list[Worker] = []

    def start(self) -> None:
        super().start()
        self.members = self.workers
        # The engine's lanes (WorkerPool.live / add_exit_listener work on them unchanged: a lane
        # has ``alive`` and ``_listeners`` like a Worker).
        self.workers = [GroupLane(self.members)]

    def summary(self) -> str:
        head = f"context-parallel group ({self.mode}) over {len(self.members or self.specs)} ranks"
        return "\n".join([head, *("  " + line for line in self._member_summary().splitlines())])

    def _member_summary(self) -> str:
        lanes, self.workers = self.workers, self.members
        try:
            return super().summary()
        finally:
            self.workers = lanes

    def close(self, timeout_s: float | None = None) -> None:
        if not self.members:
            super().close(timeout_s)
            return
        lanes, self.workers = self.workers, self.members
        try:
            super().close(timeout_s)
        finally:
            self.workers = lanes
