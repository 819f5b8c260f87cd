"""LTX-Video 0.9.5+'s condition pipeline (diffusers ``LTXConditionPipeline``) in the runtime: the
tiny pipeline (``ltx_configs.build_tiny_condition_pipeline``: tiny-ltx's parts and weights with
the 0.9.5+ scheduler; its videos are noise), the ``tiny-ltx-condition`` preset, the pipeline
table's row (text-to-video without an image, or one image at frame 0: ``image_optional``; one
image per call and one video per such call: ``image_alone``), the mounted ``ltx`` adapter bitwise
against plain diffusers with and without the image, ``ditfuse generate`` with and without
``--image`` and ``/v1/videos`` with and without ``input_reference``."""

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

PRESET = "tiny-ltx-condition"
# 9 frames -> 2 latent frames; 64x96 px -> a 2x3 latent grid: 12 video tokens
SIZE = dict(width=96, height=64, num_frames=9)
PROMPTS = ["a red fox", "a grey cat"]
# what every call of the preset gets (the tiny tokenizer's 128 positions)
CALL_KWARGS = PRESET_TABLE[PRESET].resolved_call_kwargs()


def _call(pipe, seed: int = 3, image=None, seeds=None, **over) -> torch.Tensor:
    """One video per seed of ``seeds`` (default: two, ``seed`` and ``seed + 1``), prompt i on
    generator i, CFG against "blurry"; on ``image`` (one condition of the whole call, at frame 0)
    when given, text-only without it."""
    seeds = [seed, seed + 1] if seeds is None else seeds
    kw = dict(prompt=[PROMPTS[i % 2] for i in range(len(seeds))], negative_prompt="blurry", **SIZE,
              generator=[torch.Generator().manual_seed(s) for s in seeds], **CALL_KWARGS)
    if image is not None:
        kw["image"] = image
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def cond():
    return vr.quiet(lc.build_tiny_condition_pipeline())


def test_same_parts_as_tiny_ltx_with_the_095_scheduler(cond):
    from diffusers import LTXConditionPipeline

    t2v = lc.build_tiny_pipeline()
    assert type(cond) is LTXConditionPipeline
    for name in ("transformer", "vae", "text_encoder"):
        sd, sd2 = getattr(cond, name).state_dict(), getattr(t2v, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"ltx_condition.{name}.{key} (tiny-ltx's)")
    # the call passes its own timesteps and no mu: a dynamically shifting scheduler refuses it
    assert not cond.scheduler.config.use_dynamic_shifting and t2v.scheduler.config.use_dynamic_shifting
    assert cond.scheduler.config.shift_terminal == t2v.scheduler.config.shift_terminal == 0.1
    spec = PIPELINE_SPECS["LTXConditionPipeline"]
    assert spec.takes_image and spec.image_optional and spec.image_alone and not spec.image_per_sample
    assert spec.fps_kwarg == "frame_rate" and spec.check_image(False) is None and spec.check_image(True) is None
    assert (spec.size_multiple(cond), spec.frame_multiple(cond)) == (32, 8)


def test_text_only_and_image_calls(cond):
    """The call runs with no condition at all (text-to-video) and with one image; the image
    changes the clip, and so does the frame rate (RoPE's temporal scale through video_coords)."""
    text = _call(cond)
    assert tuple(text.shape) == (2, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), text.shape
    assert torch.isfinite(text).all() and text.min() >= 0 and text.max() <= 1
    on_image = _call(cond, image=picture(0))
    assert on_image.shape == text.shape and not torch.equal(on_image, text), "the image changed nothing"
    assert not torch.equal(_call(cond, image=picture(1)), on_image), "another image changed nothing"
    assert not torch.equal(_call(cond, frame_rate=8), text), "frame_rate changed nothing"


def test_why_image_calls_hold_one_video(cond):
    """diffusers 0.42.1 samples the image's latents once per call with the first generator: the
    second video of a call on an image is not what its seed makes alone (the text-only call has
    no such coupling: its second video is the one a call led by its own seed makes). So the row
    says image_alone, and the engine runs one video per image call."""
    img, same = picture(0), dict(prompt=[PROMPTS[0]] * 2)
    mates, alone = _call(cond, image=img, seeds=[5, 3], **same), _call(cond, image=img, seeds=[3, 3], **same)
    assert not torch.equal(mates[1], alone[0])
    text_mates, text_alone = _call(cond, seeds=[5, 3], **same), _call(cond, seeds=[3, 3], **same)
    assert_bitwise_equal(text_mates[1], text_alone[0], "text-only: video 1 of [5, 3] vs video 0 of [3, 3]")


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated(with_image):
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call on two prompts, text-only or on one
    image (its latents condition the first frame: per-token timesteps, 0 on its tokens), is
    bitwise the plain pipeline's, and every op of the ltx adapter reached the gate."""
    pipe = vr.quiet(lc.build_tiny_condition_pipeline()).to(torch.bfloat16)
    image = picture(0) if with_image else None
    vr.assert_accelerated_bitwise(pipe, lambda p: _call(p, image=image), ltx_adapter.ADAPTER)


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert p.spec == spec and spec.name == "LTXConditionPipeline" == type(pipe).__name__
    assert p.frame_multiple == spec.frame_multiple(pipe) == 8 and p.size_multiple == spec.size_multiple(pipe) == 32
    assert (loaded.fps, loaded.default_frames, loaded.default_size) == (25, 17, (352, 256)) and "noise" in loaded.note
    assert (loaded.default_steps, loaded.default_guidance) == (8, 3.0)
    assert loaded.call_kwargs == {"max_sequence_length": 128}


def _params(seed: int, prompt: str = PROMPTS[0], image=None, tmp_path=None) -> SamplingParams:
    params = SamplingParams.create(prompt, size="96x64", num_inference_steps=2, guidance_scale=3.0, seed=seed,
                                   negative_prompt="blurry").with_(num_frames=9)
    if image is not None:
        path = tmp_path / f"{pixel_sha256(image)[:12]}.png"
        save_png(image, path)
        params = params.with_(image=str(path), image_sha256=pixel_sha256(image))
    return params


def test_text_requests_share_a_call_as_plain_diffusers(loaded):
    """Two text-only requests share one call (equal batch signatures), and each clip is plain
    diffusers' for its prompt and seed in a call of the same two, with the preset's fps as
    frame_rate."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    params = [_params(3, PROMPTS[0]), _params(4, PROMPTS[1])]
    spec = loaded.spec
    assert spec.batch_signature(params[0], PRESET) == spec.batch_signature(params[1], PRESET)
    clips = run_batch(loaded, [(p, 0) for p in params])
    with torch.no_grad():
        plain = _call(loaded.pipe, seed=3, frame_rate=loaded.fps)
    for clip, want in zip(clips, plain):
        np.testing.assert_array_equal(clip, frames_to_uint8(want.numpy()))
    assert not np.array_equal(clips[0], clips[1])


def test_image_request_runs_alone_as_plain_diffusers(loaded, tmp_path):
    """An image request's clip is plain diffusers' call of one video on that image with its seed;
    requests on the same image have equal signatures (another image: another signature), yet
    run_batch refuses two of them in one call."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    img = picture(0)
    p = _params(3, image=img, tmp_path=tmp_path)
    clip = run_batch(loaded, [(p, 0)])[0]
    with torch.no_grad():
        want = _call(loaded.pipe, image=img, seeds=[3], frame_rate=loaded.fps)[0]
    np.testing.assert_array_equal(clip, frames_to_uint8(want.numpy()))
    text_clip = run_batch(loaded, [(_params(3), 0)])[0]
    assert not np.array_equal(clip, text_clip)

    spec, mate = loaded.spec, _params(4, image=img, tmp_path=tmp_path)
    assert spec.batch_signature(p, PRESET) == spec.batch_signature(mate, PRESET)
    assert spec.batch_signature(p, PRESET) != spec.batch_signature(_params(3, image=picture(1), tmp_path=tmp_path),
                                                                   PRESET)
    assert spec.batch_signature(p, PRESET) != spec.batch_signature(_params(3), PRESET)
    with pytest.raises(ValueError, match="one video"):
        run_batch(loaded, [(p, 0), (mate, 0)])


def test_engine_caps_image_batches_at_one_video(loaded):
    """The engine's batches (and the padding that fills them up) are one video for a request with
    an image, max_video_batch_size for a text-only video, max_batch_size for a still."""
    from ditfuse.runtime.engine import Engine

    engine = Engine(loaded, None, max_batch_size=4, max_video_batch_size=2)  # not started: nothing runs
    text = _params(3)
    assert engine._batch_cap(text) == 2
    assert engine._batch_cap(text.with_(image="in.png", image_sha256="0" * 64)) == 1
    assert engine._batch_cap(text.with_(num_frames=None)) == 4


@pytest.mark.parametrize("fields,param,needle", [
    ({"num_frames": 10}, "num_frames", "8k+1"),
    ({"num_frames": 16}, "num_frames", "nearest allowed: 9 or 17"),
    ({"size": "80x64"}, "size", "32"),
    ({"size": "96x48"}, "size", "32"),
    ({"seconds": "0.2"}, "seconds", "between 0.32"),
])
def test_video_requests_refused_by_the_ltx_rules(loaded, fields, param, needle):
    vr.assert_request_refused(loaded, PRESET, fields, param, needle)


def test_video_request_defaults_with_and_without_an_image(loaded):
    from ditfuse.runtime.videos import parse_video_request

    engine = vr.video_engine(loaded, PRESET)
    params, seconds = parse_video_request({"prompt": "a fox"}, engine)
    assert (params.num_frames, params.width, params.height, params.guidance_scale) == (17, 352, 256, 3.0)
    assert params.image_sha256 is None and seconds == "0.64"
    img = picture(0, 90, 160)
    params, _ = parse_video_request({"prompt": "a fox", "input_reference": png_bytes(img)}, engine)
    # no size: the image's 9:16 at 352x256's area, sides in 32s
    assert (params.width, params.height) == (224, 384) and params.image_sha256 == pixel_sha256(img)


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_a_text_only_clip(tiny_cache, tmp_path):
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", "a fox", "--frames", "9", "--size", "96x64", "--steps", "2",
                                "--guidance", "4", "--negative-prompt", "blurry", "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (9, 96, 64, 25.0)
    vr.assert_generate_report(r, "LTXConditionPipeline", guidance="4", fps=25)
    assert "sha256" not in r.stdout


@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_a_clip_from_an_image(tiny_cache, tmp_path):
    picture(0, 90, 160).save(tmp_path / "start.png")
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", "a fox", "--image", str(tmp_path / "start.png"), "--frames", "9",
                                "--steps", "2", "--seed", "3"])
    # no --size: the image's 9:16 at 352x256's area, sides in 32s
    assert (info.frames, info.width, info.height, info.fps) == (9, 224, 384, 25.0)
    assert "(LTXConditionPipeline)" in r.stdout and f"pixels sha256 {pixel_sha256(picture(0, 90, 160))}" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--frames", "10"], "8k+1"),
    (["--size", "80x64"], "32"),
])
def test_generate_refuses_what_ltx_cannot_make(tiny_cache, tmp_path, args, needle):
    vr.assert_generate_refuses(PRESET, tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    with vr.serve_preset(PRESET, tmp_path_factory.mktemp("ltx-condition-data")) as served:
        yield served


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_text_jobs_share_a_batch(served):
    body = {"num_frames": 9, "steps": 2, "guidance_scale": 4.0, "negative_prompt": "blurry"}
    # seconds: (9 - 1) / 25
    vr.assert_two_jobs_share_a_batch(served, "96x64", body, frames=9, fps=25, seconds="0.32", bad_frames=10,
                                     needle="8k+1")


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_image_jobs_run_one_per_batch(served):
    """Two multipart jobs on the same image complete as 9-frame clips, each in a batch of its own
    (unpadded), and report the image's fingerprint."""
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=vr.KEY, timeout=300, max_retries=0)
    before = len(served.engine.batch_log)
    img = picture(0)
    jobs = [c.videos.create(prompt=f"a fox {i}", size="96x64", input_reference=("in.png", png_bytes(img), "image/png"),
                            extra_body={"num_frames": 9, "steps": 2, "seed": i}) for i in range(2)]
    videos, done = vr.completed_clips(c, jobs)
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height, i.fps) == (9, 96, 64, 25.0) for i in infos), infos
    assert done[0] != done[1]
    assert all(v.model_extra["image_sha256"] == pixel_sha256(img) for v in videos), videos
    log = list(served.engine.batch_log)[before:]
    assert [b["size"] for b in log] == [1, 1], log
    assert all(b.get("error") is None for b in log), log


@pytest.mark.slow  # a `ditfuse serve` subprocess, two jobs and a still
def test_serve_with_and_without_input_reference(tiny_cache, tmp_path):
    """`ditfuse serve --model tiny-ltx-condition`: its startup lines say a job may bring an image
    and list the images route (text-only stills work: one-frame clips); a job with an image (a JSON
    body's data URL, no size: the image's aspect) and one without both complete."""
    import base64
    import subprocess

    import httpx

    from tests.cpu.test_videos_server import EXE, _env, free_port
    from tests.support.serve_process import wait_healthy

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([EXE, "serve", "--model", PRESET, "--port", str(port), "--data-dir",
                                 str(tmp_path / "data")], env=_env(tiny_cache), stdout=out, stderr=subprocess.STDOUT,
                                text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120, output=log.read_text)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
        wide = picture(2, 160, 90)
        data_url = "data:image/png;base64," + base64.b64encode(png_bytes(wide)).decode()
        r = httpx.post(f"{url}/v1/videos", json={"prompt": "json", "input_reference": {"image_url": data_url},
                                                 "steps": 1, "num_frames": 1}, timeout=60)
        assert r.status_code == 200 and r.json()["size"] == "384x224", r.text  # 16:9 at 352x256's area, sides rounded down to 32s
        text_job = c.videos.create(prompt="a fox", size="96x64", extra_body={"steps": 1, "num_frames": 9})
        for job_id in (r.json()["id"], text_job.id):
            v = vr.wait_done(c, job_id)
            assert v.status == "completed", v.error
        assert c.videos.retrieve(r.json()["id"]).model_extra["image_sha256"] == pixel_sha256(wide)
        assert c.videos.retrieve(text_job.id).model_extra["image_sha256"] is None
        still = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "96x64", "num_inference_steps": 1}, timeout=120)
        assert still.status_code == 200 and len(still.json()["data"]) == 1, still.text
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "input images: jobs may bring input_reference (up to" in text, text
    assert "POST /v1/images/generations" in text and "POST /v1/videos" in text, text
