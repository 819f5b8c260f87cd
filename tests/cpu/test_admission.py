"""Admission logic on synthetic kernels: only an unbiased kernel no noisier than eager passes."""

import json
import math

import pytest
import torch

from ditfuse.contracts import admission
from ditfuse.contracts.admission import AdmissionResult, evaluate


def _exact(x):
    return x.double() * 1.7 + 0.1


def _eager(x):  # two bf16 roundings, like an eager chain of two ops
    return x * 1.7 + 0.1


def _good(x):  # the same math in fp32, rounded once
    return (x.float() * 1.7 + 0.1).to(torch.bfloat16)


def _biased(x):  # exact + a small constant offset: as small as eager's error, but one-sided
    return (_exact(x) + 0.001).float()


def _noisy(x):  # unbiased, but noisier than eager
    g = torch.Generator().manual_seed(1)
    return (_exact(x) + 0.006 * torch.randn(x.shape, generator=g, dtype=torch.float64)).float()


def _batches(n=4, rows=64, width=96):
    g = torch.Generator().manual_seed(0)
    return [(((0.6 + 0.5 * torch.rand(rows, width, generator=g)).to(torch.bfloat16),), {}) for _ in range(n)]


def test_only_the_good_kernel_is_admitted():
    b = _batches()
    good = evaluate("t.good", _good, _eager, _exact, b, measured_on="cpu")
    biased = evaluate("t.biased", _biased, _eager, _exact, b, measured_on="cpu")
    noisy = evaluate("t.noisy", _noisy, _eager, _exact, b, measured_on="cpu")
    assert good.admitted and good.rms_ratio <= 1.0 and good.bias_ratio < 0.25, good
    assert not biased.admitted
    assert biased.rms_ratio <= 1.5 and biased.max_ratio <= 1.5  # rejected for the bias alone
    assert biased.bias_ratio > 0.25 and "bias" in biased.reason
    assert not noisy.admitted and noisy.rms_ratio > 1.5 and "RMS error" in noisy.reason
    assert noisy.bias_ratio < 0.25
    assert good.batches == 4 and good.elements == 4 * 64 * 96


def test_nonfinite_placement_must_match():
    x = (0.6 + 0.5 * torch.rand(8, 32)).to(torch.bfloat16)
    x[0, 0] = float("inf")
    x[1, 1] = float("nan")
    x[2, 2] = -float("inf")

    def inf_to_nan(x):
        y = _good(x)
        return torch.where(torch.isinf(y), torch.full_like(y, float("nan")), y)

    ok = evaluate("t.good", _good, _eager, _exact, [((x,), {})], measured_on="cpu")
    assert ok.nonfinite_same and ok.admitted
    bad = evaluate("t.nan", inf_to_nan, _eager, _exact, [((x,), {})], measured_on="cpu")
    assert not bad.nonfinite_same and not bad.admitted and "NaN/Inf" in bad.reason


def test_sign_of_infinity_counts():
    x = torch.tensor([[1.0, float("inf")]], dtype=torch.bfloat16)
    flip = lambda x: torch.where(torch.isinf(_good(x)), -_good(x), _good(x))  # noqa: E731
    r = evaluate("t.flip", flip, _eager, _exact, [((x,), {})], measured_on="cpu")
    assert not r.nonfinite_same


def test_worst_output_decides_and_shapes_are_checked():
    b = _batches(n=2)
    two_good = lambda x: (_good(x), _good(x))  # noqa: E731
    one_noisy = lambda x: (_good(x), _noisy(x))  # noqa: E731
    eager2 = lambda x: (_eager(x), _eager(x))  # noqa: E731
    exact2 = lambda x: (_exact(x), _exact(x))  # noqa: E731
    assert evaluate("t.2", two_good, eager2, exact2, b, "cpu").admitted
    r = evaluate("t.2n", one_noisy, eager2, exact2, b, "cpu")
    assert not r.admitted and r.rms_ratio > 1.5
    with pytest.raises(ValueError, match="shapes differ"):
        evaluate("t.s", lambda x: _good(x)[:1], _eager, _exact, b, "cpu")
    with pytest.raises(ValueError, match="no input batches"):
        evaluate("t.e", _good, _eager, _exact, [], "cpu")


def test_exact_eager_means_kernel_must_be_exact_too():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    same = evaluate("t.id", lambda x: x, lambda x: x, lambda x: x.double(), [((x,), {})], "cpu")
    assert same.admitted and same.rms_ratio == 1.0
    off = evaluate("t.off", lambda x: x + 1, lambda x: x, lambda x: x.double(), [((x,), {})], "cpu")
    assert not off.admitted and math.isinf(off.rms_ratio)


def test_records_override_and_guard_reasons():
    op = "norm.layernorm_modulate_fp32"
    with admission.override_records({}):
        p = admission.admission_problem(op)
        assert p.startswith("not admitted:") and "no admission record" in p
    failed = AdmissionResult(op, 2.0, 1.0, 0.0, True, False, "H200", reason="RMS error 2.000x eager's > 1.5x")
    with admission.override_records([failed]):
        p = admission.admission_problem(op)
        assert p.startswith("not admitted:") and "failed admission on H200" in p and "RMS error" in p
    with admission.override_records([admission.admitted_record(op)]):
        assert admission.admission_problem(op) is None


def test_record_roundtrip_table_and_docs(tmp_path, monkeypatch):
    path = tmp_path / "adm.json"
    monkeypatch.setenv("DITFUSE_ADMISSION", str(path))
    admission.reload()
    try:
        good = evaluate("norm.layernorm_modulate_fp32", _good, _eager, _exact, _batches(n=1), "cpu test")
        inf_rec = AdmissionResult("rope.qk_rmsnorm_rope_fp32", math.inf, 1.0, 0.0, False, False, "cpu test", reason="x")
        admission.write_records([good, inf_rec], meta={"layers": [2, 2]})
        data = json.loads(path.read_text())
        assert data["criteria"]["rms_ratio_max"] == 1.5 and data["meta"]["layers"] == [2, 2]
        recs = admission.records()
        assert recs["norm.layernorm_modulate_fp32"].admitted
        assert math.isinf(recs["rope.qk_rmsnorm_rope_fp32"].rms_ratio)
        assert admission.admission_problem("norm.layernorm_modulate_fp32") is None
        rows = admission.admission_table()
        assert [r["op"] for r in rows] == ["norm.layernorm_modulate_fp32", "rope.qk_rmsnorm_rope_fp32"]
        assert rows[0]["admitted"] == "yes" and rows[1]["nonfinite_same"] == "no"
        from ditfuse.runtime import docs

        text = docs.render()
        assert "## Admission" in text and "`rope.qk_rmsnorm_rope_fp32` | inf" in text
    finally:
        monkeypatch.delenv("DITFUSE_ADMISSION")
        admission.reload()


def test_candidates_cover_every_close_spec():
    from ditfuse.kernels import registry
    from ditfuse.kernels.spec import Contract

    close_ops = {s.op for s in registry.specs() if s.contract is Contract.CLOSE}
    assert set(admission.candidates()) == close_ops


def test_merge_keeps_records_this_run_did_not_measure(tmp_path):
    """bench/admit.py --families vae_kl: the VAE op's new record plus every other op's old one."""
    path = tmp_path / "rec.json"
    old = [admission.admitted_record("norm.layernorm_modulate_fp32", "old gpu"),
           admission.admitted_record("norm.group_norm_silu_fp32", "old gpu")]
    admission.write_records(old, path, {"families": {"flux": {"size": "1024x1024"}}})
    new = [admission.admitted_record("norm.group_norm_silu_fp32", "new gpu")]
    recs, meta, kept = admission.merge_with_record(new, path, {"families": {"vae_kl": {"size": "1024x1024"}}})
    assert kept == ["norm.layernorm_modulate_fp32"]
    by_op = {r.op: r for r in recs}
    assert by_op["norm.group_norm_silu_fp32"].measured_on == "new gpu"
    assert by_op["norm.layernorm_modulate_fp32"].measured_on == "old gpu"
    assert set(meta["families"]) == {"flux", "vae_kl"}
    assert admission.merge_with_record(new, tmp_path / "absent.json", {})[2] == []
