"""HunyuanVideo 1.5 on CUDA: the accelerated HunyuanVideo15Transformer3DModel bitwise equal to
plain diffusers, every op verified, nothing fallen back, the kernels run, the blocks hand off.

Configs: the tiny one and HunyuanVideo 1.5 width (2048 = 16 x 128, FF 8192, text width 3584) with
3 blocks; a 480p 33-frame clip (9 x 30 x 53 = 14310 video tokens) and an odd 208x144x5 one; 256
and 77 text tokens with per-sample padding; batch 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

DEV = "cuda"


def _run(config, batch, size, txt):
    from ditfuse.models import families
    from ditfuse.models.hunyuanvideo15 import ADAPTER
    from tests.support.engaged import compare_accelerated, handoff_counts_after

    fam = families.get("hunyuanvideo15")
    fam = dataclasses.replace(fam, configs={**fam.configs, "dev_small": dict(fam.config("dev"), num_layers=3)})
    m = fam.build(config, device=DEV)
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"hunyuanvideo15 {config} B={batch} {size} txt={txt}")
    counts = handoff_counts_after(m, inp)  # the blocks hand off
    assert counts["used"] >= 2 and counts["discarded"] == 0, counts


@pytest.mark.parametrize("batch", [1, 2])
def test_tiny(batch):
    _run("tiny", batch, "208x144x5", 29)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("848x480x33", 256), ("208x144x5", 77)], ids=["480p", "odd"])
def test_hunyuanvideo15_width(batch, size, txt):
    _run("dev_small", batch, size, txt)


# (B, S_img, S_txt, H, D): 480p x 33 frames with a 256-token prompt, an odd clip, few rows, and
# D = 64 (the tile kernel)
QK_SHAPES = [(1, 14310, 256, 16, 128), (2, 14310, 256, 16, 128), (1, 273, 77, 16, 128), (2, 37, 5, 3, 128),
             (1, 1, 1, 16, 128), (2, 19, 7, 4, 64), (1, 300, 13, 2, 96)]


@pytest.mark.parametrize("B,S_img,S_txt,H,D", QK_SHAPES, ids=[f"{b}x{s}+{t}x{h}x{d}" for b, s, t, h, d in QK_SHAPES])
def test_qk_op_vs_eager(B, S_img, S_txt, H, D):
    """rope.qk_rmsnorm_diffusers_rope_img_first == the eager chain (diffusers RMSNorm, apply_rotary_emb
    on the video stream, video-first cat), bitwise, bf16 / fp16 / fp32, both kernels at D = 128,
    strided (unflattened-projection) inputs, zero rows in the text stream."""
    from ditfuse.kernels import reference as ref
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk

    g = torch.Generator(device=DEV).manual_seed(B * 131 + S_img + S_txt + D)
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        def rnd(S):
            s = torch.exp(torch.randn(B, S, H, 1, generator=g, device=DEV))
            x = torch.randn(B, S, 3 * H * D, generator=g, device=DEV).to(dtype)
            x[..., :H * D] = (x[..., :H * D].unflatten(2, (H, D)) * s).flatten(2).to(dtype)
            return x[..., :H * D].unflatten(2, (H, D))
        q, k, qt, kt = rnd(S_img), rnd(S_img), rnd(S_txt), rnd(S_txt)
        qt[:, 0] = -0.0
        ws = [(1 + 0.3 * torch.randn(D, generator=g, device=DEV)).to(dtype) for _ in range(4)]
        ang = torch.randn(S_img, D // 2, generator=g, device=DEV) * 3
        cos, sin = torch.cos(ang).repeat_interleave(2, 1), torch.sin(ang).repeat_interleave(2, 1)
        args = (q, k, ws[0], ws[1], cos, sin, 1e-6, qt, kt, ws[2], ws[3])
        exp = ref.qk_rmsnorm_diffusers_rope_img_first(*args)
        for kernel in (("lanes", "tile") if D == 128 else ("tile",)):
            got = qk._launch_img_first(*args, kernel=kernel)
            for name, a, b in zip("qk", got, exp):
                mm = compare_outputs(a, b, f"{name} {kernel} [{B},{S_img}+{S_txt},{H},{D}] {dtype}")
                if mm:
                    failures.append(str(mm))
        got = qk.qk_rmsnorm_diffusers_rope_img_first(*args)
        for name, a, b in zip("qk", got, exp):
            mm = compare_outputs(a, b, f"{name} public [{B},{S_img}+{S_txt},{H},{D}] {dtype}")
            if mm:
                failures.append(str(mm))
    assert not failures, "\n".join(failures)
