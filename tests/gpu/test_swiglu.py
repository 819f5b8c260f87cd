"""activation.swiglu on CUDA, bitwise against eager ``F.silu(a) * b`` (ditfuse.kernels.reference).

Every bf16 and fp16 bit pattern as the SiLU input (with random and special multipliers), dense and
random fp32, FLUX.2's and Z-Image's widths (18432, 10240) and odd ones, batch 1 and 2, the strided
halves of a fused projection written into a buffer slice, NaN/Inf, in place, torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal

DEV = "cuda"


@pytest.fixture(scope="module")
def k():
    from ditfuse.kernels.activation import swiglu_triton

    return swiglu_triton


def _rand(shape, dtype, scale=3.0):
    return torch.randn(shape, device=DEV).mul_(scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_bit_pattern(k, dtype):
    a = torch.arange(-32768, 32768, device=DEV, dtype=torch.int32).to(torch.int16).view(dtype)
    for name, b in (("random", _rand(a.shape, dtype, 2.0)), ("ones", torch.ones_like(a)),
                    ("1+ulp", torch.full_like(a, 1 + torch.finfo(dtype).eps)),
                    ("specials", torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0],
                                              device=DEV, dtype=dtype).repeat(a.numel() // 5 + 1)[: a.numel()])):
        assert_bitwise_equal(k.swiglu(a, b), ref.swiglu(a, b), f"swiglu all {dtype} patterns x {name}")


def test_fp32(k):
    a = torch.linspace(-100, 100, 1 << 22, device=DEV)
    b = _rand(a.shape, torch.float32, 1.0)
    assert_bitwise_equal(k.swiglu(a, b), ref.swiglu(a, b), "swiglu fp32 [-100, 100]")
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 22,), device=DEV, dtype=torch.int32).view(torch.float32)
    assert_bitwise_equal(k.swiglu(bits, b), ref.swiglu(bits, b), "swiglu fp32 random bit patterns")


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("S,I", [(4608, 18432), (4608 + 17, 10240), (17, 3077), (1, 85)])
def test_fused_projection_halves(k, B, S, I):
    """Flux2SwiGLU on the fused projection output: a = p[..., :I], b = p[..., I:]."""
    p = _rand((B, S, 2 * I), torch.bfloat16)
    p.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    assert_bitwise_equal(k.swiglu(p[..., :I], p[..., I:]), ref.swiglu_halves(p), f"swiglu halves B={B} S={S} I={I}")


@pytest.mark.parametrize("B", [1, 2])
def test_single_block_buffer(k, B):
    """FLUX.2 single block: the MLP columns of to_qkv_mlp_proj's output into the to_out buffer."""
    S, D, I = 1031, 512, 1536
    proj = _rand((B, S, 3 * D + 2 * I), torch.bfloat16)
    mlp = proj[..., 3 * D:]
    attn = _rand((B, S, D), torch.bfloat16)
    buf = torch.empty(B, S, D + I, device=DEV, dtype=torch.bfloat16)
    buf[..., :D].copy_(attn)
    k.swiglu(mlp[..., :I], mlp[..., I:], out=buf[..., D:])
    assert_bitwise_equal(buf, torch.cat([attn, ref.swiglu_halves(mlp)], dim=-1), "swiglu into the joint buffer")


def test_in_place_and_fp16(k):
    a, b = _rand((2, 333, 1000), torch.float16), _rand((2, 333, 1000), torch.float16, 1.0)
    expect = ref.swiglu(a, b)
    k.swiglu(a, b, out=a)
    assert_bitwise_equal(a, expect, "swiglu in place fp16")


def test_under_torch_compile(k):
    p = _rand((2, 64, 512), torch.bfloat16)

    def fused(p):
        buf = torch.empty(2, 64, 384, device=DEV, dtype=torch.bfloat16)
        buf[..., :128].copy_(p[..., :128])
        k.swiglu(p[..., :256], p[..., 256:], out=buf[..., 128:])
        return buf

    got = torch.compile(fused, fullgraph=True)(p)
    assert_bitwise_equal(got, torch.cat([p[..., :128], ref.swiglu_halves(p)], dim=-1), "compiled swiglu")


@pytest.mark.parametrize("B", [1, 2])
def test_swiglu_cat(k, B):
    """activation.swiglu_cat: FLUX.2's to_out input in one kernel (the attention copied, the SwiGLU
    of the MLP columns of to_qkv_mlp_proj's output), bitwise equal to eager's SwiGLU + cat, at the
    FLUX.2-dev width and an odd token count, with NaN payloads in the attention half."""
    S, D, I = 1031, 6144, 18432
    proj = _rand((B, S, 3 * D + 2 * I), torch.bfloat16)
    mlp = proj[..., 3 * D:]
    attn = _rand((B, S, D), torch.bfloat16)
    attn.view(torch.int16).view(-1)[:2] = torch.tensor([0x7F81, -0x0081], dtype=torch.int16, device=DEV)
    assert k.can_use_swiglu_cat(attn, mlp[..., :I], mlp[..., I:])
    got = k.swiglu_cat(attn, mlp[..., :I], mlp[..., I:])
    exp = torch.cat([attn, ref.swiglu_halves(mlp)], dim=-1)
    assert_bitwise_equal(got, exp, "swiglu + cat")
    assert torch.equal(got.view(torch.int16), exp.view(torch.int16)), "NaN payloads of the attention half"
