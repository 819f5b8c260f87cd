"""Chroma adapter on CUDA: accelerated ChromaTransformer2DModel bitwise equal to plain diffusers,
fast path engaged (every op verified, nothing fell back, kernels ran).

Configs: the tiny one, and Chroma1-HD width (3072 = 24 x 128, T5 width 4096) with 1 dual + 1
single block. 1024² (4096 image tokens) and an odd 336x208 (273); text 512 (the pipeline's
padding, with a masked tail per prompt) and 77; batch 1 and 2. The lossless CUDA graph: captured
once (the timestep embedder's guidance rows kept on the device, no host copy inside capture) and
replayed bitwise, also for new inputs of the same shapes."""

import pytest

from ditfuse.models import families
from ditfuse.models.chroma import ADAPTER
from tests.support.engaged import compare_accelerated, compare_cuda_graph

DEV = "cuda"
CHROMA = families.get("chroma")


def _run(config, batch, size, layers=None, txt=512):
    m = CHROMA.build(config, layers, device=DEV)
    inp = CHROMA.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"chroma {config} B={batch} {size} txt={txt}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["64x48", "336x208"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=37)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("336x208", 77)], ids=["1024px", "odd"])
def test_chroma_width(batch, size, txt):
    _run("dev", batch, size, layers=(1, 1), txt=txt)


@pytest.mark.parametrize("batch", [1, 2])
def test_cuda_graph_replays_bitwise(batch):
    m = CHROMA.build("dev", (1, 1), device=DEV, load="pretrained")
    inp = CHROMA.make_inputs(m, batch, "512x512", device=DEV, txt_tokens=512)
    inp2 = CHROMA.make_inputs(m, batch, "512x512", device=DEV, txt_tokens=512, seed=7)
    compare_cuda_graph(m, inp, inp2, f"chroma B={batch}")
