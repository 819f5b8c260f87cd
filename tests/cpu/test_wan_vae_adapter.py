"""AutoencoderKLWan adapter on CPU: mounting, the report, and the fast forwards on their reference
chains (DITFUSE_DISABLE=all) bitwise equal to diffusers for encode and the chunked, cached
decode. The kernel's bits against CUDA eager are tests/gpu/test_wan_rms_norm.py's and
tests/gpu/test_vae_gpu.py's."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal


def _vae(dtype=torch.float32, seed=0):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
        attn_scales=[], temperal_downsample=[True],
    )  # the mid block still has a WanAttentionBlock (attn_scales in the encoder breaks in diffusers 0.42.1)
    # Non-trivial gammas: the default ones would hide a gamma/bias mix-up.
    with torch.no_grad():
        for m in vae.modules():
            if type(m).__name__ == "WanRMS_norm":
                m.gamma.normal_(1.0, 0.5)
    return vae.to(dtype).eval()


def _roundtrip(vae, video):
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
        return z, vae.decode(z, return_dict=False)[0]


@pytest.mark.parametrize("batch,frames", [(1, 5), (2, 1), (1, 9)])
def test_encode_decode_on_reference_chains_equals_diffusers(batch, frames, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae()
    video = torch.randn(batch, 3, frames, 12, 20)
    z0, x0 = _roundtrip(vae, video)
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "autoencoder_kl_wan", rep
        assert {s for _, s in rep.sites} == {"wan_vae.residual", "wan_vae.rms_norm"}
        z1, x1 = _roundtrip(vae, video)
        assert_bitwise_equal(z1, z0, "encode")
        assert_bitwise_equal(x1, x0, "decode")
    finally:
        h.unmount()
    assert_bitwise_equal(_roundtrip(vae, video)[1], x0, "after unmount")


def test_bf16_decode_on_reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae(torch.bfloat16)
    z = torch.randn(1, 4, 3, 4, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            assert_bitwise_equal(vae.decode(z, return_dict=False)[0], base, "bf16 decode")
    finally:
        h.unmount()


def test_pipeline_mounts_the_wan_vae():
    from ditfuse.models.wan_configs import build_tiny_wan

    pipe = build_tiny_wan()
    h = ditfuse.accelerate(pipe)
    try:
        adapters = {c.adapter for c in h.report().components if c.status == "mounted"}
        assert {"wan", "autoencoder_kl_wan"} <= adapters, h.report()
    finally:
        h.unmount()


@pytest.mark.slow  # the RMS_norm kernel through the interpreter
def test_fast_path_reaches_the_gate_under_the_interpreter():
    vae = _vae()
    z = torch.randn(1, 4, 2, 4, 4)
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            vae.decode(z, return_dict=False)
        c = ditfuse.gate.report().calls.get("norm.wan_rms_norm_silu", {})
        assert sum(c.values()) > 0, c
    finally:
        h.unmount()
