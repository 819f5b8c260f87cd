"""HunyuanVideo (1.0) on CUDA: the accelerated HunyuanVideoTransformer3DModel bitwise equal to
plain diffusers, every op verified, nothing fallen back, the kernels run, the blocks hand off.

Configs: the tiny one (2 dual + 3 single blocks) and HunyuanVideo width (3072 = 24 x 128, FF
12288, text width 4096) with 1 dual + 1 single block (no hand-off at that depth: checked on the
tiny model); a 480p 33-frame clip (9 x 30 x 53 = 14310 video tokens) and an odd 208x144x5 one
(2 x 9 x 13 = 234 tokens); 256 and 77 text tokens with per-sample right padding; batch 1 and 2.
The single blocks' QK chain runs ``rope.qk_rmsnorm_diffusers_rope_joint`` (the joint q / k
normalised as one tensor, the video rows rotated): ``test_joint_qk_norm_rope`` against diffusers'
modules; the img-first op's norm-only form over joint rows: ``test_joint_qk_norm``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

DEV = "cuda"


def _run(config, batch, size, txt, handoff):
    from ditfuse.models import families
    from ditfuse.models.hunyuanvideo import ADAPTER
    from tests.support.engaged import compare_accelerated, handoff_counts_after

    fam = families.get("hunyuanvideo")
    fam = dataclasses.replace(fam, configs={**fam.configs,
                                            "dev_small": dict(fam.config("dev"), num_layers=1, num_single_layers=1)})
    m = fam.build(config, device=DEV)
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"hunyuanvideo {config} B={batch} {size} txt={txt}")
    if handoff:
        counts = handoff_counts_after(m, inp)  # both chains hand off
        assert counts["used"] >= 3 and counts["discarded"] == 0, counts


@pytest.mark.parametrize("batch", [1, 2])
def test_tiny(batch):
    _run("tiny", batch, "208x144x5", 29, handoff=True)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("848x480x33", 256), ("208x144x5", 77)], ids=["480p", "odd"])
def test_hunyuanvideo_width(batch, size, txt):
    _run("dev_small", batch, size, txt, handoff=False)


# (B, S_joint, H, D): 480p x 33 + 256 text tokens, the odd clip + 77, few rows
JOINT_SHAPES = [(1, 14310 + 256, 24, 128), (2, 14310 + 256, 24, 128), (2, 234 + 77, 24, 128), (1, 3, 2, 16)]


@pytest.mark.parametrize("B,S,H,D", JOINT_SHAPES, ids=[f"{b}x{s}x{h}x{d}" for b, s, h, d in JOINT_SHAPES])
def test_joint_qk_norm(B, S, H, D):
    """rope.qk_rmsnorm_diffusers_rope_img_first without text inputs and RoPE == diffusers' RMSNorm
    on the single block's joint q and k (unflattened from the projection), bitwise, bf16 / fp16 /
    fp32."""
    from diffusers.models.normalization import RMSNorm

    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk

    g = torch.Generator(device=DEV).manual_seed(B * 131 + S + D)
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        norm_q, norm_k = (RMSNorm(D, eps=1e-6).to(DEV, dtype) for _ in range(2))
        with torch.no_grad():
            for n in (norm_q, norm_k):
                n.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, device=DEV))
            q, k = (torch.randn(B, S, H * D, generator=g, device=DEV).to(dtype).unflatten(2, (H, -1)) for _ in range(2))
            got = qk.qk_rmsnorm_diffusers_rope_img_first(q, k, norm_q.weight, norm_k.weight, None, None, 1e-6)
            exp = (norm_q(q), norm_k(k))
        for name, a, b in zip("qk", got, exp):
            mm = compare_outputs(a, b, f"{name} [{B},{S},{H},{D}] {dtype}")
            if mm:
                failures.append(str(mm))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("B,S,H,D", JOINT_SHAPES, ids=[f"{b}x{s}x{h}x{d}" for b, s, h, d in JOINT_SHAPES])
def test_joint_qk_norm_rope(B, S, H, D):
    """rope.qk_rmsnorm_diffusers_rope_joint == the single block's eager chain (diffusers' RMSNorm
    modules on the joint q / k, apply_rotary_emb on the video rows, the cat), bitwise, bf16 / fp16
    / fp32, with signed zeros and a NaN in the text rows."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm

    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk

    n_txt = {14310 + 256: 256, 234 + 77: 77}.get(S, 1)
    g = torch.Generator(device=DEV).manual_seed(B * 17 + S + D)
    ang = torch.randn(S - n_txt, D // 2, generator=g, device=DEV) * 3
    emb = (torch.cos(ang).repeat_interleave(2, dim=1), torch.sin(ang).repeat_interleave(2, dim=1))
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        norm_q, norm_k = (RMSNorm(D, eps=1e-6).to(DEV, dtype) for _ in range(2))
        with torch.no_grad():
            for n in (norm_q, norm_k):
                n.weight.copy_(1 + 0.3 * torch.randn(D, generator=g, device=DEV))
            q, k = (torch.randn(B, S, H * D, generator=g, device=DEV).to(dtype).unflatten(2, (H, -1)) for _ in range(2))
            q[:, -1, 0] = -0.0
            k[:, S - n_txt, -1, 1] = float("nan")
            got = qk.qk_rmsnorm_diffusers_rope_joint(q, k, norm_q.weight, norm_k.weight, emb[0], emb[1], 1e-6, n_txt)
            nq, nk = norm_q(q), norm_k(k)
            exp = (torch.cat([apply_rotary_emb(nq[:, :-n_txt], emb, sequence_dim=1), nq[:, -n_txt:]], dim=1),
                   torch.cat([apply_rotary_emb(nk[:, :-n_txt], emb, sequence_dim=1), nk[:, -n_txt:]], dim=1))
        for name, a, b in zip("qk", got, exp):
            mm = compare_outputs(a, b, f"{name} [{B},{S},{H},{D}] n_txt={n_txt} {dtype}")
            if mm:
                failures.append(str(mm))
    assert not failures, "\n".join(failures)
