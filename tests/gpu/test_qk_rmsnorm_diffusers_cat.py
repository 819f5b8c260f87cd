"""rope.qk_rmsnorm_diffusers_cat on CUDA: bitwise equal to the eager chain
(``reference.qk_rmsnorm_diffusers_cat_heads_first``: diffusers' RMSNorm on SD3's [B, H, S, D]
transposed views + image-first cat on dim 2) at SD3.5-large shapes (H 38, D 64, S_img 4096,
S_txt 333), few-row streams (other lane counts), contiguous inputs, NaN/Inf, attn2 (no text),
torch.compile(fullgraph) and opcheck."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import (
    can_use_qk_rmsnorm_diffusers_cat as can_use,
    qk_rmsnorm_diffusers_cat as op,
)

DEV = "cuda"
H, D = 38, 64
NAMES = ("q", "k", "q_weight", "k_weight", "eps", "q_txt", "k_txt", "q_txt_weight", "k_txt_weight")


def _make(B, S_img, S_txt, H=H, D=D, dtype=torch.bfloat16, seed=0, weights=True, transposed=True):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(S):
        s = torch.exp(torch.randn(B, S, H, 1, device=DEV, generator=g))
        x = (torch.randn(B, S, H, D, device=DEV, generator=g) * s).to(dtype)
        if transposed:  # SD3: proj.view(B, -1, H, D).transpose(1, 2)
            return x.reshape(B, S, H * D).view(B, -1, H, D).transpose(1, 2)
        return x.transpose(1, 2).contiguous()

    q, k = rnd(S_img), rnd(S_img)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(S_txt), rnd(S_txt)
    ws = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype) if weights else None for _ in range(4)]
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], eps=1e-6, q_txt=q_txt, k_txt=k_txt,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None)


def _check(args, name="qk_rmsnorm_diffusers_cat"):
    assert can_use(**args)
    out = op(**args)
    assert_bitwise_equal(out, rf.qk_rmsnorm_diffusers_cat_heads_first(**args), name)
    return out


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("S_img,S_txt", [(4096, 333), (4096, 0), (273, 77)])
def test_sd35_large_shapes(B, S_img, S_txt):
    _check(_make(B, S_img, S_txt, seed=B + S_txt))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("weights", [True, False])
def test_dtypes_weights(dtype, weights):
    _check(_make(2, 1024, 333, dtype=dtype, weights=weights, seed=3))


@pytest.mark.parametrize("S_img,S_txt,H_", [(1, 1, 1), (3, 2, 1), (7, 5, 1), (15, 1, 1), (1, 13, 3), (5, 0, 2)])
def test_few_rows(S_img, S_txt, H_):
    """Streams of 1..39 rows: torch's lane count W differs (64 below 16 rows at D = 64)."""
    _check(_make(1, S_img, S_txt, H=H_, seed=S_img * 7 + S_txt))


@pytest.mark.parametrize("D_", [64, 96, 128])
def test_contiguous_and_other_head_dims(D_):
    _check(_make(2, 37, 13, H=3, D=D_, transposed=False, seed=D_))
    _check(_make(2, 37, 13, H=3, D=D_, transposed=True, seed=D_ + 1))


def test_nan_inf():
    args = _make(1, 64, 16, H=4, seed=9)
    for n in ("q", "k", "q_txt", "k_txt"):
        args[n] = args[n].clone()
    args["q"][0, 1, 0, 5] = float("nan")
    args["q"][0, 0, 2, 7] = float("inf")
    args["k_txt"][0, 1, 0, 0] = float("-inf")
    args["k"][0, 1, 3, :] = -0.0
    _check(args)


def test_compile_fullgraph():
    args = _make(2, 256, 77, seed=11)
    f = torch.compile(lambda *a: op(*a), fullgraph=True)
    out = f(*[args[n] for n in NAMES])
    assert_bitwise_equal(out, rf.qk_rmsnorm_diffusers_cat_heads_first(**args), "compiled")


def test_opcheck():
    args = _make(1, 16, 5, H=2, seed=12)
    torch.library.opcheck(torch.ops.ditfuse.qk_rmsnorm_diffusers_cat.default, [args[n] for n in NAMES])
