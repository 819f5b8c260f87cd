"""modulate.bias_residual under TRITON_INTERPRET=1, bitwise against its reference (which is eager's
two adds), on channels-last 5-D/4-D and [N, C] tensors with awkward sizes, NaN/Inf and -0."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import bias_residual_triton as br

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("shape", [(1, 96, 2, 3, 5), (2, 7, 1, 4, 3), (3, 13, 5, 7), (5, 17)],
                         ids=["5d", "5d-b2-odd", "4d-prime", "2d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_eager_adds(shape, dtype):
    fmt = {5: torch.channels_last_3d, 4: torch.channels_last}.get(len(shape), torch.contiguous_format)
    x = _rand(shape, dtype, 1)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 65000.0]).to(dtype)
    x = x.contiguous(memory_format=fmt)
    h = _rand(shape, dtype, 2).contiguous(memory_format=fmt)
    b = _rand((shape[1],), dtype, 3)
    assert br.can_use_bias_residual(x, b, h)
    got = br.bias_residual(x, b, h)
    assert got.stride() == x.stride()
    mm = compare_outputs(got, ref.bias_residual(x, b, h), f"{shape} {dtype}")
    assert mm is None, str(mm)


def test_rejections():
    x = _rand((1, 8, 2, 3, 4), torch.bfloat16, 4).contiguous(memory_format=torch.channels_last_3d)
    b = _rand((8,), torch.bfloat16, 5)
    assert br.can_use_bias_residual(x, b, x)
    for args in ((x.contiguous(), b, x.contiguous()),  # NCDHW: channels not innermost
                 (x, b, x.contiguous()),  # h in another layout
                 (x, b.float(), x),  # dtype mix: eager would promote
                 (x, b[:4], x)):
        assert not br.can_use_bias_residual(*args)
