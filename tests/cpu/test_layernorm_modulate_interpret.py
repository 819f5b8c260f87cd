"""LayerNorm (+ residual, + modulate) kernel under TRITON_INTERPRET=1 (CPU), both contracts.

The kernel reproduces torch's CUDA reduction order, which torch's CPU LayerNorm does not use, so
the bitwise check here is against tests/support/layernorm_sim.py (a pure-torch simulation of the
CUDA order, sharing nothing with the Triton code but the documented formulas); the eager CPU
reference is checked to a tight tolerance. Covered: every rows-per-program value with masked tail
rows, widths with idle threads (4, 12, 132) and a second-vector tail (520), FLUX's all-bf16 chain
and Wan's fp32 chains (FP32LayerNorm, fp32 [B, 1, D] modulation chunks, affine norm2, the plain
residual add), per-sample / per-token modulation, strided inputs, NaN/Inf/-0. The bitwise check
against CUDA eager is tests/gpu/test_layernorm_modulate.py.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.norm.layernorm_modulate_triton import (
    can_use_gate_residual_layernorm_modulate,
    can_use_layernorm_modulate,
    gate_residual_layernorm_modulate,
    gate_residual_layernorm_modulate_fp32,
    layernorm_modulate,
    layernorm_modulate_fp32,
)
from tests.support import layernorm_sim as sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
F32 = torch.float32


def _x(shape, dtype, seed, scale=3.0, offset=5.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _tol(dtype):
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]


def _eq(actual, expected, name="out"):
    mm = compare_outputs(actual, expected, name)
    assert mm is None, str(mm)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("D", [4, 64, 136, 520])
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_flux_chain_matches_cuda_order_sim(D, dtype, per_token):
    B, S = 2, 3
    x = _x((B, S, D), dtype, D)
    mshape = (B, S, D) if per_token else (B, D)
    scale = _x(mshape, dtype, D + 1, 0.5, 0.0)
    shift = _x(mshape, dtype, D + 2, 0.5, 0.0)
    got = layernorm_modulate(x, scale, shift, EPS)
    _eq(got, sim.layernorm_modulate(x, scale, shift, EPS))
    # torch's CPU LayerNorm sums in another order: close, not bitwise.
    exp = ref.layernorm_modulate(x, scale, shift, EPS)
    torch.testing.assert_close(got.float(), exp.float(), rtol=_tol(dtype), atol=_tol(dtype))


PATHS = {"warp": dict(warp=True), "held": dict(warp=False), "loop": dict(unroll=False, prefetch=False),
         "loop_prefetch": dict(unroll=False, prefetch=True)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mod", ["per_sample", "per_token", "fp32_scale"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_scale_only_modulate(gated, mod, dtype, path):
    """Qwen-Image 2.1's shift-free chain ``r(r(LN(x)) * r(1 + scale))`` (and after the gated
    residual), on every way over a row: the simulation's bits, and no shift read (a NaN-filled
    tensor passed nowhere); the output dtype is promote(x, scale), as eager's product is."""
    B, S, D = 2, 3, 1024
    x = _x((B, S, D), dtype, 70)
    mdt = F32 if mod == "fp32_scale" else dtype
    sc = _x((B, S, D) if mod == "per_token" else (B, 1, D), mdt, 71, 0.5, 0.0)
    if gated:
        g, u = _x((B, 1, D), dtype, 72, 0.5, 0.0), _x((B, S, D), dtype, 73)
        h, got = lnm._launch(x, g, u, sc, None, EPS, None, None, None, True, **PATHS[path])
        h_exp = ref.gate_residual(x, g, u)
        _eq(h, h_exp, "h")
        exp = sim.layernorm_modulate(h_exp, sc, None, EPS)
    else:
        got = lnm._launch(x, None, None, sc, None, EPS, None, None, None, True, **PATHS[path])[1]
        exp = sim.layernorm_modulate(x, sc, None, EPS)
    assert got.dtype == exp.dtype == torch.promote_types(dtype, mdt)
    _eq(got, exp)
    # A zero shift is no stand-in: equal in value, but ``-0 + 0`` is ``+0``, so wherever the product
    # is -0 the bits differ (why the kernel has a shift-free mode rather than a zeros tensor).
    with_zero = sim.layernorm_modulate(x if not gated else h_exp, sc, torch.zeros_like(sc), EPS)
    assert torch.equal(got, with_zero)
    neg_zero = (got == 0) & torch.signbit(got)
    assert not torch.signbit(with_zero[neg_zero]).any()


def test_scale_only_public_api_and_close_variant():
    x = _x((1, 5, 136), torch.bfloat16, 80)
    sc = _x((1, 136), torch.bfloat16, 81, 0.5, 0.0)
    assert can_use_layernorm_modulate(x, sc, None, EPS)
    _eq(layernorm_modulate(x, sc, None, EPS), sim.layernorm_modulate(x, sc, None, EPS))
    close = layernorm_modulate_fp32(x, sc, None, EPS)
    torch.testing.assert_close(close.float(), ref.layernorm_modulate(x, sc, None, EPS).float(),
                               rtol=_tol(torch.bfloat16), atol=_tol(torch.bfloat16))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("B,S", [(1, 5), (2, 3), (1, 4)], ids=["M5", "M6", "M4"])
@pytest.mark.parametrize("D", [12, 132, 520, 1024])
def test_rows_per_program_and_tail_rows(R, B, S, D, path):
    """Every way over a row (warp per row / held tiles / runtime loop), every tiling, tail rows;
    D = 1024 is a whole number of 128-thread steps (unpredicated loads, tail rows read row 0 and
    store nothing), the only width here the warp-per-row kernel takes."""
    if path == "warp" and D % 512:
        pytest.skip("the warp-per-row kernel needs whole 128-thread steps")
    x = _x((B, S, D), torch.bfloat16, D + S)
    sc = _x((B, D), torch.bfloat16, D + 1, 0.5, 0.0)
    sh = _x((B, D), torch.bfloat16, D + 2, 0.5, 0.0)
    got = lnm._launch(x, None, None, sc, sh, EPS, None, None, None, True, rows_per_program=R, **PATHS[path])[1]
    _eq(got, sim.layernorm_modulate(x, sc, sh, EPS))


@pytest.mark.parametrize("fp32_mod", [False, True], ids=["flux_bf16_mod", "wan_fp32_mod"])
def test_ten_step_rows_take_the_warp_kernel_bitwise(fp32_mod, monkeypatch):
    """D = 5120 (10 steps, Wan-14B's width and issue 13's large shape): a LayerNorm + modulate row
    without a residual takes the warp-per-row kernel by default (LN_WARP_MAX_STEPS), bitwise the
    simulation of torch's order, FLUX's bf16 chain and Wan's fp32 one; with a residual it keeps
    the 128-thread kernel."""
    launched = []
    real = lnm.launch
    monkeypatch.setattr(lnm, "launch", lambda fn, *a, **k: launched.append(fn) or real(fn, *a, **k))
    B, S, D = 1, 3, 5120
    x = _x((B, S, D), torch.bfloat16, 51)
    mdt = F32 if fp32_mod else torch.bfloat16
    sc, sh, g = (_x((B, 1, D), mdt, 52 + i, 0.5, 0.0) for i in range(3))
    nd = F32 if fp32_mod else None
    got = layernorm_modulate(x, sc, sh, EPS, norm_dtype=nd)
    assert launched == [lnm._ln_warp_kernel], launched
    _eq(got, sim.layernorm_modulate(x, sc, sh, EPS, norm_dtype=nd))
    launched.clear()
    u = _x((B, S, D), torch.bfloat16, 55)
    gate_residual_layernorm_modulate(x, g, u, sc, sh, EPS, norm_dtype=nd)
    assert launched and lnm._ln_warp_kernel not in launched, launched


def test_row_kernel_switch(monkeypatch):
    """DITFUSE_ROW_KERNEL picks the kernel family for whole-step rows (default ``auto``: the
    warp-per-row kernels where they measured faster on the H200 — every row without a residual,
    rows with one up to width 2048); every choice gives the simulation's bits, and an unknown
    value is an error, not a silent default."""
    from ditfuse.kernels.common.host import warp_plan, warp_rows_enabled

    x = _x((1, 3, 512), torch.bfloat16, 1)
    sc, sh = _x((1, 512), torch.bfloat16, 2, 0.5, 0.0), _x((1, 512), torch.bfloat16, 3, 0.5, 0.0)
    monkeypatch.delenv("DITFUSE_ROW_KERNEL", raising=False)
    assert warp_rows_enabled() and warp_rows_enabled(3072) and warp_rows_enabled(1536, residual=True)
    assert not warp_rows_enabled(3072, residual=True)  # FLUX's gated LayerNorm: 80.6 % vs 69.3 %
    assert warp_plan(3072, 4, None) is not None and warp_plan(3072, 4, None, residual=True) is None
    assert warp_plan(1536, 4, None, residual=True) is not None
    _eq(layernorm_modulate(x, sc, sh, EPS), sim.layernorm_modulate(x, sc, sh, EPS))
    for v in ("block", "warp", "WARP", "auto"):
        monkeypatch.setenv("DITFUSE_ROW_KERNEL", v)
        assert warp_rows_enabled(3072, residual=True) == (v.lower() == "warp")
        assert warp_rows_enabled(1536) == (v.lower() != "block")
        _eq(layernorm_modulate(x, sc, sh, EPS), sim.layernorm_modulate(x, sc, sh, EPS))
    monkeypatch.setenv("DITFUSE_ROW_KERNEL", "fast")
    with pytest.raises(ValueError, match="DITFUSE_ROW_KERNEL"):
        layernorm_modulate(x, sc, sh, EPS)


def test_warp_path_rule():
    """Whole 128-thread steps up to WARP_MAX_STEPS (LN_WARP_MAX_STEPS for LayerNorm rows without a
    residual) qualify for the warp-per-row kernels."""
    from ditfuse.kernels.common.host import warp_path

    from ditfuse.kernels.common.host import LN_WARP_MAX_STEPS, warp_plan

    assert warp_path(384) and warp_path(768)  # Wan 1536, FLUX 3072
    assert not warp_path(560)  # 2240: a partial last step
    assert not warp_path(1280)  # 5120: 10 steps
    assert warp_path(1280, LN_WARP_MAX_STEPS) and not warp_path(1536, LN_WARP_MAX_STEPS)  # 5120 yes, 6144 no
    assert not warp_path(0)
    # the LayerNorm launcher: 5120-wide rows take the warp kernel without a residual, not with one
    assert warp_plan(5120, 8, None, max_steps=LN_WARP_MAX_STEPS) is not None
    assert warp_plan(5120, 8, None, residual=True) is None
    with pytest.raises(ValueError, match="512"):
        x = torch.zeros(1, 1, 132, dtype=torch.bfloat16)
        lnm._launch(x, None, None, None, None, EPS, None, None, None, True, warp=True)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "close"])
@pytest.mark.parametrize("D", [132, 512])
def test_gated_paths_agree(D, exact, path):
    """The gated kernel's h and output through every way over the row, 5 rows at R = 2 (a tail
    row), fp32 norm with affine as Wan's norm2: same bits as the simulation (exact) or as the
    runtime loop (close, whose recipe has no simulation)."""
    if path == "warp" and D % 512:
        pytest.skip("the warp-per-row kernel needs whole 128-thread steps")
    B, S = 1, 5
    res = _x((B, S, D), torch.bfloat16, 1, 2.0, 1.0)
    upd = _x((B, S, D), torch.bfloat16, 2, 1.0, 0.0)
    gate = _x((B, 1, D), torch.float32, 3, 1.0, 0.0)
    w = _x((D,), torch.float32, 4, 0.2, 1.0)
    bias = _x((D,), torch.float32, 5, 0.2, 0.0)
    h, out = lnm._launch(res, gate, upd, None, None, EPS, w, bias, torch.float32, exact, rows_per_program=2,
                         **PATHS[path])
    if exact:
        eh = (res.float() + upd * gate).type_as(res)
        eout = sim.layernorm_modulate(eh, None, None, EPS, w, bias, torch.float32)
    else:
        other = PATHS["held" if path.startswith("loop") else "loop"]
        eh, eout = lnm._launch(res, gate, upd, None, None, EPS, w, bias, torch.float32, exact, rows_per_program=2,
                               **other)
    _eq(h, eh)
    _eq(out, eout)


def test_rows_per_program_rule(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the GPU rule
    ms = (1, 511, 512, 2047, 2048, 65520)
    assert [lnm._rows_per_program(m, 0, True) for m in ms] == [1] * 6  # the runtime loop: one row
    assert [lnm._rows_per_program(m, 3, True) for m in ms] == [1, 1, 2, 2, 2, 2]  # held: 6 vectors
    assert [lnm._rows_per_program(m, 3, False) for m in ms] == [1] * 6  # held without residual: 3
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter: few, wide programs
    assert [lnm._rows_per_program(m) for m in (1, 5, 33, 4096)] == [1, 8, 32, 32]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("D", [64, 520])
def test_gated_flux(D, dtype):
    B, S = 2, 2
    res = _x((B, S, D), dtype, 1, 2.0, 1.0)
    upd = _x((B, S, D), dtype, 2, 1.0, 0.0)
    gate = _x((B, D), dtype, 3, 1.0, 0.0)
    scale = _x((B, S, D), dtype, 4, 0.5, 0.0)
    shift = _x((B, S, D), dtype, 5, 0.5, 0.0)
    h, n = gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
    # the gated residual is elementwise: eager CPU rounds the same way (bitwise)
    _eq(h, ref.gate_residual(res, gate, upd), "h")
    _eq(n, sim.layernorm_modulate(h, scale, shift, EPS), "n")


# -- Wan: FP32LayerNorm on x.float(), fp32 modulation, .type_as(x) ------------------------------


def _wan_mods(B, S, D, seed, per_token=False, dtype=F32):
    """Chunks of ``scale_shift_table + temb.float()`` as Wan's forward makes them."""
    if per_token:
        return [c.squeeze(2) for c in _x((B, S, 6, D), dtype, seed, 0.5, 0.0).chunk(6, dim=2)]
    return list(_x((B, 6, D), dtype, seed, 0.5, 0.0).chunk(6, dim=1))


@pytest.mark.parametrize("per_token", [False, True], ids=["wan2.1", "ti2v_per_token"])
@pytest.mark.parametrize("D", [48, 136])
def test_wan_norm1_modulate(per_token, D):
    B, S = 2, 3
    x = _x((B, S, D), torch.bfloat16, 31)
    shift, scale = _wan_mods(B, S, D, 32, per_token)[:2]
    got = layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32)
    assert got.dtype == torch.bfloat16
    _eq(got, sim.layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32))
    # diffusers' own spelling of the chain
    wan = (torch.nn.functional.layer_norm(x.float(), (D,), eps=EPS) * (1 + scale) + shift).type_as(x)
    torch.testing.assert_close(got.float(), wan.float(), rtol=1.6e-2, atol=1.6e-2)


def test_wan_tail_with_bf16_modulation():
    """norm_out with a bf16 scale_shift_table (plain .to(bf16) load): 1 + scale rounds to bf16,
    the product and sum stay fp32."""
    B, S, D = 1, 4, 64
    x = _x((B, S, D), torch.bfloat16, 41)
    shift, scale = _x((B, 2, D), torch.bfloat16, 42, 0.5, 0.0).chunk(2, dim=1)
    got = layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32)
    _eq(got, sim.layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32))


@pytest.mark.parametrize("wdtype", [F32, torch.bfloat16], ids=["pretrained_fp32_norm2", "plain_bf16_norm2"])
def test_wan_gated_residual_affine_norm2(wdtype):
    B, S, D = 2, 3, 132
    x = _x((B, S, D), torch.bfloat16, 51, 2.0, 1.0)
    attn = _x((B, S, D), torch.bfloat16, 52, 1.0, 0.0)
    gate = _wan_mods(B, S, D, 53)[2]
    w, b = _x((D,), wdtype, 54, 0.3, 1.0), _x((D,), wdtype, 55, 0.3, 0.0)
    h, n = gate_residual_layernorm_modulate(x, gate, attn, None, None, EPS, w, b, F32)
    _eq(h, (x.float() + attn * gate).type_as(x), "h (diffusers' spelling)")
    _eq(n, sim.layernorm_modulate(h, None, None, EPS, w, b, F32), "n")


def test_wan_plain_residual_then_norm3_modulate():
    B, S, D = 1, 5, 64
    x = _x((B, S, D), torch.bfloat16, 61)
    attn = _x((B, S, D), torch.bfloat16, 62, 1.0, 0.0)
    mods = _wan_mods(B, S, D, 63)
    h, n = gate_residual_layernorm_modulate(x, None, attn, mods[4], mods[3], EPS, norm_dtype=F32)
    _eq(h, x + attn, "h")
    _eq(n, sim.layernorm_modulate(h, mods[4], mods[3], EPS, norm_dtype=F32), "n")


def test_close_variant_is_close_and_not_exact():
    B, S, D = 2, 3, 136
    x = _x((B, S, D), torch.bfloat16, 71)
    sc, sh = _x((B, D), torch.bfloat16, 72, 0.5, 0.0), _x((B, D), torch.bfloat16, 73, 0.5, 0.0)
    exact = layernorm_modulate(x, sc, sh, EPS)
    close = layernorm_modulate_fp32(x, sc, sh, EPS)
    assert compare_outputs(close, exact) is not None  # fewer roundings change some bits
    torch.testing.assert_close(close.float(), exact.float(), rtol=2e-2, atol=2e-2)
    res, upd, g = x, _x((B, S, D), torch.bfloat16, 74, 1.0, 0.0), sc
    h, n = gate_residual_layernorm_modulate_fp32(res, g, upd, sc, sh, EPS)
    h_exact, n_exact = gate_residual_layernorm_modulate(res, g, upd, sc, sh, EPS)
    torch.testing.assert_close(h.float(), h_exact.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(n.float(), n_exact.float(), rtol=2e-2, atol=2e-2)


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
    _eq(got, exp)
    xt = x.transpose(0, 1).contiguous().transpose(0, 1)
    _eq(layernorm_modulate(xt, scale, shift, EPS), exp)


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
    _eq(got, sim.layernorm_modulate(x, scale, shift, EPS))
    assert torch.isnan(got[0, 0]).all() and torch.isnan(got[0, 2]).all()


def test_welford_tree_sim_is_not_a_plain_mean():
    """The simulation is sensitive to order: a different combine contraction changes bits for
    some rows (so the kernel == sim check above can fail)."""
    x = _x((64, 1040), torch.float32, 12, 3.0, 5.0)
    m0, r0 = sim.row_stats(x, EPS)
    m2, r2 = sim.row_stats(x, EPS, mean_mode=2, m2_fma=False)
    assert not (torch.equal(m0, m2) and torch.equal(r0, r2))
    xd = x.double()
    torch.testing.assert_close(m0[:, 0].double(), xd.mean(-1), rtol=1e-6, atol=1e-6)
    rd = torch.rsqrt(xd.var(-1, unbiased=False) + EPS)
    torch.testing.assert_close(r0[:, 0].double(), rd, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "case",
    ["odd_width", "width_6", "misaligned", "ndim2", "mod_shape", "fp64", "eps_str", "shift_only",
     "weight_dtype", "norm_dtype_fp16"],
)
def test_predicate_rejects_and_kernel_raises(case):
    D = 64
    x = _x((1, 2, D), torch.bfloat16, 13)
    sc = _x((1, D), torch.bfloat16, 14)
    sh = _x((1, D), torch.bfloat16, 15)
    kw = {}
    eps = EPS
    if case == "odd_width":
        x, sc, sh = _x((1, 2, 67), torch.bfloat16, 1), _x((1, 67), torch.bfloat16, 2), _x((1, 67), torch.bfloat16, 3)
    elif case == "width_6":
        x, sc, sh = _x((1, 2, 6), torch.bfloat16, 1), _x((1, 6), torch.bfloat16, 2), _x((1, 6), torch.bfloat16, 3)
    elif case == "misaligned":
        flat = _x((2 * D + 1,), torch.bfloat16, 16)
        x = flat[1:].view(1, 2, D)
        assert x.is_contiguous() and x.data_ptr() % 8 != 0
    elif case == "ndim2":
        x = x[0]
    elif case == "mod_shape":
        sc = _x((1, 3, D), torch.bfloat16, 17)
    elif case == "fp64":
        x, sc, sh = x.double(), sc.double(), sh.double()
    elif case == "eps_str":
        eps = "1e-6"
    elif case == "shift_only":  # a shift needs its scale (no eager chain adds a shift alone)
        sc = None
    elif case == "weight_dtype":  # F.layer_norm's mixed-dtype path
        kw = dict(weight=torch.ones(D))
    elif case == "norm_dtype_fp16":
        kw = dict(norm_dtype=torch.float16)
    assert can_use_layernorm_modulate(x, sc, sh, eps, **kw) is False
    with pytest.raises(UnsupportedInput):
        layernorm_modulate(x, sc, sh, eps, **kw)


def test_misaligned_input_is_fine_when_upcast_or_gated():
    D = 64
    flat = _x((2 * D + 1,), torch.bfloat16, 4)
    x_mis = flat[1:].view(1, 2, D)
    sc = _x((1, D), F32, 5, 0.5, 0.0)
    # x.float() is a fresh aligned copy in eager: torch's vectorized path, handled
    assert can_use_layernorm_modulate(x_mis, sc, sc, EPS, norm_dtype=F32)
    g = _x((1, D), torch.bfloat16, 2)
    sc16 = _x((1, D), torch.bfloat16, 3)
    r = _x((1, 2, D), torch.bfloat16, 1)
    # LayerNorm sees the fresh eager output h
    assert can_use_gate_residual_layernorm_modulate(x_mis, g, r, sc16, sc16, EPS)
    assert not can_use_gate_residual_layernorm_modulate(r, g, r[..., :32], sc16, sc16, EPS)
    with pytest.raises(UnsupportedInput):
        gate_residual_layernorm_modulate(r, g, r[:, :1], sc16, sc16, EPS)


def test_empty_tokens():
    x = torch.empty(2, 0, 64, dtype=torch.bfloat16)
    sc = torch.zeros(2, 64, dtype=torch.bfloat16)
    assert layernorm_modulate(x, sc, sc, EPS).shape == (2, 0, 64)


def test_fake_impls_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 64, dtype=torch.bfloat16)
        sc = torch.empty(2, 64, dtype=torch.bfloat16)
        sc32 = torch.empty(2, 1, 64, dtype=F32)
        out = torch.ops.ditfuse.layernorm_modulate(x, sc, sc, EPS, None, None, None, True)
        wan = torch.ops.ditfuse.layernorm_modulate(x, sc32, sc32, EPS, None, None, F32, True)
        h, n = torch.ops.ditfuse.gate_residual_layernorm_modulate(x, sc, x, sc, sc, EPS, None, None, None, True)
    assert out.shape == (2, 5, 64) and out.dtype == torch.bfloat16 and wan.dtype == torch.bfloat16
    assert h.shape == n.shape == (2, 5, 64)
    x = _x((1, 2, 64), torch.bfloat16, 3)
    sc = _x((1, 64), torch.bfloat16, 4)
    torch.library.opcheck(torch.ops.ditfuse.layernorm_modulate.default, (x, sc, sc, EPS, None, None, None, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_registry_points_here():
    from ditfuse.kernels import registry

    for op, fn in (
        ("norm.layernorm_modulate", layernorm_modulate),
        ("norm.gate_residual_layernorm_modulate", gate_residual_layernorm_modulate),
        ("norm.layernorm_modulate_fp32", layernorm_modulate_fp32),
        ("norm.gate_residual_layernorm_modulate_fp32", gate_residual_layernorm_modulate_fp32),
    ):
        assert registry.select(op, backend="triton", device="cpu").load() is fn


def test_prefetch_switch(monkeypatch):
    """DITFUSE_LN_PREFETCH: auto (default) prefetches the runtime loop with a residual only; 1 / 0
    force it; the held and warp kernels never take it (their rows are loaded at once)."""
    x = _x((1, 3, 1024), torch.bfloat16, 90)
    sc = _x((1, 1024), torch.bfloat16, 91, 0.5, 0.0)
    g, u = _x((1, 1024), torch.bfloat16, 92, 0.5, 0.0), _x((1, 3, 1024), torch.bfloat16, 93)

    def pf(gated, **kw):
        r = lnm._recipe(x, g if gated else None, u if gated else None, sc, sc, EPS, None, None, None, True, **kw)
        return r.block[2]["PREFETCH"]
    monkeypatch.delenv("DITFUSE_LN_PREFETCH", raising=False)
    assert pf(True, unroll=False) and not pf(False, unroll=False)
    assert not pf(True) and not pf(True, unroll=True, warp=False)  # held rows: nothing to prefetch
    monkeypatch.setenv("DITFUSE_LN_PREFETCH", "1")
    assert pf(False, unroll=False)
    monkeypatch.setenv("DITFUSE_LN_PREFETCH", "0")
    assert not pf(True, unroll=False)
    assert pf(True, unroll=False, prefetch=True)
