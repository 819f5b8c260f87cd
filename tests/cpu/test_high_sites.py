"""quality="high" on tiny bf16 FLUX and Wan transformers (close kernels under TRITON_INTERPRET=1):
the tier switch, its guards, all-or-nothing, the fast path engaged, back to bitwise diffusers."""

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook

import ditfuse
from ditfuse.contracts import admission, ops
from ditfuse.contracts.quality import Guard, Quality, check_all, check_guards
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.models import capture_admission_batches, families, mounted_sites
from ditfuse.models.base import site_hooks

from .tiny import flux_inputs, tiny_flux

ADMITTED = [admission.admitted_record(op) for op in ops.CLOSE]
# 1 dual block, 1 single block, 2 attentions, norm_out
FLUX_SITES = sorted([
    "transformer_blocks.0:flux.dual_block", "transformer_blocks.0.attn:flux.attention",
    "single_transformer_blocks.0:flux.single_block", "single_transformer_blocks.0.attn:flux.attention",
    "norm_out:flux.norm_out",
])


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.fixture(scope="module")
def flux():
    m = tiny_flux(dtype=torch.bfloat16, guidance=True)
    inp = flux_inputs(m, batch=2, dtype=torch.bfloat16)
    return m, inp, _run(m, inp)


def test_quality_parse():
    assert Quality.parse(None) is Quality.LOSSLESS
    assert Quality.parse(" HIGH ") is Quality.HIGH
    assert Quality.parse(Quality.HIGH) is Quality.HIGH
    with pytest.raises(ValueError, match="allowed values: lossless, high"):
        Quality.parse("ultra")
    with pytest.raises(ValueError, match="allowed values"):
        Quality.parse(3)


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_high_runs_close_kernels_and_back_to_lossless_bitwise(flux, monkeypatch):
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)  # the tiny model's FeedForwards have few rows
    m, inp, base = flux
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED):
            res = h.set_quality("high")["FluxTransformer2DModel"]
        assert res.ok, res.failed
        assert sorted(res.mounted) == FLUX_SITES and sorted(mounted_sites(m)) == FLUX_SITES
        ops.reset_counts()
        hi = _run(m, inp)
        used = {op: dict(c.calls) for op, c in ops.CLOSE.items() if c.calls}
        assert set(used) == {"norm.layernorm_modulate_fp32", "norm.gate_residual_layernorm_modulate_fp32",
                             "rope.qk_rmsnorm_rope_fp32", "linear.linear_gelu_tanh_fast"}, used
        # ff and ff_context of the dual block, proj_mlp of the single block
        assert used["linear.linear_gelu_tanh_fast"] == {"kernel": 3}, used
        assert all(c.get("eager", 0) == 0 and c["kernel"] > 0 for c in used.values()), used
        assert first_mismatch(hi, base) is not None, "high mode changed no bit: the close kernels did not run"
        assert (hi.float() - base.float()).abs().max().item() < 0.05 * base.float().abs().max().item()
        res = h.set_quality("lossless")["FluxTransformer2DModel"]
        assert sorted(res.unmounted) == FLUX_SITES and mounted_sites(m) == []
        assert_bitwise_equal(_run(m, inp), base, "lossless after high")
        # one ditfuse hook per module for both tiers
        assert [n for n in m.transformer_blocks[0]._diffusers_hook.hooks if n.startswith("ditfuse.")] == [
            "ditfuse.flux.dual_block"]
    finally:
        h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_no_admission_record_mounts_nothing(flux):
    m, inp, base = flux
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records({}):
            res = h.set_quality("high")["FluxTransformer2DModel"]
        assert not res.ok and res.mounted == [] and mounted_sites(m) == []
        assert res.failed.guard.startswith("admitted:") and res.failed.reason.startswith("not admitted:")
        assert "quality=high not mounted" in h.report().summary()
        assert_bitwise_equal(_run(m, inp), base)
    finally:
        h.unmount()


def _high_failure(m, records=ADMITTED):
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(records):
            res = h.set_quality("high")[type(m).__name__]
        assert not res.ok and mounted_sites(m) == []
        return res.failed
    finally:
        h.unmount()


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_failed_admission_is_not_mountable(flux):
    recs = {r.op: r for r in ADMITTED}
    recs["rope.qk_rmsnorm_rope_fp32"] = admission.AdmissionResult(
        "rope.qk_rmsnorm_rope_fp32", 1.8, 1.0, 0.0, True, False, "H200", reason="RMS error 1.800x eager's > 1.5x")
    f = _high_failure(flux[0], recs)
    assert f.family == "flux.attention" and "failed admission on H200" in f.reason


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_disabled_kernel_fails_the_available_guard(flux, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "norm.layernorm_modulate_fp32")
    f = _high_failure(flux[0])
    assert f.guard == "available:norm.layernorm_modulate_fp32" and "DITFUSE_DISABLE" in f.reason


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_fp32_model_fails_the_dtype_guard():
    f = _high_failure(tiny_flux(dtype=torch.float32))
    assert f.guard == "dtype" and "bf16/fp16" in f.reason


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_offload_hook_fails_and_all_or_nothing():
    """A foreign hook on one module fails that site's guard: no site moves, and sites already
    running high go back to lossless."""
    m = tiny_flux(dtype=torch.bfloat16, layers=(1, 2))
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED):
            assert h.set_quality("high")["FluxTransformer2DModel"].ok
            HookRegistry.check_if_exists_or_initialize(m.single_transformer_blocks[1].proj_mlp).register_hook(
                ModelHook(), "group_offloading")
            res = h.set_quality("high")["FluxTransformer2DModel"]
        assert not res.ok and res.failed.guard == "no offload" and "group_offloading" in res.failed.reason
        assert res.failed.site == "single_transformer_blocks.1" and mounted_sites(m) == []
        assert len(res.unmounted) == 7  # every site that was high went back
        assert_bitwise_equal(_run(m, inp), base)
    finally:
        h.unmount()


def test_guard_logic():
    class M:
        pass

    def broken(mod):
        raise KeyError("weight")

    f = check_guards("a.b", "test.site", M(), [Guard("ok", lambda m: None), Guard("weight", broken)])
    assert f.guard == "weight" and "guard raised KeyError" in f.reason and "a.b (test.site)" in str(f)
    sites = [("p1", "s", M(), [Guard("g", lambda m: None)]), ("p2", "s", M(), [Guard("h", lambda m: "no bias")])]
    f = check_all(sites)
    assert f.site == "p2" and f.reason == "no bias"
    assert check_all(sites[:1]) is None


def test_close_op_runs_eager_for_inputs_it_does_not_take():
    x = torch.randn(1, 3, 6).to(torch.bfloat16)  # width 6: not a multiple of 4
    sc = torch.randn(1, 6).to(torch.bfloat16)
    ops.reset_counts()
    out = ops.HIGH.layernorm_modulate(x, sc, sc, 1e-6)
    assert ops.CLOSE["norm.layernorm_modulate_fp32"].calls == {"eager": 1}
    from ditfuse.kernels import reference as ref

    assert_bitwise_equal(out, ref.layernorm_modulate(x, sc, sc, 1e-6))


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_capture_admission_batches_and_admission_on_captured(flux, monkeypatch):
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    m, inp, _ = flux
    h = ditfuse.accelerate(m)
    try:
        b = capture_admission_batches(m, inp)
    finally:
        h.unmount()
    # 4 LN+modulate (norm1, norm1_context, single norm, norm_out), 2 gated residuals, 2 attentions,
    # 3 GEMM-GELUs (the dual block's two FeedForwards, the single block's proj_mlp: the recording
    # takes every path some site's high table would)
    assert {op: len(v) for op, v in b.items()} == {
        "norm.layernorm_modulate_fp32": 4, "norm.gate_residual_layernorm_modulate_fp32": 2,
        "rope.qk_rmsnorm_rope_fp32": 2, "linear.linear_gelu_tanh_fast": 3,
    }
    gemm = b["linear.linear_gelu_tanh_fast"]
    assert [a[0].shape[-1] for a, _ in gemm] == [m.inner_dim] * 3
    # the single block's call wrote into a slice of proj_out's input: recorded as a copy of it
    assert [kw.get("out", a[3] if len(a) > 3 else None) is not None for a, kw in gemm] == [False, False, True]
    with pytest.raises(ValueError, match="declined by the kernel"):  # tiny rows: the kernel declines all
        admission.admit_op("linear.linear_gelu_tanh_fast", gemm, "cpu")
    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)
    for op, batches in b.items():
        r = admission.admit_op(op, batches, "cpu")
        assert r.nonfinite_same and r.elements > 0
        assert r.rms_ratio <= 1.5, r  # fewer roundings than eager: no worse on RMS


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
@pytest.mark.parametrize("name, size, txt, declares", [("wan", "32x16x5", 5, True), ("ltx", "224x160x17", 9, False),
                                                       ("chroma", "64x48", 9, True)])
def test_capture_scopes_and_the_sites_own_optional_paths(name, size, txt, declares, monkeypatch):
    """Wan's, LTX's and Chroma's blocks share models.base.feed_forward with FLUX.1's; Wan's and
    Chroma's declare the GEMM-GELU (round 28), LTX's does not: only their captures record inputs for
    the close GEMM-GELU. ``scope="all"`` records every other close op too (LTX has no high tier);
    ``scope="high"`` only the close ops the model's sites run under quality="high" (round 30: the
    GPU test compared the survey with the high tier)."""
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)  # tiny token counts: only the declaration decides
    fam = families.get(name)
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, 1, size, device="cpu", txt_tokens=txt)
    h = ditfuse.accelerate(m)
    try:
        every = capture_admission_batches(m, inp, scope="all")
        high = capture_admission_batches(m, inp)
        tier = {c.op for _, _, hook in site_hooks(m) for c in hook.site.close_ops()}
        with pytest.raises(ValueError, match="scope"):
            capture_admission_batches(m, inp, scope="some")
    finally:
        h.unmount()
    assert ("linear.linear_gelu_tanh_fast" in every) is declares, list(every)
    assert len(every) >= 2, list(every)
    assert set(high) == tier & set(every), (sorted(high), sorted(tier))
    assert {op: len(b) for op, b in high.items()} == {op: len(every[op]) for op in high}
    if declares:  # one FF per block, each captured once
        # Wan: one FF per block; Chroma: the dual block's two FeedForwards and the single block's MLP
        ff = len(m.blocks) if name == "wan" else 2 * len(m.transformer_blocks) + len(m.single_transformer_blocks)
        assert len(every["linear.linear_gelu_tanh_fast"]) == ff, len(every["linear.linear_gelu_tanh_fast"])
    if name == "chroma":  # the norms' close variants are surveyed, not part of the tier
        assert set(high) == {"linear.linear_gelu_tanh_fast"} and len(every) > len(high), list(every)
    if name == "ltx":
        assert high == {}, list(high)


def test_capture_needs_a_mounted_model():
    with pytest.raises(ValueError, match="mounted"):
        capture_admission_batches(tiny_flux(), {})


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
@pytest.mark.parametrize("load", ["pretrained", "plain"])
def test_wan_high_mounts_runs_close_kernels_and_returns_bitwise(load, monkeypatch):
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)  # so that only the site's table can keep it out
    fam = families.get("wan")
    m = fam.build("tiny", device="cpu", load=load)
    inp = fam.make_inputs(m, 1, "32x16x5", device="cpu", txt_tokens=5)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED):
            res = h.set_quality("high")["WanTransformer3DModel"]
        assert res.ok, res.failed
        assert sorted(res.mounted) == sorted(["<root>:wan.model", "blocks.0:wan.block", "blocks.0.attn1:wan.attention",
                                              "blocks.1:wan.block", "blocks.1.attn1:wan.attention"])
        ops.reset_counts()
        hi = _run(m, inp)
        assert ops.CLOSE["rope.qk_rmsnorm_across_heads_rope_fp32"].calls["kernel"] == 2
        # 2 per block, + block 0's FF residual fused with block 1's norm1 across the boundary
        assert ops.CLOSE["norm.gate_residual_layernorm_modulate_fp32"].calls["kernel"] == 5
        # Wan's block declares the GEMM-GELU (round 28): each block's FF runs it
        assert ops.CLOSE["linear.linear_gelu_tanh_fast"].calls["kernel"] == 2
        assert first_mismatch(hi, base) is not None
        h.set_quality("lossless")
        assert_bitwise_equal(_run(m, inp), base)
    finally:
        h.unmount()


@pytest.mark.parametrize("module", ["chroma", "hunyuanvideo"])
def test_gemm_gelu_only_sites(module):
    """Round 28: these families' block sites declare the close GEMM-GELU (``high_ops``) and not
    their norms' close variants (``high=False``): it is their whole high tier, and their high
    tables keep every other op lossless."""
    import importlib

    sites = importlib.import_module(f"ditfuse.models.{module}").SITES
    for s in sites:
        assert [c.op for c in s.close_ops()] in ([], ["linear.linear_gelu_tanh_fast"]), (s.name, s.close_ops())
        if s.close_ops():
            t = s.high_table()
            assert t.runs("linear_gelu_tanh") and t.linear_gelu_tanh is ops.CLOSE["linear.linear_gelu_tanh_fast"]
            assert all(getattr(t, n) is getattr(ops.LOSSLESS, n) for n in t if n != "linear_gelu_tanh"), s.name
    assert any(s.close_ops() for s in sites)


@pytest.mark.slow  # tiny models through the interpreter: seconds each on 2 cores
@pytest.mark.parametrize("name, size, txt", [("chroma", "64x48", 9), ("hunyuanvideo", "80x48x9", 5)])
def test_gemm_gelu_only_high_tier(name, size, txt, monkeypatch):
    """Round 28: Chroma and HunyuanVideo blocks declare the close GEMM-GELU but
    not their norms' close variants (``high=False``). Under quality="high" the GEMM-GELU runs at
    every FF the blocks route through models.base (FeedForward, the single blocks' MLP) and no
    other close op runs; the output moves; lossless afterwards is bitwise again."""
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)  # tiny token counts: only the site's table decides
    fam = families.get(name)
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, 1, size, device="cpu", txt_tokens=txt)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED):
            res = h.set_quality("high")[type(m).__name__]
        assert res.ok, res.failed
        assert res.mounted and all("block" in p for p in res.mounted), res.mounted
        ops.reset_counts()
        hi = _run(m, inp)
        used = {op: dict(c.calls) for op, c in ops.CLOSE.items() if c.calls}
        assert set(used) == {"linear.linear_gelu_tanh_fast"}, used
        assert not used["linear.linear_gelu_tanh_fast"].get("eager"), used
        # every FF: both streams' in each dual block (round 32 added HunyuanVideo's), each single block's MLP
        want = 2 * len(m.transformer_blocks) + len(m.single_transformer_blocks)
        assert used["linear.linear_gelu_tanh_fast"].get("kernel", 0) == want, (used, want)
        assert first_mismatch(hi, base) is not None
        h.set_quality("lossless")
        assert_bitwise_equal(_run(m, inp), base)
    finally:
        h.unmount()


@pytest.mark.parametrize("name, capable", [("qwenimage", False), ("flux2", False), ("chroma", True), ("flux", True)])
def test_report_says_when_high_has_nothing_to_run(name, capable, caplog):
    """A model whose adapter declares no close kernel runs lossless under quality="high": the
    report's line and its dict say so, and switching logs it once (round 30: Qwen-Image gave its
    GEMM-GELU back, and its report said only "quality: high")."""
    m = families.get(name).build("tiny", device="cpu")
    h = ditfuse.accelerate(m)
    try:
        with admission.override_records(ADMITTED), caplog.at_level("INFO", logger="ditfuse"):
            res = h.set_quality("high")[type(m).__name__]
            h.set_quality("high")  # again: no second log line
        assert res.ok, res.failed
        rep = h.report()
        comp = next(c for c in rep.to_dict()["components"] if c["class"] == type(m).__name__)
        assert comp["high_capable"] is capable
        said = "no close kernels for this model" in rep.summary()
        logged = [r for r in caplog.records if "has no quality='high' kernels" in r.getMessage()]
        assert said is (not capable) and len(logged) == (0 if capable else 1), (rep.summary(), logged)
        assert bool(res.mounted) is capable
        h.set_quality("lossless")
        assert "no close kernels" not in h.report().summary()
    finally:
        h.unmount()
