"""Qwen-Image 2.1 on CUDA: the accelerated QwenImage21Transformer2DModel bitwise equal to plain
diffusers, every op verified, nothing fallen back, the kernels run; the blocks hand off.

Configs: the tiny one, and Qwen-Image 2.1 width (4096 = 32 x 128, SwiGLU 12288, VLM width 4096)
with 3 blocks. Modes: the KV-cached decode (the pipeline's steps after its first; target tokens
only, per-sample [B, 1, D] modulation rows), the uncached step (the block-causal prefill of text
+ image tokens, per-token rows) and an edit step with a condition image; 1024² and an odd
352x224 (308 target tokens); 512 and 77 text tokens (not multiples of 64); batch 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest

DEV = "cuda"


def _family():
    from ditfuse.models import families

    fam = families.get("qwenimage21")
    small = dict(fam.config("dev"), num_layers=3)
    return dataclasses.replace(fam, configs={**fam.configs, "dev_small": small})


def _run(config, batch, size, txt, mode, cond=0):
    from ditfuse.models.qwenimage21 import ADAPTER
    from tests.support.engaged import compare_accelerated, handoff_counts_after

    fam = _family()
    m = fam.build(config, device=DEV)
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=txt, mode=mode, cond=cond)
    compare_accelerated(m, inp, ADAPTER.ops(), f"qwenimage21 {config} B={batch} {size} txt={txt} {mode} cond={cond}")
    counts = handoff_counts_after(m, inp)  # the blocks hand off
    assert counts["used"] >= len(m.transformer_blocks) - 1 and counts["discarded"] == 0, counts


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["cached", "prefill"])
def test_tiny(batch, mode):
    _run("tiny", batch, "64x48", 29, mode)
    _run("tiny", batch, "352x224", 13, mode, cond=4)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["cached", "prefill"])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("352x224", 77)], ids=["1024px", "odd"])
def test_qwenimage21_width(batch, mode, size, txt):
    _run("dev_small", batch, size, txt, mode)


def test_edit_step_at_width():
    _run("dev_small", 1, "352x224", 77, "prefill", cond=16)
