"""Wan 2.2 A14B's second guidance scale (``guidance_scale_2``: the scale of ``transformer_2``, the
low-noise expert) as a request field: ``/v1/videos`` and ``/v1/images/generations`` fields,
``ditfuse generate --guidance-scale-2``. The runtime passes it to the call (PipelineSpec
``guidance_2_kwarg``) only on a checkpoint with two experts (``Capabilities.guidance_2``, read from
the loaded pipeline: ``boundary_ratio`` and ``transformer_2``); a request naming it anywhere else is
a 400 / exit 2 saying why. Checked on the tiny random-weight presets (their videos are noise):
``run_batch`` against diffusers' own call with the same arguments and seed, refusals on
``tiny-wan``, ``tiny-wan22-5b`` and a class without the argument, batch separation, job objects and
metadata, the CLI flag."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ditfuse.models import wan_configs as wc
from ditfuse.runtime.inputs import pixel_sha256
from ditfuse.runtime.params import ParamError, SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from tests.support import video_runtime as vr
from tests.support.video_runtime import image_bytes, picture

from .test_videos_engine import StepRunner, V, engine, run

A14B, A14B_I2V = "tiny-wan22-a14b", "tiny-wan22-a14b-i2v"
# 5 frames -> 2 latent frames; 64x48 px -> 8x6 latents -> 4x3 patches
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"


@pytest.fixture(scope="module")
def models(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return {name: load_model(name, device="cpu") for name in (A14B, A14B_I2V, "tiny-wan", "tiny-wan22-5b")}


def _params(name: str, tmp_path, guidance_2: float | None = None, seed: int = 5) -> SamplingParams:
    p = SamplingParams.create(PROMPT, size="64x48", num_inference_steps=2, guidance_scale=4.0,
                              guidance_scale_2=guidance_2, seed=seed).with_(num_frames=5)
    if name == A14B_I2V:
        from ditfuse.runtime.inputs import save_png

        save_png(picture(0), tmp_path / "a.png")
        p = p.with_(image=str(tmp_path / "a.png"), image_sha256=pixel_sha256(picture(0)))
    return p


def test_capabilities_follow_the_checkpoint(models):
    """Both A14B presets take guidance_scale_2; one-expert Wan checkpoints (Wan 2.1, TI2V-5B) do
    not, and say why; pipeline classes without the argument have no guidance_2_kwarg."""
    for name in (A14B, A14B_I2V):
        caps = models[name].capabilities
        assert caps.guidance_2 and models[name].spec.guidance_2_kwarg == "guidance_scale_2", caps
    for name in ("tiny-wan", "tiny-wan22-5b"):
        caps = models[name].capabilities
        assert not caps.guidance_2 and "one transformer" in caps.guidance_2_why, caps
    assert PIPELINE_SPECS["LTXPipeline"].guidance_2_kwarg is None
    assert PIPELINE_SPECS["SkyReelsV2ImageToVideoPipeline"].guidance_2_kwarg is None


@pytest.mark.parametrize("name", [A14B, A14B_I2V])
def test_run_batch_passes_guidance_scale_2_to_the_call(models, name, tmp_path):
    """The runtime's call with guidance_scale_2 is diffusers' own with guidance_scale 4 and
    guidance_scale_2 1.5 (same seed, image read back from its file), and differs from the call
    without it (where diffusers gives transformer_2 the guidance_scale)."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    loaded = models[name]
    kw = dict(prompt=PROMPT, **SIZE, max_sequence_length=wc.TINY_WAN_TEXT_LEN, guidance_scale=4.0,
              guidance_scale_2=1.5)
    if name == A14B_I2V:
        kw["image"] = picture(0)
    with torch.no_grad():
        plain = frames_to_uint8(vr.frames(loaded.pipe, 5, **kw)[0].numpy())
    with_2 = run_batch(loaded, [(_params(name, tmp_path, 1.5), 0)])[0]
    np.testing.assert_array_equal(with_2, plain)
    without = run_batch(loaded, [(_params(name, tmp_path), 0)])[0]
    assert not np.array_equal(with_2, without), "guidance_scale_2 changed nothing"
    # equal to guidance_scale: what diffusers does without it
    np.testing.assert_array_equal(run_batch(loaded, [(_params(name, tmp_path, 4.0), 0)])[0], without)


def test_metadata_and_signature_carry_it():
    p = SamplingParams.create("x", size="64x48", seed=1, guidance_scale=4.0)
    a, b = p.with_(guidance_scale_2=1.5), p.with_(guidance_scale_2=2.0)
    assert len({p.signature("m"), a.signature("m"), b.signature("m")}) == 3
    assert a.metadata()["guidance_scale_2"] == "1.5" and "guidance_scale_2" not in p.metadata()
    with pytest.raises(ParamError) as e:
        SamplingParams.create("x", guidance_scale_2=-1)
    assert e.value.param == "guidance_scale_2"
    # a stored job's params (jobs.params_json) come back equal
    d = a.to_dict()
    assert SamplingParams(**{**d, "quality": a.quality}) == a and d["guidance_scale_2"] == 1.5


def test_requests_with_different_guidance_scale_2_do_not_share_a_batch():
    runner = StepRunner()

    async def main():
        eng = engine(runner, max_video_batch_size=4)
        await eng.start()
        reqs = [V("a0", guidance_scale_2=1.5), V("a1", guidance_scale_2=1.5), V("b0", guidance_scale_2=2.0),
                V("c0")]
        await asyncio.gather(*[eng.submit(r) for r in reqs])
        await eng.shutdown()

    run(main())
    assert sorted(tuple(p) for _, p, _ in runner.calls) == [("a0", "a1"), ("b0",), ("c0",)]


def test_video_requests(models):
    """/v1/videos: the A14B presets take guidance_scale_2 (a form field's text too); tiny-wan and
    tiny-wan22-5b (one transformer) refuse it with a 400 saying why, as does a class whose call has
    no such argument."""
    from ditfuse.runtime.videos import parse_video_request

    params, _ = parse_video_request({"prompt": "a fox", "guidance_scale_2": "2.5"}, vr.video_engine(models[A14B], A14B))
    assert (params.guidance_scale, params.guidance_scale_2) == (5.0, 2.5)
    params, _ = parse_video_request({"prompt": "a fox", "input_reference": image_bytes(picture(0)),
                                     "guidance_scale_2": 1}, vr.video_engine(models[A14B_I2V], A14B_I2V))
    assert params.guidance_scale_2 == 1.0
    params, _ = parse_video_request({"prompt": "a fox"}, vr.video_engine(models[A14B], A14B))
    assert params.guidance_scale_2 is None
    for name in ("tiny-wan", "tiny-wan22-5b"):
        vr.assert_request_refused(models[name], name, {"guidance_scale_2": 2.0}, "guidance_scale_2", "one transformer")
    vr.assert_request_refused(models[A14B], A14B, {"guidance_scale_2": "x"}, "guidance_scale_2", "number")
    assert PIPELINE_SPECS["HunyuanVideoPipeline"].check_request({"guidance_scale_2"})[0] == "guidance_scale_2"


def test_run_batch_refuses_it_on_one_expert(models, tmp_path):
    from ditfuse.runtime.engine import run_batch

    with pytest.raises(ValueError, match="one transformer"):
        run_batch(models["tiny-wan22-5b"], [(_params("tiny-wan22-5b", tmp_path, 1.5).with_(
            width=64, height=64), 0)])


def test_images_endpoint(models):
    """A video model's images route (one-frame clips) takes it as the videos API does."""
    from ditfuse.runtime.server import APIError, parse_generation_request

    def eng(name):
        from ditfuse.contracts.quality import Quality

        return SimpleNamespace(loaded=models[name], model_name=name, default_quality=Quality.LOSSLESS)

    p = parse_generation_request({"prompt": "x", "size": "64x48", "guidance_scale_2": 2.0}, eng(A14B))
    assert p.guidance_scale_2 == 2.0
    with pytest.raises(ParamError) as e:
        parse_generation_request({"prompt": "x", "size": "64x48", "guidance_scale_2": 2.0}, eng("tiny-wan"))
    assert e.value.param == "guidance_scale_2" and "one transformer" in str(e.value)
    with pytest.raises(APIError):  # still strict about unknown fields
        parse_generation_request({"prompt": "x", "guidance_scale_3": 2.0}, eng(A14B))


def test_job_object_reports_it(tmp_path):
    from ditfuse.runtime.jobs import params_json
    from ditfuse.runtime.videos import VideoJobs

    eng = SimpleNamespace(model_name=A14B, loaded=SimpleNamespace(is_video=True, fps=16))
    jobs = VideoJobs(eng, tmp_path, sweep_interval_s=0)
    p = _params(A14B, tmp_path, 1.5)
    row = {"id": "video_x", "model": A14B, "status": "queued", "progress": 0, "created_at": 1, "prompt": PROMPT,
           "size": p.size, "seconds": "0.25", "quality": "lossless", "params": params_json(p)}
    api = jobs.to_api(row)
    assert (api["guidance_scale"], api["guidance_scale_2"]) == (4.0, 1.5)
    row["params"] = params_json(p.with_(guidance_scale_2=None))
    assert jobs.to_api(row)["guidance_scale_2"] is None
    # a row stored before the field existed
    old = json.loads(params_json(p))
    del old["guidance_scale_2"]
    row["params"] = json.dumps(old)
    assert jobs.to_api(row)["guidance_scale_2"] is None


@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_with_guidance_scale_2(tiny_cache, tmp_path):
    r, info = vr.generate_clip(A14B, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--size", "64x48", "--frames", "5", "--steps", "2",
                                "--guidance", "4", "--guidance-scale-2", "1.5", "--seed", "3"])
    assert (info.frames, info.width, info.height) == (5, 64, 48)
    assert "guidance 4 (low-noise expert 1.5)" in r.stdout, r.stdout
    assert "guidance_scale_2=1.5" in info.metadata["comment"], info.metadata


@pytest.mark.parametrize("preset", ["tiny-wan", "tiny-wan22-5b"])
def test_generate_refuses_guidance_scale_2_on_one_expert(tiny_cache, tmp_path, preset):
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, ["--guidance-scale-2", "2", "--frames", "5"],
                               "one transformer")
