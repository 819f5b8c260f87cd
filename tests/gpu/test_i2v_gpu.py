"""Image-conditioned pipelines on CUDA (round 23, written without a GPU; first run pending): what
an image-to-video or image-editing call adds to the paths the other GPU tests cover.

- The Wan VAE's **encode** (the I2V pipelines encode the conditioning video: the first frame and
  zeros) through the autoencoder_kl_wan adapter's sites, bitwise equal to diffusers, every op
  verified and nothing fallen back: the tiny config and the Wan 2.1 VAE at 480x832x17; bf16 and
  fp32. No other GPU test encodes.
- The two tiny runtime pipelines (``tiny-wan-i2v``, ``tiny-ltx-i2v``) end to end in bf16:
  accelerated bitwise equal to plain diffusers, every op of the transformer's adapter verified
  (CLIP image tokens through Wan's added k/v; LTX's per-token timesteps).
- ``tiny-hunyuanvideo15-i2v`` (HunyuanVideo 1.5 image-to-video, written in round 24, first run
  pending): two prompts on one image at the preset's 16:9 bucket (256x144) with the pipeline's full
  text lengths, the image's SigLIP tokens in the joint sequence; the VAE decodes the two with
  slicing, as the runtime sets it.
- ``tiny-skyreels-v2-i2v`` (SkyReels-V2 image-to-video, written in round 24, first run pending):
  two prompts on one image, CLIP image tokens through the added k/v of the ``skyreels_v2``
  adapter's blocks (Wan's sites on diffusers' copies), the Wan VAE's encode and decode.
- ``tiny-flux-kontext`` (FLUX.1 Kontext editing): the AutoencoderKL **encode** of the input image
  (auto-resized to Kontext's ~1 MP resolution, as diffusers does) and the flux adapter with the
  image's tokens in the sequence, bitwise against plain diffusers."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import flux, hunyuanvideo15, ltx, wan, wan_variants
from ditfuse.models import hunyuanvideo15_configs as hc
from ditfuse.models import ltx_configs as lc
from ditfuse.models import wan_configs as wc
from ditfuse.models import wan_variants_configs as wv
from ditfuse.models.autoencoder_kl_wan import ADAPTER as WAN_VAE_ADAPTER
from tests.support import video_runtime as vr
from tests.gpu.test_vae_gpu import WAN_TINY, WAN_VAE, _wan_vae
from tests.support.engaged import TINY_VAE_CL_CONVS, assert_engaged

DEV = "cuda"


def _i2v_condition(batch, frames, height, width, dtype):
    """WanImageToVideoPipeline's video_condition: the image as frame 0, zeros after it."""
    g = torch.Generator().manual_seed(1)
    first = torch.rand(batch, 3, 1, height, width, generator=g) * 2 - 1
    return torch.cat([first, first.new_zeros(batch, 3, frames - 1, height, width)], dim=2).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg,shape", [(WAN_TINY, (1, 9, 64, 96)), (WAN_TINY, (2, 5, 48, 80)),
                                       (WAN_VAE, (1, 17, 480, 832))], ids=["tiny", "tiny-b2", "wan21-480p"])
def test_wan_vae_encode_bitwise(cfg, shape, dtype):
    vae = _wan_vae(cfg, dtype)
    x = _i2v_condition(*shape, dtype)
    with torch.no_grad():
        base = vae.encode(x).latent_dist.mode()
        ditfuse.gate.reset()
        h = ditfuse.accelerate(vae)
        try:
            outs = [vae.encode(x).latent_dist.mode() for _ in range(2)]
        finally:
            h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"wan vae encode {shape} {dtype} ({'first sight' if i == 0 else 'again'})")
    # the encoder runs the norm sites (NCDHW: the channels-last path is the decoder's)
    ran = {op for op, c in ditfuse.gate.report().calls.items() if c.get("verify", 0) > 0}
    assert ran and ran <= set(WAN_VAE_ADAPTER.ops()), ran
    assert_engaged(tuple(ran), per_signature_ok=("layout.conv_channels_last",))


def _pipeline_bitwise(pipe, call, adapter):
    """``call(pipe)`` accelerated (transformer and VAE) is bitwise ``call(pipe)`` plain, twice;
    every op of the transformer's adapter verified and ran; a per-signature cuDNN refusal of the
    VAE's channels-last convolutions is the gate doing its job (tests/gpu/test_vae_gpu.py), and so
    is their decline of convolutions with fewer than 32 input channels (tiny-flux's VAE:
    CL_MIN_IN_CHANNELS, round 24; round 26's H100 run saw it as the only fallback)."""
    base = call(pipe)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        outs = [call(pipe) for _ in range(2)]
    finally:
        h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"{adapter.family} i2v pipeline, call {i + 1}")
    assert_engaged(adapter.ops(), per_signature_ok=(*TINY_VAE_CL_CONVS, "layout.conv_channels_last"),
                   declined_ok=TINY_VAE_CL_CONVS)


def test_tiny_wan_i2v_pipeline_bitwise():
    pipe = vr.quiet(wc.build_tiny_wan_i2v()).to(DEV, torch.bfloat16)

    def call(p):
        return vr.frames(p, 4, image=vr.picture(4), prompt="a fox", width=64, height=48, num_frames=5,
                         max_sequence_length=wc.TINY_WAN_TEXT_LEN)

    _pipeline_bitwise(pipe, call, wan.ADAPTER)


def test_tiny_ltx_i2v_pipeline_bitwise():
    pipe = vr.quiet(lc.build_tiny_i2v_pipeline()).to(DEV, torch.bfloat16)

    def call(p):
        return vr.frames(p, 3, image=[vr.picture(0), vr.picture(1)], prompt=["a fox", "a cat"],
                         negative_prompt="blurry", width=96, height=64, num_frames=9,
                         generator=[torch.Generator().manual_seed(s) for s in (3, 4)])

    _pipeline_bitwise(pipe, call, ltx.ADAPTER)


def test_tiny_hunyuanvideo15_i2v_pipeline_bitwise():
    pipe = vr.quiet(hc.build_tiny_i2v_pipeline()).to(DEV, torch.bfloat16)
    hc.set_text_lengths(pipe)  # the crop of the tiny tokenizer's template, as the preset loads it
    pipe.vae.enable_slicing()  # diffusers 0.42.1 decodes a batch of this VAE's videos only so

    def call(p):
        return vr.frames(p, 3, image=vr.picture(0, 160, 90), prompt=["a fox", "a cat"], num_frames=5,
                         generator=[torch.Generator().manual_seed(s) for s in (3, 4)])

    _pipeline_bitwise(pipe, call, hunyuanvideo15.ADAPTER)


def test_tiny_skyreels_v2_i2v_pipeline_bitwise():
    pipe = vr.quiet(wv.build_tiny_i2v_pipeline()).to(DEV, torch.bfloat16)

    def call(p):
        return vr.frames(p, 3, image=vr.picture(0), prompt=["a fox", "a cat"], negative_prompt="blurry", width=64,
                         height=48, num_frames=5, generator=[torch.Generator().manual_seed(s) for s in (3, 4)],
                         **wv.TINY_CALL_KWARGS)

    _pipeline_bitwise(pipe, call, wan_variants.SKYREELS_V2_ADAPTER)


def test_tiny_flux_kontext_pipeline_bitwise():
    from ditfuse.runtime.presets import build_tiny_flux_kontext

    pipe = build_tiny_flux_kontext().to(DEV, torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)

    def call(p):
        return p(image=vr.picture(0, 96, 64), prompt="make it red", height=64, width=96, max_area=64 * 96,
                 num_inference_steps=2, output_type="pt", generator=torch.Generator().manual_seed(1),
                 max_sequence_length=128).images

    _pipeline_bitwise(pipe, call, flux.ADAPTER)
