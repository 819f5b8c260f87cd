"""First-last-frame-to-video in the runtime: a request's second image (``/v1/videos``
``last_input_reference``, sent as ``input_reference`` is; ``ditfuse generate --last-image``) goes
to the call's ``last_image`` (PipelineSpec ``last_image_kwarg``: WanImageToVideoPipeline,
SkyReelsV2ImageToVideoPipeline) where the loaded checkpoint takes one (``Capabilities.last_image``):

- Wan 2.2 I2V-A14B (``tiny-wan22-a14b-i2v``: no CLIP) conditions on the images' latents: optional.
- Wan 2.1 / SkyReels-V2 image-to-video with CLIP (``tiny-wan-i2v``, ``tiny-skyreels-v2-i2v``): the call
  encodes both images with CLIP, and only a transformer with the first-last-frame image position
  embedding (Wan2.1-FLF2V-14B's ``pos_embed_seq_len``) takes two images' tokens: refused on the I2V
  presets (plain diffusers fails there too), required on ``tiny-wan-flf2v`` and
  ``tiny-skyreels-v2-flf2v``.
- Wan 2.2 TI2V-5B's image mode (``expand_timesteps``): diffusers ignores it, so it is refused.

Checked on the tiny random-weight presets (their videos are noise): the accelerated pipelines
bitwise against plain diffusers with both images, ``run_batch`` against diffusers' own call, the
refusals, batch separation on different last images, the job object and stored files, ``generate
--last-image``, and a live server with multipart and JSON bodies."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import wan, wan_variants
from ditfuse.models import wan_configs as wc
from ditfuse.models import wan_variants_configs as wv
from ditfuse.runtime.inputs import pixel_sha256, save_png
from ditfuse.runtime.params import SamplingParams
from ditfuse.runtime.pipelines import LAST_IMAGE_NONE, LAST_IMAGE_OPTIONAL, LAST_IMAGE_REQUIRED, PIPELINE_SPECS
from tests.support import video_runtime as vr
from tests.support.video_runtime import image_bytes, picture

from .test_videos_engine import StepRunner, V, engine, run
from .test_videos_server import one_thread  # noqa: F401 - fixture

WAN_FLF2V, SKY_FLF2V, A14B_I2V = "tiny-wan-flf2v", "tiny-skyreels-v2-flf2v", "tiny-wan22-a14b-i2v"
TAKES_LAST = (WAN_FLF2V, SKY_FLF2V, A14B_I2V)
BUILDERS = {WAN_FLF2V: wc.build_tiny_wan_flf2v, SKY_FLF2V: wv.build_tiny_flf2v_pipeline,
            A14B_I2V: wc.build_tiny_wan22_a14b_i2v}
ADAPTERS = {WAN_FLF2V: wan.ADAPTER, SKY_FLF2V: wan_variants.SKYREELS_V2_ADAPTER, A14B_I2V: wan.ADAPTER}
# 5 frames -> 2 latent frames (the last image's latents fill the second); 64x48 px -> 4x3 patches
SIZE = dict(width=64, height=48, num_frames=5)
PROMPT = "a red fox"


def _call(pipe, seed: int = 3, image=None, last=None, **over) -> torch.Tensor:
    kw = dict(image=picture(0) if image is None else image, prompt=PROMPT, **SIZE,
              max_sequence_length=wc.TINY_WAN_TEXT_LEN, guidance_scale=4.0)
    if last is not None:
        kw["last_image"] = last
    return vr.frames(pipe, seed, **{**kw, **over})


# a last image of another size and aspect than the first: the pipeline resizes both to the clip's
def _last(seed: int = 1):
    return picture(seed, 50, 20)


# -- the builders -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flf2v,i2v", [(wc.build_tiny_wan_flf2v, wc.build_tiny_wan_i2v),
                                       (wv.build_tiny_flf2v_pipeline, wv.build_tiny_i2v_pipeline)])
def test_flf2v_builders_are_the_i2v_ones_plus_the_image_position_embedding(flf2v, i2v):
    """The FLF2V layout (Wan2.1-FLF2V-14B's): the I2V pipeline with the same weights, plus the
    image embedder's position embedding for two images' CLIP tokens, drawn (not diffusers' zeros)."""
    a, b = flf2v(), i2v()
    assert type(a) is type(b) and a.transformer.config.pos_embed_seq_len == 2 * wc.TINY_CLIP_TOKENS
    assert b.transformer.config.pos_embed_seq_len is None
    sa, sb = a.transformer.state_dict(), b.transformer.state_dict()
    pos = "condition_embedder.image_embedder.pos_embed"
    assert set(sa) - set(sb) == {pos} and float(sa[pos].abs().sum()) > 0
    for key, t in sb.items():
        assert_bitwise_equal(sa[key], t, f"transformer.{key}")
    for name in ("image_encoder", "vae", "text_encoder"):
        for key, t in getattr(b, name).state_dict().items():
            assert_bitwise_equal(getattr(a, name).state_dict()[key], t, f"{name}.{key}")


# -- which checkpoints take a last image --------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_cache):
    from ditfuse.runtime.presets import load_model

    names = (*TAKES_LAST, "tiny-wan-i2v", "tiny-skyreels-v2-i2v", "tiny-wan22-5b-i2v", "tiny-wan", "tiny-ltx-i2v")
    return {name: load_model(name, device="cpu") for name in names}


def test_capabilities_follow_the_checkpoint(models):
    want = {WAN_FLF2V: LAST_IMAGE_REQUIRED, SKY_FLF2V: LAST_IMAGE_REQUIRED, A14B_I2V: LAST_IMAGE_OPTIONAL,
            "tiny-wan-i2v": LAST_IMAGE_NONE, "tiny-skyreels-v2-i2v": LAST_IMAGE_NONE,
            "tiny-wan22-5b-i2v": LAST_IMAGE_NONE, "tiny-wan": LAST_IMAGE_NONE, "tiny-ltx-i2v": LAST_IMAGE_NONE}
    assert {name: m.capabilities.last_image for name, m in models.items()} == want
    assert "pos_embed_seq_len" in models["tiny-wan-i2v"].capabilities.last_image_why
    assert "expand_timesteps" in models["tiny-wan22-5b-i2v"].capabilities.last_image_why
    for name in ("WanImageToVideoPipeline", "SkyReelsV2ImageToVideoPipeline"):
        assert PIPELINE_SPECS[name].last_image_kwarg == "last_image"
    assert PIPELINE_SPECS["LTXImageToVideoPipeline"].last_image_kwarg is None


def test_an_i2v_transformer_cannot_take_a_last_image_in_diffusers_either(models):
    """Why tiny-wan-i2v refuses one: diffusers' call encodes two images with CLIP, and a
    transformer without the FLF2V position embedding fails on the twice-as-large image batch
    (as Wan2.1-I2V-14B would). And an FLF2V transformer fails on a single image."""
    with pytest.raises(RuntimeError):
        _call(models["tiny-wan-i2v"].pipe, last=_last(), num_inference_steps=1)
    with pytest.raises(RuntimeError):
        _call(models[WAN_FLF2V].pipe, num_inference_steps=1)


# -- accelerated == plain diffusers -------------------------------------------------------------------

@pytest.mark.parametrize("name", TAKES_LAST)
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_with_both_images(name):
    """Mounted on the tiny pipeline in bf16, a 2-step CFG call on a first and a last image (both
    through CLIP where the checkpoint has it, both through the VAE encoder) is bitwise the plain
    pipeline's, every op of the adapter reached the gate, and the last image changes the clip."""
    pipe = vr.quiet(BUILDERS[name]()).to(torch.bfloat16)

    def call(p):
        return _call(p, seed=4, image=picture(4), last=_last())

    tr = vr.assert_accelerated_bitwise(pipe, call, ADAPTERS[name], no_skipped_sites=False)
    n = pipe.transformer.config.num_layers
    assert sorted(path for path, _ in tr.skipped_sites) == [f"blocks.{i}.attn2" for i in range(n)], tr.skipped_sites
    assert not torch.equal(call(pipe), _call(pipe, seed=4, image=picture(4), last=_last(2))), "the last image changed nothing"


# -- run_batch ------------------------------------------------------------------------------------------

def _params(tmp_path, last=None, seed: int = 5, **kw) -> SamplingParams:
    save_png(picture(0), tmp_path / "a.png")
    p = SamplingParams.create(PROMPT, size="64x48", num_inference_steps=2, guidance_scale=4.0, seed=seed,
                              **kw).with_(num_frames=5, image=str(tmp_path / "a.png"),
                                          image_sha256=pixel_sha256(picture(0)))
    if last is not None:
        path = tmp_path / f"last-{pixel_sha256(last)[:8]}.png"
        save_png(last, path)
        p = p.with_(last_image=str(path), last_image_sha256=pixel_sha256(last))
    return p


def _run_read(loaded, p):
    """``run_batch``'s clip for ``p`` alone, and the latents (noise, mask and the images' VAE
    latents) its first transformer call read."""
    from ditfuse.runtime.engine import run_batch

    read = []

    def hook(_mod, args, kwargs):
        if not read:
            read.append(kwargs["hidden_states"].clone() if "hidden_states" in kwargs else args[0].clone())

    handle = loaded.pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        clip = run_batch(loaded, [(p, 0)])[0]
    finally:
        handle.remove()
    return clip, read[0]


@pytest.mark.parametrize("name", TAKES_LAST)
def test_run_batch_is_diffusers_own_call_with_both_images(models, name, tmp_path):
    """The runtime's call is diffusers' own with the request's first and last images (read back
    from their files, the last one of another size: the pipeline resizes both) and seed; another
    last image changes what the transformer reads and, with CLIP, the clip; (where the checkpoint
    may go without) none makes another clip.

    tiny-wan22-a14b-i2v sees the last image only through its VAE latents, and the tiny random VAE
    (2 base channels) all but ignores its input: two last images move the transformer's input by
    ~1e-4 and the decoded frames by ~1 float32 ulp, so whether its uint8 clips differ is a
    rounding accident (they differ by one value for 1 of 12 seeds). There the check is on the
    transformer's input."""
    from ditfuse.runtime.engine import run_batch
    from ditfuse.runtime.video_io import frames_to_uint8

    loaded = models[name]
    with torch.no_grad():
        plain = frames_to_uint8(_call(loaded.pipe, seed=5, last=_last())[0].numpy())
    p = _params(tmp_path, _last())
    clip, read = _run_read(loaded, p)
    assert clip.shape == (5, 48, 64, 3)
    np.testing.assert_array_equal(clip, plain)
    clip_2, read_2 = _run_read(loaded, _params(tmp_path, _last(2)))
    # the first image's latent frame as it was, the last image's (the second) another
    assert torch.equal(read_2[:, :, 0], read[:, :, 0]) and not torch.equal(read_2[:, :, -1], read[:, :, -1])
    if name != A14B_I2V:
        assert not np.array_equal(clip_2, clip)
    if name == A14B_I2V:
        assert not np.array_equal(run_batch(loaded, [(_params(tmp_path), 0)])[0], clip)
    else:  # required: refused before anything runs
        with pytest.raises(ValueError, match="needs a last image"):
            run_batch(loaded, [(_params(tmp_path), 0)])
    assert p.metadata(0)["last_image_sha256"] == pixel_sha256(_last())


def test_run_batch_refuses_a_last_image_where_the_checkpoint_takes_none(models, tmp_path):
    from ditfuse.runtime.engine import run_batch

    with pytest.raises(ValueError, match="pos_embed_seq_len"):
        run_batch(models["tiny-wan-i2v"], [(_params(tmp_path, _last()), 0)])


def test_a_batch_of_two_on_the_same_images(models, tmp_path):
    """Two seeds on one first and last image run as one call of the FLF2V checkpoint (its image
    embedder folds each video's two CLIP rows together): each clip within one uint8 level of the
    request run alone."""
    from ditfuse.runtime.engine import run_batch

    ps = [_params(tmp_path, _last(), seed=i) for i in range(2)]
    clips = run_batch(models[WAN_FLF2V], [(p, 0) for p in ps])
    assert not np.array_equal(clips[0], clips[1])
    for p, clip in zip(ps, clips):
        alone = run_batch(models[WAN_FLF2V], [(p, 0)])[0]
        assert np.abs(clip.astype(int) - alone.astype(int)).max() <= 1, p.seed


def test_different_last_images_do_not_share_a_batch():
    a, b = pixel_sha256(_last(1)), pixel_sha256(_last(2))
    assert V().signature("m") != V().with_(last_image_sha256=a).signature("m")
    runner = StepRunner()

    async def main():
        eng = engine(runner, max_video_batch_size=4)
        await eng.start()
        reqs = [V("a0").with_(last_image_sha256=a), V("a1").with_(last_image_sha256=a),
                V("b0").with_(last_image_sha256=b), V("n0")]
        await asyncio.gather(*[eng.submit(r) for r in reqs])
        await eng.shutdown()

    run(main())
    assert sorted(tuple(p) for _, p, _ in runner.calls) == [("a0", "a1"), ("b0",), ("n0",)]


# -- /v1/videos requests ---------------------------------------------------------------------------------

def test_video_requests_take_a_last_image_as_the_first(models):
    from ditfuse.runtime.inputs import default_size_for_image
    from ditfuse.runtime.videos import parse_video_request

    first, last = picture(0, 160, 90), _last()
    url = "data:image/png;base64," + base64.b64encode(image_bytes(last)).decode()
    for name in TAKES_LAST:
        e = vr.video_engine(models[name], name)
        for value in (image_bytes(last), {"image_url": url}, url):
            params, _ = parse_video_request({"prompt": "a fox", "input_reference": image_bytes(first),
                                             "last_input_reference": value}, e)
            assert params.last_image_sha256 == pixel_sha256(last) and params.last_image is None
            assert pixel_sha256(params.extra["last_image"]) == params.last_image_sha256
            assert params.image_sha256 == pixel_sha256(first)
            # the size follows the first image (its aspect at the preset's area), not the last
            assert (params.width, params.height) == default_size_for_image(models[name], first)


@pytest.mark.parametrize("name,fields,param,needle", [
    ("tiny-wan", {}, "last_input_reference", "takes no last image (first-last-frame-to-video needs"),
    ("tiny-ltx-i2v", {"input_reference": True}, "last_input_reference", "takes no last image"),
    ("tiny-wan-i2v", {"input_reference": True}, "last_input_reference", "pos_embed_seq_len"),
    ("tiny-skyreels-v2-i2v", {"input_reference": True}, "last_input_reference", "pos_embed_seq_len"),
    ("tiny-wan22-5b-i2v", {"input_reference": True}, "last_input_reference", "expand_timesteps"),
    (A14B_I2V, {"input_reference": True, "num_frames": 1}, "num_frames", "at least 2 frames"),
    (A14B_I2V, {"input_reference": True, "last_input_reference": {"file_id": "f"}}, "last_input_reference",
     "no files API"),
])
def test_video_requests_refused(models, name, fields, param, needle):
    fields = {"last_input_reference": image_bytes(_last()), **fields}
    if fields.get("input_reference") is True:
        fields["input_reference"] = image_bytes(picture(0))
    vr.assert_request_refused(models[name], name, fields, param, needle)


@pytest.mark.parametrize("name", [WAN_FLF2V, SKY_FLF2V])
def test_flf2v_requests_need_both_images(models, name):
    vr.assert_request_refused(models[name], name, {"input_reference": image_bytes(picture(0))},
                              "last_input_reference", "needs a last image")
    vr.assert_request_refused(models[name], name, {"last_input_reference": image_bytes(_last())},
                              "input_reference", "generates from an image")


def test_body_limit_has_room_for_two_images(models):
    from types import SimpleNamespace

    from ditfuse.runtime.inputs import MAX_INPUT_BYTES
    from ditfuse.runtime.server import DEFAULT_MAX_BODY_BYTES, default_max_body_bytes

    one = MAX_INPUT_BYTES * 4 // 3
    assert default_max_body_bytes(SimpleNamespace(loaded=models[A14B_I2V])) == DEFAULT_MAX_BODY_BYTES + 2 * one
    assert default_max_body_bytes(SimpleNamespace(loaded=models["tiny-wan-i2v"])) == DEFAULT_MAX_BODY_BYTES + one


def test_startup_keeps_the_last_images_of_jobs_and_removes_the_rest(tmp_path):
    from types import SimpleNamespace

    from ditfuse.runtime.jobs import params_json
    from ditfuse.runtime.videos import VideoJobs

    eng = SimpleNamespace(model_name=A14B_I2V, loaded=SimpleNamespace(is_video=True, fps=16))
    jobs = VideoJobs(eng, tmp_path, sweep_interval_s=0)
    store = jobs.open()
    p = _params(tmp_path, _last())
    store.insert({"id": "video_done", "model": A14B_I2V, "status": "failed", "progress": 0, "created_at": 1,
                  "prompt": PROMPT, "size": p.size, "seconds": "0.25", "quality": "lossless",
                  "params": params_json(p)})
    for name in ("video_done.png", "video_done-last.png", "video_gone.png", "video_gone-last.png"):
        save_png(picture(0), jobs.inputs_dir / name)
    jobs._remove_orphans()
    assert sorted(f.name for f in jobs.inputs_dir.iterdir()) == ["video_done-last.png", "video_done.png"]
    api = jobs.to_api(store.get("video_done"))
    assert api["last_image_sha256"] == pixel_sha256(_last()) and api["image_sha256"] == pixel_sha256(picture(0))
    jobs.delete("video_done")
    assert not list(jobs.inputs_dir.iterdir())
    store.close()


# -- ditfuse generate and a live server ------------------------------------------------------------------

@pytest.mark.slow  # a `ditfuse` subprocess: a fresh interpreter importing torch
def test_generate_with_a_last_image(tiny_cache, tmp_path):
    picture(0, 160, 90).save(tmp_path / "start.png")
    _last().save(tmp_path / "end.png")
    r, info = vr.generate_clip(A14B_I2V, tiny_cache, tmp_path / "clip.mp4",
                               ["--prompt", PROMPT, "--image", str(tmp_path / "start.png"), "--last-image",
                                str(tmp_path / "end.png"), "--size", "64x48", "--frames", "5", "--steps", "2",
                                "--guidance", "4", "--seed", "3"])
    assert (info.frames, info.width, info.height) == (5, 64, 48)
    assert f"last image: {tmp_path / 'end.png'} (pixels sha256 {pixel_sha256(_last())})" in r.stdout, r.stdout
    assert f"last_image_sha256={pixel_sha256(_last())}" in info.metadata["comment"], info.metadata


@pytest.mark.parametrize("preset,args,needle", [
    ("tiny-wan", ["--last-image", "LAST"], "takes no last image"),
    ("tiny-wan-i2v", ["--image", "LAST", "--last-image", "LAST"], "pos_embed_seq_len"),
    (WAN_FLF2V, ["--image", "LAST"], "needs a last image"),
    (A14B_I2V, ["--image", "LAST", "--last-image", "/nonexistent/end.png"], "No such file"),
    (A14B_I2V, ["--image", "LAST", "--last-image", "LAST", "--frames", "1"], "at least 2 frames"),
])
def test_generate_refuses(tiny_cache, tmp_path, preset, args, needle):
    image = tmp_path.parent / f"{tmp_path.name}-end.png"
    _last().save(image)
    vr.assert_generate_refuses(preset, tiny_cache, tmp_path, [str(image) if a == "LAST" else a for a in args],
                               needle)


@pytest.fixture(scope="module")
def served(tiny_cache, one_thread, tmp_path_factory):  # noqa: F811
    data_dir = tmp_path_factory.mktemp("flf2v-data")
    with vr.serve_preset(A14B_I2V, data_dir) as served:
        served.data_dir = data_dir
        yield served


@pytest.mark.slow  # a live server, four jobs
def test_videos_api_multipart_and_json(served):
    """Multipart uploads (as input_reference is sent) and a JSON data URL: jobs on the same first
    and last image share a batch, a job on another last image runs alone; the job objects report
    both fingerprints; each job keeps both inputs until it is deleted."""
    import openai

    headers = {"Authorization": f"Bearer {vr.KEY}"}
    form = {"prompt": "a fox", "size": "64x48", "num_frames": "5", "steps": "2", "guidance_scale": "4"}
    a, l1, l2 = image_bytes(picture(0)), image_bytes(_last(1)), image_bytes(_last(2))
    ids = []
    for i, last in enumerate((l1, l1, l2)):
        r = httpx.post(f"{served.url}/v1/videos", headers=headers, data={**form, "seed": str(i)},
                       files={"input_reference": ("start.png", a, "image/png"),
                              "last_input_reference": ("end.png", last, "image/png")}, timeout=60)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    c = openai.OpenAI(base_url=served.url + "/v1", api_key=vr.KEY, timeout=300, max_retries=0)
    videos = [vr.wait_done(c, i) for i in ids]
    assert all(v.status == "completed" for v in videos), videos
    assert sorted(entry["size"] for entry in served.engine.batch_log) == [1, 2], served.engine.batch_log
    assert [v.model_extra["last_image_sha256"] for v in videos] == [pixel_sha256(_last(1))] * 2 + [
        pixel_sha256(_last(2))]
    inputs = served.data_dir / "inputs"
    assert (inputs / f"{ids[2]}-last.png").is_file() and (inputs / f"{ids[2]}.png").is_file()
    c.videos.delete(ids[2])
    assert not (inputs / f"{ids[2]}-last.png").exists() and (inputs / f"{ids[0]}-last.png").is_file()
    # JSON: both images as data URLs
    url = "data:image/png;base64,"
    r = httpx.post(f"{served.url}/v1/videos", headers=headers, timeout=60, json={
        "prompt": "json", "size": "64x48", "num_frames": 5, "steps": 1,
        "input_reference": {"image_url": url + base64.b64encode(a).decode()},
        "last_input_reference": {"image_url": url + base64.b64encode(l2).decode()}})
    assert r.status_code == 200, r.text
    v = vr.wait_done(c, r.json()["id"])
    assert v.status == "completed" and v.model_extra["last_image_sha256"] == pixel_sha256(_last(2)), v
    # the form encoding of an {"image_url": ...} object, as the openai client writes one
    r = httpx.post(f"{served.url}/v1/videos", headers=headers, timeout=60, data={
        **form, "input_reference[image_url]": url + base64.b64encode(a).decode(),
        "last_input_reference[image_url]": url + base64.b64encode(l1).decode(), "steps": "1"})
    assert r.status_code == 200 and r.json()["last_image_sha256"] == pixel_sha256(_last(1)), r.text
    vr.wait_done(c, r.json()["id"])
    r = httpx.post(f"{served.url}/v1/videos", headers=headers, timeout=60, data={**form, "num_frames": "1"},
                   files={"input_reference": ("s.png", a, "image/png"), "last_input_reference": ("e.png", l1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames", r.text
