"""FLUX.1 Fill (diffusers ``FluxFillPipeline``, inpainting / outpainting) in the runtime: the
``tiny-flux-fill`` preset (tiny-flux's parts around a transformer that also reads the masked image
and the mask; its images are noise), the pipeline table's row (an image and a mask, one of each
per prompt), the mask conventions (OpenAI's alpha 0 = edit, diffusers' white = repaint), the mounted
flux adapter bitwise against plain diffusers, ``ditfuse generate --image --mask`` and
``POST /v1/images/edits`` with a mask through the official client."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import flux
from ditfuse.runtime.inputs import check_mask_size, mask_from_image, pixel_sha256, save_png
from ditfuse.runtime.params import ParamError, SamplingParams
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import build_tiny_flux, build_tiny_flux_fill
from tests.cpu.test_generate import run_cli
from tests.cpu.test_videos_server import serving
from tests.support.engaged import assert_gate_clean
from tests.support.video_runtime import image_bytes, picture

from .test_videos_server import one_thread  # noqa: F401 - fixture

PRESET = "tiny-flux-fill"
KEY = "k"


def box(width: int, height: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray:
    """A boolean [height, width] array, True inside the box (the region to repaint)."""
    m = np.zeros((height, width), bool)
    m[y0:y1, x0:x1] = True
    return m


def rgba_mask(region: np.ndarray, seed: int = 0) -> Image.Image:
    """OpenAI's convention: alpha 0 inside ``region``, opaque (alpha 1..255, random) elsewhere;
    random colours everywhere (they must not matter)."""
    rng = np.random.RandomState(seed)
    rgba = rng.randint(0, 256, region.shape + (4,)).astype(np.uint8)
    rgba[..., 3] = np.where(region, 0, rng.randint(1, 256, region.shape))
    return Image.fromarray(rgba, "RGBA")


def bw_mask(region: np.ndarray) -> Image.Image:
    """diffusers' convention, no alpha channel: white inside ``region``, black elsewhere."""
    return Image.fromarray(np.where(region, 255, 0).astype(np.uint8), "L")


def _call(pipe, img, mask, seeds=(1,), **over):
    """A 2-step 64x48 call of the plain pipeline, one image and mask per prompt (lists, as the
    runtime calls it); ``over`` replaces any argument."""
    n = len(seeds)
    kw = dict(prompt=["fill it"] * n, image=[img] * n, mask_image=[mask] * n, height=48, width=64,
              num_inference_steps=2, guidance_scale=30.0, output_type="pt", max_sequence_length=128,
              generator=[torch.Generator().manual_seed(s) for s in seeds])
    return pipe(**{**kw, **over}).images


def test_preset_and_row():
    from diffusers import FluxFillPipeline

    f, t = build_tiny_flux_fill(), build_tiny_flux()
    assert type(f) is FluxFillPipeline
    for name in ("vae", "text_encoder", "text_encoder_2"):
        sd, sd2 = getattr(f, name).state_dict(), getattr(t, name).state_dict()
        for key, v in sd.items():
            assert_bitwise_equal(sd2[key], v, f"fill.{name}.{key} (tiny-flux's)")
    cfg = f.transformer.config
    # FLUX.1 Fill's channel layout: noise latents + masked-image latents + packed 8x8 mask
    assert (cfg.in_channels, cfg.out_channels) == (16 * 4 + 16 * 4 + 8 * 8 * 4, 16 * 4) == (384, 64)
    spec = PIPELINE_SPECS["FluxFillPipeline"]
    assert (spec.default_steps, spec.default_guidance, spec.negative) == (50, 30.0, None)
    assert spec.image_kwarg == "image" and spec.mask_kwarg == "mask_image" and spec.image_per_sample
    assert spec.check_image(False) is not None and spec.check_mask(False) is not None
    assert spec.check_image(True) is None and spec.check_mask(True) is None
    for other in ("FluxKontextPipeline", "FluxPipeline", "WanImageToVideoPipeline"):
        why = PIPELINE_SPECS[other].check_mask(True)
        assert why.startswith("mask is not supported") and "FluxFillPipeline" in why, why
        assert PIPELINE_SPECS[other].check_mask(False) is None
    assert spec.check_request({"negative_prompt"})[0] == "negative_prompt"
    assert spec.check_request({"true_cfg_scale"})[0] == "true_cfg_scale"


def test_one_image_for_the_batch_would_depend_on_its_place():
    """Why the row passes an image and a mask per prompt: with one image for the whole call,
    diffusers' FluxFillPipeline samples the image's latents with the first generator only, so an
    image's output depends on its place in the batch; as lists, it does not."""
    pipe = build_tiny_flux_fill()
    pipe.set_progress_bar_config(disable=True)
    img, mask = picture(0, 64, 48), bw_mask(box(64, 48, 20, 10, 50, 30))
    single = dict(prompt=["fill it"] * 2, image=img, mask_image=mask)
    a, b = _call(pipe, img, mask, (1, 2), **single), _call(pipe, img, mask, (2, 1), **single)
    assert not torch.equal(a[0], b[1])
    a, b = _call(pipe, img, mask, (1, 2)), _call(pipe, img, mask, (2, 1))
    assert_bitwise_equal(b[1], a[0], "seed 1 first or second")
    assert_bitwise_equal(b[0], a[1], "seed 2 first or second")


def test_mask_conversion():
    region = box(40, 30, 5, 4, 25, 20)
    want = np.where(region, 255, 0).astype(np.uint8)
    # OpenAI's: alpha 0 -> white, any other alpha (1 included) -> black, whatever the colour
    for im in (rgba_mask(region), rgba_mask(region).convert("LA"), Image.fromarray(want).convert("L")):
        got = mask_from_image(im)
        assert got.mode == "L" and got.size == (40, 30)
        np.testing.assert_array_equal(np.asarray(got), want)
    almost = rgba_mask(region)
    a = np.asarray(almost).copy()
    a[..., 3] = np.where(region, 0, 1)  # alpha 1: opaque enough to keep
    np.testing.assert_array_equal(np.asarray(mask_from_image(Image.fromarray(a, "RGBA"))), want)
    # a palette image with a transparent index is an alpha mask too
    pal = Image.fromarray(np.where(region, 1, 0).astype(np.uint8), "P")
    pal.putpalette([255, 255, 255, 0, 0, 0] + [0] * 762)  # index 1 (black) transparent
    pal.info["transparency"] = 1
    np.testing.assert_array_equal(np.asarray(mask_from_image(pal)), want)
    # no alpha channel: diffusers' convention, the grayscale as it is (the pipeline binarizes it)
    gray = np.where(region, 200, 30).astype(np.uint8)
    for im in (Image.fromarray(gray, "L"), Image.fromarray(np.stack([gray] * 3, -1), "RGB")):
        np.testing.assert_array_equal(np.asarray(mask_from_image(im)), gray)
    bilevel = Image.fromarray(region).convert("1")
    np.testing.assert_array_equal(np.asarray(mask_from_image(bilevel)), want)
    # nothing to repaint: refused, naming the convention
    opaque = Image.new("RGBA", (40, 30), (255, 255, 255, 255))
    with pytest.raises(ParamError, match="no pixel is fully transparent") as e:
        mask_from_image(opaque)
    assert e.value.param == "mask"
    with pytest.raises(ParamError, match="no pixel is white"):
        mask_from_image(Image.fromarray(np.full((30, 40), 127, np.uint8), "L"))
    # the size of its image, exactly
    check_mask_size(Image.new("L", (40, 30)), picture(0, 40, 30))
    with pytest.raises(ParamError, match=r"mask is 40x31 pixels; it must be the size of the image \(40x30\)"):
        check_mask_size(Image.new("L", (40, 31)), picture(0, 40, 30))


def test_signature_holds_the_mask_where_one_mask_serves_a_call():
    p = SamplingParams.create("x", size="64x48", seed=1).with_(image="a.png", image_sha256="i")
    a, b = p.with_(mask="m1.png", mask_sha256="m1"), p.with_(mask="m2.png", mask_sha256="m2")
    assert a.signature("m") != b.signature("m")  # one image and mask per call: separate calls
    assert a.signature("m", by_image=False) == b.signature("m", by_image=False)  # one per prompt
    assert a.signature("m", by_image=False) != p.signature("m", by_image=False)  # with / without a mask
    spec = PIPELINE_SPECS["FluxFillPipeline"]
    assert spec.batch_signature(a, "m") == spec.batch_signature(b, "m")
    assert a.metadata()["mask_sha256"] == "m1" and "mask_sha256" not in p.metadata()


@pytest.mark.usefixtures("verify_every_call")
def test_transformer_accelerated_bitwise_with_the_mask_tokens():
    """The transformer mounted (bf16): inpainting calls, each token carrying the noise, the masked
    image's latents and the packed mask, are bitwise plain diffusers', every flux op verified, none
    fallen back. Only the transformer is mounted, as in test_images_kontext.py (on the CPU the VAE
    encoder's channels-last GroupNorm input rounds otherwise than the CUDA kernel ours reproduces)."""
    pipe = build_tiny_flux_fill().to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    img = picture(1, 64, 48)
    masks = [bw_mask(box(64, 48, 16, 8, 48, 40)), bw_mask(box(64, 48, 0, 0, 32, 48))]
    base = [_call(pipe, img, m) for m in masks]
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe.transformer)
    try:
        got = [_call(pipe, img, m) for m in masks]
        gate = ditfuse.gate.report()
    finally:
        h.unmount()
    for i, (g, b) in enumerate(zip(got, base)):
        assert_bitwise_equal(g, b, f"fill mask {i}")
    assert_gate_clean(gate, "fill")
    for op in flux.ADAPTER.ops():
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"{op} never reached the gate"
    assert not torch.equal(base[0], base[1]), "the mask changed nothing"


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def _files(tmp_path, image, mask, name="a"):
    save_png(image, tmp_path / f"{name}.png")
    mask.save(tmp_path / f"{name}-mask.png")
    return str(tmp_path / f"{name}.png"), str(tmp_path / f"{name}-mask.png")


def test_run_batch_is_diffusers_call(loaded, tmp_path):
    """run_batch with an image and an OpenAI-style RGBA mask file is diffusers' call with the
    image and the converted mask; a batch of two requests on other images and masks gives each
    what it gets with a copy of itself as batch-mate (one image and mask per prompt)."""
    from ditfuse.runtime.engine import run_batch

    region = box(96, 64, 10, 10, 60, 50)
    img, other = picture(0, 96, 64), picture(3, 96, 64)
    p = SamplingParams.create("fill it", size="64x48", num_inference_steps=2, guidance_scale=30.0, seed=1)
    path, mpath = _files(tmp_path, img, rgba_mask(region))
    a = p.with_(image=path, image_sha256=pixel_sha256(img), mask=mpath, mask_sha256=pixel_sha256(bw_mask(region)))
    got = np.asarray(run_batch(loaded, [(a, 0)])[0])
    with torch.no_grad():
        want = _call(loaded.pipe, img, bw_mask(region), output_type="pil")[0]
    assert got.shape == (48, 64, 3)
    np.testing.assert_array_equal(got, np.asarray(want))
    # another image and mask in the same call
    region_b = box(96, 64, 40, 0, 96, 64)
    path_b, mpath_b = _files(tmp_path, other, bw_mask(region_b), "b")
    b = p.with_(seed=2, image=path_b, image_sha256=pixel_sha256(other), mask=mpath_b,
                mask_sha256=pixel_sha256(bw_mask(region_b)))
    spec = loaded.spec
    assert spec.batch_signature(a, PRESET) == spec.batch_signature(b, PRESET)
    together = run_batch(loaded, [(a, 0), (b, 0)])
    alone = [run_batch(loaded, [(q, 0)], pad_to=2)[0] for q in (a, b)]
    for t, s in zip(together, alone):
        np.testing.assert_array_equal(np.asarray(t), np.asarray(s))
    assert np.asarray(together[0]).tobytes() != np.asarray(together[1]).tobytes()
    # a mask file changed after the request was made, a missing mask, a mask on a text-only slot
    with pytest.raises(ValueError, match="mask .* changed after the request was made"):
        run_batch(loaded, [(a.with_(mask=mpath_b), 0)])
    with pytest.raises(ValueError, match="needs a mask"):
        run_batch(loaded, [(a.with_(mask=None, mask_sha256=None), 0)])


@pytest.mark.slow  # `ditfuse` subprocesses
def test_generate_with_a_mask(tiny_cache, tmp_path):
    """`generate --image --mask`: an RGBA mask (alpha 0 = repaint) and the black-and-white mask of
    the same region (white = repaint) make the same image; refusals exit 2 before the model loads."""
    picture(0, 160, 90).save(tmp_path / "in.png")
    region = box(160, 90, 30, 20, 120, 70)
    rgba_mask(region).save(tmp_path / "rgba.png")
    bw_mask(region).convert("RGB").save(tmp_path / "bw.png")
    outs = []
    for mask in ("rgba.png", "bw.png"):
        out = tmp_path / f"out-{mask}"
        r = run_cli(["generate", "--model", PRESET, "--prompt", "fill it", "--image", str(tmp_path / "in.png"),
                     "--mask", str(tmp_path / mask), "--steps", "2", "--seed", "4", "--out", str(out)], tiny_cache)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "(FluxFillPipeline)" in r.stdout and "mask: " in r.stdout, r.stdout
        with Image.open(out) as im:
            assert im.size == (336, 192)  # no --size: the image's 16:9 at 256x256's area
            assert im.text["mask_sha256"] == pixel_sha256(bw_mask(region))
            assert im.text["guidance_scale"] == "30.0"
            outs.append(im.tobytes())
    assert outs[0] == outs[1]
    fails = [
        (["--model", PRESET, "--image", str(tmp_path / "in.png")], "needs a mask"),
        (["--model", PRESET, "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "small.png")],
         "mask is 40x30 pixels; it must be the size of the image (160x90)"),
        (["--model", "tiny-flux-kontext", "--image", str(tmp_path / "in.png"), "--mask", str(tmp_path / "bw.png")],
         "mask is not supported by FLUX.1 Kontext"),
        (["--model", "tiny-flux", "--mask", str(tmp_path / "bw.png")], "mask is not supported by FLUX.1"),
    ]
    bw_mask(box(40, 30, 0, 0, 10, 10)).save(tmp_path / "small.png")
    for args, needle in fails:
        r = run_cli(["generate", "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "x.png"), *args], tiny_cache)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stdout + r.stderr)
        assert "model:" not in r.stdout  # refused before the load


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread):  # noqa: F811
    from ditfuse.runtime.server import build_engine, create_app

    engine, _ = build_engine(PRESET, accelerate=False, max_batch_size=2, batch_wait_ms=300, max_queue=16)
    with serving(create_app(engine, api_key=KEY)) as url:
        yield url, engine


@pytest.mark.slow  # a live server
def test_images_edits_with_a_mask_through_the_openai_client(served, tmp_path):
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.presets import cache_dir

    url, engine = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    img = picture(0, 96, 64)
    png = image_bytes(img)
    regions = [box(96, 64, 10, 10, 60, 50), box(96, 64, 48, 0, 96, 64)]
    masks = [image_bytes(rgba_mask(r, seed=i)) for i, r in enumerate(regions)]
    # two edits of one image with different masks: one batch (one image and mask per prompt)
    with cf.ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda m: c.images.edit(image=("in.png", png, "image/png"), mask=("m.png", m, "image/png"),
                                                   prompt="fill it",
                                                   extra_body={"seed": 5, "num_inference_steps": 2}), masks))
    imgs = [Image.open(io.BytesIO(base64.b64decode(o.data[0].b64_json))) for o in outs]
    assert [im.size for im in imgs] == [(304, 208)] * 2 and imgs[0].tobytes() != imgs[1].tobytes()
    assert [b["size"] for b in engine.batch_log][-1:] == [2], engine.batch_log
    assert [im.text["mask_sha256"] for im in imgs] == [pixel_sha256(bw_mask(r)) for r in regions]
    assert imgs[0].text["image_sha256"] == pixel_sha256(img)
    # what the server made is the engine's call on the converted mask (padded to 2 as it ran)
    path, mpath = _files(tmp_path, img, rgba_mask(regions[0]))
    p = SamplingParams.create("fill it", size="304x208", num_inference_steps=2, guidance_scale=30.0, seed=5)
    p = p.with_(image=path, image_sha256=pixel_sha256(img), mask=mpath, mask_sha256=pixel_sha256(bw_mask(regions[0])))
    np.testing.assert_array_equal(np.asarray(imgs[0]), np.asarray(run_batch(engine.loaded, [(p, 0)], pad_to=2)[0]))
    # JSON: image and mask as data URLs (a black-and-white mask: diffusers' convention)
    def data_url(b):
        return "data:image/png;base64," + base64.b64encode(b).decode()

    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/images/edits", headers=auth, timeout=120,
                   json={"prompt": "x", "image": {"image_url": data_url(png)}, "size": "64x48",
                         "mask": {"image_url": data_url(image_bytes(bw_mask(regions[0])))}, "num_inference_steps": 1})
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (64, 48)
    # refusals: no mask, a mask of another size, a mask marking nothing, two masks, no image
    opaque = image_bytes(Image.new("RGBA", (96, 64), (0, 0, 0, 255)))
    small = image_bytes(rgba_mask(box(48, 32, 0, 0, 10, 10)))
    for kw, param, needle in [
        (dict(image=("a.png", png, "image/png")), "mask", "needs a mask"),
        (dict(image=("a.png", png, "image/png"), mask=("m.png", small, "image/png")), "mask",
         "mask is 48x32 pixels; it must be the size of the image (96x64)"),
        (dict(image=("a.png", png, "image/png"), mask=("m.png", opaque, "image/png")), "mask",
         "no pixel is fully transparent"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            c.images.edit(prompt="x", **kw)
        assert needle in str(e.value) and e.value.body["param"] == param, str(e.value)
    r = httpx.post(url + "/v1/images/edits", headers=auth, data={"prompt": "x"},
                   files=[("image", ("a.png", png, "image/png")), ("mask", ("m.png", masks[0], "image/png")),
                          ("mask", ("n.png", masks[1], "image/png"))])
    assert r.status_code == 400 and "2 masks were sent" in r.text, r.text
    r = httpx.post(url + "/v1/images/generations", headers=auth, json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_needs_image", r.text
    # every request's input files are gone once it answered
    leftovers = list((cache_dir() / "inputs").rglob("*.png"))
    assert not leftovers, leftovers


@pytest.mark.parametrize("model,code", [("tiny-flux-kontext", "model_takes_no_mask"), ("tiny-flux", "model_takes_no_mask")])
def test_models_without_masks_refuse_one(tiny_cache, one_thread, model, code):  # noqa: F811
    from starlette.testclient import TestClient

    from ditfuse.runtime.server import build_engine, create_app, default_max_body_bytes

    engine, _ = build_engine(model, accelerate=False, max_batch_size=1)
    png = image_bytes(picture(0))
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/images/edits", data={"prompt": "x"},
                    files=[("image", ("in.png", png, "image/png")),
                           ("mask", ("m.png", image_bytes(rgba_mask(box(40, 30, 0, 0, 5, 5))), "image/png"))])
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == code and err["param"] == "mask", r.text
    assert err["message"].startswith("mask is not supported") and "FluxFillPipeline" in err["message"]
    # the inpainting model's default body limit has room for the mask as well as the image
    fill, _ = build_engine(PRESET, accelerate=False, max_batch_size=1)
    assert default_max_body_bytes(fill) > default_max_body_bytes(engine)
