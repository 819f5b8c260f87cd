"""layout.upsample_nearest2x vs eager WanUpsample on CUDA, bitwise, at the Wan 2.1 decoder's
480x832 upsample shapes and with NaN payloads, -0, Inf and subnormals (the cast back is the
inline-PTX ``cvt.rn`` c10 runs: this is where its NaN bits are checked)."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.layout import upsample_nearest_triton as up

# WanResample inputs of one later chunk [b*t, C, H, W]: up_blocks 0, 1 (upsample3d), 2 (upsample2d)
SHAPES = [(2, 384, 60, 104), (4, 384, 120, 208), (4, 192, 240, 416), (1, 40, 3, 7)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_eager(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    failures = []
    for shape in SHAPES:
        x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
        bits = {torch.bfloat16: [0x7FC1, 0xFFA5, 0x7F81, 0x8000, 0x0001, 0x7F80],  # NaN payloads, -0, subnormal, Inf
                torch.float16: [0x7E01, 0xFD05, 0x7C01, 0x8000, 0x0001, 0x7C00]}.get(dtype)
        if bits is not None:
            x.view(torch.int16).view(-1)[: len(bits)] = torch.tensor([b - 65536 if b > 32767 else b for b in bits],
                                                                     dtype=torch.int16, device="cuda")
        x = x.contiguous(memory_format=torch.channels_last)
        assert up.can_use_upsample_nearest2x(x)
        got, exp = up.upsample_nearest2x(x), ref.wan_upsample(x)
        assert got.stride() == exp.stride(), (got.stride(), exp.stride())
        mm = compare_outputs(got, exp, f"{list(shape)} {dtype}")
        if mm:
            failures.append(str(mm))
        if not torch.equal(got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)):
            failures.append(f"{list(shape)} {dtype}: bit patterns differ (NaN payloads?)")
        del x, got, exp
    assert not failures, "\n".join(failures)


# AutoencoderKL's Upsample2D inputs in the channels-last (quality="high") decode at 1024x1024,
# batch 2, and odd sizes
KL_SHAPES = [(1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512), (2, 512, 64, 64), (1, 40, 3, 7)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_upsample_nearest2d_matches_eager(dtype):
    """layout.upsample_nearest2d (diffusers' Upsample2D: F.interpolate nearest x2 on the input's
    dtype, no round trip) vs eager on channels-last x: a bit copy, NaN payloads kept."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    failures = []
    for shape in KL_SHAPES:
        x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
        if dtype != torch.float32:
            x.view(torch.int16).view(-1)[:3] = torch.tensor([0x7FC1, -91, 1], dtype=torch.int16, device="cuda")
        x = x.contiguous(memory_format=torch.channels_last)
        got, exp = up.upsample_nearest2d(x), ref.upsample_nearest2d(x)
        assert got.stride() == exp.stride(), (got.stride(), exp.stride())
        if not torch.equal(got.contiguous().view(torch.uint8), exp.contiguous().view(torch.uint8)):
            failures.append(f"{list(shape)} {dtype}: bit patterns differ; {compare_outputs(got, exp)}")
        del x, got, exp
    assert not failures, "\n".join(failures)
