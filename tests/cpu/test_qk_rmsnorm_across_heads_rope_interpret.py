"""rope.qk_rmsnorm_across_heads_rope (Wan) under TRITON_INTERPRET=1, bitwise against
tests/support/rms_sim.py (torch's vectorized RMS order, several vectors per thread for rows wider
than 512) followed by diffusers' Wan RoPE chain. Under the interpreter ``rsqrt`` is numpy's
``1 / sqrt`` and the simulation uses the same; the GPU tests compare with the real eager chain."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import exact, reference
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope.qk_rmsnorm_across_heads_rope_triton import (
    can_use_qk_rmsnorm_across_heads_rope,
    qk_rmsnorm_across_heads_rope,
    qk_rmsnorm_across_heads_rope_fp32,
)
from tests.support import rms_sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


def _freqs(S: int, Dh: int, dtype=torch.float32, seed: int = 0):
    """Wan's rotary tables: [1, S, 1, Dh], each frequency repeated for its pair."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (S,), generator=g).double()
    freqs = 1.0 / (10000.0 ** (torch.arange(0, Dh, 2).double() / Dh))
    ang = pos[:, None] * freqs[None, :]
    cos = ang.cos().repeat_interleave(2, dim=1).float()[None, :, None, :]
    sin = ang.sin().repeat_interleave(2, dim=1).float()[None, :, None, :]
    return cos.to(dtype), sin.to(dtype)


def _make(B, S, H, Dh, dtype=torch.bfloat16, seed=0, weights=True, fdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    D = H * Dh
    q = (torch.randn(B, S, D, generator=g) * 2).to(dtype)
    k = (torch.randn(B, S, D, generator=g) * 2).to(dtype)
    wq = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None
    wk = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None
    cos, sin = _freqs(S, Dh, fdtype, seed)
    return dict(q=q, k=k, q_weight=wq, k_weight=wk, cos=cos, sin=sin, heads=H, eps=1e-6)


def _sim(a):
    return rms_sim.qk_rmsnorm_across_heads_rope(**a, rsqrt=rms_sim.interp_rsqrt)


@pytest.mark.parametrize("H,Dh", [(2, 16), (3, 32), (12, 64)], ids=["D32", "D96", "D768_2vec"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fdtype", [torch.float32, torch.bfloat16], ids=["fp32_freqs", "bf16_freqs"])
def test_bitwise_vs_sim(H, Dh, dtype, fdtype):
    a = _make(2, 5, H, Dh, dtype, seed=H + Dh, fdtype=fdtype)
    out = qk_rmsnorm_across_heads_rope(**a)
    for o, s, name in zip(out, _sim(a), "qk"):
        assert o.shape == (2, 5, H, Dh) and o.is_contiguous()
        assert_bitwise_equal(o, s, name)


def test_rows_wider_than_512_use_several_vectors_per_thread():
    """D = 1536 (Wan 1.3B): threads hold 3 vectors; the simulation's order matters there."""
    a = _make(1, 2, 12, 128, dtype=torch.float32, seed=5)
    assert_bitwise_equal(qk_rmsnorm_across_heads_rope(**a)[0], _sim(a)[0])
    # fp32 squares round, so the order shows: a plain sequential sum differs from torch's
    seq = rms_sim.rms_norm(a["q"], a["q_weight"], 1e-6, rms_sim.interp_rsqrt, order="sequential")
    assert not torch.equal(seq, rms_sim.rms_norm(a["q"], a["q_weight"], 1e-6, rms_sim.interp_rsqrt))


PATHS = {"warp": dict(warp=True), "held": dict(warp=False), "loop": dict(unroll=False)}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("H,Dh,R", [(12, 128, 4), (4, 128, 2), (2, 6, 2), (5, 4, 1)],
                         ids=["D1536_R4", "D512_R2", "D12_Dh6_R2", "D20_R1"])
def test_warp_held_rows_and_runtime_loop(H, Dh, R, path):
    """Every way over a row, 5 rows (tail rows at R = 2, 4), whole numbers of 128-thread steps
    (1536, 512: unpredicated loads; the only widths the warp-per-row kernel takes) and head_dims
    6 and 4 whose 4-element vectors straddle heads (cos/sin read per element position); fp32
    rows too, whose squares round, so the order of the sums shows."""
    from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

    if path == "warp" and (H * Dh) % 512:
        pytest.skip("the warp-per-row kernel needs whole 128-thread steps")
    for dtype in (torch.bfloat16, torch.float32):
        a = _make(1, 5, H, Dh, dtype=dtype, seed=H * Dh + R)
        got = wr._launch_one(a["q"], a["q_weight"], a["cos"], a["sin"], H, 1e-6, True, rows_per_program=R,
                             **PATHS[path])
        assert_bitwise_equal(got, _sim(a)[0])
    b = dict(a, cos=None, sin=None)
    got = wr._launch_one(b["q"], b["q_weight"], None, None, H, 1e-6, True, rows_per_program=R, **PATHS[path])
    assert_bitwise_equal(got, _sim(b)[0])


def test_no_weight_no_rope_and_strided_qkv_chunks():
    a = _make(1, 4, 2, 32, weights=False, seed=7)
    assert_bitwise_equal(qk_rmsnorm_across_heads_rope(**a)[1], _sim(a)[1])
    b = dict(a, cos=None, sin=None)
    assert_bitwise_equal(qk_rmsnorm_across_heads_rope(**b)[0], _sim(b)[0])
    qkv = torch.randn(1, 4, 3 * 64).to(torch.bfloat16)  # fused projections: chunk views
    q, k, _ = qkv.chunk(3, dim=-1)
    c = dict(a, q=q, k=k)
    assert not q.is_contiguous() and can_use_qk_rmsnorm_across_heads_rope(**c)
    assert_bitwise_equal(qk_rmsnorm_across_heads_rope(**c)[0], _sim(c)[0])


def test_nan_inf():
    a = _make(1, 3, 2, 16, seed=9)
    a["q"][0, 0, 3] = float("nan")
    a["q"][0, 1, :] = float("inf")
    a["k"][0, 2, 5] = float("-inf")
    for o, s in zip(qk_rmsnorm_across_heads_rope(**a), _sim(a)):
        assert_bitwise_equal(o, s)


def test_matches_cpu_reference_closely():
    a = _make(2, 3, 4, 32, seed=3)
    for o, r in zip(qk_rmsnorm_across_heads_rope(**a), reference.qk_rmsnorm_across_heads_rope(**a)):
        torch.testing.assert_close(o.float(), r.float(), rtol=1.6e-2, atol=1.6e-2)


def test_close_variant_is_closer_to_fp64():
    a = _make(2, 6, 4, 32, seed=13)
    ex, cl, r64 = qk_rmsnorm_across_heads_rope(**a), qk_rmsnorm_across_heads_rope_fp32(**a), \
        exact.qk_rmsnorm_across_heads_rope_fp64(**a)
    for e, c, r in zip(ex, cl, r64):
        assert not torch.equal(e.view(torch.int16), c.view(torch.int16))
        assert (c.double() - r).pow(2).mean() <= (e.double() - r).pow(2).mean() * 1.05


@pytest.mark.parametrize("case", ["odd_head_dim", "heads_not_dividing", "width_not_4", "weight_dtype",
                                  "freqs_shape", "misaligned", "q_k_shapes", "freqs_dtypes_differ"])
def test_predicate_rejects_and_kernel_raises(case):
    a = _make(1, 3, 2, 16)
    if case == "odd_head_dim":
        a.update(q=torch.randn(1, 3, 30).bfloat16(), k=torch.randn(1, 3, 30).bfloat16(), q_weight=None, k_weight=None,
                 heads=2, cos=None, sin=None)
    elif case == "heads_not_dividing":
        a["heads"] = 5
    elif case == "width_not_4":
        a.update(q=torch.randn(1, 3, 6).bfloat16(), k=torch.randn(1, 3, 6).bfloat16(), q_weight=None, k_weight=None,
                 heads=3, cos=None, sin=None)
    elif case == "weight_dtype":
        a["q_weight"] = a["q_weight"].float()
    elif case == "freqs_shape":
        a["cos"] = a["cos"][0, :, 0]
    elif case == "misaligned":
        flat = torch.randn(3 * 32 + 1).bfloat16()
        a["q"] = flat[1:].view(1, 3, 32)
    elif case == "q_k_shapes":
        a["k"] = a["k"][:, :2]
    elif case == "freqs_dtypes_differ":
        a["sin"] = a["sin"].bfloat16()
    assert not can_use_qk_rmsnorm_across_heads_rope(**a)
    with pytest.raises(UnsupportedInput):
        qk_rmsnorm_across_heads_rope(**a)


def test_custom_op_fake_and_registry():
    a = _make(1, 2, 2, 16, seed=2)
    args = [a[n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin", "heads", "eps")] + [True]
    torch.library.opcheck(torch.ops.ditfuse.qk_rmsnorm_across_heads_rope.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    from ditfuse.kernels import registry

    assert registry.select("rope.qk_rmsnorm_across_heads_rope", device="cpu").load() is qk_rmsnorm_across_heads_rope


@pytest.mark.parametrize("path", ["warp", "loop"])
def test_close_variant_same_bits_every_way(path):
    """The close kernel (EXACT=False) has one recipe whichever way it walks the row: the
    warp-per-row kernel and the runtime loop give the held kernel's bits."""
    from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

    a = _make(1, 5, 4, 128, dtype=torch.bfloat16, seed=21)
    held = wr._launch_one(a["q"], a["q_weight"], a["cos"], a["sin"], 4, 1e-6, False, warp=False)
    got = wr._launch_one(a["q"], a["q_weight"], a["cos"], a["sin"], 4, 1e-6, False, **PATHS[path])
    assert_bitwise_equal(got, held)
    assert first_mismatch(held, wr._launch_one(a["q"], a["q_weight"], a["cos"], a["sin"], 4, 1e-6, True,
                                                warp=False)) is not None  # close differs from exact


@pytest.mark.parametrize("weights", ["both", "q_only", "none"])
@pytest.mark.parametrize("exact_", [True, False], ids=["exact", "close"])
@pytest.mark.parametrize("H,Dh,fdtype", [(12, 128, torch.float32), (4, 128, torch.bfloat16), (8, 64, torch.float32)],
                         ids=["D1536_fp32_freqs", "D512_bf16_freqs", "D512_Dh64"])
def test_q_and_k_in_one_launch(monkeypatch, weights, exact_, H, Dh, fdtype):
    """The public op launches q and k together where the warp-per-row kernel takes the rows:
    one launch (counted), the two single launches' bits, tail rows (7 rows at R = 4), strided k
    (a chunk of a fused projection), each of q and k with or without its own weight."""
    from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

    a = _make(1, 7, H, Dh, seed=H + Dh, fdtype=fdtype)
    kv = torch.randn(1, 7, 2 * H * Dh).to(torch.bfloat16)
    a["k"] = kv[..., : H * Dh]
    if weights != "both":
        a["k_weight"] = None
    if weights == "none":
        a["q_weight"] = None
    calls = []
    real = wr._rms_rope_warp_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(kw.get("PAIR", False))
                return real[grid](*args, **kw)
            return run

    monkeypatch.setattr(wr, "_rms_rope_warp_kernel", Spy())
    fn = qk_rmsnorm_across_heads_rope if exact_ else qk_rmsnorm_across_heads_rope_fp32
    got = fn(**a)
    assert calls == [True], calls
    single = [wr._launch_one(a[x], a[f"{x}_weight"], a["cos"], a["sin"], H, 1e-6, exact_, warp=True) for x in "qk"]
    held = [wr._launch_one(a[x], a[f"{x}_weight"], a["cos"], a["sin"], H, 1e-6, exact_, warp=False) for x in "qk"]
    assert_bitwise_equal(got, tuple(single), "pair vs single warp launches")
    assert_bitwise_equal(got, tuple(held), "pair vs 128-thread kernel")
    if exact_:
        assert_bitwise_equal(got, _sim(a), "pair vs simulation")
    b = dict(a, cos=None, sin=None)
    calls.clear()
    got = fn(**b)
    assert calls == [True]
    if exact_:
        assert_bitwise_equal(got, _sim(b), "pair without RoPE vs simulation")
