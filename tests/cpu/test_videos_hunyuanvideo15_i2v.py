"""HunyuanVideo 1.5 image-to-video (diffusers ``HunyuanVideo15ImageToVideoPipeline``) in the
runtime: the tiny random-weight pipeline (``hunyuanvideo15_configs.build_tiny_i2v_pipeline``:
tiny-hunyuanvideo15's parts and weights plus a tiny SigLIP vision encoder; its videos are noise),
the ``tiny-hunyuanvideo15-i2v`` preset, the pipeline table's row, the output size the call derives
from its image (``PipelineSpec.size_from_image`` / ``fit_image``: the aspect bucket nearest the
image's, or a named bucket the image is fitted to), the mounted ``hunyuanvideo15`` adapter bitwise
against plain diffusers with the image's SigLIP tokens in the joint sequence, ``ditfuse generate
--image`` and ``/v1/videos`` with ``input_reference`` through the official client against a
``ditfuse serve`` process."""

from __future__ import annotations

import base64
import subprocess

import httpx
import numpy as np
import openai
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import hunyuanvideo15 as hy
from ditfuse.models import hunyuanvideo15_configs as hc
from ditfuse.runtime import video_io
from ditfuse.runtime.inputs import default_size_for_image, fit_image_to_size, pixel_sha256, save_png
from ditfuse.runtime.params import ParamError, SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr
from tests.support.serve_process import wait_healthy
from tests.support.video_runtime import image_bytes as png_bytes
from tests.support.video_runtime import picture

PRESET = "tiny-hunyuanvideo15-i2v"
CLASS = "HunyuanVideo15ImageToVideoPipeline"
PROMPT = "a red fox"


def _buckets(pipe) -> list[tuple[int, int]]:
    """Every (width, height) bucket of ``pipe``'s target size (diffusers' list is (height, width))."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list

    return [(w, h) for h, w in generate_crop_size_list(pipe.target_size, pipe.vae_scale_factor_spatial)]


def _small(pipe):
    """``pipe`` with the interpreter-sized text (:data:`hc.TINY_TEXT_LENGTHS`) and a target size
    of 64, whose 4:3 bucket is 64x48 (4x3 latents): the call's cost under the Triton interpreter
    grows with the joint sequence. ``target_size`` is the instance attribute the call reads (the
    pipeline copies it from the transformer's config)."""
    hc.set_text_lengths(pipe, **hc.TINY_TEXT_LENGTHS)
    pipe.target_size = 64
    return vr.quiet(pipe)


def test_same_parts_as_tiny_hunyuanvideo15():
    """The I2V build is tiny-hunyuanvideo15's parts and weights (config changes only: the
    transformer's target_size and task_type) plus a SigLIP encoder drawn after them from its own
    seed, the same on every build."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipVisionModel

    i2v, t2v = hc.build_tiny_i2v_pipeline(), hc.build_tiny_pipeline()
    assert type(i2v) is HunyuanVideo15ImageToVideoPipeline and type(i2v.image_encoder) is SiglipVisionModel
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        sd, sd2 = getattr(i2v, name).state_dict(), getattr(t2v, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"hy15_i2v.{name}.{key} (tiny-hunyuanvideo15's)")
    again = hc.build_tiny_i2v_pipeline().image_encoder.state_dict()
    for key, t in i2v.image_encoder.state_dict().items():
        assert_bitwise_equal(again[key], t, f"image_encoder.{key} (second build)")
    cfg = i2v.transformer.config
    assert (cfg.target_size, cfg.task_type, i2v.target_size) == (hc.TINY_I2V_TARGET_SIZE, "i2v", hc.TINY_I2V_TARGET_SIZE)
    # the encoder's tokens are the transformer's image embeddings; the processor feeds it its size
    assert i2v.image_encoder.config.hidden_size == cfg.image_embed_dim
    assert i2v.feature_extractor.size["height"] == i2v.image_encoder.config.image_size
    spec = PIPELINE_SPECS[CLASS]
    assert spec.takes_image and not spec.image_per_sample and spec.size_from_image and spec.fit_image
    assert (spec.size_multiple(i2v), spec.frame_multiple(i2v), spec.size_for(i2v)) == (16, 4, (256, 144))


def test_the_image_sets_the_size_and_conditions_the_clip():
    """The clip takes the bucket of the image's aspect (here 64x48 for 4:3, 48x64 for 3:4); the
    same image and seed give the same clip, another image another one; the transformer sees the
    image's SigLIP tokens (not text-to-video's zeros) and its latents on the first frame."""
    pipe = _small(hc.build_tiny_i2v_pipeline())
    seen_embeds, seen_inputs = [], []
    hooks = [pipe.transformer.image_embedder.register_forward_pre_hook(lambda m, a: seen_embeds.append(a[0])),
             pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen_inputs.append(kw["hidden_states"]),
                                                        with_kwargs=True)]
    frames = vr.frames(pipe, 3, image=picture(0), prompt=PROMPT, num_frames=5, num_inference_steps=1)
    for h in hooks:
        h.remove()
    assert tuple(frames.shape) == (1, 5, 48, 64, 3), frames.shape
    embeds, latents = seen_embeds[0], seen_inputs[0]
    side = pipe.image_encoder.config.image_size // pipe.image_encoder.config.patch_size
    assert embeds.shape[1:] == (side * side, pipe.transformer.config.image_embed_dim) and embeds.abs().sum() > 0
    c = pipe.vae.config.latent_channels
    cond, mask = latents[:, c:2 * c], latents[:, 2 * c]
    assert cond[:, :, 0].abs().sum() > 0 and not cond[:, :, 1:].any() and mask[:, 0].eq(1).all() and not mask[:, 1:].any()
    assert torch.equal(vr.frames(pipe, 3, image=picture(0), prompt=PROMPT, num_frames=5, num_inference_steps=1), frames)
    other = vr.frames(pipe, 3, image=picture(1), prompt=PROMPT, num_frames=5, num_inference_steps=1)
    assert other.shape == frames.shape and not torch.equal(other, frames), "the image changed nothing"
    tall = vr.frames(pipe, 3, image=picture(0, 30, 40), prompt=PROMPT, num_frames=1, num_inference_steps=1)
    assert tuple(tall.shape) == (1, 1, 64, 48, 3)


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call on an image (its SigLIP tokens
    valid in the joint text sequence, its VAE latents and mask in the transformer's input) is
    bitwise the plain pipeline's, and every op of the hunyuanvideo15 adapter reached the gate.
    The token refiner's attention (AttnProcessor2_0, text only) keeps diffusers' forward.

    On the CPU the gate's eager reference is aten's CPU LayerNorm, which reduces in another order
    than the CUDA kernels the ops reproduce; for some data one bf16 element can differ by 1 ulp
    and the gate falls back, as it should (tests/cpu/test_videos_wan_i2v.py); with every call
    verified (conftest verify_every_call) such a fallback is allowed on the CPU and the output is
    still the reference's bits (support/engaged.assert_gate_clean)."""
    pipe = _small(hc.build_tiny_i2v_pipeline()).to(torch.bfloat16)

    def call(p):
        return vr.frames(p, 3, image=picture(0), prompt=PROMPT, num_frames=5)

    tr = vr.assert_accelerated_bitwise(pipe, call, hy.ADAPTER, no_skipped_sites=False)
    n = pipe.transformer.config.num_refiner_layers
    assert sorted(p for p, _ in tr.skipped_sites) == [
        f"context_embedder.token_refiner.refiner_blocks.{i}.attn" for i in range(n)], tr.skipped_sites


# -- the runtime: preset, sizes, run_batch ------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


@pytest.fixture(scope="module")
def short(loaded):
    """``loaded`` with the short text of :data:`hc.TINY_TEXT_LENGTHS` (the preset's call is
    1000 + 256 text tokens, the real pipeline's): the run_batch tests compare the runtime's call
    with diffusers' on the same pipeline object, whichever lengths it has."""
    pipe = loaded.pipe
    saved = pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens
    hc.set_text_lengths(pipe, **hc.TINY_TEXT_LENGTHS)
    yield loaded
    hc.set_text_lengths(pipe, *saved)


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model, video_models_hint

    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert is_video_model(PRESET) and p.spec == spec and spec.name == CLASS == type(pipe).__name__
    assert loaded.is_video and "noise" in loaded.note and pipe.vae.use_slicing  # the row's prepare ran
    assert p.frame_multiple == spec.frame_multiple(pipe) == 4 and p.size_multiple == spec.size_multiple(pipe) == 16
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
    # the preset's default size is what a 16:9 image makes at its target size
    assert loaded.default_size == spec.size_for(pipe) == (256, 144) == PRESET_TABLE["tiny-hunyuanvideo15"].default_size
    assert (loaded.default_steps, loaded.default_guidance) == (8, 6.0)
    assert PRESET in video_models_hint() and CLASS in video_models_hint()


@pytest.mark.parametrize("w,h,want", [
    (160, 90, (256, 144)),  # 16:9
    (90, 160, (144, 240)),  # 9:16 (its exact bucket 144x256 is reached from a taller aspect)
    (40, 30, (208, 160)),
    (1, 1, (192, 192)),
    (4000, 10, (384, 96)),  # the widest bucket (aspect 4)
])
def test_no_size_gets_the_bucket_of_the_image(loaded, w, h, want):
    assert default_size_for_image(loaded, picture(0, w, h)) == want
    # a Preset (generate's checks before loading) has no pipeline to ask: its default stands in,
    # and generate asks the loaded model again
    assert default_size_for_image(PRESET_TABLE[PRESET], picture(0, w, h)) == (256, 144)


def test_every_bucket_can_be_named_and_nothing_else(loaded):
    """Fitted by the spec, an image of any aspect makes exactly the named bucket, for every bucket
    of the target size: by the image itself where it is its own bucket, else fitted to the bucket
    (the call's crop-resize is then the identity) or, for the buckets the rounded-ratio search
    reaches only from another aspect, to one pixel more, which the call crops without resampling.
    A size that is no bucket is a ParamError naming the bucket of its aspect."""
    pipe, spec = loaded.pipe, loaded.spec
    buckets = _buckets(pipe)
    assert len(buckets) == 37 and (256, 144) in buckets and (144, 256) in buckets
    ways = {"as given": 0, "fitted": 0, "one pixel more": 0}
    for image in (picture(0, 40, 30), picture(1, 90, 160), picture(2, 7, 300)):
        for w, h in buckets:
            fitted = fit_image_to_size(loaded, image, w, h)
            assert spec.size_from_image(pipe, fitted.width, fitted.height) == (w, h), (image.size, w, h)
            # what the call itself then does to the image: nothing, or a crop without resampling
            resized = np.asarray(pipe.video_processor.resize(fitted, height=h, width=w, resize_mode="crop"))
            if fitted is image:
                ways["as given"] += 1
            elif fitted.size == (w, h):
                ways["fitted"] += 1
                assert np.array_equal(resized, np.asarray(fitted)), (w, h)
            else:
                ways["one pixel more"] += 1
                assert fitted.size in ((w + 1, h), (w, h + 1)), fitted.size
                left, top = fitted.width // 2 - w // 2, fitted.height // 2 - h // 2
                assert np.array_equal(resized, np.asarray(fitted.crop((left, top, left + w, top + h)))), (w, h)
    assert all(ways.values()), ways
    img = picture(0, 40, 30)
    assert fit_image_to_size(loaded, img, 208, 160) is img  # its own bucket: diffusers' own fit
    for size, near in [((832, 480), "240x144"), ((256, 160), "224x144"), ((144, 272), "144x256")]:
        with pytest.raises(ParamError) as e:
            fit_image_to_size(loaded, img, *size)
        assert e.value.param == "size" and f"{size[0]}x{size[1]} is not one" in str(e.value), str(e.value)
        assert f"comes out at {near}" in str(e.value) and CLASS in str(e.value), str(e.value)


def test_sizes_without_the_pipeline(loaded):
    """serve --gpus N's server process holds the model's description without its pipeline (a
    pickled ``dataclasses.replace(loaded, pipe=None)``, workers.py): it sizes, fits and refuses
    as the loaded pipeline does, from ``loaded.sizing``."""
    import dataclasses
    import pickle

    meta = pickle.loads(pickle.dumps(dataclasses.replace(loaded, pipe=None)))
    assert meta.pipe is None and meta.sizing.target_size == hc.TINY_I2V_TARGET_SIZE
    for w, h in ((40, 30), (90, 160), (1, 1)):
        img = picture(0, w, h)
        assert default_size_for_image(meta, img) == default_size_for_image(loaded, img)
    img = picture(0, 40, 30)
    for size in ((144, 256), (256, 144), (208, 160)):
        a, b = fit_image_to_size(meta, img, *size), fit_image_to_size(loaded, img, *size)
        assert a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b)), size
    with pytest.raises(ParamError, match="832x480 is not one"):
        fit_image_to_size(meta, img, 832, 480)


def _params(loaded, path, image, size=None, seed: int = 5, frames: int = 5) -> SamplingParams:
    """A 1-step CFG request on ``image`` (kept at ``path``), at ``size`` or, without one, the
    size the runtime gives it on ``loaded``."""
    return SamplingParams.create(PROMPT, size=size, default_size=default_size_for_image(loaded, image),
                                 num_inference_steps=1, guidance_scale=4.0, seed=seed).with_(
        num_frames=frames, image=str(path), image_sha256=pixel_sha256(image))


def _plain(pipe, image, seed: int, frames: int = 5, **kw) -> np.ndarray:
    """Plain diffusers' clip for the runtime's call: guidance on the guider, one generator."""
    from ditfuse.runtime.video_io import frames_to_uint8

    saved = pipe.guider.guidance_scale
    pipe.guider.guidance_scale = 4.0
    try:
        with torch.no_grad():
            out = vr.frames(pipe, seed, image=image, prompt=[PROMPT], num_frames=frames, num_inference_steps=1,
                            generator=[torch.Generator().manual_seed(seed)], **kw)
    finally:
        pipe.guider.guidance_scale = saved
    return frames_to_uint8(out[0].numpy())


def test_run_batch_matches_plain_diffusers_and_reports_the_true_size(short, tmp_path):
    """No size: the runtime's call is diffusers' own on the request's image (read back from its
    file) and seed, at the image's bucket. A named bucket: diffusers' call on the image the spec
    fitted to it, at exactly that size. A size that is no bucket is refused before anything runs."""
    from ditfuse.runtime.engine import run_batch

    a = picture(0, 40, 30)
    save_png(a, tmp_path / "a.png")
    p = _params(short, tmp_path / "a.png", a)
    assert (p.width, p.height) == (208, 160)
    clip = run_batch(short, [(p, 0)])[0]
    assert clip.shape == (5, 160, 208, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, _plain(short.pipe, a, 5))
    assert p.metadata(0)["size"] == "208x160" and p.metadata(0)["image_sha256"] == pixel_sha256(a)
    # 144x256: a bucket the image's own 3:4 does not pick; fitted to 144x257, cropped by the call
    named = _params(short, tmp_path / "a.png", a, size="144x256", frames=1)
    clip = run_batch(short, [(named, 0)])[0]
    fitted = fit_image_to_size(short, a, 144, 256)
    assert clip.shape == (1, 256, 144, 3) and fitted.size == (144, 257)
    np.testing.assert_array_equal(clip, _plain(short.pipe, fitted, 5, frames=1))
    with pytest.raises(ValueError, match="832x480 is not one"):
        run_batch(short, [(_params(short, tmp_path / "a.png", a, size="832x480", frames=1), 0)])
    with pytest.raises(ValueError, match="generates from an image"):
        run_batch(short, [(p.with_(image=None, image_sha256=None), 0)])


def test_a_batch_of_two_on_one_image(short, tmp_path):
    """Two seeds on one image share one call (the image's SigLIP tokens and latents are repeated
    over the batch; the VAE decodes the two with slicing); jobs on another image do not share it."""
    from ditfuse.runtime.engine import run_batch

    a, b = picture(0, 40, 30), picture(1, 40, 30)
    save_png(a, tmp_path / "a.png")
    save_png(b, tmp_path / "b.png")
    ps = [_params(short, tmp_path / "a.png", a, seed=i, frames=1) for i in range(2)]
    spec = short.spec
    assert spec.batch_signature(ps[0], PRESET) == spec.batch_signature(ps[1], PRESET)
    assert spec.batch_signature(_params(short, tmp_path / "b.png", b, seed=0, frames=1), PRESET) != \
        spec.batch_signature(ps[0], PRESET)
    clips = run_batch(short, [(p, 0) for p in ps])
    assert [c.shape for c in clips] == [(1, 160, 208, 3)] * 2 and not np.array_equal(clips[0], clips[1])


def test_video_requests_take_the_bucket_or_a_named_one(loaded):
    from ditfuse.runtime.videos import parse_video_request

    engine = vr.video_engine(loaded, PRESET)
    vr.assert_request_refused(loaded, PRESET, {}, "input_reference", "generates from an image")
    img = picture(0, 160, 90)
    params, seconds = parse_video_request({"prompt": "a fox", "input_reference": png_bytes(img)}, engine)
    assert (params.width, params.height, params.num_frames, seconds) == (256, 144, 17, "0.666667")
    assert params.image_sha256 == pixel_sha256(img)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    params2, _ = parse_video_request({"prompt": "a fox", "size": "144x256", "input_reference": {"image_url": url}},
                                     engine)
    assert (params2.width, params2.height, params2.image_sha256) == (144, 256, params.image_sha256)
    vr.assert_request_refused(loaded, PRESET, {"size": "832x480", "input_reference": png_bytes(img)}, "size",
                              "comes out at 240x144")


def test_text_to_video_model_refuses_an_image(tiny_cache):
    from ditfuse.runtime.presets import load_model

    t2v = load_model("tiny-hunyuanvideo15", device="cpu")
    vr.assert_request_refused(t2v, "tiny-hunyuanvideo15", {"input_reference": png_bytes(picture(0))},
                              "input_reference", "takes no input image")


# -- ditfuse generate and ditfuse serve -----------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_an_i2v_clip(tiny_cache, tmp_path):
    picture(0, 90, 160).save(tmp_path / "start.png")
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--image", str(tmp_path / "start.png"), "--frames", "5",
                                "--steps", "2", "--guidance", "4", "--seed", "3"])
    # no --size: the bucket of the image's 9:16 at the preset's target size
    assert (info.frames, info.width, info.height, info.fps) == (5, 144, 240, 24.0)
    vr.assert_generate_report(r, CLASS, guidance="4", fps=24)
    assert "sampling: 144x240," in r.stdout and f"pixels sha256 {pixel_sha256(picture(0, 90, 160))}" in r.stdout


@pytest.mark.parametrize("preset,args,needle", [
    (PRESET, [], "generates from an image"),
    (PRESET, ["--image", "IMAGE", "--size", "256x160"], "256x160 is not one"),
    ("tiny-hunyuanvideo15", ["--image", "IMAGE"], "takes no input image"),
])
def test_generate_refuses_without_the_right_image_or_size(tiny_cache, tmp_path, tmp_path_factory, preset, args,
                                                          needle):
    start = tmp_path_factory.mktemp("start") / "start.png"  # outside tmp_path, which must stay empty
    picture(0).save(start)
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, [str(start) if a == "IMAGE" else a for a in args],
                               needle)


@pytest.mark.slow  # a `ditfuse serve` subprocess, three jobs in two batches
def test_serve_videos_with_input_reference(tiny_cache, tmp_path):
    """`ditfuse serve --model tiny-hunyuanvideo15-i2v` through the official openai client: every
    job's size is its clip's (the bucket of its image without a size; a named bucket, fitted); a
    size that is no bucket and a job without an image are 400s; the images route says where
    image-to-video lives; the startup lines say every job needs an image."""
    from tests.cpu.test_videos_server import EXE, _env, free_port

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([EXE, "serve", "--model", PRESET, "--port", str(port), "--data-dir",
                                 str(tmp_path / "data"), "--max-video-batch-size", "2"], env=_env(tiny_cache),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120, output=log.read_text)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
        body = {"num_frames": 5, "steps": 1, "guidance_scale": 4.0}
        wide, tall = png_bytes(picture(0, 160, 90)), png_bytes(picture(1, 30, 40))
        jobs = [c.videos.create(prompt="a fox", input_reference=("wide.png", wide, "image/png"),
                                extra_body={**body, "seed": 0}),
                c.videos.create(prompt="a fox", size="144x256", input_reference=("tall.png", tall, "image/png"),
                                extra_body={**body, "seed": 1})]
        assert [j.size for j in jobs] == ["256x144", "144x256"]  # known when the job is created
        videos, clips = vr.completed_clips(c, jobs)
        for v, mp4 in zip(videos, clips):
            info = video_io.probe_video(mp4)
            assert f"{info.width}x{info.height}" == v.size and (info.frames, info.fps) == (5, 24.0), (v, info)
        assert c.videos.retrieve(jobs[1].id).model_extra["image_sha256"] == pixel_sha256(picture(1, 30, 40))
        with pytest.raises(openai.BadRequestError) as e:
            c.videos.create(prompt="x", size="832x480", input_reference=("wide.png", wide, "image/png"),
                            extra_body=body)
        assert e.value.body["param"] == "size" and "comes out at 240x144" in e.value.body["message"], e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            c.videos.create(prompt="x", extra_body=body)
        assert e.value.body["param"] == "input_reference", e.value.body
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "64x48"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_needs_image", r.text
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "input images: every job needs input_reference, whose aspect sets the output size" in text, text
    assert "(POST /v1/videos)" in text, text
