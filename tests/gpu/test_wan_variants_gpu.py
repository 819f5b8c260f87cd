"""Wan's "Copied from" transformers on CUDA (models/wan_variants.py): ChronoEdit, SkyReels-V2 and
Wan-Animate accelerated bitwise equal to plain diffusers, fast path engaged (every op verified,
nothing fell back, kernels ran).

Configs: each family's tiny one, and its real width with 1-2 blocks (Wan-Animate: 5, the fewest its forward
runs with); ``pretrained`` load (from_pretrained's fp32-kept modules), batch 1 and 2
(CFG). SkyReels-V2 also with diffusion forcing (per-frame timesteps, [B, 6, S, D] modulation, a
causal mask over 2-frame blocks). ChronoEdit's stream stays the transposed patch-embedding view
(no .contiguous()): the ops must keep eager's layout. Not run yet (no GPU in the round that wrote
it); sized to finish well under a minute on an H100."""

import pytest

from ditfuse.models import families
from ditfuse.models import wan_variants as V
from tests.support.engaged import compare_accelerated

DEV = "cuda"


def _run(family, config, batch, size, layers=None, adapter=None, **kw):
    fam = families.get(family)
    m = fam.build(config, layers, device=DEV, load="pretrained")
    ops = adapter.ops()
    if config == "tiny-df" or kw.pop("df", False):
        m._set_ar_attention(2)
        # diffusion forcing's per-token modulation is summed inside the ops that read it
        ops = tuple(op for op in ops if op != "modulate.table_add")
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=kw.pop("txt_tokens", 37), **kw)
    compare_accelerated(m, inp, ops, f"{family} {config} B={batch} {size}")


@pytest.mark.parametrize("batch", [1, 2])
def test_chronoedit_tiny(batch):
    _run("chronoedit", "tiny", batch, "80x48x9", adapter=V.CHRONOEDIT_ADAPTER)


@pytest.mark.parametrize("batch", [1, 2])
def test_chronoedit_14b_width(batch):
    _run("chronoedit", "dev", batch, "320x192x5", layers=(1,), adapter=V.CHRONOEDIT_ADAPTER)


@pytest.mark.parametrize("config", ["tiny", "tiny-df"])
@pytest.mark.parametrize("batch", [1, 2])
def test_skyreels_tiny(config, batch):
    _run("skyreels_v2", config, batch, "80x48x13", adapter=V.SKYREELS_V2_ADAPTER)


@pytest.mark.parametrize("df", [False, True], ids=["t", "diffusion-forcing"])
@pytest.mark.parametrize("batch", [1, 2])
def test_skyreels_1_3b_width(batch, df):
    _run("skyreels_v2", "dev", batch, "320x192x13", layers=(2,), adapter=V.SKYREELS_V2_ADAPTER, df=df)


@pytest.mark.parametrize("batch", [1, 2])
def test_wan_animate_tiny(batch):
    _run("wan_animate", "tiny", batch, "80x48x9", adapter=V.WAN_ANIMATE_ADAPTER)


def test_wan_animate_14b_width():
    # 5 blocks: the model has num_layers // 5 face adapters and block 0 indexes the first, so fewer
    # blocks than inject_face_latents_blocks (5) raise in diffusers' own forward. The motion
    # encoder's 512 x 512 px face video: 5 frames keep it small.
    _run("wan_animate", "dev", 1, "320x192x5", layers=(5,), adapter=V.WAN_ANIMATE_ADAPTER, image_tokens=257)
