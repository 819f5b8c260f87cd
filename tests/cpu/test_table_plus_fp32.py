"""models.adaln.table_plus_fp32: Wan's / SkyReels-V2's ``table + temb.float()`` as the op
``modulate.table_add`` — bit for bit eager's sum, without the fp32 copy of ``temb`` (round 32: the
per-token TI2V-5B modulation spent two passes per block on it). The kernel itself:
tests/cpu/test_table_add_interpret.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ditfuse
from ditfuse.contracts.ops import LOSSLESS
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models.adaln import table_plus_fp32
from tests.support.specials import with_specials

OP = "modulate.table_add"


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _specials(t: torch.Tensor) -> torch.Tensor:
    """NaN, ±Inf, -0.0 (tests.support.specials) plus +0.0, values near fp32's overflow (Inf in
    fp16 / bf16 as the cast makes them) and an fp32 subnormal, next to the first."""
    with_specials(t)
    t.view(-1)[1:5] = torch.tensor([0.0, 3.0e38, -3.0e38, 1e-40]).to(t.dtype)
    return t


def _calls() -> dict[str, int]:
    return dict(ditfuse.gate.report().calls.get(OP, {}))


@pytest.fixture
def strict(monkeypatch):
    """A kernel that differs from eager raises (the default gate would return eager's sum)."""
    monkeypatch.setenv("DITFUSE_VERIFY", "strict")


# (table shape, temb shape): Wan 2.2 TI2V per-token [1, 1, 6, D] + [B, S, 6, D]; SkyReels-V2
# diffusion forcing [1, 6, 1, D] + [B, 6, S, D]
LAYOUTS = {
    "wan_ti2v": ((1, 1, 6, 48), lambda b, s: (b, s, 6, 48)),
    "skyreels_df": ((1, 6, 1, 40), lambda b, s: (b, 6, s, 40)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("temb_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 13), (1, 97)])
def test_equals_eager_bit_for_bit(strict, layout, temb_dtype, batch, seq):
    """Through the lossless table: the op's kernel runs (verified against eager at first sight,
    strictly) and the sum is eager's, dtype and layout included."""
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    table_shape, temb_shape = LAYOUTS[layout]
    table = torch.randn(table_shape, generator=g) * 0.05
    temb = _specials((torch.randn(temb_shape(batch, seq), generator=g) * 3).to(temb_dtype))
    before = _calls()
    out = table_plus_fp32(table, temb, LOSSLESS)
    after = _calls()
    ref = table + temb.float()
    assert out.dtype == ref.dtype == torch.float32 and out.shape == ref.shape and out.stride() == ref.stride()
    assert_bitwise_equal(out, ref)
    ran = {k: after.get(k, 0) - before.get(k, 0) for k in ("kernel", "verify", "unsupported")}
    assert ran["kernel"] + ran["verify"] == 1 and ran["unsupported"] == 0, ran


def test_strided_temb(strict):
    """A non-contiguous temb (a slice of a wider buffer) is one the kernel refuses: the op runs
    its reference, eager's sum."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn(1, 1, 6, 32, generator=g)
    wide = torch.randn(2, 11, 6, 64, generator=g).to(torch.bfloat16)
    temb = wide[..., 16:48]
    assert not temb.is_contiguous()
    before = _calls().get("unsupported", 0)
    assert_bitwise_equal(table_plus_fp32(table, temb, LOSSLESS), table + temb.float())
    assert _calls().get("unsupported", 0) == before + 1


class _Recording:
    """An op table whose ``table_add`` records what it is handed and returns a marker."""

    def __init__(self):
        self.args: list[tuple[torch.Tensor, torch.Tensor]] = []

    def table_add(self, table, temb):
        self.args.append((table, temb))
        return "sum"


def test_no_upcast_copy_of_temb():
    """The point of the helper: eager converts temb in a pass of its own (``_to_copy``) before
    the add; the helper dispatches no torch op of its own and hands the op temb as it is (bf16),
    which the kernel reads once (kernels/modulate/table_add_triton.py)."""
    table = torch.randn(1, 1, 6, 16)
    temb = torch.randn(2, 5, 6, 16).to(torch.bfloat16)
    ops = _Recording()
    with _Ops() as eager_ops:
        table + temb.float()
    with _Ops() as ours:
        assert table_plus_fp32(table, temb, ops) == "sum"
    assert "aten._to_copy" in eager_ops.seen, eager_ops.seen  # what eager pays
    assert ours.seen == [], ours.seen
    assert len(ops.args) == 1 and ops.args[0][0] is table and ops.args[0][1] is temb


@pytest.mark.parametrize("table_dtype, temb_dtype, runs", [
    (torch.bfloat16, torch.bfloat16, "kernel"),       # a model cast with a plain .to(bf16)
    (torch.float16, torch.float32, "kernel"),
    (torch.float32, torch.float64, "unsupported"),    # an fp64 sum
])
def test_other_dtype_pairs(strict, table_dtype, temb_dtype, runs):
    """A bf16 / fp16 table still makes an fp32 sum in eager (``temb.float()`` is fp32), which the
    kernel computes from the exactly widened table; an fp64 temb makes an fp64 sum, which the
    kernel refuses: the op runs its reference, eager's expression, result dtype included."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(1, 1, 6, 24, generator=g).to(table_dtype)
    temb = torch.randn(1, 9, 6, 24, generator=g).to(temb_dtype)
    before = _calls()
    out = table_plus_fp32(table, temb, LOSSLESS)
    after = _calls()
    ref = table + temb.float()
    assert out.dtype == ref.dtype
    assert_bitwise_equal(out, ref)
    ran = {k: after.get(k, 0) - before.get(k, 0) for k in ("kernel", "verify", "unsupported")}
    if runs == "kernel":
        assert ran["kernel"] + ran["verify"] == 1 and ran["unsupported"] == 0, ran
    else:  # a first sight counts a verification too
        assert ran["unsupported"] == 1 and ran["kernel"] == 0, ran
