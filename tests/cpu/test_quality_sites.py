import pytest
import torch
from diffusers.hooks import ModelHook

from ditfuse.contracts import quality as Q
from ditfuse.contracts.quality import Guard, Quality

from .tiny import flux_inputs, tiny_flux


def test_quality_parse():
    assert Quality.parse(None) is Quality.LOSSLESS
    assert Quality.parse(" HIGH ") is Quality.HIGH
    assert Quality.parse(Quality.HIGH) is Quality.HIGH
    with pytest.raises(ValueError, match="allowed values: lossless, high"):
        Quality.parse("ultra")
    with pytest.raises(ValueError, match="allowed values"):
        Quality.parse(3)


class ScaleOutput(ModelHook):
    """A 'close' fast forward for tests: the original forward, output nudged."""

    def new_forward(self, module, *args, **kwargs):
        out = self.fn_ref.original_forward(*args, **kwargs)
        return tuple(o * 1.001 for o in out)


def _mark_all(model, failing_guard_at=None):
    for i, block in enumerate([*model.transformer_blocks, *model.single_transformer_blocks]):
        guards = [Guard("dtype", lambda m: None)]
        if i == failing_guard_at:
            guards.append(Guard("bias", lambda m: "proj has no bias"))
        Q.mark(block, "test.nudge", guards, lambda m: ScaleOutput())


def _run(model, inp):
    with torch.no_grad():
        return model(**inp)[0]


def test_mount_unmount_restores_output_bitwise():
    m = tiny_flux(layers=(2, 2))
    inp = flux_inputs(m, batch=2)
    base = _run(m, inp)
    _mark_all(m)
    assert len(Q.sites(m)) == 4 and Q.mounted(m) == []
    res = Q.mount(m, "high")
    assert res.ok and len(res.mounted) == 4 and len(Q.mounted(m)) == 4
    assert not torch.equal(_run(m, inp), base)  # the site really runs
    assert Q.mount(m, "high").ok and len(Q.mounted(m)) == 4  # idempotent
    res = Q.mount(m, "lossless")
    assert len(res.unmounted) == 4 and Q.mounted(m) == []
    assert torch.equal(_run(m, inp), base)


def test_all_or_nothing():
    m = tiny_flux(layers=(2, 2))
    inp = flux_inputs(m)
    base = _run(m, inp)
    _mark_all(m, failing_guard_at=3)
    res = Q.mount(m, Quality.HIGH)
    assert not res.ok and res.mounted == []
    assert res.failed.guard == "bias" and res.failed.reason == "proj has no bias"
    assert "single_transformer_blocks.1" in str(res.failed)
    assert Q.mounted(m) == []
    assert torch.equal(_run(m, inp), base)


def test_failed_mount_removes_previously_mounted_sites():
    m = tiny_flux(layers=(1, 1))
    inp = flux_inputs(m)
    base = _run(m, inp)
    _mark_all(m)
    assert Q.mount(m, "high").ok
    flag = {"fail": False}
    Q.mark(m.transformer_blocks[0], "test.other", [Guard("flag", lambda mod: "off" if flag["fail"] else None)], lambda mod: ScaleOutput())
    flag["fail"] = True
    res = Q.mount(m, "high")
    assert not res.ok and Q.mounted(m) == []
    assert torch.equal(_run(m, inp), base)


def test_guard_exception_counts_as_failure():
    m = tiny_flux()

    def broken(mod):
        raise KeyError("weight")

    Q.mark(m.transformer_blocks[0], "test.x", [Guard("weight", broken)], lambda mod: ScaleOutput())
    res = Q.mount(m, "high")
    assert not res.ok and "guard raised KeyError" in res.failed.reason


def test_site_hooks_compose_with_diffusers_registry():
    m = tiny_flux()
    _mark_all(m)
    Q.mount(m, "high")
    reg = m.transformer_blocks[0]._diffusers_hook
    assert "ditfuse.high.test.nudge" in reg.hooks
    Q.unmount(m)
    assert "ditfuse.high.test.nudge" not in reg.hooks
