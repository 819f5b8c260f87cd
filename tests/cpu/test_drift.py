"""ditfuse drift: metrics, and a 2-step transformer-only run where lossless is bitwise identical."""

import json
import math

import pytest

import torch

from ditfuse.contracts import admission
from ditfuse.contracts.ops import CLOSE
from ditfuse.runtime import cli
from ditfuse.runtime.drift import psnr, ssim


def test_psnr():
    ref = torch.linspace(0, 1, 100)
    assert psnr(ref.clone(), ref) == math.inf
    x = ref + 0.01  # mse 1e-4, range 1 -> 40 dB
    assert abs(psnr(x, ref) - 40.0) < 1e-4
    assert abs(psnr(x, ref, data_range=2.0) - (40.0 + 20 * math.log10(2))) < 1e-4


def test_ssim():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(1, 3, 32, 32, generator=g)
    assert ssim(img.clone(), img, 1.0) == 1.0
    slight = ssim((img + 0.01 * torch.randn(img.shape, generator=g)).clamp(0, 1), img, 1.0)
    heavy = ssim(torch.rand(1, 3, 32, 32, generator=g), img, 1.0)
    assert 0.9 < slight < 1.0 and heavy < 0.2 and heavy < slight
    # a constant offset barely moves structure but lowers luminance similarity a little
    assert 0.9 < ssim((img + 0.05).clamp(0, 1), img, 1.0) < 1.0
    # small images shrink the window instead of failing
    assert ssim(img[..., :5, :5] + 0.01, img[..., :5, :5], 1.0) < 1.0


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_drift_transformer_only_lossless_identical_high_drifts(tmp_path, capsys):
    with admission.override_records([admission.admitted_record(op) for op in CLOSE]):
        rc = cli.main([
            "drift", "--model", "tiny-flux", "--transformer-only", "--steps", "2", "--size", "32x32",
            "--txt-tokens", "4", "--dtype", "bf16", "--device", "cpu", "--out-dir", str(tmp_path), "--json",
        ])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "drift.json").read_text()) == res
    modes = res["modes"]
    assert list(modes) == ["eager", "lossless", "high"]
    lo, hi = modes["lossless"], modes["high"]
    assert lo["bitwise_identical"] and lo["step_psnr"] == ["inf", "inf"] and lo["final_psnr"] == "inf"
    assert lo["step_max_abs"] == [0.0, 0.0] and lo["final_ssim"] == 1.0
    assert hi["note"].startswith("high mounted"), hi["note"]
    assert not hi["bitwise_identical"]
    assert all(isinstance(v, float) and 15 < v < 120 for v in hi["step_psnr"]), hi["step_psnr"]
    assert 0 < hi["final_ssim"] < 1 and max(hi["step_max_abs"]) > 0
    assert res["config"]["size"] == "32x32" and res["config"]["dtype"] == "bfloat16"


def test_drift_rejects_flux_dev_size_without_transformer_only(capsys):
    assert cli.main(["drift", "--model", "flux-dev-size"]) == 2
    assert "--transformer-only" in capsys.readouterr().err


@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_drift_wan_transformer_only_lossless_identical(tmp_path, capsys):
    with admission.override_records([admission.admitted_record(op) for op in CLOSE]):
        rc = cli.main([
            "drift", "--model", "wan-tiny", "--transformer-only", "--steps", "1", "--size", "32x32x5",
            "--txt-tokens", "4", "--dtype", "bf16", "--device", "cpu", "--out-dir", str(tmp_path), "--json",
        ])
    assert rc == 0
    modes = json.loads(capsys.readouterr().out)["modes"]
    assert modes["lossless"]["bitwise_identical"] and modes["high"]["note"].startswith("high mounted")
    assert not modes["high"]["bitwise_identical"]
