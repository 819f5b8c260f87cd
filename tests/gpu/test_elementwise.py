"""Issue 3 sweep for the elementwise kernels on CUDA: bitwise against ditfuse.kernels.reference.

modulate.gate_residual, activation.gelu_tanh over widths 3072, 1536, 2048,
2240, 4096, 5120 and an odd width (3077, handled), tokens 1, 17, 512, 4096, 4608, batch 1 and 2,
bf16 (fp16/fp32 subset), per-sample and per-token scale/shift/gate, NaN/Inf, strided inputs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from tests.support.specials import with_specials

WIDTHS = (3072, 1536, 2048, 2240, 4096, 5120, 3077)
TOKENS = (1, 17, 512, 4096, 4608)
BATCHES = (1, 2)
DEV = "cuda"


@pytest.fixture(scope="module")
def k():
    from ditfuse.kernels.activation.gelu_tanh_triton import gelu_tanh
    from ditfuse.kernels.modulate.gate_residual_triton import gate_residual

    return type("K", (), dict(gate_residual=staticmethod(gate_residual), gelu_tanh=staticmethod(gelu_tanh)))


_specials = with_specials


def _rand(shape, dtype, scale=1.0, specials=True):
    t = torch.randn(shape, device=DEV, dtype=torch.float32).mul_(scale).to(dtype)
    return _specials(t) if specials else t


def _check_all(k, x, scale, shift, gate, y, name):
    assert_bitwise_equal(k.gate_residual(x, gate, y), ref.gate_residual(x, gate, y), f"gate_residual {name}")
    assert_bitwise_equal(k.gelu_tanh(y), ref.gelu_tanh(y), f"gelu_tanh {name}")


@pytest.mark.parametrize("B,S", list(itertools.product(BATCHES, TOKENS)))
def test_sweep_bf16(k, B, S):
    torch.manual_seed(B * 10000 + S)
    for D in WIDTHS:
        x = _rand((B, S, D), torch.bfloat16, 4.0)
        y = _rand((B, S, D), torch.bfloat16, 3.0)
        sc, sh, g = (_rand((B, D), torch.bfloat16, 0.5) for _ in range(3))
        _check_all(k, x, sc, sh, g, y, f"per-sample B={B} S={S} D={D}")
        if S in (17, 4608) or D in (2240, 3077):
            sc3, sh3, g3 = (_rand((B, S, D), torch.bfloat16, 0.5) for _ in range(3))
            _check_all(k, x, sc3, sh3, g3, y, f"per-token B={B} S={S} D={D}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("B,S,D", [(2, 17, 3072), (1, 4608, 2240), (2, 512, 3077), (1, 1, 5120)])
def test_sweep_fp16_fp32(k, dtype, B, S, D):
    torch.manual_seed(S + D)
    x, y = _rand((B, S, D), dtype, 4.0), _rand((B, S, D), dtype, 3.0)
    sc, sh, g = (_rand((B, D), dtype, 0.5) for _ in range(3))
    _check_all(k, x, sc, sh, g, y, f"{dtype} per-sample B={B} S={S} D={D}")
    sc3, sh3, g3 = (_rand((B, S, D), dtype, 0.5) for _ in range(3))
    _check_all(k, x, sc3, sh3, g3, y, f"{dtype} per-token B={B} S={S} D={D}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_every_bit_pattern(k, dtype):
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype).reshape(2, 128, 256).to(DEV)
    assert_bitwise_equal(k.gelu_tanh(x), ref.gelu_tanh(x), f"gelu_tanh all {dtype} patterns")


def test_gelu_fp32_dense_sweep(k):
    x = torch.linspace(-12, 12, 1 << 22, device=DEV, dtype=torch.float32).reshape(1, 1024, 4096)
    assert_bitwise_equal(k.gelu_tanh(x), ref.gelu_tanh(x), "gelu_tanh fp32 [-12, 12]")
    g = torch.Generator(device=DEV).manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), device=DEV, generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).reshape(2, 512, 4096)
    assert_bitwise_equal(k.gelu_tanh(x), ref.gelu_tanh(x), "gelu_tanh fp32 random bit patterns")


@pytest.mark.parametrize("B", [1, 2])
def test_strided_inputs(k, B):
    torch.manual_seed(7)
    S, D = 4608, 3072
    dt = torch.bfloat16
    big = _rand((B, S, 2 * D), dt, 4.0)
    x = big[:, :, D:]  # row stride 2D
    xt = _rand((S, B, D), dt, 4.0).transpose(0, 1)  # batch-minor
    xs = _rand((B, S, 2 * D), dt, 4.0)[:, :, ::2]  # last-dim stride 2
    sc = _rand((B, 2 * D), dt, 0.5)[:, ::2]
    sh = _rand((D, B), dt, 0.5).t()
    g3 = _rand((B, S, 2 * D), dt, 0.5)[:, :, :D]
    for name, xx in (("row-strided", x), ("transposed", xt), ("last-dim stride 2", xs)):
        assert_bitwise_equal(k.gate_residual(xx, g3, x), ref.gate_residual(xx, g3, x), f"gate_residual {name}")
        assert_bitwise_equal(k.gelu_tanh(xx), ref.gelu_tanh(xx), f"gelu_tanh {name}")
    # batch-broadcast gate [1, D] and a transposed [B, D] gate
    sc1 = _rand((1, D), dt, 0.5)
    assert_bitwise_equal(k.gate_residual(x, sc1, xt), ref.gate_residual(x, sc1, xt), "gate_residual [1, D] gate")
    assert_bitwise_equal(k.gate_residual(x, sh, xt), ref.gate_residual(x, sh, xt), "gate_residual transposed gate")
    assert_bitwise_equal(k.gate_residual(x, sc, xs), ref.gate_residual(x, sc, xs), "gate_residual strided gate")


@pytest.mark.parametrize("B", [1, 2])
def test_gelu_into_single_block_buffer(k, B):
    """FLUX single block: cat([attn, gelu(proj_mlp(n))], dim=2) without the cat."""
    torch.manual_seed(3)
    S, D = 4608, 3072
    dt = torch.bfloat16
    attn = _rand((B, S, D), dt, 1.0)
    mlp_pre = _rand((B, S, 4 * D), dt, 3.0)
    buf = torch.empty(B, S, 5 * D, device=DEV, dtype=dt)
    buf[:, :, :D].copy_(attn)
    ret = k.gelu_tanh(mlp_pre, out=buf[:, :, D:])
    assert ret.data_ptr() == buf[:, :, D:].data_ptr()
    assert_bitwise_equal(buf, ref.single_block_mlp_cat(attn, mlp_pre), "single-block buffer")


@pytest.mark.parametrize("B", [1, 2])
def test_gelu_tanh_cat(B):
    """activation.gelu_tanh_cat: the whole single-block buffer in one kernel, bitwise equal to the
    eager cat of the attention output and the GELU: FLUX's widths (no block straddles), widths
    whose boundary falls inside a column block, a strided attention view, 4607 tokens (tail rows),
    NaN/Inf/-0 in both halves (the copy keeps NaN payloads)."""
    from ditfuse.kernels.activation.gelu_tanh_triton import can_use_gelu_tanh_cat, gelu_tanh_cat

    torch.manual_seed(5 + B)
    dt = torch.bfloat16
    failures = []
    for S, DA, DM in ((4608, 3072, 12288), (4607, 3072, 12288), (333, 96, 384), (77, 40, 200), (5, 1000, 24)):
        attn = _rand((B, S, DA), dt, 1.0)
        mlp_pre = _rand((B, S, DM), dt, 3.0)
        attn.view(-1)[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], dtype=dt)
        attn.view(torch.int16).view(-1)[5] = 0x7F81  # a NaN with a payload: copied, not re-canonicalised
        mlp_pre.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=dt)
        assert can_use_gelu_tanh_cat(attn, mlp_pre)
        got = gelu_tanh_cat(attn, mlp_pre)
        if not torch.equal(got.view(torch.int16), ref.single_block_mlp_cat(attn, mlp_pre).view(torch.int16)):
            failures.append(f"S={S} DA={DA} DM={DM}")
    wide = _rand((B, 64, 2 * 3072), dt, 1.0)
    attn = wide[:, :, ::2]  # strided attention input
    mlp_pre = _rand((B, 64, 4 * 3072), dt, 3.0)
    assert_bitwise_equal(gelu_tanh_cat(attn, mlp_pre), ref.single_block_mlp_cat(attn, mlp_pre), "strided attn")
    assert not failures, failures


def test_in_place_and_rejections(k):
    x = _rand((2, 17, 3072), torch.bfloat16, 3.0)
    expect = ref.gelu_tanh(x)
    k.gelu_tanh(x, out=x)
    assert_bitwise_equal(x, expect, "gelu in place")
    from ditfuse.kernels.activation.gelu_tanh_triton import can_use_gelu_tanh
    from ditfuse.kernels.modulate.gate_residual_triton import can_use_gate_residual

    y = torch.randn(2, 17, 3072, device=DEV, dtype=torch.bfloat16)
    assert not can_use_gelu_tanh(y, out=torch.empty(2, 17, 3072, device=DEV, dtype=torch.float32))
    assert not can_use_gelu_tanh(y.double())
    buf = torch.empty(2, 17, 3100, device=DEV, dtype=torch.bfloat16)
    assert not can_use_gelu_tanh(buf[:, :, :3072], out=buf[:, :, 28:])  # partial overlap
    with pytest.raises(UnsupportedInput):
        k.gelu_tanh(buf[:, :, :3072], out=buf[:, :, 28:])
    assert not can_use_gate_residual(y, None, y)  # a plain add: nothing to fuse
    with pytest.raises(UnsupportedInput):
        k.gate_residual(y.double(), y.double()[:, 0], y.double())


def test_under_torch_compile(k):
    """One opaque node each; the out= write into a buffer view survives functionalisation."""
    B, S, D = 1, 64, 256
    dt = torch.bfloat16
    x, y = _rand((B, S, D), dt, 3.0, False), _rand((B, S, 4 * D), dt, 3.0, False)
    sc, sh, g = (_rand((B, D), dt, 0.5, False) for _ in range(3))

    def fused(x, y, sc, sh, g):
        n = k.gate_residual(x, sc, sh[:, None].expand(B, S, D))
        buf = torch.empty(B, S, 5 * D, device=DEV, dtype=dt)
        buf[:, :, :D].copy_(n)
        k.gelu_tanh(y, out=buf[:, :, D:])
        return k.gate_residual(x, g, buf[:, :, :D]), buf

    def eager(x, y, sc, sh, g):
        n = ref.gate_residual(x, sc, sh[:, None].expand(B, S, D))
        return ref.gate_residual(x, g, n), ref.single_block_mlp_cat(n, y)

    got = torch.compile(fused, fullgraph=True)(x, y, sc, sh, g)
    assert_bitwise_equal(got, eager(x, y, sc, sh, g), "compiled fused chain")


@pytest.mark.parametrize("B", [1, 2])
def test_wan_mixed_dtype_gate_residual(k, B):
    """Wan: (x.float() + y * gate_fp32).type_as(x), gate a [B, 1, D] chunk of the fp32 modulation
    table or per-token [B, S, D] (TI2V), at the 1.3B video shape."""
    torch.manual_seed(11 + B)
    S, D = 32760, 1536
    dt = torch.bfloat16
    x, y = _rand((B, S, D), dt, 3.0), _rand((B, S, D), dt, 2.0)
    table = _rand((B, 6, D), torch.float32, 0.5)
    for name, g in (("[B,1,D] chunk", table.chunk(6, dim=1)[2]), ("per-token", _rand((B, S, D), torch.float32, 0.5))):
        exp = (x.float() + y.float() * g).type_as(x)
        assert_bitwise_equal(k.gate_residual(x, g, y), exp, f"wan gate_residual {name}")
        assert_bitwise_equal(k.gate_residual(x, g, y), ref.gate_residual(x, g, y), f"reference {name}")
