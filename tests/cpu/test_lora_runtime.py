"""``--lora PATH[:SCALE]`` / ``--fuse-lora`` for ``ditfuse generate`` and ``ditfuse serve``
(runtime/presets.py ``apply_loras``): the LoRA is loaded as diffusers loads it, and the image is
the one plain diffusers makes with the same LoRA. tiny-flux (random weights: the images are noise)
and a random LoRA saved in diffusers' format."""

from __future__ import annotations

import pytest
import torch

from ditfuse.runtime.presets import LoraSpec, apply_loras, load_model

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("text,want", [
    ("style", LoraSpec("style", 1.0)),
    ("/loras/style:0.5", LoraSpec("/loras/style", 0.5)),
    ("/loras/a:b/style.safetensors", LoraSpec("/loras/a:b/style.safetensors", 1.0)),  # not a number
    ("x:1e-1", LoraSpec("x", 0.1)),
    ("C:/loras/style", LoraSpec("C:/loras/style", 1.0)),
])
def test_lora_spec_parse(text, want):
    assert LoraSpec.parse(text) == want


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, tiny_cache):
    """A random LoRA on every Linear of tiny-flux's transformer, saved as diffusers saves one."""
    from diffusers import FluxPipeline
    from peft.utils import get_peft_model_state_dict

    loaded = load_model("tiny-flux", device="cpu", dtype="fp32")
    t = loaded.pipe.transformer
    targets = [n for n, m in t.named_modules() if type(m) is torch.nn.Linear]
    torch.manual_seed(5)
    t.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=targets))
    out = tmp_path_factory.mktemp("lora")
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(t))
    return out


def _image(pipe, kw):
    g = torch.Generator("cpu").manual_seed(0)
    return pipe("a fox", height=32, width=32, num_inference_steps=2, generator=g, output_type="pt", **kw).images


@pytest.mark.slow  # loads tiny-flux a few times
@pytest.mark.parametrize("fuse", [False, True])
def test_load_model_with_lora_equals_diffusers(lora_dir, fuse):
    plain = load_model("tiny-flux", device="cpu", dtype="fp32")
    kw = plain.call_kwargs
    base = _image(plain.pipe, kw)
    plain.pipe.load_lora_weights(str(lora_dir), adapter_name="x")
    plain.pipe.set_adapters(["x"], adapter_weights=[0.7])
    if fuse:
        plain.pipe.fuse_lora(adapter_names=["x"])
        plain.pipe.unload_lora_weights()
    want = _image(plain.pipe, kw)
    assert not torch.equal(want, base), "the LoRA changes nothing: the test could not fail"

    got = load_model("tiny-flux", device="cpu", dtype="fp32", loras=[LoraSpec(str(lora_dir), 0.7)], fuse_lora=fuse)
    assert got.loras == (f"{lora_dir} (scale 0.7)" + (", fused" if fuse else ""),)
    assert torch.equal(_image(got.pipe, kw), want)
    if fuse:  # merged and unloaded: plain Linears again, so the fast forwards read them directly
        assert all(type(m) is not peft.tuners.lora.Linear for m in got.pipe.transformer.modules())


def test_lora_file_path_and_errors(lora_dir, tmp_path):
    loaded = load_model("tiny-flux", device="cpu", dtype="fp32")
    f = next(lora_dir.glob("*.safetensors"))
    assert apply_loras(loaded.pipe, [LoraSpec(str(f))]) == (f"{f} (scale 1)",)
    with pytest.raises(ValueError, match="does not exist"):
        apply_loras(loaded.pipe, [LoraSpec(str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="does not load LoRA weights"):
        apply_loras(object(), [LoraSpec(str(f))])


@pytest.mark.slow  # a `ditfuse` subprocess
def test_generate_cli_with_lora(lora_dir, tiny_cache, tmp_path):
    from .test_generate import run_cli

    outs = {}
    for name, extra in (("plain", []), ("lora", ["--lora", f"{lora_dir}:0.7"]),
                        ("fused", ["--lora", f"{lora_dir}:0.7", "--fuse-lora"])):
        out = tmp_path / f"{name}.png"
        r = run_cli(["generate", "--prompt", "a fox", "--size", "32x32", "--steps", "2", "--seed", "1",
                     "--out", str(out), *extra], tiny_cache)
        assert r.returncode == 0, r.stdout + r.stderr
        outs[name] = out.read_bytes()
        if extra:
            assert f"LoRA: {lora_dir} (scale 0.7)" in r.stdout
    assert outs["lora"] != outs["plain"]
    r = run_cli(["generate", "--prompt", "a fox", "--out", str(tmp_path / "x.png"), "--lora", str(tmp_path / "nope")],
                tiny_cache)
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.slow  # two worker processes
@pytest.mark.parametrize("devices", [None, ["cpu", "cpu"]], ids=["one_process", "two_workers"])
def test_serve_engine_loads_the_lora(lora_dir, devices):
    """serve's engine (and each data-parallel worker) loads the LoRA before accelerating, and
    says so in its startup summary."""
    from ditfuse.runtime.server import build_engine

    engine, summary = build_engine("tiny-flux", device="cpu", devices=devices, loras=[LoraSpec(str(lora_dir), 0.7)],
                                   worker_options={"threads": 1} if devices else None)
    try:
        assert summary.count(f"LoRA: {lora_dir} (scale 0.7)") == (2 if devices else 1), summary
    finally:
        if engine.pool is not None:
            engine.pool.close()
