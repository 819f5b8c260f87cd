"""LayerNorm+modulate v2 (several rows per program) under TRITON_INTERPRET=1, bitwise against
tests/layernorm_sim.py and against v1: every rows-per-program value, row counts that are not a
multiple of it (masked tail rows), widths with idle threads (4, 12, 132) and a second-vector
tail (520), per-sample / per-token modulation, the gated op, strided inputs."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from tests import layernorm_sim as sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

EPS = 1e-6


def _x(shape, dtype, seed, scale=3.0, offset=5.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _run(x, sc, sh, impl, R=None):
    return lnm._launch(x, None, None, sc, sh, EPS, gated=False, impl=impl, rows_per_program=R)[1]


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("B,S", [(1, 5), (2, 3), (1, 4)], ids=["M5", "M6", "M4"])
@pytest.mark.parametrize("D", [4, 12, 132, 520])
def test_v2_rows_and_tails_match_sim(R, B, S, D):
    dtype = torch.bfloat16
    x = _x((B, S, D), dtype, D + S)
    sc = _x((B, D), dtype, D + 1, 0.5, 0.0)
    sh = _x((B, D), dtype, D + 2, 0.5, 0.0)
    got = _run(x, sc, sh, "v2", R)
    mm = compare_outputs(got, sim.layernorm_modulate(x, sc, sh, EPS))
    assert mm is None, str(mm)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("R", [2, 4])
def test_v2_per_token_other_dtypes(dtype, R):
    B, S, D = 2, 3, 136
    x = _x((B, S, D), dtype, 21)
    sc = _x((B, S, D), dtype, 22, 0.5, 0.0)
    sh = _x((B, S, D), dtype, 23, 0.5, 0.0)
    got = _run(x, sc, sh, "v2", R)
    assert compare_outputs(got, sim.layernorm_modulate(x, sc, sh, EPS)) is None
    assert compare_outputs(got, _run(x, sc, sh, "v1")) is None


@pytest.mark.parametrize("R", [1, 4])
def test_v2_gated_matches_v1_and_sim(R):
    dtype = torch.bfloat16
    B, S, D = 2, 3, 520
    res = _x((B, S, D), dtype, 1, 2.0, 1.0)
    upd = _x((B, S, D), dtype, 2, 1.0, 0.0)
    gate = _x((B, D), dtype, 3, 1.0, 0.0)
    sc = _x((B, S, D), dtype, 4, 0.5, 0.0)
    sh = _x((B, S, D), dtype, 5, 0.5, 0.0)
    h, n = lnm._launch(res, gate, upd, sc, sh, EPS, gated=True, impl="v2", rows_per_program=R)
    assert compare_outputs(h, ref.gate_residual(res, gate, upd), "h") is None
    assert compare_outputs(n, sim.layernorm_modulate(h, sc, sh, EPS), "n") is None
    h1, n1 = lnm._launch(res, gate, upd, sc, sh, EPS, gated=True, impl="v1")
    assert compare_outputs(h, h1) is None and compare_outputs(n, n1) is None


def test_v2_strided_and_special_values():
    D = 132
    wide = _x((2, 3, D + 8), torch.bfloat16, 7)
    x = wide[..., 4 : 4 + D]
    x[0, 0, 3] = float("nan")
    x[0, 1, :] = float("-inf")
    x[1, 0, :] = -0.0
    x[1, 1, 5] = float("inf")
    emb = _x((2, 6 * D), torch.bfloat16, 8, 0.5, 0.0)
    shift, scale = emb.chunk(6, dim=1)[:2]
    scale[0, 7] = -1.0
    got = _run(x, scale, shift, "v2", 4)
    assert compare_outputs(got, sim.layernorm_modulate(x.contiguous(), scale, shift, EPS)) is None
    assert compare_outputs(got, _run(x, scale, shift, "v1")) is None


def test_impl_env_switch(monkeypatch):
    x = _x((1, 3, 64), torch.bfloat16, 9)
    sc = _x((1, 64), torch.bfloat16, 10, 0.5, 0.0)
    monkeypatch.setenv("DITFUSE_LN_IMPL", "v1")
    assert lnm._impl() == "v1"
    a = lnm.layernorm_modulate(x, sc, sc, EPS)
    monkeypatch.setenv("DITFUSE_LN_IMPL", "v2")
    assert lnm._impl() == "v2"
    assert compare_outputs(lnm.layernorm_modulate(x, sc, sc, EPS), a) is None
    monkeypatch.delenv("DITFUSE_LN_IMPL")
    assert lnm._impl() == "v2"
    monkeypatch.setenv("DITFUSE_LN_IMPL", "v3")
    with pytest.raises(ValueError):
        lnm._impl()


def test_rows_per_program_rule():
    assert [lnm._rows_per_program(m) for m in (1, 511, 512, 2047, 2048, 65520)] == [1, 1, 2, 2, 4, 4]
