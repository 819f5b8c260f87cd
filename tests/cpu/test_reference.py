import pytest
import torch

from tests import reference_checks as rc

from .tiny import flux_inputs, tiny_flux


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("check", rc.ALL, ids=lambda f: f.__name__)
def test_reference_equals_diffusers_module(check, dtype):
    check("cpu", dtype)


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_fast_forwards_on_reference_chains_equal_diffusers(batch, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    m = tiny_flux(dtype=torch.bfloat16, layers=(2, 2))
    rc.check_flux_blocks_with_references(m, flux_inputs(m, batch=batch, dtype=torch.bfloat16))
