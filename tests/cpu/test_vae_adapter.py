"""AutoencoderKL adapter on CPU: mounting, the report, and the fast forwards on their reference
chains (DITFUSE_DISABLE=all) bitwise equal to diffusers for plain, tiled and sliced decode. The
kernel's bits against CUDA eager are tests/gpu/test_vae_gpu.py's."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal


def _vae(dtype=torch.float32, seed=0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32,
    )
    return vae.to(dtype).eval()


def _flux2_vae(dtype=torch.float32, seed=0):
    """A tiny AutoencoderKLFlux2 (FLUX.2 / FLUX.3's VAE class: the same Decoder, quant convs on)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32,
    )
    return vae.to(dtype).eval()


def _decode(vae, z):
    with torch.no_grad():
        return vae.decode(z, return_dict=False)[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_on_reference_chains_equals_diffusers(batch, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae()
    z = torch.randn(batch, 4, 9, 7)  # odd latent sizes
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "autoencoder_kl"
        sites = {s for _, s in rep.sites}
        assert sites == {"vae.resnet", "vae.group_norm", "vae.conv", "vae.decoder", "vae.upsample"}
        assert_bitwise_equal(_decode(vae, z), base, "decode")
    finally:
        h.unmount()
    assert_bitwise_equal(_decode(vae, z), base, "after unmount")


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled+sliced"])
def test_flux2_vae_mounts_and_decodes_on_reference_chains(tiled, monkeypatch):
    """AutoencoderKLFlux2 (FLUX.2 / FLUX.3) takes the same sites: every one mounts, nothing is
    skipped, and the decode on the reference chains is bitwise diffusers' (plain, tiled + sliced)."""
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _flux2_vae()
    z = torch.randn(2, 4, 9, 7)
    if tiled:
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 8
        vae.enable_slicing()
        z = torch.randn(2, 4, 20, 12)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "autoencoder_kl", h.report().summary()
        assert {s for _, s in rep.sites} == {"vae.resnet", "vae.group_norm", "vae.conv", "vae.decoder", "vae.upsample"}
        assert not rep.skipped_sites, rep.skipped_sites
        assert_bitwise_equal(_decode(vae, z), base, "AutoencoderKLFlux2 decode")
    finally:
        h.unmount()
    assert_bitwise_equal(_decode(vae, z), base, "after unmount")


@pytest.mark.slow  # the GroupNorm kernel through the interpreter
def test_flux2_vae_fast_path_reaches_the_gate():
    vae = _flux2_vae()
    z = torch.randn(1, 4, 6, 6)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        assert_bitwise_equal(_decode(vae, z), base, "AutoencoderKLFlux2, interpreter kernels through the gate")
        c = ditfuse.gate.report().calls.get("norm.group_norm_silu", {})
        assert sum(c.values()) > 0, c
    finally:
        h.unmount()


@pytest.mark.parametrize("batch", [1, 2])
def test_channels_last_chain_on_reference_chains_equals_diffusers(batch, monkeypatch):
    """The lossless bf16/fp16 CUDA decode runs every ResnetBlock2D as norm (written channels-last)
    -> conv1 -> norm -> conv2 + residual on channels-last ops, and the decoder head alike. Forced
    on here (its CUDA-only predicates patched) with every op on its reference chain: bitwise
    diffusers, every decoder resnet through the chain, the image NCHW."""
    from ditfuse.models import autoencoder_kl as akl

    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    assert akl.channels_last_chain_enabled()  # on unless DITFUSE_VAE_CL=0
    ran = []
    real = akl._resnet_channels_last
    monkeypatch.setattr(akl, "_channels_last_chain", lambda block, x: x.dim() == 4 and block.upsample is None)
    monkeypatch.setattr(akl, "_head_channels_last", lambda dec, x: True)
    monkeypatch.setattr(akl, "_resnet_channels_last", lambda *a: ran.append(1) or real(*a))
    vae = _vae(torch.bfloat16)
    z = torch.randn(batch, 4, 9, 7).to(torch.bfloat16)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        out = _decode(vae, z)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "channels-last chain decode")
    assert out.is_contiguous()
    from diffusers.models.resnet import ResnetBlock2D

    assert len(ran) == sum(isinstance(m, ResnetBlock2D) for m in vae.decoder.modules())


def test_every_resnet_block_mounts_its_fused_site():
    """The decoder's up blocks build their ResnetBlock2Ds with time_embedding_norm="group" (the
    Decoder's norm_type) and the mid block with "default": without a time embedding both run
    norm -> SiLU, so every ResnetBlock2D takes the fused site (rounds 5-13 skipped the up blocks'
    twelve of the FLUX.1 VAE decoder's fourteen, leaving their SiLU eager); nothing is skipped."""
    from diffusers.models.resnet import ResnetBlock2D

    vae = _vae()
    kinds = {m.time_embedding_norm for m in vae.modules() if isinstance(m, ResnetBlock2D)}
    assert kinds == {"default", "group"}, kinds
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        assert not rep.skipped_sites, rep.skipped_sites
        n = sum(isinstance(m, ResnetBlock2D) for m in vae.modules())
        assert sum(s == "vae.resnet" for _, s in rep.sites) == n
    finally:
        h.unmount()


def test_scale_shift_resnet_keeps_diffusers_forward():
    """A ResnetBlock2D with time_embedding_norm="scale_shift" and no time embedding raises in
    diffusers' forward; the fused site does not take it (the report says why)."""
    from ditfuse.models.autoencoder_kl import _resnet_applies
    from diffusers.models.resnet import ResnetBlock2D

    block = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=None, groups=4,
                          time_embedding_norm="scale_shift")
    assert "scale_shift" in _resnet_applies(block)
    assert _resnet_applies(ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=None, groups=4,
                                         time_embedding_norm="group")) is None


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_resnet_tail_on_reference_chain_equals_diffusers(scale, monkeypatch):
    """conv2 + residual as modulate.conv_bias_residual (a CUDA path; forced here) on its reference
    chain: the decode equals diffusers' bitwise, so the site passes the op diffusers' operands
    (conv2's input and parameters, the shortcut's output) and skipping the division by
    output_scale_factor = 1 changes no bit; every decoder ResnetBlock2D took the branch."""
    from diffusers.models.resnet import ResnetBlock2D

    from ditfuse.models import autoencoder_kl as akl

    monkeypatch.setenv("DITFUSE_DISABLE", "all")  # every op runs its reference (eager's chain)
    taken = []
    monkeypatch.setattr(akl, "_tail_applies", lambda block, hidden_states: taken.append(block) or True)
    vae = _vae()
    for m in vae.decoder.modules():
        if isinstance(m, ResnetBlock2D):
            m.output_scale_factor = scale  # 1: the division is skipped; else it runs after the op
    z = torch.randn(2, 4, 9, 7)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        assert_bitwise_equal(_decode(vae, z), base, f"decode with the fused resnet tail, scale {scale}")
    finally:
        h.unmount()
    decoder_resnets = [m for m in vae.decoder.modules() if isinstance(m, ResnetBlock2D)]
    assert len(taken) == len(decoder_resnets) and {id(b) for b in taken} == {id(b) for b in decoder_resnets}


def test_conv_site_on_reference_chain_equals_diffusers(monkeypatch):
    """Every biased Conv2d through modulate.conv_bias (a CUDA path; forced here) on its reference
    chain: the decode equals diffusers' bitwise (the site hands the op the module's stride,
    padding, dilation and groups), and every decoder Conv2d took the op."""
    from ditfuse.models import autoencoder_kl as akl

    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    taken = []
    monkeypatch.setattr(akl, "_conv_on_op", lambda x: taken.append(x.shape) or True)
    vae = _vae()
    z = torch.randn(1, 4, 9, 7)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        rep = h.report().components[0]
        convs = [p for p, s in rep.sites if s == "vae.conv"]
        assert len(convs) == sum(type(m) is torch.nn.Conv2d and m.bias is not None for m in vae.modules())
        assert_bitwise_equal(_decode(vae, z), base, "decode with every Conv2d on modulate.conv_bias")
    finally:
        h.unmount()
    # the decoder's convolutions, the resnets' conv2 included (CPU: the tail stays diffusers')
    assert len(taken) == sum(type(m) is torch.nn.Conv2d for m in vae.decoder.modules()) + (
        vae.post_quant_conv is not None)


def test_resnet_tail_applies_only_where_it_is_eager():
    from types import SimpleNamespace

    from diffusers.models.resnet import ResnetBlock2D

    from ditfuse.models.autoencoder_kl import _tail_applies

    block = ResnetBlock2D(in_channels=8, out_channels=8, temb_channels=None, groups=4).eval()
    on_cuda, on_cpu = SimpleNamespace(is_cuda=True), torch.zeros(1)
    assert _tail_applies(block, on_cuda)
    assert not _tail_applies(block, on_cpu)  # aten's CPU convolutions add the bias inside
    block.train()
    assert not _tail_applies(block, on_cuda)
    block.eval()
    handle = block.conv2.register_forward_hook(lambda *a: None)  # the op would skip the hook
    assert not _tail_applies(block, on_cuda)
    handle.remove()
    block.conv2.padding_mode = "reflect"
    assert not _tail_applies(block, on_cuda)
    block.conv2.padding_mode, block.conv2.padding = "zeros", "same"
    assert not _tail_applies(block, on_cuda)


def test_conv_site_refuses_what_the_op_does_not_take():
    from ditfuse.models.autoencoder_kl import _conv_applies

    assert _conv_applies(torch.nn.Conv2d(4, 4, 3, padding=1)) is None
    assert "bias" in _conv_applies(torch.nn.Conv2d(4, 4, 3, padding=1, bias=False))
    assert "padding_mode" in _conv_applies(torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    assert "padding=" in _conv_applies(torch.nn.Conv2d(4, 4, 3, padding="same"))


def test_tiled_and_sliced_decode_on_reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    vae = _vae()
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 8  # several overlapping tiles
    vae.enable_slicing()
    z = torch.randn(2, 4, 20, 12)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        assert_bitwise_equal(_decode(vae, z), base, "tiled + sliced decode")
    finally:
        h.unmount()


@pytest.mark.slow  # the GroupNorm kernel through the interpreter
def test_fast_path_reaches_the_gate_under_the_interpreter():
    vae = _vae()
    z = torch.randn(1, 4, 6, 6)
    h = ditfuse.accelerate(vae)
    try:
        _decode(vae, z)
        c = ditfuse.gate.report().calls.get("norm.group_norm_silu", {})
        assert sum(c.values()) > 0, c
    finally:
        h.unmount()


def test_high_tier_needs_admission_then_runs_the_close_group_norm():
    """quality="high" on a bf16 VAE: refused (the whole model stays lossless) without an admission
    record for norm.group_norm_silu_fp32; with one, both GroupNorm sites move to high, the close
    kernel runs (interpreter) and the decode stays close to diffusers; set back to lossless it is
    bitwise again. The capture for admission records the close op's inputs from a decode."""
    from ditfuse.contracts import admission, ops
    from ditfuse.models import capture_admission_batches, mounted_high

    vae = _vae(torch.bfloat16)
    z = torch.randn(1, 4, 6, 6).to(torch.bfloat16)
    base = _decode(vae, z)
    h = ditfuse.accelerate(vae)
    try:
        with admission.override_records({}):
            res = h.set_quality("high")["AutoencoderKL"]
        assert not res.ok and "norm.group_norm_silu_fp32" in str(res.failed), res.failed
        assert mounted_high(vae) == []
        got = capture_admission_batches(vae, run=lambda: _decode(vae, z))
        assert set(got) == {"norm.group_norm_silu_fp32"} and len(got["norm.group_norm_silu_fp32"]) > 0
        with pytest.raises(ValueError, match="either inputs"):
            capture_admission_batches(vae)
        with admission.override_records([admission.admitted_record("norm.group_norm_silu_fp32")]):
            res = h.set_quality("high")["AutoencoderKL"]
            assert res.ok, res.failed
            assert {s.partition(":")[2] for s in mounted_high(vae)} == {"vae.resnet", "vae.group_norm", "vae.decoder"}
            ops.reset_counts()
            # the high decode runs channels-last: every decoder convolution sees channels-last
            # input, and the close GroupNorm takes its in-place channels-last path every time
            seen = []
            hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append(
                a[0].is_contiguous(memory_format=torch.channels_last) and not a[0].is_contiguous()))
                for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
            from ditfuse.kernels.norm import group_norm_silu_triton as gn

            real, cl_calls = gn._launch_cl, []
            gn._launch_cl = lambda *a, **k: cl_calls.append(1) or real(*a, **k)
            try:
                hi = _decode(vae, z)
            finally:
                gn._launch_cl = real
                for hk in hooks:
                    hk.remove()
        assert seen and all(seen), seen
        assert hi.is_contiguous()
        n_gn = sum(type(m) is torch.nn.GroupNorm for m in vae.decoder.modules())
        assert ops.CLOSE["norm.group_norm_silu_fp32"].calls["kernel"] == n_gn == len(cl_calls)
        assert ops.CLOSE["norm.group_norm_silu_fp32"].calls["eager"] == 0
        torch.testing.assert_close(hi.float(), base.float(), rtol=0.05, atol=0.05)
        h.set_quality("lossless")
        assert mounted_high(vae) == []
        assert_bitwise_equal(_decode(vae, z), base, "back to lossless")
    finally:
        h.unmount()


def test_upsample_site_on_channels_last_memory(monkeypatch):
    """vae.upsample: a channels-last input (the high decode's) takes layout.upsample_nearest2d and
    then the upsampler's conv, bitwise Upsample2D's forward; NCHW input and output_size keep
    diffusers' forward (the op never sees them)."""
    from diffusers.models.upsampling import Upsample2D

    from ditfuse.models import autoencoder_kl as akl

    up = Upsample2D(8, use_conv=True, out_channels=8).to(torch.bfloat16).eval()
    assert akl._upsample_applies(up) is None
    assert "norm" in akl._upsample_applies(Upsample2D(8, use_conv=True, norm_type="rms_norm", eps=1e-6))
    x = torch.randn(2, 8, 5, 7).to(torch.bfloat16)
    xc = x.contiguous(memory_format=torch.channels_last)
    calls = []

    class Ops:
        def upsample_nearest2d(self, t):
            calls.append(t.shape)
            from ditfuse.kernels.layout.upsample_nearest_triton import upsample_nearest2d

            return upsample_nearest2d(t)

    with torch.no_grad():
        want = up(xc)
        got = akl.upsample_forward(up, up.forward, xc, _ops=Ops())
        assert calls == [xc.shape]
        assert_bitwise_equal(got, want, "upsample channels-last")
        assert got.is_contiguous(memory_format=torch.channels_last)
        akl.upsample_forward(up, up.forward, x, _ops=Ops())
        akl.upsample_forward(up, up.forward, xc, output_size=(10, 14), _ops=Ops())
    assert len(calls) == 1
