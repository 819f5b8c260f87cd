"""AutoencoderKLQwenImage (Qwen-Image's VAE) on the Wan VAE adapter's site table (CPU).

diffusers 0.42.1 builds Qwen-Image's VAE from copies of the Wan 2.1 VAE blocks under
``QwenImage*`` names. The first test pins that: every forward the adapter mirrors is Wan's
source up to the class names and two spellings with the same meaning. Then, as for the Wan VAE
(tests/cpu/test_wan_vae_adapter.py): mounting and the report, the decode on the reference chains
(DITFUSE_DISABLE=all) bitwise equal to diffusers for images (one latent frame) and short videos,
the channels-last decode's plumbing on CPU, and the RMS_norm kernel through the gate under the
interpreter. The kernels' bits against CUDA eager are tests/gpu/test_vae_gpu.py's."""

import inspect
import re

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from tests.cpu.test_wan_vae_adapter import _channels_last_on_cpu

SITES = {"qwenimage_vae.residual", "qwenimage_vae.rms_norm", "qwenimage_vae.decoder", "qwenimage_vae.causal_conv",
         "qwenimage_vae.conv2d", "qwenimage_vae.resample", "qwenimage_vae.upsample"}


def _vae(dtype=torch.float32, seed=0):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[True])
    with torch.no_grad():  # non-trivial gammas: the default ones would hide a gamma/bias mix-up
        for m in vae.modules():
            if type(m).__name__ == "QwenImageRMS_norm":
                m.gamma.normal_(1.0, 0.5)
    return vae.to(dtype).eval()


def _decode(vae, z):
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


def _source(cls, meth):
    src = inspect.getsource(getattr(cls, meth))
    src = re.sub(r'""".*?"""', "", src, flags=re.S)
    src = re.sub(r"#.*", "", src).replace("QwenImage", "Wan")
    # the two spellings of one meaning: x[:, :, -min(CACHE_T, T):] is x[:, :, -CACHE_T:] (a slice
    # clips at the start), and positional (feat_cache, feat_idx) are the keyword ones
    src = src.replace("-min(CACHE_T, x.shape[2]) :", "-CACHE_T:")
    src = re.sub(r"\(x, feat_cache, feat_idx\)", "(x, feat_cache=feat_cache, feat_idx=feat_idx)", src)
    src = re.sub(r",? *first_chunk=(first_chunk|None|False)", "", src)
    return [ln.strip() for ln in src.splitlines() if ln.strip()]


@pytest.mark.parametrize("role,meths", [
    ("ResidualBlock", ("forward",)), ("RMS_norm", ("forward", "__init__")), ("CausalConv3d", ("forward", "__init__")),
    ("Upsample", ("forward",)), ("Resample", ("forward",)), ("UpBlock", ("forward",)), ("MidBlock", ("forward",)),
    ("Decoder3d", ("forward",)), ("AttentionBlock", ("forward",)),
])
def test_qwenimage_blocks_are_the_wan_blocks(role, meths):
    from diffusers.models.autoencoders import autoencoder_kl_qwenimage as q
    from diffusers.models.autoencoders import autoencoder_kl_wan as w

    for meth in meths:
        a, b = _source(getattr(w, f"Wan{role}"), meth), _source(getattr(q, f"QwenImage{role}"), meth)
        assert a == b, f"{role}.{meth} differs from Wan's:\n" + "\n".join(
            f"wan:  {x}\nqwen: {y}" for x, y in zip(a, b) if x != y)
    assert q.CACHE_T == w.CACHE_T


@pytest.mark.parametrize("batch,frames", [(1, 1), (2, 1), (1, 3)], ids=["image", "image-b2", "video"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_on_reference_chains_equals_diffusers(batch, frames, dtype, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae(dtype)
    z = torch.randn(batch, 4, frames, 6, 10).to(dtype)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "autoencoder_kl_qwenimage", h.report().summary()
        assert {s for _, s in rep.sites} == SITES
        assert not rep.skipped_sites, rep.skipped_sites
        assert_bitwise_equal(_decode(vae, z), base, "decode")
        assert_bitwise_equal(_decode(vae, z), base, "decode again")
    finally:
        h.unmount()
    assert_bitwise_equal(_decode(vae, z), base, "after unmount")


@pytest.mark.parametrize("batch,lat", [(1, (1, 4, 6)), (2, (1, 4, 4)), (1, (3, 4, 6))], ids=["image", "image-b2", "video"])
def test_channels_last_decode_equals_diffusers(batch, lat, monkeypatch):
    """The channels-last decode (from the second decode of a shape on) on the reference chains:
    bitwise equal to diffusers, every decoder convolution fed channels-last memory."""
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    vae = _vae(torch.bfloat16)
    z = torch.randn(batch, 4, *lat, dtype=torch.bfloat16)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        first = _decode(vae, z)  # NCDHW, recording eager's layouts
        assert calls == []
        out = _decode(vae, z)  # channels-last
    finally:
        h.unmount()
    assert_bitwise_equal(first, base, f"recording decode B={batch} {lat}")
    assert_bitwise_equal(out, base, f"channels-last decode B={batch} {lat}")
    assert out.is_contiguous()
    assert len(calls) >= 8 * lat[0] and all(cl for _, cl in calls), calls


def test_encode_on_reference_chains_equals_diffusers(monkeypatch):
    """The Edit pipelines encode their reference images: the encoder's residual blocks and norms
    run the same sites."""
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae()
    image = torch.randn(2, 3, 1, 24, 40)
    with torch.no_grad():
        base = vae.encode(image).latent_dist.mode()
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            assert_bitwise_equal(vae.encode(image).latent_dist.mode(), base, "encode")
    finally:
        h.unmount()


def test_tiled_decode_on_reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae()
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                      tile_sample_stride_width=16)
    z = torch.randn(1, 4, 1, 12, 10)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        assert_bitwise_equal(_decode(vae, z), base, "tiled decode")
    finally:
        h.unmount()


@pytest.mark.slow  # the RMS_norm kernel through the interpreter
def test_fast_path_reaches_the_gate_under_the_interpreter():
    vae = _vae()
    z = torch.randn(1, 4, 1, 4, 4)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        assert_bitwise_equal(_decode(vae, z), base, "interpreter kernels through the gate")
        c = ditfuse.gate.report().calls.get("norm.wan_rms_norm_silu", {})
        assert sum(c.values()) > 0, c
    finally:
        h.unmount()
