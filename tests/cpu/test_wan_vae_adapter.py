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
        assert {s for _, s in rep.sites} == {"wan_vae.residual", "wan_vae.rms_norm", "wan_vae.decoder",
                                             "wan_vae.causal_conv", "wan_vae.conv2d", "wan_vae.resample",
                                             "wan_vae.upsample"}
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


def _channels_last_on_cpu(monkeypatch):
    """Let the channels-last decode run on CPU: the decoder's CUDA requirement lifted, and the
    channels-last convolution stood in for by its reference's values in channels-last memory
    (cuDNN's NHWC kernel is the GPU tests'). Returns the (input, output) layouts of every call."""
    from ditfuse.contracts.ops import LOSSLESS
    from ditfuse.kernels import reference as ref
    from ditfuse.models import autoencoder_kl_wan as wa

    calls = []
    # aten adds a cuDNN convolution's bias in a separate pass (the channels-last decode relies on
    # it to fold a bias into the next norm); CPU convolutions fuse it: both runs get cuDNN's way
    for name in ("conv2d", "conv3d"):
        orig = getattr(torch.nn.functional, name)

        def split_bias(x, weight, bias=None, *args, _orig=orig, **kwargs):
            out = _orig(x, weight, None, *args, **kwargs)
            return out if bias is None else out + bias.reshape(1, -1, *([1] * (out.dim() - 2)))

        monkeypatch.setattr(torch.nn.functional, name, split_bias)

    def conv_cl(x, weight, bias, stride, padding):
        fmt = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
        out = ref.conv_channels_last(x, weight, bias, stride, padding).contiguous(memory_format=fmt)
        calls.append((x.dim(), wa._is_cl(x) or x.is_contiguous(memory_format=fmt)))
        return out

    monkeypatch.setattr(wa, "_cl_problem", lambda dec, x: None if (x.shape[3] * x.shape[4]) % 4 == 0 else "odd")
    monkeypatch.setattr(LOSSLESS, "conv_channels_last", conv_cl)
    return calls


@pytest.mark.parametrize("batch,lat", [(1, (3, 4, 6)), (2, (2, 4, 4)), (1, (1, 2, 6))], ids=["b1t3", "b2t2", "b1t1"])
def test_channels_last_decode_equals_diffusers(batch, lat, monkeypatch):
    """The channels-last decode's plumbing (padded causal-conv buffers with cache frames, the
    channels-last frame interleave, the views around the 2-D convolutions, contiguous output) on
    the reference chains: bitwise equal to diffusers, and every decoder convolution got a
    channels-last input."""
    from ditfuse.contracts.ops import LOSSLESS
    from ditfuse.kernels import reference as ref
    from ditfuse.models import autoencoder_kl_wan as wa

    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    pads = []  # (norm, cache handed to the op, kept frames) per padded-output norm

    def pad_op(x, gamma, bias, silu, ncdhw, pad, pre_bias=None, cache=None, keep=0):
        out = ref.wan_rms_norm_silu_pad(x, gamma, bias, silu, ncdhw, pad, pre_bias, cache, keep)
        pads.append((gamma, cache, keep))
        return out

    monkeypatch.setattr(LOSSLESS, "wan_rms_norm_silu_pad", pad_op)
    vae = _vae(torch.bfloat16)
    z = torch.randn(batch, 4, *lat, dtype=torch.bfloat16)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    h = ditfuse.accelerate(vae)
    try:
        sites = {s for _, s in h.report().components[0].sites}
        assert {"wan_vae.decoder", "wan_vae.causal_conv", "wan_vae.conv2d", "wan_vae.resample",
                "wan_vae.upsample"} <= sites
        with torch.no_grad():
            first = vae.decode(z, return_dict=False)[0]  # NCDHW, recording eager's layouts
            assert calls == [] and pads == []
            out = vae.decode(z, return_dict=False)[0]  # channels-last
    finally:
        h.unmount()
    # the head (norm_out -> SiLU -> conv_out) writes its conv's padded input like the residual
    # blocks do; later chunks hand their dense channels-last caches to the op and keep 2 frames
    assert any(g is vae.decoder.norm_out.gamma for g, _, _ in pads)
    if lat[0] > 1:
        assert any(c is not None and ref.dense_channels_last(c) and k == wa.CACHE_T for _, c, k in pads), \
            [(None if c is None else tuple(c.shape), k) for _, c, k in pads]
    assert_bitwise_equal(first, base, f"recording decode B={batch} {lat}")
    assert_bitwise_equal(out, base, f"channels-last decode B={batch} {lat}")
    assert out.is_contiguous()
    # conv_in, 2 per residual block, the attention's two 1x1, the time and 2-D resample convs, conv_out
    assert len(calls) >= 8 * lat[0] and all(cl for _, cl in calls), calls
    assert {d for d, _ in calls} == {4, 5}


def _plain_then_accelerated(vae, z):
    """(plain decode, accelerated decode): the accelerated one is the second call (the first
    records eager's layouts)."""
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            vae.decode(z, return_dict=False)
            return base, vae.decode(z, return_dict=False)[0]
    finally:
        h.unmount()


def test_channels_last_tiled_decode(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    vae = _vae(torch.bfloat16)
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
                      tile_sample_stride_height=24, tile_sample_stride_width=24)
    base, out = _plain_then_accelerated(vae, torch.randn(1, 4, 2, 12, 10, dtype=torch.bfloat16))
    assert_bitwise_equal(out, base, "tiled")
    assert calls


def test_channels_last_decode_off_for_odd_latents(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    vae = _vae(torch.bfloat16)
    base, out = _plain_then_accelerated(vae, torch.randn(1, 4, 2, 3, 5, dtype=torch.bfloat16))  # H*W = 15
    assert_bitwise_equal(out, base, "odd latent")
    assert calls == []


@pytest.mark.slow  # the RMS_norm kernel through the interpreter, on channels-last tensors
def test_channels_last_decode_through_the_gate(monkeypatch):
    """The op tables themselves (the gate, the interpreter kernel) on the channels-last decode: the
    output equals diffusers' (the CUDA-order kernel differs from CPU eager's order, so the gate
    sends the norm to its reference on CPU: what is checked is the plumbing around it)."""
    calls = _channels_last_on_cpu(monkeypatch)
    vae = _vae(torch.float32)
    z = torch.randn(1, 4, 2, 4, 4)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    ditfuse.gate.reset()
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            vae.decode(z, return_dict=False)
            out = vae.decode(z, return_dict=False)[0]
        c = ditfuse.gate.report().calls.get("norm.wan_rms_norm_silu", {})
        assert sum(c.values()) > 0, c
    finally:
        h.unmount()
    assert calls and all(cl for _, cl in calls)
    assert_bitwise_equal(out, base, "channels-last decode through the gate")
    assert out.is_contiguous()


def test_layout_record_and_replay_lookups():
    """The layout table: recorded classes come back; a call the recording never made marks the
    chunk kind NCDHW-only (later chunks of that kind skip the channels-last path)."""
    from ditfuse.models import autoencoder_kl_wan as wa

    lay, conv = wa._Layouts(), torch.nn.Conv2d(4, 4, 1)
    x = torch.zeros(1, 4, 3, 5)
    lay.record(conv, x)
    lay.record(conv, x.contiguous(memory_format=torch.channels_last)[:, :, :2])  # another shape: channels-last
    assert lay.get(conv, x) == wa.NCDHW and lay.get(conv, x[:, :, :2]) == wa.CL and lay.problem is None
    assert lay.get(conv, torch.zeros(1, 4, 7, 7)) == wa.OTHER and "unseen" in lay.problem
    odd = wa._Layouts()
    odd.record(conv, torch.zeros(1, 4, 6, 6)[:, :, ::2])  # strided: not reproduced
    assert odd.problem is not None


def test_high_tier_on_the_norm_sites():
    """quality="high" on a bf16 Wan VAE with an injected admission record: the residual and
    rms_norm sites (the ones with a close op) move to high and norm.wan_rms_norm_silu_fp32 runs
    (interpreter); the conv/layout sites have no high tier; back to lossless it is bitwise again."""
    from ditfuse.contracts import admission, ops
    from ditfuse.models import mounted_high

    vae = _vae(torch.bfloat16)
    z = torch.randn(1, 4, 2, 4, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    h = ditfuse.accelerate(vae)
    try:
        with admission.override_records([admission.admitted_record("norm.wan_rms_norm_silu_fp32")]):
            res = h.set_quality("high")["AutoencoderKLWan"]
            assert res.ok, res.failed
            assert {s.partition(":")[2] for s in mounted_high(vae)} == {"wan_vae.residual", "wan_vae.rms_norm"}
            ops.reset_counts()
            with torch.no_grad():
                hi = vae.decode(z, return_dict=False)[0]
        assert ops.CLOSE["norm.wan_rms_norm_silu_fp32"].calls["kernel"] > 0
        torch.testing.assert_close(hi.float(), base.float(), rtol=0.05, atol=0.05)
        h.set_quality("lossless")
        with torch.no_grad():
            assert_bitwise_equal(vae.decode(z, return_dict=False)[0], base, "back to lossless")
    finally:
        h.unmount()


def _vae22(dtype=torch.float32, seed=0):
    """A tiny Wan 2.2-style VAE (TI2V-5B's layout: residual up blocks with the DupUp3D shortcut,
    2x2 patchified 12-channel images, a decoder wider than the encoder)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1,
                           attn_scales=[], temperal_downsample=[False, True], is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16)
    with torch.no_grad():
        for m in vae.modules():
            if type(m).__name__ == "WanRMS_norm":
                m.gamma.normal_(1.0, 0.5)
    return vae.to(dtype).eval()


@pytest.mark.parametrize("batch,lat", [(1, (1, 4, 6)), (1, (3, 4, 6)), (2, (2, 4, 4))], ids=["b1t1", "b1t3", "b2t2"])
def test_wan22_channels_last_decode_equals_diffusers(batch, lat, monkeypatch):
    """Wan 2.2's residual up blocks run the channels-last decode too: bitwise diffusers on the
    reference chains, every decoder convolution fed channels-last memory, and the DupUp3D
    shortcut computed on channels-last memory (its input and, but for the first chunk's frame
    slice at B > 1, its output channels-last)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    from ditfuse.models import autoencoder_kl_wan as wa

    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    vae = _vae22(torch.bfloat16)
    assert {type(b).__name__ for b in vae.decoder.up_blocks} == {"WanResidualUpBlock"}
    z = torch.randn(batch, 4, *lat, dtype=torch.bfloat16)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, o: seen.append((wa._is_cl(a[0]), wa._is_cl(o))))
             for m in vae.modules() if isinstance(m, DupUp3D)]
    h = ditfuse.accelerate(vae)
    try:
        assert "wan_vae.dup_up" in {s for _, s in h.report().components[0].sites}
        with torch.no_grad():
            first = vae.decode(z, return_dict=False)[0]  # NCDHW, recording
            assert calls == [] and not any(i for i, _ in seen)
            seen.clear()
            out = vae.decode(z, return_dict=False)[0]  # channels-last
    finally:
        h.unmount()
        for hk in hooks:
            hk.remove()
    assert_bitwise_equal(first, base, f"Wan 2.2 recording decode B={batch} {lat}")
    assert_bitwise_equal(out, base, f"Wan 2.2 channels-last decode B={batch} {lat}")
    assert out.is_contiguous()
    assert calls and all(cl for _, cl in calls), calls
    assert seen and all(i for i, _ in seen), seen
    assert sum(o for _, o in seen) >= len(seen) - (1 if batch > 1 else 0), seen


def test_dup_up_site_matches_diffusers_on_channels_last_input():
    """dup_up_forward against DupUp3D.forward for temporal and spatial factors, first chunk or
    not, batch 2: the same values; channels-last in, channels-last out."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    from ditfuse.models import autoencoder_kl_wan as wa

    x = torch.randn(2, 6, 3, 4, 5).to(torch.bfloat16)
    x_cl = x.contiguous(memory_format=torch.channels_last_3d)
    for in_c, out_c, ft in ((6, 6, 2), (6, 3, 1), (6, 12, 2)):
        mod = DupUp3D(in_c, out_c, factor_t=ft, factor_s=2)
        for first in (False, True):
            ref = mod(x, first_chunk=first)
            got = wa.dup_up_forward(mod, mod.forward, x_cl, first)
            assert_bitwise_equal(got, ref, f"DupUp3D {in_c}->{out_c} ft={ft} first={first}")
            assert wa._is_cl(got) or first
    assert wa.dup_up_forward(mod, lambda *a: "eager", x, False) == "eager"  # NCDHW input: diffusers' own


def test_channels_last_decode_switch(monkeypatch):
    """DITFUSE_WAN_VAE_CL=0 keeps every decode NCDHW (no channels-last convolution runs) and
    bitwise; the check sits in front of the CPU harness's stand-in for the CUDA requirement."""
    from ditfuse.models import autoencoder_kl_wan as wa

    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    calls = _channels_last_on_cpu(monkeypatch)
    harness = wa._cl_problem
    monkeypatch.setattr(wa, "_cl_problem", lambda dec, x: (None if wa.channels_last_decode_enabled()
                                                           else "DITFUSE_WAN_VAE_CL=0") or harness(dec, x))
    monkeypatch.setenv("DITFUSE_WAN_VAE_CL", "0")
    vae = _vae22(torch.bfloat16)
    z = torch.randn(1, 4, 2, 4, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
    h = ditfuse.accelerate(vae)
    try:
        with torch.no_grad():
            outs = [vae.decode(z, return_dict=False)[0] for _ in range(2)]
    finally:
        h.unmount()
    assert calls == []
    for o in outs:
        assert_bitwise_equal(o, base, "NCDHW decode")
    monkeypatch.undo()
    monkeypatch.setenv("DITFUSE_WAN_VAE_CL", "0")
    assert harness is not wa._cl_problem and wa._cl_problem(vae.decoder, z) == "DITFUSE_WAN_VAE_CL=0"
    monkeypatch.setenv("DITFUSE_WAN_VAE_CL", "1")
    assert wa.channels_last_decode_enabled() and wa._cl_problem(vae.decoder, z) == "not a 5-D CUDA latent"
