"""rope.qk_rmsnorm_rope on CUDA: bitwise equal to the eager chain (ditfuse.kernels.reference,
i.e. torch's ``_fused_rms_norm`` + diffusers' RoPE) over FLUX-like shapes, dtypes, strided views
and NaN/Inf inputs. Runs in well under a minute on an H200."""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import can_use_qk_rmsnorm_rope, qk_rmsnorm_rope

DEV = "cuda"
D = 128


def _rope_tables(S: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX-like fp32 tables (fp64 angles from 3 position axes, each frequency repeated for its
    pair) with random positions."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 128, (S,), generator=g).double()
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2).double() / D))
    ang = pos[:, None] * freqs[None, :] + torch.rand(S, D // 2, generator=g).double()
    cos = ang.cos().float().repeat_interleave(2, dim=1)
    sin = ang.sin().float().repeat_interleave(2, dim=1)
    return cos.to(DEV), sin.to(DEV)


def _make(B, S_img, S_txt, H, D=D, dtype=torch.bfloat16, seed=0, weights=True, rope=True):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        # Per-row scales over several binades: sums of squares round in many ways.
        scale = torch.exp(torch.randn(*shape[:-1], 1, device=DEV, generator=g))
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)

    q, k = rnd(B, S_img, H, D), rnd(B, S_img, H, D)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(B, S_txt, H, D), rnd(B, S_txt, H, D)
    ws = [
        (1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype) if weights else None
        for _ in range(4)
    ]
    cos = sin = None
    if rope:
        cos, sin = _rope_tables(S_img + S_txt, D, seed)
    return dict(
        q=q, k=k, q_weight=ws[0], k_weight=ws[1], cos=cos, sin=sin, eps=1e-6,
        q_txt=q_txt, k_txt=k_txt,
        q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None,
    )


def _check(args, name="qk_rmsnorm_rope"):
    assert can_use_qk_rmsnorm_rope(**args)
    out = qk_rmsnorm_rope(**args)
    expected = reference.qk_rmsnorm_rope(**args)
    assert_bitwise_equal(out, expected, name)
    return out


SWEEP = list(itertools.product([24, 12, 16, 40], [1, 17, 512, 4096, 4608], [0, 512], [1, 2]))


@pytest.mark.parametrize("H,S_img,S_txt,B", SWEEP, ids=[f"H{h}-S{s}-T{t}-B{b}" for h, s, t, b in SWEEP])
def test_sweep_bf16(H, S_img, S_txt, B):
    _check(_make(B, S_img, S_txt, H, seed=H * 7 + S_img + S_txt + B))


DT_SWEEP = list(itertools.product([torch.float16, torch.float32], [17, 4096], [0, 512], [1, 2]))


@pytest.mark.parametrize("dtype,S_img,S_txt,B", DT_SWEEP, ids=[f"{str(d)[6:]}-S{s}-T{t}-B{b}" for d, s, t, b in DT_SWEEP])
def test_sweep_fp16_fp32(dtype, S_img, S_txt, B):
    _check(_make(B, S_img, S_txt, 24, dtype=dtype, seed=S_img + S_txt + B))


@pytest.mark.parametrize("head_dim", [64, 96, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_head_dims(head_dim, dtype):
    _check(_make(2, 300, 40, 8, D=head_dim, dtype=dtype, seed=head_dim))


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False), (False, False)])
def test_no_weight_no_rope(weights, rope):
    _check(_make(2, 1024, 512, 24, seed=5, weights=weights, rope=rope))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nan_inf(dtype):
    args = _make(2, 512, 512, 24, dtype=dtype, seed=9)
    g = torch.Generator(device=DEV).manual_seed(1)
    for name in ("q", "k", "q_txt", "k_txt"):
        t = args[name]
        n = t.numel()
        idx = torch.randint(0, n, (64,), device=DEV, generator=g)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0], device=DEV, dtype=dtype)
        t.view(-1)[idx] = vals.repeat(16)
        t[0, 3, 1, :] = 0.0  # an all-zero row: rstd = rsqrt(eps), output zeros with signs
        t[1, 4, 2, :] = float("inf")  # rstd = 0: 0 * inf = NaN everywhere
    big = args["q"][0, 5, 0]
    big.copy_(torch.full_like(big, 3e19 if dtype != torch.float16 else 6e4))  # squares overflow
    _check(args)


def test_strided_views():
    """q/k as chunks of a fused qkv projection (single block, no text), and text q/k as
    head-major tensors transposed, against the same inputs made contiguous."""
    B, S, St, H = 2, 1024, 512, 24
    g = torch.Generator(device=DEV).manual_seed(3)
    qkv = torch.randn(B, S, 3 * H * D, device=DEV, generator=g).to(torch.bfloat16)
    q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    qt = torch.randn(B, H, St, D, device=DEV, generator=g).to(torch.bfloat16).transpose(1, 2)
    kt = torch.randn(B, H, St, D, device=DEV, generator=g).to(torch.bfloat16).transpose(1, 2)
    w = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(torch.bfloat16) for _ in range(4)]
    cos, sin = _rope_tables(S + St, D, 3)
    _check(dict(q=q, k=k, q_weight=w[0], k_weight=w[1], cos=cos, sin=sin, eps=1e-6,
                q_txt=qt, k_txt=kt, q_txt_weight=w[2], k_txt_weight=w[3]), "text+image strided")
    cos1, sin1 = _rope_tables(S, D, 4)
    _check(dict(q=q, k=k, q_weight=w[0], k_weight=w[1], cos=cos1, sin=sin1, eps=1e-6,
                q_txt=None, k_txt=None, q_txt_weight=None, k_txt_weight=None), "single block qkv chunks")


def test_misaligned_is_rejected():
    """A contiguous input starting off a 4-element boundary takes torch's other kernels: rejected."""
    args = _make(1, 17, 0, 24, seed=2)
    flat = torch.empty(args["q"].numel() + 1, device=DEV, dtype=torch.bfloat16)
    q = flat[1:].view(args["q"].shape)
    q.copy_(args["q"])
    args["q"] = q
    assert not can_use_qk_rmsnorm_rope(**args)


def test_custom_op_opcheck():
    args = _make(1, 17, 5, 4, seed=6)
    ordered = [args[n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin", "eps",
                                 "q_txt", "k_txt", "q_txt_weight", "k_txt_weight")] + [True]
    torch.library.opcheck(
        torch.ops.ditfuse.qk_rmsnorm_rope.default, ordered,
        test_utils=("test_schema", "test_faketensor"),
    )


def test_close_variant_runs_and_stays_close():
    from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import qk_rmsnorm_rope_fp32

    args = _make(1, 4096, 512, 24, seed=9)
    exact, close = qk_rmsnorm_rope(**args), qk_rmsnorm_rope_fp32(**args)
    for e, c in zip(exact, close):
        assert not torch.equal(e.view(torch.int16), c.view(torch.int16))
        torch.testing.assert_close(c.float(), e.float(), rtol=2e-2, atol=2e-2)
