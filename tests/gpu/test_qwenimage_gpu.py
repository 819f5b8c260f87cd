"""Qwen-Image adapter on CUDA: accelerated QwenImageTransformer2DModel bitwise equal to plain
diffusers, fast path engaged (every op verified, nothing fell back, kernels ran).

Configs: the tiny one, and Qwen-Image width (3072 = 24 x 128, FF 12288, text width 3584) with 2
blocks. 1024² (4096 image tokens) and an odd 336x208 (273); text 512 and 77 (not multiples of
64; the prompt's real length in the pipeline); batch 1 and 2 (CFG)."""

import pytest

from ditfuse.models import families
from ditfuse.models.qwenimage import ADAPTER
from tests.support.engaged import compare_accelerated

DEV = "cuda"
QWEN = families.get("qwenimage")


def _run(config, batch, size, layers=None, txt=512):
    m = QWEN.build(config, layers, device=DEV)
    inp = QWEN.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"qwenimage {config} B={batch} {size} txt={txt}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["64x48", "336x208"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=37)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("336x208", 77)], ids=["1024px", "odd"])
def test_qwen_image_width(batch, size, txt):
    _run("dev", batch, size, layers=(2,), txt=txt)
