"""modulate.table_add under TRITON_INTERPRET=1, bitwise (integer views) against its reference,
eager's ``table + temb.float()``: Wan's per-token layout ([1, 1, 6, D] + [B, S, 6, D]),
SkyReels-V2's diffusion forcing ([1, 6, 1, D] + [B, 6, S, D]) and Wan 2.1's per-sample one
([1, 6, D] + [B, 6, D]); bf16 / fp16 / fp32 temb, an fp32 table (``from_pretrained``) and a bf16
or fp16 one (a plain ``.to(dtype)``); odd widths and token counts; NaN, ±Inf, -0, subnormals. The
refusals agree with ``can_use_table_add``.

NaNs must sit where eager's are; their payloads are not compared (kernels/compare.py's rule):
here they come from numpy's conversions and adds against torch's CPU kernels (an fp16 NaN widens
to 0x7fc00000 in numpy, 0x7fffffff in torch; of two NaN operands each picks its own), not from
the CUDA instructions the kernel mirrors, where every NaN sum is the canonical 0x7fffffff."""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.modulate import table_add_triton as ta
from tests.support.specials import with_specials

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# layout -> (table shape, temb shape) for (B, S, D)
LAYOUTS = {
    "wan": (lambda b, s, d: (1, 1, 6, d), lambda b, s, d: (b, s, 6, d)),
    "skyreels": (lambda b, s, d: (1, 6, 1, d), lambda b, s, d: (b, 6, s, d)),
}


def _assert_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype == torch.float32, (label, got.dtype, want.dtype)
    assert got.shape == want.shape and got.stride() == want.stride(), (label, got.shape, got.stride(), want.stride())
    g, w = got.view(torch.int32), want.view(torch.int32)
    bad = ((g != w) & ~(torch.isnan(got) & torch.isnan(want))).nonzero()
    if len(bad):
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{label}: {len(bad)} of {want.numel()} elements differ bitwise (NaN placement: "
            f"{int((torch.isnan(got) != torch.isnan(want)).sum())}); first at {list(i)}: "
            f"got {got[i].item()!r} (0x{g[i].item() & 0xFFFFFFFF:08x}), "
            f"expected {want[i].item()!r} (0x{w[i].item() & 0xFFFFFFFF:08x})")


def _inputs(layout: str, b: int, s: int, d: int, dtype: torch.dtype, seed: int, table_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    tshape, eshape = (f(b, s, d) for f in LAYOUTS[layout])
    table = (torch.randn(tshape, generator=gen) * 0.05).to(table_dtype)
    temb = with_specials((torch.randn(eshape, generator=gen) * 3).to(dtype))
    return table, temb


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bitwise_equal_to_eager(layout, dtype):
    """Every (B, S, D) of B in {1, 2}, S in {1, 13, 97}, D in {1, 7, 48, 130} in one test per
    layout and dtype (the interpreter's kernel compile is per test, the launches are cheap)."""
    for b, s, d in itertools.product((1, 2), (1, 13, 97), (1, 7, 48, 130)):
        table, temb = _inputs(layout, b, s, d, dtype, seed=b * 10000 + s * 100 + d)
        label = f"{layout} {dtype} B={b} S={s} D={d}"
        assert ta.can_use_table_add(table, temb), label
        _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), label)


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16], ids=["bf16-table", "fp16-table"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_low_precision_table(layout, dtype, table_dtype):
    """A table cast with the model (a plain ``.to(bf16)``): eager's ``table + temb.float()`` is
    still an fp32 sum, of the exactly widened table."""
    for b, s, d in ((1, 1, 1), (2, 13, 7), (1, 97, 130)):
        table, temb = _inputs(layout, b, s, d, dtype, seed=b + s + d, table_dtype=table_dtype)
        label = f"{layout} {table_dtype} table + {dtype} B={b} S={s} D={d}"
        assert ta.can_use_table_add(table, temb), label
        _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), label)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16], ids=["fp32-table", "bf16-table"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_specials_and_subnormals(dtype, table_dtype):
    """NaN (signalling and negative ones too, in bf16 / fp32), ±Inf, ±0, values at the edge of
    fp32's range and subnormals in both operands."""
    table, temb = _inputs("wan", 2, 5, 16, dtype, seed=1, table_dtype=table_dtype)
    tv = table.view(-1)
    tv[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 3.0e38, -1e-40, 1e-45]).to(table_dtype)
    specials = [float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 6e-8, 3.0e38, -3.0e38]
    ev = temb.view(-1)
    ev[96:96 + len(specials)] = torch.tensor(specials).to(dtype)
    ev[200:208] = torch.tensor([-0.0] * 8).to(dtype)
    if dtype is torch.bfloat16:
        temb.view(torch.int16).view(-1)[300:304] = torch.tensor([0x7F81, -0x7F, 0x0001, -0x7FFF], dtype=torch.int16)
    elif dtype is torch.float32:
        temb.view(torch.int32).view(-1)[300:304] = torch.tensor([0x7F800001, 0x7FC01234, 0x00000001, -0x7FFFFFFF],
                                                               dtype=torch.int32)
    _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), f"specials {table_dtype} + {dtype}")


@pytest.mark.parametrize("tshape, eshape", [
    ((1, 6, 24), (2, 6, 24)),          # Wan 2.1 / SkyReels' 3-D temb: per sample
    ((6, 24), (3, 6, 24)),             # a table of fewer dims
    ((1, 6, 1, 1), (2, 6, 9, 1)),      # D = 1 in SkyReels' layout: the table row broadcast over tokens
    ((1, 6, 1, 24), (2, 6, 1, 24)),    # SkyReels' layout with one token: a trailing block again
    ((24,), (24,)),                    # no broadcast
    ((), ()),                          # 0-d
], ids=["per-sample", "short-table", "skyreels-d1", "skyreels-s1", "same-shape", "0d"])
def test_other_broadcasts(tshape, eshape):
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(tshape, generator=gen)
    temb = (torch.randn(eshape, generator=gen) * 3).to(torch.bfloat16)
    assert ta.can_use_table_add(table, temb)
    _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), f"{tshape} + {eshape}")


def test_empty():
    table, temb = torch.randn(1, 1, 6, 8), torch.randn(2, 0, 6, 8).to(torch.bfloat16)
    assert ta.can_use_table_add(table, temb)
    out = ta.table_add(table, temb)
    assert out.shape == (2, 0, 6, 8) and out.dtype == torch.float32


def _rejected():
    gen = torch.Generator().manual_seed(9)
    table = torch.randn(1, 1, 6, 16, generator=gen)
    temb = torch.randn(2, 5, 6, 16, generator=gen).to(torch.bfloat16)
    wide = torch.randn(2, 5, 6, 32, generator=gen).to(torch.bfloat16)
    return {
        "strided temb": (table, wide[..., 8:24]),
        "fp64 table": (table.double(), temb),
        "fp64 temb": (table, temb.double()),
        "int temb": (table, temb.to(torch.int32)),
        "strided table": (torch.randn(1, 1, 6, 32, generator=gen)[..., ::2], temb),
        "table enlarges temb": (torch.randn(2, 5, 6, 16, generator=gen), temb[:1]),
        "not broadcastable": (torch.randn(1, 1, 6, 8, generator=gen), temb),
        # table dims interleaved with broadcast dims more than once: [6, 1, 4, 1, 16] over [6, 2, 4, 3, 16]
        "three table groups": (torch.randn(6, 1, 4, 1, 16, generator=gen),
                               torch.randn(6, 2, 4, 3, 16, generator=gen).to(torch.bfloat16)),
    }


@pytest.mark.parametrize("case", list(_rejected()))
def test_rejections_raise_and_predicate_agrees(case):
    table, temb = _rejected()[case]
    assert not ta.can_use_table_add(table, temb)
    with pytest.raises(UnsupportedInput):
        ta.table_add(table, temb)


def test_requires_grad_in_grad_mode_is_rejected():
    table = torch.randn(1, 1, 6, 16, requires_grad=True)
    temb = torch.randn(1, 3, 6, 16).to(torch.bfloat16)
    assert not ta.can_use_table_add(table, temb)
    with pytest.raises(UnsupportedInput):
        ta.table_add(table, temb)
    with torch.no_grad():
        assert ta.can_use_table_add(table, temb)
        _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), "no_grad")


def test_recipe_tiles():
    """Wan's real layout: whole 1024-column tiles of the 6 * D block, no mask (the tile only
    changes which program computes what, never an element's arithmetic)."""
    table = torch.empty(1, 1, 6, 3072)
    temb = torch.empty(1, 64, 6, 3072, dtype=torch.bfloat16)
    grid, (q, m1, m2, n_q, n_c), consts, _ = ta._recipe(table, temb)
    assert (q, m1, m2) == (64, 1, 6 * 3072) and consts["BLOCK_C"] == 1024 and consts["EVEN"]
    assert grid == (n_q * n_c,)
    # SkyReels': planes of S tokens per (sample, chunk)
    table = torch.empty(1, 6, 1, 3072)
    temb = torch.empty(2, 6, 64, 3072, dtype=torch.bfloat16)
    grid, (q, m1, m2, n_q, n_c), consts, _ = ta._recipe(table, temb)
    assert (q, m1, m2) == (64, 6, 3072) and consts["EVEN"] and grid == (12 * n_q * n_c,)


def test_custom_op_fake_shape():
    """The fake implementation torch.compile traces with: temb's shape, fp32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        table = torch.empty(1, 6, 1, 16)
        temb = torch.empty(2, 6, 5, 16, dtype=torch.bfloat16)
        out = torch.ops.ditfuse.table_add(table, temb)
    assert out.shape == (2, 6, 5, 16) and out.dtype == torch.float32


def test_int64_addressing(monkeypatch):
    """The 64-bit address path (taken where an operand's storage has 2**31 elements or more) gives
    the same bits."""
    monkeypatch.setattr(ta, "fits_int32", lambda *a, **k: False)
    for layout in LAYOUTS:
        table, temb = _inputs(layout, 2, 13, 48, torch.bfloat16, seed=3)
        _assert_bits(ta.table_add(table, temb), ref.table_add(table, temb), f"{layout} int64")
