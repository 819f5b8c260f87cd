"""quality="high" on CUDA: every close kernel passes admission on activations captured from a
FLUX.1-dev-width model; a high-mode forward is within the admitted bounds against an fp64 forward;
lossless after unmount is bitwise equal to diffusers again."""

import pytest
import torch

import ditfuse
from ditfuse.contracts import admission, close
from ditfuse.contracts import quality as Q
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models.flux_high import HIGH_OPS, capture_admission_batches

from tests.cpu.tiny import flux_inputs

DEV = "cuda"
IMG, TXT = 1024, 256  # 512x512: the widths are FLUX.1-dev's, fewer tokens keep the fp64 pass quick


def _model(dtype=torch.bfloat16, layers=(1, 1)):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    with torch.device(DEV):
        m = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=layers[0], num_single_layers=layers[1],
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        )
    return m.to(dtype).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def setup():
    m = _model()
    inp = flux_inputs(m, batch=1, img=IMG, txt=TXT, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        base = m(**inp)[0]
    batches = {op: [] for op in HIGH_OPS}
    for ts in (0.9, 0.3):
        inp_t = dict(inp, timestep=torch.full((1,), ts, device=DEV, dtype=torch.bfloat16))
        for op, b in capture_admission_batches(m, inp_t).items():
            batches[op].extend(b)
    results = {op: admission.admit_op(op, batches[op], DEV) for op in HIGH_OPS}
    print("\n" + admission.format_table(results.values()))
    return m, inp, base, results


@pytest.mark.parametrize("op", HIGH_OPS)
def test_close_kernel_admitted(setup, op):
    r = setup[3][op]
    assert r.nonfinite_same
    assert r.admitted, f"{op}: {r.reason} (kernel rms {r.kernel_rms:.3e} vs eager {r.eager_rms:.3e}, " \
                       f"max {r.kernel_max:.3e} vs {r.eager_max:.3e}, mean {r.kernel_mean:.3e})"


def test_linear_gelu_epilogue_is_engaged():
    """On CUDA the fused op must not be eager's two-rounding chain (else there is nothing to gain)."""
    from ditfuse.kernels.activation.linear_gelu_tanh_torch import linear_gelu_tanh
    from ditfuse.kernels.reference import linear_gelu_tanh as eager

    g = torch.Generator(DEV).manual_seed(0)
    x = torch.randn(512, 3072, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(12288, 3072, device=DEV, generator=g) / 55).to(torch.bfloat16)
    b = torch.randn(12288, device=DEV, generator=g).to(torch.bfloat16)
    assert not torch.equal(linear_gelu_tanh(x, w, b).view(torch.int16), eager(x, w, b).view(torch.int16))


def _err(out, ref64):
    d = out.double() - ref64
    return d.pow(2).mean().sqrt().item(), d.abs().max().item(), d.mean().item()


def test_high_forward_within_admitted_bounds_vs_fp64_and_lossless_after(setup):
    m, inp, base, results = setup
    m64 = _model(torch.float64)
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    inp64 = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inp.items()}
    with torch.no_grad():
        ref64 = m64(**inp64)[0]
    del m64
    torch.cuda.empty_cache()

    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(results.values()):
            res = h.set_quality("high")[type(m).__name__]
        assert res.ok, res.failed
        close.reset_counts()
        with torch.no_grad():
            hi = m(**inp)[0]
        for op in HIGH_OPS:
            assert close.ALL[op].calls["kernel"] > 0 and close.ALL[op].calls["eager"] == 0, (op, dict(close.ALL[op].calls))
        e_rms, e_max, e_mean = _err(base, ref64)
        k_rms, k_max, k_mean = _err(hi, ref64)
        print(f"\nforward vs fp64: eager rms {e_rms:.4e} max {e_max:.4e} mean {e_mean:.3e}; "
              f"high rms {k_rms:.4e} max {k_max:.4e} mean {k_mean:.3e}")
        assert k_rms <= admission.RMS_LIMIT * e_rms
        assert abs(k_mean) <= admission.BIAS_LIMIT * e_rms

        h.set_quality("lossless")
        assert Q.mounted(m) == []
        with torch.no_grad():
            lo = m(**inp)[0]
        assert_bitwise_equal(lo, base, "lossless after high")
    finally:
        h.unmount()
    with torch.no_grad():
        assert_bitwise_equal(m(**inp)[0], base, "after unmount")
