"""The tiny random-weight Qwen-Image and Z-Image pipelines (``build_tiny_pipeline`` in
ditfuse/models/qwenimage_configs.py and zimage_configs.py), on CPU.

Each build is deterministic, runs the stock diffusers pipeline end to end at a small non-square
size (PIL and numpy outputs; Qwen-Image's true CFG), survives ``save_pretrained`` /
``DiffusionPipeline.from_pretrained``, and accelerated (interpreter kernels behind the gate) gives
the un-accelerated pipeline's output bitwise, with the transformer and VAE mounted in full and
every transformer op reaching the gate.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

FAMILIES = ("qwenimage", "zimage")
# (VAE adapter, transformer sites): Qwen-Image 2 blocks + their attentions + norm_out; Z-Image
# 1 noise refiner + 1 context refiner + 2 main blocks and their attentions.
MOUNTS = {
    "qwenimage": ("autoencoder_kl_qwenimage", 5),
    "zimage": ("autoencoder_kl", 8),
}
# Multiples of 16 (VAE 8x, then 2x2 patches): 4 x 3 latent patches.
WIDTH, HEIGHT = 64, 48
PROMPT = "a red cat on a blue mat"


def _configs(family: str) -> Any:
    return importlib.import_module(f"ditfuse.models.{family}_configs")


def _build(family: str) -> Any:
    pipe = _configs(family).build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: Any, family: str, **kw: Any) -> Any:
    args = dict(prompt=PROMPT, width=WIDTH, height=HEIGHT, num_inference_steps=2,
                generator=torch.Generator().manual_seed(7), **_configs(family).TINY_CALL_KWARGS)
    args.update(kw)
    return pipe(**args).images


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_are_deterministic(family):
    a, b = _build(family), _build(family)
    mods_a, mods_b = _modules(a), _modules(b)
    assert sorted(mods_a) == ["text_encoder", "transformer", "vae"]
    assert sorted(mods_b) == sorted(mods_a)
    for name in mods_a:
        sa, sb = mods_a[name].state_dict(), mods_b[name].state_dict()
        assert list(sa) == list(sb), name
        for key in sa:
            assert_bitwise_equal(sb[key], sa[key], f"{family} {name}.{key}")
    assert dict(a.scheduler.config) == dict(b.scheduler.config)
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


@pytest.mark.parametrize("family", FAMILIES)
def test_two_step_call_at_a_non_square_size(family):
    pipe = _build(family)
    steps = []
    images = _call(pipe, family, callback_on_step_end=lambda p, i, t, kw: steps.append(i) or kw)
    assert steps == [0, 1]
    assert len(images) == 1 and images[0].size == (WIDTH, HEIGHT)
    arr = _call(pipe, family, output_type="np")
    assert arr.shape == (1, HEIGHT, WIDTH, 3) and np.isfinite(arr).all()
    if family == "qwenimage":
        # true CFG: a second (negative) transformer pass per step, its own text length
        cfg = _call(pipe, family, output_type="np", negative_prompt="blurry", true_cfg_scale=2.0)
    else:
        # CFG (guidance_scale > 0, the pipeline's default 5.0) batches both prompts' unequal
        # caption lengths; 0 is the Turbo setting, one pass
        cfg = _call(pipe, family, output_type="np", guidance_scale=0.0)
    assert cfg.shape == arr.shape and np.isfinite(cfg).all()
    assert not np.array_equal(cfg, arr)


def _fresh_memory(pipe: Any) -> None:
    """Copy every parameter and buffer into newly allocated memory. ``from_pretrained`` leaves
    CPU weights in the memory-mapped safetensors file, at offsets aligned to 8 bytes only, and
    CPU GEMM (MKL) rounds differently by the weight pointer's alignment: the same weights give
    other last bits until they sit where a fresh build's do."""
    with torch.no_grad():
        for mod in _modules(pipe).values():
            for t in [*mod.parameters(), *mod.buffers()]:
                t.data = t.data.clone()


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_reload(family, tmp_path):
    import diffusers

    pipe = _build(family)
    base = _call(pipe, family, output_type="np")
    pipe.save_pretrained(tmp_path)
    loaded = diffusers.DiffusionPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is type(pipe)
    for name, mod in _modules(pipe).items():
        other = getattr(loaded, name)
        assert type(other) is type(mod), name
        sa, sb = mod.state_dict(), other.state_dict()
        assert list(sa) == list(sb), name
        for key in sa:
            assert_bitwise_equal(sb[key], sa[key], f"{family} reloaded {name}.{key}")
    assert loaded.tokenizer.get_vocab() == pipe.tokenizer.get_vocab()
    assert loaded.tokenizer.chat_template == pipe.tokenizer.chat_template
    _fresh_memory(loaded)
    assert_bitwise_equal(torch.from_numpy(_call(loaded, family, output_type="np")), torch.from_numpy(base),
                         f"{family} reloaded pipeline")


@pytest.mark.interpret
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_pipeline_bitwise_and_every_op_gated(family):
    adapter = importlib.import_module(f"ditfuse.models.{family}").ADAPTER
    vae_adapter, n_sites = MOUNTS[family]
    pipe = _build(family)
    base = torch.from_numpy(_call(pipe, family, output_type="np"))
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        reps = {c.component: c for c in h.report().components}
        summary = h.report().summary()
        tr, vae = reps["transformer"], reps["vae"]
        assert (tr.adapter, tr.status) == (family, "mounted") and not tr.skipped_sites, summary
        assert len(tr.sites) == n_sites, tr.sites
        assert (vae.adapter, vae.status) == (vae_adapter, "mounted") and not vae.skipped_sites, summary
        assert reps["text_encoder"].status == "untouched", summary
        out = torch.from_numpy(_call(pipe, family, output_type="np"))
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    after = torch.from_numpy(_call(pipe, family, output_type="np"))
    assert_bitwise_equal(out, base, f"{family} accelerated")
    assert_bitwise_equal(after, base, f"{family} after unmount")
    # On CPU the gate may send an op to eager at first sight (the CPU's sums round otherwise);
    # what matters here is that every op of the transformer reached it.
    for op in adapter.ops():
        assert sum(calls.get(op, {}).values()) > 0, (op, {k: dict(v) for k, v in calls.items()})
