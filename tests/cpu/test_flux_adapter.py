import json
import os
import subprocess
import sys

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import flux as flux_adapter

from .tiny import flux_inputs, tiny_flux


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("guidance", [False, True])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch, guidance):
    m = tiny_flux(guidance=guidance, dtype=torch.bfloat16)
    inp = flux_inputs(m, batch=batch, dtype=torch.bfloat16)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report()
    assert rep.components[0].status == "mounted"
    # 1 dual + 1 single block, 2 attentions, norm_out; the transformer and its position embedder
    # (the RoPE table cache, models/pos_cache.py)
    assert sorted(s for _, s in rep.components[0].sites) == sorted(
        ["flux.dual_block", "flux.single_block", "flux.attention", "flux.attention", "flux.norm_out",
         "flux.transformer", "flux.pos_embed"]
    )
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    assert_bitwise_equal(_run(m, inp), base, "accelerated, second call")
    h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    for mod in m.modules():
        reg = getattr(mod, "_diffusers_hook", None)
        assert reg is None or not [n for n in reg.hooks if n.startswith("ditfuse.")]


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_fast_path_engages_under_interpreter():
    """On CPU the Triton kernels run in the interpreter; the gate must have seen every op."""
    m = tiny_flux(dtype=torch.float32)
    inp = flux_inputs(m)
    h = ditfuse.accelerate(m)
    _run(m, inp)
    calls = ditfuse.gate.report().calls
    h.unmount()
    for op in flux_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert sum(c.values()) > 0, f"{op} never reached the gate: {dict(c)}"


def test_refuses_other_diffusers_version(monkeypatch):
    import diffusers

    m = tiny_flux()
    monkeypatch.setattr(diffusers, "__version__", "0.99.0")
    h = ditfuse.accelerate(m)
    c = h.report().components[0]
    assert c.status == "refused"
    assert "mirrors diffusers 0.42.1" in c.reason and "0.99.0" in c.reason
    assert not hasattr(m.transformer_blocks[0], "_diffusers_hook") or not m.transformer_blocks[0]._diffusers_hook.hooks


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_flux as tf

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None, extra=None):
        pass

    monkeypatch.setattr(tf.FluxTransformerBlock, "forward", forward)
    assert "FluxTransformerBlock.forward" in flux_adapter.ADAPTER.version_problem()


def test_report_lists_untouched_components_and_skipped_modules():
    m = tiny_flux()
    m.single_transformer_blocks[0].act_mlp = torch.nn.GELU()  # not tanh: that block keeps its forward

    class Pipe:
        components = {"transformer": m, "vae": torch.nn.Linear(2, 2), "scheduler": object(), "tokenizer": None}

    h = ditfuse.accelerate(Pipe())
    rep = h.report()
    by = {c.component: c for c in rep.components}
    assert set(by) == {"transformer", "vae"}
    assert by["vae"].status == "untouched" and "no ditfuse adapter" in by["vae"].reason
    assert by["transformer"].skipped_sites[0][0] == "single_transformer_blocks.0"
    text = rep.summary()
    assert "transformer (FluxTransformer2DModel): flux adapter" in text and "vae (Linear): untouched" in text
    json.dumps(rep.to_dict())
    h.unmount()


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_set_quality_high_then_lossless_bitwise():
    m = tiny_flux(dtype=torch.bfloat16)
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    h = ditfuse.accelerate(m, quality="high")
    assert h.quality.value == "high"
    _run(m, inp)
    h.set_quality("lossless")
    assert h.quality.value == "lossless"
    assert_bitwise_equal(_run(m, inp), base)
    with pytest.raises(ValueError, match="allowed values"):
        h.set_quality("best")
    h.unmount()


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_no_cuda_report_says_so_in_one_line():
    code = (
        "import torch, sys; sys.path.insert(0, '.')\n"
        "from tests.cpu.tiny import tiny_flux\n"
        "import ditfuse\n"
        "h = ditfuse.accelerate(tiny_flux())\n"
        "print(h.report().summary())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout
    lines = [l for l in out.splitlines() if "fused ops are unavailable" in l]
    assert len(lines) == 1, out
    assert "untouched" in out


def test_accelerate_rejects_non_models():
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        ditfuse.accelerate(42)


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_attention_backend_chosen_through_diffusers_is_respected(monkeypatch):
    """The fused attention path calls diffusers' dispatch_attention_fn with the backend set on the
    model (here '_native_math'), never a hard-coded SDPA."""
    from diffusers.models import attention_dispatch

    m = tiny_flux(dtype=torch.bfloat16)
    m.set_attention_backend("_native_math")
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    seen = []
    real = attention_dispatch.dispatch_attention_fn

    def spy(*args, **kwargs):
        seen.append(kwargs.get("backend"))
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", spy)
    h = ditfuse.accelerate(m)
    out = _run(m, inp)
    h.unmount()
    assert seen and all(str(getattr(b, "value", b)) == "_native_math" for b in seen), seen
    assert_bitwise_equal(out, base)
