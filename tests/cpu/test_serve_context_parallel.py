"""`ditfuse serve --parallel context`: the devices form one context-parallel group (ContextPool),
one engine lane whose every batch runs on all of them. On CPU: 2 worker processes, gloo, the
tiny presets, plain diffusers in the workers (no Triton interpreter: deterministic, see
test_workers.py) — the group machinery is what is tested here; ditfuse under context
parallelism is tests/cpu/test_context_parallel.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ditfuse.runtime.engine import Engine, NoLiveWorkers, RequestCancelled
from ditfuse.runtime.params import SamplingParams
from ditfuse.runtime.workers import ContextPool, WorkerDied

pytestmark = [pytest.mark.xdist_group("workers"), pytest.mark.slow]

EXE = str(Path(sys.executable).with_name("ditfuse"))
PLAIN = {"TRITON_INTERPRET": None}


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _shutdown(eng: Engine) -> None:
    """Bounded: a group stuck in a collective must fail the test, not hang it (pool.close()
    afterwards kills what is left)."""
    try:
        await asyncio.wait_for(eng.shutdown(drain=False), 30)
    except asyncio.TimeoutError:
        pass


def _pool(model: str) -> ContextPool:
    pool = ContextPool(model, ["cpu", "cpu"], threads=1, env=PLAIN, start_timeout_s=120)
    pool.start()
    return pool


def test_image_equals_generate_over_two_ranks_and_batches_run_on_every_rank(tiny_cache, tmp_path):
    ref = tmp_path / "ref.png"
    env = {**os.environ, "DITFUSE_CACHE": str(tiny_cache), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([EXE, "generate", "--model", "tiny-flux", "--prompt", "a red fox", "--size", "64x64",
                        "--steps", "2", "--seed", "5", "--devices", "cpu,cpu", "--out", str(ref)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    pool = _pool("tiny-flux")
    pids = [m.pid for m in pool.members]
    try:
        assert len(pool.workers) == 1 and pool.workers[0].device == "cpu,cpu"  # one lane
        assert "context-parallel group (ulysses) over 2 ranks" in pool.summary()

        async def serve():
            eng = Engine(pool.loaded, None, pool=pool, max_batch_size=1, batch_wait_ms=10)
            await eng.start()
            try:
                p = SamplingParams.create("a red fox", size="64x64", num_inference_steps=2, seed=5)
                out = await asyncio.wait_for(eng.submit(p), 120)
                return out, list(eng.batch_log)
            finally:
                await _shutdown(eng)

        (img,), log = asyncio.run(serve())
    finally:
        pool.close()
    assert np.array_equal(np.asarray(img.image), np.asarray(Image.open(ref))), "serve's group and generate's ranks differ"
    assert log[-1]["device"] == "cpu,cpu" and "error" not in log[-1]
    assert not any(pid_alive(p) for p in pids)


def test_cancelled_video_stops_every_rank_at_the_same_step_and_the_group_serves_on(tiny_cache):
    """The stop check is a collective: were it per rank, the rank that stopped first would leave
    the other waiting in the next all-to-all, and the next request would never finish. The lane
    sets every rank's stop flag at once, so to make the race certain the test tells rank 0 only:
    the collective must carry it to rank 1."""
    pool = _pool("tiny-wan")
    lane = pool.workers[0]
    lane.stop = lambda batch_id, reason: pool.members[0].stop(batch_id, reason)
    try:
        async def scenario():
            eng = Engine(pool.loaded, None, pool=pool, max_batch_size=1, batch_wait_ms=10)
            await eng.start()
            try:
                steps = []
                long = SamplingParams.create("a long one", size="32x32", num_inference_steps=200, seed=1).with_(num_frames=5)
                req = eng.enqueue(long, on_progress=lambda done, total: steps.append(done))
                t0 = time.monotonic()
                while not any(s >= 2 for s in steps):
                    assert time.monotonic() - t0 < 120, "the video never started"
                    await asyncio.sleep(0.01)
                eng.cancel(req)
                with pytest.raises(RequestCancelled):
                    await eng.wait(req)
                short = SamplingParams.create("after", size="32x32", num_inference_steps=2, seed=2).with_(num_frames=5)
                clip = await asyncio.wait_for(eng.submit(short), 60)
                t_wait = time.monotonic()
                while not any("stopped while running" in b.get("error", "") for b in eng.batch_log):
                    assert time.monotonic() - t_wait < 30
                    await asyncio.sleep(0.01)
                return steps, clip, list(eng.batch_log)
            finally:
                await _shutdown(eng)

        steps, (clip,), log = asyncio.run(scenario())
    finally:
        pool.close()
    assert max(steps) < 200  # stopped, not finished
    assert clip.image.shape == (5, 32, 32, 3)
    assert [("error" in b) for b in log] == [True, False]


def test_a_dead_rank_stops_the_group(tiny_cache):
    pool = _pool("tiny-flux")
    pids = [m.pid for m in pool.members]
    try:
        async def scenario():
            eng = Engine(pool.loaded, None, pool=pool, max_batch_size=1, batch_wait_ms=10)
            await eng.start()
            try:
                long = SamplingParams.create("slow", size="512x512", num_inference_steps=200, seed=1)
                req = eng.enqueue(long)
                t0 = time.monotonic()
                while not eng.in_flight:
                    assert time.monotonic() - t0 < 60
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                os.kill(pids[1], signal.SIGKILL)
                with pytest.raises(WorkerDied) as e:
                    await asyncio.wait_for(eng.wait(req), 60)
                with pytest.raises(NoLiveWorkers):
                    await eng.submit(SamplingParams.create("next", size="32x32", num_inference_steps=1))
                return str(e.value)
            finally:
                await _shutdown(eng)

        msg = asyncio.run(scenario())
    finally:
        pool.close()
    assert "context-parallel group (cpu,cpu" in msg and f"pid {pids[1]}) exited with exit code -9 (SIGKILL)" in msg, msg
    assert not any(pid_alive(p) for p in pids), "the surviving rank was left running"


def test_serve_parallel_context_needs_two_devices(capsys):
    from ditfuse.runtime import cli

    assert cli.main(["serve", "--parallel", "context", "--devices", "cpu"]) == 2
    assert "--parallel context spreads each request over several devices" in capsys.readouterr().err
    assert cli.main(["serve", "--parallel", "context", "--parallel-mode", "ring", "--devices", "cpu,cpu"]) == 2
    assert "ring attention needs a GPU" in capsys.readouterr().err


class _FakeMember:
    """A Worker stand-in whose batch fails with WorkerDied before its exit listeners ran: the
    order a member's reader thread uses (settle the job, then tell the listeners) lets the
    group's gather finish in between."""

    def __init__(self, pid: int, dies: bool) -> None:
        self.pid, self.device, self.dies = pid, "cpu", dies
        self.alive = True
        self._listeners: list = []
        self.process = type("P", (), {"is_alive": staticmethod(lambda: False), "kill": staticmethod(lambda: None)})()

    def exit_description(self) -> str:
        return f"worker {self.pid} (cpu, pid {self.pid}) exited with exit code -9 (SIGKILL)"

    async def run(self, batch_id, quality, slots, pad_to, on_step=None):
        if self.dies:
            self.alive = False
            raise WorkerDied(f"{self.exit_description()} while running batch {batch_id}")
        return [], {}


@pytest.mark.parametrize("dead_rank", [0, 1])
def test_group_names_the_dead_member_before_its_listener_ran(dead_rank):
    from ditfuse.runtime.workers import GroupLane

    members = [_FakeMember(100 + r, dies=r == dead_rank) for r in range(2)]
    lane = GroupLane(members)
    told = []
    lane._listeners.append(told.append)
    with pytest.raises(WorkerDied) as e:
        asyncio.run(lane.run(7, None, [], None))
    msg = str(e.value)
    assert "is alive" not in msg and f"pid {100 + dead_rank}) exited with exit code -9" in msg, msg
    assert told == [lane], "the engine's listener was not told the lane died"
    members[dead_rank]._listeners[0](members[dead_rank])  # the reader thread's late call: no-op
    assert told == [lane]
