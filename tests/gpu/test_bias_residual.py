"""modulate.bias_residual on CUDA, bitwise against eager's two passes (a cuDNN convolution's bias
``add_`` and the residual ``+``), at the Wan decoder's channels-last shapes and odd ones, bf16 /
fp16 / fp32, NaN/Inf; and the real convolution: ``conv3d(x, w, None)`` then this op equals
``conv3d(x, w, b) + h`` as aten runs it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.modulate import bias_residual_triton as br

DEV = "cuda"


@pytest.mark.parametrize("shape", [(1, 96, 4, 480, 832), (1, 384, 1, 60, 104), (2, 13, 3, 7, 5), (3, 7, 11, 13)],
                         ids=["wan-full", "wan-mid", "b2-odd", "4d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_eager(shape, dtype):
    fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(shape, device=DEV, generator=g) * 3).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], device=DEV).to(dtype)
    x = x.contiguous(memory_format=fmt)
    h = (torch.randn(shape, device=DEV, generator=g) * 3).to(dtype).contiguous(memory_format=fmt)
    b = torch.randn(shape[1], device=DEV, generator=g).to(dtype)
    assert br.can_use_bias_residual(x, b, h)
    assert_bitwise_equal(br.bias_residual(x, b, h), ref.bias_residual(x, b, h), f"{shape} {dtype}")


def test_equals_conv_with_bias_then_residual():
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(1, 96, 3, 34, 42, device=DEV, generator=g).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    w = (torch.randn(96, 96, 3, 3, 3, device=DEV, generator=g) * 0.05).to(torch.bfloat16)
    w = w.contiguous(memory_format=torch.channels_last_3d)
    b = torch.randn(96, device=DEV, generator=g).to(torch.bfloat16)
    h = torch.randn(1, 96, 1, 32, 40, device=DEV, generator=g).to(torch.bfloat16)
    h = h.contiguous(memory_format=torch.channels_last_3d)
    eager = F.conv3d(x, w, b) + h
    assert_bitwise_equal(br.bias_residual(F.conv3d(x, w, None), b, h), eager, "conv bias deferred")
