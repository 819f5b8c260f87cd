"""runtime/pipelines.py: the per-class call table, checked against diffusers 0.42.1's real
pipeline signatures, and run_batch / the request parsers following it (fake pipelines that carry
the real classes' signatures and record what they were called with)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

import diffusers
from ditfuse.runtime import pipelines as pl
from ditfuse.runtime.engine import run_batch
from ditfuse.runtime.params import ParamError, SamplingParams
from ditfuse.runtime.presets import LoadedModel


def _accepted(cls_name: str) -> set[str]:
    return set(inspect.signature(getattr(diffusers, cls_name).__call__).parameters)


@pytest.mark.parametrize("name", sorted(pl.PIPELINE_SPECS))
def test_table_matches_the_real_pipeline_signatures(name):
    """What each row says the class takes is what diffusers 0.42.1's __call__ takes."""
    spec = pl.PIPELINE_SPECS[name]
    params = _accepted(name)
    assert spec.name == name
    assert ("guidance_scale" in params) == (spec.guidance == pl.GUIDANCE_KWARG) or name == "QwenImagePipeline", (
        name, spec.guidance)  # Qwen-Image's guidance_scale is for guidance-distilled checkpoints only
    assert ("true_cfg_scale" in params) == spec.takes_true_cfg, name
    assert ("negative_prompt" in params) == (spec.negative is not None), name
    assert ("num_frames" in params) == spec.is_video, name
    # an inpainting call's mask argument (FLUX.1 Fill's mask_image) is the row's, and only its
    assert ("mask_image" in params) == (spec.mask_kwarg == "mask_image"), (name, spec.mask_kwarg)
    if spec.guidance == pl.GUIDANCE_GUIDER:
        init = inspect.signature(getattr(diffusers, name).__init__).parameters
        assert "guider" in init, name
    default = inspect.signature(getattr(diffusers, name).__call__).parameters["num_inference_steps"].default
    assert spec.default_steps == default, (name, spec.default_steps, default)
    if spec.guidance == pl.GUIDANCE_KWARG:
        g = inspect.signature(getattr(diffusers, name).__call__).parameters["guidance_scale"].default
        assert spec.default_guidance == g, (name, spec.default_guidance, g)
    if spec.takes_true_cfg:
        t = inspect.signature(getattr(diffusers, name).__call__).parameters["true_cfg_scale"].default
        assert spec.default_true_cfg == t, (name, spec.default_true_cfg, t)
    sig = inspect.signature(getattr(diffusers, name).__call__).parameters
    # a call that takes the frame rate (LTX-Video) gets the clip's fps, diffusers' default
    assert ("frame_rate" in params) == (spec.fps_kwarg == "frame_rate"), (name, spec.fps_kwarg)
    if spec.fps_kwarg is not None:
        assert spec.fps == sig[spec.fps_kwarg].default, (name, spec.fps, sig[spec.fps_kwarg].default)
    if spec.is_video:
        assert spec.default_frames == sig["num_frames"].default, (name, spec.default_frames)
    # the size is passed as height / width, except to a call that derives it from its image
    # (size_from_image: the runtime fits the image instead, or the requested size would be dropped)
    assert ("height" in params and "width" in params) == (spec.size_from_image is None), name
    assert (spec.fit_image is None and spec.sizing is None) or spec.size_from_image is not None, name
    if isinstance(spec.default_size, tuple) and isinstance(sig["height"].default, int):
        assert spec.default_size == (sig["width"].default, sig["height"].default), (name, spec.default_size)


def test_check_request_names_the_field_and_the_pipeline():
    qwen = pl.PIPELINE_SPECS["QwenImagePipeline"]
    field, why = qwen.check_request({"guidance_scale", "negative_prompt"})
    assert field == "guidance_scale" and "Qwen-Image" in why and "true_cfg_scale" in why
    assert qwen.check_request({"negative_prompt", "true_cfg_scale"}) is None
    sd3 = pl.PIPELINE_SPECS["StableDiffusion3Pipeline"]
    assert sd3.check_request({"true_cfg_scale"})[0] == "true_cfg_scale"
    assert sd3.check_request({"guidance_scale", "negative_prompt"}) is None
    assert pl.PIPELINE_SPECS["Flux2Pipeline"].check_request({"negative_prompt"})[0] == "negative_prompt"
    assert pl.PIPELINE_SPECS["FluxPipeline"].check_request({"guidance_scale", "true_cfg_scale", "negative_prompt"}) is None
    assert pl.PIPELINE_SPECS["HunyuanVideo15Pipeline"].check_request({"guidance_scale", "negative_prompt"}) is None


def test_unknown_class_is_called_the_flux_way_and_says_so():
    spec = pl.spec_for("SomeNewPipeline")
    assert not spec.known and spec.guidance == pl.GUIDANCE_KWARG and spec.takes_true_cfg
    note = pl.unknown_pipeline_note(spec)
    assert "SomeNewPipeline" in note and "QwenImagePipeline" in note
    assert pl.unknown_pipeline_note(pl.spec_for("FluxPipeline")) is None


def _fake(cls_name: str, video: bool = False):
    """A pipeline object whose __call__ has the real class's signature and records its kwargs."""
    calls: list[dict] = []

    class Fake:
        def __call__(self, **kw):
            calls.append(dict(kw, _guider_scale=getattr(getattr(self, "guider", None), "guidance_scale", None)))
            sched = getattr(self, "scheduler", None)
            for _ in range(kw["num_inference_steps"]):
                if sched is not None:
                    sched.step()
            n = len(kw["prompt"])
            if video:
                import numpy as np

                return SimpleNamespace(frames=[np.zeros((kw["num_frames"], 4, 4, 3), np.float32)] * n)
            return SimpleNamespace(images=[f"img{i}" for i in range(n)])

    real = inspect.signature(getattr(diffusers, cls_name).__call__)
    Fake.__call__.__signature__ = real
    Fake.__name__ = cls_name
    return Fake(), calls


def _loaded(cls_name: str, pipe, kind: str = "image") -> LoadedModel:
    return LoadedModel(cls_name, pipe, "cpu", None, True, kind=kind, spec=pl.spec_for(cls_name))


def P(**kw):
    kw.setdefault("size", "64x64")
    kw.setdefault("num_inference_steps", 2)
    kw.setdefault("seed", 0)
    return SamplingParams.create("a cat", **kw)


def test_qwenimage_gets_no_guidance_scale_and_true_cfg_with_a_negative_prompt():
    pipe, calls = _fake("QwenImagePipeline")
    ld = _loaded("QwenImagePipeline", pipe)
    run_batch(ld, [(P(), 0)])
    assert "guidance_scale" not in calls[-1] and "negative_prompt" not in calls[-1]
    p = P(negative_prompt="blur", true_cfg_scale=4.0)
    run_batch(ld, [(p, 0), (p, 1)])
    assert calls[-1]["negative_prompt"] == ["blur", "blur"] and calls[-1]["true_cfg_scale"] == 4.0
    assert "guidance_scale" not in calls[-1]


def test_cfg_pipelines_get_negative_prompts_per_image():
    pipe, calls = _fake("StableDiffusion3Pipeline")
    ld = _loaded("StableDiffusion3Pipeline", pipe)
    run_batch(ld, [(P(guidance_scale=7.0, negative_prompt="blur"), 0)])
    assert calls[-1]["negative_prompt"] == ["blur"] and calls[-1]["guidance_scale"] == 7.0
    assert "true_cfg_scale" not in calls[-1]
    run_batch(ld, [(P(guidance_scale=7.0), 0)])
    assert "negative_prompt" not in calls[-1]  # the pipeline's own default ("") applies


def test_negative_prompt_on_a_pipeline_without_one_is_an_error():
    pipe, _ = _fake("Flux2Pipeline")
    with pytest.raises(ValueError, match="FLUX.2 .*takes no negative_prompt"):
        run_batch(_loaded("Flux2Pipeline", pipe), [(P(negative_prompt="blur"), 0)])


def test_guider_scale_set_for_the_call_only_and_progress_from_the_scheduler():
    """HunyuanVideo 1.5: guidance on the guider component (restored after the call, also when
    it raises); no callback_on_step_end, so steps are counted at the scheduler's step()."""
    pipe, calls = _fake("HunyuanVideo15Pipeline", video=True)
    stepped = []

    class Sched:
        def step(self):
            stepped.append(1)

    pipe.guider = SimpleNamespace(guidance_scale=6.0)
    pipe.scheduler = Sched()
    ld = _loaded("HunyuanVideo15Pipeline", pipe, kind="video")
    progress = []
    p = P(guidance_scale=3.0, num_inference_steps=3).with_(num_frames=5)
    clips = run_batch(ld, [(p, 0)], on_step=lambda i, n: progress.append((i, n)))
    assert calls[-1]["_guider_scale"] == 3.0 and "guidance_scale" not in calls[-1]
    assert "callback_on_step_end" not in calls[-1]
    assert pipe.guider.guidance_scale == 6.0
    assert progress == [(0, 3), (1, 3), (2, 3)] and len(stepped) == 3
    assert "step" not in vars(pipe.scheduler)  # the wrapper is gone
    assert clips[0].shape == (5, 4, 4, 3)

    def boom(**kw):
        raise RuntimeError("oom")

    type(pipe).__call__ = lambda self, **kw: boom(**kw)
    type(pipe).__call__.__signature__ = inspect.signature(diffusers.HunyuanVideo15Pipeline.__call__)
    with pytest.raises(RuntimeError):
        run_batch(ld, [(p, 0)], on_step=lambda i, n: None)
    assert pipe.guider.guidance_scale == 6.0 and "step" not in vars(pipe.scheduler)


def _engine(cls_name: str, kind: str = "image", **loaded_kw):
    from ditfuse.contracts.quality import Quality

    ld = LoadedModel(cls_name, None, "cpu", None, False, kind=kind, spec=pl.spec_for(cls_name), **loaded_kw)
    return SimpleNamespace(loaded=ld, model_name=cls_name, default_quality=Quality.LOSSLESS)


def test_image_requests_checked_and_defaulted_by_the_table():
    from ditfuse.runtime.server import parse_generation_request

    eng = _engine("QwenImagePipeline", default_steps=50)
    with pytest.raises(ParamError) as e:
        parse_generation_request({"prompt": "a cat", "guidance_scale": 4.0}, eng)
    assert e.value.param == "guidance_scale" and "true_cfg_scale" in str(e.value)
    p = parse_generation_request({"prompt": "a cat", "negative_prompt": "blur"}, eng)
    assert p.true_cfg_scale == 4.0 and p.uses_true_cfg and p.num_inference_steps == 50
    eng = _engine("StableDiffusion3Pipeline", default_steps=28, default_guidance=7.0)
    p = parse_generation_request({"prompt": "a cat"}, eng)
    assert (p.guidance_scale, p.num_inference_steps) == (7.0, 28)
    with pytest.raises(ParamError) as e:
        parse_generation_request({"prompt": "a cat", "true_cfg_scale": 2.0}, eng)
    assert e.value.param == "true_cfg_scale"


def test_video_requests_checked_by_the_table():
    from ditfuse.runtime.videos import parse_video_request

    eng = _engine("HunyuanVideo15Pipeline", kind="video", fps=24, frame_multiple=4, default_frames=121,
                  default_steps=50, default_guidance=6.0, default_size=(848, 480))
    params, seconds = parse_video_request({"prompt": "a fox", "seconds": "1", "size": "64x48"}, eng)
    assert params.num_frames == 25 and params.guidance_scale == 6.0 and seconds == "1"


def test_serving_doc_lists_every_pipeline_class():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [name for name in pl.PIPELINE_SPECS if f"| `{name}`" not in doc]
    assert not missing, f"docs/serving.md's Pipelines table lacks {missing}"


def test_cuda_graph_auto_follows_the_table():
    from ditfuse.runtime.presets import cuda_graphs_for

    assert cuda_graphs_for("auto", _loaded("FluxPipeline", None))
    assert not cuda_graphs_for("auto", _loaded("QwenImage21Pipeline", None))  # its forward syncs
    assert cuda_graphs_for("auto", _loaded("ChromaPipeline", None))  # its embedder's copy is kept on the device
    assert not cuda_graphs_for("auto", _loaded("WanPipeline", None, kind="video"))
    assert cuda_graphs_for("on", _loaded("QwenImage21Pipeline", None))  # asked for: tried (and warned)


def test_frame_rate_passed_only_to_a_pipeline_that_takes_it():
    """LTX-Video's frame_rate scales its RoPE in time: it gets the model's fps (clips and one-frame
    stills alike); Wan's call has no such argument and gets none."""
    pipe, calls = _fake("LTXPipeline", video=True)
    ld = _loaded("LTXPipeline", pipe, kind="video")
    ld.fps = 24
    run_batch(ld, [(P(guidance_scale=3.0, negative_prompt="blur").with_(num_frames=9), 0)])
    assert calls[-1]["frame_rate"] == 24 and calls[-1]["num_frames"] == 9
    assert calls[-1]["negative_prompt"] == ["blur"] and calls[-1]["guidance_scale"] == 3.0
    run_batch(ld, [(P(), 0)])  # an image request: a one-frame clip, same frame rate
    assert calls[-1]["frame_rate"] == 24 and calls[-1]["num_frames"] == 1
    wan, wan_calls = _fake("WanPipeline", video=True)
    wld = _loaded("WanPipeline", wan, kind="video")
    wld.fps = 16
    run_batch(wld, [(P().with_(num_frames=5), 0)])
    assert "frame_rate" not in wan_calls[-1]


def test_hunyuanvideo_embedded_guidance_always_true_cfg_only_when_asked():
    """HunyuanVideo (1.0) is guidance-distilled: guidance_scale goes to every call (its guidance
    embedding); the negative prompt and true_cfg_scale only with true_cfg_scale > 1 (diffusers'
    default 1.0 ignores a negative prompt); no frame rate argument."""
    pipe, calls = _fake("HunyuanVideoPipeline", video=True)
    ld = _loaded("HunyuanVideoPipeline", pipe, kind="video")
    ld.fps = 24
    run_batch(ld, [(P(guidance_scale=6.0, negative_prompt="blur").with_(num_frames=5), 0)])
    assert calls[-1]["guidance_scale"] == 6.0 and calls[-1]["num_frames"] == 5
    assert "negative_prompt" not in calls[-1] and "true_cfg_scale" not in calls[-1] and "frame_rate" not in calls[-1]
    p = P(guidance_scale=6.0, negative_prompt="blur", true_cfg_scale=3.0).with_(num_frames=5)
    run_batch(ld, [(p, 0), (p, 1)])
    assert calls[-1]["negative_prompt"] == ["blur", "blur"] and calls[-1]["true_cfg_scale"] == 3.0
    spec = pl.PIPELINE_SPECS["HunyuanVideoPipeline"]
    assert spec.check_request({"guidance_scale", "true_cfg_scale", "negative_prompt"}) is None


def test_videos_api_refuses_true_cfg_scale_where_the_pipeline_has_none():
    from ditfuse.contracts.quality import Quality
    from ditfuse.runtime.videos import parse_video_request

    for name, fps in (("WanPipeline", 16), ("LTXPipeline", 25), ("SkyReelsV2Pipeline", 24)):
        ld = _loaded(name, None, kind="video")
        ld.fps, ld.frame_multiple, ld.default_frames, ld.default_guidance = fps, 4, 17, 5.0
        engine = SimpleNamespace(loaded=ld, model_name="m", default_quality=Quality.LOSSLESS)
        with pytest.raises(ParamError) as e:
            parse_video_request({"prompt": "a fox", "true_cfg_scale": 3}, engine)
        assert e.value.param == "true_cfg_scale" and name in str(e.value), str(e.value)
        params, _ = parse_video_request({"prompt": "a fox", "negative_prompt": "blur"}, engine)
        assert params.true_cfg_scale == 1.0 and params.negative_prompt == "blur"


def test_skyreels_v2_called_the_wan_way():
    """SkyReelsV2Pipeline (text-to-video) is called as Wan's: guidance_scale always, the negative
    prompt per video for its CFG (none given: diffusers' own ""), no true_cfg_scale, no frame rate;
    its row states diffusers 0.42.1's defaults and SkyReels-V2's 24 fps."""
    spec = pl.PIPELINE_SPECS["SkyReelsV2Pipeline"]
    assert (spec.kind, spec.guidance, spec.negative, spec.fps, spec.fps_kwarg) == ("video", pl.GUIDANCE_KWARG,
                                                                                 pl.NEGATIVE_CFG, 24, None)
    assert (spec.default_steps, spec.default_guidance, spec.default_size, spec.default_frames) == (
        50, 6.0, (960, 544), 97)
    pipe, calls = _fake("SkyReelsV2Pipeline", video=True)
    ld = _loaded("SkyReelsV2Pipeline", pipe, kind="video")
    ld.fps = 24
    p = P(guidance_scale=6.0, negative_prompt="blur").with_(num_frames=9)
    run_batch(ld, [(p, 0), (p, 1)])
    assert calls[-1]["guidance_scale"] == 6.0 and calls[-1]["num_frames"] == 9
    assert calls[-1]["negative_prompt"] == ["blur", "blur"]
    assert "true_cfg_scale" not in calls[-1] and "frame_rate" not in calls[-1] and "fps" not in calls[-1]
    run_batch(ld, [(P(guidance_scale=6.0).with_(num_frames=5), 0)])
    assert "negative_prompt" not in calls[-1]
    assert spec.check_request({"true_cfg_scale"})[0] == "true_cfg_scale"
    # sides: multiples of 16 for the released geometry (VAE 8x, 1x2x2 patches), and never below
    # check_inputs' 16 whatever the patch
    vae8 = SimpleNamespace(vae_scale_factor_spatial=8)
    for patch, multiple in (((1, 2, 2), 16), ((1, 1, 1), 16), ((1, 4, 4), 32)):
        fake = SimpleNamespace(**vars(vae8), transformer=SimpleNamespace(config=SimpleNamespace(patch_size=patch)))
        assert spec.size_multiple(fake) == multiple, patch
