import pytest
import torch

from ditfuse.models import families
from tests.support import reference_checks as rc

from .tiny import flux_inputs, tiny_flux


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("check", rc.ALL, ids=lambda f: f.__name__)
def test_reference_equals_diffusers_module(check, dtype):
    check("cpu", dtype)


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_fast_forwards_on_reference_chains_equal_diffusers(batch, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    m = tiny_flux(dtype=torch.bfloat16, layers=(2, 2))
    rc.check_model_with_references(m, flux_inputs(m, batch=batch, dtype=torch.bfloat16), "flux")


@pytest.mark.parametrize("config,per_token,load", [
    ("tiny", False, "pretrained"), ("tiny", False, "plain"), ("tiny", True, "pretrained"), ("tiny-i2v", False, "plain"),
], ids=["t2v-pretrained", "t2v-plain", "ti2v-per-token", "i2v"])
@pytest.mark.slow  # a tiny model through the interpreter: seconds on 2 cores
def test_wan_fast_forwards_on_reference_chains_equal_diffusers(config, per_token, load, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    fam = families.get("wan")
    m = fam.build(config, device="cpu", load=load)
    inp = fam.make_inputs(m, 2, "32x16x5", device="cpu", txt_tokens=7, per_token_timestep=per_token, image_tokens=5)
    rc.check_model_with_references(m, inp, f"wan {config}")


@pytest.mark.parametrize("config,billions", [("dev", 1.419), ("ti2v-5b", 5.000), ("t2v-14b", 14.288), ("i2v-14b", 16.395)])
def test_wan_bench_configs_are_the_released_sizes(config, billions):
    """The benchmark configs build the released models' layouts (parameter counts of Wan2.1-T2V-1.3B,
    Wan2.2-TI2V-5B, Wan2.1-T2V-14B and Wan2.1-I2V-14B-480P), on the meta device: no memory."""
    fam = families.get("wan")
    m = fam.build(config, device="meta", load="plain")
    assert round(sum(p.numel() for p in m.parameters()) / 1e9, 3) == billions


def test_wan_inputs_per_token_timestep_follows_the_ti2v_layout():
    """TI2V-5B's pipeline runs with expand_timesteps (a timestep per token); the other layouts one
    per sample; an explicit argument wins."""
    fam = families.get("wan")
    five = fam.build("ti2v-5b", (1,), device="meta", load="plain")
    t2v = fam.build("tiny", device="cpu", load="plain")
    assert fam.make_inputs(five, 2, "64x64x5", device="meta", txt_tokens=3)["timestep"].shape == (2, 2 * 2 * 2)
    assert fam.make_inputs(five, 2, "64x64x5", device="meta", txt_tokens=3, per_token_timestep=False)["timestep"].shape == (2,)
    assert fam.make_inputs(t2v, 2, "32x16x5", device="cpu", txt_tokens=3)["timestep"].shape == (2,)
