"""layout.head_cat (kernels/layout/head_cat_triton.py) under the Triton interpreter: SD3's joint
value ``torch.cat([v, v_txt], dim=2)`` of two transposed [B, H, S, D] views as one copy pass.
A copy has no arithmetic: every case must give eager's bits (NaN payloads too) and eager's
contiguous layout. The GPU test (tests/gpu/test_head_cat_gpu.py) checks the same on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.layout import head_cat_triton as hc


def _proj(b, s, h, d, dtype, seed):
    """A projection's output [B, S, H*D] viewed as SD3 does: ``.view(B, S, H, D).transpose(1, 2)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h * d, generator=g).to(dtype).view(b, s, h, d).transpose(1, 2)


def _check(a, b):
    got = hc.head_cat(a, b)
    want = ref.head_cat(a, b)
    assert_bitwise_equal(got, want, "head_cat")
    assert got.stride() == want.stride(), (got.stride(), want.stride())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,h,sa,sb,d", [
    (1, 1, 1, 1, 1),        # every size 1
    (1, 3, 7, 13, 48),      # primes, a non-power-of-two head
    (2, 2, 65, 5, 64),      # CFG batch, one row past a 64-row block
    (1, 2, 64, 64, 96),     # whole blocks, non-power-of-two head
    (2, 1, 3, 130, 16),     # the text longer than the image
    (1, 2, 9, 4, 300),      # a head wider than one 256 column block
])
def test_transposed_views_bitwise(dtype, b, h, sa, sb, d):
    _check(_proj(b, sa, h, d, dtype, 1), _proj(b, sb, h, d, dtype, 2))


@pytest.mark.parametrize("case", ["contiguous", "mixed layouts", "sliced", "empty text", "empty image"])
def test_other_strides(case):
    a, b = _proj(2, 11, 3, 32, torch.bfloat16, 3), _proj(2, 6, 3, 32, torch.bfloat16, 4)
    if case == "contiguous":
        a, b = a.contiguous(), b.contiguous()
    elif case == "mixed layouts":
        b = b.contiguous()
    elif case == "sliced":  # every other token of a longer projection: a stride of its own
        a = _proj(2, 22, 3, 32, torch.bfloat16, 5)[:, :, ::2]
    elif case == "empty text":
        b = b[:, :, :0]
    elif case == "empty image":
        a = a[:, :, :0]
    _check(a, b)


def test_nan_inf_payloads_copied():
    a, b = _proj(1, 9, 2, 16, torch.bfloat16, 6), _proj(1, 4, 2, 16, torch.bfloat16, 7)
    bits = a.view(torch.int16)
    bits[0, 0, 0, :4] = torch.tensor([0x7FC1, -0x0001, 0x7F80, -0x0080], dtype=torch.int16)  # NaNs, +-Inf
    b[0, 1, 3, 5] = float("nan")
    got, want = hc.head_cat(a, b), ref.head_cat(a, b)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case", ["3-D", "head mismatch", "dim mismatch", "mixed dtypes", "int dtype",
                                  "strided head dim", "channels-last", "grad"])
def test_rejections(case):
    a, b = _proj(1, 5, 2, 8, torch.float32, 8), _proj(1, 3, 2, 8, torch.float32, 9)
    if case == "3-D":
        a = a[0]
    elif case == "head mismatch":
        b = _proj(1, 3, 4, 8, torch.float32, 9)
    elif case == "dim mismatch":
        b = _proj(1, 3, 2, 16, torch.float32, 9)
    elif case == "mixed dtypes":
        b = b.to(torch.bfloat16)
    elif case == "int dtype":
        a, b = a.to(torch.int32), b.to(torch.int32)
    elif case == "strided head dim":
        a = _proj(1, 5, 2, 16, torch.float32, 8)[..., ::2]
    elif case == "channels-last":
        # D = 1: the head dim is trivially contiguous, but eager's cat writes channels-last
        a = torch.randn(1, 2, 5, 1).contiguous(memory_format=torch.channels_last)
        b = torch.randn(1, 2, 3, 1).contiguous(memory_format=torch.channels_last)
        assert ref.head_cat(a, b).is_contiguous(memory_format=torch.channels_last)
    elif case == "grad":
        a.requires_grad_(True)
    assert not hc.can_use_head_cat(a, b)
    with pytest.raises(UnsupportedInput):
        with torch.enable_grad():
            hc.head_cat(a, b)


# -- layout.heads_to_tokens: SDPA's heads-first output back in token rows (the same kernel) ------


def _heads_first(b, h, s, d, dtype, seed):
    """SDPA's output: a contiguous [B, H, S, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g).to(dtype)


def _check_tokens(x):
    got = hc.heads_to_tokens(x)
    want = ref.heads_to_tokens(x)
    assert want.data_ptr() != x.data_ptr(), "eager's reshape was a view: not a case for the op"
    assert_bitwise_equal(got, want, "heads_to_tokens")
    assert got.stride() == want.stride(), (got.stride(), want.stride())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("b,h,s,d", [
    (1, 2, 2, 2),           # the smallest shape eager copies (one token merges as a view)
    (1, 3, 13, 48),         # primes, a non-power-of-two head
    (2, 5, 65, 64),         # CFG batch, one row past a 64-row block
    (1, 38, 129, 64),       # SD3.5-large's heads, a prime-ish token count
    (2, 2, 9, 300),         # a head wider than one 256 column block
])
def test_heads_to_tokens_bitwise(dtype, b, h, s, d):
    _check_tokens(_heads_first(b, h, s, d, dtype, 11))


@pytest.mark.parametrize("case", ["sliced tokens", "batch-strided", "empty"])
def test_heads_to_tokens_other_strides(case):
    x = _heads_first(2, 3, 12, 32, torch.bfloat16, 12)
    if case == "sliced tokens":  # every other token: a token stride of its own
        x = x[:, :, ::2]
    elif case == "batch-strided":  # one sample of a larger batch dim (B stride > H*S*D)
        x = _heads_first(4, 3, 12, 32, torch.bfloat16, 13)[::2]
    elif case == "empty":
        x = x[:, :, :0]
    if x.numel():
        _check_tokens(x)
    else:
        got = hc.heads_to_tokens(x)
        assert got.shape == (2, 0, 96) and got.is_contiguous()


def test_heads_to_tokens_nan_inf_payloads_copied():
    x = _heads_first(1, 2, 9, 16, torch.bfloat16, 14)
    x.view(torch.int16)[0, 1, 4, :4] = torch.tensor([0x7FC1, -0x0001, 0x7F80, -0x0080], dtype=torch.int16)
    got, want = hc.heads_to_tokens(x), ref.heads_to_tokens(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("case", ["3-D", "one head", "head dim 1", "one token", "sequence-major",
                                  "strided head dim", "int dtype", "grad"])
def test_heads_to_tokens_rejections(case):
    x = _heads_first(1, 2, 5, 8, torch.float32, 15)
    if case == "3-D":
        x = x[0]
    elif case == "one head":  # eager's reshape merges a single head as a view
        x = _heads_first(1, 1, 5, 8, torch.float32, 15)
    elif case == "head dim 1":
        x = _heads_first(1, 2, 5, 1, torch.float32, 15)
    elif case == "one token":  # the head stride equals D: eager's reshape is a view
        x = _heads_first(1, 2, 1, 8, torch.float32, 15)
        assert ref.heads_to_tokens(x).data_ptr() == x.data_ptr()
    elif case == "sequence-major":  # [B, S, H, D] memory viewed heads-first: eager's reshape is a view
        x = torch.randn(1, 5, 2, 8).transpose(1, 2)
        assert ref.heads_to_tokens(x).data_ptr() == x.data_ptr()
    elif case == "strided head dim":
        x = _heads_first(1, 2, 5, 16, torch.float32, 15)[..., ::2]
    elif case == "int dtype":
        x = x.to(torch.int32)
    elif case == "grad":
        x.requires_grad_(True)
    assert not hc.can_use_heads_to_tokens(x)
    with pytest.raises(UnsupportedInput):
        with torch.enable_grad():
            hc.heads_to_tokens(x)
