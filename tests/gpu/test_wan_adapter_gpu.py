"""Wan adapter on CUDA: accelerated WanTransformer3DModel bitwise equal to plain diffusers, fast
path engaged (every op verified, nothing fell back, kernels ran).

Configs: the tiny one; Wan2.1-1.3B width (1536, 12 heads, ffn 8960) with 2 blocks; Wan2.2-TI2V-5B
width (3072, 48 latent channels) with per-token modulation; an I2V config with image embeddings
(CLIP 1280 through the added k/v). Both load paths: ``pretrained`` (from_pretrained's fp32-kept
modules: rope tables, norms, modulation tables, time embedder) and ``plain`` (all bf16). Token
counts not multiples of 64 (720, 32760), batch 1 and 2 (CFG)."""

import pytest
import torch

from ditfuse.models import families
from ditfuse.models.wan import ADAPTER
from tests.support.engaged import compare_accelerated

DEV = "cuda"
WAN = families.get("wan")


def _run(config, load, batch, size, layers=None, **kw):
    m = WAN.build(config, layers, device=DEV, load=load)
    inp = WAN.make_inputs(m, batch, size, device=DEV, **kw)
    ops = ADAPTER.ops()
    if kw.get("per_token_timestep"):
        # per-token modulation is summed inside the ops that read it (their *_table arguments)
        ops = tuple(op for op in ops if op != "modulate.table_add")
    compare_accelerated(m, inp, ops, f"wan {config} {load} B={batch} {size}")


@pytest.mark.parametrize("load", ["pretrained", "plain"])
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny(load, batch):
    _run("tiny", load, batch, "64x48x9", txt_tokens=37)


@pytest.mark.parametrize("load", ["pretrained", "plain"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["320x192x9", "832x480x81"], ids=["720tok", "32760tok"])
def test_1_3b_width(load, batch, size):
    if size == "832x480x81" and batch == 2 and load == "plain":
        pytest.skip("one B=2 full-size case (pretrained) is enough for the time budget")
    _run("dev", load, batch, size, layers=(2,))


@pytest.mark.parametrize("batch", [1, 2])
def test_ti2v_5b_width_per_token_timestep(batch):
    _run("ti2v-5b", "pretrained", batch, "640x352x17", layers=(1,), per_token_timestep=True)


def test_i2v_with_image_embeddings():
    _run("i2v-14b", "pretrained", 1, "320x192x9", layers=(1,))


def test_two_expert_pipeline_components():
    """Wan 2.2 A14B: accelerate(pipe) mounts both experts (transformer and transformer_2)."""
    import ditfuse

    t1 = WAN.build("tiny", device=DEV, load="pretrained", seed=1)
    t2 = WAN.build("tiny", device=DEV, load="pretrained", seed=2)

    class Pipe:
        components = {"transformer": t1, "transformer_2": t2, "scheduler": object()}

    h = ditfuse.accelerate(Pipe())
    try:
        by = {c.component: c for c in h.report().components}
        assert by["transformer"].status == by["transformer_2"].status == "mounted"
        for t in (t1, t2):
            inp = WAN.make_inputs(t, 1, "64x48x9", device=DEV, txt_tokens=8)
            with torch.no_grad():
                t(**inp)
    finally:
        h.unmount()
