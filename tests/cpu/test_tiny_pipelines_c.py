"""The tiny random-weight pipelines of ``hunyuanvideo15_configs`` and ``qwenimage21_configs``
(``build_tiny_pipeline``: HunyuanVideo15Pipeline, QwenImage21Pipeline), on CPU.

Each is a complete diffusers pipeline built offline (text encoders, tokenizers / processor, VAE,
scheduler, guider, transformer): builds are deterministic, a 2-step call at a non-square size
makes frames / an image of that size, save_pretrained / from_pretrained round-trips bitwise, and
``ditfuse.accelerate`` mounts the family's adapter on the transformer with every op reaching the
gate and the output bitwise unchanged. The accelerated runs cast the pipeline to bf16, the dtype
the kernels are made for (in fp32 the interpreter's LayerNorm and QK-norm results differ from CPU
eager at first sight and the gate sends those ops to eager, so no kernel of theirs would run).

QwenImage21's tests need torchvision: transformers builds no Qwen3VLProcessor without a video
processor, and its video processors need torchvision (absent from this project's CPU venv).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import hunyuanvideo15_configs as hvc
from ditfuse.models import qwenimage21_configs as qic
from tests.support.engaged import assert_gate_clean

# HunyuanVideo 1.5: multiples of 16, 4k + 1 frames. The quotes send "tiny" through the ByT5 glyph
# encoder (without them its embeddings are zeros and its mask empty).
HV_SIZE = dict(width=64, height=48, num_frames=5)
HV_PROMPT = 'a sign that says "tiny"'
HV_NEGATIVE = "blurry"
# Qwen-Image 2.1: multiples of 32 (smaller sizes are floored to them).
QI_SIZE = dict(width=96, height=64)
QI_PROMPT = "a tiny red cube"


def _needs_torchvision() -> None:
    pytest.importorskip("torchvision", reason="QwenImage21Pipeline's Qwen3VLProcessor needs a video processor, "
                                              "and transformers' video processors need torchvision")


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _hv_call(pipe, seed: int = 3, **over) -> torch.Tensor:
    kw = dict(prompt=HV_PROMPT, negative_prompt=HV_NEGATIVE, num_inference_steps=2, output_type="np",
              generator=torch.Generator().manual_seed(seed), **HV_SIZE, **hvc.TINY_CALL_KWARGS)
    frames = pipe(**{**kw, **over}).frames
    assert isinstance(frames, np.ndarray), type(frames)
    return torch.from_numpy(np.ascontiguousarray(frames))


def _qi_call(pipe, seed: int = 3, output_type: str = "np", **over):
    kw = dict(prompt=QI_PROMPT, num_inference_steps=2, output_type=output_type,
              generator=torch.Generator().manual_seed(seed), **QI_SIZE, **qic.TINY_CALL_KWARGS)
    images = pipe(**{**kw, **over}).images
    if output_type != "np":
        return images
    assert isinstance(images, np.ndarray), type(images)
    return torch.from_numpy(np.ascontiguousarray(images))


def _modules(pipe) -> dict[str, torch.nn.Module]:
    return {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}


def _assert_same_weights(pipe, other, label: str) -> None:
    mods, mods2 = _modules(pipe), _modules(other)
    assert set(mods) == set(mods2) and {"transformer", "vae", "text_encoder"} <= set(mods), sorted(mods)
    for name, mod in mods.items():
        sd, sd2 = mod.state_dict(), mods2[name].state_dict()
        assert list(sd) == list(sd2), f"{label}.{name}: state dict keys differ"
        for key, t in sd.items():
            assert_bitwise_equal(sd2[key], t, f"{label}.{name}.{key} (second build)")


@pytest.fixture(scope="module")
def hv():
    return _quiet(hvc.build_tiny_pipeline())


@pytest.fixture(scope="module")
def qi():
    _needs_torchvision()
    return _quiet(qic.build_tiny_pipeline())


# -- HunyuanVideo 1.5 -------------------------------------------------------------------------------

def test_hunyuanvideo15_builds_are_deterministic(hv):
    from diffusers import HunyuanVideo15Pipeline

    assert type(hv) is HunyuanVideo15Pipeline
    _assert_same_weights(hv, hvc.build_tiny_pipeline(), "hunyuanvideo15")
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in _modules(hv).items()}
    # diffusers hard-codes the ByT5 projection's hidden width (2048): 4.2M of the transformer's
    # 4.4M parameters; everything else stays tiny
    byt5 = sum(p.numel() for p in hv.transformer.context_embedder_2.parameters())
    assert byt5 > 4_000_000 and sum(counts.values()) - byt5 < 400_000, counts


def test_hunyuanvideo15_two_step_call_makes_frames_of_the_size(hv):
    frames = _hv_call(hv)
    assert tuple(frames.shape) == (1, HV_SIZE["num_frames"], HV_SIZE["height"], HV_SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1


def test_hunyuanvideo15_save_pretrained_round_trip_is_bitwise(hv, tmp_path):
    from diffusers import DiffusionPipeline

    hv.save_pretrained(tmp_path)
    loaded = _quiet(DiffusionPipeline.from_pretrained(str(tmp_path)))
    assert type(loaded) is type(hv) and type(loaded.guider) is type(hv.guider)
    assert loaded.guider.guidance_scale == hv.guider.guidance_scale
    assert_bitwise_equal(_hv_call(loaded), _hv_call(hv), "hunyuanvideo15: reloaded pipeline output")


def test_hunyuanvideo15_guidance_scale_per_call_does_not_persist(hv):
    """The pipeline reads its guidance scale from ``pipe.guider``; ``guidance_scale(pipe, s)``
    swaps in a copy at ``s`` for the calls inside and puts the original back."""
    guider, scale = hv.guider, hv.guider.guidance_scale
    base = _hv_call(hv)
    with hvc.guidance_scale(hv, 2.0):
        assert hv.guider is not guider and hv.guider.guidance_scale == 2.0
        low = _hv_call(hv)
    with hvc.guidance_scale(hv, 9.0):
        high = _hv_call(hv)
    with hvc.guidance_scale(hv, scale):  # the same scale through a fresh guider: the same video
        same = _hv_call(hv)
    with hvc.guidance_scale(hv, None):
        assert hv.guider is guider
    assert hv.guider is guider and hv.guider.guidance_scale == scale
    assert not torch.equal(low, high), "the guidance scale changed nothing"
    assert_bitwise_equal(same, base, "hunyuanvideo15: default scale through guidance_scale()")
    assert_bitwise_equal(_hv_call(hv), base, "hunyuanvideo15: after guidance_scale() (must not persist)")
    # the negative prompt is the unconditional branch: it matters while CFG is on, not at scale 1
    assert not torch.equal(_hv_call(hv, negative_prompt="sharp"), base), "the negative prompt changed nothing"
    with hvc.guidance_scale(hv, 1.0):
        assert_bitwise_equal(_hv_call(hv, negative_prompt="sharp"), _hv_call(hv), "hunyuanvideo15: CFG off")


def test_hunyuanvideo15_batch_of_prompts_with_vae_slicing(hv):
    """diffusers 0.42.1's HunyuanVideo 1.5 VAE decodes one video at a time only (see the
    builder's docstring): with slicing, a list of prompts makes one video each."""
    hv.vae.enable_slicing()
    try:
        frames = _hv_call(hv, prompt=[HV_PROMPT, "a cat"], negative_prompt=[HV_NEGATIVE, ""],
                          generator=[torch.Generator().manual_seed(s) for s in (3, 4)])
    finally:
        hv.vae.disable_slicing()
    assert tuple(frames.shape) == (2, HV_SIZE["num_frames"], HV_SIZE["height"], HV_SIZE["width"], 3), frames.shape
    assert torch.isfinite(frames).all()


def test_hunyuanvideo15_text_lengths_crop_at_the_prompt():
    """``set_text_lengths``: the crop starts at the prompt (the tiny byte-level tokenizer spells the
    system message in ~490 tokens, not the 108 the pipeline assumes), so short lengths keep it."""
    pipe = hvc.build_tiny_pipeline()
    start = hvc.prompt_template_start(pipe)
    assert pipe.prompt_template_encode_start_idx == 108 and start > 400, start
    hvc.set_text_lengths(pipe, **hvc.TINY_TEXT_LENGTHS)
    assert pipe.prompt_template_encode_start_idx == start
    embeds, mask = pipe._get_mllm_prompt_embeds(
        pipe.text_encoder, pipe.tokenizer, "abc", "cpu", tokenizer_max_length=pipe.tokenizer_max_length,
        system_message=pipe.system_message, crop_start=start)
    assert tuple(embeds.shape) == (1, hvc.TINY_TEXT_LENGTHS["mllm_tokens"], pipe.text_encoder.config.hidden_size)
    ids = pipe.tokenizer.apply_chat_template([[{"role": "user", "content": "abc"}]], tokenize=True, return_dict=True,
                                             add_generation_prompt=True)["input_ids"][0]
    # "abc" + the end of the user turn + the assistant header: valid; the rest: padding
    assert int(mask.sum()) == len(ids) - len(pipe.tokenizer("<|im_start|>user\n").input_ids), mask


@pytest.mark.usefixtures("verify_every_call")
def test_hunyuanvideo15_accelerated_bitwise_every_op_gated():
    from ditfuse.models import hunyuanvideo15 as adapter_mod

    pipe = _quiet(hvc.build_tiny_pipeline()).to(torch.bfloat16)
    # the interpreter's cost grows with the joint text sequence (1985 tokens by default)
    hvc.set_text_lengths(pipe, **hvc.TINY_TEXT_LENGTHS)
    base = _hv_call(pipe)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        rep = {c.component: c for c in h.report().components}
        tr = rep["transformer"]
        assert tr.adapter == "hunyuanvideo15" and tr.status == "mounted", h.report().summary()
        # the token refiner's attention is not HunyuanVideo's processor: the only sites skipped
        assert all("AttnProcessor2_0" in str(x) for x in tr.skipped_sites), tr.skipped_sites
        assert {s for _, s in tr.sites} == {s.name for s in adapter_mod.ADAPTER.sites}, tr.sites
        out = _hv_call(pipe)
        gate = ditfuse.gate.report()
        counts = ditfuse.models.handoff_counts(pipe.transformer)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "hunyuanvideo15: accelerated pipeline output")
    # every op's kernel ran and was compared with eager (interpreter mismatches allowed: conftest)
    assert_gate_clean(gate, "hunyuanvideo15")
    for op in adapter_mod.ADAPTER.ops():
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"hunyuanvideo15: {op} never reached the gate: {gate.calls}"
    assert counts["links"] == 2 and counts["used"] > 0 and counts["discarded"] == 0, counts
    assert_bitwise_equal(_hv_call(pipe), base, "hunyuanvideo15: output after unmount")


# -- Qwen-Image 2.1 ---------------------------------------------------------------------------------

def test_qwenimage21_builds_are_deterministic_and_tiny(qi):
    from diffusers import QwenImage21Pipeline

    assert type(qi) is QwenImage21Pipeline
    _assert_same_weights(qi, qic.build_tiny_pipeline(), "qwenimage21")
    total = sum(p.numel() for m in _modules(qi).values() for p in m.parameters())
    assert total < 400_000, total


def test_qwenimage21_two_step_call_makes_an_rgba_image_of_the_size(qi):
    (image,) = _qi_call(qi, output_type="pil")
    assert image.size == (QI_SIZE["width"], QI_SIZE["height"]) and image.mode == "RGBA", (image.size, image.mode)
    arr = _qi_call(qi)
    assert tuple(arr.shape) == (1, QI_SIZE["height"], QI_SIZE["width"], 4), arr.shape
    assert torch.isfinite(arr).all() and arr.min() >= 0 and arr.max() <= 1


def test_qwenimage21_size_rules(qi):
    """height / width win over ``output_resolution``, which is the square's side without them;
    sizes are floored to multiples of 32; true CFG needs a negative prompt and a scale > 1."""
    assert tuple(_qi_call(qi, width=64, height=48).shape) == (1, 32, 64, 4)
    assert tuple(_qi_call(qi, width=None, height=None, output_resolution=64).shape) == (1, 64, 64, 4)
    assert tuple(_qi_call(qi, height=None, output_resolution=64).shape) == (1, 64, 96, 4)
    base = _qi_call(qi)
    assert_bitwise_equal(_qi_call(qi, negative_prompt="blurry"), base, "qwenimage21: negative prompt at scale 1")
    assert not torch.equal(_qi_call(qi, negative_prompt="blurry", true_cfg_scale=4.0), base)


def test_qwenimage21_save_pretrained_round_trip_is_bitwise(qi, tmp_path):
    from diffusers import DiffusionPipeline

    qi.save_pretrained(tmp_path)
    loaded = _quiet(DiffusionPipeline.from_pretrained(str(tmp_path)))
    assert type(loaded) is type(qi) and type(loaded.processor) is type(qi.processor)
    assert_bitwise_equal(_qi_call(loaded), _qi_call(qi), "qwenimage21: reloaded pipeline output")


@pytest.mark.usefixtures("verify_every_call")
def test_qwenimage21_accelerated_bitwise_every_op_gated(qi):
    from ditfuse.models import qwenimage21 as adapter_mod

    pipe = _quiet(qic.build_tiny_pipeline()).to(torch.bfloat16)
    base = _qi_call(pipe)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(pipe)
    try:
        tr = {c.component: c for c in h.report().components}["transformer"]
        assert tr.adapter == "qwenimage21" and tr.status == "mounted", h.report().summary()
        assert not tr.skipped_sites, tr.skipped_sites
        assert {s for _, s in tr.sites} == {s.name for s in adapter_mod.ADAPTER.sites}, tr.sites
        out = _qi_call(pipe)  # step 1 prefills the KV cache, step 2 decodes from it
        gate = ditfuse.gate.report()
        counts = ditfuse.models.handoff_counts(pipe.transformer)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "qwenimage21: accelerated pipeline output")
    # every op's kernel ran and was compared with eager (interpreter mismatches allowed: conftest)
    assert_gate_clean(gate, "qwenimage21")
    for op in adapter_mod.ADAPTER.ops():
        assert gate.calls.get(op, {}).get("verify", 0) > 0, f"qwenimage21: {op} never reached the gate: {gate.calls}"
    assert counts["links"] == 2 and counts["used"] > 0 and counts["discarded"] == 0, counts
    assert_bitwise_equal(_qi_call(pipe), base, "qwenimage21: output after unmount")
