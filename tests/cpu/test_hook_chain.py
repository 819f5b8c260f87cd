"""ditfuse's site hooks sit at the bottom of each module's diffusers hook chain: hooks applied
before ``accelerate`` (context-parallel split/gather, group offloading, caches) keep running
around the fast forward, and unmounting leaves every other hook working."""

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

from .tiny import flux_inputs, tiny_flux


class _ScaleInput(ModelHook):
    """pre_forward hook (like diffusers' context-parallel split): halves the block's image stream."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        kwargs["hidden_states"] = kwargs["hidden_states"] * 0.5
        return args, kwargs


class _CountingForward(ModelHook):
    """new_forward hook (like a cache hook): calls the chain below and scales its image output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def new_forward(self, module, *args, **kwargs):
        self.calls += 1
        enc, hid = self.fn_ref.original_forward(*args, **kwargs)
        return enc, hid * 2.0


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def _chain(block):
    return list(block._diffusers_hook._hook_order)


def _gate_calls(op: str) -> int:
    return sum(ditfuse.gate.report().calls.get(op, {}).values())


@pytest.mark.slow  # a tiny model through the interpreter
@pytest.mark.parametrize("kind", [_ScaleInput, _CountingForward])
def test_hook_applied_before_accelerate_keeps_running(kind):
    m = tiny_flux(layers=(2, 1))
    inp = flux_inputs(m, batch=2)
    block = m.transformer_blocks[0]
    foreign = kind()
    HookRegistry.check_if_exists_or_initialize(block).register_hook(foreign, "user.hook")
    base = _run(m, inp)
    assert foreign.calls == 1

    h = ditfuse.accelerate(m)
    assert _chain(block) == ["ditfuse.flux.dual_block", "user.hook"], "the ditfuse hook must be innermost"
    got = _run(m, inp)
    assert foreign.calls == 2, "the hook applied before accelerate() was skipped by the fast forward"
    assert _gate_calls("norm.layernorm_modulate") > 0, "the fast forward did not run"
    assert_bitwise_equal(got, base, "accelerated, with the user's hook")

    h.unmount()
    assert _chain(block) == ["user.hook"]
    assert_bitwise_equal(_run(m, inp), base, "after unmount, with the user's hook")
    assert foreign.calls == 3, "unmount broke the user's hook"
    HookRegistry.check_if_exists_or_initialize(block).remove_hook("user.hook", recurse=False)
    plain = _run(m, inp)
    assert foreign.calls == 3
    assert not torch.equal(plain, base), "the test hook has no effect on the output: the test proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize("kind", [_ScaleInput, _CountingForward])
def test_hook_applied_after_accelerate_wraps_the_fast_forward(kind):
    m = tiny_flux(layers=(2, 1))
    inp = flux_inputs(m)
    block = m.transformer_blocks[1]
    h = ditfuse.accelerate(m)
    foreign = kind()
    HookRegistry.check_if_exists_or_initialize(block).register_hook(foreign, "user.hook")
    assert _chain(block) == ["ditfuse.flux.dual_block", "user.hook"]
    got = _run(m, inp)
    assert foreign.calls == 1
    h.unmount()
    assert _chain(block) == ["user.hook"]
    assert_bitwise_equal(_run(m, inp), got, "after unmount, with the user's hook")
    assert foreign.calls == 2


def test_innermost_registration_on_a_bare_module():
    """Unit level: the chain order and links on a module with two foreign hooks, without a model."""
    from ditfuse.models.base import SiteHook, register_innermost, remove_hook

    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    reg = HookRegistry.check_if_exists_or_initialize(lin)
    order: list[str] = []

    class Pre(ModelHook):
        def __init__(self, tag):
            super().__init__()
            self.tag = tag

        def pre_forward(self, module, *args, **kwargs):
            order.append(self.tag)
            return args, kwargs

    class Replace(SiteHook, ModelHook):
        def new_forward(self, module, *args, **kwargs):
            order.append("ditfuse")
            return self.fn_ref.original_forward(*args, **kwargs) + 1.0

    reg.register_hook(Pre("a"), "a")
    reg.register_hook(Pre("b"), "b")
    register_innermost(reg, Replace(site=None), "ditfuse.x")
    assert reg._hook_order == ["ditfuse.x", "a", "b"]
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert_bitwise_equal(lin(x), ref + 1.0, "replaced forward")
    assert order == ["b", "a", "ditfuse"]
    order.clear()
    remove_hook(reg, "ditfuse.x")
    assert reg._hook_order == ["a", "b"]
    assert_bitwise_equal(lin(x), ref, "after removal")
    assert order == ["b", "a"]
    with pytest.raises(ValueError, match="already registered"):
        register_innermost(reg, Replace(site=None), "a")
