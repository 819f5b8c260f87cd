"""The videos API on the second video family: tiny-hunyuanvideo15 (random weights: its videos are
noise) behind `/v1/videos` with the official client. HunyuanVideo 1.5's pipeline takes its
guidance scale from a guider component and has no step callback, and diffusers 0.42.1 decodes a
batch of its videos only with VAE slicing: the runtime's pipeline table covers all three."""

from __future__ import annotations

import pytest

from tests.support import video_runtime as vr

from .test_videos_server import one_thread  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def hv(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    # accelerate=False: under pytest the Triton interpreter would run the kernels (minutes per
    # call at this pipeline's fixed 2000-token text); the runtime path is what is tested here
    with vr.serve_preset("tiny-hunyuanvideo15", tmp_path_factory.mktemp("hv-data"), accelerate=False) as served:
        yield served


def test_two_jobs_share_a_padded_batch_and_decode(hv):
    body = {"num_frames": 9, "steps": 2, "guidance_scale": 4.0, "negative_prompt": "blurry"}
    # every call ran two videos (padded to max_video_batch_size when one job was alone): the
    # batched decode works because the runtime turned on the VAE's slicing at load
    vr.assert_two_jobs_share_a_batch(hv, "64x48", body, frames=9, fps=24, seconds="0.333333", bad_frames=8,
                                     needle="4k+1")
    assert hv.engine.loaded.pipe.vae.use_slicing
    assert hv.engine.loaded.pipe.guider.guidance_scale == 6.0  # the request's 4.0 did not persist


def test_request_defaults_come_from_the_guider(hv):
    loaded = hv.engine.loaded
    assert loaded.spec.name == "HunyuanVideo15Pipeline" and loaded.default_guidance == 6.0
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
