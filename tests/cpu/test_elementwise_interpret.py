"""Elementwise kernels under TRITON_INTERPRET=1 (set by tests/conftest.py when there is no CUDA).

gate_residual is checked bitwise against ditfuse.kernels.reference: its fp32 math is a plain
multiply and add per eager op (numpy computes them exactly as the GPU does) and the bf16 stores
go through the round-to-nearest-even shim; mixed dtypes (Wan's fp32 gate on bf16 activations)
follow torch's promotion. GELU is checked with a tolerance
here: on the GPU the kernel uses libdevice tanhf (ex2.approx / rcp.approx), which the interpreter
does not have; it runs the same algorithm with numpy's exp2 and an exact division, and the
interpreter's fma rounds twice, so the fp32 value before the final rounding may differ by a few
ulps from torch's CPU tanh-GELU (itself a different implementation from CUDA's). Bitwise GELU is
proved on the GPU (tests/gpu/test_elementwise.py, all 65,536 bf16 and fp16 patterns).
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 1, 1), (1, 1, 64), (2, 7, 96), (1, 13, 136), (2, 3, 97), (2, 1, 31)]


@pytest.fixture(scope="module")
def k():
    from ditfuse.kernels.activation import gelu_tanh_triton as g
    from ditfuse.kernels.modulate import gate_residual_triton as gr

    return type("K", (), dict(gr=gr, g=g))


def _specials(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    vals = (float("nan"), float("inf"), float("-inf"), -0.0, 1e-40)
    for i, v in enumerate(vals):
        if i * 5 < flat.numel():
            flat[i * 5] = v
    return flat.reshape(t.shape)


def _rand(shape, dtype, scale=1.0, specials=True):
    t = (torch.randn(shape) * scale).to(dtype)
    return _specials(t) if specials else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_token", [False, True])
def test_gate_residual_bitwise(k, dtype, shape, per_token):
    torch.manual_seed(sum(shape) + 1)
    B, S, D = shape
    res, upd = _rand(shape, dtype, 4.0), _rand(shape, dtype, 3.0)
    gate = _rand((B, S, D) if per_token else (B, D), dtype, 0.7)
    assert k.gr.can_use_gate_residual(res, gate, upd)
    assert_bitwise_equal(k.gr.gate_residual(res, gate, upd), ref.gate_residual(res, gate, upd))


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 7, 96), (2, 3, 100)])
@pytest.mark.parametrize("gate_form", ["[B,1,D] chunk", "[B,S,D]"])
def test_gate_residual_mixed_dtypes_wan(k, gate_dtype, shape, gate_form):
    """Wan: (x.float() + y * gate_fp32).type_as(x): fp32 product and sum, one bf16 rounding."""
    torch.manual_seed(sum(shape) + 7)
    B, S, D = shape
    res, upd = _rand(shape, torch.bfloat16, 4.0), _rand(shape, torch.bfloat16, 3.0)
    if gate_form == "[B,S,D]":
        gate = _rand((B, S, D), gate_dtype, 0.7)
    else:  # a chunk of the [B, 6, D] modulation table, as Wan's forward produces it
        gate = _rand((B, 6, D), gate_dtype, 0.7).chunk(6, dim=1)[2]
    out = k.gr.gate_residual(res, gate, upd)
    assert out.dtype == torch.bfloat16
    wan = (res.float() + upd.float() * gate.float()).type_as(res) if gate_dtype == torch.float32 else None
    assert_bitwise_equal(out, ref.gate_residual(res, gate, upd))
    if wan is not None:
        assert_bitwise_equal(out, wan, "diffusers' Wan spelling")


def test_rounding_paths_are_exercised(k):
    """Values chosen so that skipping the product's rounding changes the bf16 result."""
    torch.manual_seed(0)
    x = _rand((2, 16, 64), torch.bfloat16, 8.0, specials=False)
    gate, upd = _rand((2, 64), torch.bfloat16, 0.9, False), _rand((2, 16, 64), torch.bfloat16, 5.0, False)
    fused = (x.double() + gate[:, None].double() * upd.double()).to(torch.bfloat16)
    expect = ref.gate_residual(x, gate, upd)
    assert not torch.equal(fused, expect)  # the product's rounding matters for these inputs
    assert_bitwise_equal(k.gr.gate_residual(x, gate, upd), expect)


def test_broadcast_forms(k):
    torch.manual_seed(1)
    x = _rand((2, 5, 64), torch.bfloat16, 2.0)
    for sc in (_rand((2, 1, 64), torch.bfloat16), _rand((1, 64), torch.bfloat16), _rand((1, 5, 64), torch.bfloat16)):
        assert_bitwise_equal(k.gr.gate_residual(x, sc, x), ref.gate_residual(x, sc, x))


def test_strided_views(k):
    torch.manual_seed(2)
    dt = torch.bfloat16
    big = _rand((2, 7, 160), dt, 3.0)
    x = big[:, :, 32:128]  # row stride 160
    xt = _rand((7, 2, 96), dt, 3.0).transpose(0, 1)
    xs = _rand((2, 7, 192), dt, 3.0)[:, :, ::2]
    g3 = _rand((2, 7, 192), dt)[:, :, 96:]
    g2 = _rand((2, 192), dt)[:, ::2]
    for xx in (x, xt, xs):
        assert_bitwise_equal(k.gr.gate_residual(xx, g3, x), ref.gate_residual(xx, g3, x))
        assert_bitwise_equal(k.gr.gate_residual(xx, g2, x), ref.gate_residual(xx, g2, x))


def _gelu_close(actual: torch.Tensor, x: torch.Tensor) -> None:
    expect = ref.gelu_tanh(x)
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expect)
    assert torch.equal(nan_a, nan_e)
    assert torch.equal(torch.isinf(actual), torch.isinf(expect))
    fin = ~nan_e & ~torch.isinf(expect)
    a64, e64 = actual[fin].double(), expect[fin].double()
    # 1 ulp of the output dtype (bf16 2^-8, fp16 2^-10 relative; 4 ulps in fp32), plus the
    # cancellation in 1 + tanh(inner) for x << 0 (tanh -> -1): a few fp32 ulps of 1 times |0.5 x|.
    rel = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10, torch.float32: 2.0**-21}[x.dtype]
    tol = rel * e64.abs() + 2.0**-21 * x[fin].double().abs() + 1e-38
    bad = (a64 - e64).abs() > tol
    assert int(bad.sum()) == 0, f"{int(bad.sum())} values out of tolerance, first at x={x[fin][bad][0].item()}"
    # after a bf16/fp16 rounding the vast majority must be bitwise equal already
    same = (actual.reshape(-1) == expect.reshape(-1)) | (nan_a & nan_e).reshape(-1)
    assert same.float().mean() > (0.97 if x.dtype != torch.float32 else 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(3, 5, 7, 16)])
def test_gelu_tanh_close(k, dtype, shape):
    torch.manual_seed(len(shape) + sum(shape))
    x = _rand(shape, dtype, 3.0)
    _gelu_close(k.g.gelu_tanh(x), x)


def test_gelu_tanh_into_buffer_slice(k):
    torch.manual_seed(3)
    B, S, D = 2, 5, 32
    attn = _rand((B, S, D), torch.bfloat16)
    mlp_pre = _rand((B, S, 4 * D), torch.bfloat16, 3.0)
    buf = torch.full((B, S, 5 * D), 7.0, dtype=torch.bfloat16)
    buf[:, :, :D].copy_(attn)
    ret = k.g.gelu_tanh(mlp_pre, out=buf[:, :, D:])
    assert ret.data_ptr() == buf[:, :, D:].data_ptr()
    assert_bitwise_equal(buf[:, :, :D], attn)  # untouched
    assert_bitwise_equal(buf[:, :, D:], k.g.gelu_tanh(mlp_pre))  # same bits as the contiguous path
    _gelu_close(buf[:, :, D:], mlp_pre)


@pytest.mark.parametrize("DA,DM", [(32, 128), (96, 384), (40, 200), (1000, 24), (0, 64)],
                         ids=["aligned", "flux-ratio", "straddle", "wide-attn", "no-attn"])
def test_gelu_tanh_cat_is_copy_plus_gelu(k, DA, DM):
    """gelu_tanh_cat == cat([attn, gelu_tanh(mlp_pre)]) bitwise (the same GELU code under the
    interpreter; its closeness to eager is checked above), whether or not a column block
    straddles the boundary, NaN payloads in the attention half copied as they are, tail rows, a
    strided attention view."""
    torch.manual_seed(DA + DM)
    B, S = 2, 5
    attn = _rand((B, S, 2 * DA), torch.bfloat16)[:, :, ::2]
    if DA:
        attn.view(torch.int16)[0, 0, 0] = 0x7F81  # NaN with a payload
    mlp_pre = _rand((B, S, DM), torch.bfloat16, 3.0)
    got = k.g.gelu_tanh_cat(attn, mlp_pre)
    assert got.shape == (B, S, DA + DM) and got.is_contiguous()
    assert_bitwise_equal(got, torch.cat([attn, k.g.gelu_tanh(mlp_pre)], dim=2))
    with pytest.raises(UnsupportedInput, match="dtype"):
        k.g.gelu_tanh_cat(attn.float(), mlp_pre)
    assert not k.g.can_use_gelu_tanh_cat(attn[:, :3], mlp_pre)


def test_gelu_tanh_strided_input_and_in_place(k):
    torch.manual_seed(4)
    x = _rand((2, 6, 128), torch.bfloat16, 3.0)[:, :, ::2]
    _gelu_close(k.g.gelu_tanh(x), x)
    y = _rand((2, 6, 64), torch.bfloat16, 3.0)
    y0 = y.clone()
    k.g.gelu_tanh(y, out=y)
    assert_bitwise_equal(y, k.g.gelu_tanh(y0))


def test_predicates_match_raises(k):
    dt = torch.bfloat16
    x = torch.randn(2, 3, 64).to(dt)
    good_sc = torch.randn(2, 64).to(dt)
    bad = [
        (x[0], good_sc),  # 2-D x
        (x.double(), good_sc.double()),  # fp64
        (x, torch.randn(3, 64).to(dt)),  # batch mismatch
        (x, torch.randn(2, 32).to(dt)),  # width mismatch
        (x, None),  # no gate: a plain add, nothing to fuse
    ]
    for res, gate in bad:
        assert not k.gr.can_use_gate_residual(res, gate, res)
        with pytest.raises(UnsupportedInput):
            k.gr.gate_residual(res, gate, res)
    assert not k.gr.can_use_gate_residual(x, good_sc, x[:, :1])  # update shape differs
    assert k.gr.can_use_gate_residual(x, good_sc.float(), x)  # promotion is reproduced
    w = torch.randn(2, 3, 64, requires_grad=True)
    assert not k.gr.can_use_gate_residual(w, torch.randn(2, 64), w)
    with torch.no_grad():
        assert k.gr.can_use_gate_residual(w, torch.randn(2, 64), w)
    # gelu
    buf = torch.empty(2, 3, 80, dtype=dt)
    gbad = [
        (x.double(), None),
        (x, torch.empty(2, 3, 64)),  # out dtype
        (x, torch.empty(2, 3, 63, dtype=dt)),  # out shape
        (buf[:, :, :64], buf[:, :, 16:]),  # partial overlap
        (torch.randn(4, 3, 5, 64).to(dt).permute(1, 0, 2, 3)[:, :, ::2], None),  # 3 leading strided dims
    ]
    for xx, out in gbad:
        assert not k.g.can_use_gelu_tanh(xx, out)
        with pytest.raises(UnsupportedInput):
            k.g.gelu_tanh(xx, out)
    assert k.g.can_use_gelu_tanh(x, x)  # in place is fine
    assert k.g.can_use_gelu_tanh(torch.randn(7).to(dt))  # 1-D


def test_empty_inputs(k):
    x = torch.empty(2, 0, 64, dtype=torch.bfloat16)
    sc = torch.randn(2, 64).to(torch.bfloat16)
    assert k.gr.gate_residual(x, sc, x).shape == (2, 0, 64)
    assert k.g.gelu_tanh(x).shape == (2, 0, 64)


def test_custom_ops_registered_with_fake_impls(k):
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert torch.ops.ditfuse.gate_residual.default._schema.name == "ditfuse::gate_residual"
    schema = torch.ops.ditfuse.gelu_tanh.default._schema
    assert schema.name == "ditfuse::gelu_tanh"
    assert schema.arguments[1].alias_info is not None and schema.arguments[1].alias_info.is_write
    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        sc = torch.empty(2, 64, dtype=torch.bfloat16)
        assert torch.ops.ditfuse.gate_residual(x, sc, x).shape == (2, 3, 64)
        assert torch.ops.ditfuse.gelu_tanh(x, x) is None
        m = torch.empty(2, 3, 256, dtype=torch.bfloat16)
        assert torch.ops.ditfuse.gelu_tanh_cat(x, m).shape == (2, 3, 320)


def test_opcheck(k):
    x = torch.randn(1, 2, 32).to(torch.bfloat16)
    sc = torch.randn(1, 32).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.ditfuse.gate_residual.default, (x, sc, x),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ditfuse.gelu_tanh.default, (x, torch.empty_like(x)),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ditfuse.gelu_tanh_cat.default, (x, torch.randn(1, 2, 128).to(torch.bfloat16)),
                          test_utils=("test_schema", "test_faketensor"))


def test_registry_loads_these_kernels():
    from ditfuse.kernels.registry import select

    for op in ("modulate.gate_residual", "activation.gelu_tanh"):
        spec = select(op)
        assert callable(spec.load()) and callable(spec.load_predicate())


def test_int32_and_int64_addressing_agree(monkeypatch):
    """The 32-bit address path (every offset fits in int32) and the 64-bit one give the same
    bits in each elementwise kernel (gate residual, GELU into a buffer slice, SwiGLU), strided
    inputs included; fits_int32 bounds the largest offset."""
    from ditfuse.kernels.activation import gelu_tanh_triton as gt
    from ditfuse.kernels.activation import swiglu_triton as sw
    from ditfuse.kernels.common import elementwise as ew
    from ditfuse.kernels.modulate import gate_residual_triton as grt

    g = torch.Generator().manual_seed(11)
    res = torch.randn(2, 7, 96, generator=g).to(torch.bfloat16)
    upd = torch.randn(2, 7, 192, generator=g).to(torch.bfloat16)[..., ::2]  # strided
    gate = torch.randn(2, 1, 96, generator=g)
    buf = torch.zeros(2, 7, 160, dtype=torch.bfloat16)

    def run():
        gr = grt._launch(res, gate, upd)
        buf.zero_()
        gt._launch(upd, buf[..., 64:])  # GELU into a slice of a wider buffer
        out = torch.empty_like(res)
        sw._launch(res, upd, out)
        return gr, buf.clone(), out

    fast = run()
    for mod in (grt, gt, sw):
        monkeypatch.setattr(mod, "fits_int32", lambda *a, **k: False)
    slow = run()
    for a, b in zip(fast, slow):
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(fast[0], ref.gate_residual(res, gate, upd))
    assert ew.fits_int32(res, upd)
    assert not ew.fits_int32(torch.empty((2, 1 << 30), device="meta"))  # metadata only
    assert ew.fits_int32(torch.empty(1, device="meta").expand(2, 1 << 30))  # stride 0: small offsets


@pytest.mark.parametrize("tile_", [None, (1, 32, 4), (4, 64, 4), (2, 16, 4)], ids=["default", "1x32", "4x64", "2x16"])
def test_program_order_gives_the_same_bits(monkeypatch, tile_):
    """DITFUSE_TILE_ORDER=cols (one grid axis, column block fastest) and the default row-block
    order launch the same programs in another order: every element's arithmetic is the same, so
    the bits are, for GELU (into a strided slice), SwiGLU and the GELU/SwiGLU-into-cat kernels,
    with tail rows, tail columns and column blocks that straddle the cat boundary."""
    from ditfuse.kernels.activation import gelu_tanh_triton as gt
    from ditfuse.kernels.activation import swiglu_triton as sw
    from ditfuse.kernels.common import elementwise as ew
    from ditfuse.kernels.common.host import tl_dtype

    g = torch.Generator().manual_seed(5)
    x = _rand((2, 7, 200), torch.bfloat16, 3.0)[..., ::2]  # strided, D = 100: a tail column block
    u = torch.randn(2, 7, 100, generator=g).to(torch.bfloat16)
    attn = torch.randn(2, 7, 40, generator=g).to(torch.bfloat16)  # 40 + 100: blocks straddle

    def run(order):
        monkeypatch.setenv("DITFUSE_TILE_ORDER", order)
        buf = torch.zeros(2, 7, 164, dtype=torch.bfloat16)
        gt._launch(x, buf[..., 64:])
        sw_out = torch.zeros(2, 7, 100, dtype=torch.bfloat16)
        sw._launch(x, u, sw_out)
        cols = order == "cols"
        cats = []
        for act, p, uu in ((gt._gelu_cat_act, gt.TANH_PTX, None), (sw._swiglu_tile, 0, u)):
            rec = ew.act_cat_recipe(attn, x, uu, tile_=tile_, cols_first=cols)
            assert rec[-1] is cols and len(rec[0]) == (1 if cols else 2)
            cats.append(ew.act_cat_fire(rec, act, p, attn, x, uu, tl_dtype(x.dtype)))
        return buf, sw_out, *cats

    rows, cols = run("rows"), run("cols")
    for a, b in zip(rows, cols):
        assert_bitwise_equal(b, a)
    assert_bitwise_equal(rows[2], torch.cat([attn, rows[0][..., 64:]], dim=2))
    assert_bitwise_equal(rows[3], torch.cat([attn, rows[1]], dim=2))
    assert ew.tile_grid(10, 100, 4, 32, True) == (3 * 4,) and ew.tile_grid(10, 100, 4, 32, False) == (3, 4)
