"""The QK ops' vector-per-lane kernel on CUDA: at every family's real shape it runs (the layout
guard accepted its binary, counted launches), and its outputs equal the eager chain and the tile
kernel's bit for bit. The other GPU QK tests run the default (``auto``: the lane kernel wherever
it applies) over their sweeps; this file pins down that the lane kernel is what ran."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.common import warp
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as mod
from tests.support.launch_count import count_launches

DEV = "cuda"


@pytest.fixture
def launches(monkeypatch):
    return count_launches(monkeypatch, mod, _qk_lanes_kernel="lanes", _qk_rmsnorm_rope_kernel="tile")


def _rnd(g, *shape, dtype=torch.bfloat16):
    scale = torch.exp(torch.randn(*shape[:-1], 1, device=DEV, generator=g))
    return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)


def _flux(B, S_img, S_txt, H, D=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ang = torch.rand(S_img + S_txt, D // 2, device=DEV, generator=g) * 6.28
    cos, sin = (t.repeat_interleave(2, dim=1).contiguous() for t in (ang.cos(), ang.sin()))
    w = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype) for _ in range(4)]
    txt = S_txt > 0
    return dict(q=_rnd(g, B, S_img, H, D, dtype=dtype), k=_rnd(g, B, S_img, H, D, dtype=dtype), q_weight=w[0],
                k_weight=w[1], cos=cos, sin=sin, eps=1e-6,
                q_txt=_rnd(g, B, S_txt, H, D, dtype=dtype) if txt else None,
                k_txt=_rnd(g, B, S_txt, H, D, dtype=dtype) if txt else None,
                q_txt_weight=w[2] if txt else None, k_txt_weight=w[3] if txt else None)


def _complex(B, S_img, S_txt, H, D=128, dtype=torch.bfloat16, seed=0, per_sample=False):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def table(S):
        ang = torch.rand(B if per_sample else 1, S, D // 2, device=DEV, generator=g) * 6.28
        f = torch.polar(torch.ones_like(ang), ang)
        return f if per_sample else f[0]

    w = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype) for _ in range(4)]
    txt = S_txt > 0
    return dict(q=_rnd(g, B, S_img, H, D, dtype=dtype), k=_rnd(g, B, S_img, H, D, dtype=dtype), q_weight=w[0],
                k_weight=w[1], freqs=table(S_img), eps=1e-6,
                q_txt=_rnd(g, B, S_txt, H, D, dtype=dtype) if txt else None,
                k_txt=_rnd(g, B, S_txt, H, D, dtype=dtype) if txt else None,
                q_txt_weight=w[2] if txt else None, k_txt_weight=w[3] if txt else None,
                txt_freqs=table(S_txt) if txt else None)


def _run_both(monkeypatch, launches, fn, expected):
    warp._LANE_VERDICTS.clear()
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "lanes")
    launches.clear()
    lanes = fn()
    assert dict(launches) == {"lanes": 1}, f"the lane kernel was refused or not launched: {dict(launches)}"
    assert warp._LANE_VERDICTS and all(v is None for v in warp._LANE_VERDICTS.values()), warp._LANE_VERDICTS
    assert_bitwise_equal(lanes, expected, "lane kernel vs eager")
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "tile")
    launches.clear()
    tile = fn()
    assert dict(launches) == {"tile": 1}
    assert_bitwise_equal(lanes, tile, "lane kernel vs tile kernel")


# FLUX.1 / FLUX.2 dual (text + image) and single blocks, prime and tiny token counts, B=2 (CFG).
FLUX = [(1, 4096, 512, 24), (2, 4096, 512, 24), (1, 4608, 0, 24), (1, 1021, 77, 24), (2, 1, 1, 48),
        (1, 4096, 512, 48)]


@pytest.mark.parametrize("B,S_img,S_txt,H", FLUX, ids=[f"B{b}-S{s}-T{t}-H{h}" for b, s, t, h in FLUX])
def test_flux(monkeypatch, launches, B, S_img, S_txt, H):
    args = _flux(B, S_img, S_txt, H, seed=S_img + H)
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), rf.qk_rmsnorm_rope(**args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_flux_dtypes_widths(monkeypatch, launches, dtype, D):
    args = _flux(1, 333, 29, 7, D=D, dtype=dtype, seed=D)
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), rf.qk_rmsnorm_rope(**args))


def test_flux_nan_inf(monkeypatch, launches):
    args = _flux(1, 64, 16, 4, seed=3)
    args["q"][0, 0, 0, 5] = float("nan")
    args["k"][0, 1, 2, 0] = float("inf")
    args["q_txt"][0, 2, 1] = 0.0
    args["k_txt"][0, 3, 3, 9] = torch.finfo(torch.bfloat16).max
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_rope(**args), rf.qk_rmsnorm_rope(**args))


# Qwen-Image (24 heads, text + image) and Z-Image (30 heads, one stream, per-sample tables).
QWEN = [(1, 4096, 512), (2, 4096, 77), (1, 37, 13)]


@pytest.mark.parametrize("B,S_img,S_txt", QWEN, ids=[f"B{b}-S{s}-T{t}" for b, s, t in QWEN])
def test_qwen(monkeypatch, launches, B, S_img, S_txt):
    args = _complex(B, S_img, S_txt, 24, seed=S_img)
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**args),
              rf.qk_rmsnorm_diffusers_rope_complex_cat(**args))


@pytest.mark.parametrize("B", [1, 2])
def test_zimage(monkeypatch, launches, B):
    args = _complex(B, 4128, 0, 30, seed=B, per_sample=True)
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_rope_complex(**args),
              rf.qk_rmsnorm_diffusers_rope_complex_cat(**args))


def test_sd3_heads_first_d128(monkeypatch, launches):
    g = torch.Generator(device=DEV).manual_seed(5)
    B, H, S, St, D = 2, 6, 1024, 333, 128

    def heads_first(S_):
        return _rnd(g, B, S_, H * D).unflatten(-1, (H, D)).transpose(1, 2)

    w = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).bfloat16() for _ in range(4)]
    args = dict(q=heads_first(S), k=heads_first(S), q_weight=w[0], k_weight=w[1], eps=1e-6,
                q_txt=heads_first(St), k_txt=heads_first(St), q_txt_weight=w[2], k_txt_weight=w[3])
    _run_both(monkeypatch, launches, lambda: mod.qk_rmsnorm_diffusers_cat(**args),
              rf.qk_rmsnorm_diffusers_cat_heads_first(**args))
