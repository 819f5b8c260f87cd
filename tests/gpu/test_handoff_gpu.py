"""Cross-block fusion on CUDA (ditfuse/models/handoff.py) at real widths: bitwise equal to plain
diffusers with the hand-offs provably used (the successor took the fused op's LayerNorm output),
at the first and last block of each list, with a block skipped by a user hook, with SD3's
skip_layers, and for Wan 2.2 TI2V's per-token modulation. The CPU twin (reference chains and every
intervention between blocks): tests/cpu/test_handoff.py."""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models.base import handoff_counts
from tests.support.engaged import assert_engaged

DEV = "cuda"
OP = "norm.gate_residual_layernorm_modulate"


def _compare(m, inp, links, used_per_call=None, label=""):
    ditfuse.gate.reset()
    with torch.no_grad():
        base = m(**inp)[0]
        h = ditfuse.accelerate(m)
        try:
            first, second = m(**inp)[0], m(**inp)[0]
            counts = handoff_counts(m)
        finally:
            h.unmount()
    assert_bitwise_equal(first, base, f"{label} first call")
    assert_bitwise_equal(second, base, f"{label} second call")
    used = links if used_per_call is None else used_per_call
    assert counts["links"] == links and counts["used"] == 2 * used and counts["discarded"] == 0, counts
    assert_engaged([OP])


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_dev_width(batch):
    fam = families.get("flux")
    m = fam.build("dev", (3, 3), device=DEV)
    inp = fam.make_inputs(m, batch, "512x512", device=DEV, txt_tokens=77)
    _compare(m, inp, links=4, label=f"flux dev width B={batch}")


@pytest.mark.parametrize("load", ["pretrained", "plain"])
@pytest.mark.parametrize("batch", [1, 2])
def test_wan_1_3b_width(load, batch):
    fam = families.get("wan")
    m = fam.build("dev", (3,), device=DEV, load=load)
    inp = fam.make_inputs(m, batch, "320x192x9", device=DEV)
    _compare(m, inp, links=2, label=f"wan 1.3B width {load} B={batch}")


def test_wan_ti2v_per_token_modulation():
    fam = families.get("wan")
    m = fam.build("ti2v-5b", (2,), device=DEV, load="pretrained")
    inp = fam.make_inputs(m, 1, "640x352x17", device=DEV, per_token_timestep=True)
    _compare(m, inp, links=1, label="wan ti2v per-token")


@pytest.mark.parametrize("family,config,layers,links", [
    ("sd3", "medium", (4,), 3), ("qwenimage", "dev", (3,), 2), ("flux2", "dev", (2, 3), 3),
])
def test_image_families(family, config, layers, links):
    fam = families.get(family)
    m = fam.build(config, layers, device=DEV)
    inp = fam.make_inputs(m, 2, "512x512", device=DEV, txt_tokens=77)
    _compare(m, inp, links=links, label=f"{family} {config}")


class _SkipBlock(ModelHook):
    def new_forward(self, module, *args, **kwargs):
        return kwargs["encoder_hidden_states"], kwargs["hidden_states"]


def test_flux_block_skipped_by_a_user_hook():
    fam = families.get("flux")
    m = fam.build("dev", (4, 2), device=DEV)
    HookRegistry.check_if_exists_or_initialize(m.transformer_blocks[1]).register_hook(_SkipBlock(), "user.skip")
    inp = fam.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=77)
    # dual 0->1 not speculated (foreign hook), 1->2 never produced, 2->3 used; single 0->1 used
    _compare(m, inp, links=4, used_per_call=2, label="flux, dual block 1 skipped by a hook")


def test_sd3_skip_layers():
    fam = families.get("sd3")
    m = fam.build("medium", (4,), device=DEV)
    inp = fam.make_inputs(m, 2, "512x512", device=DEV, txt_tokens=77)
    inp["skip_layers"] = [1]
    ditfuse.gate.reset()
    with torch.no_grad():
        base = m(**inp)[0]
        h = ditfuse.accelerate(m)
        try:
            outs = [m(**inp)[0] for _ in range(2)]
            counts = handoff_counts(m)
        finally:
            h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"sd3 skip_layers=[1] call {i}")
    assert counts == {"links": 3, "used": 2, "discarded": 1}, counts
