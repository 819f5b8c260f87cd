"""The videos API on the second video family: tiny-hunyuanvideo15 (random weights: its videos are
noise) behind `/v1/videos` with the official client. HunyuanVideo 1.5's pipeline takes its
guidance scale from a guider component and has no step callback, and diffusers 0.42.1 decodes a
batch of its videos only with VAE slicing: the runtime's pipeline table covers all three."""

from __future__ import annotations

import time
from types import SimpleNamespace

import openai
import pytest

from ditfuse.runtime import video_io

from .test_videos_server import one_thread, serving  # noqa: F401 - fixture

KEY = "k"


@pytest.fixture(scope="module")
def hv(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    from ditfuse.runtime.server import build_engine, create_app
    from ditfuse.runtime.videos import VideoJobs

    # accelerate=False: under pytest the Triton interpreter would run the kernels (minutes per
    # call at this pipeline's fixed 2000-token text); the runtime path is what is tested here
    engine, _ = build_engine("tiny-hunyuanvideo15", accelerate=False, max_batch_size=1, max_video_batch_size=2,
                             batch_wait_ms=300, max_queue=16)
    jobs = VideoJobs(engine, tmp_path_factory.mktemp("hv-data"), sweep_interval_s=0)
    app = create_app(engine, api_key=KEY, max_body_bytes=64 * 1024, videos=jobs)
    with serving(app) as url:
        yield SimpleNamespace(url=url, engine=engine)


def test_two_jobs_share_a_padded_batch_and_decode(hv):
    c = openai.OpenAI(base_url=hv.url + "/v1", api_key=KEY, timeout=300, max_retries=0)
    body = {"num_frames": 9, "steps": 2, "guidance_scale": 4.0, "negative_prompt": "blurry"}
    jobs = [c.videos.create(prompt=f"a fox {i}", size="64x48", extra_body={**body, "seed": i}) for i in range(2)]
    done = []
    for j in jobs:
        deadline = time.monotonic() + 240
        while (v := c.videos.retrieve(j.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, v
            time.sleep(0.2)
        assert v.status == "completed", v.error
        done.append(c.videos.download_content(j.id).read())
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height, i.fps) == (9, 64, 48, 24.0) for i in infos)
    assert done[0] != done[1]  # different seeds
    log = list(hv.engine.batch_log)
    # every call ran two videos (padded to max_video_batch_size when one job was alone): the
    # batched decode works because the runtime turned on the VAE's slicing at load
    assert hv.engine.pad_batches and sum(b["size"] for b in log) == 2, log
    assert hv.engine.loaded.pipe.vae.use_slicing
    assert hv.engine.loaded.pipe.guider.guidance_scale == 6.0  # the request's 4.0 did not persist


def test_request_defaults_come_from_the_guider(hv):
    loaded = hv.engine.loaded
    assert loaded.spec.name == "HunyuanVideo15Pipeline" and loaded.default_guidance == 6.0
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
