"""Wan 2.2 in the runtime: the tiny random-weight pipelines of its two layouts
(``wan_configs.build_tiny_wan22_*``; their videos are noise) and their presets.

- **TI2V-5B** (``tiny-wan22-5b``: ``WanPipeline``; ``tiny-wan22-5b-i2v``: the same components as a
  ``WanImageToVideoPipeline`` without an image encoder): ``expand_timesteps`` (a timestep per
  token, so the adaLN modulation is per token; in image mode the first frame's tokens get 0), the
  48-channel Wan 2.2 VAE (2x2 patchify, residual blocks, 16x spatial) whose sides come in 32s, and
  24 fps clips.
- **A14B** (``tiny-wan22-a14b``, ``tiny-wan22-a14b-i2v``): two experts, ``transformer`` for the steps
  at or above ``boundary_ratio * 1000`` and ``transformer_2`` below, on the Wan 2.1 VAE; A14B's
  image mode conditions on the image's latents only (36 input channels, no CLIP).

Checked here: the builders' layouts, that both experts run, the ``wan`` adapter on every expert
and the ``autoencoder_kl_wan`` adapter on the VAE bitwise against plain diffusers under the Triton
interpreter, the presets against their loaded pipelines, the frame rate a Wan 2.2 TI2V-5B
*directory* gets (24 fps, from its ``expand_timesteps``), sizes, ``run_batch`` against diffusers'
own call, ``ditfuse generate`` (``--image`` too) and ``/v1/videos`` through the official client."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import autoencoder_kl_wan, wan
from ditfuse.models import wan_configs as wc
from ditfuse.runtime import video_io
from ditfuse.runtime.inputs import pixel_sha256, size_for_image
from ditfuse.runtime.params import SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import PRESET_TABLE
from tests.support import video_runtime as vr
from tests.support.engaged import assert_gate_clean
from tests.support.video_runtime import image_bytes as png_bytes
from tests.support.video_runtime import picture

from .test_videos_server import one_thread  # noqa: F401 - fixture

FIVE_B, FIVE_B_I2V, A14B, A14B_I2V = "tiny-wan22-5b", "tiny-wan22-5b-i2v", "tiny-wan22-a14b", "tiny-wan22-a14b-i2v"
BUILDERS = {FIVE_B: wc.build_tiny_wan22_ti2v, FIVE_B_I2V: wc.build_tiny_wan22_ti2v_i2v,
            A14B: wc.build_tiny_wan22_a14b, A14B_I2V: wc.build_tiny_wan22_a14b_i2v}
I2V = (FIVE_B_I2V, A14B_I2V)
# 5 frames -> 2 latent frames. TI2V-5B: 96x64 px -> 6x4 latents (16x) -> a 3x2 patch grid; A14B:
# 64x48 px -> 8x6 latents (8x) -> 4x3 patches.
SIZES = {FIVE_B: dict(width=96, height=64, num_frames=5), A14B: dict(width=64, height=48, num_frames=5)}
SIZES[FIVE_B_I2V], SIZES[A14B_I2V] = SIZES[FIVE_B], SIZES[A14B]
PROMPT = "a red fox"


def _call(pipe, name: str, seed: int = 3, image=None, **over) -> torch.Tensor:
    kw = dict(prompt=PROMPT, **SIZES[name], max_sequence_length=wc.TINY_WAN_TEXT_LEN)
    if name in I2V:
        kw["image"] = picture(0) if image is None else image
    return vr.frames(pipe, seed, **{**kw, **over})


def _experts(pipe) -> dict[str, torch.nn.Module]:
    return {n: getattr(pipe, n) for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None}


def _state_equal(a: torch.nn.Module, b: torch.nn.Module, label: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), label
    for key, t in sa.items():
        assert_bitwise_equal(sb[key], t, f"{label}.{key}")


# -- the builders ------------------------------------------------------------------------------------

def test_ti2v_5b_builders_have_its_layout():
    """TI2V-5B's text and image modes: one 48-channel transformer, expand_timesteps, no second
    expert and no image encoder, the Wan 2.2 VAE (48 latent channels, 12-channel patchified input,
    residual blocks, 16x / 4x); sides in 32s and 24 fps by the table's own functions; both modes
    have the same weights, the same on every build."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    t2v, i2v = wc.build_tiny_wan22_ti2v(), wc.build_tiny_wan22_ti2v_i2v()
    assert type(t2v) is WanPipeline and type(i2v) is WanImageToVideoPipeline
    for pipe in (t2v, i2v):
        assert pipe.config.expand_timesteps and pipe.config.boundary_ratio is None
        assert pipe.transformer_2 is None and getattr(pipe, "image_encoder", None) is None
        vae = pipe.vae.config
        assert (vae.z_dim, vae.is_residual, vae.patch_size, vae.in_channels, vae.out_channels) == (48, True, 2, 12, 12)
        assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (16, 4)
        assert len(vae.latents_mean) == len(vae.latents_std) == 48
        cfg = pipe.transformer.config
        assert (cfg.in_channels, cfg.out_channels, tuple(cfg.patch_size), cfg.image_dim) == (48, 48, (1, 2, 2), None)
        spec = PIPELINE_SPECS[type(pipe).__name__]
        assert (spec.size_multiple(pipe), spec.frame_multiple(pipe), spec.fps_for(pipe)) == (32, 4, 24)
    for name in ("transformer", "vae", "text_encoder"):
        _state_equal(getattr(t2v, name), getattr(i2v, name), f"5b.{name} (image mode)")
    _state_equal(t2v.transformer, wc.build_tiny_wan22_ti2v().transformer, "5b.transformer (second build)")


def test_a14b_builders_have_its_layout():
    """A14B: two experts of one layout with their own weights, boundary_ratio 0.875 (T2V) / 0.9
    (I2V), the Wan 2.1 VAE (sides in 16s, 16 fps); the text-to-video experts read 16 channels
    and the pipeline is tiny-wan's (same draw: its transformer is the high-noise expert) plus the
    low-noise expert, drawn last; the image-to-video experts read
    Wan 2.1 I2V's 36 channels without CLIP tokens (no image encoder, no added k/v)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    t2v, i2v, wan21 = wc.build_tiny_wan22_a14b(), wc.build_tiny_wan22_a14b_i2v(), wc.build_tiny_wan()
    assert type(t2v) is WanPipeline and type(i2v) is WanImageToVideoPipeline
    assert (t2v.config.boundary_ratio, i2v.config.boundary_ratio) == (wc.WAN22_T2V_BOUNDARY, wc.WAN22_I2V_BOUNDARY)
    for pipe, channels in ((t2v, 16), (i2v, 16 + 4 + 16)):
        assert not pipe.config.expand_timesteps and getattr(pipe, "image_encoder", None) is None
        one, two = pipe.transformer.config, pipe.transformer_2.config
        assert dict(one) == dict(two) and one.in_channels == channels and one.out_channels == 16
        assert one.image_dim is None and one.added_kv_proj_dim is None
        assert not torch.equal(pipe.transformer.blocks[0].ffn.net[2].weight, pipe.transformer_2.blocks[0].ffn.net[2].weight)
        spec = PIPELINE_SPECS[type(pipe).__name__]
        assert (spec.size_multiple(pipe), spec.frame_multiple(pipe), spec.fps_for(pipe)) == (16, 4, 16)
    for name in ("transformer", "vae", "text_encoder"):
        _state_equal(getattr(wan21, name), getattr(t2v, name), f"a14b.{name} (tiny-wan's)")


def _forward_log(pipe) -> tuple[list[tuple[str, tuple[int, ...], torch.Tensor]], list]:
    """Record each expert forward: (expert, timestep shape, timestep)."""
    log, hooks = [], []
    for name, model in _experts(pipe).items():
        def pre(module, args, kwargs, name=name):
            t = kwargs["timestep"]
            log.append((name, tuple(t.shape), t.detach().clone()))
        hooks.append(model.register_forward_pre_hook(pre, with_kwargs=True))
    return log, hooks


@pytest.mark.parametrize("name", [A14B, A14B_I2V])
def test_both_experts_run_on_their_steps(name):
    """With 2 CFG steps, step 0 (t = 999) runs ``transformer`` twice and step 1 (t = 750, below
    the boundary) ``transformer_2`` twice; and the second expert's weights matter."""
    pipe = vr.quiet(BUILDERS[name]())
    log, hooks = _forward_log(pipe)
    try:
        out = _call(pipe, name, guidance_scale=4.0)
    finally:
        for h in hooks:
            h.remove()
    assert [(n, float(t[0])) for n, _, t in log] == [("transformer", 999.0)] * 2 + [("transformer_2", 750.0)] * 2, log
    assert 750 < pipe.config.boundary_ratio * 1000 <= 999
    with torch.no_grad():
        pipe.transformer_2.blocks[0].ffn.net[2].weight.mul_(2.0)
    assert not torch.equal(_call(pipe, name, guidance_scale=4.0), out), "transformer_2 changed nothing"


@pytest.mark.parametrize("name", [FIVE_B, FIVE_B_I2V])
def test_ti2v_timesteps_are_per_token(name):
    """expand_timesteps: the transformer gets a [B, tokens] timestep (the adapter's per-token
    modulation path); in image mode the first latent frame's tokens (the image) get 0."""
    pipe = vr.quiet(BUILDERS[name]())
    log, hooks = _forward_log(pipe)
    try:
        _call(pipe, name, guidance_scale=1.0)
    finally:
        for h in hooks:
            h.remove()
    per_frame = (SIZES[name]["height"] // 32) * (SIZES[name]["width"] // 32)
    assert [shape for _, shape, _ in log] == [(1, 2 * per_frame)] * 2, log
    first = log[0][2][0]
    assert bool((first[per_frame:] == 999).all())
    assert bool((first[:per_frame] == (0 if name in I2V else 999)).all()), first


def test_the_image_conditions_the_5b_clip():
    pipe = vr.quiet(wc.build_tiny_wan22_ti2v_i2v())
    frames = _call(pipe, FIVE_B_I2V)
    assert tuple(frames.shape) == (1, 5, 64, 96, 3), frames.shape
    assert torch.equal(_call(pipe, FIVE_B_I2V), frames)
    assert not torch.equal(_call(pipe, FIVE_B_I2V, image=picture(1)), frames), "the image changed nothing"


# -- accelerated == plain diffusers ----------------------------------------------------------------

def _gated_calls(op: str) -> int:
    c = ditfuse.gate.report().calls.get(op, {})
    return c.get("kernel", 0) + c.get("verify", 0)


# The CPU artifact (see the test's docstring): seeds at which aten's CPU LayerNorm / RMS norms and
# the CUDA order our kernels reproduce round alike for every element of the call.
BITWISE_SEEDS = {FIVE_B: 4, FIVE_B_I2V: 4, A14B: 4, A14B_I2V: 4}


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated(name):
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call is bitwise the plain pipeline's,
    before and after unmounting. Every expert took the ``wan`` adapter with all of its sites (only
    the text cross-attentions kept diffusers' forward, as on Wan 2.1), and each expert's forwards went through
    the gate: the QK-norm + RoPE op ran once per block per forward of *that* expert (so A14B's
    low-noise expert, which runs only below the boundary, is accelerated too). The VAE took
    ``autoencoder_kl_wan`` (Wan 2.2's residual blocks and DupUp3D shortcut included) and its
    RMS_norm + SiLU op reached the gate (in image mode the conditioning image's encode runs on the
    mounted VAE too, so the output covers it). Every op of the ``wan`` adapter and the VAE's norm op verified;
    nothing fell back or was disabled. (The VAE's channels-last decode ops need CUDA: on the CPU
    the decoder runs NCDHW, so they are the GPU tests'.)

    The seed matters on CPU only: the gate's eager reference here is aten's *CPU* LayerNorm and
    F.normalize, whose reductions run in another order than the CUDA kernels the ops reproduce, so
    for some seeds one element rounds to a bf16 1 ulp away and the gate falls back, as it should
    (tests/cpu/test_videos_wan_i2v.py found it for Wan's fp32 norm1 with the CUDA-order simulation,
    tests/support/layernorm_sim.py). :data:`BITWISE_SEEDS` are seeds where both orders agree."""
    pipe = vr.quiet(BUILDERS[name]()).to(torch.bfloat16)
    seed = BITWISE_SEEDS[name]

    def call(p):
        return _call(p, name, seed=seed, image=picture(seed) if name in I2V else None, guidance_scale=4.0)

    base = call(pipe)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    attn_op = "rope.qk_rmsnorm_across_heads_rope"
    per_expert: dict[str, list[int]] = {}
    hooks = []
    try:
        reports = {c.component: c for c in h.report().components}
        for expert, model in _experts(pipe).items():
            rep = reports[expert]
            assert (rep.adapter, rep.status) == ("wan", "mounted"), h.report().summary()
            assert {s for _, s in rep.sites} == {s.name for s in wan.ADAPTER.sites}, rep.sites
            # the text cross-attentions stay diffusers' (no RoPE after their norms: nothing to fuse)
            assert sorted(p for p, _ in rep.skipped_sites) == [f"blocks.{i}.attn2" for i in range(len(model.blocks))]

            def pre(module, args, expert=expert):
                per_expert.setdefault(expert, []).append(-_gated_calls(attn_op))

            def post(module, args, out, expert=expert):
                per_expert[expert][-1] += _gated_calls(attn_op)

            hooks += [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
        vae = reports["vae"]
        assert (vae.adapter, vae.status) == ("autoencoder_kl_wan", "mounted"), h.report().summary()
        out = call(pipe)
        gate = ditfuse.gate.report()
    finally:
        for hk in hooks:
            hk.remove()
        h.unmount()
    assert_bitwise_equal(out, base, f"{name}: accelerated pipeline output")
    assert_gate_clean(gate, name)
    for op in (*wan.ADAPTER.ops(), "norm.wan_rms_norm_silu"):
        if op == "modulate.table_add" and name in (FIVE_B, FIVE_B_I2V):
            # TI2V's per-token modulation is summed inside the ops that read it (*_table arguments)
            assert "modulate.table_add" not in gate.calls, gate.calls
            continue
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"{name}: {op} never reached the gate: {gate.calls}"
    assert "norm.wan_rms_norm_silu" in autoencoder_kl_wan.ADAPTER.ops()
    layers = pipe.transformer.config.num_layers
    want = {"transformer": [layers] * 2, "transformer_2": [layers] * 2} if len(_experts(pipe)) == 2 else \
        {"transformer": [layers] * 4}
    assert per_expert == want, per_expert
    assert_bitwise_equal(call(pipe), base, f"{name}: output after unmount")


# -- the runtime: presets, the pipeline table, sizes, run_batch --------------------------------------

@pytest.fixture(scope="module")
def loaded_models(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return {name: load_model(name, device="cpu") for name in BUILDERS}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_preset_agrees_with_the_loaded_pipeline(loaded_models, name):
    """What the preset table says without loading (class, sides, frame rule, fps) is what the
    table's functions read of the loaded pipeline; the rest is tiny-wan's."""
    from ditfuse.runtime.presets import is_video_model, video_models_hint

    loaded = loaded_models[name]
    p, spec, pipe = PRESET_TABLE[name], loaded.spec, loaded.pipe
    assert is_video_model(name) and p.spec == spec and spec.takes_image == (name in I2V)
    assert spec.name == p.pipeline == type(pipe).__name__ and loaded.is_video and "noise" in loaded.note
    assert (p.size_multiple, p.frame_multiple, p.fps) == (spec.size_multiple(pipe), spec.frame_multiple(pipe),
                                                          spec.fps_for(pipe))
    assert (loaded.size_multiple, loaded.fps) == ((32, 24) if name in (FIVE_B, FIVE_B_I2V) else (16, 16))
    assert (loaded.frame_multiple, loaded.default_frames, loaded.default_steps) == (4, 17, 8)
    assert (loaded.default_guidance, loaded.default_size) == (5.0, (832, 480))
    assert loaded.call_kwargs == {"max_sequence_length": 128}
    assert set(_experts(pipe)) == ({"transformer", "transformer_2"} if "a14b" in name else {"transformer"})
    assert name in video_models_hint()


@pytest.mark.parametrize("name,fps,multiple", [(FIVE_B, 24, 32), (FIVE_B_I2V, 24, 32), (A14B, 16, 16)])
def test_a_wan22_directory_gets_its_frame_rate_and_sides(tiny_cache, name, fps, multiple):
    """A diffusers directory is sized and timed by the table's functions of the loaded pipeline:
    a TI2V-5B directory (model_index.json: WanPipeline, expand_timesteps true) writes 24 fps clips
    (its model's rate) with sides in 32s; an A14B one 16 fps in 16s. Before the table read the
    frame rate from the pipeline, every Wan directory got 16 fps, so a TI2V-5B clip played at two
    thirds of its speed and ``seconds`` picked two thirds of the frames."""
    from ditfuse.runtime.params import resolve_num_frames
    from ditfuse.runtime.presets import ensure_preset, load_model

    loaded = load_model(str(ensure_preset(name)), device="cpu")
    assert not loaded.is_preset and type(loaded.pipe).__name__ == PRESET_TABLE[name].pipeline
    assert (loaded.fps, loaded.size_multiple, loaded.frame_multiple) == (fps, multiple, 4)
    assert (loaded.default_size, loaded.default_frames, loaded.default_steps) == ((832, 480), 81, 50)
    # 5 s: 121 frames at 24 fps (TI2V-5B's own clip length), 81 at 16
    assert resolve_num_frames(seconds="5", num_frames=None, fps=loaded.fps, frame_multiple=4,
                              default_frames=81) == 5 * fps + 1


def test_the_5b_image_mode_from_its_text_mode_directory(loaded_models, tmp_path):
    """Wan2.2-TI2V-5B-Diffusers' model_index.json names WanPipeline, so its directory serves text
    to video. A copy whose model_index.json names WanImageToVideoPipeline (same components; the
    image encoder is optional) serves its image mode: 24 fps, sides in 32s, an image per request,
    and the same clip as the image-mode preset on the same weights."""
    import json
    import shutil

    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.presets import ensure_preset, load_model

    d = tmp_path / "ti2v-5b-i2v"
    shutil.copytree(ensure_preset(FIVE_B), d)
    index = json.loads((d / "model_index.json").read_text())
    assert (index["_class_name"], index["expand_timesteps"]) == ("WanPipeline", True)
    index["_class_name"] = "WanImageToVideoPipeline"
    (d / "model_index.json").write_text(json.dumps(index))
    loaded = load_model(str(d), device="cpu")
    assert type(loaded.pipe).__name__ == "WanImageToVideoPipeline" and loaded.spec.takes_image
    assert (loaded.fps, loaded.size_multiple) == (24, 32)
    # the preset's calls pad the text to its 128 positions; a directory's to diffusers' 512
    assert loaded.call_kwargs == {}
    loaded.call_kwargs = dict(loaded_models[FIVE_B_I2V].call_kwargs)
    params = _params(FIVE_B_I2V, tmp_path)
    np.testing.assert_array_equal(run_batch(loaded, [(params, 0)])[0],
                                  run_batch(loaded_models[FIVE_B_I2V], [(params, 0)])[0])


def test_ti2v_sizes_come_in_32s(loaded_models):
    """TI2V-5B's 16x VAE and 2x2 patches: a size must be a multiple of 32 (the pipeline itself
    would silently crop 80x48 to 64x32); a request naming none gets 832x480; in image mode, the
    image's aspect at that area, each side rounded down to a multiple of 32. A14B keeps 16s."""
    from ditfuse.runtime.videos import parse_video_request

    t2v, i2v = loaded_models[FIVE_B], loaded_models[FIVE_B_I2V]
    vr.assert_request_refused(t2v, FIVE_B, {"size": "80x48"}, "size", "32")
    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1"}, vr.video_engine(t2v, FIVE_B))
    assert (params.width, params.height, params.num_frames, seconds) == (832, 480, 25, "1")  # 1 s at 24 fps
    img = picture(0, 160, 90)
    params, _ = parse_video_request({"prompt": "a fox", "input_reference": png_bytes(img)},
                                    vr.video_engine(i2v, FIVE_B_I2V))
    assert (params.width, params.height) == (832, 448) == size_for_image(160, 90, (832, 480), 32)
    assert params.image_sha256 == pixel_sha256(img)
    a14b = loaded_models[A14B_I2V]
    params, _ = parse_video_request({"prompt": "a fox", "input_reference": png_bytes(img)},
                                    vr.video_engine(a14b, A14B_I2V))
    assert (params.width, params.height) == (832, 464)
    params, _ = parse_video_request({"prompt": "a fox", "size": "80x48"}, vr.video_engine(loaded_models[A14B], A14B))
    assert (params.width, params.height) == (80, 48)


def _params(name: str, tmp_path, seed: int = 5) -> SamplingParams:
    s = SIZES[name]
    p = SamplingParams.create(PROMPT, size=f"{s['width']}x{s['height']}", num_inference_steps=2, guidance_scale=4.0,
                              seed=seed).with_(num_frames=s["num_frames"])
    if name in I2V:
        from ditfuse.runtime.inputs import save_png

        save_png(picture(0), tmp_path / "a.png")
        p = p.with_(image=str(tmp_path / "a.png"), image_sha256=pixel_sha256(picture(0)))
    return p


@pytest.mark.parametrize("name", list(BUILDERS))
def test_run_batch_matches_plain_diffusers(loaded_models, name, tmp_path):
    """The runtime's call is diffusers' own with the request's size, frames, steps, guidance, seed
    (and image, read back from its file)."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    loaded = loaded_models[name]
    with torch.no_grad():
        plain = frames_to_uint8(_call(loaded.pipe, name, seed=5, guidance_scale=4.0)[0].numpy())
    clip = run_batch(loaded, [(_params(name, tmp_path), 0)])[0]
    s = SIZES[name]
    assert clip.shape == (s["num_frames"], s["height"], s["width"], 3) and clip.dtype == np.uint8
    np.testing.assert_array_equal(clip, plain)


# -- ditfuse generate and /v1/videos ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_a_5b_clip(tiny_cache, tmp_path):
    r, info = vr.generate_clip(FIVE_B, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--size", "96x64", "--frames", "5", "--steps", "2",
                                "--guidance", "4", "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (5, 96, 64, 24.0)
    vr.assert_generate_report(r, "WanPipeline", guidance="4", fps=24)


@pytest.mark.slow
def test_generate_a_5b_i2v_clip(tiny_cache, tmp_path):
    picture(0, 160, 90).save(tmp_path / "start.png")
    r, info = vr.generate_clip(FIVE_B_I2V, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--image", str(tmp_path / "start.png"), "--size", "96x64",
                                "--frames", "5", "--steps", "2", "--guidance", "4", "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (5, 96, 64, 24.0)
    vr.assert_generate_report(r, "WanImageToVideoPipeline", guidance="4", fps=24)
    assert f"pixels sha256 {pixel_sha256(picture(0, 160, 90))}" in r.stdout


@pytest.mark.slow
def test_generate_an_a14b_clip_reports_both_experts(tiny_cache, tmp_path):
    """The acceleration report names each expert. (The subprocess is a plain CPU process without
    the Triton interpreter, so they are "untouched" there; the engine test below mounts them.)"""
    r, info = vr.generate_clip(A14B, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--size", "64x48", "--frames", "5", "--steps", "2",
                                "--guidance", "4", "--seed", "3"])
    assert (info.frames, info.width, info.height, info.fps) == (5, 64, 48, 16.0)
    vr.assert_generate_report(r, "WanPipeline", guidance="4", fps=16)
    for expert in ("transformer", "transformer_2"):
        assert f"  {expert} (WanTransformer3DModel): " in r.stdout, r.stdout


def test_the_served_a14b_engine_mounts_both_experts(tiny_cache):
    """``serve``'s engine (build_engine, in this process: Triton's interpreter stands in for a
    GPU) mounts the ``wan`` adapter on both experts and the VAE adapter, and its startup summary
    lists them."""
    from ditfuse.runtime.server import build_engine

    engine, summary = build_engine(A14B, accelerate=True, device="cpu")
    try:
        mounted = {r.component: r.adapter for r in engine.handle.report().components if r.status == "mounted"}
        assert mounted == {"transformer": "wan", "transformer_2": "wan", "vae": "autoencoder_kl_wan"}, summary
        for expert in ("transformer", "transformer_2"):
            assert f"{expert} (WanTransformer3DModel): wan adapter, " in summary, summary
    finally:
        engine.handle.unmount()


@pytest.mark.parametrize("preset,args,needle", [
    (FIVE_B_I2V, [], "generates from an image"),
    (FIVE_B, ["--image", __file__], "takes no input image"),
    (FIVE_B, ["--size", "80x48"], "32"),
])
def test_generate_refuses(tiny_cache, tmp_path, preset, args, needle):
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, args, needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    data_dir = tmp_path_factory.mktemp("wan22-5b-i2v-data")
    with vr.serve_preset(FIVE_B_I2V, data_dir) as served:
        yield served


@pytest.mark.slow  # a live server, three jobs
def test_videos_api_5b_i2v(served):
    """Through the official openai client: two jobs on one uploaded image share a batch and a job
    on another image runs alone; the clips are 24 fps and their job objects say so; a size that is
    not a multiple of 32 is a 400 naming ``size``; the served engine's acceleration mounted the
    transformer and the VAE."""
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=vr.KEY, timeout=300, max_retries=0)
    body = {"num_frames": 5, "steps": 2, "guidance_scale": 4.0}
    a, b = png_bytes(picture(0)), png_bytes(picture(1))
    jobs = [c.videos.create(prompt=f"a fox {i}", size="96x64", input_reference=("start.png", img, "image/png"),
                            extra_body={**body, "seed": i}) for i, img in enumerate((a, a, b))]
    videos, done = vr.completed_clips(c, jobs)
    infos = [video_io.probe_video(mp4) for mp4 in done]
    assert all((i.frames, i.width, i.height, i.fps) == (5, 96, 64, 24.0) for i in infos), infos
    assert len(set(done)) == 3
    assert all(v.seconds == "0.166667" and v.model_extra["fps"] == 24 for v in videos), videos
    assert sorted(entry["size"] for entry in served.engine.batch_log) == [1, 2], served.engine.batch_log
    assert videos[0].model_extra["image_sha256"] == pixel_sha256(picture(0))
    with pytest.raises(openai.BadRequestError) as e:
        c.videos.create(prompt="x", size="80x48", input_reference=("start.png", a, "image/png"), extra_body=body)
    assert e.value.body["param"] == "size", e.value.body
    mounted = {r.component: r.adapter for r in served.engine.handle.report().components if r.status == "mounted"}
    assert mounted == {"transformer": "wan", "vae": "autoencoder_kl_wan"}, mounted
