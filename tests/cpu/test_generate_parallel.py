"""`ditfuse generate --devices cpu,cpu`: one generation over 2 ranks with diffusers' context
parallelism (gloo; the kernels under the Triton interpreter so that ditfuse mounts). The image or
clip must equal, pixel for pixel, the same command's plain-diffusers (`--no-accelerate`) context-
parallel run; rank 0 alone writes it. On GPUs the same command takes `--gpus N` (docs/parallel.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

EXE = str(Path(sys.executable).with_name("ditfuse"))

pytestmark = pytest.mark.slow  # torchrun with 2 ranks loading the preset: ~15 s a run


def run_cli(args, cache, interpret=True, timeout=300):
    env = {**os.environ, "DITFUSE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_image_over_two_ranks_equals_plain_diffusers(tiny_cache, tmp_path):
    common = ["generate", "--model", "tiny-flux", "--prompt", "a red fox", "--size", "64x64", "--steps", "2",
              "--seed", "5", "--devices", "cpu,cpu"]
    fused, plain = tmp_path / "fused.png", tmp_path / "plain.png"
    r = run_cli([*common, "--out", str(fused)], tiny_cache)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "parallel: context parallelism (ulysses) over 2 ranks (cpu, cpu) on transformer" in r.stdout
    assert "transformer (FluxTransformer2DModel): flux adapter" in r.stdout  # ditfuse mounted
    assert r.stdout.count(f"wrote {fused}") == 1  # rank 0 reports and writes; rank 1 is silent
    r = run_cli([*common, "--no-accelerate", "--out", str(plain)], tiny_cache)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    a, b = np.asarray(Image.open(fused)), np.asarray(Image.open(plain))
    assert a.shape == (64, 64, 3)
    assert np.array_equal(a, b), f"{int((a != b).sum())} pixel values differ"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.png", "plain.png"]


def test_video_over_two_ranks_equals_plain_diffusers(tiny_cache, tmp_path):
    from ditfuse.runtime.video_io import decode_frames

    common = ["generate", "--model", "tiny-wan", "--prompt", "a fox", "--size", "64x64", "--frames", "5",
              "--steps", "2", "--seed", "1", "--devices", "cpu,cpu"]
    fused, plain = tmp_path / "fused.mp4", tmp_path / "plain.mp4"
    r = run_cli([*common, "--out", str(fused)], tiny_cache)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "transformer (WanTransformer3DModel): wan adapter" in r.stdout
    r = run_cli([*common, "--no-accelerate", "--out", str(plain)], tiny_cache)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    a, b = decode_frames(fused), decode_frames(plain)
    assert a.shape == (5, 64, 64, 3)
    assert np.array_equal(a, b)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--gpus", "2"], "asked for 2 GPUs, but 0 CUDA devices are visible"),
        (["--devices", "cpu,cpu", "--parallel-mode", "ring"], "ring attention needs a GPU attention backend"),
        (["--devices", "cpu,cuda:0"], "--devices takes a comma-separated list of one kind"),
        (["--devices", "cpu,cpu", "--gpus", "3"], "--gpus 3 does not match --devices (2 devices)"),
    ],
)
def test_parallel_argument_errors(tiny_cache, tmp_path, extra, message):
    r = run_cli(["generate", "--prompt", "x", "--out", str(tmp_path / "x.png"), *extra], tiny_cache, interpret=False,
                timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "x.png").exists()
