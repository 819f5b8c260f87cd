"""rope.qk_rmsnorm_across_heads_rope (Wan) on CUDA: bitwise equal to the eager chain
(``torch.nn.RMSNorm(H * Dh)``'s fused kernel, the head split, diffusers' Wan RoPE) at Wan widths
(1536, 3072, 5120: 3 to 10 vectors per thread), video token counts, fp32 and bf16 rotary tables,
batch 1 and 2 (CFG), strided qkv chunks, NaN/Inf; and through diffusers' own WanAttnProcessor."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.rope.qk_rmsnorm_across_heads_rope_triton import (
    can_use_qk_rmsnorm_across_heads_rope,
    qk_rmsnorm_across_heads_rope,
    qk_rmsnorm_across_heads_rope_fp32,
)

DEV = "cuda"


def _freqs(S, Dh, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 1024, (S,), generator=g).double()
    freqs = 1.0 / (10000.0 ** (torch.arange(0, Dh, 2).double() / Dh))
    ang = pos[:, None] * freqs[None, :]
    cos = ang.cos().repeat_interleave(2, dim=1).float()[None, :, None, :]
    sin = ang.sin().repeat_interleave(2, dim=1).float()[None, :, None, :]
    return cos.to(DEV, dtype), sin.to(DEV, dtype)


def _make(B, S, H, Dh=128, dtype=torch.bfloat16, fdtype=torch.float32, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    D = H * Dh

    def rnd(*shape):
        scale = torch.exp(torch.randn(*shape[:-1], 1, device=DEV, generator=g))  # rows over several binades
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(dtype)

    w = lambda: (1 + 0.3 * torch.randn(D, device=DEV, generator=g)).to(dtype)  # noqa: E731
    cos, sin = _freqs(S, Dh, fdtype, seed)
    return dict(q=rnd(B, S, D), k=rnd(B, S, D), q_weight=w(), k_weight=w(), cos=cos, sin=sin, heads=H, eps=1e-6)


def _failures(args, label):
    assert can_use_qk_rmsnorm_across_heads_rope(**args), label
    got = qk_rmsnorm_across_heads_rope(**args)
    exp = reference.qk_rmsnorm_across_heads_rope(**args)
    mm = compare_outputs(got, exp, label)
    return [] if mm is None else [str(mm)]


@pytest.mark.parametrize("row_kernel", ["block", "warp"])
def test_sweep(row_kernel, monkeypatch):
    """The public op at Wan widths (1536, 3072: whole steps; 5120), token counts 1 / 1560 / 32760,
    B = 1 / 2, fp32 and bf16 freqs, under both row-kernel families (DITFUSE_ROW_KERNEL)."""
    monkeypatch.setenv("DITFUSE_ROW_KERNEL", row_kernel)
    failures = []
    for H in (12, 24, 40):
        for S in (1, 1560, 32760):
            for B in (1, 2):
                if H == 40 and S * B > 32760:
                    continue
                for fdtype in (torch.float32, torch.bfloat16):
                    label = f"H={H} D={H * 128} S={S} B={B} freqs {fdtype}"
                    failures += _failures(_make(B, S, H, fdtype=fdtype, seed=H + S + B), label)
        torch.cuda.empty_cache()
    assert not failures, "\n".join(failures[:12]) + f"\n({len(failures)} failing cases)"


def test_warp_held_rows_and_runtime_loop():
    """Every way over a row at every tiling, 2051 tokens (tail rows): the warp-per-row kernel
    (default for whole steps up to D = 3072; forced at 5120, 10 held steps), the 128-thread kernel
    with held tiles (default for partial steps) and its runtime loop (default beyond 3072). D =
    1536 (3 whole steps), 5120 (10) and 1020 (a partial step: predicated loads) with head_dim 102,
    whose 4-element vectors straddle heads; fp32 rows too (their squares round: order shows)."""
    from ditfuse.kernels.common import warp as cw
    from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

    failures = []
    for H, Dh, dtype in ((12, 128, torch.bfloat16), (12, 128, torch.float32), (40, 128, torch.bfloat16),
                         (10, 102, torch.bfloat16)):
        a = _make(2, 2051, H, Dh, dtype=dtype, seed=H)
        exp = reference.qk_rmsnorm_across_heads_rope(**a)[0]
        paths = {"held": dict(warp=False), "loop": dict(unroll=False)}
        if (H * Dh) % 512 == 0:
            paths["warp"] = dict(warp=True)
        for path, kw in paths.items():
            for R in (1, 2, 4):
                got = wr._launch_one(a["q"], a["q_weight"], a["cos"], a["sin"], H, 1e-6, True, rows_per_program=R,
                                     **kw)
                mm = compare_outputs(got, exp, f"H={H} Dh={Dh} {dtype} {path} R={R}")
                if mm is not None:
                    failures.append(str(mm))
    refused = {k: v for k, v in cw._VERDICTS.items() if v}
    assert not refused, f"the layout guard refused warp-per-row binaries: {refused}"
    assert not failures, "\n".join(failures)


def test_other_dtypes_and_head_dims():
    failures = []
    for dtype in (torch.float16, torch.float32):
        failures += _failures(_make(2, 1560, 12, dtype=dtype, seed=3), f"{dtype}")
    for Dh, H in ((64, 8), (96, 4), (256, 6)):
        failures += _failures(_make(1, 777, H, Dh=Dh, seed=Dh), f"Dh={Dh} H={H}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("row_kernel", ["block", "warp"])
def test_strided_chunks_no_weights_no_rope_nan_inf(row_kernel, monkeypatch):
    monkeypatch.setenv("DITFUSE_ROW_KERNEL", row_kernel)
    a = _make(2, 1560, 12, seed=5)
    qkv = torch.randn(2, 1560, 3 * 1536, device=DEV).to(torch.bfloat16)
    q, k, _ = qkv.chunk(3, dim=-1)
    failures = _failures(dict(a, q=q, k=k), "qkv chunks")
    failures += _failures(dict(a, q_weight=None, k_weight=None), "no weights")
    failures += _failures(dict(a, cos=None, sin=None), "no rope")
    b = _make(1, 64, 12, seed=6)
    b["q"][0, 0, 3] = float("nan")
    b["q"][0, 1, :] = float("inf")
    b["k"][0, 2, 5] = float("-inf")
    b["k"][0, 3, :] = 0.0
    failures += _failures(b, "nan/inf/zero rows")
    assert not failures, "\n".join(failures)


def test_through_wan_attention_module():
    """diffusers' WanAttention (to_q/k/v, norm_q/norm_k, WanAttnProcessor's RoPE) vs the
    ditfuse fast forward, both load paths of the rotary tables."""
    import ditfuse
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    torch.manual_seed(0)
    failures = []
    for fdtype in (torch.float32, torch.bfloat16):
        attn = WanAttention(1536, heads=12, dim_head=128, eps=1e-6, processor=WanAttnProcessor()).to(
            DEV, torch.bfloat16).eval()
        x = torch.randn(2, 1560, 1536, device=DEV).to(torch.bfloat16)
        rot = _freqs(1560, 128, fdtype, 1)
        with torch.no_grad():
            base = attn(x, None, None, rot)
            h = ditfuse.accelerate(attn)
            try:
                got = attn(x, None, None, rot)
            finally:
                h.unmount()
        mm = compare_outputs(got, base, f"WanAttention freqs {fdtype}")
        if mm is not None:
            failures.append(str(mm))
    assert not failures, "\n".join(failures)


def test_close_variant_runs_and_stays_close():
    a = _make(1, 1560, 12, seed=8)
    for e, c in zip(qk_rmsnorm_across_heads_rope(**a), qk_rmsnorm_across_heads_rope_fp32(**a)):
        assert not torch.equal(e.view(torch.int16), c.view(torch.int16))
        torch.testing.assert_close(c.float(), e.float(), rtol=2e-2, atol=2e-2)


def test_under_torch_compile():
    a = _make(1, 64, 12, seed=9)
    fn = torch.compile(lambda q, k: qk_rmsnorm_across_heads_rope(q, k, a["q_weight"], a["k_weight"], a["cos"],
                                                                 a["sin"], 12, 1e-6), fullgraph=True)
    mm = compare_outputs(fn(a["q"], a["k"]), reference.qk_rmsnorm_across_heads_rope(**a))
    assert mm is None, str(mm)
