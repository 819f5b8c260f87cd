"""quality="high" on a tiny bf16 FluxTransformer2DModel (close kernels under TRITON_INTERPRET=1):
guards, all-or-nothing, the fast path engaged, unmount back to bitwise diffusers."""

import pytest
import torch

import ditfuse
from ditfuse.contracts import admission, close
from ditfuse.contracts import quality as Q
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.models.flux_high import HIGH_OPS, capture_admission_batches, mark_high_sites

from .tiny import flux_inputs, tiny_flux

ADMITTED = [admission.admitted_record(op) for op in HIGH_OPS]
# 1 dual block (+ its 2 FeedForward GELUs), 1 single block, 2 attentions, norm_out
SITES = sorted([
    "transformer_blocks.0:flux.dual_block", "transformer_blocks.0.ff.net.0:flux.linear_gelu_tanh",
    "transformer_blocks.0.ff_context.net.0:flux.linear_gelu_tanh", "transformer_blocks.0.attn:flux.attention",
    "single_transformer_blocks.0:flux.single_block", "single_transformer_blocks.0.attn:flux.attention",
    "norm_out:flux.norm_out",
])


@pytest.fixture(scope="module")
def model_and_base():
    m = tiny_flux(dtype=torch.bfloat16, guidance=True)
    inp = flux_inputs(m, batch=2, dtype=torch.bfloat16)
    return m, inp, _run(m, inp)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def test_high_mounts_all_sites_runs_close_kernels_and_unmounts_bitwise(model_and_base):
    m, inp, base = model_and_base
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED):
            res = h.set_quality("high")["FluxTransformer2DModel"]
            assert res.ok, res.failed
            assert sorted(res.mounted) == SITES and sorted(Q.mounted(m)) == SITES
            close.reset_counts()
            hi = _run(m, inp)
            for op in HIGH_OPS:
                assert close.ALL[op].calls["kernel"] > 0 and close.ALL[op].calls["eager"] == 0, (op, close.ALL[op].calls)
            mm = first_mismatch(hi, base)
            assert mm is not None, "high mode ran but changed no bit: the close kernels were not used"
            err = (hi.float() - base.float()).abs().max().item()
            assert err < 0.05 * base.float().abs().max().item()
        res = h.set_quality("lossless")["FluxTransformer2DModel"]
        assert sorted(res.unmounted) == SITES and Q.mounted(m) == []
        assert_bitwise_equal(_run(m, inp), base, "lossless after high")
        # the lossless hooks are still there, under the removed high ones
        assert "ditfuse.lossless.flux.dual_block" in m.transformer_blocks[0]._diffusers_hook.hooks
    finally:
        h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")


def test_no_admission_record_mounts_nothing(model_and_base):
    m, inp, base = model_and_base
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records({}):
            res = h.set_quality("high")["FluxTransformer2DModel"]
        assert not res.ok and res.mounted == [] and Q.mounted(m) == []
        assert res.failed.guard.startswith("admitted:") and res.failed.reason.startswith("not admitted:")
        assert "quality=high not mounted" in h.report().summary()
        assert_bitwise_equal(_run(m, inp), base)
    finally:
        h.unmount()


def test_failed_admission_is_not_mountable(model_and_base):
    m, _, _ = model_and_base
    recs = {r.op: r for r in ADMITTED}
    recs["rope.qk_rmsnorm_rope_fp32"] = admission.AdmissionResult(
        "rope.qk_rmsnorm_rope_fp32", 1.8, 1.0, 0.0, True, False, "H200", reason="RMS error 1.800x eager's > 1.5x")
    mark_high_sites(m)
    with admission.override_records(recs):
        res = Q.mount(m, "high")
    assert not res.ok and Q.mounted(m) == []
    assert res.failed.family == "flux.attention" and "failed admission on H200" in res.failed.reason


def test_disabled_kernel_fails_the_available_guard(model_and_base, monkeypatch):
    m, _, _ = model_and_base
    mark_high_sites(m)
    monkeypatch.setenv("DITFUSE_DISABLE", "activation.linear_gelu_tanh")
    with admission.override_records(ADMITTED):
        res = Q.mount(m, "high")
    assert not res.ok and res.failed.guard == "available:activation.linear_gelu_tanh"
    assert "DITFUSE_DISABLE" in res.failed.reason and Q.mounted(m) == []


def _fail_reason(m):
    mark_high_sites(m)
    with admission.override_records(ADMITTED):
        res = Q.mount(m, "high")
    assert not res.ok and Q.mounted(m) == []
    return res.failed


def test_fp32_model_fails_the_dtype_guard():
    f = _fail_reason(tiny_flux(dtype=torch.float32))
    assert f.guard == "dtype" and "bf16/fp16" in f.reason


def test_linear_without_bias_fails():
    m = tiny_flux(dtype=torch.bfloat16)
    m.single_transformer_blocks[0].proj_mlp.bias = None
    f = _fail_reason(m)
    assert f.site == "single_transformer_blocks.0" and "no bias" in f.reason


def test_bias_of_another_dtype_fails():
    m = tiny_flux(dtype=torch.bfloat16)
    ff = m.transformer_blocks[0].ff.net[0].proj
    ff.bias = torch.nn.Parameter(ff.bias.float())
    f = _fail_reason(m)
    assert f.family in ("flux.dual_block", "flux.linear_gelu_tanh")  # dtype guard or linear guard
    assert "dtype" in f.reason


def test_offload_hook_fails():
    from diffusers.hooks import HookRegistry, ModelHook

    m = tiny_flux(dtype=torch.bfloat16)
    HookRegistry.check_if_exists_or_initialize(m.single_transformer_blocks[0].proj_mlp).register_hook(
        ModelHook(), "group_offloading")
    f = _fail_reason(m)
    assert f.guard == "no offload" and "group_offloading" in f.reason


def test_non_tanh_gelu_fails_structure():
    m = tiny_flux(dtype=torch.bfloat16)
    m.transformer_blocks[0].ff_context.net[0].approximate = "none"
    f = _fail_reason(m)
    assert f.site == "transformer_blocks.0.ff_context.net.0" and f.guard == "structure"


def test_wrapped_weight_is_rejected():
    from ditfuse.models.flux_high import _plain_linear

    class Wrapped(torch.Tensor):
        pass

    lin = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert _plain_linear(lin, "proj") is None
    lin.weight = torch.nn.Parameter(lin.weight.data.as_subclass(Wrapped))
    assert "quantized or wrapped" in _plain_linear(lin, "proj")


def test_predicate_rejection_runs_eager():
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    w = torch.randn(6, 8).to(torch.bfloat16)
    close.reset_counts()
    out = close.linear_gelu_tanh(x, w, None)  # no bias: the predicate says no, eager runs
    assert close.linear_gelu_tanh.calls["eager"] == 1
    assert_bitwise_equal(out, torch.nn.functional.gelu(torch.nn.functional.linear(x, w), approximate="tanh"))


def test_capture_admission_batches_and_admission_on_captured(model_and_base):
    m, inp, _ = model_and_base
    b = capture_admission_batches(m, inp)
    # 3 GEMM+GELU sites, 4 LN+modulate (norm1, norm1_context, single norm, norm_out),
    # 2 gated residuals (image, text), 2 attentions
    assert {op: len(v) for op, v in b.items()} == {
        "activation.linear_gelu_tanh": 3, "norm.layernorm_modulate_fp32": 4,
        "norm.gate_residual_layernorm_modulate_fp32": 2, "rope.qk_rmsnorm_rope_fp32": 2,
    }
    for op in HIGH_OPS:
        r = admission.admit_op(op, b[op], "cpu")
        assert r.nonfinite_same and r.elements > 0
        assert r.rms_ratio <= 1.5, r  # fewer roundings than eager: no worse on RMS
