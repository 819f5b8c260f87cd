"""LTX-Video (diffusers ``LTXPipeline``) in the runtime: the tiny random-weight pipeline
(``ltx_configs.build_tiny_pipeline``; its videos are noise), the ``tiny-ltx`` preset, the
pipeline table's row (sides in multiples of 32, ``8k + 1`` frames, 25 fps passed as the call's
``frame_rate``), the mounted adapter bitwise against plain diffusers, ``ditfuse generate`` and
``/v1/videos`` through the official client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import ltx as ltx_adapter
from ditfuse.models import ltx_configs as lc
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr

from .test_videos_server import one_thread  # noqa: F401 - fixture

# 9 frames -> 2 latent frames; 64x96 px -> a 2x3 latent grid: 12 video tokens
SIZE = dict(width=96, height=64, num_frames=9)
PROMPT = "a red fox"
NEGATIVE = "blurry"


def _call(pipe, seed: int = 3, **over) -> torch.Tensor:
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, **SIZE, **lc.TINY_CALL_KWARGS)
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def ltx():
    return vr.quiet(lc.build_tiny_pipeline())


def test_builds_offline_deterministic_with_the_real_compression(ltx):
    from diffusers import LTXPipeline

    assert type(ltx) is LTXPipeline
    # what LTXPipeline reads for its latent grid, and the runtime for sizes and frame counts
    assert (ltx.vae_spatial_compression_ratio, ltx.vae_temporal_compression_ratio) == (32, 8)
    assert ltx.transformer.config.in_channels == ltx.vae.config.latent_channels
    assert ltx.text_encoder.config.d_model == ltx.transformer.config.caption_channels
    spec = PIPELINE_SPECS["LTXPipeline"]
    assert (spec.size_multiple(ltx), spec.frame_multiple(ltx)) == (32, 8)
    other = lc.build_tiny_pipeline()
    for name in ("transformer", "vae", "text_encoder"):
        sd, sd2 = getattr(ltx, name).state_dict(), getattr(other, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"ltx.{name}.{key} (second build)")
    params = sum(p.numel() for n in ("transformer", "vae", "text_encoder") for p in getattr(ltx, n).parameters())
    assert params < 300_000, params


def test_two_step_call_makes_frames_of_the_size(ltx):
    frames = _call(ltx)
    assert tuple(frames.shape) == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    # the frame rate reaches the transformer (its RoPE's temporal scale), the negative prompt CFG
    assert not torch.equal(_call(ltx, frame_rate=8), frames), "frame_rate changed nothing"
    assert not torch.equal(_call(ltx, negative_prompt="sharp"), frames), "the negative prompt changed nothing"


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16 (the dtype the kernels are made for), a 2-step CFG call
    is bitwise the plain pipeline's, and every op of the adapter reached the gate."""
    pipe = vr.quiet(lc.build_tiny_pipeline()).to(torch.bfloat16)
    vr.assert_accelerated_bitwise(pipe, _call, ltx_adapter.ADAPTER)


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model("tiny-ltx", device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model

    p, spec, pipe = PRESET_TABLE["tiny-ltx"], loaded.spec, loaded.pipe
    assert is_video_model("tiny-ltx") and p.spec == spec
    assert spec.name == "LTXPipeline" == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    # what the preset states without loading is what the table reads off the loaded pipeline
    assert p.frame_multiple == spec.frame_multiple(pipe) == 8 and p.size_multiple == spec.size_multiple(pipe) == 32
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (25, 8, 17)
    assert (loaded.default_steps, loaded.default_guidance) == (8, 3.0)
    assert spec.fps == 25 and spec.fps_kwarg == "frame_rate"


def test_run_batch_matches_plain_diffusers_and_passes_the_frame_rate(loaded, monkeypatch):
    """The runtime's call of the pipeline is plain diffusers' with the same seed (fps as
    ``frame_rate``); changing the model's fps changes what the pipeline is called with."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.params import SamplingParams
    from ditfuse.runtime.video_io import frames_to_uint8

    params = SamplingParams.create(PROMPT, size="96x64", num_inference_steps=2, guidance_scale=4.0, seed=5,
                                   negative_prompt=NEGATIVE).with_(num_frames=9)
    clip = run_batch(loaded, [(params, 0)])[0]
    assert clip.shape == (9, 64, 96, 3) and clip.dtype == np.uint8

    def plain(frame_rate: int) -> np.ndarray:
        with torch.no_grad():
            out = _call(loaded.pipe, seed=5, guidance_scale=4.0, frame_rate=frame_rate, **loaded.call_kwargs)
        return frames_to_uint8(out[0].numpy())

    np.testing.assert_array_equal(clip, plain(25))
    monkeypatch.setattr(loaded, "fps", 8)
    slow_clip = run_batch(loaded, [(params, 0)])[0]
    np.testing.assert_array_equal(slow_clip, plain(8))
    assert not np.array_equal(slow_clip, clip)


def _video_engine(loaded):
    return vr.video_engine(loaded, "tiny-ltx")


@pytest.mark.parametrize("fields,param,needle", [
    ({"num_frames": 10}, "num_frames", "8k+1"),
    ({"num_frames": 16}, "num_frames", "nearest allowed: 9 or 17"),
    ({"size": "80x64"}, "size", "32"),
    ({"seconds": "0.2"}, "seconds", "between 0.32"),
])
def test_video_requests_refused_by_the_ltx_rules(loaded, fields, param, needle):
    vr.assert_request_refused(loaded, "tiny-ltx", fields, param, needle)


def test_video_request_defaults_and_seconds(loaded):
    from ditfuse.runtime.videos import parse_video_request

    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1"}, _video_engine(loaded))
    # 1 s at 25 fps would be 26 frames; the nearest 8k + 1 count is 25 (0.96 s), which the job reports
    assert params.num_frames == 25 and seconds == "0.96"
    params, seconds = parse_video_request({"prompt": "a fox", "seconds": 2}, _video_engine(loaded))
    assert params.num_frames == 49 and seconds == "1.92"
    params, seconds = parse_video_request({"prompt": "a fox"}, _video_engine(loaded))
    assert (params.num_frames, params.width, params.height, params.guidance_scale) == (17, 352, 256, 3.0)
    assert seconds == "0.64"


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_an_ltx_clip(tiny_cache, tmp_path):
    r, info = vr.generate_clip("tiny-ltx", tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--frames", "9", "--size", "96x64", "--steps", "2",
                                "--guidance", "4", "--negative-prompt", NEGATIVE, "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (9, 96, 64, 25.0)
    vr.assert_generate_report(r, "LTXPipeline", guidance="4", fps=25)


@pytest.mark.parametrize("args,needle", [
    (["--frames", "10"], "8k+1"),
    (["--size", "80x64"], "32"),
])
def test_generate_refuses_what_ltx_cannot_make(tiny_cache, tmp_path, args, needle):
    vr.assert_generate_refuses("tiny-ltx", tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    with vr.serve_preset("tiny-ltx", tmp_path_factory.mktemp("ltx-data")) as served:
        yield served


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_two_jobs_share_a_batch(served):
    body = {"num_frames": 9, "steps": 2, "guidance_scale": 4.0, "negative_prompt": NEGATIVE}
    # seconds: (9 - 1) / 25
    vr.assert_two_jobs_share_a_batch(served, "96x64", body, frames=9, fps=25, seconds="0.32", bad_frames=10,
                                     needle="8k+1")
