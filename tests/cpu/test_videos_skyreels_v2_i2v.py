"""SkyReels-V2 image-to-video (diffusers ``SkyReelsV2ImageToVideoPipeline``) in the runtime: the
tiny random-weight pipeline (``wan_variants_configs.build_tiny_i2v_pipeline``: tiny-skyreels-v2's
parts and weights, tiny-wan-i2v's CLIP vision encoder and a 36-channel I2V
``SkyReelsV2Transformer3DModel``; its videos are noise), the ``tiny-skyreels-v2-i2v`` preset, the
pipeline table's row (one image per call, CFG whenever guidance is above 1, sides in 16s, ``4k + 1``
frames, 24 fps), the mounted ``skyreels_v2`` adapter bitwise against plain diffusers,
``ditfuse generate --image`` and ``/v1/videos`` with ``input_reference`` through the official
client against a ``ditfuse serve`` process. What input images share with Wan image-to-video (decoding, fingerprints, storage) is
tested in test_videos_wan_i2v.py."""

from __future__ import annotations

import base64
import subprocess

import httpx
import numpy as np
import openai
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import wan_configs as wc
from ditfuse.models import wan_variants
from ditfuse.models import wan_variants_configs as wv
from ditfuse.runtime import video_io
from ditfuse.runtime.inputs import pixel_sha256, size_for_image
from ditfuse.runtime.params import SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr
from tests.support.video_runtime import image_bytes, picture

PRESET = "tiny-skyreels-v2-i2v"
PIPELINE = "SkyReelsV2ImageToVideoPipeline"
# 5 frames -> 2 latent frames; 64x48 px -> 8x6 latents -> a 2 x 4 x 3 patch grid: 24 video tokens
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"
NEGATIVE = "blurry"


def _call(pipe, seed: int = 3, image=None, **over) -> torch.Tensor:
    kw = dict(image=picture(0) if image is None else image, prompt=PROMPT, negative_prompt=NEGATIVE, **SIZE,
              **wv.TINY_CALL_KWARGS)
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def sky():
    return vr.quiet(wv.build_tiny_i2v_pipeline())


def test_builds_offline_with_the_i2v_layout_and_the_t2v_weights(sky):
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Transformer3DModel

    assert type(sky) is SkyReelsV2ImageToVideoPipeline and type(sky.transformer) is SkyReelsV2Transformer3DModel
    cfg = sky.transformer.config
    z = sky.vae.config.z_dim
    # the I2V input: noise, the first-frame mask (one channel per frame the VAE packs into a latent
    # frame) and the image's latents; the image's CLIP tokens through the added k/v
    assert cfg.in_channels == z + sky.vae_scale_factor_temporal + z and cfg.out_channels == z
    assert cfg.image_dim == sky.image_encoder.config.hidden_size == wc.TINY_CLIP_WIDTH
    assert cfg.added_kv_proj_dim == cfg.num_attention_heads * cfg.attention_head_dim
    # as diffusers' SkyReels-V2-I2V conversion: no fps embedding (the I2V call passes no fps), no
    # causal blocks, no first-last-frame position embedding
    assert not cfg.inject_sample_info and cfg.num_frame_per_block == 1 and cfg.pos_embed_seq_len is None
    spec = PIPELINE_SPECS[PIPELINE]
    assert (spec.size_multiple(sky), spec.frame_multiple(sky)) == (16, 4) and spec.image_kwarg == "image"
    assert not spec.image_per_sample  # one image per call: batches only on the same image
    # tiny-wan-i2v's CLIP encoder and image processor (the same builder: wc.tiny_clip_image_parts)
    wan_i2v = wc.build_tiny_wan_i2v()
    assert sky.image_encoder.config.to_dict() == wan_i2v.image_encoder.config.to_dict()
    assert sky.image_processor.to_dict() == wan_i2v.image_processor.to_dict()
    # the scheduler: text-to-video's at the I2V flow shift (diffusers' I2V example: 5.0, T2V 8.0)
    t2v = wv.build_tiny_pipeline()
    assert sky.scheduler.config.flow_shift == wv.SKYREELS_I2V_FLOW_SHIFT == 5.0
    assert {**t2v.scheduler.config, "flow_shift": 5.0} == dict(sky.scheduler.config)
    # tiny-skyreels-v2's weights wherever the layouts agree: text encoder, VAE and every
    # transformer tensor of the same name and shape; the I2V additions are their own
    for name in ("text_encoder", "vae"):
        for key, t in getattr(t2v, name).state_dict().items():
            assert_bitwise_equal(getattr(sky, name).state_dict()[key], t, f"{name}.{key} (tiny-skyreels-v2's)")
    sd, sd_t2v = sky.transformer.state_dict(), t2v.transformer.state_dict()
    own = sorted(k for k in sd if k not in sd_t2v or sd[k].shape != sd_t2v[k].shape)
    assert set(sd_t2v) <= set(sd)
    i2v_only = ("condition_embedder.image_embedder.", ".attn2.add_k_proj.", ".attn2.add_v_proj.",
                ".attn2.norm_added_k.")
    assert own == sorted(["patch_embedding.weight", *(k for k in sd if any(s in k for s in i2v_only))]), own
    for key, t in sd_t2v.items():
        if key not in own:
            assert_bitwise_equal(sd[key], t, f"transformer.{key} (tiny-skyreels-v2's)")
    # deterministic: a second build is the same pipeline
    other = wv.build_tiny_i2v_pipeline()
    for name in ("transformer", "vae", "text_encoder", "image_encoder"):
        sd, sd2 = getattr(sky, name).state_dict(), getattr(other, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"skyreels_v2_i2v.{name}.{key} (second build)")


def test_the_image_conditions_the_clip(sky):
    frames = _call(sky)
    assert tuple(frames.shape) == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    assert not torch.equal(_call(sky, image=picture(1)), frames), "the image changed nothing"
    assert not torch.equal(_call(sky, negative_prompt="sharp"), frames), "the negative prompt changed nothing"


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call (the image through CLIP, the VAE
    encoder and the transformer's added k/v) is bitwise the plain pipeline's, and every op of the
    skyreels_v2 adapter reached the gate. The attention site leaves exactly the cross-attentions
    (image + text keys) on diffusers' forward: their QK norms have no RoPE after them. The VAE took
    ``autoencoder_kl_wan``, and its RMS_norm + SiLU op reached the gate (the conditioning image's
    encode and the decode run on the mounted VAE, so the output covers both; its channels-last
    decode ops need CUDA)."""
    import ditfuse
    from ditfuse.models import autoencoder_kl_wan

    pipe = vr.quiet(wv.build_tiny_i2v_pipeline()).to(torch.bfloat16)
    tr = vr.assert_accelerated_bitwise(pipe, _call, wan_variants.SKYREELS_V2_ADAPTER, no_skipped_sites=False)
    n = pipe.transformer.config.num_layers
    assert sorted(path for path, _ in tr.skipped_sites) == [f"blocks.{i}.attn2" for i in range(n)], tr.skipped_sites
    assert all("cross-attention" in why for _, why in tr.skipped_sites), tr.skipped_sites
    vae_op = "norm.wan_rms_norm_silu"
    assert vae_op in autoencoder_kl_wan.ADAPTER.ops()
    assert ditfuse.gate.report().calls.get(vae_op, {}).get("verify", 0) > 0, ditfuse.gate.report().calls


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model, video_models_hint

    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert is_video_model(PRESET) and p.spec == spec and spec.takes_image
    assert spec.name == PIPELINE == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    # tiny-skyreels-v2's preset with another builder and pipeline class
    parent = PRESET_TABLE["tiny-skyreels-v2"]
    assert (p.default_size, p.size_multiple, p.fps, p.frame_multiple, p.default_frames, p.default_steps) == (
        parent.default_size, parent.size_multiple, parent.fps, parent.frame_multiple, parent.default_frames,
        parent.default_steps)
    assert p.frame_multiple == spec.frame_multiple(pipe) == 4 and p.size_multiple == spec.size_multiple(pipe) == 16
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
    # the I2V call's own guidance default (5.0; text-to-video's is 6.0)
    assert (loaded.default_steps, loaded.default_guidance, loaded.default_size) == (8, 5.0, (480, 272))
    assert spec.fps_kwarg is None and not spec.takes_true_cfg and spec.prepare is None
    assert loaded.call_kwargs == {"max_sequence_length": 128}
    assert PRESET in video_models_hint() and PIPELINE in video_models_hint()


def _params(image_path, image, seed: int = 5, prompt: str = PROMPT, **kw) -> SamplingParams:
    return SamplingParams.create(prompt, size="64x48", num_inference_steps=2, guidance_scale=4.0, seed=seed,
                                 **kw).with_(num_frames=5, image=str(image_path), image_sha256=pixel_sha256(image))


def test_run_batch_is_diffusers_own_call(loaded, tmp_path):
    """Two requests on one image run as one call of the pipeline, which is exactly diffusers' own
    call with their prompts, negative prompts and seeds and the image read back from its file; a
    request on another image has another batch signature and makes another clip."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.inputs import save_png
    from ditfuse.runtime.video_io import frames_to_uint8

    a, b = picture(0), picture(1)
    save_png(a, tmp_path / "a.png")
    save_png(b, tmp_path / "b.png")
    pa = [_params(tmp_path / "a.png", a, seed=5 + i, prompt=f"a fox {i}", negative_prompt=NEGATIVE)
          for i in range(2)]
    clips = run_batch(loaded, [(p, 0) for p in pa])
    with torch.no_grad():
        plain = _call(loaded.pipe, image=a, prompt=[p.prompt for p in pa], negative_prompt=[NEGATIVE] * 2,
                      guidance_scale=4.0, generator=[torch.Generator().manual_seed(p.seed) for p in pa])
    assert [c.shape for c in clips] == [(5, 48, 64, 3)] * 2 and clips[0].dtype == np.uint8
    for clip, want in zip(clips, plain):
        np.testing.assert_array_equal(clip, frames_to_uint8(want.numpy()))
    assert not np.array_equal(clips[0], clips[1])
    pb = _params(tmp_path / "b.png", b, seed=5, prompt="a fox 0", negative_prompt=NEGATIVE)
    assert pb.signature(PRESET) != pa[0].signature(PRESET) == pa[1].signature(PRESET)
    assert not np.array_equal(run_batch(loaded, [(pb, 0)])[0], clips[0])
    with pytest.raises(ValueError, match="generates from an image"):
        run_batch(loaded, [(pa[0].with_(image=None, image_sha256=None), 0)])


def test_video_requests_take_the_image_aspect_and_the_skyreels_rules(loaded):
    from ditfuse.runtime.videos import parse_video_request

    engine = vr.video_engine(loaded, PRESET)
    img = picture(0, 160, 90)
    params, seconds = parse_video_request({"prompt": "a fox", "input_reference": image_bytes(img)}, engine)
    # no size: the image's 16:9 at the preset's 480x272 area, in 16s; 17 frames at 24 fps
    assert (params.width, params.height) == size_for_image(160, 90, (480, 272), 16) == (480, 256)
    assert (params.num_frames, seconds, params.guidance_scale) == (17, "0.666667", 5.0)
    assert params.image_sha256 == pixel_sha256(img)
    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1", "size": "64x48",
                                           "input_reference": image_bytes(img)}, engine)
    assert (params.width, params.height, params.num_frames, seconds) == (64, 48, 25, "1")
    url = "data:image/png;base64," + base64.b64encode(image_bytes(img)).decode()
    params, _ = parse_video_request({"prompt": "a fox", "input_reference": {"image_url": url}}, engine)
    assert params.image_sha256 == pixel_sha256(img)


@pytest.mark.parametrize("fields,param,needle", [
    ({}, "input_reference", "generates from an image"),
    ({"num_frames": 6}, "num_frames", "4k+1"),
    ({"size": "72x48"}, "size", "16"),
    ({"true_cfg_scale": 3}, "true_cfg_scale", PIPELINE),
])
def test_video_requests_refused(loaded, fields, param, needle):
    with_image = {} if param == "input_reference" else {"input_reference": image_bytes(picture(0))}
    vr.assert_request_refused(loaded, PRESET, {**with_image, **fields}, param, needle)


def test_text_to_video_skyreels_refuses_an_image(tiny_cache):
    from ditfuse.runtime.presets import load_model

    t2v = load_model("tiny-skyreels-v2", device="cpu")
    vr.assert_request_refused(t2v, "tiny-skyreels-v2", {"input_reference": image_bytes(picture(0))},
                              "input_reference", "takes no input image")


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_an_i2v_clip(tiny_cache, tmp_path):
    picture(0, 160, 90).save(tmp_path / "start.png")
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--image", str(tmp_path / "start.png"), "--frames", "5",
                                "--steps", "2", "--guidance", "4", "--negative-prompt", NEGATIVE, "--seed", "3"])
    # no --size: the image's 16:9 at 480x272's area
    assert (info.frames, info.width, info.height, info.fps) == (5, 480, 256, 24.0)
    vr.assert_generate_report(r, PIPELINE, guidance="4", fps=24)
    assert f"pixels sha256 {pixel_sha256(picture(0, 160, 90))}" in r.stdout


@pytest.mark.parametrize("preset,args,needle", [
    (PRESET, [], "generates from an image"),
    ("tiny-skyreels-v2", ["--image", __file__], "takes no input image"),
])
def test_generate_refuses_without_the_right_image(tiny_cache, tmp_path, preset, args, needle):
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, args, needle)


def _metric(text: str, name: str) -> float:
    """A sample's value in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.slow  # a `ditfuse serve` subprocess, four jobs
def test_serve_videos_with_input_reference(tiny_cache, tmp_path):
    """`ditfuse serve --model tiny-skyreels-v2-i2v` through the official openai client: jobs on one
    uploaded image share a batch and a job on another image runs in its own (ditfuse_batch_size
    counts); each clip is the job's size at 24 fps; a JSON body carries the image as a data URL and,
    with no size, gets the image's aspect at the preset's area; a job without an image is a 400
    naming input_reference; the images route says where image-to-video lives; the startup lines say
    every job needs an image."""
    from tests.cpu.test_videos_server import EXE, _env, free_port
    from tests.support.serve_process import wait_healthy

    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        # 300 ms to gather a batch: the two jobs on one image, created back to back, share one
        proc = subprocess.Popen([EXE, "serve", "--model", PRESET, "--port", str(port), "--data-dir",
                                 str(tmp_path / "data"), "--max-video-batch-size", "2", "--batch-wait-ms", "300"],
                                env=_env(tiny_cache), stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120, output=log.read_text)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=300, max_retries=0)
        body = {"num_frames": 5, "steps": 2, "guidance_scale": 4.0, "negative_prompt": NEGATIVE}
        a, b = image_bytes(picture(0)), image_bytes(picture(1))
        jobs = [c.videos.create(prompt=f"a fox {i}", size="64x48", input_reference=("start.png", img, "image/png"),
                                extra_body={**body, "seed": i}) for i, img in enumerate((a, a, b))]
        videos, done = vr.completed_clips(c, jobs)
        infos = [video_io.probe_video(mp4) for mp4 in done]
        assert all((i.frames, i.width, i.height, i.fps) == (5, 64, 48, 24.0) for i in infos), infos
        assert all(v.seconds == "0.166667" for v in videos), videos  # (5 - 1) / 24
        assert len(set(done)) == 3
        metrics = httpx.get(f"{url}/metrics").text
        # the two on image a together, b alone
        assert [_metric(metrics, f'ditfuse_batch_size_total{{size="{n}"}}') for n in (1, 2)] == [1, 1], metrics
        assert c.videos.retrieve(jobs[2].id).model_extra["image_sha256"] == pixel_sha256(picture(1))
        wide = picture(2, 160, 90)
        url_body = "data:image/png;base64," + base64.b64encode(image_bytes(wide)).decode()
        r = httpx.post(f"{url}/v1/videos", json={"prompt": "json", "input_reference": {"image_url": url_body},
                                                 "steps": 1, "num_frames": 1})
        assert r.status_code == 200 and r.json()["size"] == "480x256", r.text  # 16:9 at 480x272's area
        v = vr.wait_done(c, r.json()["id"])
        assert v.status == "completed" and v.model_extra["image_sha256"] == pixel_sha256(wide), v
        with pytest.raises(openai.BadRequestError) as e:
            c.videos.create(prompt="x", size="64x48", extra_body=body)
        assert e.value.body["param"] == "input_reference" and "generates from an image" in e.value.body["message"]
        r = httpx.post(f"{url}/v1/images/generations", json={"prompt": "x", "size": "64x48"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_needs_image", r.text
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "input images: every job needs input_reference (up to" in text, text
