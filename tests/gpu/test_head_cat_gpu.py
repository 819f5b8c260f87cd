"""layout.head_cat vs eager ``torch.cat([v, v_txt], dim=2)`` on CUDA, bitwise and in eager's
layout: SD3.5-large's joint value (38 heads x 64, 4096 image + 333 text tokens, batch 1 and 2),
SD3.5-medium's (24 x 64), odd sizes, and NaN/Inf payloads (a copy must move every bit)."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.layout import head_cat_triton as hc


def _proj(b, s, h, d, dtype, gen):
    return (torch.randn(b, s, h * d, generator=gen, device="cuda") * 2).to(dtype).view(b, s, h, d).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("b,h,sa,sb,d", [(1, 38, 4096, 333, 64), (2, 38, 4096, 333, 64), (2, 24, 4096, 77, 64),
                                         (1, 38, 273, 77, 64), (3, 5, 1, 1, 96), (1, 7, 1031, 13, 40)])
def test_matches_eager(dtype, b, h, sa, sb, d):
    gen = torch.Generator(device="cuda").manual_seed(5)
    a, t = _proj(b, sa, h, d, dtype, gen), _proj(b, sb, h, d, dtype, gen)
    if dtype != torch.float32:
        pat = torch.tensor([0x7FC1, -0x005B, 0x7F80, -0x8000, 0x0001], dtype=torch.int16, device="cuda")
        a.view(torch.int16)[0, 0, 0, : len(pat)] = pat
        t.view(torch.int16)[-1, -1, -1, : len(pat)] = pat
    assert hc.can_use_head_cat(a, t)
    got, exp = hc.head_cat(a, t), ref.head_cat(a, t)
    assert got.stride() == exp.stride(), (got.stride(), exp.stride())
    mm = compare_outputs(got, exp, f"head_cat {b}x{h}x({sa}+{sb})x{d} {dtype}")
    assert mm is None, str(mm)
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), "bit patterns differ (NaN payloads?)"
