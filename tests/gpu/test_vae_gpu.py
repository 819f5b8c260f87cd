"""VAE adapters on CUDA: accelerated decode bitwise equal to plain diffusers, with the kernels
verified and nothing fallen back. AutoencoderKL (tiny and FLUX.1-VAE-size configs, batch 1 and
2, odd latent sizes, tiled + sliced decode, bf16 and fp32), AutoencoderKLQwenImage (Qwen-Image's
VAE on the Wan adapter's sites: 1024² images B=1 / 2, an odd size, two frames, fp32),
AutoencoderKLFlux2 (the FLUX.2 /
FLUX.3 VAE at its default size, 1024² B=1 and 2, tiled; a narrow fp32 one at an odd size) and AutoencoderKLWan (tiny and the
Wan 2.1 VAE config, chunked cached decode over several latent frames, tiled; the channels-last
decode from the second call on; the Wan 2.2 TI2V-5B VAE)."""

import pytest
import torch

from ditfuse.models.autoencoder_kl import ADAPTER
from ditfuse.models.autoencoder_kl_wan import ADAPTER as WAN_ADAPTER
from ditfuse.models.autoencoder_kl_wan import QWENIMAGE_ADAPTER
from tests.support.engaged import assert_engaged

DEV = "cuda"
CONV_CL = "layout.conv_channels_last"
CL_OPS = (CONV_CL, "norm.wan_rms_norm_silu_pad", "modulate.bias_residual", "layout.upsample_nearest2x")  # the channels-last decode's (bf16/fp16 only)
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512),
                layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
                use_quant_conv=False, use_post_quant_conv=False)
TINY = dict(FLUX_VAE, block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, sample_size=64)


# The Wan 2.1 VAE (AutoencoderKLWan's defaults spelled out), and a narrow one for many shapes.
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True])
WAN_TINY = dict(WAN_VAE, base_dim=32, num_res_blocks=1)
# The Wan 2.2 VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json's architecture fields): residual
# up blocks with the DupUp3D shortcut, 2x2-patchified 12-channel images, 48 latent channels.
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                 out_channels=12, patch_size=2, scale_factor_spatial=16)


def _kl_ops(dtype):
    """The AutoencoderKL ops a lossless decode runs: in bf16/fp16 every ResnetBlock2D takes the
    channels-last chain (norms writing channels-last, conv1 / conv2 without cuDNN's transposes,
    the decoder head alike); fp32 stays NCHW (cuDNN's fp32 NHWC kernels are another computation)."""
    from ditfuse.models.autoencoder_kl import channels_last_chain_enabled

    if dtype == torch.float32 or not channels_last_chain_enabled():
        return ("norm.group_norm_silu", "modulate.conv_bias", "modulate.conv_bias_residual")
    return ("norm.group_norm_silu", "norm.group_norm_silu_cl", "modulate.conv_bias", "modulate.conv_bias_cl",
            "modulate.conv_bias_residual_cl")


def _vae(cfg, dtype):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**cfg).to(DEV, dtype).eval()


def _compare(vae, z, label, adapter=ADAPTER, ops=None, declined_ok=()):
    import ditfuse
    from ditfuse.kernels.compare import assert_bitwise_equal

    ditfuse.gate.reset()
    with torch.no_grad():
        base = vae.decode(z, return_dict=False)[0]
        h = ditfuse.accelerate(vae)
        try:
            # Wan: the first decode records eager's layouts, the second runs channels-last (and
            # verifies those ops at first sight), the third runs their kernels alone.
            outs = [vae.decode(z, return_dict=False)[0] for _ in range(3 if adapter in (WAN_ADAPTER, QWENIMAGE_ADAPTER) else 2)]
        finally:
            h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"{label} decode {i + 1} ({'first sight' if i == 0 else 'again'})")
    if ops is None:
        ops = _kl_ops(z.dtype) if adapter is ADAPTER else adapter.ops()
    assert_engaged(ops, per_signature_ok=("modulate.conv_bias_cl", "modulate.conv_bias_residual_cl",
                                          "layout.conv_channels_last"), declined_ok=declined_ok)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("hw", [(8, 8), (9, 13)], ids=["8x8", "odd9x13"])
def test_tiny(dtype, batch, hw):
    vae = _vae(TINY, dtype)
    z = torch.randn(batch, 16, *hw, device=DEV).to(dtype)
    _compare(vae, z, f"tiny {dtype} B={batch} {hw}")


@pytest.mark.parametrize("hw", [(8, 8), (9, 13)], ids=["8x8", "odd9x13"])
def test_nchw_path_opt_out(hw, monkeypatch):
    """DITFUSE_VAE_CL=0: the NCHW path (every ResnetBlock2D's convolutions through cuDNN's own
    transposes), bitwise, its ops engaged; the FLUX.1 VAE at 1024² batch 2 too."""
    monkeypatch.setenv("DITFUSE_VAE_CL", "0")
    _compare(_vae(TINY, torch.bfloat16), torch.randn(2, 16, *hw, device=DEV).to(torch.bfloat16), f"tiny nchw {hw}")
    if hw == (8, 8):
        vae = _vae(FLUX_VAE, torch.bfloat16)
        _compare(vae, torch.randn(2, 16, 128, 128, device=DEV).to(torch.bfloat16), "FLUX VAE nchw 1024 B=2")


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_vae_1024(batch):
    vae = _vae(FLUX_VAE, torch.bfloat16)
    z = torch.randn(batch, 16, 128, 128, device=DEV).to(torch.bfloat16)
    _compare(vae, z, f"FLUX VAE 1024x1024 B={batch}")


def test_flux_vae_odd_size_fp32():
    vae = _vae(FLUX_VAE, torch.float32)
    z = torch.randn(1, 16, 37, 29, device=DEV)
    _compare(vae, z, "FLUX VAE fp32 296x232")


def _flux2_vae(dtype, **cfg):
    """AutoencoderKLFlux2 (the FLUX.2 / FLUX.3 VAE) as its class defaults declare it (blocks
    128/256/512/512, 32 latent channels, quant convs), random weights."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    return AutoencoderKLFlux2(**cfg).to(DEV, dtype).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_flux2_vae_1024(batch):
    vae = _flux2_vae(torch.bfloat16)
    z = torch.randn(batch, 32, 128, 128, device=DEV).to(torch.bfloat16)
    _compare(vae, z, f"FLUX.2 VAE 1024x1024 B={batch}")


def test_flux2_vae_odd_size_fp32_and_tiled():
    vae = _flux2_vae(torch.float32, block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                     up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, sample_size=64)
    _compare(vae, torch.randn(1, 32, 37, 29, device=DEV), "FLUX.2 VAE class fp32 odd")
    vae = _flux2_vae(torch.bfloat16)
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 256, 32
    _compare(vae, torch.randn(1, 32, 72, 56, device=DEV).to(torch.bfloat16), "FLUX.2 VAE tiled")


def test_tiled_and_sliced_decode():
    vae = _vae(FLUX_VAE, torch.bfloat16)
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 256, 32
    vae.enable_slicing()
    z = torch.randn(2, 16, 72, 56, device=DEV).to(torch.bfloat16)
    _compare(vae, z, "tiled + sliced")


def _wan_vae(cfg, dtype):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**cfg)
    with torch.no_grad():
        for m in vae.modules():
            if type(m).__name__ == "WanRMS_norm":
                m.gamma.normal_(1.0, 0.3)
    return vae.to(DEV, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("batch,lat", [
    (1, (3, 8, 8)),
    # B=2: one RMS_norm input is channels-last in eager itself (after the mid block's attention);
    # the adapter runs eager's chain there on purpose (logged), not through the gate.
    (2, (2, 9, 13)),
    (1, (1, 12, 20)),
    (2, (2, 8, 12)),  # batch 2 on the channels-last decode
], ids=["b1t3", "b2t2odd", "b1t1", "b2t2"])
def test_wan_tiny(dtype, batch, lat):
    vae = _wan_vae(WAN_TINY, dtype)
    z = torch.randn(batch, 16, *lat, device=DEV).to(dtype)
    # fp32 keeps the NCDHW decode (cuDNN's fp32 channels-last convolutions are other bits)
    cl = dtype is torch.bfloat16 and (lat[1] * lat[2]) % 4 == 0  # else the decode stays NCDHW
    ops = WAN_ADAPTER.ops() if cl else tuple(o for o in WAN_ADAPTER.ops() if o not in CL_OPS)
    _compare(vae, z, f"wan tiny {dtype} B={batch} {lat}", WAN_ADAPTER, ops)


def _wan_compare_cl(vae, z, label, declined_ok=()):
    """_compare, plus: the channels-last decode ran (its convolution op verified and called; the
    first decode records eager's layouts, the second runs channels-last)."""
    _compare(vae, z, label, WAN_ADAPTER, declined_ok=declined_ok)
    c = __import__("ditfuse").gate.report().calls.get(CONV_CL, {})
    assert c.get("kernel", 0) > 0, c


def test_wan_tiled_decode_channels_last():
    vae = _wan_vae(WAN_TINY, torch.bfloat16)
    vae.enable_tiling(tile_sample_min_height=128, tile_sample_min_width=128,
                      tile_sample_stride_height=96, tile_sample_stride_width=96)
    z = torch.randn(1, 16, 2, 24, 28, device=DEV).to(torch.bfloat16)
    _wan_compare_cl(vae, z, "wan tiny tiled decode")


def test_wan_vae_480x832():
    vae = _wan_vae(WAN_VAE, torch.bfloat16)
    z = torch.randn(1, 16, 3, 60, 104, device=DEV).to(torch.bfloat16)  # 9 frames at 480x832
    _wan_compare_cl(vae, z, "Wan 2.1 VAE 480x832x9")


def test_wan_vae_b2_channels_last():
    vae = _wan_vae(WAN_VAE, torch.bfloat16)
    z = torch.randn(2, 16, 2, 16, 24, device=DEV).to(torch.bfloat16)
    _wan_compare_cl(vae, z, "Wan 2.1 VAE B=2 128x192x5")


@pytest.mark.parametrize("batch,lat", [(1, (2, 16, 24)), (2, (2, 8, 12))], ids=["b1t2", "b2t2"])
def test_wan22_vae_channels_last(batch, lat):
    """The Wan 2.2 (TI2V-5B) VAE: its residual up blocks and DupUp3D shortcut on the channels-last
    decode, bitwise over three decodes, the channels-last convolution engaged."""
    vae = _wan_vae(WAN22_VAE, torch.bfloat16)
    z = torch.randn(batch, 48, *lat, device=DEV).to(torch.bfloat16)
    # At these small latents torch splits some of the 2.2 decoder's wide RMS norms (few positions,
    # many channels) across thread blocks; the kernels decline those (eager runs them, logged)
    # and must run on the rest (H100 run, round 19).
    _wan_compare_cl(vae, z, f"Wan 2.2 VAE B={batch} {lat}",
                    declined_ok=("norm.wan_rms_norm_silu", "norm.wan_rms_norm_silu_pad"))


def _qwenimage_vae(dtype):
    """AutoencoderKLQwenImage at its defaults (the Wan 2.1 VAE's blocks and sizes), random weights."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage().to(DEV, dtype).eval()


@pytest.mark.parametrize("batch,lat", [(1, (1, 128, 128)), (2, (1, 128, 128)), (1, (1, 41, 27)), (1, (2, 16, 24))],
                         ids=["1024px", "1024px-b2", "odd328x216", "2frames"])
def test_qwenimage_vae(batch, lat):
    """Qwen-Image's VAE (an image is one latent frame): bitwise over three decodes (recording,
    channels-last at first sight, kernels only); the channels-last ops engaged where the latent's
    H*W is a multiple of 4 (else the decode stays NCDHW, its RMS_norm kernels still engaged)."""
    vae = _qwenimage_vae(torch.bfloat16)
    z = torch.randn(batch, 16, *lat, device=DEV).to(torch.bfloat16)
    cl = (lat[1] * lat[2]) % 4 == 0
    ops = QWENIMAGE_ADAPTER.ops() if cl else tuple(o for o in QWENIMAGE_ADAPTER.ops() if o not in CL_OPS)
    _compare(vae, z, f"Qwen-Image VAE B={batch} {lat}", QWENIMAGE_ADAPTER, ops)


def test_qwenimage_vae_fp32_stays_ncdhw():
    vae = _qwenimage_vae(torch.float32)
    z = torch.randn(1, 16, 1, 32, 24, device=DEV)
    _compare(vae, z, "Qwen-Image VAE fp32", QWENIMAGE_ADAPTER,
             tuple(o for o in QWENIMAGE_ADAPTER.ops() if o not in CL_OPS))


@pytest.mark.parametrize("which", ["kl", "wan"])
def test_high_tier_admitted_and_closer_than_eager(which):
    """quality="high" on the real-width VAEs (bf16): the close norm op passes admission on this
    decode's own captured inputs, mounts on the norm sites with that record, runs (kernel calls >
    0), and the high decode is no further from an fp32 decode of the same weights than eager
    bf16 is; set back to lossless it is bitwise equal to diffusers again."""
    import ditfuse
    from ditfuse.contracts import admission, ops
    from ditfuse.kernels.compare import assert_bitwise_equal
    from ditfuse.models import capture_admission_batches, mounted_high

    if which == "kl":
        vae, vae32 = _vae(FLUX_VAE, torch.bfloat16), _vae(FLUX_VAE, torch.float32)
        z = torch.randn(1, 16, 64, 64, device=DEV)
        op, sites = "norm.group_norm_silu_fp32", {"vae.resnet", "vae.group_norm", "vae.decoder"}
    else:
        vae, vae32 = _wan_vae(WAN_VAE, torch.bfloat16), _wan_vae(WAN_VAE, torch.float32)
        z = torch.randn(1, 16, 2, 30, 52, device=DEV)
        op, sites = "norm.wan_rms_norm_silu_fp32", {"wan_vae.residual", "wan_vae.rms_norm"}
    zb = z.to(torch.bfloat16)

    def dec(m, x):
        with torch.no_grad():
            return m.decode(x, return_dict=False)[0].float()

    ref32, base = dec(vae32, zb.float()), dec(vae, zb)
    del vae32
    h = ditfuse.accelerate(vae)
    try:
        batches = capture_admission_batches(vae, run=lambda: dec(vae, zb))
        result = admission.admit_op(op, batches[op], DEV)
        assert result.admitted, admission.format_table([result])
        with admission.override_records([result]):
            res = h.set_quality("high")[type(vae).__name__]
            assert res.ok, res.failed
            assert {s.partition(":")[2] for s in mounted_high(vae)} == sites
            ops.reset_counts()
            from ditfuse.kernels.norm import group_norm_silu_triton as gn

            real, cl_calls = gn._launch_cl, []
            gn._launch_cl = lambda *a, **k: cl_calls.append(1) or real(*a, **k)
            try:
                dec(vae, zb)  # the channels-last decode starts on the second call (Wan)
                hi = dec(vae, zb)
            finally:
                gn._launch_cl = real
        assert ops.CLOSE[op].calls["kernel"] > 0
        if which == "kl":  # AutoencoderKL's high decode is channels-last: every GroupNorm on its in-place path
            assert ops.CLOSE[op].calls["eager"] == 0
            up = ditfuse.gate.report().calls.get("layout.upsample_nearest2d", {})
            assert up.get("kernel", 0) > 0 and not up.get("unsupported"), up
            assert len(cl_calls) == 2 * sum(type(m) is torch.nn.GroupNorm for m in vae.decoder.modules())
        err_hi, err_eager = (hi - ref32).norm().item(), (base - ref32).norm().item()
        assert err_hi <= 1.05 * err_eager, (err_hi, err_eager)
        h.set_quality("lossless")
        dec(vae, zb)
        assert_bitwise_equal(dec(vae, zb), base, "lossless after high")
    finally:
        h.unmount()


_CL = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "h_channels_last", "x_channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("b,cin,cout,hw,k", [(1, 512, 512, 128, 3), (2, 512, 512, 64, 3), (1, 256, 256, 512, 3),
                                             (1, 128, 128, 1024, 3), (1, 5, 7, 13, 3), (2, 16, 16, 9, 1)])
def test_conv_bias_residual_matches_eager(dtype, b, cin, cout, hw, k, layout):
    """ResnetBlock2D's tail, ``h + conv2(x)``: cuDNN's convolution without its bias, then the bias
    and the residual in one pass, against eager (which adds the bias in a pass of its own), at the
    FLUX.1 VAE decoder's conv2 shapes and odd ones, NCHW, channels-last (quality="high"'s decode)
    and mixed (the NCHW decode's residual stream is channels-last after the mid-block attention;
    the output takes h's layout, as eager's ``h + y``); bitwise, NaN/Inf in the residual."""
    from ditfuse.kernels import reference as ref
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.modulate import bias_residual_triton as br

    if dtype == torch.float32 and hw >= 1024:
        pytest.skip("fp32 at 1024²: 512 MiB per tensor; the smaller shapes cover the arithmetic")
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(b, cin, hw, hw, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(cout, cin, k, k, generator=gen, device=DEV) / (cin * k * k) ** 0.5).to(dtype)
    bias = torch.randn(cout, generator=gen, device=DEV).to(dtype)
    h = torch.randn(b, cout, hw, hw, generator=gen, device=DEV).to(dtype)
    h.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], device=DEV).to(dtype)
    if layout in ("channels_last", "x_channels_last"):
        x = _CL(x)
    if layout in ("channels_last", "h_channels_last"):  # h only: the NCHW decode after its attention
        h = _CL(h)
    geo = ((1, 1), (k // 2, k // 2), (1, 1), 1)
    assert br.can_use_conv_bias_residual(x, w, bias, h, *geo)
    got = br.conv_bias_residual(x, w, bias, h, *geo)
    exp = ref.conv_bias_residual(x, w, bias, h, *geo)
    assert got.stride() == exp.stride()
    mm = compare_outputs(got, exp, f"conv_bias_residual [{b},{cin}->{cout},{hw}²] k{k} {dtype}")
    assert mm is None, str(mm)


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("b,cin,cout,hw,k,stride", [(1, 16, 512, 128, 3, 1), (1, 512, 512, 256, 3, 1),
                                                    (1, 512, 256, 512, 3, 1), (1, 256, 128, 1024, 1, 1),
                                                    (1, 128, 3, 1024, 3, 1), (2, 7, 5, 13, 3, 2)])
def test_conv_bias_matches_eager(dtype, b, cin, cout, hw, k, stride, layout):
    """A biased Conv2d as cuDNN's convolution plus one vectorized bias pass, against eager (aten's
    broadcast bias add), at the FLUX.1 VAE decoder's conv_in / upsampler / narrowing conv1 /
    1x1 shortcut / conv_out shapes and an odd strided one; bitwise."""
    from ditfuse.kernels import reference as ref
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.modulate import bias_residual_triton as br

    if dtype == torch.float32 and hw >= 1024:
        pytest.skip("fp32 at 1024²: the smaller shapes cover the arithmetic")
    gen = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(b, cin, hw, hw, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(cout, cin, k, k, generator=gen, device=DEV) / (cin * k * k) ** 0.5).to(dtype)
    bias = torch.randn(cout, generator=gen, device=DEV).to(dtype)
    if layout == "channels_last":
        x = _CL(x)
    geo = ((stride, stride), (k // 2, k // 2), (1, 1), 1)
    assert br.can_use_conv_bias(x, w, bias, *geo)
    got, exp = br.conv_bias(x, w, bias, *geo), ref.conv_bias(x, w, bias, *geo)
    assert got.stride() == exp.stride()
    mm = compare_outputs(got, exp, f"conv_bias [{b},{cin}->{cout},{hw}²] k{k} s{stride} {dtype}")
    assert mm is None, str(mm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("b,cin,cout,hw,k,h_cl", [(1, 512, 512, 128, 3, False), (2, 512, 512, 64, 3, True),
                                                  (1, 512, 512, 256, 3, True), (1, 256, 256, 512, 3, True),
                                                  (1, 128, 128, 1024, 3, True), (1, 512, 256, 512, 3, False),
                                                  (1, 128, 3, 1024, 3, None), (2, 32, 5, 13, 3, False)])
def test_channels_last_convs_match_the_nchw_convolution(dtype, b, cin, cout, hw, k, h_cl):
    """modulate.conv_bias_cl / conv_bias_residual_cl: the convolution on a channels-last copy of x
    against eager's NCHW convolution of x (+ bias, + residual h in either layout, the output then in
    h's layout), bitwise at the FLUX.1 VAE decoder's conv1 / conv2 / conv_out shapes. cuDNN's NHWC
    kernel is the one its NCHW path wraps in transposes: an observation these shapes pin down (with
    at least 32 input channels: fewer are refused, br.CL_MIN_IN_CHANNELS, round 24)."""
    from ditfuse.kernels import reference as ref
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.modulate import bias_residual_triton as br

    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(b, cin, hw, hw, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(cout, cin, k, k, generator=gen, device=DEV) / (cin * k * k) ** 0.5).to(dtype)
    bias = torch.randn(cout, generator=gen, device=DEV).to(dtype)
    geo = ((1, 1), (k // 2, k // 2), (1, 1), 1)
    xc = _CL(x)
    if h_cl is None:
        got = br.conv_bias_cl(xc, w, bias, *geo)
        exp = ref.conv_bias_nchw(x, w, bias, *geo)
        assert got.is_contiguous()  # NCHW out: eager's layout
    else:
        h = torch.randn(b, cout, hw, hw, generator=gen, device=DEV).to(dtype)
        h.view(-1)[:2] = torch.tensor([float("nan"), float("-inf")], device=DEV).to(dtype)
        if h_cl:
            h = _CL(h)
        got = br.conv_bias_residual_cl(xc, w, bias, h, *geo)
        exp = ref.conv_bias_residual_nchw(x, w, bias, h, *geo)
        assert got.stride() == exp.stride() == h.stride()
    mm = compare_outputs(got, exp, f"cl conv [{b},{cin}->{cout},{hw}²] k{k} h_cl={h_cl} {dtype}")
    assert mm is None, str(mm)
