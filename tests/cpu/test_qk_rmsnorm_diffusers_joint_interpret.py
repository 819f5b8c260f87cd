"""rope.qk_rmsnorm_diffusers_rope_joint (HunyuanVideo's single-block QK chain) under TRITON_INTERPRET=1.

Kernel == the simulation of the eager chain: tests/support/diffusers_rms_sim.py's CUDA model of
diffusers' RMSNorm over the WHOLE joint tensor (one mean call: the joint row count's lane count
and factor for every row), then the reference's RoPE on the leading video rows and the re-concat,
bitwise; both kernels at D = 128, awkward video / text splits (1 text row, 1 video row), batch 1
and 2, every dtype, with and without weights, signed zeros in the text rows, the predicate's
rejections. A split whose two row ranges would each get their own reduction launch (the
img-first op called on views) is shown to differ where the row counts change torch's lane count,
which is why the op exists.
"""

from __future__ import annotations

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


def _make(B, S, n_txt, H, D, dtype=torch.bfloat16, seed=0, weights=True):
    g = torch.Generator().manual_seed(seed)
    s = torch.exp(torch.randn(B, S, H, 1, generator=g))
    # the projection's output unflattened: [B, S, H * D] -> [B, S, H, D] (contiguous)
    q, k = ((torch.randn(B, S, H, D, generator=g) * s).to(dtype).reshape(B, S, H * D).unflatten(2, (H, D))
            for _ in range(2))
    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(2)]
    ang = torch.randn(S - n_txt, D // 2, generator=g) * 3
    cos = torch.cos(ang).repeat_interleave(2, dim=1)
    sin = torch.sin(ang).repeat_interleave(2, dim=1)
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], cos=cos, sin=sin, eps=1e-6, n_txt=n_txt)


def _expected(args):
    """The eager chain with torch's CUDA mean simulated: the joint norm, then the reference's RoPE
    on the video rows (identical on CPU and CUDA: fp32 products and sum, one rounding)."""
    n = args["n_txt"]
    nq, nk = sim.qk_img_first_cuda(args["q"], args["k"], args["q_weight"], args["k_weight"], None, None,
                                   args["eps"], rsqrt=rms_sim.interp_rsqrt)
    s = nq.shape[1] - n
    return (torch.cat([rf.rope_interleaved(nq[:, :s], args["cos"], args["sin"]), nq[:, s:]], dim=1),
            torch.cat([rf.rope_interleaved(nk[:, :s], args["cos"], args["sin"]), nk[:, s:]], dim=1))


def _check(args, kernel=None):
    assert qk.can_use_qk_rmsnorm_diffusers_rope_joint(**args), qk._joint_reason(*args.values())
    if kernel is None:
        out = qk.qk_rmsnorm_diffusers_rope_joint(**args)
    else:
        out = qk._launch_joint(*args.values(), kernel=kernel)
    assert_bitwise_equal(out, _expected(args), f"qk_rmsnorm_diffusers_rope_joint ({kernel or 'auto'}) vs simulation")
    for t, x in zip(out, (args["q"], args["k"])):
        assert t.shape == x.shape and t.dtype == x.dtype and t.is_contiguous()
    return out


SHAPES = [(1, 2, 1, 1, 64), (2, 9, 4, 3, 64), (1, 37, 13, 2, 96), (2, 16, 1, 5, 128), (1, 8, 7, 3, 128),
          (2, 3, 2, 1, 16)]


@pytest.mark.parametrize("B,S,n_txt,H,D", SHAPES, ids=[f"B{b}-S{s}-T{t}-H{h}-D{d}" for b, s, t, h, d in SHAPES])
def test_shapes(B, S, n_txt, H, D):
    _check(_make(B, S, n_txt, H, D, seed=B + S * 7 + n_txt * 31 + D))


@pytest.mark.parametrize("kernel", ["tile", "lanes"])
@pytest.mark.parametrize("B,H,n_txt", [(1, 1, 1), (2, 3, 5), (1, 16, 11)])
def test_both_kernels_at_head_dim_128(kernel, B, H, n_txt):
    _check(_make(B, 9 + n_txt, n_txt, H, 128, seed=B * 10 + H + n_txt), kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weights", [True, False])
def test_dtypes_weights(dtype, weights):
    _check(_make(2, 12, 5, 3, 64, dtype, seed=3, weights=weights))


def test_text_rows_keep_signed_zeros():
    args = _make(1, 10, 6, 2, 128, seed=3)
    args["q"][:, 4 + 2] = -0.0
    out = _check(args)
    assert torch.signbit(out[0][:, 4 + 2]).any()


def test_joint_launch_is_not_the_split_one():
    """Below 16 rows torch's mean gives a row more lanes: a stream of 4 text rows alone reduces
    over 64 lanes at D = 96 (elements l, l + 64 per lane, then the fold), the joint 20 rows over 32
    (l, l + 32, l + 64): another summation order. So the img-first op on the two views (each range
    its own launch) is not this chain; the joint op is. Shown on a case where the two disagree
    (otherwise the test would prove nothing)."""
    assert qk._reduce_launch(96, 4)[0] == 64 and qk._reduce_launch(96, 20)[0] == 32
    for seed in range(20):
        args = _make(1, 20, 4, 1, 96, torch.float32, seed=seed)
        s = 16
        split = qk.qk_rmsnorm_diffusers_rope_img_first(
            args["q"][:, :s], args["k"][:, :s], args["q_weight"], args["k_weight"], args["cos"], args["sin"], 1e-6,
            args["q"][:, s:], args["k"][:, s:], args["q_weight"], args["k_weight"])
        exp = _expected(args)
        if not (torch.equal(split[0], exp[0]) and torch.equal(split[1], exp[1])):
            _check(args)
            return
    raise AssertionError("no seed made the split launch differ from the joint one in the last bit")


def test_head_major_memory():
    """q / k laid out [B, H, S, D] in memory and viewed [B, S, H, D]: rows still D apart, the head
    dim innermost (torch's mean reduces them in place), so the op takes them."""
    args = _make(2, 9, 3, 3, 64, seed=6)
    for name in ("q", "k"):
        args[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)
    _check(args)


@pytest.mark.parametrize("case", ["no_text", "all_text", "no_rope", "cos_shape", "k_shape", "head_dim_strided",
                                  "n_bool"])
def test_rejections(case):
    args = _make(1, 6, 2, 2, 64, seed=4)
    if case == "no_text":
        args["n_txt"] = 0
        args["cos"], args["sin"] = (torch.ones(6, 64), torch.zeros(6, 64))
    elif case == "all_text":
        args["n_txt"] = 6
    elif case == "no_rope":
        args["cos"] = args["sin"] = None
    elif case == "cos_shape":
        args["cos"] = args["cos"][:-1]
    elif case == "k_shape":
        args["k"] = args["k"][:, :-1]
    elif case == "head_dim_strided":
        args["q"] = args["q"].transpose(-1, -2).contiguous().transpose(-1, -2)
    elif case == "n_bool":
        args["n_txt"] = True
    assert not qk.can_use_qk_rmsnorm_diffusers_rope_joint(**args)
    with pytest.raises(UnsupportedInput):
        qk.qk_rmsnorm_diffusers_rope_joint(**args)


def test_fake_impl_and_registry():
    from ditfuse.kernels import DESCRIPTORS

    d = next(d for d in DESCRIPTORS if d.op == "rope.qk_rmsnorm_diffusers_rope_joint")
    assert d.load_reference() is rf.qk_rmsnorm_diffusers_rope_joint
    args = _make(2, 7, 3, 2, 64, seed=5)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        q, k = torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_joint(*fake.values())
    assert tuple(q.shape) == tuple(k.shape) == (2, 7, 2, 64)


def test_reference_is_the_processor_chain():
    """The reference equals diffusers' single-block code path (RMSNorm modules, apply_rotary_emb,
    the cat) on CPU, bitwise."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm

    args = _make(2, 11, 4, 3, 32, torch.float32, seed=8)
    nq, nk = RMSNorm(32, eps=1e-6), RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        nq.weight.copy_(args["q_weight"])
        nk.weight.copy_(args["k_weight"])
        q, k = nq(args["q"]), nk(args["k"])
        n = args["n_txt"]
        emb = (args["cos"], args["sin"])
        q = torch.cat([apply_rotary_emb(q[:, :-n], emb, sequence_dim=1), q[:, -n:]], dim=1)
        k = torch.cat([apply_rotary_emb(k[:, :-n], emb, sequence_dim=1), k[:, -n:]], dim=1)
    assert_bitwise_equal(rf.qk_rmsnorm_diffusers_rope_joint(**args), (q, k), "reference vs processor chain")
