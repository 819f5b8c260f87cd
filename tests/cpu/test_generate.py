"""`ditfuse generate` end to end on the tiny preset, and the preset's build/cache behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

EXE = str(Path(sys.executable).with_name("ditfuse"))


def run_cli(args, cache, timeout=240):
    env = {**os.environ, "DITFUSE_CACHE": str(cache)}
    # A plain CPU process: no Triton interpreter, so the report says fused ops are unavailable.
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # `ditfuse` subprocesses: a fresh interpreter importing torch each
def test_generate_writes_pngs_with_metadata(tiny_cache, tmp_path):
    out = tmp_path / "img" / "out.png"
    r = run_cli(
        ["generate", "--model", "tiny-flux", "--prompt", "a red fox", "--size", "96x64", "--steps", "3",
         "--seed", "7", "--quality", "lossless", "--out", str(out), "--n", "2"],
        tiny_cache,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    paths = [out.with_name("out-0.png"), out.with_name("out-1.png")]
    for i, p in enumerate(paths):
        img = Image.open(p)
        assert img.format == "PNG" and img.size == (96, 64)
        assert img.text["prompt"] == "a red fox"
        assert img.text["seed"] == str(7 + i)
        assert img.text["num_inference_steps"] == "3"
        assert img.text["size"] == "96x64"
        assert img.text["quality"] == "lossless"
        assert img.text["quality_applied"] == "lossless"
        assert img.text["model"] == "tiny-flux"
        assert "seed=" in img.text["parameters"]
        assert f"wrote {p}" in r.stdout
    assert paths[0].read_bytes() != paths[1].read_bytes()
    s = r.stdout
    assert "device: cpu" in s
    assert "noise" in s  # the preset says plainly that its images are noise
    assert "accelerated:" in s and "fused ops are unavailable" in s
    assert "n 2, quality lossless\n" in s
    for timing in ("load + accelerate", "per step (median)", "VAE decode", "total"):
        assert timing in s
    assert "denoising" in r.stderr  # the progress bar
    assert "3/3" in r.stderr


@pytest.mark.slow  # `ditfuse` subprocesses: a fresh interpreter importing torch each
def test_generate_single_image_is_reproducible(tiny_cache, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for out in (a, b):
        r = run_cli(["generate", "--prompt", "same", "--size", "32x32", "--steps", "2", "--seed", "3", "--out", str(out)], tiny_cache)
        assert r.returncode == 0, r.stderr
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--size", "65x64"], "multiples of 16"),
        (["--steps", "0"], "num_inference_steps"),
        (["--quality", "ultra"], "allowed values: lossless, high"),
        (["--n", "9"], "n must be between 1 and 8"),
        (["--model", "/nonexistent/dir"], "not a built-in preset"),
    ],
)
def test_generate_reports_bad_arguments(tiny_cache, tmp_path, args, needle, capsys):
    # In-process (the console script itself is run by the tests above): a subprocess per case
    # only added interpreter start-up and a torch import to a check that never loads a model.
    from ditfuse.runtime.cli import main

    rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.png"), *args])
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_generate_names_modular_pipeline_directories(tmp_path, capsys):
    """A modular pipeline directory (FLUX.3's format) gets its own error, pointing at accelerate()."""
    from ditfuse.runtime.cli import main

    d = tmp_path / "flux3"
    d.mkdir()
    (d / "modular_model_index.json").write_text("{}")
    rc = main(["generate", "--model", str(d), "--prompt", "x", "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "modular pipeline" in err and "ditfuse.accelerate(pipe)" in err, err


def test_help_lists_runtime_commands_without_importing_torch():
    code = (
        "import sys; from ditfuse.runtime.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'triton', 'diffusers', 'fastapi') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    r = subprocess.run([EXE, "--help"], capture_output=True, text=True, timeout=60)
    assert "generate" in r.stdout and "serve" in r.stdout
    r = subprocess.run([EXE, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert "127.0.0.1" in r.stdout and "--max-batch-size" in r.stdout and "noise" in r.stdout


def test_preset_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    import torch

    from ditfuse.runtime import presets

    monkeypatch.setenv("DITFUSE_CACHE", str(tmp_path / "cache"))
    path = presets.ensure_tiny_flux()
    assert path == presets.tiny_flux_path() and path.is_relative_to(tmp_path / "cache")
    assert (path / "model_index.json").is_file()
    stamp = (path / "model_index.json").stat().st_mtime_ns
    built = []
    monkeypatch.setattr(presets, "build_tiny_flux", lambda: built.append(1))
    assert presets.ensure_tiny_flux() == path and not built
    assert (path / "model_index.json").stat().st_mtime_ns == stamp
    a = presets.load_model("tiny-flux", device="cpu")
    assert a.pipe.transformer.dtype == torch.float32 and a.is_preset and a.note and "noise" in a.note
    assert a.pipe.vae_scale_factor * 2 == a.size_multiple == 16
    monkeypatch.undo()
    # same seed, same recipe: a fresh build has exactly the cached weights
    fresh = presets.build_tiny_flux()
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        sa, sb = getattr(a.pipe, name).state_dict(), getattr(fresh, name).state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name


def test_real_model_directory_loads_with_dtype(tmp_path):
    """`--model DIR` takes any diffusers directory: here the preset saved elsewhere, in bf16."""
    import torch

    from ditfuse.runtime import presets

    d = tmp_path / "my-flux"
    presets.build_tiny_flux().save_pretrained(d)
    m = presets.load_model(str(d), device="cpu", dtype="bf16")
    assert m.name == "my-flux" and not m.is_preset
    assert m.pipe.transformer.dtype == torch.bfloat16
    assert m.size_multiple == 16
    with pytest.raises(ValueError, match="model_index.json"):
        presets.load_model(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="unknown dtype"):
        presets.load_model(str(d), device="cpu", dtype="int3")


@pytest.mark.parametrize(
    "asked,close_sites,line,applied",
    [
        ("lossless", 0, "quality lossless", "lossless"),
        ("high", 115, "quality high (close kernels on 115 sites)", "high"),
        ("high", 0, "quality high (ran lossless: no site runs a close kernel)", "lossless"),
    ],
)
def test_generate_says_which_quality_ran(asked, close_sites, line, applied):
    """The summary line and the files' metadata give the tier asked for and, where it differs, the
    one that ran (``applied_quality``, the rule behind the servers' ``quality_applied``)."""
    from ditfuse.runtime.generate import _quality_line
    from ditfuse.runtime.params import SamplingParams

    p = SamplingParams.create("x", size="32x32", seed=1, quality=asked)
    assert _quality_line(p, close_sites) == line
    meta = p.metadata(0, model="m", close_sites=close_sites)
    assert meta["quality"] == asked and meta["quality_applied"] == applied
    assert "quality_applied" not in p.metadata(0)  # not known: not written
