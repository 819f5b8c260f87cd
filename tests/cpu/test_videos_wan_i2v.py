"""Wan image-to-video (diffusers ``WanImageToVideoPipeline``) in the runtime: the tiny
random-weight pipeline (``wan_configs.build_tiny_wan_i2v``: tiny-wan's parts, a tiny CLIP vision
encoder and a 36-channel I2V transformer; its videos are noise), the ``tiny-wan-i2v`` preset, the
pipeline table's ``image_kwarg`` row, input images (runtime/inputs.py: decoding, fingerprints,
the size an image implies), the mounted ``wan`` adapter bitwise against plain diffusers,
``ditfuse generate --image`` and ``/v1/videos`` with ``input_reference`` through the official
client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import wan
from ditfuse.models import wan_configs as wc
from ditfuse.runtime import video_io
from ditfuse.runtime.inputs import pixel_sha256, size_for_image
from ditfuse.runtime.params import ParamError, SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr
from tests.support.video_runtime import image_bytes as png_bytes
from tests.support.video_runtime import picture

from .test_videos_server import one_thread  # noqa: F401 - fixture

PRESET = "tiny-wan-i2v"
# 5 frames -> 2 latent frames; 64x48 px -> 8x6 latents -> a 2 x 4 x 3 patch grid: 24 video tokens
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"


def _call(pipe, seed: int = 3, image=None, **over) -> torch.Tensor:
    kw = dict(image=picture(0) if image is None else image, prompt=PROMPT, **SIZE, max_sequence_length=wc.TINY_WAN_TEXT_LEN)
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def i2v():
    return vr.quiet(wc.build_tiny_wan_i2v())


def test_builds_offline_deterministic_with_the_i2v_layout(i2v):
    from diffusers import WanImageToVideoPipeline

    assert type(i2v) is WanImageToVideoPipeline
    cfg = i2v.transformer.config
    z = i2v.vae.config.z_dim
    # Wan 2.1 I2V's input: noise, the first-frame mask (one channel per frame the VAE packs into a
    # latent frame) and the image's latents
    assert cfg.in_channels == z + i2v.vae_scale_factor_temporal + z and cfg.out_channels == z
    assert cfg.image_dim == i2v.image_encoder.config.hidden_size == wc.TINY_CLIP_WIDTH
    assert cfg.added_kv_proj_dim == cfg.num_attention_heads * cfg.attention_head_dim
    assert not i2v.config.expand_timesteps and i2v.config.boundary_ratio is None
    spec = PIPELINE_SPECS["WanImageToVideoPipeline"]
    assert (spec.size_multiple(i2v), spec.frame_multiple(i2v)) == (16, 4) and spec.image_kwarg == "image"
    other = wc.build_tiny_wan_i2v()
    for name in ("transformer", "vae", "text_encoder", "image_encoder"):
        sd, sd2 = getattr(i2v, name).state_dict(), getattr(other, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"wan_i2v.{name}.{key} (second build)")
    # tiny-wan's parts are drawn first: the I2V build leaves their weights as tiny-wan's
    t2v = wc.build_tiny_wan()
    for key, t in t2v.text_encoder.state_dict().items():
        assert_bitwise_equal(i2v.text_encoder.state_dict()[key], t, f"text_encoder.{key}")


def test_the_image_conditions_the_clip(i2v):
    frames = _call(i2v)
    assert tuple(frames.shape) == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), frames.shape
    assert torch.equal(_call(i2v), frames), "the same image and seed gave another clip"
    assert not torch.equal(_call(i2v, image=picture(1)), frames), "the image changed nothing"


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call (the image through CLIP, the VAE
    encoder and the transformer's added k/v) is bitwise the plain pipeline's, and every op of the
    wan adapter reached the gate. The cross-attentions (image + text keys) stay diffusers'.

    The seed matters on CPU only: the gate's eager reference here is aten's *CPU* LayerNorm, whose
    statistics are summed in another order than the CUDA kernel the op reproduces. For about a
    third of seeds one element of Wan's fp32 norm1 then rounds to a bf16 1 ulp away (checked at
    seed 3: the kernel equals the CUDA-order simulation, tests/support/layernorm_sim.py, and CPU
    eager does not) and the gate falls back, as it should. Seed 4 is one where both orders agree
    at first sight; with every call verified (conftest verify_every_call) a later mismatch falls
    back too, which the CPU suite allows (support/engaged.assert_gate_clean)."""
    pipe = vr.quiet(wc.build_tiny_wan_i2v()).to(torch.bfloat16)

    def call(p):
        return _call(p, seed=4, image=picture(4))

    tr = vr.assert_accelerated_bitwise(pipe, call, wan.ADAPTER, no_skipped_sites=False)
    n = pipe.transformer.config.num_layers
    assert sorted(path for path, _ in tr.skipped_sites) == [f"blocks.{i}.attn2" for i in range(n)], tr.skipped_sites


# -- input images ----------------------------------------------------------------------------------

@pytest.mark.parametrize("w,h,want", [
    (160, 90, (832, 464)),   # 16:9 at 832x480's area
    (90, 160, (464, 832)),
    (832, 480, (832, 480)),  # the default's own aspect
    (1, 1, (624, 624)),      # square
    (4000, 10, (2048, 32)),  # extreme: the long side clamped to the most a request may name
])
def test_size_for_image_keeps_the_area_and_the_aspect(w, h, want):
    assert size_for_image(w, h, (832, 480), 16) == want


def test_decode_and_fingerprint():
    from ditfuse.runtime.inputs import data_url_bytes, decode_image

    img = picture(2)
    rgba = img.convert("RGBA")
    # one fingerprint for the pixels whatever the file: PNG, lossless WebP, RGBA with its alpha dropped
    for data in (png_bytes(img), png_bytes(img, "WEBP", lossless=True), png_bytes(rgba)):
        got = decode_image(data)
        assert got.mode == "RGB" and pixel_sha256(got) == pixel_sha256(img)
    assert pixel_sha256(picture(3)) != pixel_sha256(img)
    assert pixel_sha256(picture(2, 30, 40)) != pixel_sha256(picture(2, 40, 30))
    gray = decode_image(png_bytes(picture(4, mode="L")))
    assert gray.mode == "RGB" and gray.size == (40, 30)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    assert data_url_bytes(url) == png_bytes(img)
    for bad, needle in [(b"", "empty"), (b"\x89PNG not really", "not an image"),
                        ("http://example.com/a.png", "does not fetch"), ("data:image/png,abc", "base64 data URL"),
                        ("data:image/png;base64,@@@", "not valid base64")]:
        with pytest.raises(ParamError) as e:
            decode_image(bad) if isinstance(bad, bytes) else data_url_bytes(bad)
        assert e.value.param == "input_reference" and needle in str(e.value), str(e.value)


def test_a_huge_image_is_refused_before_it_is_decoded(monkeypatch):
    from ditfuse.runtime import inputs

    monkeypatch.setattr(inputs, "MAX_INPUT_PIXELS", 40 * 30 - 1)
    with pytest.raises(ParamError, match="at most 1199 pixels"):
        inputs.decode_image(png_bytes(picture(0)))
    monkeypatch.setattr(inputs, "MAX_INPUT_BYTES", 10)
    with pytest.raises(ParamError, match="at most 10 are accepted"):
        inputs.decode_image(png_bytes(picture(0)))


def test_open_image_notices_a_changed_file(tmp_path):
    from ditfuse.runtime.inputs import open_image, save_png

    path = tmp_path / "in.png"
    save_png(picture(0), path)
    assert pixel_sha256(open_image(path, pixel_sha256(picture(0)))) == pixel_sha256(picture(0))
    save_png(picture(1), path)
    with pytest.raises(ValueError, match="changed after the request"):
        open_image(path, pixel_sha256(picture(0)))
    with pytest.raises(ValueError, match="is gone"):
        open_image(tmp_path / "missing.png")


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model, video_models_hint

    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert is_video_model(PRESET) and p.spec == spec and spec.takes_image
    assert spec.name == "WanImageToVideoPipeline" == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    assert p.frame_multiple == spec.frame_multiple(pipe) == 4 and p.size_multiple == spec.size_multiple(pipe) == 16
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (16, 4, 17)
    assert (loaded.default_steps, loaded.default_guidance, loaded.default_size) == (8, 5.0, (832, 480))
    assert loaded.call_kwargs == {"max_sequence_length": 128}
    assert PRESET in video_models_hint() and "WanImageToVideoPipeline" in video_models_hint()


def _params(image_path, image, seed: int = 5, **kw) -> SamplingParams:
    return SamplingParams.create(PROMPT, size="64x48", num_inference_steps=2, guidance_scale=4.0, seed=seed,
                                 **kw).with_(num_frames=5, image=str(image_path), image_sha256=pixel_sha256(image))


def test_run_batch_matches_plain_diffusers(loaded, tmp_path):
    """The runtime's call is plain diffusers' with the request's image (read back from its file)
    and seed; a request on another image is another clip, and neither shares a batch signature."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.inputs import save_png
    from ditfuse.runtime.video_io import frames_to_uint8

    a, b = picture(0), picture(1)
    save_png(a, tmp_path / "a.png")
    save_png(b, tmp_path / "b.png")
    with torch.no_grad():
        plain = frames_to_uint8(_call(loaded.pipe, seed=5, image=a, guidance_scale=4.0)[0].numpy())
    pa, pb = _params(tmp_path / "a.png", a), _params(tmp_path / "b.png", b)
    clip = run_batch(loaded, [(pa, 0)])[0]
    assert clip.shape == (5, 48, 64, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, plain)
    assert not np.array_equal(run_batch(loaded, [(pb, 0)])[0], clip)
    assert pa.signature(PRESET) != pb.signature(PRESET)
    assert pa.with_(image=str(tmp_path / "copy.png")).signature(PRESET) == pa.signature(PRESET)  # pixels, not paths
    assert pa.metadata(0)["image_sha256"] == pixel_sha256(a)
    # no image, or an image the text-only pipeline cannot take: refused before anything runs
    with pytest.raises(ValueError, match="generates from an image"):
        run_batch(loaded, [(pa.with_(image=None, image_sha256=None), 0)])


def test_a_batch_of_two_on_one_image(loaded, tmp_path):
    """Two seeds on one image run as one call (diffusers repeats the image's CLIP tokens and
    latents over the batch): each video is its own seed's, within one uint8 level of the request
    run alone (the batched matmuls may round differently)."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.inputs import save_png

    a = picture(0)
    save_png(a, tmp_path / "a.png")
    ps = [_params(tmp_path / "a.png", a, seed=i) for i in range(2)]
    clips = run_batch(loaded, [(p, 0) for p in ps])
    assert [c.shape for c in clips] == [(5, 48, 64, 3)] * 2 and not np.array_equal(clips[0], clips[1])
    for p, clip in zip(ps, clips):
        alone = run_batch(loaded, [(p, 0)])[0]
        assert np.abs(clip.astype(int) - alone.astype(int)).max() <= 1, p.seed


def test_video_requests_need_an_image_and_take_its_aspect(loaded):
    from ditfuse.runtime.videos import parse_video_request

    engine = vr.video_engine(loaded, PRESET)
    vr.assert_request_refused(loaded, PRESET, {}, "input_reference", "generates from an image")
    vr.assert_request_refused(loaded, PRESET, {"input_reference": {"file_id": "file_1"}}, "input_reference",
                              "no files API")
    vr.assert_request_refused(loaded, PRESET, {"input_reference": {"image_url": "https://x/y.png"}},
                              "input_reference", "does not fetch")
    img = picture(0, 160, 90)
    params, seconds = parse_video_request({"prompt": "a fox", "input_reference": png_bytes(img)}, engine)
    assert (params.width, params.height, params.num_frames, seconds) == (832, 464, 17, "1")
    assert params.image is None and params.image_sha256 == pixel_sha256(img)
    assert pixel_sha256(params.extra["input_image"]) == params.image_sha256
    url = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    params2, _ = parse_video_request({"prompt": "a fox", "size": "64x48", "input_reference": {"image_url": url}},
                                     engine)
    assert (params2.width, params2.height, params2.image_sha256) == (64, 48, params.image_sha256)


def test_text_to_video_models_refuse_an_image(tiny_cache):
    from ditfuse.runtime.presets import load_model

    t2v = load_model("tiny-wan", device="cpu")
    vr.assert_request_refused(t2v, "tiny-wan", {"input_reference": png_bytes(picture(0))}, "input_reference",
                              "takes no input image")


def test_default_body_limit_has_room_for_an_image(loaded, tiny_cache):
    from types import SimpleNamespace

    from ditfuse.runtime.inputs import MAX_INPUT_BYTES
    from ditfuse.runtime.presets import load_model
    from ditfuse.runtime.server import DEFAULT_MAX_BODY_BYTES, default_max_body_bytes

    # base64 of the largest image, on top of the usual limit
    assert default_max_body_bytes(SimpleNamespace(loaded=loaded)) == DEFAULT_MAX_BODY_BYTES + MAX_INPUT_BYTES * 4 // 3
    t2v = load_model("tiny-wan", device="cpu")
    assert default_max_body_bytes(SimpleNamespace(loaded=t2v)) == DEFAULT_MAX_BODY_BYTES


def test_startup_keeps_the_inputs_of_jobs_and_removes_the_rest(loaded, tmp_path):
    """A restart: the queued job's input image is kept and re-queued with it; a finished job's
    stays until the job is deleted; an input without a row and a half-written one are removed."""
    import asyncio
    import json
    from types import SimpleNamespace

    from ditfuse.runtime.inputs import save_png
    from ditfuse.runtime.jobs import params_json
    from ditfuse.runtime.videos import VideoJobs

    queued = []

    class Engine:  # what VideoJobs needs of an engine to recover and re-queue
        model_name = PRESET
        loaded = SimpleNamespace(is_video=True, fps=16)

        def enqueue(self, params, timeout_s=None, on_progress=None):
            queued.append(params)
            return SimpleNamespace()

        async def wait(self, req):
            await asyncio.sleep(3600)

    jobs = VideoJobs(Engine(), tmp_path, sweep_interval_s=0)
    store = jobs.open()
    a = picture(0)
    for job_id, status in (("video_q", "queued"), ("video_done", "failed")):
        save_png(a, jobs.inputs_dir / f"{job_id}.png")
        p = _params(jobs.inputs_dir / f"{job_id}.png", a)
        store.insert({"id": job_id, "model": PRESET, "status": status, "progress": 0, "created_at": 1,
                      "prompt": PROMPT, "size": p.size, "seconds": "0.25", "quality": "lossless",
                      "params": params_json(p)})
    save_png(a, jobs.inputs_dir / "video_gone.png")
    (jobs.inputs_dir / ".video_x.png.tmp").write_bytes(b"half")

    async def start_and_close():
        await jobs.start()
        row = jobs.store.get("video_q")
        for live in jobs._live.values():
            live.task.cancel()
        jobs._live.clear()
        await jobs.close()
        return row

    row = asyncio.run(start_and_close())
    assert sorted(f.name for f in jobs.inputs_dir.iterdir()) == ["video_done.png", "video_q.png"]
    assert [p.image for p in queued] == [str(jobs.inputs_dir / "video_q.png")]
    assert queued[0].image_sha256 == pixel_sha256(a) and row["status"] == "queued"
    assert json.loads(row["params"])["image_sha256"] == pixel_sha256(a)


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_an_i2v_clip(tiny_cache, tmp_path):
    picture(0, 160, 90).save(tmp_path / "start.png")
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--image", str(tmp_path / "start.png"), "--frames", "5",
                                "--steps", "2", "--guidance", "4", "--seed", "3"])
    # no --size: the image's 16:9 at 832x480's area
    assert (info.frames, info.width, info.height, info.fps) == (5, 832, 464, 16.0)
    vr.assert_generate_report(r, "WanImageToVideoPipeline", guidance="4", fps=16)
    assert f"pixels sha256 {pixel_sha256(picture(0, 160, 90))}" in r.stdout


@pytest.mark.parametrize("preset,args,needle", [
    (PRESET, [], "generates from an image"),
    (PRESET, ["--image", "/nonexistent/start.png"], "No such file"),
    ("tiny-wan", ["--image", __file__], "takes no input image"),
])
def test_generate_refuses_without_the_right_image(tiny_cache, tmp_path, preset, args, needle):
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    data_dir = tmp_path_factory.mktemp("wan-i2v-data")
    with vr.serve_preset(PRESET, data_dir) as served:
        served.data_dir = data_dir
        yield served


@pytest.mark.slow  # a live server, four jobs
def test_videos_api_with_input_reference(served):
    """Through the official openai client: jobs on one uploaded image share a batch, a job on
    another image runs in its own; a JSON body carries the image as a data URL; each job keeps
    its input until it is deleted; the images endpoint says where image-to-video lives."""
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=vr.KEY, timeout=300, max_retries=0)
    body = {"num_frames": 5, "steps": 2, "guidance_scale": 4.0}
    a, b = png_bytes(picture(0)), png_bytes(picture(1))
    jobs = [c.videos.create(prompt=f"a fox {i}", size="64x48", input_reference=("start.png", img, "image/png"),
                            extra_body={**body, "seed": i}) for i, img in enumerate((a, a, b))]
    _, done = vr.completed_clips(c, jobs)
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height) == (5, 64, 48) for i in infos), infos
    assert len(set(done)) == 3
    sizes = sorted(entry["size"] for entry in served.engine.batch_log)
    assert sizes == [1, 2], served.engine.batch_log  # the two on image a together, b alone
    raw = c.videos.retrieve(jobs[0].id).model_extra
    assert raw["image_sha256"] == pixel_sha256(picture(0))
    # JSON with a data URL, and no size: the image's aspect at the preset's area
    url = "data:image/png;base64," + base64.b64encode(png_bytes(picture(2, 40, 40))).decode()
    r = httpx.post(f"{served.url}/v1/videos", headers={"Authorization": f"Bearer {vr.KEY}"},
                   json={"prompt": "json", "input_reference": {"image_url": url}, "steps": 1, "num_frames": 1,
                         "size": "32x32"})
    assert r.status_code == 200, r.text
    v = vr.wait_done(c, r.json()["id"])
    assert v.status == "completed" and v.size == "32x32", v
    # missing image: a 400 naming input_reference
    with pytest.raises(openai.BadRequestError) as e:
        c.videos.create(prompt="x", size="64x48", extra_body=body)
    assert e.value.body["param"] == "input_reference" and "generates from an image" in e.value.body["message"]
    # deleting a job removes its input image
    files = served.data_dir / "inputs"
    assert (files / f"{jobs[2].id}.png").is_file()
    c.videos.delete(jobs[2].id)
    assert not (files / f"{jobs[2].id}.png").exists() and (files / f"{jobs[0].id}.png").is_file()
    r = httpx.post(f"{served.url}/v1/images/generations", headers={"Authorization": f"Bearer {vr.KEY}"},
                   json={"prompt": "x", "size": "32x32"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_needs_image", r.text
