"""layout.upsample_nearest2x (WanUpsample on channels-last memory) under TRITON_INTERPRET=1:
bitwise against the eager chain (kernels/reference.py:wan_upsample) at awkward shapes, the
refusals. The cast back's NaN bits (inline PTX) are tests/gpu/test_upsample.py's."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.layout import upsample_nearest_triton as up

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


@pytest.mark.parametrize(
    "shape",
    [(1, 8, 1, 2), (2, 3, 5, 7), (1, 40, 3, 13), (2, 200, 2, 5), (1, 16, 2, 37)],
    ids=["1x2", "b2-c3-odd", "c40", "c200-two-channel-blocks", "w37-two-column-blocks"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_eager(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    flat = x.view(-1)
    specials = torch.tensor([-0.0, float("inf"), float("-inf"), 1e-40 if dtype == torch.float32 else 1e-7], dtype=dtype)
    flat[: min(4, flat.numel())] = specials[: min(4, flat.numel())]
    x = x.contiguous(memory_format=torch.channels_last)
    assert up.can_use_upsample_nearest2x(x)
    got = up.upsample_nearest2x(x)
    exp = ref.wan_upsample(x)
    assert got.shape == exp.shape == (shape[0], shape[1], 2 * shape[2], 2 * shape[3])
    assert got.is_contiguous(memory_format=torch.channels_last) or got.is_contiguous()
    assert got.stride() == exp.stride()
    mm = compare_outputs(got, exp, f"upsample {shape} {dtype}")
    assert mm is None, str(mm)


def test_refusals():
    x = torch.randn(1, 8, 3, 4, dtype=torch.bfloat16)
    one = torch.randn(1, 8, 1, 1, dtype=torch.bfloat16)  # channels-last and contiguous: eager writes NCHW
    odd = torch.randn(1, 3, 4, 8, dtype=torch.bfloat16).permute(0, 2, 3, 1).as_strided((1, 8, 3, 4), (8, 1, 32, 8))
    assert odd.is_contiguous(memory_format=torch.channels_last)  # size-1 batch, stride 8: eager writes NCHW
    for bad in (x, one, odd, x.contiguous(memory_format=torch.channels_last)[:, :, :, ::2], x.unsqueeze(2),
                x.int().contiguous(memory_format=torch.channels_last)):
        assert not up.can_use_upsample_nearest2x(bad)
        with pytest.raises(UnsupportedInput):
            up.upsample_nearest2x(bad)
