import logging
import threading
import time

import pytest
import torch

from ditfuse.contracts.bitexact import BitExactGate, BitExactMismatch, tensor_signature
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.kernels.errors import UnsupportedInput


class Counting:
    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


def ref_fn(x):
    return x * 2 + 1


@pytest.fixture
def g():
    gate = BitExactGate()
    gate.is_compiling = lambda: False
    gate.is_capturing = lambda: False
    return gate


def test_reference_called_once_per_new_signature(g):
    kern, ref = Counting(ref_fn), Counting(ref_fn)
    x = torch.randn(4, 8)
    for _ in range(5):
        assert torch.equal(g.call("t.op", ("sigA",), kern, ref, x), ref_fn(x))
    assert ref.calls == 1 and kern.calls == 5
    g.call("t.op", ("sigB",), kern, ref, x)
    assert ref.calls == 2
    rep = g.report()
    assert sorted(rep.verified["t.op"]) == [("sigA",), ("sigB",)]
    assert rep.calls["t.op"]["verify"] == 2 and rep.calls["t.op"]["kernel"] == 4
    assert rep.disabled == {} and rep.fallbacks == []


def test_mismatch_disables_permanently_and_returns_reference(g, caplog):
    def bad(x):
        y = ref_fn(x)
        y[1, 2] += 1
        return y

    kern, ref = Counting(bad), Counting(ref_fn)
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="ditfuse.gate"):
        out = g.call("t.bad", ("s",), kern, ref, x)
    assert torch.equal(out, ref_fn(x))
    assert g.is_disabled("t.bad")
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "t.bad" in msg and "[1, 2]" in msg and "('s',)" in msg
    # permanently: even a new signature goes to the reference, the kernel is not called again
    g.call("t.bad", ("other",), kern, ref, x)
    assert kern.calls == 1 and ref.calls == 2
    rep = g.report()
    assert "t.bad" in rep.disabled and rep.fallbacks[0].op == "t.bad"
    assert "1 of 32 elements differ" in rep.fallbacks[0].reason


def test_per_signature_op_mismatch_sends_only_that_signature_to_eager(g, caplog):
    """OpDescriptor.per_signature (cuDNN-observation ops): a mismatch sends that signature to the
    reference for good; the op stays on, its other signatures verified one by one."""
    def bad_on_odd(x):
        y = ref_fn(x)
        if x.shape[0] % 2:
            y[0, 0] += 1
        return y

    g.per_signature("t.cudnn")
    kern, ref = Counting(bad_on_odd), Counting(ref_fn)
    odd, even = torch.randn(3, 8), torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="ditfuse.gate"):
        assert torch.equal(g.call("t.cudnn", ("odd",), kern, ref, odd), ref_fn(odd))
    assert not g.is_disabled("t.cudnn")
    assert "this signature runs eager" in " ".join(r.getMessage() for r in caplog.records)
    for _ in range(3):  # the bad signature: reference only, the kernel is not called again
        assert torch.equal(g.call("t.cudnn", ("odd",), kern, ref, odd), ref_fn(odd))
    assert kern.calls == 1
    for _ in range(3):  # another signature: verified, then the kernel alone
        assert torch.equal(g.call("t.cudnn", ("even",), kern, ref, even), ref_fn(even))
    assert kern.calls == 4
    rep = g.report()
    assert rep.verified["t.cudnn"] == {("even",)} or sorted(rep.verified["t.cudnn"]) == [("even",)]
    assert [f.op for f in rep.fallbacks] == ["t.cudnn"] and "bitwise mismatch" in rep.fallbacks[0].reason


def test_nan_inputs_compared_bitwise(g):
    x = torch.tensor([1.0, float("nan"), float("inf"), -0.0])
    # NaN in the same place: equal, even with another payload
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    alt = lambda x: torch.where(torch.isnan(x), nan2.expand_as(x), x)
    assert g.call("t.nan", ("s",), alt, lambda x: x.clone(), x) is not None
    assert not g.is_disabled("t.nan")
    # -0.0 vs +0.0 is a mismatch
    g2 = BitExactGate()
    g2.is_compiling = g2.is_capturing = lambda: False
    g2.call("t.zero", ("s",), lambda x: x.abs(), lambda x: x.clone(), x.nan_to_num())
    assert g2.is_disabled("t.zero")
    # NaN where eager has a number: mismatch
    g2.call("t.nanplace", ("s",), lambda x: x.clone().fill_(float("nan")), lambda x: x.clone(), torch.ones(3))
    assert g2.is_disabled("t.nanplace")


@pytest.mark.parametrize("which", ["compiling", "capturing"])
def test_no_verification_under_capture_or_compile(g, which):
    kern, ref = Counting(ref_fn), Counting(ref_fn)
    x = torch.randn(3)
    setattr(g, "is_" + which, lambda: True)
    g.call("t.cap", ("s",), kern, ref, x)  # unverified: reference only, no compare
    assert kern.calls == 0 and ref.calls == 1
    assert g.report().calls["t.cap"]["unverified_under_capture"] == 1
    setattr(g, "is_" + which, lambda: False)
    g.call("t.cap", ("s",), kern, ref, x)  # verification outside
    assert kern.calls == 1 and ref.calls == 2
    setattr(g, "is_" + which, lambda: True)
    g.call("t.cap", ("s",), kern, ref, x)  # verified: kernel runs inside capture
    assert kern.calls == 2 and ref.calls == 2


def test_strict_mode_raises(g, monkeypatch):
    monkeypatch.setenv("DITFUSE_VERIFY", "strict")
    with pytest.raises(BitExactMismatch, match="t.strict"):
        g.call("t.strict", ("s",), lambda x: x + 1, ref_fn, torch.ones(2))


def test_always_and_off_modes(g, monkeypatch):
    kern, ref = Counting(ref_fn), Counting(ref_fn)
    monkeypatch.setenv("DITFUSE_VERIFY", "always")
    for _ in range(3):
        g.call("t.always", ("s",), kern, ref, torch.ones(2))
    assert ref.calls == 3
    monkeypatch.setenv("DITFUSE_VERIFY", "off")
    g.call("t.off", ("s",), lambda x: x + 100, ref, torch.ones(2))
    assert ref.calls == 3 and not g.is_disabled("t.off")
    monkeypatch.setenv("DITFUSE_VERIFY", "sometimes")
    with pytest.raises(ValueError, match="first, always, off, strict"):
        g.call("t.x", ("s",), kern, ref, torch.ones(2))


def test_kernel_exception_falls_back_and_reports(g):
    def boom(x):
        raise RuntimeError("launch failed")

    out = g.call("t.boom", ("s",), boom, ref_fn, torch.ones(2))
    assert torch.equal(out, ref_fn(torch.ones(2)))
    rep = g.report()
    assert "launch failed" in rep.disabled["t.boom"]
    assert "RuntimeError" in rep.fallbacks[0].reason


def test_unsupported_input_falls_back_without_disabling(g):
    def picky(x):
        if x.numel() == 3:
            raise UnsupportedInput("odd width 3")
        return ref_fn(x)

    g.call("t.picky", ("s3",), picky, ref_fn, torch.ones(3))
    assert not g.is_disabled("t.picky")
    assert "odd width 3" in g.report().fallbacks[0].reason
    g.call("t.picky", ("s4",), picky, ref_fn, torch.ones(4))
    assert g.is_verified("t.picky", ("s4",))


def test_out_buffer_kernels_verified(g):
    def kern(x, out):
        out.copy_(x * 2)
        return out

    def ref(x, out):
        out.copy_(x * 2)
        return out

    buf = torch.empty(4)
    res = g.call("t.out", ("s",), kern, ref, torch.arange(4.0), buf)
    assert res.data_ptr() == buf.data_ptr() and torch.equal(buf, torch.arange(4.0) * 2)
    assert g.is_verified("t.out", ("s",))


def test_concurrent_first_sight_verifies_once(g):
    ref_calls = []

    def slow_ref(x):
        ref_calls.append(threading.get_ident())
        time.sleep(0.05)
        return ref_fn(x)

    x = torch.randn(16)
    barrier = threading.Barrier(2)
    results = []

    def worker():
        barrier.wait()
        results.append(g.call("t.conc", ("s",), ref_fn, slow_ref, x))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(ref_calls) == 1
    assert all(torch.equal(r, ref_fn(x)) for r in results)
    assert g.report().calls["t.conc"]["kernel"] == 1


def test_report_summary_and_dict(g):
    g.call("t.a", ("s",), ref_fn, ref_fn, torch.ones(2))
    text = g.report().summary()
    assert "t.a: 1 verified signature(s)" in text
    d = g.report().to_dict()
    assert d["calls"]["t.a"]["verify"] == 1


def test_tensor_signature_layout_classes():
    x = torch.randn(4, 6)
    assert tensor_signature(x) == ("float32", "cpu", "contiguous")
    assert tensor_signature(x[:, :3])[2] == "rows-strided"
    assert tensor_signature(x.t())[2] == "strided"


def test_assert_bitwise_equal_reports_details():
    a = torch.zeros(3, 5, dtype=torch.bfloat16)
    b = a.clone()
    b[1, 3] = 1.5
    b[2, 0] = float("nan")
    with pytest.raises(AssertionError) as e:
        assert_bitwise_equal(a, b, "x")
    msg = str(e.value)
    assert "2 of 15 elements differ" in msg and "[1, 3]" in msg and "expected 1.5" in msg
    assert "NaN placement differs at 1" in msg
    assert first_mismatch(a, a.clone()) is None
    with pytest.raises(AssertionError, match="shape/dtype"):
        assert_bitwise_equal(a, a.float())


def test_equal_values_in_another_layout_run_that_signature_eager(g, caplog):
    """A kernel with eager's values but not eager's strides (SD3's transposed residual stream
    written back contiguous): what reads the result next may round differently, so that
    signature runs eager from then on; the op is not disabled, other signatures keep the kernel."""
    def eager(x):  # elementwise: keeps x's layout
        return x * 2 + 1

    def contiguous_kernel(x):
        return (x * 2 + 1).contiguous()

    kern, ref = Counting(contiguous_kernel), Counting(eager)
    xt = torch.randn(8, 4).t()  # transposed
    with caplog.at_level(logging.WARNING, logger="ditfuse.gate"):
        out = g.call("t.layout", ("transposed",), kern, ref, xt)
    assert out.stride() == xt.stride() and torch.equal(out, eager(xt))  # eager's result, eager's layout
    assert any("layout differs" in r.getMessage() for r in caplog.records)
    assert not g.is_disabled("t.layout")
    out2 = g.call("t.layout", ("transposed",), kern, ref, xt)
    assert out2.stride() == xt.stride() and kern.calls == 1  # eager from now on for this signature
    x = torch.randn(4, 8)  # contiguous: the same layout either way
    for _ in range(3):
        g.call("t.layout", ("contiguous",), kern, ref, x)
    assert kern.calls == 4
    rep = g.report()
    assert rep.calls["t.layout"]["layout"] == 1 and rep.verified["t.layout"] == [("contiguous",)]
    assert [f.signature for f in rep.fallbacks] == [("transposed",)]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_kernel_writing_its_out_slice_is_verified_with_the_slice_layout(g, batch):
    """An op that writes an ``out=`` slice of a larger buffer in place and returns it (the
    GEMM-GELU into the FLUX single block's proj_out input): the gate's copy of the kernel's output
    keeps the slice's strides, so equal values in the same buffer are not a layout difference
    (round 26's H100 run: the copy was contiguous and the real-width test fell back)."""
    def op(x, out):
        return out.copy_(x * 2 + 1)

    x = torch.randn(batch, 5, 3)
    buf = torch.zeros(batch, 5, 7)
    kern = Counting(op)
    got = g.call("t.out_slice", ("s",), kern, Counting(op), x, buf[:, :, 4:])
    rep = g.report()
    assert rep.calls["t.out_slice"].get("layout", 0) == 0 and not rep.fallbacks, rep.fallbacks
    assert rep.verified["t.out_slice"] == [("s",)]
    assert got.stride() == buf[:, :, 4:].stride() and torch.equal(buf[:, :, 4:], x * 2 + 1)
    assert torch.equal(buf[:, :, :4], torch.zeros(batch, 5, 4))


def test_a_wrong_out_slice_write_is_still_a_mismatch(g):
    """Keeping the slice's strides does not hide a kernel that wrote wrong values into it."""
    x = torch.randn(2, 5, 3)
    buf = torch.zeros(2, 5, 7)
    kern = Counting(lambda x, out: out.copy_(x * 2))
    g.call("t.out_slice_bad", ("s",), kern, Counting(lambda x, out: out.copy_(x * 2 + 1)), x, buf[:, :, 4:])
    assert g.is_disabled("t.out_slice_bad")
    assert torch.equal(buf[:, :, 4:], x * 2 + 1)  # the reference wrote last


def test_size_one_dims_do_not_count_as_layout(g):
    """A size-1 dim's stride addresses nothing: [1, S, D] with stride 0 vs S*D in dim 0 is the
    same layout."""
    x = torch.randn(1, 5, 3)
    odd = torch.empty_strided((1, 5, 3), (999, 3, 1))
    kern = Counting(lambda x: odd.copy_(x * 2 + 1))
    g.call("t.size1", ("s",), kern, ref_fn, x)
    assert g.report().calls["t.size1"].get("layout", 0) == 0 and g.report().verified["t.size1"] == [("s",)]


@pytest.mark.parametrize("reason, interpreted, ok", [
    ("bitwise mismatch for signature s: 1 of 8 elements differ", True, True),
    ("bitwise mismatch for signature s: 1 of 8 elements differ", False, False),
    ("kernel raised RuntimeError: boom", True, False),
    ("unsupported input: width 7", True, False),
    ("output layout differs from eager's: strides", True, False),
])
def test_assert_gate_clean_allows_only_interpreter_mismatches(reason, interpreted, ok, monkeypatch):
    """tests/support/engaged.assert_gate_clean, which the CPU suite's whole-pipeline tests use
    under verify_every_call: only a bitwise mismatch under the interpreter passes."""
    from ditfuse.contracts.bitexact import Fallback, GateReport
    from tests.support.engaged import assert_gate_clean

    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpreted else "0")
    disabled = {"op.x": reason} if not reason.startswith(("unsupported", "output layout")) else {}
    rep = GateReport(disabled=disabled, fallbacks=[Fallback("op.x", ("sig",), reason)])
    if ok:
        assert_gate_clean(rep, "case")
    else:
        with pytest.raises(AssertionError, match="op.x"):
            assert_gate_clean(rep, "case")
    assert_gate_clean(GateReport(), "empty")
