"""The tiny random-weight pipelines of ``sd3_configs``, ``chroma_configs`` and ``flux2_configs``
(``build_tiny_pipeline``: StableDiffusion3Pipeline, ChromaPipeline, Flux2KleinPipeline), on CPU.

Each is a complete diffusers pipeline built offline (text encoders, tokenizers, VAE, scheduler,
transformer): builds are deterministic, a 2-step call at a non-square size makes an image of that
size, save_pretrained / from_pretrained round-trips bitwise, and ``ditfuse.accelerate`` mounts
the family's adapter on the transformer with every op reaching the gate and the output bitwise
unchanged (the Triton kernels run under the interpreter here; the gate sends any op whose
interpreter result differs from eager back to eager, so the output stays bitwise either way).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

# family -> (pipeline class name, adapter module)
FAMILIES = {
    "sd3": ("StableDiffusion3Pipeline", "ditfuse.models.sd3"),
    "chroma": ("ChromaPipeline", "ditfuse.models.chroma"),
    "flux2": ("Flux2KleinPipeline", "ditfuse.models.flux2"),
}
# Multiples of 16 (vae_scale_factor 8 x 2x2 patches / packing) for all three; non-square.
WIDTH, HEIGHT = 64, 48
PROMPT = "a tiny red cube"
# Everything the builders make together stays tiny (fast on CPU, cheap to cache).
MAX_PARAMS = 400_000


def _configs(family: str) -> Any:
    return importlib.import_module(f"ditfuse.models.{family}_configs")


def _build(family: str) -> Any:
    pipe = _configs(family).build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(family: str, pipe: Any, output_type: str = "np", seed: int = 3) -> Any:
    # prompt by keyword: Flux2KleinPipeline's first positional parameter is ``image``
    return pipe(prompt=PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, output_type=output_type,
                generator=torch.Generator().manual_seed(seed), **_configs(family).TINY_CALL_KWARGS).images


def _np(images: Any) -> torch.Tensor:
    assert isinstance(images, np.ndarray), type(images)
    return torch.from_numpy(np.ascontiguousarray(images))


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def built(request) -> tuple[str, Any]:
    return request.param, _build(request.param)


def test_builds_are_deterministic_and_tiny(built):
    family, pipe = built
    assert type(pipe).__name__ == FAMILIES[family][0]
    other = _build(family)
    mods, mods2 = _modules(pipe), _modules(other)
    assert set(mods) == set(mods2) and {"transformer", "vae", "text_encoder"} <= set(mods), sorted(mods)
    for name, mod in mods.items():
        sd, sd2 = mod.state_dict(), mods2[name].state_dict()
        assert list(sd) == list(sd2), f"{family}.{name}: state dict keys differ"
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"{family}.{name}.{key} (second build)")
    total = sum(p.numel() for m in mods.values() for p in m.parameters())
    assert total < MAX_PARAMS, f"{family}: {total} parameters"


def test_two_step_call_makes_an_image_of_the_size(built):
    family, pipe = built
    images = _call(family, pipe, output_type="pil")
    assert len(images) == 1 and images[0].size == (WIDTH, HEIGHT), (family, images[0].size)
    arr = _call(family, pipe)
    assert arr.shape == (1, HEIGHT, WIDTH, 3), arr.shape
    assert np.isfinite(arr).all(), f"{family}: non-finite pixels"


def test_save_pretrained_round_trip_is_bitwise(built, tmp_path):
    from diffusers import DiffusionPipeline

    family, pipe = built
    pipe.save_pretrained(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(str(tmp_path))
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is type(pipe)
    assert_bitwise_equal(_np(_call(family, loaded)), _np(_call(family, pipe)), f"{family}: reloaded pipeline output")


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_output_bitwise_and_every_op_reaches_the_gate(built):
    family, pipe = built
    adapter = importlib.import_module(FAMILIES[family][1]).ADAPTER
    base = _np(_call(family, pipe))
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        rep = {c.component: c for c in h.report().components}
        tr = rep["transformer"]
        assert tr.adapter == adapter.family and tr.status == "mounted", h.report().summary()
        assert not tr.skipped_sites, tr.skipped_sites
        # every kind of site the adapter has is present in the tiny transformer
        assert {s for _, s in tr.sites} == {s.name for s in adapter.sites}, tr.sites
        assert rep["vae"].status == "mounted", h.report().summary()
        out = _np(_call(family, pipe))
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, f"{family}: accelerated pipeline output")
    for op in adapter.ops():
        assert sum(calls.get(op, {}).values()) > 0, f"{family}: {op} never reached the gate: {dict(calls)}"
    assert_bitwise_equal(_np(_call(family, pipe)), base, f"{family}: output after unmount")
