"""activation.swiglu under TRITON_INTERPRET=1 (set by tests/conftest.py when there is no CUDA).

On the GPU the kernel's SiLU is libdevice's expf and an IEEE division, bitwise aten's
ActivationSiluKernel (tests/gpu/test_swiglu.py, every bf16 and fp16 bit pattern). The interpreter
has numpy's exp instead and torch's CPU SiLU is a vectorized Sleef exp, so the values before the
last rounding may differ by an ulp: the SiLU-gated product is checked to a couple of ulps here, and
everything that does not depend on exp (layouts, the buffer slice, the rounding of the SiLU before
the multiply, rejections, the custom op) is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 1, 1), (1, 1, 64), (2, 7, 96), (1, 13, 136), (2, 3, 97), (2, 1, 31), (3, 5, 7, 16)]


@pytest.fixture(scope="module")
def k():
    from ditfuse.kernels.activation import swiglu_triton

    return swiglu_triton


def _rand(shape, dtype, scale=3.0, specials=True):
    t = (torch.randn(shape) * scale).to(dtype)
    if specials:
        flat = t.reshape(-1)
        for i, v in enumerate((float("nan"), float("inf"), float("-inf"), -0.0, 88.5, -90.0)):
            if i * 5 < flat.numel():
                flat[i * 5] = v
        t = flat.reshape(shape)
    return t


def _close(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """Within 4 ulps of eager's dtype (NaN where eager has NaN), and mostly bitwise already."""
    expect = ref.swiglu(a, b)
    assert actual.dtype == expect.dtype and actual.shape == expect.shape
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expect)
    assert torch.equal(nan_a, nan_e), f"NaN positions differ: {int((nan_a != nan_e).sum())}"
    fin = ~nan_e
    eps = torch.finfo(actual.dtype).eps
    tol = 4 * eps * expect[fin].float().abs() + torch.finfo(actual.dtype).tiny
    bad = (actual[fin].float() - expect[fin].float()).abs() > tol
    inf_ok = torch.isinf(expect[fin]) & (actual[fin] == expect[fin])
    bad &= ~inf_ok
    assert not bad.any(), (f"{int(bad.sum())} of {fin.sum()} outside 4 ulps; first: "
                           f"{actual[fin][bad][0].item()} vs {expect[fin][bad][0].item()}")
    same = (actual == expect) | (nan_a & nan_e)
    assert same.float().mean() > (0.95 if actual.dtype != torch.float32 else 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_close(k, dtype, shape):
    torch.manual_seed(sum(shape) + len(shape))
    a, b = _rand(shape, dtype), _rand(shape, dtype, 1.0, specials=False)
    _close(k.swiglu(a, b), a, b)


def test_silu_is_rounded_before_the_multiply(k):
    """b = 1 + 2^-7 (bf16): r(s * b) with s rounded to bf16 first differs from r(s32 * b) for
    many s; the kernel must keep eager's intermediate rounding."""
    torch.manual_seed(1)
    a = (torch.randn(4096) * 4).to(torch.bfloat16)
    b = torch.full_like(a, 1 + 2 ** -7)
    got = k.swiglu(a, b)
    one_round = (torch.nn.functional.silu(a.float()) * b.float()).to(torch.bfloat16)
    two_round = (torch.nn.functional.silu(a.float()).to(torch.bfloat16).float() * b.float()).to(torch.bfloat16)
    assert (one_round != two_round).sum() > 100  # the test has teeth
    agree2 = (got == two_round).float().mean().item()
    agree1 = (got == one_round).float().mean().item()
    assert agree2 > 0.99 and agree2 > agree1, (agree2, agree1)


@pytest.mark.parametrize("B", [1, 2])
def test_fused_projection_halves_into_buffer_slice(k, B):
    """FLUX.2 single block: swiglu(p[..., :I], p[..., I:]) of the MLP columns of the fused
    projection, written into the MLP columns of the [B, S, D + I] to_out input."""
    torch.manual_seed(3 + B)
    S, D, I = 5, 16, 48
    proj = _rand((B, S, 3 * D + 2 * I), torch.bfloat16)
    mlp = proj[..., 3 * D:]
    gate_in, up = mlp[..., :I], mlp[..., I:]
    buf = torch.full((B, S, D + I), 7.0, dtype=torch.bfloat16)
    attn = _rand((B, S, D), torch.bfloat16)
    buf[..., :D].copy_(attn)
    ret = k.swiglu(gate_in, up, out=buf[..., D:])
    assert ret.data_ptr() == buf[..., D:].data_ptr()
    assert_bitwise_equal(buf[..., :D], attn, "attention columns untouched")
    assert_bitwise_equal(buf[..., D:], k.swiglu(gate_in.contiguous(), up.contiguous()), "strided = contiguous")
    _close(buf[..., D:], gate_in, up)
    assert_bitwise_equal(ref.swiglu_halves(mlp), ref.swiglu(gate_in, up))


def test_in_place(k):
    torch.manual_seed(5)
    a, b = _rand((2, 6, 64), torch.bfloat16), _rand((2, 6, 64), torch.bfloat16, 1.0)
    expect = k.swiglu(a, b)
    k.swiglu(a, b, out=a)
    assert_bitwise_equal(a, expect, "in place over gate_in")


def test_rejections_match_predicate(k):
    dt = torch.bfloat16
    x = torch.randn(2, 3, 64).to(dt)
    buf = torch.empty(2, 3, 80, dtype=dt)
    bad = [
        (x.double(), x.double(), None),
        (x, x.float(), None),  # promotion
        (x, x[:, :1], None),  # broadcasting
        (x, x, torch.empty(2, 3, 64)),  # out dtype
        (x, x, torch.empty(2, 3, 63, dtype=dt)),  # out shape
        (buf[:, :, :64], x, buf[:, :, 16:]),  # partial overlap
        (torch.randn(4, 3, 5, 64).to(dt).permute(1, 0, 2, 3)[:, :, ::2],) * 2 + (None,),  # 3 strided dims
        (x, "x", None),
    ]
    for a, b, out in bad:
        assert not k.can_use_swiglu(a, b, out)
        with pytest.raises(UnsupportedInput):
            k.swiglu(a, b, out)
    w = torch.randn(2, 3, 64, requires_grad=True)
    assert not k.can_use_swiglu(w, w)
    with torch.no_grad():
        assert k.can_use_swiglu(w, w)
    assert k.can_use_swiglu(torch.randn(7).to(dt), torch.randn(7).to(dt))  # 1-D
    assert k.swiglu(torch.empty(2, 0, 8, dtype=dt), torch.empty(2, 0, 8, dtype=dt)).shape == (2, 0, 8)


def test_custom_op_and_opcheck(k):
    from torch._subclasses.fake_tensor import FakeTensorMode

    schema = torch.ops.ditfuse.swiglu.default._schema
    assert schema.name == "ditfuse::swiglu"
    assert schema.arguments[2].alias_info is not None and schema.arguments[2].alias_info.is_write
    with FakeTensorMode():
        x = torch.empty(2, 3, 64, dtype=torch.bfloat16)
        assert torch.ops.ditfuse.swiglu(x, x, torch.empty_like(x)) is None
    a = torch.randn(1, 2, 32).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.ditfuse.swiglu.default, (a, a.clone(), torch.empty_like(a)),
                          test_utils=("test_schema", "test_faketensor"))


def test_registry_and_gate_table():
    from ditfuse.contracts.ops import LOSSLESS
    from ditfuse.kernels.registry import select

    spec = select("activation.swiglu")
    assert callable(spec.load()) and callable(spec.load_predicate())
    assert LOSSLESS.swiglu.descriptor.op == "activation.swiglu"


@pytest.mark.parametrize("DA,DM", [(32, 96), (64, 192), (40, 200), (1000, 24), (0, 64)],
                         ids=["aligned", "flux2-ratio", "straddle", "wide-attn", "no-attn"])
def test_swiglu_cat_is_copy_plus_swiglu(k, DA, DM):
    """swiglu_cat == cat([attn, swiglu(gate_in, up)], -1) bitwise (the same SwiGLU code under the
    interpreter; its closeness to eager is checked above): the halves of one fused projection as
    strided inputs, a strided attention view with a NaN payload copied as it is, column blocks
    straddling the boundary or not, tail rows; the refusals."""
    torch.manual_seed(DA + DM)
    B, S = 2, 5
    attn = _rand((B, S, 2 * DA), torch.bfloat16, specials=False)[:, :, ::2]
    if DA:
        attn.view(torch.int16)[0, 0, 0] = 0x7F81  # NaN with a payload
    proj = _rand((B, S, 2 * DM), torch.bfloat16)
    gate_in, up = proj[..., :DM], proj[..., DM:]
    assert k.can_use_swiglu_cat(attn, gate_in, up)
    got = k.swiglu_cat(attn, gate_in, up)
    assert got.shape == (B, S, DA + DM) and got.is_contiguous()
    exp = torch.cat([attn, k.swiglu(gate_in, up)], dim=-1)
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    _close(got[..., DA:], gate_in, up)
    with pytest.raises(UnsupportedInput, match="dtype"):
        k.swiglu_cat(attn.float(), gate_in, up)
    assert not k.can_use_swiglu_cat(attn[:, :3], gate_in, up)
    assert not k.can_use_swiglu_cat(attn, gate_in, up[..., :-1])


def test_swiglu_cat_op_schema_and_reference():
    """ditfuse::swiglu_cat's FakeTensor implementation, and the reference against diffusers'
    Flux2SwiGLU + cat."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    from ditfuse.kernels.activation import swiglu_triton  # noqa: F401 (registers the op)

    a = torch.randn(1, 3, 16).to(torch.bfloat16)
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.ditfuse.swiglu_cat.default, (a, x[..., :32], x[..., 32:]),
                          test_utils=("test_schema", "test_faketensor"))
    assert_bitwise_equal(ref.single_block_swiglu_cat(a, x[..., :32], x[..., 32:]),
                         torch.cat([a, Flux2SwiGLU()(x)], dim=-1))
