"""rope.qk_rmsnorm_diffusers_rope_img_first (HunyuanVideo 1.5's QK chain) under TRITON_INTERPRET=1.

Kernel == tests/support/diffusers_rms_sim.py ``qk_img_first_cuda`` (torch's CUDA reduce order and
MeanOps' factor per stream, the interpreter's rsqrt; the RoPE as the reference computes it)
bitwise, on both kernels (tile and vector-per-lane at D = 128), text and image streams of
awkward lengths, batch 1 and 2, every dtype, with and without weights / text / RoPE, strided
(unflattened-projection) inputs, signed zeros in the text rows (which must not be rotated: an
identity rotation would turn -0 into +0), and the predicate's rejections.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk
from tests.support import diffusers_rms_sim as sim
from tests.support import rms_sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _make(B, S_img, S_txt, H, D, dtype=torch.bfloat16, seed=0, weights=True, rope=True, strided=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(S):
        s = torch.exp(torch.randn(B, S, H, 1, generator=g))
        x = (torch.randn(B, S, H, D, generator=g) * s).to(dtype)
        if strided:  # proj(x).unflatten(2, (H, -1)) of a fused [B, S, 3 * H * D] projection
            big = torch.zeros(B, S, 3 * H * D, dtype=dtype)
            big[..., H * D:2 * H * D] = x.reshape(B, S, H * D)
            return big[..., H * D:2 * H * D].unflatten(2, (H, D))
        return x

    q, k = rnd(S_img), rnd(S_img)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(S_txt), rnd(S_txt)
    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(4)]
    cos = sin = None
    if rope:
        ang = torch.randn(S_img, D // 2, generator=g) * 3
        cos = torch.cos(ang).repeat_interleave(2, dim=1)
        sin = torch.sin(ang).repeat_interleave(2, dim=1)
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], cos=cos, sin=sin, eps=1e-6, q_txt=q_txt, k_txt=k_txt,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None)


def _check(args, kernel=None):
    assert qk.can_use_qk_rmsnorm_diffusers_rope_img_first(**args)
    if kernel is None:
        out = qk.qk_rmsnorm_diffusers_rope_img_first(**args)
    else:
        a = dict(args)
        out = qk._launch_img_first(*(a.pop(n) for n in ("q", "k", "q_weight", "k_weight", "cos", "sin", "eps",
                                                        "q_txt", "k_txt", "q_txt_weight", "k_txt_weight")),
                                   kernel=kernel)
    exp = sim.qk_img_first_cuda(**args, rsqrt=rms_sim.interp_rsqrt)
    assert_bitwise_equal(out, exp, f"qk_rmsnorm_diffusers_rope_img_first ({kernel or 'auto'}) vs simulation")
    B, S_img, H, D = args["q"].shape
    S_txt = args["q_txt"].shape[1] if args["q_txt"] is not None else 0
    for t in out:
        assert t.shape == (B, S_img + S_txt, H, D) and t.dtype == args["q"].dtype
    return out


SHAPES = list(itertools.product([64, 128, 96], [1, 7, 37], [0, 5, 13]))


@pytest.mark.parametrize("D,S_img,S_txt", SHAPES, ids=[f"D{d}-S{s}-T{t}" for d, s, t in SHAPES])
def test_shapes(D, S_img, S_txt):
    B = 1 + (S_img + S_txt) % 2
    H = 3 if (S_img + D) % 3 else 1
    _check(_make(B, S_img, S_txt, H, D, seed=D + S_img * 7 + S_txt, strided=(S_img + S_txt) % 3 != 1))


@pytest.mark.parametrize("kernel", ["tile", "lanes"])
@pytest.mark.parametrize("B,H,S_txt", [(1, 1, 0), (2, 3, 5), (1, 16, 11), (2, 2, 1)])
def test_both_kernels_at_head_dim_128(kernel, B, H, S_txt):
    """D = 128 (HunyuanVideo's head dim): the lane kernel's mode, and the tile kernel forced."""
    _check(_make(B, 9, S_txt, H, 128, seed=B * 10 + H + S_txt), kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S_txt", [0, 13])
@pytest.mark.parametrize("weights", [True, False])
@pytest.mark.parametrize("rope", [True, False])
def test_dtypes_weights_rope(dtype, S_txt, weights, rope):
    _check(_make(2, 7, S_txt, 3, 64, dtype, seed=S_txt + 1, weights=weights, rope=rope))


@pytest.mark.parametrize("kernel", ["tile", "lanes"])
def test_text_rows_keep_signed_zeros(kernel):
    """Zero text rows normalise to signed zeros; not rotated, they keep their sign (the reference's
    text stream has no rotation: cos = 1, sin = 0 would give -0 * 1 - (+0) * 0 = -0 + -0 ... and
    +0 where a +0 product meets a -0 one)."""
    args = _make(1, 4, 6, 2, 128, seed=3)
    args["q_txt"][:, 2] = -0.0
    args["k_txt"][:, 3] = 0.0
    args["k_txt"][:, 3, :, ::2] = -0.0
    out = _check(args, kernel=kernel)
    assert torch.signbit(out[0][:, 4 + 2]).any()


def test_matches_the_eager_reference_closely():
    """The CPU reference (torch's CPU mean order) agrees to rounding: the simulation models CUDA's."""
    args = _make(2, 7, 5, 3, 64, torch.float32, seed=9)
    out = qk.qk_rmsnorm_diffusers_rope_img_first(**args)
    exp = rf.qk_rmsnorm_diffusers_rope_img_first(**args)
    for a, b in zip(out, exp):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("case", ["cos_only", "cos_shape", "cos_dtype", "weight_dtype", "mixed_dtype", "odd_d",
                                  "no_image"])
def test_rejections(case):
    args = _make(1, 5, 3, 2, 64, seed=4)
    if case == "cos_only":
        args["sin"] = None
    elif case == "cos_shape":
        args["cos"] = args["cos"][:-1]
    elif case == "cos_dtype":
        args["cos"] = args["cos"].double()
    elif case == "weight_dtype":
        args["q_weight"] = args["q_weight"].float()
    elif case == "mixed_dtype":
        args["k_txt"] = args["k_txt"].half()
    elif case == "odd_d":
        args = _make(1, 5, 3, 2, 63, seed=4, rope=False)
        args["cos"] = torch.ones(5, 63)
        args["sin"] = torch.zeros(5, 63)
    elif case == "no_image":
        args = _make(1, 0, 3, 2, 64, seed=4, rope=False)
        args["cos"] = torch.ones(0, 64)
        args["sin"] = torch.zeros(0, 64)
    assert not qk.can_use_qk_rmsnorm_diffusers_rope_img_first(**args)
    with pytest.raises(UnsupportedInput):
        qk.qk_rmsnorm_diffusers_rope_img_first(**args)


def test_fake_impl_and_registry():
    from ditfuse.kernels import DESCRIPTORS

    d = next(d for d in DESCRIPTORS if d.op == "rope.qk_rmsnorm_diffusers_rope_img_first")
    assert d.load_reference() is rf.qk_rmsnorm_diffusers_rope_img_first
    args = _make(2, 5, 3, 2, 64, seed=5)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        q, k = torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_img_first(*fake.values())
    assert tuple(q.shape) == tuple(k.shape) == (2, 8, 2, 64)
