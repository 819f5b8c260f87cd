"""FLUX.1 Kontext (diffusers ``FluxKontextPipeline``, image editing) in the runtime: the
``tiny-flux-kontext`` preset (tiny-flux's parts and weights; its images are noise), the pipeline
table's row (an optional image, one per call; the requested area passed as ``max_area``), the
mounted flux adapter bitwise against plain diffusers with the input image's tokens in the
sequence, ``ditfuse generate --image`` and ``POST /v1/images/edits`` through the official client."""

from __future__ import annotations

import base64
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
from ditfuse.runtime.inputs import pixel_sha256, save_png
from ditfuse.runtime.params import SamplingParams
from tests.support.engaged import assert_gate_clean
from ditfuse.runtime.pipelines import PIPELINE_SPECS
from ditfuse.runtime.presets import build_tiny_flux, build_tiny_flux_kontext
from tests.cpu.test_generate import run_cli
from tests.cpu.test_videos_server import serving
from tests.support.serve_process import wait_healthy
from tests.support.video_runtime import image_bytes, picture

from .test_videos_server import one_thread  # noqa: F401 - fixture

PRESET = "tiny-flux-kontext"
KEY = "k"


def _call(pipe, image=None, seed: int = 1, **over):
    """A 2-step 64x48 call; ``image`` is kept at its own size unless ``_auto_resize=True`` (the
    pipeline's default resizes it to Kontext's ~1 MP resolutions: 4000 image tokens, minutes
    under the interpreter)."""
    kw = dict(prompt="make it red", height=48, width=64, max_area=64 * 48, num_inference_steps=2, output_type="pt",
              generator=torch.Generator().manual_seed(seed), max_sequence_length=128)
    if image is not None:
        kw.update(image=image, _auto_resize=False)
    return pipe(**{**kw, **over}).images


def test_same_parts_as_tiny_flux():
    from diffusers import FluxKontextPipeline

    k, t = build_tiny_flux_kontext(), build_tiny_flux()
    assert type(k) is FluxKontextPipeline
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        sd, sd2 = getattr(k, name).state_dict(), getattr(t, name).state_dict()
        for key, v in sd.items():
            assert_bitwise_equal(sd2[key], v, f"kontext.{name}.{key} (tiny-flux's)")
    spec = PIPELINE_SPECS["FluxKontextPipeline"]
    assert spec.takes_image and spec.image_optional and not spec.image_per_sample and spec.area_kwarg == "max_area"
    assert spec.check_image(False) is None and spec.check_image(True) is None


@pytest.mark.usefixtures("verify_every_call")
def test_transformer_accelerated_bitwise_with_the_image_tokens():
    """The transformer mounted (bf16): an edit call, whose sequence holds the input image's latent
    tokens after the noise's (with their own position ids), and a text-only call are bitwise
    plain diffusers', every flux op verified. Only the transformer is mounted here: on the CPU the
    VAE encoder's GroupNorm input comes out of aten's CPU convolution channels-last, where CPU
    eager's GroupNorm rounds otherwise than the CUDA kernel ours reproduces (the kernel equals the
    CUDA-order simulation there; the gate falls back). The same holds for the LayerNorm in
    data-dependent cases: at 96x64 the second step's norm1 rounds one element 1 ulp apart from
    CPU eager (the kernel equals tests/support/layernorm_sim.py there); at 64x48 every seed tried
    (1-6, with every call verified) agrees. tests/gpu/test_i2v_gpu.py runs the whole pipeline."""
    pipe = build_tiny_flux_kontext().to(torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    img = picture(1, 64, 48)
    base = [_call(pipe, img), _call(pipe)]
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe.transformer)
    try:
        got = [_call(pipe, img), _call(pipe)]
        gate = ditfuse.gate.report()
    finally:
        h.unmount()
    assert_bitwise_equal(got[0], base[0], "kontext edit")
    assert_bitwise_equal(got[1], base[1], "kontext text-only")
    assert_gate_clean(gate, "kontext")
    for op in flux.ADAPTER.ops():
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"{op} never reached the gate"
    assert not torch.equal(base[0], base[1]), "the image changed nothing"


@pytest.fixture(scope="module")
def loaded(tiny_cache):
    from ditfuse.runtime.presets import load_model

    return load_model(PRESET, device="cpu")


def test_run_batch_is_diffusers_call_with_and_without_an_image(loaded, tmp_path):
    from ditfuse.runtime.engine import run_batch

    img = picture(0, 96, 64)
    save_png(img, tmp_path / "in.png")
    p = SamplingParams.create("make it red", size="64x48", num_inference_steps=2, guidance_scale=3.5, seed=1)
    edit = p.with_(image=str(tmp_path / "in.png"), image_sha256=pixel_sha256(img))
    for params, image in ((edit, img), (p, None)):
        got = np.asarray(run_batch(loaded, [(params, 0)])[0])
        with torch.no_grad():  # the runtime calls it as diffusers' default does: the image auto-resized
            want = _call(loaded.pipe, image, guidance_scale=3.5, output_type="pil",
                         **({} if image is None else {"_auto_resize": True}))[0]
        assert got.shape == (48, 64, 3)
        np.testing.assert_array_equal(got, np.asarray(want))
    assert edit.signature(PRESET) != p.signature(PRESET)


@pytest.mark.slow  # a `ditfuse` subprocess
def test_generate_an_edit(tiny_cache, tmp_path):
    picture(0, 160, 90).save(tmp_path / "in.png")
    out = tmp_path / "edit.png"
    r = run_cli(["generate", "--model", PRESET, "--prompt", "make it red", "--image", str(tmp_path / "in.png"),
                 "--steps", "2", "--out", str(out)], tiny_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    with Image.open(out) as im:
        # no --size: the image's 16:9 at 256x256's area, sides in 16s
        assert im.size == (336, 192)
        assert im.text["image_sha256"] == pixel_sha256(picture(0, 160, 90))
    assert "(FluxKontextPipeline)" in r.stdout and "pixels sha256" in r.stdout


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread):  # noqa: F811
    from ditfuse.runtime.server import build_engine, create_app

    engine, _ = build_engine(PRESET, accelerate=False, max_batch_size=2, batch_wait_ms=300, max_queue=16)
    with serving(create_app(engine, api_key=KEY)) as url:
        yield url, engine


@pytest.mark.slow  # a live server
def test_images_edits_through_the_openai_client(served, tiny_cache):
    from ditfuse.runtime.presets import cache_dir

    url, engine = served
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, timeout=120, max_retries=0)
    png = image_bytes(picture(0, 96, 64))
    # two edits of one image: one batch; the size follows the image (3:2 at 256x256's area)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda s: c.images.edit(image=("in.png", png, "image/png"), prompt="make it red",
                                                   extra_body={"seed": s, "num_inference_steps": 2}), (0, 1)))
    imgs = [Image.open(io.BytesIO(base64.b64decode(o.data[0].b64_json))) for o in outs]
    assert [im.size for im in imgs] == [(304, 208)] * 2 and imgs[0].tobytes() != imgs[1].tobytes()
    assert [b["size"] for b in engine.batch_log][-1:] == [2], engine.batch_log
    assert imgs[0].text["image_sha256"] == pixel_sha256(picture(0, 96, 64))
    # JSON with a data URL and a size; text-to-image on the same server
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    r = httpx.post(url + "/v1/images/edits", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "x", "image": {"image_url": data_url}, "size": "64x48", "num_inference_steps": 1})
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (64, 48)
    gen = c.images.generate(prompt="x", size="64x64", extra_body={"num_inference_steps": 1})
    assert len(gen.data) == 1
    # refusals: no image, two images, a mask
    r = httpx.post(url + "/v1/images/edits", headers={"Authorization": f"Bearer {KEY}"}, json={"prompt": "x"})
    assert r.status_code == 400 and "image is required" in r.json()["error"]["message"], r.text
    for kw, needle in [(dict(image=[("a.png", png, "image/png"), ("b.png", png, "image/png")]), "one image per request"),
                       (dict(image=("a.png", png, "image/png"), mask=("m.png", png, "image/png")), "mask is not supported")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.images.edit(prompt="x", **kw)
        assert needle in str(e.value), str(e.value)
    # every request's input file is gone once it answered
    leftovers = list((cache_dir() / "inputs").rglob("*.png"))
    assert not leftovers, leftovers


def test_text_to_image_model_refuses_edits(tiny_cache, one_thread):  # noqa: F811
    from starlette.testclient import TestClient

    from ditfuse.runtime.server import build_engine, create_app

    engine, _ = build_engine("tiny-flux", accelerate=False, max_batch_size=1)
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("in.png", image_bytes(picture(0)), "image/png")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_takes_no_image", r.text


@pytest.mark.slow  # a `ditfuse serve` subprocess
def test_serve_cli_takes_a_large_edit_by_default(tiny_cache, tmp_path):
    """`ditfuse serve --model tiny-flux-kontext` as users start it: the startup lines name the edits
    route and the input limits, and a 2 MB upload fits the default body limit (1 MiB on a
    text-to-image model)."""
    import subprocess

    from tests.cpu.test_videos_server import EXE, _env, free_port

    big = image_bytes(picture(5, 1000, 700))
    assert len(big) > 2_000_000
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([EXE, "serve", "--model", PRESET, "--port", str(port)], env=_env(tiny_cache),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, 120, output=log.read_text)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=120, max_retries=0)
        r = c.images.edit(image=("big.png", big, "image/png"), prompt="x", size="64x48",
                          extra_body={"num_inference_steps": 1, "seed": 3})
        out_img = Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json)))
        assert out_img.size == (64, 48) and out_img.text["image_sha256"] == pixel_sha256(picture(5, 1000, 700))
    finally:
        proc.terminate()
        proc.wait(60)
    text = log.read_text()
    assert "input images: /v1/images/edits takes the image to edit (up to 32 MiB, 4096x4096 px)" in text, text
    assert "(POST /v1/images/generations, POST /v1/images/edits)" in text, text
