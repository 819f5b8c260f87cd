"""The videos API, live on loopback with the tiny-wan preset, driven by the official ``openai``
client; ``ditfuse generate`` for video; a server killed and restarted on the same data dir."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from PIL import Image

from ditfuse.runtime import video_io
from tests.support.serve_process import wait_healthy

# client.videos.* are marked deprecated (the hosted Sora API's shutdown date); they work unchanged.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEY = "sk-ditfuse-video-test"
EXE = str(Path(sys.executable).with_name("ditfuse"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "ditfuse-cache"
    old = os.environ.get("DITFUSE_CACHE")
    os.environ["DITFUSE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DITFUSE_CACHE", None)
    else:
        os.environ["DITFUSE_CACHE"] = old


@pytest.fixture(scope="module")
def one_thread():
    """See test_server.py: the tiny model gains nothing from intra-op threads on a busy 2-core box."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def vs(tiny_cache, one_thread, tmp_path_factory):
    from ditfuse.runtime.server import build_engine, create_app
    from ditfuse.runtime.videos import VideoJobs

    engine, _ = build_engine(
        "tiny-wan", accelerate=True, max_batch_size=4, max_video_batch_size=2, batch_wait_ms=100,
        max_queue=256, image_batches_per_video=2,
    )
    data_dir = tmp_path_factory.mktemp("video-data")
    jobs = VideoJobs(engine, data_dir, sweep_interval_s=0)
    app = create_app(engine, api_key=KEY, max_body_bytes=64 * 1024, videos=jobs)
    with serving(app) as url:
        yield SimpleNamespace(url=url, engine=engine, jobs=jobs, data_dir=data_dir)


@contextmanager
def serving(app):
    """``app`` under uvicorn on a free loopback port in a thread: yields its base URL, stops it
    on exit."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(60)
    assert not thread.is_alive()


def client(vs, **kw) -> openai.OpenAI:
    kw.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=vs.url + "/v1", api_key=kw.pop("api_key", KEY), timeout=120, **kw)


def aclient(vs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=vs.url + "/v1", api_key=KEY, timeout=300, max_retries=0)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def extra(frames=5, steps=1, seed=0, **kw):
    return {"num_frames": frames, "steps": steps, "seed": seed, **kw}


def batches(vs) -> list[dict]:
    return list(vs.engine.batch_log)


def wait_idle(vs, timeout=60) -> None:
    """Until nothing runs or waits and the batch log has been still for 0.2 s: a job failed by its
    timeout, say, leaves its batch running until the next step notices (and then logs it)."""
    deadline = time.monotonic() + timeout
    n, still_since = -1, time.monotonic()
    while True:
        busy = vs.engine.in_flight or vs.engine.queue_depth
        if busy or len(vs.engine.batch_log) != n:
            n, still_since = len(vs.engine.batch_log), time.monotonic()
        elif time.monotonic() - still_since >= 0.2:
            return
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


def wait_status(c, video_id, statuses, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        v = c.videos.retrieve(video_id)
        if v.status in statuses:
            return v
        assert time.monotonic() < deadline, f"{video_id} still {v.status}"
        time.sleep(0.02)


def test_create_poll_download_list_delete(vs):
    c = client(vs)
    v = c.videos.create_and_poll(
        model="tiny-wan", prompt="a lighthouse", size="64x48", seconds="1", poll_interval_ms=50,
        extra_body={"steps": 2, "seed": 5, "quality": "lossless"},
    )
    assert (v.object, v.status, v.progress, v.size, v.seconds, v.model) == ("video", "completed", 100, "64x48", "1", "tiny-wan")
    assert v.error is None and v.completed_at >= v.created_at and v.expires_at > v.completed_at
    assert v.model_extra["num_frames"] == 17 and v.model_extra["quality"] == "lossless" and v.model_extra["seed"] == 5
    mp4 = c.videos.download_content(v.id).read()
    info = video_io.probe_video(mp4)  # decoded back: every frame
    assert (info.frames, info.width, info.height, info.fps, info.codec) == (17, 64, 48, 16.0, "h264")
    assert "prompt=a lighthouse" in info.metadata["comment"] and "seed=5" in info.metadata["comment"]
    assert mp4 == (vs.data_dir / "files" / f"{v.id}.mp4").read_bytes()
    thumb = Image.open(io.BytesIO(c.videos.download_content(v.id, variant="thumbnail").read()))
    assert thumb.format == "WEBP" and thumb.size == (64, 48)
    assert c.videos.retrieve(v.id).status == "completed"

    more = [c.videos.create(prompt=f"p{i}", size="32x32", extra_body=extra(seed=i)) for i in range(3)]
    assert all(m.status == "queued" and m.progress == 0 for m in more)
    for m in more:
        wait_status(c, m.id, ("completed",))
    page = c.videos.list(limit=2)
    assert [x.id for x in page.data] == [more[2].id, more[1].id] and page.has_more
    everything = [x.id for x in c.videos.list(limit=2)]  # the client follows the `after` cursor
    assert everything[:4] == [more[2].id, more[1].id, more[0].id, v.id]
    assert [x.id for x in c.videos.list(order="asc", limit=100)][-4:] == [v.id, more[0].id, more[1].id, more[2].id]

    gone = c.videos.delete(v.id)
    assert (gone.id, gone.deleted, gone.object) == (v.id, True, "video.deleted")
    for call in (lambda: c.videos.retrieve(v.id), lambda: c.videos.download_content(v.id), lambda: c.videos.delete(v.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "video_not_found"
    assert not list((vs.data_dir / "files").glob(f"{v.id}*"))


def _new_batches(vs, before):
    return [b for b in batches(vs)[before:] if b["signature"][8] is not None]  # video batches (num_frames)


def test_quality_applied_says_what_ran_lossless_and_high(vs):
    """``quality_applied`` beside ``quality``: null until the job completes, then "high" only when
    its batch ran close kernels. tiny-wan loads in fp32 on CPU, where no close kernel mounts (the
    batch log says so), so a high job runs nothing close here and must say "lossless", as the images
    API does."""
    c = client(vs)
    for quality in ("lossless", "high"):
        wait_idle(vs)
        before = len(batches(vs))
        v = c.videos.create(prompt=f"what ran {quality}", size="32x32", extra_body=extra(quality=quality))
        assert v.status == "queued" and v.model_extra["quality"] == quality
        assert "quality_applied" in v.model_extra and v.model_extra["quality_applied"] is None
        done = wait_status(c, v.id, ("completed", "failed"))
        assert done.status == "completed", done
        ran = _new_batches(vs, before)
        assert [b["quality"] for b in ran] == [quality] and ran[0]["mounted"] == [], ran  # nothing close mounted
        assert (done.model_extra["quality"], done.model_extra["quality_applied"]) == (quality, "lossless")
        listed = {x.id: x for x in c.videos.list(limit=100)}
        assert listed[v.id].model_extra["quality_applied"] == "lossless"
        assert vs.jobs.store.get(v.id)["close_sites"] == 0


def test_quality_applied_is_high_when_the_batch_ran_close_kernels(vs, monkeypatch):
    """The same path with close kernels reported as running in high batches (the engine's
    ``mounted_sites`` stood in for, as on a GPU where the high tier mounts): the count travels from
    the batch to the job row and the job object says "high"; a lossless job beside it says "lossless"."""
    from ditfuse.contracts.quality import Quality
    from ditfuse.runtime import engine as engine_mod

    sites = ["transformer/blocks.0.ffn:linear_gelu_tanh", "transformer/blocks.1.ffn:linear_gelu_tanh"]
    monkeypatch.setattr(engine_mod, "mounted_sites",
                        lambda pipe: list(sites) if vs.engine.handle.quality is Quality.HIGH else [])
    c = client(vs)
    wait_idle(vs)
    before = len(batches(vs))
    jobs = {q: c.videos.create(prompt=f"close {q}", size="32x32", extra_body=extra(quality=q)) for q in ("high", "lossless")}
    done = {q: wait_status(c, v.id, ("completed", "failed")) for q, v in jobs.items()}
    assert {b["quality"]: len(b["mounted"]) for b in _new_batches(vs, before)} == {"high": 2, "lossless": 0}
    assert done["high"].status == "completed" and done["high"].model_extra["quality_applied"] == "high"
    assert vs.jobs.store.get(jobs["high"].id)["close_sites"] == 2
    assert done["lossless"].status == "completed" and done["lossless"].model_extra["quality_applied"] == "lossless"


def test_progress_goes_queued_in_progress_completed(vs):
    c = client(vs)
    v = c.videos.create(prompt="slow", size="64x48", extra_body=extra(frames=9, steps=150))
    seen = []
    deadline = time.monotonic() + 120
    while True:
        r = httpx.get(f"{vs.url}/v1/videos/{v.id}", headers=auth())
        assert r.headers["openai-poll-after-ms"] == "500"
        body = r.json()
        seen.append((body["status"], body["progress"]))
        if body["status"] == "completed":
            break
        assert time.monotonic() < deadline
        time.sleep(0.01)
    statuses = [s for s, _ in seen]
    assert statuses[-1] == "completed" and "in_progress" in statuses
    assert statuses == sorted(statuses, key=["queued", "in_progress", "completed"].index)
    progress = [p for _, p in seen]
    assert progress == sorted(progress) and progress[-1] == 100
    assert any(0 < p < 100 for s, p in seen if s == "in_progress")


@pytest.mark.parametrize(
    "kw,param,needle",
    [
        (dict(size="65x48"), "size", "multiples of 16"),
        (dict(size="big"), "size", "WIDTHxHEIGHT"),
        (dict(seconds="20"), "seconds", "between 0.25 and 15"),
        (dict(seconds="soon"), "seconds", "number"),
        (dict(extra_body={"num_frames": 10}), "num_frames", "4k+1"),
        (dict(extra_body={"num_frames": 301}), "num_frames", "between 1 and 241"),
        (dict(seconds="4", extra_body={"num_frames": 17}), "num_frames", "does not match"),
        (dict(extra_body={"quality": "ultra"}), "quality", "lossless, high"),
        (dict(prompt="x" * 4001), "prompt", "longer than 4000"),
        (dict(prompt=""), "prompt", "non-empty"),
        (dict(extra_body={"steps": 0}), "steps", "between 1 and 200"),
        (dict(extra_body={"steps": "many"}), "steps", "integer"),
        (dict(extra_body={"steps": 2, "num_inference_steps": 2}), "steps", "not both"),
        (dict(extra_body={"guidance_scale": "lots"}), "guidance_scale", "number"),
        (dict(extra_body={"fps": 24}), "fps", "unknown field 'fps'"),
        (dict(input_reference=("ref.png", b"\x89PNG", "image/png")), "input_reference", "takes no input image"),
    ],
)
def test_bad_requests_get_400_with_openai_error_body(vs, kw, param, needle):
    kw.setdefault("prompt", "a cat")
    before = vs.jobs.store.count()
    with pytest.raises(openai.BadRequestError) as e:
        client(vs).videos.create(**kw)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and needle in body["message"], body
    assert vs.jobs.store.count() == before  # nothing stored


def test_other_errors(vs):
    c = client(vs)
    with pytest.raises(openai.NotFoundError) as e:
        c.videos.create(model="sora-2", prompt="x")
    assert e.value.body["code"] == "model_not_found" and "tiny-wan" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.videos.retrieve("video_doesnotexist")
    with pytest.raises(openai.AuthenticationError):
        client(vs, api_key="wrong").videos.list()
    # JSON bodies work too; other content types are 415; form values are checked the same way
    r = httpx.post(f"{vs.url}/v1/videos", json={"prompt": "json", "size": "32x32", **extra(seed=1)}, headers=auth())
    assert r.status_code == 200 and r.json()["status"] == "queued"
    wait_status(c, r.json()["id"], ("completed",))
    r = httpx.post(f"{vs.url}/v1/videos", content=b"prompt=x", headers={**auth(), "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(f"{vs.url}/v1/videos", data={"prompt": "x", "seed": "-3"}, headers=auth())
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = httpx.post(f"{vs.url}/v1/videos", files={"prompt": ("p.txt", b"a cat")}, headers=auth())
    assert r.status_code == 400 and "text field, not a file" in r.json()["error"]["message"]
    r = httpx.post(f"{vs.url}/v1/videos", content=b"{bad", headers={**auth(), "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for q, param in [({"limit": "0"}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"), ({"after": "video_nope"}, "after")]:
        r = httpx.get(f"{vs.url}/v1/videos", params=q, headers=auth())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, q


def _long_job(c, prompt, steps=200, size="64x48", frames=9):
    return c.videos.create(prompt=prompt, size=size, extra_body=extra(frames=frames, steps=steps))


def test_queue_full_429_content_before_completion_409_and_delete_cancels(vs):
    c = client(vs)
    eng = vs.engine
    old = eng.max_queue
    a = _long_job(c, "running")
    wait_status(c, a.id, ("in_progress",))
    eng.max_queue = 2
    try:
        b, d = _long_job(c, "queued b"), _long_job(c, "queued d")
        stored = vs.jobs.store.count()
        with pytest.raises(openai.RateLimitError) as e:
            _long_job(c, "rejected")
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert vs.jobs.store.count() == stored  # the rejected job left no row
        with pytest.raises(openai.ConflictError) as e:
            c.videos.download_content(b.id)
        assert e.value.body["code"] == "video_not_ready" and "queued" in e.value.body["message"]
    finally:
        eng.max_queue = old
    n_batches = len(batches(vs))
    t0 = time.monotonic()
    for job in (b, d, a):  # queued ones first: they must never run; then the running one
        assert c.videos.delete(job.id).deleted
    deadline = time.monotonic() + 30
    while eng.in_flight or eng.queue_depth:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert time.monotonic() - t0 < 10  # a stopped 200-step job, not a finished one
    log = batches(vs)
    stopped = [x for x in log if "stopped while running (cancelled)" in x.get("error", "")]
    assert stopped, log[-3:]
    assert len(log) == n_batches or all("error" in x for x in log[n_batches:])  # b and d never ran
    assert not any(vs.jobs.store.get(j.id) for j in (a, b, d))


def test_per_job_timeout_fails_the_job(vs):
    c = client(vs)
    old = vs.jobs.job_timeout_s
    vs.jobs.job_timeout_s = 0.5
    try:
        v = _long_job(c, "too slow", steps=200)
    finally:
        vs.jobs.job_timeout_s = old
    v = wait_status(c, v.id, ("completed", "failed"))
    assert v.status == "failed" and v.error.code == "timeout" and "0.5 s" in v.error.message
    assert v.model_extra["quality_applied"] is None  # nothing was produced
    with pytest.raises(openai.ConflictError):
        c.videos.download_content(v.id)


def _decode_png(item) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(item.b64_json)))


async def _video(ac, prompt, size, frames, quality, seed):
    v = await ac.videos.create_and_poll(prompt=prompt, size=size, poll_interval_ms=50,
                                        extra_body=extra(frames=frames, seed=seed, quality=quality))
    data = (await ac.videos.download_content(v.id)).read() if v.status == "completed" else b""
    return v, data


async def _image(ac, prompt, size, quality, seed):
    return await ac.images.generate(model="tiny-wan", prompt=prompt, size=size, quality=quality,
                                    extra_body={"seed": seed, "num_inference_steps": 1})


def test_mixed_image_and_video_traffic_with_mixed_quality(vs):
    wait_idle(vs)  # a batch an earlier test left running must not land in this test's count
    before = len(batches(vs))
    videos = [(f"v{i}", "32x32" if i % 2 else "48x32", 5, ["lossless", "high"][i // 2 % 2], i) for i in range(8)]
    images = [(f"i{i}", "32x32", ["lossless", "high", "hd", "low"][i % 4], i) for i in range(8)]

    async def burst():
        async with aclient(vs) as ac:
            return await asyncio.gather(*[_video(ac, *v) for v in videos], *[_image(ac, *i) for i in images])

    res = asyncio.run(burst())
    for (prompt, size, frames, quality, _), (v, data) in zip(videos, res[: len(videos)]):
        assert v.status == "completed" and v.model_extra["quality"] == quality, v
        info = video_io.probe_video(data)
        assert (info.frames, f"{info.width}x{info.height}") == (frames, size)
        assert f"prompt={prompt};" in info.metadata["comment"]
    for (prompt, size, quality, _), r in zip(images, res[len(videos):]):
        img = _decode_png(r.data[0])
        assert img.size == (32, 32) and img.text["prompt"] == prompt
        assert img.text["quality"] == {"hd": "high", "low": "lossless"}.get(quality, quality)
    new = batches(vs)[before:]
    assert sum(b["size"] for b in new) == len(videos) + len(images)
    for b in new:
        sig = b["signature"]  # (model, w, h, steps, guidance, quality, true-cfg, cfg scale, num_frames)
        assert b["handle_quality"] == b["quality"] == sig[5], b
    video_batches = [b for b in new if b["signature"][8] is not None]
    assert sum(b["size"] for b in video_batches) == len(videos)
    assert max(b["size"] for b in video_batches) == 2  # same shape + quality batched (CFG on: guidance 5)
    assert {b["quality"] for b in video_batches} == {"lossless", "high"}


def test_soak_120_mixed_requests_none_lost(vs):
    m0 = vs.engine.metrics
    images0, videos0 = m0.images, m0.videos
    n_img, n_vid = 80, 40
    t0 = time.monotonic()

    async def soak():
        async with aclient(vs) as ac:
            return await asyncio.gather(
                *[_image(ac, f"s{i}", ["32x32", "48x32"][i % 2], ["lossless", "high", "auto"][i % 3], i) for i in range(n_img)],
                *[_video(ac, f"sv{i}", "32x32", [5, 9][i % 2], ["lossless", "high"][i % 2], i) for i in range(n_vid)],
                return_exceptions=True,
            )

    res = asyncio.run(soak())
    errors = [r for r in res if isinstance(r, Exception)]
    assert not errors, errors[:3]
    for i, r in enumerate(res[:n_img]):
        assert _decode_png(r.data[0]).text["prompt"] == f"s{i}"
    for i, (v, data) in enumerate(res[n_img:]):
        assert v.status == "completed", v
        assert video_io.probe_video(data).frames == [5, 9][i % 2]
    assert vs.engine.metrics.images - images0 == n_img
    assert vs.engine.metrics.videos - videos0 == n_vid
    assert vs.engine.queue_depth == 0 and vs.engine.in_flight == 0
    print(f"soak: {n_img} images + {n_vid} videos in {time.monotonic() - t0:.1f} s")


def test_retention_deletes_old_files_with_their_rows(vs):
    c = client(vs)
    old = vs.jobs.max_stored
    vs.jobs.max_stored = 3
    try:
        made = [c.videos.create_and_poll(prompt=f"keep {i}", size="32x32", poll_interval_ms=20, extra_body=extra(seed=i)) for i in range(4)]
    finally:
        vs.jobs.max_stored = old
    ids = [x.id for x in c.videos.list(limit=100)]
    finished = [i for i in ids if vs.jobs.store.get(i)["status"] in ("completed", "failed")]
    assert finished == [made[3].id, made[2].id, made[1].id]
    files = {p.name for p in (vs.data_dir / "files").iterdir()}
    assert files == {f"{i}{s}" for i in finished if vs.jobs.store.get(i)["status"] == "completed" for s in (".mp4", ".webp")}


def test_an_image_model_server_refuses_videos_clearly():
    from starlette.testclient import TestClient

    from ditfuse.runtime.server import create_app

    from ditfuse.runtime.metrics import EngineMetrics
    from ditfuse.runtime.pipelines import spec_for

    loaded = SimpleNamespace(is_video=False, spec=spec_for("FluxPipeline"))
    engine = SimpleNamespace(model_name="tiny-flux", loaded=loaded, metrics=EngineMetrics())
    tc = TestClient(create_app(engine))  # no lifespan: no engine needed for this route
    for method, path in [("POST", "/v1/videos"), ("GET", "/v1/videos"), ("GET", "/v1/videos/video_x/content")]:
        r = tc.request(method, path, data={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 400, path
        assert r.json()["error"]["code"] == "model_not_video" and "tiny-wan, tiny-wan-i2v" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------
# A server process killed and restarted on the same data dir.


def _env(cache):
    # one intra-op thread, as in the in-process fixture: predictable job times on a busy CI box
    env = {**os.environ, "DITFUSE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    return env


def _start(port, data_dir, cache):
    env = _env(cache)
    cmd = [EXE, "serve", "--model", "tiny-wan", "--port", str(port), "--data-dir", str(data_dir),
           "--max-video-batch-size", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120)
    return proc, url


def test_restart_after_a_crash_keeps_finished_jobs_fails_running_requeues_queued(tiny_cache, tmp_path):
    data_dir = tmp_path / "data"
    port = free_port()
    proc, url = _start(port, data_dir, tiny_cache)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = c.videos.create_and_poll(prompt="finished", size="32x32", poll_interval_ms=50, extra_body=extra(seed=1))
        assert done.status == "completed"
        content = c.videos.download_content(done.id).read()
        # a second server on the same data dir is refused (before it binds a port)
        r = subprocess.run([EXE, "serve", "--model", "tiny-wan", "--port", str(free_port()), "--data-dir", str(data_dir)],
                           env=_env(tiny_cache), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "in use by another ditfuse server" in r.stderr
        running = _long_job(c, "running", size="256x256", frames=17)  # a few seconds
        queued = c.videos.create(prompt="queued", size="32x32", extra_body=extra(seed=2))
        wait_status(c, running.id, ("in_progress",))
        assert c.videos.retrieve(queued.id).status == "queued"
        os.kill(proc.pid, signal.SIGKILL)  # the crash
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # what a crash mid-write leaves: a temporary file, and a file whose row never said completed
    (data_dir / "files" / ".tmp-0123456789ab-video_half.mp4").write_bytes(b"half an mp4")
    (data_dir / "files" / "video_orphan.mp4").write_bytes(b"no row")

    proc, url = _start(port, data_dir, tiny_cache)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        listed = {v.id: v for v in c.videos.list(limit=100)}
        assert set(listed) == {done.id, running.id, queued.id}
        assert listed[done.id].status == "completed"
        assert listed[done.id].model_extra["quality_applied"] == "lossless"  # stored with the row
        assert c.videos.download_content(done.id).read() == content
        failed = listed[running.id]
        assert failed.status == "failed" and failed.error.code == "server_restarted"
        assert failed.model_extra["quality_applied"] is None
        assert "create it again" in failed.error.message
        requeued = wait_status(c, queued.id, ("completed", "failed"))
        assert requeued.status == "completed"
        assert video_io.probe_video(c.videos.download_content(queued.id).read()).frames == 5
        names = {p.name for p in (data_dir / "files").iterdir()}
        assert names == {f"{i}{s}" for i in (done.id, queued.id) for s in (".mp4", ".webp")}
        # graceful stop: the running job finishes, the queued one stays queued for the next start
        slow = _long_job(c, "finishing", size="256x256", frames=17)
        waiting = c.videos.create(prompt="waiting", size="32x32", extra_body=extra(seed=3))
        wait_status(c, slow.id, ("in_progress",))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert "noise" in out and f"data dir {data_dir}" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    from ditfuse.runtime.jobs import JobStore

    store = JobStore(data_dir)
    try:
        assert store.get(slow.id)["status"] == "completed"
        assert store.get(waiting.id)["status"] == "queued"
        assert (data_dir / "files" / f"{slow.id}.mp4").is_file()
        assert json.loads(store.get(waiting.id)["params"])["num_frames"] == 5
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------
# `ditfuse generate` for video, and the preset


def run_cli(args, cache, timeout=240):
    env = {**os.environ, "DITFUSE_CACHE": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_generate_writes_an_mp4_that_decodes_back(tiny_cache, tmp_path):
    out = tmp_path / "out" / "clip.mp4"
    r = run_cli(["generate", "--model", "tiny-wan", "--prompt", "a red fox", "--frames", "9", "--size", "64x48",
                 "--steps", "3", "--seed", "7", "--quality", "high", "--out", str(out)], tiny_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    info = video_io.probe_video(out)
    assert (info.frames, info.width, info.height, info.fps, info.codec) == (9, 64, 48, 16.0, "h264")
    comment = info.metadata["comment"]
    for item in ("prompt=a red fox", "seed=7", "num_frames=9", "quality=high", "model=tiny-wan", "num_inference_steps=3"):
        assert item in comment
    assert "noise" in r.stdout and "VAE decode" in r.stderr and "4/4" in r.stderr  # 3 steps + the decode
    assert f"wrote {out} (9 frames, 64x48, 16 fps, H.264 MP4" in r.stdout
    assert list(out.parent.iterdir()) == [out]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model", "tiny-wan", "--frames", "10"], "4k+1"),
        (["--model", "tiny-wan", "--seconds", "30"], "between 0.25 and 15"),
        (["--model", "tiny-wan", "--out", "x.png"], ".mp4, .webp or .gif"),
        (["--model", "tiny-wan", "--n", "2", "--out", "x.mp4"], "--n must be 1"),
        (["--model", "tiny-flux", "--frames", "17"], "need a video model"),
    ],
)
def test_generate_video_bad_arguments(tiny_cache, tmp_path, args, needle):
    r = run_cli(["generate", "--prompt", "x", *args], tiny_cache)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_tiny_wan_preset_and_wan_directories(tiny_cache, tmp_path):
    import torch
    from diffusers import WanPipeline

    from ditfuse.runtime import presets

    m = presets.load_model("tiny-wan", device="cpu")
    assert isinstance(m.pipe, WanPipeline) and m.is_video and m.is_preset and "noise" in m.note
    assert (m.fps, m.frame_multiple, m.size_multiple, m.default_frames) == (16, 4, 16, 17)
    assert presets.preset_path("tiny-wan").name == "tiny-wan-v1"
    fresh = presets.build_preset("tiny-wan")  # same seed, same recipe: the cached weights
    for name in ("transformer", "vae", "text_encoder"):
        sa, sb = getattr(m.pipe, name).state_dict(), getattr(fresh, name).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), name
    d = tmp_path / "Wan2.1-T2V-tiny"
    fresh.save_pretrained(d)
    assert presets.pipeline_class(d) == "WanPipeline"
    real = presets.load_model(str(d), device="cpu")
    assert real.is_video and not real.is_preset and real.name == d.name
    assert (real.fps, real.frame_multiple, real.size_multiple, real.default_frames, real.default_steps) == (16, 4, 16, 81, 50)
