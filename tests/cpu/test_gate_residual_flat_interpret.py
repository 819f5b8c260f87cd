"""modulate.gate_residual's flat per-sample launch (on by default since round 13's H100 probe;
DITFUSE_GATE_RESIDUAL_FLAT=0 turns it off) under the Triton interpreter: the same bits as eager and as the tile kernel,
taken exactly where it applies (contiguous residual and update, a gate broadcast over tokens)."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.modulate import gate_residual_triton as gr


@pytest.fixture
def flat(monkeypatch):
    monkeypatch.setenv("DITFUSE_GATE_RESIDUAL_FLAT", "1")
    gr._RECIPES.clear()
    yield
    gr._RECIPES.clear()


def _t(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape,gshape,gdtype", [
    ((1, 1, 1), (1, 1), torch.bfloat16),            # one element
    ((1, 37, 48), (1, 1, 48), torch.float32),       # Wan's fp32 [B, 1, D] gate, prime token count
    ((2, 5, 96), (2, 96), torch.bfloat16),          # CFG batch, S * D a multiple of neither block
    ((2, 64, 16), (2, 16), torch.bfloat16),         # S * D = 1024: the unmasked (EVEN) path
    ((3, 7, 1000), (3, 1, 1000), torch.float16),    # non-power-of-two width
])
def test_flat_path_bitwise(flat, shape, gshape, gdtype):
    x, u = _t(shape, torch.bfloat16, 1), _t(shape, torch.bfloat16, 2)
    g = _t(gshape, gdtype, 3)
    assert gr._recipe(x, g, u)[0] is gr._gate_residual_flat_kernel
    assert_bitwise_equal(gr.gate_residual(x, g, u), ref.gate_residual(x, g, u), "flat gate_residual")


def test_flat_path_nan_inf(flat):
    x, u = _t((2, 9, 64), torch.bfloat16, 4), _t((2, 9, 64), torch.bfloat16, 5)
    g = _t((2, 64), torch.bfloat16, 6)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    u[1, 8, 5] = float("inf")
    g[1, 5] = 0.0  # inf * 0 = nan in the product
    assert_bitwise_equal(gr.gate_residual(x, g, u), ref.gate_residual(x, g, u), "flat gate_residual nan/inf")


@pytest.mark.parametrize("case", ["per-token gate", "strided residual", "strided update"])
def test_tile_kernel_elsewhere(flat, case):
    x, u = _t((2, 11, 32), torch.bfloat16, 7), _t((2, 11, 32), torch.bfloat16, 8)
    g = _t((2, 32), torch.bfloat16, 9)
    if case == "per-token gate":
        g = _t((2, 11, 32), torch.bfloat16, 9)
    elif case == "strided residual":
        x = _t((2, 32, 11), torch.bfloat16, 7).transpose(1, 2)
    elif case == "strided update":
        u = _t((2, 11, 64), torch.bfloat16, 8)[..., ::2]
    assert gr._recipe(x, g, u)[0] is gr._gate_residual_kernel
    assert_bitwise_equal(gr.gate_residual(x, g, u), ref.gate_residual(x, g, u), case)


@pytest.mark.parametrize("value,kernel", [(None, "_gate_residual_flat_kernel"), ("0", "_gate_residual_kernel")])
def test_default_and_switch(monkeypatch, value, kernel):
    if value is None:
        monkeypatch.delenv("DITFUSE_GATE_RESIDUAL_FLAT", raising=False)
    else:
        monkeypatch.setenv("DITFUSE_GATE_RESIDUAL_FLAT", value)
    x, u, g = _t((1, 8, 32), torch.bfloat16, 1), _t((1, 8, 32), torch.bfloat16, 2), _t((1, 32), torch.bfloat16, 3)
    assert gr._recipe(x, g, u)[0] is getattr(gr, kernel)


def test_switch_is_part_of_the_call_key(monkeypatch):
    """DITFUSE_GATE_RESIDUAL_FLAT is in the geometry key (plans._ENV_SWITCHES): flipping it picks
    the other launch for the same tensors without clearing the cached recipes."""
    from ditfuse.kernels.common.plans import call_key

    x, u, g = _t((1, 8, 32), torch.bfloat16, 1), _t((1, 8, 32), torch.bfloat16, 2), _t((1, 32), torch.bfloat16, 3)
    keys = []
    for value in ("1", "0"):
        monkeypatch.setenv("DITFUSE_GATE_RESIDUAL_FLAT", value)
        keys.append(call_key((x, g, u)))
        assert_bitwise_equal(gr.gate_residual(x, g, u), ref.gate_residual(x, g, u), f"switch {value}")
    assert keys[0] != keys[1]
    assert {gr._RECIPES.get(k)[0] for k in keys} == {gr._gate_residual_flat_kernel, gr._gate_residual_kernel}
