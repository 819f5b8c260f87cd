"""norm.rms_norm_diffusers_scale / gate_residual_rms_norm_diffusers(_scale) under TRITON_INTERPRET=1.

The kernel is compared bitwise with tests/support/rms_diffusers_rows_sim.py, a pure-torch
simulation of diffusers' RMSNorm as torch 2.11 runs it on CUDA (the generic reduce kernel's lane
order, MeanOps' factor) and of the Z-Image chains around it. Under the interpreter ``rsqrt`` is
numpy's ``1 / sqrt`` and the simulation uses the same (on the GPU both are ``rsqrtf``; the GPU
tests compare with eager). The simulation's elementwise parts are checked against the CPU
reference where the mean's order cannot matter (exact sums, power-of-two D), and the order is
shown to matter (a sequential sum differs on these inputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm import rms_norm_diffusers_triton as mod
from tests.support import rms_diffusers_rows_sim as sim
from tests.support.rms_sim import interp_rsqrt

EPS = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(*shape, dtype=torch.bfloat16, g=None):
    # per-row scales over several binades: the sums round in many ways
    s = torch.exp(torch.randn(*shape[:-1], 1, generator=g) * 1.5)
    return (torch.randn(*shape, generator=g) * s).to(dtype)


def _weight(D, kind, dtype, g):
    if kind is None:
        return None
    return (1 + 0.3 * torch.randn(D, generator=g)).to(torch.float32 if kind == "fp32" else dtype)


def _mod(B, S, D, dtype, g, shape="b1d"):
    if shape is None:
        return None
    if shape == "bd":
        return (torch.randn(B, D, generator=g) * 0.3).to(dtype)
    if shape == "bsd":
        return (torch.randn(B, S, D, generator=g) * 0.3).to(dtype)
    # Z-Image: a chunk of adaLN_modulation(c).unsqueeze(1).chunk(4, dim=2): [B, 1, D], strided
    big = (torch.randn(B, 1, 4 * D, generator=g) * 0.3).to(dtype)
    return big.chunk(4, dim=2)[1]


def _check_all(x, r, gate, scale, w, w2, label):
    got = mod.rms_norm_diffusers_scale(x, w, scale, EPS)
    assert_bitwise_equal(got, sim.rms_norm_diffusers_scale(x, w, scale, EPS, interp_rsqrt), f"Z1 {label}")
    if gate is not None:
        # LTX-Video's ``norm(h) * (1 + scale) + shift``: the gate's operand (every layout the
        # tests give it) serves as the shift
        got = mod.rms_norm_diffusers_scale(x, w, scale, EPS, gate)
        assert_bitwise_equal(got, sim.rms_norm_diffusers_scale(x, w, scale, EPS, interp_rsqrt, shift=gate),
                             f"Z1 + shift {label}")
    got = mod.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS)
    assert_bitwise_equal(got, sim.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS, interp_rsqrt), f"Z6 {label}")
    h, n = mod.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS)
    wh, wn = sim.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS, interp_rsqrt)
    assert_bitwise_equal(h, wh, f"Z3 h {label}")
    assert_bitwise_equal(n, wn, f"Z4 n {label}")


# ---------------------------------------------------------------------------- kernel == simulation


@pytest.mark.parametrize("D", [3840, 256, 128, 96, 64, 16])
@pytest.mark.parametrize("B,S", [(1, 1), (1, 7), (2, 37), (1, 19)])
def test_widths_and_row_counts(D, B, S):
    """Every verified width; 1 and 7 rows (more than 32 lanes per row), 19 and 74 (32 lanes)."""
    if D == 3840 and B * S > 40:
        S = 11  # keep the interpreter quick: 22 rows still take the 32-lane path
    g = _gen(D * 100 + B * 10 + S)
    x, r = _rows(B, S, D, g=g), _rows(B, S, D, g=g)
    _check_all(x, r, _mod(B, S, D, torch.bfloat16, g), _mod(B, S, D, torch.bfloat16, g),
               _weight(D, "half", torch.bfloat16, g), _weight(D, "half", torch.bfloat16, g), f"D={D} B={B} S={S}")


def test_mean_factor_and_many_rows():
    """MeanOps multiplies by ``f32(rows) / f32(rows * D)``: for Z-Image's row counts that is
    r32(1/3840), and ``sum * r32(1/D)`` is not ``sum / D`` for every sum; from rows * 15 >= 2^24
    the factor itself moves. The kernel's host factor equals the simulation's everywhere."""
    D = 3840
    for rows in (1, 7, 4109, 2 * 4109, 2**20 + 3, 3 * 2**20 + 1):
        assert mod.mean_factor(rows, D) == float(sim.factor(rows, D))
    assert sim.factor(3 * 2**20 + 1, D) != np.float32(1) / np.float32(D)
    sums = torch.exp(torch.rand(10000, generator=_gen(2)) * 20).float()
    f = torch.tensor(float(sim.factor(8218, D)), dtype=torch.float32)
    assert ((sums * f) != (sums / D)).any()
    g = _gen(5)
    x, r = _rows(2, 33, D, g=g), _rows(2, 33, D, g=g)
    gate, scale = _mod(2, 33, D, torch.bfloat16, g), _mod(2, 33, D, torch.bfloat16, g)
    w, w2 = _weight(D, "half", torch.bfloat16, g), _weight(D, "half", torch.bfloat16, g)
    _check_all(x, r, gate, scale, w, w2, "66 rows")


@pytest.mark.parametrize("gate_shape", [None, "b1d", "bd", "bsd"])
@pytest.mark.parametrize("scale_shape", [None, "b1d", "bd", "bsd"])
@pytest.mark.parametrize("wkind", [None, "half"])
def test_gate_scale_weight_variants(gate_shape, scale_shape, wkind):
    B, S, D = 2, 5, 256
    g = _gen(hash((gate_shape, scale_shape, wkind)) % 1000)
    x, r = _rows(B, S, D, g=g), _rows(B, S, D, g=g)
    _check_all(x, r, _mod(B, S, D, torch.bfloat16, g, gate_shape), _mod(B, S, D, torch.bfloat16, g, scale_shape),
               _weight(D, wkind, torch.bfloat16, g), _weight(D, wkind, torch.bfloat16, g),
               f"gate={gate_shape} scale={scale_shape} w={wkind}")


@pytest.mark.parametrize("D", [256, 64])
def test_mixed_weights_second_norm(D):
    g = _gen(D)
    x, r = _rows(2, 9, D, g=g), _rows(2, 9, D, g=g)
    w = _weight(D, "half", torch.bfloat16, g)
    _check_all(x, r, _mod(2, 9, D, torch.bfloat16, g), None, w, None, "w then None")
    _check_all(x, r, None, _mod(2, 9, D, torch.bfloat16, g), None, w, "None then w")


@pytest.mark.parametrize("D", [256, 96])
@pytest.mark.parametrize("wkind", [None, "fp32"])
def test_fp32_rows(D, wkind):
    g = _gen(D + 7)
    x, r = _rows(2, 6, D, dtype=torch.float32, g=g), _rows(2, 6, D, dtype=torch.float32, g=g)
    _check_all(x, r, _mod(2, 6, D, torch.float32, g), _mod(2, 6, D, torch.float32, g),
               _weight(D, wkind, torch.float32, g), _weight(D, wkind, torch.float32, g), f"fp32 w={wkind}")


def test_fp16_rows():
    g = _gen(16)
    D = 128
    x, r = _rows(1, 9, D, dtype=torch.float16, g=g), _rows(1, 9, D, dtype=torch.float16, g=g)
    _check_all(x, r, _mod(1, 9, D, torch.float16, g), _mod(1, 9, D, torch.float16, g),
               _weight(D, "half", torch.float16, g), _weight(D, "half", torch.float16, g), "fp16")


def test_strided_operands():
    """Rows that are a slice of a wider buffer, a transposed batch/sequence, 2-D rows; outputs
    are fresh contiguous tensors with eager's values."""
    g = _gen(3)
    B, S, D = 2, 7, 128
    wide = _rows(B, S, 3 * D, g=g)
    x = wide[..., D: 2 * D]  # leading strides 3D
    r = _rows(S, B, D, g=g).transpose(0, 1)  # [B, S, D] view of [S, B, D] memory
    gate = _mod(B, S, D, torch.bfloat16, g)
    scale = _mod(B, S, D, torch.bfloat16, g, "bsd").transpose(0, 1).contiguous().transpose(0, 1)
    w, w2 = _weight(D, "half", torch.bfloat16, g), _weight(D, "half", torch.bfloat16, g)
    _check_all(x, r, gate, scale, w, w2, "strided")
    x2, r2 = x.reshape(B * S, D), _rows(B * S, D, g=g)
    _check_all(x2, r2, None, _mod(B * S, 1, D, torch.bfloat16, g, "bd"), w, w2, "2-D rows")
    assert mod.rms_norm_diffusers_scale(x, w, None, EPS).is_contiguous()


def test_nan_inf_negative_zero():
    g = _gen(11)
    B, S, D = 1, 6, 256
    x, r = _rows(B, S, D, g=g), _rows(B, S, D, g=g)
    x[0, 0, 3] = float("nan")
    x[0, 1, 5] = float("inf")
    x[0, 2] = 0.0  # rstd = rsqrt(eps)
    x[0, 3, ::2] = -0.0
    x[0, 3, 1::2] = 0.0
    r[0, 4, 7] = float("-inf")
    r[0, 5, :8] = -0.0
    x[0, 5, :8] = -0.0
    gate, scale = _mod(B, S, D, torch.bfloat16, g), _mod(B, S, D, torch.bfloat16, g)
    scale[0, 0, 9] = -1.0  # 1 + scale = +0
    gate[0, 0, 10] = float("nan")
    _check_all(x, r, gate, scale, _weight(D, "half", torch.bfloat16, g), None, "nan/inf/-0")


# --------------------------------------------------------------------- simulation sanity checks


@pytest.mark.parametrize("wkind", [None, "half"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_simulation_elementwise_equals_reference(wkind, dtype):
    """With small-integer inputs every square and every partial sum is exact and D is a power of
    two (factor = 1/D exactly, like the CPU's division): the mean is the same in any order, so the
    simulation (with torch's CPU rsqrt) must equal the CPU reference chain bit for bit."""
    g = _gen(21)
    B, S, D = 2, 5, 64
    x = torch.randint(-8, 9, (B, S, D), generator=g).to(dtype)
    r = _rows(B, S, D, dtype=dtype, g=g)
    gate, scale = _mod(B, S, D, dtype, g), _mod(B, S, D, dtype, g)
    w = _weight(D, "half" if dtype != torch.float32 else "fp32", dtype, g) if wkind else None
    w2 = _weight(D, "half" if dtype != torch.float32 else "fp32", dtype, g) if wkind else None
    assert_bitwise_equal(sim.rms_norm_diffusers_scale(x, w, scale, EPS), rf.rms_norm_diffusers_scale(x, w, scale, EPS))
    for sc in (scale, None):
        assert_bitwise_equal(sim.rms_norm_diffusers_scale(x, w, sc, EPS, shift=gate),
                             rf.rms_norm_diffusers_scale(x, w, sc, EPS, gate))
    assert_bitwise_equal(sim.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS),
                         rf.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS))
    # the second norm's input h is not small integers: compare the first output, and the second
    # norm on integer rows separately
    h_sim, _ = sim.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS)
    h_ref, _ = rf.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS)
    assert_bitwise_equal(h_sim, h_ref)


def test_simulation_order_matters():
    """On these inputs a sequential sum gives other bits than the reduce order: a kernel summing
    in the wrong order would fail the tests above."""
    g = _gen(8)
    x = _rows(64, 3840, dtype=torch.float32, g=g)
    sq = x * x
    seq = sq[:, 0].clone()
    for i in range(1, 3840):
        seq = seq + sq[:, i]
    ours = sim.sumsq(x, 64)
    assert (ours != seq).any()
    halves_only = sq.clone()
    while halves_only.shape[-1] > 1:  # a plain halving tree over all elements
        if halves_only.shape[-1] % 2:
            halves_only = torch.cat([halves_only, halves_only.new_zeros(64, 1)], -1)
        h = halves_only.shape[-1] // 2
        halves_only = halves_only[:, :h] + halves_only[:, h:]
    assert (ours != halves_only[:, 0]).any()


def test_launch_layout_rules():
    assert mod.reduce_launch(3840, 4109) == (32, 4, False)
    assert mod.reduce_launch(3840, 1) == (512, 4, False)
    assert mod.reduce_launch(3840, 7) == (128, 4, False)
    assert mod.reduce_launch(128, 100)[:2] == (32, 4)
    assert mod.reduce_launch(96, 100)[:2] == (32, 1)
    assert mod.reduce_launch(16, 100)[:2] == (16, 1)
    assert mod.reduce_launch(8192, 4096)[2]  # would split rows across warps
    for D, rows in [(3840, 1), (3840, 7), (64, 3), (256, 19), (16, 2)]:
        assert mod.reduce_launch(D, rows)[:2] == sim.lanes(D, rows)


# ---------------------------------------------------------------------------------- rejections


def _base(D=64, dtype=torch.bfloat16):
    g = _gen(1)
    x, r = _rows(2, 3, D, dtype=dtype, g=g), _rows(2, 3, D, dtype=dtype, g=g)
    return x, r, _mod(2, 3, D, dtype, g), _mod(2, 3, D, dtype, g), _weight(D, "half", dtype, g)


def _rejections():
    x, r, gate, scale, w = _base()
    cases = {
        "int dtype": dict(x=x.to(torch.int32)),
        "4-D rows": dict(x=x[None], r=r[None]),
        "gate dtype": dict(gate=gate.float()),
        "scale dtype": dict(scale=scale.half()),
        "weight shape": dict(w=w[:-1]),
        "weight other half": dict(w=w.half()),
        "fp32 weight, bf16 rows": dict(w=w.float()),
        "int weight": dict(w=w.to(torch.int32)),
        "width 100": dict(x=_base(100)[0], r=_base(100)[1], gate=None, scale=None, w=None),
        "width 130": dict(x=_base(130)[0], r=_base(130)[1], gate=None, scale=None, w=None),
        "non-contiguous rows": dict(x=x.transpose(0, 2).contiguous().transpose(0, 2)),
        "interleaved rows": dict(x=torch.zeros(2, 3, 64, dtype=x.dtype).as_strided((2, 3, 64), (64, 16, 1))),
        "residual shape": dict(r=r[:, :2]),
        "residual dtype": dict(r=r.float()),
        "gate broadcast": dict(gate=gate[:, :, :32]),
        "shift dtype": dict(shift=scale.float()),
        "shift broadcast": dict(shift=scale[:, :, :32]),
        "eps type": dict(eps="1e-5"),
        "grad": dict(x=x.clone().requires_grad_(True)),
        "warp split": dict(x=torch.zeros(1, 2, 8192, dtype=x.dtype), r=torch.zeros(1, 2, 8192, dtype=x.dtype),
                           gate=None, scale=None, w=None),
    }
    return (x, r, gate, scale, w), cases


_BASE, _CASES = _rejections()


@pytest.mark.parametrize("name", sorted(_CASES))
def test_rejections(name):
    x, r, gate, scale, w = _BASE
    a = dict(x=x, r=r, gate=gate, scale=scale, w=w, eps=EPS)
    a.update(_CASES[name])
    res_only = name in ("residual shape", "residual dtype")
    gate_case = name.startswith("gate")
    if name.startswith("shift"):  # MODE 0 only: the same operand with a good shift is taken
        assert mod.can_use_rms_norm_diffusers_scale(a["x"], a["w"], a["scale"], a["eps"], gate)
        assert not mod.can_use_rms_norm_diffusers_scale(a["x"], a["w"], a["scale"], a["eps"], a["shift"]), name
        with pytest.raises(UnsupportedInput, match="shift"):
            mod.rms_norm_diffusers_scale(a["x"], a["w"], a["scale"], a["eps"], a["shift"])
        return
    with torch.enable_grad():
        if not res_only and not gate_case:
            assert not mod.can_use_rms_norm_diffusers_scale(a["x"], a["w"], a["scale"], a["eps"]), name
            with pytest.raises(UnsupportedInput):
                mod.rms_norm_diffusers_scale(a["x"], a["w"], a["scale"], a["eps"])
        if name.startswith("scale"):
            return
        assert not mod.can_use_gate_residual_rms_norm_diffusers(a["r"], a["gate"], a["x"], a["w"], a["eps"]), name
        with pytest.raises(UnsupportedInput):
            mod.gate_residual_rms_norm_diffusers(a["r"], a["gate"], a["x"], a["w"], a["eps"])
        assert not mod.can_use_gate_residual_rms_norm_diffusers_scale(
            a["r"], a["gate"], a["x"], a["w"], a["w"], a["scale"], a["eps"]), name
        with pytest.raises(UnsupportedInput):
            mod.gate_residual_rms_norm_diffusers_scale(a["r"], a["gate"], a["x"], a["w"], a["w"], a["scale"], a["eps"])


def test_accepts_base_and_rejects_cpu_without_interpreter(monkeypatch):
    x, r, gate, scale, w = _BASE
    assert mod.can_use_rms_norm_diffusers_scale(x, w, scale, EPS)
    assert mod.can_use_gate_residual_rms_norm_diffusers(r, gate, x, w, EPS)
    assert mod.can_use_gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w, scale, EPS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not mod.can_use_rms_norm_diffusers_scale(x, w, scale, EPS)
    with pytest.raises(UnsupportedInput, match="CUDA"):
        mod.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w, scale, EPS)


def test_empty_rows():
    x = torch.zeros(2, 0, 64, dtype=torch.bfloat16)
    out = mod.rms_norm_diffusers_scale(x, None, None, EPS)
    assert out.shape == x.shape
    h, n = mod.gate_residual_rms_norm_diffusers_scale(x, None, x, None, None, None, EPS)
    assert h.shape == n.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,S,D", [(1, 1, 64), (2, 13, 256), (1, 31, 96), (2, 3, 3840)])
def test_ltx_per_token_scale_shift(dtype, B, S, D):
    """LTX-Video's block head as diffusers spells it: ``ada = table[None, None] + temb.reshape(B,
    S, 6, -1)`` unbound on dim 2 (strided [B, S, D] views, per token for I2V), then
    ``norm1(h) * (1 + scale_msa) + shift_msa`` with diffusers' weightless RMSNorm. The kernel on
    those views equals the simulation bit for bit, with NaN, +-Inf, -0 and 1 + scale = 0 in the
    operands; the shift alone (scale None) too."""
    g = _gen(B * 1000 + S * 10 + D)
    x = _rows(B, S, D, dtype=dtype, g=g)
    table = (torch.randn(6, D, generator=g) / D ** 0.5).to(dtype)
    temb = (torch.randn(B, S, 6 * D, generator=g) * 0.5).to(dtype)
    ada = table[None, None] + temb.reshape(B, S, 6, -1)
    shift, scale = ada.unbind(dim=2)[:2]
    x[0, 0, 1] = float("nan")
    x[-1, -1, 2] = float("-inf")
    x[0, -1, :4] = -0.0
    scale[0, 0, 3] = -1.0
    shift[0, 0, 4] = float("inf")
    shift[-1, 0, 5] = -0.0
    assert scale.stride(-1) == 1 and scale.stride(1) == 6 * D
    for sc in (scale, None):
        got = mod.rms_norm_diffusers_scale(x, None, sc, EPS, shift)
        want = sim.rms_norm_diffusers_scale(x, None, sc, EPS, interp_rsqrt, shift=shift)
        assert_bitwise_equal(got, want, f"LTX {dtype} [{B},{S},{D}] scale={'yes' if sc is not None else 'None'}")
    # the per-sample (T2V) layout: temb [B, 1, 6D]
    ada1 = table[None, None] + temb[:, :1].reshape(B, 1, 6, -1)
    sh1, sc1 = ada1.unbind(dim=2)[:2]
    assert_bitwise_equal(mod.rms_norm_diffusers_scale(x, None, sc1, EPS, sh1),
                         sim.rms_norm_diffusers_scale(x, None, sc1, EPS, interp_rsqrt, shift=sh1), "LTX per sample")
