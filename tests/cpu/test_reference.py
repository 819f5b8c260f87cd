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
