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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("b,h,s,d", [(1, 38, 4429, 64), (2, 38, 4429, 64), (2, 24, 4173, 64), (1, 24, 4096, 64),
                                     (3, 5, 2, 96), (1, 7, 1031, 40)])
def test_heads_to_tokens_matches_eager(dtype, b, h, s, d):
    """SDPA's heads-first output back in token rows: SD3.5-large (38 x 64, 4096 + 333 tokens),
    SD3.5-medium's attn (24 x 64, 4096 + 77) and its text-free attn2, odd sizes, NaN/Inf payloads."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = (torch.randn(b, h, s, d, generator=gen, device="cuda") * 2).to(dtype)
    if dtype != torch.float32:
        pat = torch.tensor([0x7FC1, -0x005B, 0x7F80, -0x8000, 0x0001], dtype=torch.int16, device="cuda")
        x.view(torch.int16)[0, 0, 0, : len(pat)] = pat
        x.view(torch.int16)[-1, -1, -1, : len(pat)] = pat
    assert hc.can_use_heads_to_tokens(x)
    got, exp = hc.heads_to_tokens(x), ref.heads_to_tokens(x)
    assert exp.data_ptr() != x.data_ptr()
    assert got.stride() == exp.stride(), (got.stride(), exp.stride())
    mm = compare_outputs(got, exp, f"heads_to_tokens {b}x{h}x{s}x{d} {dtype}")
    assert mm is None, str(mm)
    assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), "bit patterns differ (NaN payloads?)"


def test_heads_to_tokens_of_sdpa_output():
    """On what SDPA really returns for SD3.5-large's joint q / k / v (contiguous [1, 38, 4429, 64]):
    the op must take it (heads-first), and the copy must equal the processor's transpose + reshape."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, 38, 4429, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert hc.can_use_heads_to_tokens(o), f"SDPA output strides {o.stride()}: not heads-first"
    got, exp = hc.heads_to_tokens(o), ref.heads_to_tokens(o)
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
