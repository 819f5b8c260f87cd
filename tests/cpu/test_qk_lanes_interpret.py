"""The QK ops' vector-per-lane kernel under TRITON_INTERPRET=1: it takes the launches it claims,
and gives the tile kernel's bits and the simulation's (torch's order) on each.

Every QK op (FLUX's ``qk_rmsnorm_rope`` and its close variant, Qwen-Image's / Z-Image's
``qk_rmsnorm_diffusers_rope_complex``, SD3.5's ``qk_rmsnorm_diffusers_cat``) launches either
kernel; ``DITFUSE_QK_KERNEL=lanes|tile`` picks one. The launches are counted by standing a
counting wrapper in for each kernel object, so a test cannot pass by running the other kernel.
The GPU side (layout guard, bits against eager) is tests/cpu/test_qk_lanes_codegen.py and
tests/gpu/test_qk_rmsnorm_rope.py.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as mod
from tests.support.launch_count import count_launches
from tests.support import diffusers_rms_sim as dsim
from tests.support import rms_sim


@pytest.fixture
def launches(monkeypatch):
    return count_launches(monkeypatch, mod, _qk_lanes_kernel="lanes", _qk_rmsnorm_rope_kernel="tile")


def _both(monkeypatch, launches, fn, expect_lanes: bool):
    """fn() under each kernel setting: the outputs, checked equal bit for bit, and which kernel ran."""
    outs = {}
    for mode in ("lanes", "tile"):
        launches.clear()
        monkeypatch.setenv("DITFUSE_QK_KERNEL", mode)
        outs[mode] = fn()
        ran = dict(launches)
        if mode == "lanes" and expect_lanes:
            assert ran == {"lanes": 1}, ran
        else:
            assert ran == {"tile": 1}, (mode, ran)
    assert_bitwise_equal(outs["lanes"], outs["tile"], "lane kernel vs tile kernel")
    return outs["lanes"]


def _flux_args(B, S_img, S_txt, H, D, dtype, seed=0, weights=True, rope=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        s = torch.exp(torch.randn(*shape[:-1], 1, generator=g))  # rows over several binades
        return (torch.randn(*shape, generator=g) * s * scale).to(dtype)

    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(4)]
    cos = sin = None
    if rope:
        ang = torch.rand(S_img + S_txt, D // 2, generator=g) * 6.28
        cos, sin = (t.repeat_interleave(2, dim=1).contiguous() for t in (ang.cos(), ang.sin()))
    return dict(q=rnd(B, S_img, H, D), k=rnd(B, S_img, H, D), q_weight=ws[0], k_weight=ws[1], cos=cos, sin=sin,
                eps=1e-6, q_txt=rnd(B, S_txt, H, D) if S_txt else None, k_txt=rnd(B, S_txt, H, D) if S_txt else None,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("B,S_img,S_txt,H", [(1, 5, 3, 3), (2, 7, 0, 1), (1, 1, 1, 5)])
def test_flux_lanes_equal_tile_and_simulation(monkeypatch, launches, dtype, D, B, S_img, S_txt, H):
    """Row counts that are not a multiple of the 8-row program (masked tail rows), one-token
    sequences, odd head counts, text and image-only."""
    args = _flux_args(B, S_img, S_txt, H, D, dtype, seed=D + S_img)
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=True)
    assert_bitwise_equal(out, rms_sim.qk_rmsnorm_rope(**args, rsqrt=rms_sim.interp_rsqrt), "lanes vs simulation")


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False), (False, False)])
def test_flux_without_weights_or_rope(monkeypatch, launches, weights, rope):
    args = _flux_args(1, 6, 2, 2, 128, torch.bfloat16, seed=3, weights=weights, rope=rope)
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=True)


def test_flux_close_variant(monkeypatch, launches):
    args = _flux_args(2, 4, 3, 3, 128, torch.bfloat16, seed=9)
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope_fp32(**args), expect_lanes=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_flux_nan_inf_zero_rows(monkeypatch, launches, dtype):
    args = _flux_args(1, 6, 2, 2, 128, dtype, seed=5)
    args["q"][0, 0, 0, 3] = float("nan")
    args["q"][0, 1, 1, 0] = float("inf")
    args["k"][0, 2, 0] = 0.0
    args["k"][0, 3, 1, 7] = -0.0
    args["q_txt"][0, 1, 1, 5] = float("-inf")
    args["k_txt"][0, 0, 0] = torch.finfo(dtype).max  # the sum of squares overflows
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=True)


def test_flux_strided_views(monkeypatch, launches):
    """Chunks of a fused qkv projection; text given head-major and transposed; strided tables."""
    B, S, St, H, D = 2, 5, 3, 2, 128
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(B, S, 3 * H * D, generator=g).bfloat16()
    q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1))
    qt = torch.randn(B, H, St, D, generator=g).bfloat16().transpose(1, 2)
    kt = torch.randn(B, H, St, D, generator=g).bfloat16().transpose(1, 2)
    tab = torch.randn(S + St, 2 * D, generator=g)
    args = dict(q=q, k=k, q_weight=None, k_weight=None, cos=tab[:, :D], sin=tab[:, D:], eps=1e-6,
                q_txt=qt, k_txt=kt, q_txt_weight=None, k_txt_weight=None)
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=True)
    assert_bitwise_equal(out, rms_sim.qk_rmsnorm_rope(**args, rsqrt=rms_sim.interp_rsqrt), "lanes vs simulation")


@pytest.mark.parametrize("D", [4, 16, 96, 136, 256, 512])
def test_flux_other_widths_stay_on_the_tile_kernel(monkeypatch, launches, D):
    """Lanes per row other than 8, 16 or 32 (or rows wider than one warp's vectors): tile kernel."""
    args = _flux_args(1, 3, 2, 2, D, torch.bfloat16, seed=D)
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=False)


def _qwen_args(B, S_img, S_txt, H, D=128, dtype=torch.bfloat16, seed=0, per_sample=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        s = torch.exp(torch.randn(*shape[:-1], 1, generator=g))
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    def table(S):
        ang = torch.rand((B if per_sample else 1), S, D // 2, generator=g) * 6.28
        f = torch.polar(torch.ones_like(ang), ang)
        return f if per_sample else f[0]

    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) for _ in range(4)]
    return dict(q=rnd(B, S_img, H, D), k=rnd(B, S_img, H, D), q_weight=ws[0], k_weight=ws[1], freqs=table(S_img),
                eps=1e-6, q_txt=rnd(B, S_txt, H, D) if S_txt else None, k_txt=rnd(B, S_txt, H, D) if S_txt else None,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None,
                txt_freqs=table(S_txt) if S_txt else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,S_img,S_txt,H", [(1, 8, 8, 2), (2, 9, 5, 3), (1, 17, 0, 1), (1, 2, 1, 1)])
def test_diffusers_complex_lanes(monkeypatch, launches, dtype, B, S_img, S_txt, H):
    """Qwen-Image's chain at head_dim 128 (torch's reduction runs 32 vectorized lanes per row:
    the lane kernel's order), few and many rows per stream."""
    args = _qwen_args(B, S_img, S_txt, H, dtype=dtype, seed=S_img)
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**args), expect_lanes=True)
    exp = dsim.qk_chain_cuda(**args, cmul=mod.CMUL_MODE, rsqrt=rms_sim.interp_rsqrt)
    assert_bitwise_equal(out, exp, "lanes vs simulation")


def test_diffusers_complex_per_sample_tables(monkeypatch, launches):
    """Z-Image: per-sample [B, S, D/2] freqs (a batch stride in the table)."""
    args = _qwen_args(2, 9, 0, 2, seed=4, per_sample=True)
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**args), expect_lanes=True)
    exp = dsim.qk_chain_cuda(**args, cmul=mod.CMUL_MODE, rsqrt=rms_sim.interp_rsqrt)
    assert_bitwise_equal(out, exp, "lanes vs simulation")


@pytest.mark.parametrize("D", [64, 256])
def test_diffusers_other_widths_stay_on_the_tile_kernel(monkeypatch, launches, D):
    """diffusers' RMSNorm below 128 (lane-strided elements, not vectors) or above (several vectors
    per lane): not the lane order. At 128 torch runs 32 vectorized lanes for any row count."""
    args = _qwen_args(1, 8, 3, 2, D=D, seed=2)
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**args), expect_lanes=False)


def test_diffusers_cat_heads_first(monkeypatch, launches):
    """SD3.5's op at head_dim 128 (the heads-first, image-first output layout)."""
    g = torch.Generator().manual_seed(6)
    B, H, S, St, D = 2, 2, 9, 8, 128

    def rnd(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).bfloat16() for _ in range(4)]
    args = dict(q=rnd(B, H, S, D), k=rnd(B, H, S, D), q_weight=ws[0], k_weight=ws[1], eps=1e-6,
                q_txt=rnd(B, H, St, D), k_txt=rnd(B, H, St, D), q_txt_weight=ws[2], k_txt_weight=ws[3])
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_cat(**args), expect_lanes=True)
    exp = dsim.qk_cat_heads_first_cuda(**args, rsqrt=rms_sim.interp_rsqrt)
    assert_bitwise_equal(out, exp, "lanes vs simulation")


def test_auto_takes_the_lane_kernel_and_bad_values_fail(monkeypatch, launches):
    args = _flux_args(1, 3, 2, 2, 128, torch.bfloat16)
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "auto")
    mod.qk_rmsnorm_rope(**args)
    assert dict(launches) == {"lanes": 1}
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "warp")
    with pytest.raises(ValueError, match="DITFUSE_QK_KERNEL"):
        mod.qk_rmsnorm_rope(**args)


@pytest.mark.parametrize("H", [1, 3, 24, 30, 40])
@pytest.mark.parametrize("T", [8, 16, 32])
def test_default_tiling_fills_every_warp(T, H):
    """The launcher's tiling gives each warp at least the 32 / T rows one warp spans (what the
    codegen test shows the guard needs); never one row per program; at most 8 heads a program."""
    R, nw, V = mod._lane_tiling(T, H)
    assert 2 <= R <= max(8, 2 * 32 // T) and R & (R - 1) == 0 and V in (1, 2, 4) and T % V == 0
    if not mod.interpreter_on():
        assert R // nw >= 32 // (T // V)


@pytest.mark.parametrize("H", [3, 5, 12, 30])
def test_heads_not_a_multiple_of_the_program(monkeypatch, launches, H):
    """Programs whose last heads do not exist (H % R != 0: masked rows), image-first and
    text-first layouts alike."""
    args = _flux_args(2, 3, 2, H, 128, torch.bfloat16, seed=H)
    out = _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), expect_lanes=True)
    assert_bitwise_equal(out, rms_sim.qk_rmsnorm_rope(**args, rsqrt=rms_sim.interp_rsqrt), "lanes vs simulation")
    qargs = _qwen_args(1, 3, 2, H, seed=H)
    _both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**qargs), expect_lanes=True)


@pytest.mark.parametrize("V", [1, 2, 4])
@pytest.mark.parametrize("norm", ["torch", "diffusers"])
def test_virtual_lanes_per_thread(monkeypatch, launches, V, norm):
    """Each thread holding 1, 2 or 4 of torch's lanes (the tree's top levels in registers):
    the same bits as the tile kernel and the simulation, for both norms."""
    if norm == "torch":
        args = _flux_args(2, 5, 3, 3, 128, torch.float32, seed=V)  # fp32: the order of every add shows
        fn = lambda: mod._launch(**args, lanes_tiling=(4, 1, V))  # noqa: E731
        exp = rms_sim.qk_rmsnorm_rope(**args, rsqrt=rms_sim.interp_rsqrt)
    else:
        args = _qwen_args(2, 5, 3, 3, dtype=torch.float32, seed=V)
        fn = lambda: mod._launch_diffusers(**args, cmul=mod.CMUL_MODE, lanes_tiling=(4, 1, V))  # noqa: E731
        exp = dsim.qk_chain_cuda(**args, cmul=mod.CMUL_MODE, rsqrt=rms_sim.interp_rsqrt)
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "lanes")
    out = fn()
    assert dict(launches) == {"lanes": 1}
    assert_bitwise_equal(out, exp, f"lanes V={V} vs simulation")
