"""rope.qk_rmsnorm_diffusers_rope_complex under TRITON_INTERPRET=1 (tiny shapes).

The kernel is compared bitwise with tests/support/diffusers_rms_sim.py, a pure-torch simulation of
the chain as CUDA runs it (torch's generic reduce order for ``pow(2).mean(-1)``, MeanOps'
factor, each complex-multiply contraction). Under the interpreter ``rsqrt`` is numpy's
``1 / sqrt`` and the simulation uses the same (on the GPU both are ``rsqrtf``; the GPU tests
compare with the eager chain). The simulation itself is checked against the CPU reference with
the CPU's mean and the CPU's (FMA-free, vectorized) complex multiply.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as mod
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import (
    CMUL_MODE,
    can_use_qk_rmsnorm_diffusers_rope_complex as can_use,
    qk_rmsnorm_diffusers_rope_complex as op,
)
from tests.support import diffusers_rms_sim as sim
from tests.support import rms_sim

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = ("q", "k", "q_weight", "k_weight", "freqs", "eps", "q_txt", "k_txt", "q_txt_weight",
         "k_txt_weight", "txt_freqs")


def _sim(args, cmul=CMUL_MODE):
    return sim.qk_chain_cuda(**args, cmul=cmul, rsqrt=rms_sim.interp_rsqrt)


def _table(S: int, D: int, g: torch.Generator) -> torch.Tensor:
    """complex64 [S, D/2] like Qwen's: polar(1, fp32 angles pos * theta^(-2i/D))."""
    pos = torch.randint(-64, 64, (S, 1), generator=g).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = pos * inv + torch.rand(S, D // 2, generator=g)
    return torch.polar(torch.ones_like(ang), ang)


def _make(B, S_img, S_txt, H, D, dtype=torch.bfloat16, seed=0, weights=True, rope=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        # Per-row scales over several binades: sums of squares round in many ways.
        s = torch.exp(torch.randn(*shape[:-1], 1, generator=g))
        return (torch.randn(*shape, generator=g) * s * scale).to(dtype)

    q, k = rnd(B, S_img, H, D), rnd(B, S_img, H, D)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(B, S_txt, H, D), rnd(B, S_txt, H, D)
    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(4)]
    freqs = _table(S_img, D, g) if rope else None
    txt_freqs = _table(S_txt, D, g) if rope and S_txt else None
    return dict(q=q, k=k, q_weight=ws[0], k_weight=ws[1], freqs=freqs, eps=1e-6, q_txt=q_txt, k_txt=k_txt,
                q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None,
                txt_freqs=txt_freqs)


def _check(args, name="qk_rmsnorm_diffusers_rope_complex"):
    assert can_use(**args)
    out = op(**args)
    assert_bitwise_equal(out, _sim(args), f"{name} vs simulation")
    B, S_img, H, D = args["q"].shape
    S_txt = args["q_txt"].shape[1] if args["q_txt"] is not None else 0
    for t in out:
        assert t.shape == (B, S_txt + S_img, H, D) and t.is_contiguous() and t.dtype == args["q"].dtype
    return out


@pytest.mark.parametrize("cmul", sim.CMUL_MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_contraction_mode_bitwise(cmul, dtype):
    args = _make(2, 7, 5, 3, 128, dtype, seed=cmul)
    out = mod._launch_diffusers(**args, cmul=cmul)
    assert_bitwise_equal(out, _sim(args, cmul), f"cmul={cmul} {dtype}")


def test_contraction_modes_differ():
    """The five modes are pairwise distinguishable on fp32 outputs (so the mode tests can fail;
    after a bf16 rounding a one-ulp fp32 difference rarely shows)."""
    args = _make(1, 16, 0, 4, 128, torch.float32, seed=3)
    outs = [mod._launch_diffusers(**args, cmul=m)[0] for m in sim.CMUL_MODES]
    for i, j in itertools.combinations(range(len(outs)), 2):
        assert first_mismatch(outs[i], outs[j]) is not None, (i, j)


SHAPES = list(itertools.product([128, 64, 256, 96], [1, 7, 37], [0, 5, 13]))


@pytest.mark.parametrize("D,S_img,S_txt", SHAPES, ids=[f"D{d}-S{s}-T{t}" for d, s, t in SHAPES])
def test_shapes(D, S_img, S_txt):
    """D 64/96 (2 or 3 elements per lane, zero-padded lanes), 128/256 (4-element vectors);
    1..37 image and 0..13 text rows per head, so streams with 1 to 222 rows: the lane count W
    (32 from 16 rows, up to 64 below) differs per stream."""
    B = 1 + (S_img + S_txt) % 2
    H = 3 if (S_img + D) % 3 else 1
    _check(_make(B, S_img, S_txt, H, D, seed=D + S_img * 7 + S_txt))


@pytest.mark.parametrize("B,H", [(1, 1), (2, 1), (1, 3), (2, 3)])
def test_batch_heads(B, H):
    _check(_make(B, 5, 3, H, 128, seed=B * 10 + H))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S_txt", [0, 5])
def test_dtypes(dtype, S_txt):
    _check(_make(2, 7, S_txt, 3, 128, dtype, seed=S_txt + 1))


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False), (False, False)])
def test_no_weight_no_rope(weights, rope):
    for S_txt in (0, 4):
        _check(_make(1, 6, S_txt, 2, 128, seed=7 + S_txt, weights=weights, rope=rope))


def test_mixed_weights_and_fp32_weight_with_fp32_input():
    args = _make(1, 5, 3, 2, 128, seed=4)
    args["k_txt_weight"] = None
    args["q_weight"] = None
    _check(args)
    args = _make(1, 5, 3, 2, 64, torch.float32, seed=5)
    _check(args)


def test_factor_and_lane_count_follow_each_stream():
    """MeanOps' factor float(rows) / float(rows * D) is r32(1/D) while rows times the odd part of
    D is below 2**24 (both operands exact), not always beyond (D = 127 past 2**24 / 127 rows);
    the lane count depends on the rows below 16. The kernel takes each stream's own values
    (host == simulation), and the factor it is given matters."""
    n0 = 2**24 // 127
    r = np.float32(1) / np.float32(127)
    assert all(mod._mean_factor(n, 127) == r for n in range(1, 2000))
    assert any(mod._mean_factor(n, 127) != r for n in range(n0, n0 + 2000))
    assert all(mod._mean_factor(n, 96) == np.float32(1) / np.float32(96) for n in range(n0, n0 + 2000))
    assert mod._reduce_launch(64, 1)[0] == 64 and mod._reduce_launch(64, 16)[0] == 32
    assert mod._reduce_launch(96, 8)[0] == 64 and mod._reduce_launch(256, 1) == (64, 4, False)
    assert mod._reduce_launch(128, 1) == (32, 4, False) and mod._reduce_launch(512, 3) == (128, 4, False)
    for D, rows in itertools.product([1, 3, 64, 96, 100, 127, 128, 136, 256, 3840],
                                     [1, 2, 5, 15, 16, 300, 5000, n0 + 7, n0 + 1001]):
        assert mod._reduce_launch(D, rows)[:2] == sim.reduce_width(D, rows), (D, rows)
        assert mod._mean_factor(rows, D) == sim.mean_factor(rows, D), (D, rows)
    args = _make(1, 37, 1, 3, 96, torch.float32, seed=8)
    good = _check(args)
    orig = mod._mean_factor
    try:  # one ulp off (what a huge stream of an odd width gives): the output changes
        mod._mean_factor = lambda rows, D: float(np.nextafter(np.float32(orig(rows, D)), np.float32(1)))
        bad = mod._launch_diffusers(**args)
    finally:
        mod._mean_factor = orig
    assert first_mismatch(good[0], bad[0]) is not None or first_mismatch(good[1], bad[1]) is not None


def _probe():
    """bench/probes/probe_diffusers_rms.py: the candidate orders the H200 run compared with torch
    (bench/results/probe_diffusers_rms_h200.json)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "probes" / "probe_diffusers_rms.py"
    spec = importlib.util.spec_from_file_location("probe_diffusers_rms", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("D", [16, 64, 96, 128, 256, 3840])
def test_sum_order_is_the_one_the_h200_matched(D):
    """The simulation's order equals the probe candidate that had 0 differing rows on the H200 for
    that width (reduce kernel with the halving tree; at D = 128 the layer-norm order, which is
    the vectorized one there), and differs from the ones that did not (so it has teeth)."""
    probe = _probe()
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(256 if D < 3840 else 32, D, generator=g)
         * torch.exp(torch.randn(256 if D < 3840 else 32, 1, generator=g)))
    ours = sim.sumsq_reduce_order(x)
    sq = x * x
    if D == 128:
        assert torch.equal(ours, probe.sum_layernorm_order(sq))
        assert torch.equal(ours, rms_sim.sumsq(x, "torch_nofma"))
    else:
        assert torch.equal(ours, probe.sum_reduce(sq, tree=probe._tree_halves))
    assert not torch.equal(ours, probe.sum_reduce(sq, tree=probe._tree_adjacent))


def test_strided_views():
    """Projections unflattened (contiguous), chunks of a fused qkv, head-major transposed text,
    and tables that are row / column slices of wider tables."""
    B, S, St, H, D = 2, 5, 3, 2, 128
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, 3 * H * D, generator=g).to(torch.bfloat16)
    q, k, _ = (t.unflatten(-1, (-1, D)) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    qt = torch.randn(B, St, H * D, generator=g).to(torch.bfloat16).unflatten(-1, (-1, D))
    kt = torch.randn(B, H, St, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    w = [(1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16) for _ in range(4)]
    wide = _table(2 * S, D * 2, g)
    freqs = wide[1::2, ::2]  # strided rows and pairs
    txt_freqs = _table(St + 4, D, g)[4:]  # Qwen's text table: rows of a longer table
    args = dict(q=q, k=k, q_weight=w[0], k_weight=w[1], freqs=freqs, eps=1e-6, q_txt=qt, k_txt=kt,
                q_txt_weight=w[2], k_txt_weight=w[3], txt_freqs=txt_freqs)
    out = _check(args)
    contiguous = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    assert_bitwise_equal(out, op(**contiguous), "strided vs contiguous")


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("D", [128, 256])
def test_misaligned_input_is_accepted(D):
    """torch's mean reads the fresh fp32 ``pow(2)`` tensor, never the input's memory: an input
    off a 16-byte boundary runs the same reduction."""
    args = _make(1, 3, 2, 2, D, seed=D)
    args["q"] = _misaligned(args["q"])
    assert args["q"].data_ptr() % 16 != 0
    _check(args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_signed_zero(dtype):
    args = _make(1, 4, 2, 2, 128, dtype, seed=9)
    args["q"][0, 1, 0, 5] = float("nan")
    args["q"][0, 2, 1, 7] = float("inf")
    args["k_txt"][0, 0, 1, 0] = float("-inf")
    args["k"][0, 3, 0, :] = 0.0  # all-zero row: rstd = rsqrt(eps)
    args["k"][0, 3, 1, :] = -0.0  # signed zeros through the norm and the complex multiply
    args["q_txt"][0, 1, 0, ::3] = -0.0
    big = 3e19 if dtype != torch.float16 else 6e4
    args["k"][0, 2, 0, :4] = big  # squares overflow (fp16: not quite)
    for cmul in sim.CMUL_MODES:
        out = mod._launch_diffusers(**args, cmul=cmul)
        assert_bitwise_equal(out, _sim(args, cmul), f"cmul={cmul}")
    out = _check(args)
    assert torch.isnan(out[0][0, 2 + 1, 0]).all()  # NaN spreads over its row (text rows first)


def test_large_and_tiny_scales():
    _check(_make(1, 3, 0, 2, 128, torch.bfloat16, seed=12, scale=3e19))
    _check(_make(1, 3, 2, 2, 128, torch.bfloat16, seed=13, scale=1e-21))
    _check(_make(1, 3, 2, 2, 64, torch.float32, seed=14, scale=1e-22))


def test_empty_sequence():
    args = _make(1, 0, 0, 2, 128)
    q, k = op(**args)
    assert q.shape == (1, 0, 2, 128) and k.shape == (1, 0, 2, 128)


def test_simulation_matches_cpu_reference():
    """The simulation's chain (roundings, weights, per-stream tables, concat) equals the CPU
    reference when it uses the CPU's mean and ``torch.rsqrt`` and mode 0: the CPU's vectorized
    complex64 loop has no FMA (tests/cpu/test_family_chains.py), and D/2 = 64 pairs fill whole
    vectors. Whether CUDA contracts is the GPU test's question."""
    for dtype in (torch.bfloat16, torch.float32):
        for weights in (True, False):
            args = _make(2, 7, 5, 3, 128, dtype, seed=21, weights=weights)
            exp = rf.qk_rmsnorm_diffusers_rope_complex_cat(**args)
            got = sim.qk_chain_cuda(**args, cmul=0, mean=sim.cpu_mean)
            assert_bitwise_equal(got, exp, f"simulation (cpu mean, cmul 0) vs CPU reference {dtype}")
    args = _make(1, 7, 5, 2, 128, torch.float32, seed=22)
    got = sim.qk_chain_cuda(**args, cmul=1, mean=sim.cpu_mean)
    assert first_mismatch(got[0], rf.qk_rmsnorm_diffusers_rope_complex_cat(**args)[0]) is not None


def test_reference_wrapper_and_exact():
    from ditfuse.kernels import exact

    args = _make(1, 4, 3, 2, 64, seed=30)
    assert_bitwise_equal(rf.qk_rmsnorm_diffusers_rope_complex(**args),
                         rf.qk_rmsnorm_diffusers_rope_complex_cat(**args), "wrapper")
    e = exact.qk_rmsnorm_diffusers_rope_complex_fp64(**args)
    out = op(**args)
    for o, x in zip(out, e):
        # two bf16 roundings in the norm, one after RoPE: within a few output ulps
        torch.testing.assert_close(o.double(), x, rtol=2**-6, atol=3 * 2**-7)


def _base():
    return _make(1, 2, 1, 2, 128, seed=1)


REJECTIONS = {
    "dtype_mix": lambda a: a.update(k=a["k"].float()),
    "fp64": lambda a: a.update(q=a["q"].double(), k=a["k"].double(), q_txt=a["q_txt"].double(),
                               k_txt=a["k_txt"].double(), q_weight=None, k_weight=None,
                               q_txt_weight=None, k_txt_weight=None),
    "fp32_weight_bf16_input": lambda a: a.update(q_weight=a["q_weight"].float()),
    "fp16_weight_bf16_input": lambda a: a.update(k_txt_weight=a["k_txt_weight"].half()),
    "bf16_weight_fp32_input": lambda a: a.update(
        q=a["q"].float(), k=a["k"].float(), q_txt=a["q_txt"].float(), k_txt=a["k_txt"].float(),
        q_weight=a["q_weight"].float(), k_weight=a["k_weight"].float(), q_txt_weight=a["q_txt_weight"].float()),
    "weight_shape": lambda a: a.update(k_weight=a["k_weight"][:64]),
    "shape_mismatch": lambda a: a.update(k=a["k"][:, :1]),
    "not_4d": lambda a: a.update(q=a["q"].flatten(2), k=a["k"].flatten(2)),
    "text_half": lambda a: a.update(k_txt=None),
    "text_weight_no_text": lambda a: a.update(q_txt=None, k_txt=None, txt_freqs=None),
    "txt_freqs_missing": lambda a: a.update(txt_freqs=None),
    "txt_freqs_without_freqs": lambda a: a.update(freqs=None),
    "freqs_shape": lambda a: a.update(freqs=a["freqs"][:1]),
    "freqs_width": lambda a: a.update(txt_freqs=a["txt_freqs"][:, :32]),
    "freqs_real": lambda a: a.update(freqs=a["freqs"].real.contiguous()),
    "freqs_complex128": lambda a: a.update(freqs=a["freqs"].to(torch.complex128)),
    "freqs_conj": lambda a: a.update(freqs=a["freqs"].conj()),
    "head_dim_not_innermost": lambda a: a.update(
        q=a["q"].transpose(2, 3).contiguous().transpose(2, 3)),
    "channels_last": lambda a: a.update(
        q=torch.empty(1, 2, 1, 128, dtype=torch.bfloat16).as_strided((1, 2, 1, 128), (256, 1, 256, 2)).copy_(a["q"][:, :, :1]),
        k=a["k"][:, :, :1], q_txt=a["q_txt"][:, :, :1], k_txt=a["k_txt"][:, :, :1]),
    "rows_overlap": lambda a: a.update(q=a["q"][:, :, :1].expand(-1, -1, 2, -1)),
    "grad": lambda a: a.update(q=a["q"].clone().requires_grad_(True)),
    "eps_tensor": lambda a: a.update(eps=torch.tensor(1e-6)),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS) + ["head_dim_odd_rope", "head_dim_unvectorizable",
                                                       "warp_split"])
def test_predicate_rejects_and_kernel_raises(case):
    if case == "head_dim_odd_rope":
        args = _make(1, 2, 1, 1, 66, seed=2)
        args["freqs"] = _table(2, 66, torch.Generator().manual_seed(0))[:, :33]
        args["txt_freqs"] = args["freqs"][:1]
        args["q"], args["k"] = args["q"][..., :65], args["k"][..., :65]
        args["q_txt"], args["k_txt"] = args["q_txt"][..., :65], args["k_txt"][..., :65]
        args.update(q_weight=None, k_weight=None, q_txt_weight=None, k_txt_weight=None)
    elif case == "head_dim_unvectorizable":
        args = _make(1, 2, 1, 1, 130, seed=2, rope=False)
    elif case == "warp_split":
        args = _make(1, 20, 0, 1, 8192, seed=2, rope=False, weights=False)
    else:
        args = _base()
        REJECTIONS[case](args)
    assert not can_use(**args)
    with pytest.raises(UnsupportedInput):
        op(**args)


def test_odd_head_dim_without_rope_is_supported():
    """No RoPE: any D <= 128 runs torch's non-vectorized order (here 65 and 3)."""
    _check(_make(1, 3, 2, 2, 65, seed=3, rope=False))
    _check(_make(2, 1, 0, 1, 3, seed=4, rope=False))


def test_custom_op_and_fake():
    args = _make(1, 2, 1, 2, 128, seed=2)
    ordered = [args[n] for n in NAMES] + [CMUL_MODE]
    torch.library.opcheck(
        torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_complex.default, ordered,
        test_utils=("test_schema", "test_faketensor"),
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in ordered]
        q, k = torch.ops.ditfuse.qk_rmsnorm_diffusers_rope_complex(*fake)
    assert q.shape == (1, 3, 2, 128) and k.dtype == torch.bfloat16


def test_registry_descriptor():
    from ditfuse.kernels import descriptor

    d = descriptor("rope.qk_rmsnorm_diffusers_rope_complex")
    assert d.load_reference() is rf.qk_rmsnorm_diffusers_rope_complex
    assert d.specs()[0].load() is op and d.specs()[0].load_predicate() is can_use


# -- per-sample freqs (Z-Image's single stream: freqs_cis [B, S, D/2]) -------------------------


def _per_sample(B, S, D, g, b1=False):
    """complex64 [B, S, D/2] with a different table per sample (Z-Image pads each sample's
    positions separately), or [1, S, D/2] when ``b1``."""
    return torch.stack([_table(S, D, g) for _ in range(1 if b1 else B)])


@pytest.mark.parametrize("B,S,H,D", [(2, 7, 3, 128), (1, 13, 2, 64), (2, 37, 1, 96), (3, 5, 2, 256)])
def test_per_sample_freqs_single_stream(B, S, H, D):
    g = torch.Generator().manual_seed(B * 100 + S)
    args = _make(B, S, 0, H, D, seed=S + D)
    args["freqs"] = _per_sample(B, S, D, g)
    out = _check(args, "per-sample freqs")
    # each sample really reads its own table: swapping samples' tables changes the output
    swapped = dict(args, freqs=args["freqs"].flip(0))
    if B > 1:
        assert first_mismatch(op(**swapped)[0], out[0]) is not None
    # == the CPU reference chain's broadcasting (freqs.unsqueeze(2)) with the CPU's own mean
    # and complex multiply is the simulation's job; here: the fp64 math agrees to bf16 precision
    from ditfuse.kernels import exact
    q64, _ = exact.qk_rmsnorm_diffusers_rope_complex_fp64(
        *[a.double() if isinstance(a, torch.Tensor) and not a.is_complex() else a for a in
          (args["q"], args["k"], args["q_weight"], args["k_weight"])], args["freqs"], args["eps"])
    assert torch.allclose(out[0].double(), q64, rtol=2e-2, atol=2e-2)


def test_per_sample_freqs_broadcast_batch_one_table():
    """[1, S, D/2] with B = 2: one table for both samples (batch stride 0), == the 2-D table."""
    g = torch.Generator().manual_seed(5)
    args = _make(2, 9, 0, 2, 128, seed=9)
    t = _per_sample(2, 9, 128, g, b1=True)
    a3 = _check(dict(args, freqs=t))
    a2 = _check(dict(args, freqs=t[0]))
    assert_bitwise_equal(a3, a2, "[1,S,D/2] vs [S,D/2]")


def test_per_sample_freqs_with_text_stream():
    g = torch.Generator().manual_seed(11)
    args = _make(2, 7, 5, 3, 128, seed=11)
    args["freqs"] = _per_sample(2, 7, 128, g)
    args["txt_freqs"] = _per_sample(2, 5, 128, g)
    _check(args, "per-sample freqs, two streams")


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 8, 64), (2, 7, 32), (7, 32), (1, 1, 7, 64)])
def test_per_sample_freqs_rejected_shapes(shape):
    args = _make(2, 7, 0, 3, 128, seed=1)
    args["freqs"] = torch.polar(torch.ones(shape), torch.zeros(shape))
    assert not can_use(**args)
    with pytest.raises(UnsupportedInput, match="freqs must be"):
        op(**args)
