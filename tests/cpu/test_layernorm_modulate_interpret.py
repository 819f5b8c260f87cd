"""layernorm_modulate / gate_residual_layernorm_modulate under TRITON_INTERPRET=1 (CPU).

The kernel reproduces torch's CUDA reduction order, which torch's CPU LayerNorm does not use,
so the bitwise check here is against tests/layernorm_sim.py (a pure-torch simulation of the
CUDA order, sharing nothing with the Triton code but the documented formulas); the eager CPU
reference is checked to a tight tolerance. The bitwise check against CUDA eager is in
tests/gpu/test_layernorm_modulate.py.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm.layernorm_modulate_triton import (
    can_use_gate_residual_layernorm_modulate,
    can_use_layernorm_modulate,
    gate_residual_layernorm_modulate,
    layernorm_modulate,
)
from tests import layernorm_sim as sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# 4: one vector; 64/96/136: fewer vectors than threads (idle threads, count-0 combines);
# 520: 130 vectors, so threads 0-1 read a second vector (the tail loop).
WIDTHS = [4, 64, 136, 520]


def _x(shape, dtype, seed, scale=3.0, offset=5.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _tol(dtype):
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("D", WIDTHS)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_layernorm_modulate_matches_cuda_order_sim(D, dtype, per_token):
    B, S = 2, 3
    x = _x((B, S, D), dtype, D)
    mshape = (B, S, D) if per_token else (B, D)
    scale = _x(mshape, dtype, D + 1, 0.5, 0.0)
    shift = _x(mshape, dtype, D + 2, 0.5, 0.0)
    got = layernorm_modulate(x, scale, shift, EPS)
    mm = compare_outputs(got, sim.layernorm_modulate(x, scale, shift, EPS))
    assert mm is None, str(mm)
    # torch's CPU LayerNorm sums in another order: close, not bitwise.
    exp = ref.layernorm_modulate(x, scale, shift, EPS)
    torch.testing.assert_close(got.float(), exp.float(), rtol=_tol(dtype), atol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("D", [64, 520])
def test_gate_residual_layernorm_modulate(D, dtype):
    B, S = 2, 2
    res = _x((B, S, D), dtype, 1, 2.0, 1.0)
    upd = _x((B, S, D), dtype, 2, 1.0, 0.0)
    gate = _x((B, D), dtype, 3, 1.0, 0.0)
    scale = _x((B, S, D), dtype, 4, 0.5, 0.0)
    shift = _x((B, S, D), dtype, 5, 0.5, 0.0)
    h, n = gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
    # the gated residual is elementwise: eager CPU rounds the same way (bitwise)
    mm = compare_outputs(h, ref.gate_residual(res, gate, upd), "h")
    assert mm is None, str(mm)
    mm = compare_outputs(n, sim.layernorm_modulate(h, scale, shift, EPS), "n")
    assert mm is None, str(mm)


def test_strided_inputs_same_bits_as_contiguous():
    D = 136
    wide = _x((2, 3, D + 8), torch.bfloat16, 7)
    x = wide[..., 4 : 4 + D]
    emb = _x((2, 6 * D), torch.bfloat16, 8, 0.5, 0.0)
    shift, scale = emb.chunk(6, dim=1)[:2]
    assert not x.is_contiguous() and not scale.is_contiguous()
    assert can_use_layernorm_modulate(x, scale, shift, EPS)
    got = layernorm_modulate(x, scale, shift, EPS)
    exp = layernorm_modulate(x.contiguous(), scale.contiguous(), shift.contiguous(), EPS)
    assert compare_outputs(got, exp) is None
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert compare_outputs(layernorm_modulate(xt, scale, shift, EPS), exp) is None


def test_nan_inf_signed_zero_match_sim():
    D = 64
    x = _x((1, 6, D), torch.bfloat16, 9)
    x[0, 0, 3] = float("nan")
    x[0, 1, 5] = float("inf")
    x[0, 2, :] = float("-inf")
    x[0, 3, :] = 0.0
    x[0, 4, :] = -0.0
    scale = _x((1, D), torch.bfloat16, 10, 0.5, 0.0)
    shift = _x((1, D), torch.bfloat16, 11, 0.5, 0.0)
    scale[0, 7] = -1.0  # 1 + scale = 0 -> signed zeros in the product
    shift[0, 7] = -0.0
    shift[0, 8] = float("nan")
    got = layernorm_modulate(x, scale, shift, EPS)
    mm = compare_outputs(got, sim.layernorm_modulate(x, scale, shift, EPS))
    assert mm is None, str(mm)
    assert torch.isnan(got[0, 0]).all() and torch.isnan(got[0, 2]).all()


def test_welford_tree_sim_is_not_a_plain_mean():
    """The simulation is sensitive to order: a different combine contraction changes bits for
    some rows (so the kernel == sim check above can fail)."""
    x = _x((64, 1040), torch.float32, 12, 3.0, 5.0)
    m0, r0 = sim.row_stats(x, EPS)
    m2, r2 = sim.row_stats(x, EPS, mean_mode=2, m2_fma=False)
    assert not (torch.equal(m0, m2) and torch.equal(r0, r2))
    # and it agrees with fp64 statistics to fp32 accuracy
    xd = x.double()
    torch.testing.assert_close(m0[:, 0].double(), xd.mean(-1), rtol=1e-6, atol=1e-6)
    rd = torch.rsqrt(xd.var(-1, unbiased=False) + EPS)
    torch.testing.assert_close(r0[:, 0].double(), rd, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "case",
    ["odd_width", "width_6", "misaligned", "dtype_mismatch", "ndim2", "mod_shape", "fp64", "eps_str"],
)
def test_predicate_rejects_and_kernel_raises(case):
    D = 64
    x = _x((1, 2, D), torch.bfloat16, 13)
    sc = _x((1, D), torch.bfloat16, 14)
    sh = _x((1, D), torch.bfloat16, 15)
    eps = EPS
    if case == "odd_width":
        x, sc, sh = _x((1, 2, 67), torch.bfloat16, 1), _x((1, 67), torch.bfloat16, 2), _x((1, 67), torch.bfloat16, 3)
    elif case == "width_6":
        x, sc, sh = _x((1, 2, 6), torch.bfloat16, 1), _x((1, 6), torch.bfloat16, 2), _x((1, 6), torch.bfloat16, 3)
    elif case == "misaligned":
        flat = _x((2 * D + 1,), torch.bfloat16, 16)
        x = flat[1:].view(1, 2, D)
        assert x.is_contiguous() and x.data_ptr() % 8 != 0
    elif case == "dtype_mismatch":
        sc = sc.float()
    elif case == "ndim2":
        x = x[0]
    elif case == "mod_shape":
        sc = _x((1, 1, D), torch.bfloat16, 17)
    elif case == "fp64":
        x, sc, sh = x.double(), sc.double(), sh.double()
    elif case == "eps_str":
        eps = "1e-6"
    assert can_use_layernorm_modulate(x, sc, sh, eps) is False
    with pytest.raises(UnsupportedInput):
        layernorm_modulate(x, sc, sh, eps)


def test_gated_predicate():
    D = 64
    r = _x((1, 2, D), torch.bfloat16, 1)
    g = _x((1, D), torch.bfloat16, 2)
    sc = _x((1, D), torch.bfloat16, 3)
    assert can_use_gate_residual_layernorm_modulate(r, g, r, sc, sc, EPS)
    # misalignment of residual does not matter: LayerNorm sees the fresh eager output h
    flat = _x((2 * D + 1,), torch.bfloat16, 4)
    r_mis = flat[1:].view(1, 2, D)
    assert can_use_gate_residual_layernorm_modulate(r_mis, g, r, sc, sc, EPS)
    assert not can_use_gate_residual_layernorm_modulate(r, g, r[..., :32], sc, sc, EPS)
    assert not can_use_gate_residual_layernorm_modulate(r, g.float(), r, sc, sc, EPS)
    with pytest.raises(UnsupportedInput):
        gate_residual_layernorm_modulate(r, g, r.float(), sc, sc, EPS)


def test_empty_tokens():
    x = torch.empty(2, 0, 64, dtype=torch.bfloat16)
    sc = torch.zeros(2, 64, dtype=torch.bfloat16)
    out = layernorm_modulate(x, sc, sc, EPS)
    assert out.shape == (2, 0, 64)


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        sc = torch.empty(2, 64, dtype=torch.bfloat16)
        out = torch.ops.ditfuse.layernorm_modulate(x, sc, sc, EPS)
        h, n = torch.ops.ditfuse.gate_residual_layernorm_modulate(x, sc, x, sc, sc, EPS)
    assert out.shape == (2, 5, 64) and out.dtype == torch.bfloat16
    assert h.shape == n.shape == (2, 5, 64)


def test_registry_points_here():
    from ditfuse.kernels import registry

    for op, fn in (
        ("norm.layernorm_modulate", layernorm_modulate),
        ("norm.gate_residual_layernorm_modulate", gate_residual_layernorm_modulate),
    ):
        spec = registry.select(op, backend="triton", device="cpu")
        assert spec.load() is fn
