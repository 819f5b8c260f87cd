"""HunyuanVideo 1.5 on CUDA: the accelerated HunyuanVideo15Transformer3DModel bitwise equal to
plain diffusers, every op verified, nothing fallen back, the kernels run, the blocks hand off.

Configs: the tiny one and HunyuanVideo 1.5 width (2048 = 16 x 128, FF 8192, text width 3584) with
3 blocks; a 480p 33-frame clip (9 x 30 x 53 = 14310 video tokens) and an odd 208x144x5 one; 256
and 77 text tokens with per-sample padding; batch 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

DEV = "cuda"


def _run(config, batch, size, txt):
    import ditfuse
    from ditfuse.models import families
    from ditfuse.models.hunyuanvideo15 import ADAPTER
    from tests.support.engaged import compare_accelerated

    fam = families.get("hunyuanvideo15")
    fam = dataclasses.replace(fam, configs={**fam.configs, "dev_small": dict(fam.config("dev"), num_layers=3)})
    m = fam.build(config, device=DEV)
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    compare_accelerated(m, inp, ADAPTER.ops(), f"hunyuanvideo15 {config} B={batch} {size} txt={txt}")
    with torch.no_grad():
        h = ditfuse.accelerate(m)
        try:
            m(**inp)
            counts = ditfuse.models.handoff_counts(m)
        finally:
            h.unmount()
    assert counts["used"] >= 2 and counts["discarded"] == 0, counts


@pytest.mark.parametrize("batch", [1, 2])
def test_tiny(batch):
    _run("tiny", batch, "208x144x5", 29)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("848x480x33", 256), ("208x144x5", 77)], ids=["480p", "odd"])
def test_hunyuanvideo15_width(batch, size, txt):
    _run("dev_small", batch, size, txt)
