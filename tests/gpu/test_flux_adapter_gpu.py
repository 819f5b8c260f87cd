"""FLUX adapter on CUDA: accelerated transformer / pipeline bitwise equal to plain diffusers, and
the fast path provably engaged (every op verified, nothing fell back or was rejected)."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models.flux import ADAPTER

from tests.cpu.tiny import flux_inputs
from tests.support.engaged import TINY_VAE_CL_CONVS
from tests.support.engaged import assert_engaged as _assert_engaged
from tests.support.engaged import compare_accelerated

DEV = "cuda"


def _model(width_heads, layers, guidance, head_dim=128, joint=4096, pooled=768, in_ch=64, seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    with torch.device(DEV):
        m = FluxTransformer2DModel(
            patch_size=1, in_channels=in_ch, num_layers=layers[0], num_single_layers=layers[1],
            attention_head_dim=head_dim, num_attention_heads=width_heads, joint_attention_dim=joint,
            pooled_projection_dim=pooled, guidance_embeds=guidance, axes_dims_rope=(16, 56, 56),
        )
    return m.to(torch.bfloat16).eval()


def assert_engaged(ops=ADAPTER.ops()):
    _assert_engaged(ops)


def _compare(m, inp):
    compare_accelerated(m, inp, ADAPTER.ops(), "flux")


@pytest.mark.parametrize("guidance", [False, True], ids=["noguid", "guid"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("img", [256, 1024])
def test_tiny_config_bitwise(guidance, batch, img):
    m = _model(2, (1, 1), guidance, joint=64, pooled=32, in_ch=16)
    _compare(m, flux_inputs(m, batch=batch, img=img, txt=64, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("guidance", [True, False], ids=["guid", "noguid"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("img", [1024, 4096], ids=["512px", "1024px"])
def test_flux_dev_width_bitwise(guidance, batch, img):
    m = _model(24, (2, 2), guidance)
    _compare(m, flux_inputs(m, batch=batch, img=img, txt=512, dtype=torch.bfloat16, device=DEV))


def test_cuda_graph_replays_bitwise():
    m = _model(24, (1, 1), True)
    inp = flux_inputs(m, batch=1, img=1024, txt=512, dtype=torch.bfloat16, device=DEV)
    inp2 = flux_inputs(m, batch=1, img=1024, txt=512, dtype=torch.bfloat16, device=DEV, seed=7)
    inp3 = flux_inputs(m, batch=2, img=256, txt=512, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        base, base2, base3 = m(**inp)[0], m(**inp2)[0], m(**inp3)[0]
        h = ditfuse.accelerate(m, cuda_graph=True)
        runner = h._graphs["FluxTransformer2DModel"]
        outs = [m(**inp)[0], m(**inp)[0], m(**inp)[0], m(**inp2)[0]]  # warm-up, capture, replay, replay
        assert runner.captures == 1 and runner.replays >= 2
        outs3 = [m(**inp3)[0] for _ in range(3)]  # a new shape captures a new graph
        assert runner.captures == 2
        h.unmount()
    for i, o in enumerate(outs[:3]):
        assert_bitwise_equal(o, base, f"graph call {i}")
    assert_bitwise_equal(outs[3], base2, "replay with new inputs")
    for i, o in enumerate(outs3):
        assert_bitwise_equal(o, base3, f"second shape call {i}")
    assert_engaged()


def test_cuda_graph_cache_is_bounded_and_stays_bitwise():
    """max_cuda_graphs=1: a second shape's capture releases the first shape's graph; when the
    first shape returns it runs eagerly once, then is captured again. Every output bitwise equal."""
    m = _model(24, (1, 1), True)
    a = flux_inputs(m, batch=1, img=256, txt=512, dtype=torch.bfloat16, device=DEV)
    b = flux_inputs(m, batch=2, img=256, txt=512, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        base_a, base_b = m(**a)[0], m(**b)[0]
        h = ditfuse.accelerate(m, cuda_graph=True, max_cuda_graphs=1)
        runner = h._graphs["FluxTransformer2DModel"]
        outs = [(m(**x)[0], ref) for x, ref in ((a, base_a), (a, base_a), (b, base_b), (b, base_b),
                                                (a, base_a), (a, base_a), (a, base_a))]
        captures, evictions, live = runner.captures, runner.evictions, len(runner.live)
        h.unmount()
    assert (captures, evictions, live) == (3, 2, 1), (captures, evictions, live)
    for i, (o, ref) in enumerate(outs):
        assert_bitwise_equal(o, ref, f"call {i}")
    assert_engaged()


def test_whole_pipeline_image_bitwise():
    """tiny-flux encoders/VAE with a head_dim-128 transformer, 4 steps, bf16, CFG-free FLUX.1-dev style."""
    from diffusers import FluxPipeline

    from ditfuse.runtime.presets import load_model

    lm = load_model("tiny-flux", device=DEV, dtype="bfloat16")
    comps = dict(lm.pipe.components)
    comps["transformer"] = _model(2, (1, 1), True, joint=comps["transformer"].config.joint_attention_dim,
                                  pooled=comps["transformer"].config.pooled_projection_dim,
                                  in_ch=comps["transformer"].config.in_channels)
    pipe = FluxPipeline(**comps).to(DEV)
    pipe.set_progress_bar_config(disable=True)

    def run():
        g = torch.Generator(DEV).manual_seed(0)
        return pipe("a red fox", height=256, width=256, num_inference_steps=4, guidance_scale=3.5,
                    generator=g, output_type="pt", **lm.call_kwargs).images

    base = run()
    h = ditfuse.accelerate(pipe)
    assert "transformer (FluxTransformer2DModel): flux adapter" in h.report().summary()
    fast = run()
    h.unmount()
    assert_bitwise_equal(fast, base, "pipeline image")
    # tiny-flux's 8- and 16-channel VAE convolutions are declined by the channels-last path
    _assert_engaged(ADAPTER.ops(), per_signature_ok=TINY_VAE_CL_CONVS, declined_ok=TINY_VAE_CL_CONVS)
