"""quality="high" on CUDA: every close kernel passes admission on activations captured from
real-width FLUX.1-dev and Wan2.1-1.3B models (both including the close GEMM-GELU their blocks
declare) and from Chroma1-HD and HunyuanVideo models (the GEMM-GELU, their whole high tier); a
high-mode forward is within the admitted bounds against an fp64 forward; lossless after high is
bitwise equal to diffusers again. The capture takes the close ops each site runs under high
(``scope="high"``): bench/admit.py surveys the rest."""

import pytest
import torch

import ditfuse
from ditfuse.contracts import admission, ops
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import capture_admission_batches, families, mounted_sites

DEV = "cuda"
# The widths are the real ones; fewer tokens and blocks keep the fp64 passes quick.
CASES = {"flux": dict(layers=(1, 1), size="512x512", txt_tokens=256),
         # 3 latent frames x 20 x 20 patches = 1200 rows: the close GEMM-GELU's FF runs (>= 1024)
         "wan": dict(layers=(1,), size="320x320x9", txt_tokens=512),
         # the families whose high tier is the close GEMM-GELU alone (Site.high=False + high_ops),
         # at FLUX.1's widths: 1024 image rows, 256 text rows (declined: below the row threshold)
         "chroma": dict(layers=(1, 1), size="512x512", txt_tokens=256),
         # single blocks only: 1200 video + 256 text rows through one MLP
         "hunyuanvideo": dict(layers=(1, 1), size="320x320x9", txt_tokens=256)}
# Close ops each case admits and runs: FLUX.1 and Wan the fp32 norms and QK chains too; the
# others (Site.high=False) the GEMM-GELU alone.
EXPECTED_CLOSE = {
    "flux": {"norm.layernorm_modulate_fp32", "norm.gate_residual_layernorm_modulate_fp32",
             "rope.qk_rmsnorm_rope_fp32", "linear.linear_gelu_tanh_fast"},
    "wan": {"norm.layernorm_modulate_fp32", "norm.gate_residual_layernorm_modulate_fp32",
            "rope.qk_rmsnorm_across_heads_rope_fp32", "linear.linear_gelu_tanh_fast"},
    "chroma": {"linear.linear_gelu_tanh_fast"},
    "hunyuanvideo": {"linear.linear_gelu_tanh_fast"},
}
# GEMM-GELU calls below the close kernel's row threshold, run by eager's chain: the dual blocks'
# 256-row text-stream FeedForward (one dual block in each case; HunyuanVideo's dual blocks declare
# the op since round 32)
DECLINED = {"flux": {"linear.linear_gelu_tanh_fast": 1}, "chroma": {"linear.linear_gelu_tanh_fast": 1},
            "hunyuanvideo": {"linear.linear_gelu_tanh_fast": 1}}


@pytest.fixture(scope="module", params=list(CASES))
def setup(request):
    name = request.param
    fam, c = families.get(name), CASES[name]
    m = fam.build("dev", c["layers"], device=DEV, load="pretrained")
    inp = fam.make_inputs(m, 1, c["size"], device=DEV, txt_tokens=c["txt_tokens"])
    with torch.no_grad():
        base = m(**inp)[0]
    batches: dict[str, list] = {}
    h = ditfuse.accelerate(m)
    for sigma in (0.9, 0.3):
        inp_t = dict(inp, timestep=fam.timestep(sigma, 1, DEV, torch.bfloat16))
        for op, b in capture_admission_batches(m, inp_t).items():
            batches.setdefault(op, []).extend(b)
    h.unmount()
    results = {op: admission.admit_op(op, b, DEV) for op, b in batches.items()}
    print(f"\n{name}:\n" + admission.format_table(results.values()))
    return name, fam, m, inp, base, results


def test_close_kernels_admitted(setup):
    name, *_, results = setup
    assert set(results) == EXPECTED_CLOSE[name]
    bad = {op: r.reason for op, r in results.items() if not (r.admitted and r.nonfinite_same)}
    assert not bad, bad


def _err(out, ref64):
    d = out.double() - ref64
    return d.pow(2).mean().sqrt().item(), d.abs().max().item(), d.mean().item()


def test_high_forward_within_bounds_vs_fp64_and_lossless_after(setup):
    name, fam, m, inp, base, results = setup
    m64 = fam.build("dev", CASES[name]["layers"], device=DEV, dtype=torch.float64, load="plain")
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
        ops.reset_counts()
        with torch.no_grad():
            hi = m(**inp)[0]
        # the text stream's FeedForward (256 rows) is below the close GEMM-GELU's row threshold:
        # eager's chain runs it (the image stream's 1024 rows and the single block's MLP do not)
        declined = DECLINED.get(name, {})
        for op in results:
            c = ops.CLOSE[op].calls
            assert c["kernel"] > 0 and c["eager"] == declined.get(op, 0), (op, dict(c))
        e_rms, e_max, e_mean = _err(base, ref64)
        k_rms, k_max, k_mean = _err(hi, ref64)
        print(f"\n{name} forward vs fp64: eager rms {e_rms:.4e} max {e_max:.4e} mean {e_mean:.3e}; "
              f"high rms {k_rms:.4e} max {k_max:.4e} mean {k_mean:.3e}")
        assert k_rms <= admission.RMS_LIMIT * e_rms
        assert abs(k_mean) <= admission.BIAS_LIMIT * e_rms + 1e-12
        h.set_quality("lossless")
        assert mounted_sites(m) == []
        with torch.no_grad():
            lo = m(**inp)[0]
        assert_bitwise_equal(lo, base, "lossless after high")
    finally:
        h.unmount()
    with torch.no_grad():
        assert_bitwise_equal(m(**inp)[0], base, "after unmount")
