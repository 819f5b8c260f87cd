"""`ditfuse generate` on every family's tiny preset (random weights: the images are noise), and
the runtime's pipeline table (runtime/pipelines.py) deciding what each pipeline is called with."""

from __future__ import annotations

import pytest
from PIL import Image

from ditfuse.runtime.presets import PRESET_TABLE

from .test_generate import run_cli

IMAGE_PRESETS = {
    "tiny-sd3": "sd3",
    "tiny-chroma": "chroma",
    "tiny-flux2-klein": "flux2",
    "tiny-qwenimage": "qwenimage",
    "tiny-zimage": "zimage",
}


def test_every_image_preset_names_a_listed_pipeline():
    from ditfuse.runtime.pipelines import PIPELINE_SPECS

    for name in IMAGE_PRESETS:
        p = PRESET_TABLE[name]
        assert p.pipeline in PIPELINE_SPECS and p.spec.kind == "image" == p.kind, name
        assert "noise" in p.note
        assert p.resolved_call_kwargs(), name  # the builder module's TINY_CALL_KWARGS


@pytest.mark.slow  # `ditfuse` subprocesses: a fresh interpreter importing torch each
@pytest.mark.parametrize("preset", sorted(IMAGE_PRESETS))
def test_generate_on_each_family_preset(preset, tiny_cache, tmp_path):
    out = tmp_path / f"{preset}.png"
    args = ["generate", "--model", preset, "--prompt", "a red fox", "--size", "64x48", "--steps", "2",
            "--seed", "5", "--out", str(out)]
    spec = PRESET_TABLE[preset].spec
    if spec.negative is not None:
        args += ["--negative-prompt", "blurry"]
    r = run_cli(args, tiny_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    img = Image.open(out)
    assert img.size == (64, 48) and img.text["model"] == preset and img.text["seed"] == "5"
    s = r.stdout
    assert f"({spec.name})" in s and "noise" in s and "accelerated:" in s
    assert "2/2" in r.stderr  # the step progress bar ran to the end


@pytest.mark.slow
def test_fields_a_pipeline_does_not_take_fail_before_loading(tiny_cache, tmp_path):
    r = run_cli(["generate", "--model", "tiny-qwenimage", "--prompt", "x", "--guidance", "4",
                 "--out", str(tmp_path / "q.png")], tiny_cache)
    assert r.returncode == 2 and "takes no guidance_scale" in r.stderr and "true_cfg_scale" in r.stderr, r.stderr
    r = run_cli(["generate", "--model", "tiny-flux2-klein", "--prompt", "x", "--negative-prompt", "blur",
                 "--out", str(tmp_path / "k.png")], tiny_cache)
    assert r.returncode == 2 and "takes no negative_prompt" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_qwenimage_true_cfg_runs_and_changes_the_image(tiny_cache):
    """In process, on the real tiny Qwen-Image pipeline: a negative prompt with the pipeline's
    default true_cfg_scale (4.0, diffusers') runs two passes and changes the image; the request
    needs no guidance_scale."""
    import numpy as np

    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.params import SamplingParams
    from ditfuse.runtime.presets import load_model

    loaded = load_model("tiny-qwenimage", device="cpu")
    assert loaded.spec.name == "QwenImagePipeline" and loaded.default_steps == 50
    kw = dict(size="64x48", num_inference_steps=2, seed=1)
    plain = SamplingParams.create("a red fox", **kw)
    neg = SamplingParams.create("a red fox", negative_prompt="blurry", true_cfg_scale=loaded.spec.default_true_cfg, **kw)
    assert neg.uses_true_cfg
    a, b = (np.asarray(run_batch(loaded, [(p, 0)])[0]) for p in (plain, neg))
    assert a.shape == b.shape == (48, 64, 3) and not np.array_equal(a, b)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_rgba_images_save_in_every_format(fmt, tmp_path):
    """Qwen-Image 2.1's pipeline returns RGBA images: every output format writes them (JPEG
    without the alpha channel)."""
    from ditfuse.runtime.generate import save_image

    img = Image.new("RGBA", (8, 6), (10, 20, 30, 255))
    path = tmp_path / f"x.{fmt}"
    save_image(img, path, fmt, {"prompt": "p"})
    back = Image.open(path)
    assert back.size == (8, 6), back.size
    if fmt == "png":  # lossless: the pixels come back
        assert back.mode == "RGBA" and back.getpixel((0, 0)) == (10, 20, 30, 255)
    if fmt == "jpeg":
        assert back.mode == "RGB"


@pytest.mark.slow
def test_generate_a_hunyuanvideo15_clip(tiny_cache, tmp_path):
    """The video preset of the second video family: an MP4 of the asked frames and size, guidance
    on the guider, progress counted at the scheduler (the pipeline has no step callback)."""
    from ditfuse.runtime.video_io import probe_video

    out = tmp_path / "clip.mp4"
    r = run_cli(["generate", "--model", "tiny-hunyuanvideo15", "--prompt", 'a sign that says "OPEN"', "--frames", "9",
                 "--size", "64x48", "--steps", "2", "--guidance", "4", "--negative-prompt", "blurry", "--seed", "3",
                 "--out", str(out)], tiny_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    info = probe_video(out)
    assert (info.frames, info.width, info.height, info.fps) == (9, 64, 48, 24.0)
    assert "(HunyuanVideo15Pipeline)" in r.stdout and "guidance 4" in r.stdout and "noise" in r.stdout
    assert "2/3" in r.stderr  # two denoising steps counted (the third tick is the VAE decode)


def test_hunyuanvideo15_preset_is_a_video_model_with_its_guider_default():
    from ditfuse.runtime.presets import is_video_model

    p = PRESET_TABLE["tiny-hunyuanvideo15"]
    assert is_video_model("tiny-hunyuanvideo15") and p.spec.guidance == "guider" and p.fps == 24
