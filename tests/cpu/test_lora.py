"""LoRA (PEFT adapters, as diffusers' ``load_lora_weights`` injects them) on accelerated models.

A LoRA wraps each targeted ``nn.Linear`` in a ``peft`` layer whose forward adds the low-rank delta.
The fast forwards call their projections as modules, so the delta is applied; the sites that read
a Linear's weight directly (``layout.linear_cat``) ask ``plain_linear`` per call and take the
module path for a wrapped one. These tests hold that for every family, with the LoRA loaded before
``accelerate`` (the usual order: the mount must not refuse a block because a Linear is wrapped)
and after it, with a LoRA scale, and after the adapters are disabled again.

They run the reference chains (``DITFUSE_DISABLE=all``): what is under test is which code the
sites run, not the kernels' rounding (tested per op, and bitwise on the GPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

from .test_handoff import CASES, _build, _case_inputs

peft = pytest.importorskip("peft")

# family -> builder: the hand-off cases (linked blocks) and Z-Image
BUILDS = {**{f: build for f, (build, _) in CASES.items()}, "zimage": lambda dt: _build("zimage", None, dt)}
# the keywords diffusers' @apply_lora_scale reads a LoRA scale from
_SCALE_KW = ("joint_attention_kwargs", "attention_kwargs")


@pytest.fixture(autouse=True)
def reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the fused ops' device check: the CPU counts


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=_LINEARS)


_LINEARS: list[str] = []


def _add_lora(m, seed: int = 7) -> None:
    """A random LoRA on every ``nn.Linear`` of ``m`` (full names: suffixes such as ``0`` would
    also match blocks); the same seed gives the same adapter weights on a twin model."""
    _LINEARS[:] = [n for n, mod in m.named_modules() if type(mod) is torch.nn.Linear]
    torch.manual_seed(seed)
    m.add_adapter(_lora_config())


def _run(m, inp, **kw):
    with torch.no_grad():
        out = m(**inp, **kw)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one latent per sample


def _scale_kwargs(m) -> dict:
    params = inspect.signature(type(m).forward).parameters
    for name in _SCALE_KW:
        if name in params:
            return {name: {"scale": 0.5}}
    return {}


def _mounted(h) -> tuple[list, list]:
    c = h.report().components[0]
    assert c.status == "mounted", c
    return sorted(s for _, s in c.sites), sorted(c.skipped_sites)


@pytest.mark.slow  # tiny models, reference chains: a few seconds each on 2 cores
@pytest.mark.parametrize("order", ["lora_then_accelerate", "accelerate_then_lora"])
@pytest.mark.parametrize("family", list(BUILDS))
def test_lora_bitwise_and_sites_kept(family, order):
    build = BUILDS[family]
    plain = build(torch.bfloat16)
    inp = _case_inputs(family, plain, 1)
    base = _run(plain, inp)
    # the sites a LoRA-free model mounts: a LoRA must not cost any of them
    h = ditfuse.accelerate(plain)
    want_sites, want_skipped = _mounted(h)
    h.unmount()

    twin = build(torch.bfloat16)  # plain diffusers with the same LoRA: the reference
    _add_lora(twin)
    ref = _run(twin, inp)
    assert not torch.equal(ref, base), "the LoRA does not change the output: the test could not fail"

    m = build(torch.bfloat16)
    if order == "lora_then_accelerate":
        _add_lora(m)
        h = ditfuse.accelerate(m)
    else:
        h = ditfuse.accelerate(m)
        assert_bitwise_equal(_run(m, inp), base, f"{family}: accelerated, before the LoRA")
        _add_lora(m)
    try:
        assert _mounted(h) == (want_sites, want_skipped), "a LoRA-wrapped Linear made the mount skip a site"
        assert_bitwise_equal(_run(m, inp), ref, f"{family}: accelerated with the LoRA ({order})")
        assert_bitwise_equal(_run(m, inp), ref, f"{family}: second call")
        scale = _scale_kwargs(m)
        if scale:
            assert_bitwise_equal(_run(m, inp, **scale), _run(twin, inp, **scale), f"{family}: LoRA scale 0.5")
        m.disable_adapters()
        twin.disable_adapters()
        assert_bitwise_equal(_run(m, inp), base, f"{family}: adapters disabled")
    finally:
        h.unmount()


def test_linear_module_sees_through_peft_wrappers():
    from ditfuse.models.base import linear_module, plain_linear

    lin = torch.nn.Linear(8, 12)
    holder = torch.nn.Sequential(lin)
    torch.manual_seed(0)
    wrapped = peft.inject_adapter_in_model(
        peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False), holder)[0]
    assert type(wrapped) is not torch.nn.Linear
    assert linear_module(lin) is lin
    assert linear_module(wrapped) is lin  # its base layer: the shape a site checks
    assert not plain_linear(wrapped)  # but its weight alone is not its output
    assert linear_module(torch.nn.Conv1d(8, 12, 1)) is None
    assert linear_module(None) is None
