"""LTX-Video image-to-video (diffusers ``LTXImageToVideoPipeline``) in the runtime: the tiny
pipeline (``ltx_configs.build_tiny_i2v_pipeline``: tiny-ltx's parts and weights; its videos are
noise), the ``tiny-ltx-i2v`` preset, the pipeline table's row (one image per prompt:
``image_per_sample``, so requests on different images share a call), the mounted ``ltx`` adapter
bitwise against plain diffusers with the per-token timesteps of the conditioned first frame,
``ditfuse generate --image`` and ``/v1/videos`` with ``input_reference``."""

from __future__ import annotations


import numpy as np
import openai
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import ltx as ltx_adapter
from ditfuse.models import ltx_configs as lc
from ditfuse.runtime import video_io
from ditfuse.runtime.inputs import pixel_sha256, save_png
from ditfuse.runtime.params import SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr
from tests.support.video_runtime import image_bytes as png_bytes
from tests.support.video_runtime import picture

from .test_videos_server import one_thread  # noqa: F401 - fixture

PRESET = "tiny-ltx-i2v"
# 9 frames -> 2 latent frames; 64x96 px -> a 2x3 latent grid: 12 video tokens
SIZE = dict(width=96, height=64, num_frames=9)
PROMPTS = ["a red fox", "a grey cat"]


def _call(pipe, seed: int = 3, images=None, **over) -> torch.Tensor:
    """Two prompts, each on its own image, each with its own generator (seed, seed + 1)."""
    images = [picture(0), picture(1)] if images is None else images
    kw = dict(image=images, prompt=PROMPTS[:len(images)], negative_prompt="blurry", **SIZE,
              generator=[torch.Generator().manual_seed(seed + i) for i in range(len(images))])
    return vr.frames(pipe, seed, **{**kw, **over})


def test_same_parts_as_tiny_ltx():
    from diffusers import LTXImageToVideoPipeline

    i2v, t2v = lc.build_tiny_i2v_pipeline(), lc.build_tiny_pipeline()
    assert type(i2v) is LTXImageToVideoPipeline
    for name in ("transformer", "vae", "text_encoder"):
        sd, sd2 = getattr(i2v, name).state_dict(), getattr(t2v, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"ltx_i2v.{name}.{key} (tiny-ltx's)")
    spec = PIPELINE_SPECS["LTXImageToVideoPipeline"]
    assert spec.takes_image and spec.image_per_sample and spec.fps_kwarg == "frame_rate"
    assert (spec.size_multiple(i2v), spec.frame_multiple(i2v)) == (32, 8)


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call on two prompts with two images
    (their latents condition the first frame: per-token timesteps, 0 on its tokens) is bitwise
    the plain pipeline's, and every op of the ltx adapter reached the gate."""
    pipe = vr.quiet(lc.build_tiny_i2v_pipeline()).to(torch.bfloat16)
    vr.assert_accelerated_bitwise(pipe, _call, ltx_adapter.ADAPTER)


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert p.spec == spec and spec.name == "LTXImageToVideoPipeline" == type(pipe).__name__
    assert p.frame_multiple == spec.frame_multiple(pipe) == 8 and p.size_multiple == spec.size_multiple(pipe) == 32
    assert (loaded.fps, loaded.default_frames, loaded.default_size) == (25, 17, (352, 256)) and "noise" in loaded.note


def test_one_call_takes_each_request_on_its_own_image(loaded, tmp_path):
    """Two requests on different images share one call (equal batch signatures), and each clip
    is plain diffusers' for its prompt, image and seed in a call of the same two."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    images = [picture(0), picture(1)]
    params = []
    for i, img in enumerate(images):
        save_png(img, tmp_path / f"{i}.png")
        params.append(SamplingParams.create(PROMPTS[i], size="96x64", num_inference_steps=2, guidance_scale=3.0,
                                            seed=3 + i, negative_prompt="blurry")
                      .with_(num_frames=9, image=str(tmp_path / f"{i}.png"), image_sha256=pixel_sha256(img)))
    spec = loaded.spec
    assert params[0].signature(PRESET) != params[1].signature(PRESET)
    assert spec.batch_signature(params[0], PRESET) == spec.batch_signature(params[1], PRESET)
    clips = run_batch(loaded, [(p, 0) for p in params])
    with torch.no_grad():
        plain = _call(loaded.pipe, seed=3, images=images, frame_rate=loaded.fps)
    for clip, want in zip(clips, plain):
        np.testing.assert_array_equal(clip, frames_to_uint8(want.numpy()))
    assert not np.array_equal(clips[0], clips[1])


@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_an_ltx_i2v_clip(tiny_cache, tmp_path):
    picture(0, 90, 160).save(tmp_path / "start.png")
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", "a fox", "--image", str(tmp_path / "start.png"), "--frames", "9",
                                "--steps", "2", "--seed", "3"])
    # no --size: the image's 9:16 at 352x256's area, sides in 32s
    assert (info.frames, info.width, info.height, info.fps) == (9, 224, 384, 25.0)
    assert "(LTXImageToVideoPipeline)" in r.stdout and f"pixels sha256 {pixel_sha256(picture(0, 90, 160))}" in r.stdout


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    with vr.serve_preset(PRESET, tmp_path_factory.mktemp("ltx-i2v-data")) as served:
        yield served


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_jobs_on_different_images_share_a_batch(served):
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=vr.KEY, timeout=300, max_retries=0)
    jobs = [c.videos.create(prompt=f"a fox {i}", size="96x64", input_reference=("in.png", png_bytes(picture(i)), "image/png"),
                            extra_body={"num_frames": 9, "steps": 2, "seed": i}) for i in range(2)]
    _, done = vr.completed_clips(c, jobs)
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height, i.fps) == (9, 96, 64, 25.0) for i in infos), infos
    assert done[0] != done[1]
    assert [b["size"] for b in served.engine.batch_log] == [2], served.engine.batch_log
