"""FLUX.2 adapter on CUDA: accelerated Flux2Transformer2DModel bitwise equal to plain diffusers,
fast path engaged (every op verified, nothing fell back, kernels ran).

Configs: the tiny one, and FLUX.2-dev width (6144 = 48 x 128, SwiGLU 18432, Mistral 15360 text
width) with 1 double + 1 single block. Image token counts 1024² (4096) and an odd 336x208
(273); text lengths 512 (the pipeline's padding) and 77 (not a multiple of 64); batch 1 and 2.
The CUDA-graph path replays bitwise too."""

import pytest

from ditfuse.models import families
from ditfuse.models.flux2 import ADAPTER
from tests.support.engaged import compare_accelerated, compare_cuda_graph

DEV = "cuda"
FLUX2 = families.get("flux2")


def _run(config, batch, size, layers=None, txt=512):
    m = FLUX2.build(config, layers, device=DEV)
    inp = FLUX2.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"flux2 {config} B={batch} {size} txt={txt}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["64x48", "336x208"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=37)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("336x208", 77)], ids=["1024px", "odd"])
def test_dev_width(batch, size, txt):
    _run("dev", batch, size, layers=(1, 1), txt=txt)


def test_cuda_graph_replays_bitwise():
    m = FLUX2.build("dev", (1, 1), device=DEV)
    inp = FLUX2.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=512)
    inp2 = FLUX2.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=512, seed=7)
    compare_cuda_graph(m, inp, inp2, "flux2")
