"""HunyuanVideo (1.0, diffusers ``HunyuanVideoPipeline``) in the runtime: the tiny random-weight
pipeline (``hunyuanvideo_configs.build_tiny_pipeline``; its videos are noise), the
``tiny-hunyuanvideo`` preset, the pipeline table's row (distilled ``guidance_scale`` always, true
CFG only with a negative prompt and ``true_cfg_scale`` > 1; sides in 16s, ``4k + 1`` frames,
24 fps), the mounted adapter bitwise against plain diffusers, ``ditfuse generate`` and
``/v1/videos`` through the official client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import hunyuanvideo as hy_adapter
from ditfuse.models import hunyuanvideo_configs as hc
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr

from .test_videos_server import one_thread  # noqa: F401 - fixture

# 5 frames -> 2 latent frames; 64x48 px -> 8x6 latents -> a 2 x 4 x 3 patch grid: 24 video tokens
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"
NEGATIVE = "blurry"


def _call(pipe, seed: int = 3, **over) -> torch.Tensor:
    kw = dict(prompt=PROMPT, **SIZE, **hc.TINY_CALL_KWARGS)
    return vr.frames(pipe, seed, **{**kw, **over})


@pytest.fixture(scope="module")
def hyv():
    return vr.quiet(hc.build_tiny_pipeline())


def test_builds_offline_deterministic_with_the_real_compression(hyv):
    from diffusers import HunyuanVideoPipeline

    assert type(hyv) is HunyuanVideoPipeline
    # what the pipeline reads for its latent grid, and the runtime for sizes and frame counts
    assert (hyv.vae_scale_factor_spatial, hyv.vae_scale_factor_temporal) == (8, 4)
    cfg = hyv.transformer.config
    assert cfg.in_channels == hyv.vae.config.latent_channels and cfg.guidance_embeds
    assert hyv.text_encoder.config.hidden_size == cfg.text_embed_dim
    assert hyv.text_encoder_2.config.hidden_size == cfg.pooled_projection_dim
    assert hyv.scheduler.config.shift == 7.0
    spec = PIPELINE_SPECS["HunyuanVideoPipeline"]
    assert (spec.size_multiple(hyv), spec.frame_multiple(hyv)) == (16, 4)
    other = hc.build_tiny_pipeline()
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        sd, sd2 = getattr(hyv, name).state_dict(), getattr(other, name).state_dict()
        assert list(sd) == list(sd2), name
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"hunyuanvideo.{name}.{key} (second build)")
    params = sum(p.numel() for n in ("transformer", "vae", "text_encoder", "text_encoder_2")
                 for p in getattr(hyv, n).parameters())
    assert params < 300_000, params


def test_the_template_crop_keeps_exactly_the_prompt(hyv):
    """With the tiny tokenizer's crop the Llama positions the transformer sees start at the prompt
    (and end with the template's closing <|eot_id|>); the template's own crop (95, the real
    tokenizer's count) would keep the system message instead."""
    kw = hc.TINY_CALL_KWARGS
    assert kw["prompt_template"]["crop_start"] == hc.TINY_CROP_START == hc.prompt_template_start(hyv.tokenizer)
    ids = hyv.tokenizer(kw["prompt_template"]["template"].format(PROMPT)).input_ids[hc.TINY_CROP_START:]
    assert hyv.tokenizer.decode(ids) == "a red fox<|eot_id|>", hyv.tokenizer.convert_ids_to_tokens(ids)
    embeds, mask = hyv._get_llama_prompt_embeds(PROMPT, kw["prompt_template"], max_sequence_length=hc.TINY_TEXT_LEN)
    assert embeds.shape == (1, hc.TINY_TEXT_LEN, 24) and mask.shape == (1, hc.TINY_TEXT_LEN)
    # right-padded: the prompt's tokens, then padding
    assert mask[0].tolist() == [1] * len(ids) + [0] * (hc.TINY_TEXT_LEN - len(ids))


def test_two_step_call_makes_frames_of_the_size(hyv):
    frames = _call(hyv)
    assert tuple(frames.shape) == (1, SIZE["num_frames"], SIZE["height"], SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    # the embedded guidance reaches the transformer; a negative prompt does only with true CFG
    assert not torch.equal(_call(hyv, guidance_scale=2.0), frames), "guidance_scale changed nothing"
    assert torch.equal(_call(hyv, negative_prompt=NEGATIVE), frames), "negative prompt used without true CFG"
    assert not torch.equal(_call(hyv, negative_prompt=NEGATIVE, true_cfg_scale=4.0), frames), "true CFG changed nothing"


@pytest.mark.slow  # the tiny pipeline's 2 steps x 2 passes through the Triton interpreter
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated():
    """Mounted on the tiny pipeline in bf16 (the dtype the kernels are made for), a 2-step true-CFG
    call is bitwise the plain pipeline's, and every op of the adapter reached the gate."""
    pipe = vr.quiet(hc.build_tiny_pipeline()).to(torch.bfloat16)
    # the token refiner's attention (AttnProcessor2_0) keeps diffusers' forward: a skipped site
    vr.assert_accelerated_bitwise(pipe, lambda p: _call(p, negative_prompt=NEGATIVE, true_cfg_scale=4.0),
                                  hy_adapter.ADAPTER, no_skipped_sites=False)


# -- the runtime: preset, pipeline table, run_batch --------------------------------------------------

@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model("tiny-hunyuanvideo", device="cpu")


def test_preset_agrees_with_the_loaded_pipeline(loaded):
    from ditfuse.runtime.presets import is_video_model

    p, spec, pipe = PRESET_TABLE["tiny-hunyuanvideo"], loaded.spec, loaded.pipe
    assert is_video_model("tiny-hunyuanvideo") and p.spec == spec
    assert spec.name == "HunyuanVideoPipeline" == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    # what the preset states without loading is what the table reads off the loaded pipeline
    assert p.frame_multiple == spec.frame_multiple(pipe) == 4 and p.size_multiple == spec.size_multiple(pipe) == 16
    assert (loaded.fps, loaded.frame_multiple, loaded.default_frames) == (24, 4, 17)
    assert (loaded.default_steps, loaded.default_guidance) == (8, 6.0)
    assert spec.fps_kwarg is None and spec.takes_true_cfg and spec.default_true_cfg == 1.0
    # the saved and reloaded tokenizer still makes the crop the call kwargs name
    assert hc.prompt_template_start(pipe.tokenizer) == loaded.call_kwargs["prompt_template"]["crop_start"]
    assert pipe.tokenizer.padding_side == "right"


def test_run_batch_matches_plain_diffusers(loaded):
    """The runtime's call of the pipeline is plain diffusers' with the same seed: the embedded
    guidance always, the negative prompt and true_cfg_scale only when true CFG is asked for."""
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

    clip = run_batch(loaded, [(params(), 0)])[0]
    assert clip.shape == (5, 48, 64, 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, plain())
    cfg_clip = run_batch(loaded, [(params(negative_prompt=NEGATIVE, true_cfg_scale=3.0), 0)])[0]
    np.testing.assert_array_equal(cfg_clip, plain(negative_prompt=NEGATIVE, true_cfg_scale=3.0))
    assert not np.array_equal(cfg_clip, clip)
    # (a negative prompt at true_cfg_scale 1 is not passed on: test_pipeline_specs, on a fake)


def test_a_batch_of_two_decodes_without_a_prepare_hook(loaded):
    """diffusers 0.42.1's AutoencoderKLHunyuanVideo decodes two videos at once (unlike 1.5's), at
    17 frames through its frame-wise tiled decode: the table's row needs no prepare hook."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.params import SamplingParams

    assert PIPELINE_SPECS["HunyuanVideoPipeline"].prepare is None
    ps = [SamplingParams.create(f"a fox {i}", size="64x48", num_inference_steps=1, guidance_scale=6.0, seed=i)
          .with_(num_frames=17) for i in range(2)]
    clips = run_batch(loaded, [(p, 0) for p in ps])
    assert [c.shape for c in clips] == [(17, 48, 64, 3)] * 2 and not np.array_equal(clips[0], clips[1])


def _video_engine(loaded):
    return vr.video_engine(loaded, "tiny-hunyuanvideo")


@pytest.mark.parametrize("fields,param,needle", [
    ({"num_frames": 6}, "num_frames", "4k+1"),
    ({"size": "72x48"}, "size", "16"),
    ({"true_cfg_scale": "x"}, "true_cfg_scale", "number"),
])
def test_video_requests_refused_by_the_hunyuanvideo_rules(loaded, fields, param, needle):
    vr.assert_request_refused(loaded, "tiny-hunyuanvideo", fields, param, needle)


def test_video_request_defaults_seconds_and_true_cfg(loaded):
    from ditfuse.runtime.videos import parse_video_request

    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1"}, _video_engine(loaded))
    assert params.num_frames == 25 and seconds == "1"  # 24 fps: 1 s is exactly 25 frames
    params, seconds = parse_video_request({"prompt": "a fox"}, _video_engine(loaded))
    assert (params.num_frames, params.width, params.height, params.guidance_scale) == (17, 256, 144, 6.0)
    assert params.true_cfg_scale == 1.0 and not params.uses_true_cfg and seconds == "0.666667"
    params, _ = parse_video_request({"prompt": "a fox", "negative_prompt": "blur", "true_cfg_scale": "3"},
                                    _video_engine(loaded))
    assert params.uses_true_cfg and params.true_cfg_scale == 3.0


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_a_hunyuanvideo_clip(tiny_cache, tmp_path):
    r, info = vr.generate_clip("tiny-hunyuanvideo", tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--frames", "5", "--size", "64x48", "--steps", "2",
                                "--guidance", "4", "--negative-prompt", NEGATIVE, "--true-cfg-scale", "3",
                                "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (5, 64, 48, 24.0)
    vr.assert_generate_report(r, "HunyuanVideoPipeline", guidance="4", fps=24)


@pytest.mark.parametrize("args,needle", [
    (["--frames", "6"], "4k+1"),
    (["--size", "72x48"], "16"),
])
def test_generate_refuses_what_hunyuanvideo_cannot_make(tiny_cache, tmp_path, args, needle):
    vr.assert_generate_refuses("tiny-hunyuanvideo", tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    with vr.serve_preset("tiny-hunyuanvideo", tmp_path_factory.mktemp("hyv-data")) as served:
        yield served


@pytest.mark.slow  # a live server, two jobs
def test_videos_api_two_jobs_share_a_batch(served):
    body = {"num_frames": 5, "steps": 2, "guidance_scale": 4.0, "negative_prompt": NEGATIVE, "true_cfg_scale": 3.0}
    # seconds: (5 - 1) / 24
    vr.assert_two_jobs_share_a_batch(served, "64x48", body, frames=5, fps=24, seconds="0.166667", bad_frames=6,
                                     needle="4k+1")
