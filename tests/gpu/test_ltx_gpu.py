"""LTX-Video adapter on CUDA: accelerated LTXVideoTransformer3DModel bitwise equal to plain
diffusers, fast path engaged (every op verified, nothing fell back, kernels ran).

Round 20 (H100, bench/results/gpu_suite_round20_c_h100.log): all 10 passed.

Configs: the tiny one, and LTX-Video 0.9.x width (2048 = 32 x 64) and the 13B width (4096 =
32 x 128) with 1-2 blocks. Sizes: the pipeline's default 704x512x161 (a 21 x 16 x 22 latent
grid, 7392 tokens) and an odd 224x160x17 (3 x 5 x 7); text 128 (the pipeline's padding, each
prompt's tail masked) and 9; batch 1 and the CFG batch 2 (per-sample RoPE tables: one QK call
per sample)."""

import pytest

from ditfuse.models import families
from ditfuse.models.ltx import ADAPTER
from tests.support.engaged import compare_accelerated

DEV = "cuda"
LTX = families.get("ltx")


def _run(config, batch, size, layers=None, txt=128, image_conditioned=False):
    m = LTX.build(config, layers, device=DEV)
    inp = LTX.make_inputs(m, batch, size, device=DEV, txt_tokens=txt, image_conditioned=image_conditioned)
    compare_accelerated(m, inp, ADAPTER.ops(),
                        f"ltx {config} B={batch} {size} txt={txt}{' image-conditioned' if image_conditioned else ''}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["224x160x17", "64x64x9"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=9)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("704x512x161", 128), ("224x160x17", 9)], ids=["default", "odd"])
def test_ltx_width(batch, size, txt):
    _run("dev", batch, size, layers=(2,), txt=txt)


@pytest.mark.parametrize("batch", [1, 2])
def test_13b_width(batch):
    _run("13b", batch, "224x160x17", layers=(1,), txt=9)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("config,layers,size", [("tiny", None, "224x160x17"), ("dev", (2,), "704x512x161")],
                         ids=["tiny", "dev-default"])
def test_image_to_video_per_token_timesteps(config, layers, size, batch):
    """LTXImageToVideoPipeline's forward (round 23, the runtime's tiny-ltx-i2v): one timestep per
    token, 0 on the conditioned first frame's, so every adaLN modulation is [B, S, D]."""
    _run(config, batch, size, layers=layers, txt=9 if config == "tiny" else 128, image_conditioned=True)
