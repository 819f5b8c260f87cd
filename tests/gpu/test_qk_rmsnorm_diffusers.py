"""rope.qk_rmsnorm_diffusers_rope_complex on CUDA: bitwise equal to the eager chain
(``reference.qk_rmsnorm_diffusers_rope_complex_cat``: diffusers' RMSNorm + Qwen-Image's complex
RoPE + text-first cat) over Qwen-Image shapes, dtypes, few-row streams (other lane counts),
strided views, NaN/Inf, and under torch.compile; plus a diagnostic that reports, per complex
multiply contraction, how many elements differ (asserting only the default mode)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as mod
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import (
    CMUL_MODE,
    can_use_qk_rmsnorm_diffusers_rope_complex as can_use,
    qk_rmsnorm_diffusers_rope_complex as op,
)
from tests.support import diffusers_rms_sim as sim

DEV = "cuda"
H, D = 24, 128


def _table(S: int, D: int, g: torch.Generator) -> torch.Tensor:
    """complex64 [S, D/2] as Qwen-Image builds it: polar(1, fp32 pos * theta^(-2i/D)), positions
    centred (negative and positive), plus random phases so every pair rounds differently."""
    pos = torch.randint(-64, 64, (S, 1), device=DEV, generator=g).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    ang = pos * inv + torch.rand(S, D // 2, device=DEV, generator=g)
    return torch.polar(torch.ones_like(ang), ang)


def _make(B, S_img, S_txt, H=H, D=D, dtype=torch.bfloat16, seed=0, weights=True, rope=True):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        scale = torch.exp(torch.randn(*shape[:-1], 1, device=DEV, generator=g))
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)

    q, k = rnd(B, S_img, H, D), rnd(B, S_img, H, D)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(B, S_txt, H, D), rnd(B, S_txt, H, D)
    ws = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype) if weights else None for _ in range(4)]
    freqs = _table(S_img, D, g) if rope else None
    txt_freqs = _table(S_txt, D, g) if rope and S_txt else None
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], freqs=freqs, eps=1e-6, q_txt=q_txt, k_txt=k_txt,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None,
                txt_freqs=txt_freqs)


def _check(args, name="qk_rmsnorm_diffusers_rope_complex"):
    assert can_use(**args)
    out = op(**args)
    assert_bitwise_equal(out, rf.qk_rmsnorm_diffusers_rope_complex_cat(**args), name)
    return out


SWEEP = list(itertools.product([1, 2], [4096, 1, 37], [512, 13, 0]))


@pytest.mark.parametrize("B,S_img,S_txt", SWEEP, ids=[f"B{b}-S{s}-T{t}" for b, s, t in SWEEP])
def test_qwen_shapes_bf16(B, S_img, S_txt):
    _check(_make(B, S_img, S_txt, seed=B * 7 + S_img + S_txt))


@pytest.mark.parametrize("S_img,S_txt", [(4096, 512), (37, 13)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp32_fp16(dtype, S_img, S_txt):
    _check(_make(2, S_img, S_txt, dtype=dtype, seed=S_img + S_txt))


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False), (False, False)])
def test_no_weight_no_rope(weights, rope):
    _check(_make(2, 1024, 512, seed=5, weights=weights, rope=rope))


FEW = list(itertools.product([1, 3], [1, 2, 7], [0, 1, 5]))


@pytest.mark.parametrize("heads,S_img,S_txt", FEW, ids=[f"H{h}-S{s}-T{t}" for h, s, t in FEW])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_few_rows_per_stream(heads, S_img, S_txt, head_dim):
    """Streams of 1..15 rows: torch's mean then uses more lanes per row (W up to 64 for these
    widths), a different fold; the kernel's launch model must follow (tested only here on the GPU)."""
    _check(_make(1, S_img, S_txt, H=heads, D=head_dim, seed=heads * 100 + S_img * 10 + S_txt))


@pytest.mark.parametrize("head_dim", [16, 64, 96, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_head_dims(head_dim, dtype):
    _check(_make(2, 300, 40, H=8, D=head_dim, dtype=dtype, seed=head_dim))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nan_inf(dtype):
    args = _make(2, 512, 512, dtype=dtype, seed=9)
    g = torch.Generator(device=DEV).manual_seed(1)
    for name in ("q", "k", "q_txt", "k_txt"):
        t = args[name]
        idx = torch.randint(0, t.numel(), (64,), device=DEV, generator=g)
        vals = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], device=DEV, dtype=dtype)
        t.view(-1)[idx] = vals.repeat(16)
        t[0, 3, 1, :] = 0.0  # all-zero row
        t[1, 4, 2, :] = float("inf")
    big = args["q"][0, 5, 0]
    big.copy_(torch.full_like(big, 3e19 if dtype != torch.float16 else 6e4))
    _check(args)


def test_strided_views():
    """Qwen's q/k are ``to_q(x).unflatten(-1, (-1, D))``; also chunks of a fused qkv, head-major
    text transposed, and tables sliced from longer ones (Qwen's text table is rows of pos_freqs)."""
    B, S, St = 2, 1024, 512
    g = torch.Generator(device=DEV).manual_seed(3)
    qkv = torch.randn(B, S, 3 * H * D, device=DEV, generator=g).to(torch.bfloat16)
    q, k, _ = (t.unflatten(-1, (-1, D)) for t in qkv.chunk(3, dim=-1))
    qt = torch.randn(B, St, H * D, device=DEV, generator=g).to(torch.bfloat16).unflatten(-1, (-1, D))
    kt = torch.randn(B, H, St, D, device=DEV, generator=g).to(torch.bfloat16).transpose(1, 2)
    w = [(1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(torch.bfloat16) for _ in range(4)]
    freqs = _table(2 * S, 2 * D, g)[::2, ::2]
    txt_freqs = _table(St + 100, D, g)[100:]
    _check(dict(q=q, k=k, q_weight=w[0], k_weight=w[1], freqs=freqs, eps=1e-6, q_txt=qt, k_txt=kt,
                q_txt_weight=w[2], k_txt_weight=w[3], txt_freqs=txt_freqs), "strided")


def test_misaligned_input_is_accepted():
    args = _make(1, 17, 5, seed=2)
    flat = torch.empty(args["q"].numel() + 1, device=DEV, dtype=torch.bfloat16)
    q = flat[1:].view(args["q"].shape)
    q.copy_(args["q"])
    args["q"] = q
    _check(args, "misaligned q")


def test_simulation_matches_eager():
    """tests/support/diffusers_rms_sim.py with the default contraction equals the eager chain on
    the GPU (the CPU tests compare the kernel with it under the interpreter)."""
    for S_img, S_txt, heads in ((4096, 512, 24), (7, 5, 1)):
        args = _make(1, S_img, S_txt, H=heads, seed=11)
        assert_bitwise_equal(sim.qk_chain_cuda(**args, cmul=CMUL_MODE),
                             rf.qk_rmsnorm_diffusers_rope_complex_cat(**args), "simulation")


def test_contraction_modes_report(capsys):
    """Diagnostic: elements differing from eager per contraction mode, fp32 and bf16 (fp32 shows
    product roundings). Only the default mode must be 0."""
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        args = _make(2, 1024, 512, dtype=dtype, seed=13)
        exp = rf.qk_rmsnorm_diffusers_rope_complex_cat(**args)
        for m in sim.CMUL_MODES:
            out = mod._launch_diffusers(**args, cmul=m)
            n = sum(int((o.view(torch.int16 if dtype != torch.float32 else torch.int32)
                         != e.view(torch.int16 if dtype != torch.float32 else torch.int32)).sum())
                    for o, e in zip(out, exp))
            counts[(str(dtype), m)] = n
    with capsys.disabled():
        print("\ncmul mode mismatches (elements):", counts)
    assert counts[("torch.float32", CMUL_MODE)] == 0 and counts[("torch.bfloat16", CMUL_MODE)] == 0


def test_compile_fullgraph():
    """One opaque custom-op node under torch.compile(fullgraph=True), same bits as eager."""
    args = _make(1, 256, 64, seed=17)

    def chain(q, k, qw, kw, f, qt, kt, qtw, ktw, tf):
        return op(q, k, qw, kw, f, 1e-6, qt, kt, qtw, ktw, tf)

    compiled = torch.compile(chain, fullgraph=True)
    ordered = [args[n] for n in ("q", "k", "q_weight", "k_weight", "freqs", "q_txt", "k_txt",
                                 "q_txt_weight", "k_txt_weight", "txt_freqs")]
    got = compiled(*ordered)
    assert_bitwise_equal(got, rf.qk_rmsnorm_diffusers_rope_complex_cat(**args), "compiled")


def test_custom_op_opcheck():
    args = _make(1, 17, 5, H=4, seed=6)
    ordered = [args[n] for n in ("q", "k", "q_weight", "k_weight", "freqs", "eps", "q_txt", "k_txt",
                                 "q_txt_weight", "k_txt_weight", "txt_freqs")] + [CMUL_MODE]
    torch.library.opcheck(torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_complex.default, ordered,
                          test_utils=("test_schema", "test_faketensor"))


def test_layer_norm_kernel_is_not_interchangeable():
    """Sanity: FLUX's op (torch.nn.RMSNorm, one rounding) differs from this chain."""
    from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import qk_rmsnorm_rope

    args = _make(1, 64, 0, seed=19, rope=False)
    a = op(**args)
    b = qk_rmsnorm_rope(args["q"], args["k"], args["q_weight"], args["k_weight"], None, None, 1e-6)
    assert first_mismatch(a[0], b[0]) is not None


# -- per-sample freqs: Z-Image's single-stream attention (freqs_cis [B, S, D/2]) -----------------


@pytest.mark.parametrize("B,S,H_", [(1, 4640, 30), (2, 4640, 30), (2, 4111, 30), (2, 13, 30), (1, 1, 30), (3, 37, 2)],
                         ids=["B1-1024px", "B2-1024px", "B2-odd", "B2-13", "B1-1row", "B3-37"])
def test_z_image_per_sample_freqs(B, S, H_):
    """Z-Image 6B: 30 heads of 128, a unified image + caption sequence, each sample its own table
    (bitwise vs the eager chain, whose ``freqs.unsqueeze(2)`` broadcasts over heads)."""
    g = torch.Generator(device=DEV).manual_seed(B * 1000 + S)
    args = _make(B, S, 0, H=H_, seed=S)
    args["freqs"] = torch.stack([_table(S, D, g) for _ in range(B)])
    out = _check(args, f"per-sample freqs B={B} S={S}")
    if B > 1 and S > 1:
        assert first_mismatch(op(**dict(args, freqs=args["freqs"].flip(0)))[0], out[0]) is not None


def test_z_image_per_sample_freqs_fp32_and_broadcast_table():
    g = torch.Generator(device=DEV).manual_seed(7)
    args = _make(2, 333, 0, H=4, dtype=torch.float32, seed=7)
    args["freqs"] = torch.stack([_table(333, D, g) for _ in range(2)])
    _check(args, "per-sample freqs fp32")
    args["freqs"] = args["freqs"][:1]
    _check(args, "[1, S, D/2] table with B=2")
