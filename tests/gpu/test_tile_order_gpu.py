"""The 2-D-tiled elementwise kernels under both program orders (common/elementwise.py tile_pids):
the default row-block order and DITFUSE_TILE_ORDER=cols (one grid axis, column block fastest),
bitwise against the eager chains at FLUX.1's and FLUX.2's real widths, with tail rows, tiles
other than the default, NaN/Inf and NaN payloads in the copied half."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from tests.support.specials import with_specials

DEV = "cuda"
TILES = [None, (4, 1024, 8), (1, 1024, 4), (2, 2048, 8)]


def _rand(shape, scale=1.0):
    return with_specials(torch.randn(shape, device=DEV).mul_(scale).to(torch.bfloat16))


@pytest.mark.parametrize("cols_first", [False, True], ids=["rows", "cols"])
@pytest.mark.parametrize("tile_", TILES, ids=lambda t: "default" if t is None else "x".join(map(str, t)))
@pytest.mark.parametrize("B,S", [(1, 4608), (2, 4607)])
def test_act_cat_orders(B, S, tile_, cols_first):
    from ditfuse.kernels.activation import gelu_tanh_triton as gt
    from ditfuse.kernels.activation import swiglu_triton as sw
    from ditfuse.kernels.common import elementwise as ew

    torch.manual_seed(S + B)
    attn = _rand((B, S, 3072))
    attn.view(torch.int16).view(-1)[7] = 0x7F81  # NaN payload: copied bit for bit
    mlp = _rand((B, S, 12288), 3.0)
    rec = ew.act_cat_recipe(attn, mlp, None, tile_=tile_, cols_first=cols_first)
    got = ew.act_cat_fire(rec, gt._gelu_cat_act, gt.TANH_PTX, attn, mlp, None, ew_dtype(mlp))
    exp = ref.single_block_mlp_cat(attn, mlp)
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), "GELU cat payloads"
    assert_bitwise_equal(got, exp, f"gelu cat {tile_} cols_first={cols_first}")

    gate_in, up = _rand((B, S, 2048)), _rand((B, S, 2048))
    rec = ew.act_cat_recipe(attn, gate_in, up, tile_=tile_, cols_first=cols_first)
    got = ew.act_cat_fire(rec, sw._swiglu_tile, 0, attn, gate_in, up, ew_dtype(up))
    assert_bitwise_equal(got, torch.cat([attn, ref.swiglu(gate_in, up)], dim=-1), f"swiglu cat {tile_}")


@pytest.mark.parametrize("order", ["rows", "cols"])
def test_activations_orders(monkeypatch, order):
    from ditfuse.kernels.activation import gelu_tanh_triton as gt
    from ditfuse.kernels.activation import swiglu_triton as sw

    monkeypatch.setenv("DITFUSE_TILE_ORDER", order)
    torch.manual_seed(3)
    for B, S, D in ((1, 4608, 12288), (2, 4099, 5120), (2, 17, 3077)):
        x, u = _rand((B, S, D), 3.0), _rand((B, S, D))
        out = torch.empty_like(x)
        gt._launch(x, out)
        assert_bitwise_equal(out, ref.gelu_tanh(x), f"gelu {order} {(B, S, D)}")
        out = torch.empty_like(x)
        sw._launch(x, u, out)
        assert_bitwise_equal(out, ref.swiglu(x, u), f"swiglu {order} {(B, S, D)}")


def ew_dtype(t: torch.Tensor):
    from ditfuse.kernels.common.host import tl_dtype

    return tl_dtype(t.dtype)
