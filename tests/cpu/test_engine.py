"""The batching engine: scheduling logic with a recording runner, then the tiny preset for real."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from ditfuse.contracts.quality import Quality
from ditfuse.runtime.engine import Engine, EngineClosed, QueueFull, RequestDropped, RequestTimeout
from ditfuse.runtime.params import SamplingParams


def P(prompt="a cat", **kw):
    kw.setdefault("size", "64x64")
    kw.setdefault("num_inference_steps", 1)
    kw.setdefault("seed", 0)
    return SamplingParams.create(prompt, **kw)


class Runner:
    """Stands in for run_batch: records every call; can be held inside a call."""

    def __init__(self, handle=None):
        self.calls = []  # (list of (prompt, seed, quality), pad_to)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.active = False
        self.handle = handle
        self.quality_seen = []

    def __call__(self, loaded, slots, pad_to=None):
        self.active = True
        try:
            self.entered.set()
            if self.handle is not None:
                self.quality_seen.append((slots[0][0].quality, self.handle.quality))
            self.calls.append(([(p.prompt, p.seed + i, p.quality) for p, i in slots], pad_to))
            if any(p.prompt == "boom" for p, _ in slots):
                raise RuntimeError("pipeline exploded")
            assert self.gate.wait(10)
            return [("img", p.prompt, p.seed + i) for p, i in slots]
        finally:
            self.active = False

    @property
    def prompts_run(self):
        return [pr for slots, _ in self.calls for pr, _, _ in slots]


class FakeHandle:
    """Stands in for accelerate()'s handle. ``mounts``: whether set_quality really (un)mounts a
    request-gated site (a GPU machine) or mounts nothing (a CPU machine: no fused ops)."""

    def __init__(self, runner_ref, mounts=True):
        self._q = Quality.LOSSLESS
        self.transitions = []
        self.runner_ref = runner_ref
        self.mounts = mounts

    @property
    def quality(self):
        return self._q

    def set_quality(self, q):
        assert not self.runner_ref[0].active, "set_quality called while a batch was running"
        self.transitions.append((self._q, Quality.parse(q)))
        self._q = Quality.parse(q)
        if not self.mounts:  # what accelerate() returns with no mounted model
            return {}
        high = self._q is Quality.HIGH
        site = ["proj_out:probe"]
        return {"transformer": SimpleNamespace(mounted=site if high else [], unmounted=[] if high else site, failed=None)}


FAKE_MODEL = SimpleNamespace(name="fake", pipe=SimpleNamespace(components={}), device="cpu", default_size=(64, 64), size_multiple=16)


def run(coro, timeout=60):
    """``coro`` to completion; ``timeout`` only guards against a hang (not a timing assertion)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make_engine(runner, **kw):
    kw.setdefault("batch_wait_ms", 100)
    return Engine(FAKE_MODEL, kw.pop("handle", None), runner=runner, **kw)


def test_compatible_requests_share_batches_up_to_max_and_are_padded():
    runner = Runner()

    async def main():
        eng = make_engine(runner, max_batch_size=4)
        await eng.start()
        res = await asyncio.gather(*[eng.submit(P(f"p{i}", seed=i)) for i in range(6)])
        await eng.shutdown()
        return eng, res

    eng, res = run(main())
    assert [len(s) for s, _ in runner.calls] == [4, 2]
    assert [pad for _, pad in runner.calls] == [4, 4]
    for i, images in enumerate(res):
        assert len(images) == 1
        assert images[0].image == ("img", f"p{i}", i)
        assert images[0].seed == i
    assert [b["size"] for b in eng.batch_log] == [4, 2]
    assert all(b["padded_to"] == 4 for b in eng.batch_log)
    m = eng.metrics
    assert m.value("ditfuse_batches_total") == 2 and m.value("ditfuse_images_total") == 6
    assert m.value("ditfuse_batch_size_total", size=4) == 1 and m.value("ditfuse_batch_size_total", size=2) == 1
    assert m.value("ditfuse_batch_size_total", size=1) == 0
    # one queue wait and one latency per request; one generation time per batch, by tier
    assert m.value("ditfuse_queue_wait_seconds_count") == 6
    assert m.value("ditfuse_request_latency_seconds_count") == 6
    assert m.value("ditfuse_generation_seconds_count", quality="lossless") == 2
    assert m.value("ditfuse_generation_seconds_count", quality="high") == 0
    # the 5th and 6th requests waited for the first batch: their queue wait covers it
    assert m.value("ditfuse_queue_wait_seconds_sum") >= 0
    assert m.value("ditfuse_generation_seconds_sum", quality="lossless") == pytest.approx(
        sum(b["seconds"] for b in eng.batch_log), abs=1e-5
    )


def test_unpadded_batches_when_disabled():
    runner = Runner()

    async def main():
        eng = make_engine(runner, max_batch_size=4, pad_batches=False)
        await eng.start()
        await asyncio.gather(*[eng.submit(P(f"p{i}")) for i in range(3)])
        await eng.shutdown()

    run(main())
    assert runner.calls[0][1] is None


def test_incompatible_requests_never_share_a_batch():
    runner = Runner()
    variants = [
        dict(),
        dict(size="32x32"),
        dict(num_inference_steps=2),
        dict(guidance_scale=5.0),
        dict(quality="high"),
    ]

    async def main():
        eng = make_engine(runner, max_batch_size=8)
        await eng.start()
        reqs = [P(f"v{j}-{i}", **variants[j]) for i in range(3) for j in range(len(variants))]
        await asyncio.gather(*[eng.submit(r) for r in reqs])
        await eng.shutdown()
        return eng

    eng = run(main())
    assert len(runner.calls) == len(variants)
    for slots, _ in runner.calls:
        assert len({pr.split("-")[0] for pr, _, _ in slots}) == 1
        assert len(slots) == 3
    assert len({tuple(b["signature"]) for b in eng.batch_log}) == len(variants)


def test_n_larger_than_batch_is_split_in_order():
    runner = Runner()

    async def main():
        eng = make_engine(runner, max_batch_size=4)
        await eng.start()
        images = await eng.submit(P("many", n=6, seed=100))
        await eng.shutdown()
        return images

    images = run(main())
    assert [len(s) for s, _ in runner.calls] == [4, 2]
    assert [g.seed for g in images] == list(range(100, 106))
    assert [g.index for g in images] == list(range(6))
    assert [g.image[2] for g in images] == list(range(100, 106))


def test_queue_full_raises_and_queue_drains_afterwards():
    runner = Runner()
    runner.gate.clear()

    async def main():
        eng = make_engine(runner, max_batch_size=1, max_queue=2, batch_wait_ms=0)
        await eng.start()
        first = asyncio.create_task(eng.submit(P("running")))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(eng.submit(P(f"w{i}"))) for i in range(2)]
        await asyncio.sleep(0.05)
        assert eng.queue_depth == 2
        with pytest.raises(QueueFull):
            await eng.submit(P("rejected"))
        runner.gate.set()
        done = await asyncio.gather(first, *waiting)
        await eng.shutdown()
        return eng, done

    eng, done = run(main())
    assert len(done) == 3
    assert "rejected" not in runner.prompts_run
    # the engine does not count requests (the server does, refusals included); its live gauges
    # are read at scrape time
    text = eng.prometheus().decode()
    assert "ditfuse_queue_depth 0.0" in text and "ditfuse_images_in_flight 0.0" in text
    assert eng.metrics.value("ditfuse_batches_total") == 3


def test_timed_out_request_is_dropped_before_it_runs():
    runner = Runner()
    runner.gate.clear()

    async def main():
        eng = make_engine(runner, max_batch_size=1, batch_wait_ms=0)
        await eng.start()
        first = asyncio.create_task(eng.submit(P("running")))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(RequestTimeout):
            await eng.submit(P("late"), timeout_s=0.2)
        runner.gate.set()
        await first
        ok = await eng.submit(P("after"))
        await eng.shutdown()
        return eng, ok

    eng, ok = run(main())
    assert runner.prompts_run == ["running", "after"]
    assert ok[0].image[1] == "after"
    assert eng.metrics.value("ditfuse_queue_dropped_total", reason="timeout") == 1
    assert eng.metrics.value("ditfuse_queue_wait_seconds_count") == 2  # "late" never started


def test_disconnected_client_is_dropped_before_it_runs():
    runner = Runner()
    runner.gate.clear()
    gone = threading.Event()

    async def is_disconnected():
        return gone.is_set()

    async def connected():
        return False

    async def main():
        eng = make_engine(runner, max_batch_size=1, batch_wait_ms=0)
        await eng.start()
        first = asyncio.create_task(eng.submit(P("running")))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        left = asyncio.create_task(eng.submit(P("left"), is_disconnected=is_disconnected))
        stays = asyncio.create_task(eng.submit(P("stays"), is_disconnected=connected))
        await asyncio.sleep(0.05)
        gone.set()
        with pytest.raises(RequestDropped):
            await left
        runner.gate.set()
        await first
        ok = await stays
        await eng.shutdown()
        return eng, ok

    eng, ok = run(main())
    assert runner.prompts_run == ["running", "stays"]
    assert ok[0].image[1] == "stays"
    assert eng.metrics.value("ditfuse_queue_dropped_total", reason="disconnected") == 1
    assert eng.metrics.value("ditfuse_queue_dropped_total", reason="timeout") == 0


def test_graceful_shutdown_finishes_in_flight_and_queued_then_refuses():
    runner = Runner()
    runner.gate.clear()

    async def main():
        eng = make_engine(runner, max_batch_size=1, batch_wait_ms=0)
        await eng.start()
        a = asyncio.create_task(eng.submit(P("a")))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        b = asyncio.create_task(eng.submit(P("b")))
        await asyncio.sleep(0.02)
        stopping = asyncio.create_task(eng.shutdown(drain=True))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineClosed):
            await eng.submit(P("c"))
        assert not stopping.done()
        runner.gate.set()
        ra, rb = await asyncio.gather(a, b)
        await stopping
        return eng, ra, rb

    eng, ra, rb = run(main())
    assert runner.prompts_run == ["a", "b"]
    assert ra[0].image[1] == "a" and rb[0].image[1] == "b"
    assert not eng.running


def test_shutdown_without_drain_fails_waiting_requests():
    runner = Runner()
    runner.gate.clear()

    async def main():
        eng = make_engine(runner, max_batch_size=1, batch_wait_ms=0)
        await eng.start()
        a = asyncio.create_task(eng.submit(P("a")))
        while not runner.entered.is_set():
            await asyncio.sleep(0.01)
        b = asyncio.create_task(eng.submit(P("b")))
        await asyncio.sleep(0.02)
        stopping = asyncio.create_task(eng.shutdown(drain=False))
        with pytest.raises(EngineClosed):
            await b
        runner.gate.set()
        ra = await a
        await stopping
        return ra

    ra = run(main())
    assert ra[0].image[1] == "a"
    assert runner.prompts_run == ["a"]


def test_pipeline_error_fails_only_its_batch():
    runner = Runner()

    async def main():
        eng = make_engine(runner, max_batch_size=2, batch_wait_ms=50)
        await eng.start()
        res = await asyncio.gather(eng.submit(P("boom")), eng.submit(P("mate")), return_exceptions=True)
        ok = await eng.submit(P("later"))
        await eng.shutdown()
        return eng, res, ok

    eng, res, ok = run(main())
    assert all(isinstance(r, RuntimeError) for r in res)
    assert ok[0].image[1] == "later"
    assert "error" in eng.batch_log[0] and "error" not in eng.batch_log[1]
    assert eng.metrics.value("ditfuse_batch_errors_total") == 1
    assert eng.metrics.value("ditfuse_batches_total") == 1 and eng.metrics.value("ditfuse_images_total") == 1


def _mixed_quality_run(mounts):
    ref = [None]
    handle = FakeHandle(ref, mounts=mounts)
    runner = Runner(handle)
    ref[0] = runner

    async def main():
        eng = make_engine(runner, max_batch_size=2, batch_wait_ms=30, handle=handle)
        await eng.start()
        qs = ["high", "lossless", "high", "high", "lossless", "lossless", "high"]
        await asyncio.gather(*[eng.submit(P(f"q{i}", quality=q)) for i, q in enumerate(qs)])
        await eng.shutdown()
        return eng

    return run(main()), handle, runner


def test_quality_changes_only_between_batches():
    eng, handle, runner = _mixed_quality_run(mounts=True)
    # every batch ran with the handle at the batch's quality
    assert runner.quality_seen and all(want is got for want, got in runner.quality_seen)
    for b in eng.batch_log:
        assert b["handle_quality"] == b["quality"]
    n_mounts = sum(1 for _, to in handle.transitions if to is Quality.HIGH)
    n_unmounts = sum(1 for _, to in handle.transitions if to is Quality.LOSSLESS)
    assert n_mounts >= 1
    m = eng.metrics
    assert (m.value("ditfuse_quality_mounts_total"), m.value("ditfuse_quality_unmounts_total")) == (n_mounts, n_unmounts)
    text = eng.prometheus().decode()
    assert f"ditfuse_quality_mounts_total {float(n_mounts)}" in text
    assert f"ditfuse_quality_unmounts_total {float(n_unmounts)}" in text
    assert 'ditfuse_quality_current{quality="lossless"} 0.0' in text  # the last batch ran high
    assert 'ditfuse_quality_current{quality="high"} 1.0' in text
    assert m.value("ditfuse_generation_seconds_count", quality="high") >= 1
    assert m.value("ditfuse_generation_seconds_count", quality="lossless") >= 1


def test_tier_switch_that_mounts_nothing_is_not_counted():
    """A CPU machine: the handle switches tier but no request-gated kernel mounts, so the mount and
    unmount counters stay 0 (they used to count every switch)."""
    eng, handle, _ = _mixed_quality_run(mounts=False)
    assert sum(1 for _, to in handle.transitions if to is Quality.HIGH) >= 1  # it did switch
    assert eng.metrics.value("ditfuse_quality_mounts_total") == 0
    assert eng.metrics.value("ditfuse_quality_unmounts_total") == 0
    assert any(b["transition"] is not None for b in eng.batch_log)


def _alternating_transitions(switch_wait_ms):
    ref = [None]
    handle = FakeHandle(ref)
    runner = Runner(handle)
    ref[0] = runner

    async def main():
        eng = make_engine(runner, max_batch_size=1, batch_wait_ms=0, handle=handle,
                          quality_switch_wait_ms=switch_wait_ms)
        await eng.start()
        qs = ["high", "lossless"] * 4
        await asyncio.gather(*[eng.submit(P(f"a{i}", quality=q)) for i, q in enumerate(qs)])
        await eng.shutdown()
        return eng

    eng = run(main())
    assert sorted(runner.prompts_run) == sorted(f"a{i}" for i in range(8))  # nothing lost
    for b in eng.batch_log:
        assert b["handle_quality"] == b["quality"]
    return len(handle.transitions)


def test_scheduler_prefers_the_mounted_tier_to_avoid_switches():
    # FIFO (no affinity): lossless is mounted, so the first 'high' switches, then every batch flips.
    assert _alternating_transitions(0) >= 7
    # With affinity: all waiting work of the mounted tier runs first, then one switch.
    assert _alternating_transitions(60_000) <= 2


# ---------------------------------------------------------------------------------------------
# The tiny preset, for real.


def _png(g) -> bytes:
    from ditfuse.runtime.server import encode_image

    return encode_image(g.image, g.params, g.index, "tiny-flux").encode()


@pytest.mark.slow  # the real tiny pipeline (interpreter-mounted kernels)
def test_image_depends_on_its_seed_not_on_batch_mates(tiny_cache):
    from ditfuse.runtime.presets import load_model

    loaded = load_model("tiny-flux")

    async def main():
        eng = Engine(loaded, None, max_batch_size=4, batch_wait_ms=200)
        await eng.start()
        alone = await eng.submit(P("a red fox", seed=1234, num_inference_steps=2))
        mates = await asyncio.gather(
            eng.submit(P("zebra", seed=1, num_inference_steps=2)),
            eng.submit(P("a red fox", seed=1234, num_inference_steps=2)),
            eng.submit(P("blue sky", seed=2, num_inference_steps=2, n=2)),
        )
        other = await eng.submit(P("a red fox", seed=1235, num_inference_steps=2))
        await eng.shutdown()
        return eng, alone, mates, other

    eng, alone, mates, other = run(main())
    assert [b["size"] for b in eng.batch_log] == [1, 4, 1]
    assert _png(alone[0]) == _png(mates[1][0])
    assert _png(alone[0]) != _png(other[0])  # the seed matters
    # image 1 of an n=2 request equals a lone request with seed+1
    assert mates[2][1].seed == 3


@pytest.mark.slow  # the real tiny pipeline (interpreter-mounted kernels)
def test_each_batch_runs_with_the_mount_state_of_its_quality(tiny_cache):
    """Mixed-quality traffic on the real tiny pipeline through accelerate(), with admission
    records injected so that quality="high" really mounts here: the batch log and the close ops'
    call counts show which batches ran with the high tier."""
    from ditfuse.contracts import admission, ops
    from ditfuse.models import accelerate, mounted_sites
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.presets import load_model

    loaded = load_model("tiny-flux", dtype="bf16")  # close kernels need a half-precision model
    handle = accelerate(loaded.pipe, quality="lossless")
    if "transformer" not in handle._mounted:
        pytest.skip("the FLUX adapter did not mount here: " + handle.report().summary())
    seen = []

    def runner(ld, slots, pad_to=None):
        ops.reset_counts()
        out = run_batch(ld, slots, pad_to=pad_to)
        seen.append((slots[0][0].quality, sum(c.calls["kernel"] for c in ops.CLOSE.values())))
        return out

    async def main():
        eng = Engine(loaded, handle, max_batch_size=2, batch_wait_ms=100, runner=runner)
        await eng.start()
        qs = ["high", "lossless", "high", "lossless", "lossless", "high"]
        res = await asyncio.gather(*[eng.submit(P(f"q{i}", quality=qq, seed=i)) for i, qq in enumerate(qs)])
        await eng.shutdown()
        return eng, res

    # six real pipeline calls with the Triton interpreter's kernels: on a loaded 2-core CI box
    # they took over a minute (a 60 s cap failed there once, round 19)
    with admission.override_records([admission.admitted_record(op) for op in ops.CLOSE]):
        eng, res = run(main(), timeout=600)
    assert len(res) == 6
    assert len(eng.batch_log) >= 2
    for b in eng.batch_log:
        assert bool(b["mounted"]) == (b["quality"] == "high"), b
        assert b["handle_quality"] == b["quality"]
    for quality, calls in seen:
        assert (calls > 0) == (quality is Quality.HIGH)
    assert {qq for qq, _ in seen} == {Quality.HIGH, Quality.LOSSLESS}
    handle.unmount()
    assert mounted_sites(loaded.pipe.transformer) == []


def test_metrics_batches_and_images_read_as_ints_for_the_serving_benchmark():
    """bench/bench_serve_cpu.py computes throughput from ``engine.metrics.batches`` / ``.images``."""
    runner = Runner()

    async def main():
        eng = make_engine(runner, max_batch_size=2, batch_wait_ms=50)
        await eng.start()
        await asyncio.gather(*[eng.submit(P(f"p{i}", n=2 if i == 0 else 1)) for i in range(3)])
        await eng.shutdown()
        return eng

    eng = run(main())
    assert (eng.metrics.batches, eng.metrics.images) == (len(runner.calls), 4)
    assert isinstance(eng.metrics.batches, int) and isinstance(eng.metrics.images, int)


def test_pipeline_runs_under_no_grad_not_inference_mode():
    """run_batch calls the pipeline under torch.no_grad (as diffusers' pipelines do themselves):
    under inference_mode every tensor lacks a version counter, and the cross-block hand-off and
    the RoPE table cache, which rely on it, would stand down for every served request."""
    import torch

    from ditfuse.runtime.engine import run_batch

    seen = []

    class Pipe:
        def __call__(self, prompt, height, width, num_inference_steps, guidance_scale, generator,
                     num_images_per_prompt, output_type):
            seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            return SimpleNamespace(images=[f"img{i}" for i in range(len(prompt))])

    loaded = SimpleNamespace(pipe=Pipe(), name="fake", device="cpu", call_kwargs={}, is_video=False)
    assert run_batch(loaded, [(P(), 0), (P(), 1)]) == ["img0", "img1"]
    assert seen == [(False, False)]
