"""Video building blocks without a server: seconds <-> frames, the SQLite job store, video files,
and the engine's video scheduling (batching, kind fairness, progress, cancellation, timeouts)
with a recording runner."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ditfuse.contracts.quality import Quality
from ditfuse.runtime import video_io
from ditfuse.runtime.engine import Engine, RequestCancelled, RequestTimeout
from ditfuse.runtime.jobs import SCHEMA_VERSION, DataDirLocked, JobStore, params_json
from ditfuse.runtime.params import (
    ParamError,
    SamplingParams,
    frames_for_seconds,
    resolve_num_frames,
    seconds_for_frames,
)

# ---------------------------------------------------------------------------------------------
# seconds <-> frames


@pytest.mark.parametrize(
    "seconds,frames",
    [(0.25, 5), (1, 17), (1.1, 17), (1.2, 21), (2, 33), (4, 65), (5, 81), (8, 129), (12, 193), (15, 241), (0.4, 9), (0.375, 9)],
)
def test_seconds_map_to_nearest_4k_plus_1_frames_at_16_fps(seconds, frames):
    assert frames_for_seconds(seconds, 16, 4) == frames
    assert (frames - 1) % 4 == 0
    got = resolve_num_frames(seconds=str(seconds), fps=16, frame_multiple=4, default_frames=17)
    assert got == frames
    # the reported duration is (frames - 1) / fps: exact for multiples of 0.25 s
    if seconds * 4 == int(seconds * 4):
        assert float(seconds_for_frames(frames, 16)) == seconds


def test_num_frames_rules():
    kw = dict(fps=16, frame_multiple=4, default_frames=17)
    assert resolve_num_frames(**kw) == 17
    assert resolve_num_frames(num_frames=1, **kw) == 1
    assert resolve_num_frames(num_frames="33", **kw) == 33
    assert resolve_num_frames(num_frames=65, seconds="4", **kw) == 65  # agreeing: fine
    cases = [
        (dict(num_frames=16), "num_frames", "4k+1"),
        (dict(num_frames=16), "num_frames", "13 or 17"),
        (dict(num_frames=0), "num_frames", "between 1 and 241"),
        (dict(num_frames=245), "num_frames", "between 1 and 241"),
        (dict(num_frames=2.5), "num_frames", "integer"),
        (dict(seconds="0"), "seconds", "between 0.25 and 15"),
        (dict(seconds=16), "seconds", "between 0.25 and 15"),
        (dict(seconds="four"), "seconds", "number"),
        (dict(seconds=float("nan")), "seconds", "number"),
        (dict(seconds=True), "seconds", "number"),
        (dict(seconds="4", num_frames=17), "num_frames", "does not match"),
    ]
    for args, param, needle in cases:
        with pytest.raises(ParamError) as e:
            resolve_num_frames(**args, **kw)
        assert e.value.param == param and needle in e.value.message, (args, e.value.message)


def test_num_frames_is_in_the_signature_and_metadata():
    p = SamplingParams.create("x", size="64x48", seed=1)
    v17, v21 = p.with_(num_frames=17), p.with_(num_frames=21)
    assert len({p.signature("m"), v17.signature("m"), v21.signature("m")}) == 3
    assert v17.metadata()["num_frames"] == "17" and "num_frames" not in p.metadata()
    assert SamplingParams(**{**v17.to_dict(), "quality": Quality.parse(v17.to_dict()["quality"])}) == v17


# ---------------------------------------------------------------------------------------------
# The job store


def _row(i, status="queued", **kw):
    row = dict(id=f"video_{i:03d}", model="m", status=status, progress=0, created_at=1000 + i, prompt=f"p{i}",
               size="64x48", seconds="1", quality="lossless", params="{}")
    row.update(kw)
    return row


def test_store_is_wal_sqlite_with_cursor_pagination(tmp_path):
    store = JobStore(tmp_path / "d")
    try:
        con = sqlite3.connect(store.db_path)
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        con.close()
        for i in range(7):
            store.insert(_row(i))
        rows, more = store.list(limit=3)
        assert [r["id"] for r in rows] == ["video_006", "video_005", "video_004"] and more
        rows, more = store.list(after="video_004", limit=3)
        assert [r["id"] for r in rows] == ["video_003", "video_002", "video_001"] and more
        rows, more = store.list(after="video_001", limit=3)
        assert [r["id"] for r in rows] == ["video_000"] and not more
        rows, more = store.list(order="asc", after="video_004", limit=10)
        assert [r["id"] for r in rows] == ["video_005", "video_006"] and not more
        with pytest.raises(KeyError):
            store.list(after="video_nope")
        assert store.update("video_001", status="in_progress")
        assert not store.update("video_001", only_status=("queued",), status="completed")
        assert store.get("video_001")["status"] == "in_progress"
        assert not store.update("video_nope", status="failed")
        assert store.delete("video_002") and store.get("video_002") is None and not store.delete("video_002")
        with pytest.raises(sqlite3.IntegrityError):
            store.insert(_row(3))  # ids are unique
        with pytest.raises(sqlite3.IntegrityError):
            store.insert(_row(99, status="done"))  # statuses are checked
    finally:
        store.close()
    # durable: a new store on the same dir sees the rows
    again = JobStore(tmp_path / "d")
    try:
        assert again.count() == 6 and again.get("video_001")["status"] == "in_progress"
    finally:
        again.close()


def test_store_retention_by_age_and_count(tmp_path):
    store = JobStore(tmp_path)
    try:
        for i in range(6):
            store.insert(_row(i, status="completed", finished_at=2000 + i, expires_at=2000 + i + 100))
        store.insert(_row(6, status="in_progress"))
        store.insert(_row(7, status="failed", finished_at=2010, expires_at=None))
        victims = {r["id"] for r in store.retention_victims(max_finished=3, now=2103.5)}
        # expired: 0..3 (expires 2100..2103); then keep the 3 newest finished of the rest (7, 5, 4)
        assert victims == {"video_000", "video_001", "video_002", "video_003"}
        victims = {r["id"] for r in store.retention_victims(max_finished=2, now=0)}
        assert victims == {"video_000", "video_001", "video_002", "video_003", "video_004"}  # keeps 7 and 5
        assert all(r["status"] != "in_progress" for r in store.retention_victims(max_finished=0, now=10**9))
    finally:
        store.close()


# The layout of schema version 1 exactly as version 1 wrote it (ditfuse/runtime/jobs.py's _SCHEMA
# then), kept verbatim here: the migration must keep working on such files.
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    seq            INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order (pagination cursor)
    id             TEXT NOT NULL UNIQUE,
    model          TEXT NOT NULL,
    status         TEXT NOT NULL CHECK (status IN ('queued', 'in_progress', 'completed', 'failed')),
    progress       INTEGER NOT NULL DEFAULT 0,
    created_at     INTEGER NOT NULL,
    started_at     INTEGER,
    completed_at   INTEGER,                -- completed jobs only (as in OpenAI's object)
    finished_at    INTEGER,                -- completed or failed: the retention clock
    expires_at     INTEGER,
    prompt         TEXT NOT NULL,
    size           TEXT NOT NULL,
    seconds        TEXT NOT NULL,
    quality        TEXT NOT NULL,
    params         TEXT NOT NULL,          -- JSON of SamplingParams.to_dict()
    file           TEXT,                   -- under files/
    bytes          INTEGER,
    error_code     TEXT,
    error_message  TEXT
);
CREATE INDEX IF NOT EXISTS videos_status ON videos (status);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def _v1_file(data_dir, rows, version="1"):
    """A data dir whose jobs.sqlite3 version 1 wrote (``version``: its meta row; None: none, as a
    crash between version 1's table and version writes left it). Returns the database path."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "jobs.sqlite3"
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.executescript(V1_SCHEMA)
    if version is not None:
        con.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (version,))
    for row in rows:
        con.execute(f"INSERT INTO videos ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
    con.close()
    return path


def _read(path, sql):
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _fake_video_jobs(store):
    """VideoJobs over ``store`` with an engine it only reads ``fps`` from (for ``to_api``)."""
    from ditfuse.runtime.videos import VideoJobs

    eng = SimpleNamespace(loaded=SimpleNamespace(is_video=True, fps=16), model_name="m")
    return VideoJobs(eng, store.data_dir, sweep_interval_s=0, store=store)


@pytest.mark.parametrize("version_row", ["1", None])
def test_store_migrates_a_version_1_file_in_place(tmp_path, caplog, version_row):
    """Opening a version-1 file adds ``close_sites`` (schema version 2) without losing a job; the
    old rows' ``quality_applied`` is unknown (null), not made up; one log line says so."""
    params = params_json(V("old", quality="high"))
    done = _row(1, status="completed", progress=100, completed_at=1100, finished_at=1100, expires_at=9999,
                file="video_001.mp4", bytes=1234, quality="high", params=params)
    failed = _row(2, status="failed", finished_at=1200, error_code="timeout", error_message="slow", params=params)
    queued = _row(3, params=params)
    path = _v1_file(tmp_path / "d", [done, failed, queued], version_row)
    before = _read(path, "SELECT * FROM videos ORDER BY seq")
    assert SCHEMA_VERSION == 2
    with caplog.at_level("INFO", logger="ditfuse.jobs"):
        store = JobStore(tmp_path / "d")
    try:
        lines = [r for r in caplog.records if r.name == "ditfuse.jobs"]
        assert len(lines) == 1 and "from schema version 1 to 2" in lines[0].getMessage(), lines
        assert store.count() == 3
        for old in (done, failed, queued):
            row = store.get(old["id"])
            assert {k: row[k] for k in old} == old  # every version-1 column as it was
            assert row["close_sites"] is None
        api = _fake_video_jobs(store).to_api(store.get(done["id"]))
        assert api["status"] == "completed" and api["quality"] == "high" and api["quality_applied"] is None
        # the migrated file works as a new one does: new rows record what ran, the cursor goes on
        store.insert(_row(4, params=params))
        assert store.update("video_004", status="completed", close_sites=0)
        assert [r["id"] for r in store.list(limit=10)[0]] == ["video_004", "video_003", "video_002", "video_001"]
    finally:
        store.close()
    assert _read(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [("2",)]
    migrated = _read(path, "SELECT * FROM videos ORDER BY seq")
    assert [r[:-1] for r in migrated[:3]] == before and [r[-1] for r in migrated] == [None, None, None, 0]
    # the same layout as a file this version creates (so a migrated file and a new one never differ)
    fresh = JobStore(tmp_path / "new")
    fresh.close()
    layout = "SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info('videos')"
    assert _read(path, layout) == _read(fresh.db_path, layout)
    assert _read(path, "SELECT name FROM sqlite_master ORDER BY name") == _read(fresh.db_path, "SELECT name FROM sqlite_master ORDER BY name")
    # opened again: already version 2, nothing to migrate, nothing logged
    caplog.clear()
    with caplog.at_level("INFO", logger="ditfuse.jobs"):
        JobStore(tmp_path / "d").close()
    assert not [r for r in caplog.records if r.name == "ditfuse.jobs"]


def test_store_refuses_a_newer_schema_and_leaves_it_alone(tmp_path):
    path = _v1_file(tmp_path, [_row(1)], version="3")
    with pytest.raises(RuntimeError, match=r"schema version 3, newer than this ditfuse's 2.*upgrade ditfuse"):
        JobStore(tmp_path)
    assert _read(path, "SELECT value FROM meta WHERE key = 'schema_version'") == [("3",)]
    assert "close_sites" not in {r[0] for r in _read(path, "SELECT name FROM pragma_table_info('videos')")}
    assert _read(path, "SELECT id FROM videos") == [("video_001",)]
    with pytest.raises(RuntimeError, match="newer"):  # the data dir lock was released: the same error again
        JobStore(tmp_path)


def test_job_quality_applied_from_the_rows_close_sites():
    """The videos API's ``quality_applied``: the images API's rule for one batch, null when unknown."""
    from ditfuse.runtime.server import quality_applied
    from ditfuse.runtime.params import applied_quality as job_quality_applied  # what VideoJobs.to_api reports

    assert [job_quality_applied(n) for n in (None, 0, 1, 7)] == [None, "lossless", "high", "high"]
    for n in (0, 1, 7):
        assert job_quality_applied(n) == quality_applied([SimpleNamespace(close_sites=n)])


def test_one_server_per_data_dir(tmp_path):
    first = JobStore(tmp_path)
    try:
        with pytest.raises(DataDirLocked, match="in use by another ditfuse server"):
            JobStore(tmp_path)
    finally:
        first.close()
    JobStore(tmp_path).close()  # released


# ---------------------------------------------------------------------------------------------
# Video files


def _clip(n=9, h=48, w=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def test_mp4_decodes_back_to_its_frames_and_tags(tmp_path):
    clip = _clip()
    clip[:, :24] = 30  # a flat region H.264 keeps nearly exactly
    path = tmp_path / "a" / "clip.mp4"
    size = video_io.write_video(path, clip, 16, metadata={"prompt": "a cat", "seed": "3"})
    assert size == path.stat().st_size > 0
    info = video_io.probe_video(path)
    assert (info.frames, info.width, info.height, info.fps, info.codec) == (9, 64, 48, 16.0, "h264")
    assert info.metadata["comment"] == "prompt=a cat; seed=3"
    back = video_io.decode_frames(path)
    assert back.shape == clip.shape
    assert np.abs(back[:, :8].astype(int) - 30).max() <= 3  # rows of flat macroblocks
    assert [p.name for p in path.parent.iterdir()] == ["clip.mp4"]  # no temp file left


@pytest.mark.parametrize("fmt", ["webp", "gif"])
def test_animated_formats(tmp_path, fmt):
    path = tmp_path / f"clip.{fmt}"
    video_io.write_video(path, _clip(5), 16)
    info = video_io.probe_video(path)
    assert (info.frames, info.width, info.height) == (5, 64, 48)


def test_float_frames_round_like_diffusers():
    f = np.array([[[[0.0, 0.5, 1.0]]], [[[0.2, 1.2, -0.1]]]], dtype=np.float32)
    assert video_io.frames_to_uint8(f).reshape(-1).tolist() == [0, 128, 255, 51, 255, 0]


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="even"):
        video_io.write_video(tmp_path / "odd.mp4", _clip(3, 47, 64), 16)
    with pytest.raises(ValueError, match=r"\.mp4, \.webp or \.gif"):
        video_io.video_format(tmp_path / "x.avi")

    def boom(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        video_io.atomic_write(tmp_path / "x.mp4", boom)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Engine: video batches


def V(prompt="v", frames=9, **kw):
    kw.setdefault("size", "64x48")
    kw.setdefault("num_inference_steps", 3)
    kw.setdefault("seed", 0)
    return SamplingParams.create(prompt, **kw).with_(num_frames=frames)


def I(prompt="i", **kw):
    kw.setdefault("size", "64x64")
    kw.setdefault("num_inference_steps", 1)
    kw.setdefault("seed", 0)
    return SamplingParams.create(prompt, **kw)


class StepRunner:
    """Stands in for run_batch: records calls; video calls step through on_step, optionally
    holding before each step until ``gate`` is set."""

    def __init__(self):
        self.calls = []  # (kind, [prompts], pad_to)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.stopped = []  # prompts of calls stopped by on_step raising
        self.step_sleep = 0.0

    def __call__(self, loaded, slots, pad_to=None, on_step=None):
        p0 = slots[0][0]
        kind = "video" if p0.num_frames is not None else "image"
        prompts = [p.prompt for p, _ in slots]
        self.calls.append((kind, prompts, pad_to))
        if kind == "video":
            assert on_step is not None
            for i in range(p0.num_inference_steps):
                self.in_step.set()
                assert self.gate.wait(10)
                time.sleep(self.step_sleep)
                try:
                    on_step(i, p0.num_inference_steps)
                except Exception:
                    self.stopped.append(prompts)
                    raise
            return [np.full((p.num_frames, p.height, p.width, 3), 7, np.uint8) for p, _ in slots]
        return [("img", p.prompt) for p, _ in slots]

    def kinds(self):
        return [k for k, _, _ in self.calls]


LOADED = SimpleNamespace(name="fake", pipe=SimpleNamespace(components={}), device="cpu", default_size=(64, 48), size_multiple=16, is_video=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def engine(runner, **kw):
    kw.setdefault("batch_wait_ms", 50)
    return Engine(LOADED, None, runner=runner, **kw)


def test_videos_of_one_shape_and_quality_batch_together_up_to_the_video_cap():
    runner = StepRunner()

    async def main():
        eng = engine(runner, max_batch_size=4, max_video_batch_size=2)
        await eng.start()
        reqs = [V("a0"), V("a1"), V("a2"), V("b0", frames=13), V("c0", quality="high"), V("d0", guidance_scale=1.0)]
        res = await asyncio.gather(*[eng.submit(r) for r in reqs])
        await eng.shutdown()
        return eng, res

    eng, res = run(main())
    groups = sorted(tuple(p) for _, p, _ in runner.calls)
    # same signature (frames, size, steps, guidance -> CFG or not, quality): at most 2 per call
    assert groups == [("a0", "a1"), ("a2",), ("b0",), ("c0",), ("d0",)]
    assert all(pad == 2 for _, _, pad in runner.calls)  # padded to the video cap, not the image cap
    assert [r[0].image.shape for r in res] == [(9, 48, 64, 3)] * 3 + [(13, 48, 64, 3), (9, 48, 64, 3), (9, 48, 64, 3)]
    assert eng.metrics.videos == 6 and eng.metrics.images == 0
    assert b"ditfuse_videos_total 6.0" in eng.prometheus()


def test_progress_is_reported_per_step_on_the_loop():
    runner = StepRunner()
    seen = []

    async def main():
        eng = engine(runner, max_video_batch_size=1)
        await eng.start()
        loop = asyncio.get_running_loop()

        def on_progress(done, total):
            assert asyncio.get_running_loop() is loop  # called on the event loop, not the worker
            seen.append((done, total))

        req = eng.enqueue(V("p", num_inference_steps=4), on_progress=on_progress)
        out = await eng.wait(req)
        await eng.shutdown()
        return out

    out = run(main())
    assert out[0].image.shape == (9, 48, 64, 3)
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]


def test_images_never_wait_behind_more_than_one_video_batch_and_videos_are_not_starved():
    """Policy: waiting images go first, but after `image_batches_per_video` image batches with a
    video waiting, a video batch runs. A running batch is never preempted."""
    runner = StepRunner()
    runner.gate.clear()

    async def main():
        eng = engine(runner, max_batch_size=1, max_video_batch_size=1, batch_wait_ms=0, image_batches_per_video=2)
        await eng.start()
        first = asyncio.create_task(eng.submit(V("v0", num_inference_steps=1)))
        while not runner.in_step.is_set():
            await asyncio.sleep(0.01)
        # while v0 runs: 3 more videos, then 6 images arrive
        tasks = [asyncio.create_task(eng.submit(V(f"v{i}", num_inference_steps=1))) for i in (1, 2, 3)]
        await asyncio.sleep(0.02)
        tasks += [asyncio.create_task(eng.submit(I(f"i{i}"))) for i in range(6)]
        await asyncio.sleep(0.05)
        runner.gate.set()
        await asyncio.gather(first, *tasks)
        await eng.shutdown()

    run(main())
    order = [p[0] for _, p, _ in runner.calls]
    assert order == ["v0", "i0", "i1", "v1", "i2", "i3", "v2", "i4", "i5", "v3"], order
    # while images waited (all of them did, from the start), no two video batches ran in a row
    kinds = runner.kinds()
    last_image = max(i for i, k in enumerate(kinds) if k == "image")
    assert all(not (a == b == "video") for a, b in zip(kinds[:last_image], kinds[1:last_image]))


def test_video_jobs_run_first_when_the_ratio_is_zero_and_alone_when_no_images_wait():
    runner = StepRunner()
    runner.gate.clear()

    async def main():
        eng = engine(runner, max_batch_size=1, batch_wait_ms=0, image_batches_per_video=0)
        await eng.start()
        first = asyncio.create_task(eng.submit(I("i0")))
        await asyncio.sleep(0.05)
        runner.gate.set()
        await first
        runner.gate.clear()
        blocker = asyncio.create_task(eng.submit(V("v0", num_inference_steps=1)))
        while not runner.in_step.is_set():
            await asyncio.sleep(0.01)
        rest = [asyncio.create_task(eng.submit(I("i1"))), asyncio.create_task(eng.submit(V("v1", num_inference_steps=1)))]
        await asyncio.sleep(0.05)
        runner.gate.set()
        await asyncio.gather(blocker, *rest)
        await eng.shutdown()

    run(main())
    assert [p[0] for _, p, _ in runner.calls] == ["i0", "v0", "v1", "i1"]


def test_cancel_a_queued_video_it_never_runs():
    runner = StepRunner()
    runner.gate.clear()

    async def main():
        eng = engine(runner, max_video_batch_size=1, batch_wait_ms=0)
        await eng.start()
        running = eng.enqueue(V("running", num_inference_steps=1))
        while not runner.in_step.is_set():
            await asyncio.sleep(0.01)
        queued = eng.enqueue(V("queued"))
        assert eng.is_waiting(queued) and not eng.is_waiting(running)
        assert eng.cancel(queued)
        assert not eng.cancel(queued)  # already cancelled
        with pytest.raises(RequestCancelled):
            await eng.wait(queued)
        runner.gate.set()
        await eng.wait(running)
        await eng.shutdown()
        return eng

    eng = run(main())
    assert [p for _, p, _ in runner.calls] == [["running"]]
    assert eng.metrics.value("ditfuse_queue_dropped_total", reason="cancelled") == 1 and eng.queue_depth == 0


def test_cancel_a_running_video_stops_its_batch_at_the_next_step():
    runner = StepRunner()
    runner.gate.clear()

    async def main():
        eng = engine(runner, max_video_batch_size=1, batch_wait_ms=0)
        await eng.start()
        req = eng.enqueue(V("long", num_inference_steps=50))
        while not runner.in_step.is_set():
            await asyncio.sleep(0.01)
        eng.cancel(req)
        runner.gate.set()
        with pytest.raises(RequestCancelled):
            await eng.wait(req)
        after = await eng.submit(V("after", num_inference_steps=1))
        await eng.shutdown()
        return eng, after

    eng, after = run(main())
    assert runner.stopped == [["long"]]
    assert after[0].image.shape == (9, 48, 64, 3)
    log = list(eng.batch_log)
    assert "stopped while running (cancelled)" in log[0]["error"] and "error" not in log[1]
    assert eng.metrics.value("ditfuse_queue_dropped_total", reason="stopped_abandoned") == 1


def test_cancelling_one_of_two_batch_mates_keeps_the_other():
    runner = StepRunner()
    runner.gate.clear()

    async def main():
        eng = engine(runner, max_video_batch_size=2, batch_wait_ms=100)
        await eng.start()
        a, b = eng.enqueue(V("a", num_inference_steps=5)), eng.enqueue(V("b", num_inference_steps=5))
        while not runner.in_step.is_set():
            await asyncio.sleep(0.01)
        eng.cancel(a)
        runner.gate.set()
        with pytest.raises(RequestCancelled):
            await eng.wait(a)
        out = await eng.wait(b)
        await eng.shutdown()
        return out

    out = run(main())
    assert [p for _, p, _ in runner.calls] == [["a", "b"]] and runner.stopped == []
    assert out[0].params.prompt == "b"


def test_a_video_that_outlives_its_timeout_is_stopped_while_running():
    runner = StepRunner()

    async def main():
        eng = engine(runner, max_video_batch_size=1, batch_wait_ms=0)
        await eng.start()
        runner.step_sleep = 0.02  # 100 steps: 2 s, well past the timeout
        req = eng.enqueue(V("slow", num_inference_steps=100), timeout_s=0.3)
        with pytest.raises(RequestTimeout):
            await eng.wait(req)
        while eng.in_flight:
            await asyncio.sleep(0.01)
        await eng.shutdown()
        return eng

    eng = run(main())
    assert runner.stopped == [["slow"]]
    assert "stopped while running (timeout)" in list(eng.batch_log)[0]["error"]
