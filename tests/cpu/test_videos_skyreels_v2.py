"""SkyReels-V2 text-to-video (diffusers ``SkyReelsV2Pipeline``) in the runtime: the tiny
random-weight pipeline (``wan_variants_configs.build_tiny_pipeline``: tiny-wan's UMT5, tokenizer,
VAE and UniPC around a tiny ``SkyReelsV2Transformer3DModel``; its videos are noise), the
``tiny-skyreels-v2`` preset, the pipeline table's row (CFG with a negative prompt whenever
guidance is above 1, sides in 16s, ``4k + 1`` frames, 24 fps, no frame-rate argument), the
mounted ``skyreels_v2`` adapter bitwise against plain diffusers, ``ditfuse generate`` and
``/v1/videos`` through the official client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import wan_variants
from ditfuse.models import wan_variants_configs as wv
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr

from .test_videos_server import one_thread  # noqa: F401 - fixture

PRESET = "tiny-skyreels-v2"
# 5 frames -> 2 latent frames; 64x48 px -> 8x6 latents -> a 2 x 4 x 3 patch grid: 24 video tokens
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"
NEGATIVE = "blurry"


def _call(pipe, seed: int = 3, **over) -> torch.Tensor:
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE, **SIZE, **wv.TINY_CALL_KWARGS)
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def sky():
    return vr.quiet(wv.build_tiny_pipeline())


def test_builds_offline_deterministic_with_the_real_compression(sky):
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    assert type(sky) is SkyReelsV2Pipeline and type(sky.transformer) is SkyReelsV2Transformer3DModel
    # what the pipeline reads for its latent grid, and the runtime for sizes and frame counts
    assert (sky.vae_scale_factor_spatial, sky.vae_scale_factor_temporal) == (8, 4)
    cfg = sky.transformer.config
    assert cfg.in_channels == cfg.out_channels == sky.vae.config.z_dim
    assert sky.text_encoder.config.d_model == cfg.text_dim
    # text-to-video: no causal blocks (diffusion forcing), no fps embedding, no image embeddings
    assert cfg.num_frame_per_block == 1 and not cfg.inject_sample_info and cfg.image_dim is None
    assert sky.scheduler.config.flow_shift == wv.SKYREELS_T2V_FLOW_SHIFT == 8.0
    spec = PIPELINE_SPECS["SkyReelsV2Pipeline"]
    assert (spec.size_multiple(sky), spec.frame_multiple(sky)) == (16, 4)
    other = wv.build_tiny_pipeline()
    for name in ("transformer", "vae", "text_encoder"):
        sd, sd2 = getattr(sky, name).state_dict(), getattr(other, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"skyreels_v2.{name}.{key} (second build)")
    params = sum(p.numel() for n in ("transformer", "vae", "text_encoder") for p in getattr(sky, n).parameters())
    assert params < 300_000, params


def test_two_step_call_makes_frames_of_the_size(sky):
    frames = _call(sky)
    assert tuple(frames.shape) == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    # CFG runs at the default guidance (6 > 1) against the negative prompt; at guidance 1 it is
    # off and the negative prompt is never encoded
    assert not torch.equal(_call(sky, guidance_scale=3.0), frames), "guidance_scale changed nothing"
    assert not torch.equal(_call(sky, negative_prompt="sharp"), frames), "the negative prompt changed nothing"
    no_cfg = _call(sky, guidance_scale=1.0)
    assert torch.equal(_call(sky, guidance_scale=1.0, negative_prompt="sharp"), no_cfg), "negative prompt without CFG"


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16 (the dtype the kernels are made for), a 2-step CFG call
    is bitwise the plain pipeline's, and every op of the skyreels_v2 adapter reached the gate. The
    attention site leaves exactly the cross-attentions on diffusers' forward (their QK norms have no
    RoPE after them: nothing to fuse)."""
    pipe = vr.quiet(wv.build_tiny_pipeline()).to(torch.bfloat16)
    tr = vr.assert_accelerated_bitwise(pipe, _call, wan_variants.SKYREELS_V2_ADAPTER, no_skipped_sites=False)
    n = wv.SKYREELS_TINY_PIPELINE["num_layers"]
    assert sorted(path for path, _ in tr.skipped_sites) == [f"blocks.{i}.attn2" for i in range(n)], tr.skipped_sites
    assert all("cross-attention" in why for _, why in tr.skipped_sites), tr.skipped_sites


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model

    p, spec, pipe = PRESET_TABLE[PRESET], loaded.spec, loaded.pipe
    assert is_video_model(PRESET) and p.spec == spec
    assert spec.name == "SkyReelsV2Pipeline" == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    # what the preset states without loading is what the table reads off the loaded pipeline
    assert p.frame_multiple == spec.frame_multiple(pipe) == 4 and p.size_multiple == spec.size_multiple(pipe) == 16
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
    assert (loaded.default_steps, loaded.default_guidance, loaded.default_size) == (8, 6.0, (480, 272))
    assert spec.fps_kwarg is None and not spec.takes_true_cfg and spec.prepare is None
    assert loaded.call_kwargs == {"max_sequence_length": 128}


def test_run_batch_matches_plain_diffusers(loaded):
    """The runtime's call of the pipeline is plain diffusers' with the same seed, with and without
    a negative prompt (without one, diffusers' own "" is the unconditional prompt)."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.params import SamplingParams
    from ditfuse.runtime.video_io import frames_to_uint8

    def params(**kw):
        return SamplingParams.create(PROMPT, size="64x48", num_inference_steps=2, guidance_scale=4.0, seed=5,
                                     **kw).with_(num_frames=5)

    def plain(**kw) -> np.ndarray:
        with torch.no_grad():
            out = _call(loaded.pipe, seed=5, guidance_scale=4.0, **kw)
        return frames_to_uint8(out[0].numpy())

    clip = run_batch(loaded, [(params(negative_prompt=NEGATIVE), 0)])[0]
    assert clip.shape == (5, 48, 64, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, plain())
    bare = run_batch(loaded, [(params(), 0)])[0]
    np.testing.assert_array_equal(bare, plain(negative_prompt=None))
    assert not np.array_equal(bare, clip)


def test_a_batch_of_two_decodes_without_a_prepare_hook(loaded):
    """diffusers 0.42.1's AutoencoderKLWan decodes two videos at once: the table's row needs no
    prepare hook; each video of the batch is its own seed's (within one uint8 level of the same
    request run alone: the batched matmuls may round differently)."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.params import SamplingParams

    assert PIPELINE_SPECS["SkyReelsV2Pipeline"].prepare is None
    ps = [SamplingParams.create(f"a fox {i}", size="64x48", num_inference_steps=1, guidance_scale=6.0, seed=i)
          .with_(num_frames=9) for i in range(2)]
    clips = run_batch(loaded, [(p, 0) for p in ps])
    assert [c.shape for c in clips] == [(9, 48, 64, 3)] * 2 and not np.array_equal(clips[0], clips[1])
    for p, clip in zip(ps, clips):
        alone = run_batch(loaded, [(p, 0)])[0]
        assert np.abs(clip.astype(int) - alone.astype(int)).max() <= 1, p.prompt


@pytest.mark.parametrize("fields,param,needle", [
    ({"num_frames": 6}, "num_frames", "4k+1"),
    ({"size": "72x48"}, "size", "16"),
    ({"true_cfg_scale": 3}, "true_cfg_scale", "SkyReelsV2Pipeline"),
])
def test_video_requests_refused_by_the_skyreels_rules(loaded, fields, param, needle):
    vr.assert_request_refused(loaded, PRESET, fields, param, needle)


def test_video_request_defaults_and_seconds(loaded):
    from ditfuse.runtime.videos import parse_video_request

    engine = vr.video_engine(loaded, PRESET)
    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1"}, engine)
    assert params.num_frames == 25 and seconds == "1"  # 24 fps: 1 s is exactly 25 frames
    params, seconds = parse_video_request({"prompt": "a fox"}, engine)
    assert (params.num_frames, params.width, params.height, params.guidance_scale) == (17, 480, 272, 6.0)
    assert (params.num_inference_steps, seconds) == (8, "0.666667")


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_a_skyreels_clip(tiny_cache, tmp_path):
    r, info = vr.generate_clip(PRESET, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--frames", "5", "--size", "64x48", "--steps", "2",
                                "--guidance", "4", "--negative-prompt", NEGATIVE, "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (5, 64, 48, 24.0)
    vr.assert_generate_report(r, "SkyReelsV2Pipeline", guidance="4", fps=24)


@pytest.mark.parametrize("args,needle", [
    (["--frames", "6"], "4k+1"),
    (["--size", "72x48"], "16"),
])
def test_generate_refuses_what_skyreels_cannot_make(tiny_cache, tmp_path, args, needle):
    vr.assert_generate_refuses(PRESET, tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    with vr.serve_preset(PRESET, tmp_path_factory.mktemp("skyreels-data")) as served:
        yield served


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_two_jobs_share_a_batch(served):
    body = {"num_frames": 5, "steps": 2, "guidance_scale": 4.0, "negative_prompt": NEGATIVE}
    # seconds: (5 - 1) / 24
    vr.assert_two_jobs_share_a_batch(served, "64x48", body, frames=5, fps=24, seconds="0.166667", bad_frames=6,
                                     needle="4k+1")
