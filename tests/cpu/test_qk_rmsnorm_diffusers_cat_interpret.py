"""rope.qk_rmsnorm_diffusers_cat (SD3.5's QK chain) under TRITON_INTERPRET=1 (tiny shapes).

Kernel == tests/support/diffusers_rms_sim.py (torch's CUDA reduce order, MeanOps' factor per
stream, the interpreter's rsqrt) bitwise, on [B, H, S, D] transposed views of [B, S, H*D]
projections and contiguous inputs; heads-first, image-first output.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal, effective_strides
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import (
    can_use_qk_rmsnorm_diffusers_cat as can_use,
    qk_rmsnorm_diffusers_cat as op,
)
from tests.support import diffusers_rms_sim as sim
from tests.support import rms_sim

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = ("q", "k", "q_weight", "k_weight", "eps", "q_txt", "k_txt", "q_txt_weight", "k_txt_weight")


def _make(B, S_img, S_txt, H, D, dtype=torch.bfloat16, seed=0, weights=True, transposed=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(S):
        s = torch.exp(torch.randn(B, S, H, 1, generator=g))
        x = (torch.randn(B, S, H, D, generator=g) * s * scale).to(dtype)
        if transposed:  # SD3: proj.view(B, -1, H, D).transpose(1, 2)
            return x.reshape(B, S, H * D).view(B, -1, H, D).transpose(1, 2)
        return x.transpose(1, 2).contiguous()

    q, k = rnd(S_img), rnd(S_img)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(S_txt), rnd(S_txt)
    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(4)]
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], eps=1e-6, q_txt=q_txt, k_txt=k_txt,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None)


def _check(args):
    assert can_use(**args)
    out = op(**args)
    exp = sim.qk_cat_heads_first_cuda(**args, rsqrt=rms_sim.interp_rsqrt)
    assert_bitwise_equal(out, exp, "qk_rmsnorm_diffusers_cat vs simulation")
    B, H, S_img, D = args["q"].shape
    S_txt = args["q_txt"].shape[2] if args["q_txt"] is not None else 0
    for t, src in zip(out, (args["q"], args["k"])):
        assert t.shape == (B, H, S_img + S_txt, D) and t.dtype == args["q"].dtype
        # eager's layout: its cat writes a contiguous result; without text its RMSNorm is
        # elementwise on q / k and keeps theirs (what reads it next, SDPA, sees eager's strides)
        if S_txt:
            assert t.is_contiguous()
        else:
            assert effective_strides(t) == effective_strides(torch.empty_like(src)), (t.stride(), src.stride())
    return out


SHAPES = list(itertools.product([64, 128, 96], [1, 7, 37], [0, 5, 13]))


@pytest.mark.parametrize("D,S_img,S_txt", SHAPES, ids=[f"D{d}-S{s}-T{t}" for d, s, t in SHAPES])
def test_shapes(D, S_img, S_txt):
    B = 1 + (S_img + S_txt) % 2
    H = 3 if (S_img + D) % 3 else 1
    _check(_make(B, S_img, S_txt, H, D, seed=D + S_img * 7 + S_txt, transposed=(S_img + S_txt) % 3 != 1))


@pytest.mark.parametrize("B,H", [(1, 1), (2, 1), (1, 3), (2, 3)])
@pytest.mark.parametrize("transposed", [True, False])
def test_batch_heads(B, H, transposed):
    _check(_make(B, 7, 5, H, 64, seed=B * 10 + H, transposed=transposed))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S_txt", [0, 13])
@pytest.mark.parametrize("weights", [True, False])
def test_dtypes_weights(dtype, S_txt, weights):
    _check(_make(2, 7, S_txt, 3, 64, dtype, seed=S_txt + 1, weights=weights))


def test_mixed_weights():
    args = _make(1, 5, 3, 2, 64, seed=4)
    args["k_txt_weight"] = None
    args["q_weight"] = None
    _check(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_signed_zero(dtype):
    args = _make(1, 4, 3, 2, 64, dtype, seed=9)
    for n in ("q", "k", "q_txt", "k_txt"):
        args[n] = args[n].clone()
    args["q"][0, 1, 0, 5] = float("nan")
    args["q"][0, 0, 2, 7] = float("inf")
    args["k_txt"][0, 1, 0, 0] = float("-inf")
    args["k"][0, 1, 3, :] = -0.0
    args["q_txt"][0, 0, 1, ::3] = -0.0
    out = _check(args)
    assert torch.isnan(out[0][0, 1, 0]).all()  # image rows first: row 0 of head 1


def test_image_first_and_matches_cpu_reference_with_cpu_mean():
    """The simulation's chain with the CPU's mean and torch.rsqrt equals the CPU reference (the
    layout and order of the concat are the reference's)."""
    for dtype in (torch.bfloat16, torch.float32):
        args = _make(2, 7, 5, 3, 64, dtype, seed=21)
        exp = rf.qk_rmsnorm_diffusers_cat(**args)
        got = sim.qk_cat_heads_first_cuda(**args, mean=sim.cpu_mean)
        assert_bitwise_equal(got, exp, f"simulation (cpu mean) vs reference {dtype}")


def test_exact_fp64():
    from ditfuse.kernels import exact

    args = _make(1, 4, 3, 2, 64, seed=30)
    e = exact.qk_rmsnorm_diffusers_cat_fp64(**args)
    for o, x in zip(op(**args), e):
        torch.testing.assert_close(o.double(), x, rtol=2**-6, atol=3 * 2**-7)


def _base():
    return _make(1, 2, 1, 2, 64, seed=1)


REJECTIONS = {
    "dtype_mix": lambda a: a.update(k=a["k"].float()),
    "fp64": lambda a: a.update(q=a["q"].double(), k=a["k"].double(), q_txt=a["q_txt"].double(),
                               k_txt=a["k_txt"].double(), q_weight=None, k_weight=None,
                               q_txt_weight=None, k_txt_weight=None),
    "fp32_weight_bf16_input": lambda a: a.update(q_weight=a["q_weight"].float()),
    "fp16_weight_bf16_input": lambda a: a.update(k_txt_weight=a["k_txt_weight"].half()),
    "weight_shape": lambda a: a.update(k_weight=a["k_weight"][:32]),
    "shape_mismatch": lambda a: a.update(k=a["k"][:, :1]),
    "not_4d": lambda a: a.update(q=a["q"].flatten(2), k=a["k"].flatten(2)),
    "text_half": lambda a: a.update(k_txt=None),
    "text_weight_no_text": lambda a: a.update(q_txt=None, k_txt=None),
    "text_heads_differ": lambda a: a.update(q_txt=a["q_txt"][:, :1], k_txt=a["k_txt"][:, :1]),
    "head_dim_not_innermost": lambda a: a.update(q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)),
    "rows_overlap": lambda a: a.update(q=a["q"][:, :, :1].expand(-1, -1, 2, -1)),
    "grad": lambda a: a.update(q=a["q"].clone().requires_grad_(True)),
    "eps_tensor": lambda a: a.update(eps=torch.tensor(1e-6)),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS) + ["head_dim_unvectorizable", "warp_split"])
def test_predicate_rejects_and_kernel_raises(case):
    if case == "head_dim_unvectorizable":
        args = _make(1, 2, 1, 1, 130, seed=2)
    elif case == "warp_split":
        args = _make(1, 20, 0, 1, 8192, seed=2, weights=False)
    else:
        args = _base()
        REJECTIONS[case](args)
    assert not can_use(**args)
    with pytest.raises(UnsupportedInput):
        op(**args)


def test_custom_op_and_fake():
    args = _base()
    ordered = [args[n] for n in NAMES]
    torch.library.opcheck(torch.ops.ditfuse.qk_rmsnorm_diffusers_cat.default, ordered,
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in ordered]
        q, k = torch.ops.ditfuse.qk_rmsnorm_diffusers_cat(*fake)
    assert q.shape == (1, 2, 3, 64) and k.dtype == torch.bfloat16


def test_registry_descriptor():
    from ditfuse.kernels import descriptor

    d = descriptor("rope.qk_rmsnorm_diffusers_cat")
    assert d.load_reference() is rf.qk_rmsnorm_diffusers_cat
    assert d.specs()[0].load() is op and d.specs()[0].load_predicate() is can_use
