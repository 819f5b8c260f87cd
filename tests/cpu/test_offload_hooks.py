"""accelerate's and diffusers' offload / casting hooks on accelerated models.

- Sequential offload (``enable_sequential_cpu_offload`` = accelerate's ``cpu_offload``) keeps
  weights on the meta device until each module's own forward loads them. A fast forward reads a
  norm's weight without calling the norm, so those sites must run diffusers' forward: before,
  every family crashed ("Tensor on device meta is not on the expected device").
- Model offload (``enable_model_cpu_offload``) wraps the transformer's forward, and diffusers
  removes and re-adds that wrapper after every pipeline call (``maybe_free_model_hooks``). The
  ditfuse chain sits under the wrapper and stays on the call path across those cycles, and
  unmounting leaves the wrapper working (before, unmount dropped it).
- Layerwise casting (fp8 storage, upcast in each module's hook), norms included.

Reference chains (``DITFUSE_DISABLE=all``): what is under test is which code runs, and that it
gives diffusers' output bitwise; execution stays on the CPU (``execution_device="cpu"``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import pos_cache
from ditfuse.models.base import site_hooks

from .test_handoff import CASES, _build, _case_inputs
from .tiny import flux_inputs, tiny_flux

BUILDS = {**{f: build for f, (build, _) in CASES.items()}, "zimage": lambda dt: _build("zimage", None, dt)}


@pytest.fixture(autouse=True)
def reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _run(m, inp):
    with torch.no_grad():
        out = m(**inp)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one latent per sample


def _offloaded_and_accelerated(m, order: str):
    """Sequential CPU offload (execution on the CPU) and ditfuse, in ``order``; the handle."""
    from accelerate import cpu_offload

    if order == "offload_then_accelerate":
        cpu_offload(m, execution_device=torch.device("cpu"))
        return ditfuse.accelerate(m)
    h = ditfuse.accelerate(m)
    cpu_offload(m, execution_device=torch.device("cpu"))
    return h


@pytest.mark.slow  # tiny models, reference chains: a few seconds each on 2 cores
@pytest.mark.parametrize("order", ["offload_then_accelerate", "accelerate_then_offload"])
@pytest.mark.parametrize("family", list(BUILDS))
def test_sequential_offload_bitwise(family, order, caplog):
    plain = BUILDS[family](torch.bfloat16)
    inp = _case_inputs(family, plain, 1)
    base = _run(plain, inp)
    m = BUILDS[family](torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="ditfuse.models"):
        h = _offloaded_and_accelerated(m, order)
        assert h.report().components[0].status == "mounted"
        assert_bitwise_equal(_run(m, inp), base, f"{family}: sequential offload ({order})")
        assert_bitwise_equal(_run(m, inp), base, f"{family}: second call")
    fell_back = {hook.site.name for _, _, hook in site_hooks(m) if hook.offload_calls}
    h.unmount()
    assert fell_back, "no site noticed the offloaded weights"
    # said once per site, not per call
    assert all(sum(f"ditfuse: {s} runs diffusers' forward" in r.getMessage() for r in caplog.records) <= 1
               for s in fell_back)


def _offload_hook(m):
    from accelerate import cpu_offload_with_hook

    cpu_offload_with_hook(m, execution_device=torch.device("cpu"))


def _free_hooks(m):
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(m, recurse=True)  # diffusers' remove_all_hooks, per component


class _Counting:
    """accelerate hook counting its calls (stands for CpuOffload's pre_forward)."""

    def __init__(self):
        from accelerate.hooks import ModelHook

        class Hook(ModelHook):
            def pre_forward(hook, module, *args, **kwargs):
                self.calls += 1
                return args, kwargs

        self.calls = 0
        self.hook = Hook()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["offload_then_accelerate", "accelerate_then_offload"])
def test_model_offload_cycles_keep_the_chain(order):
    """As diffusers does with enable_model_cpu_offload: the hook is removed and added again after
    every pipeline call. The root site (FLUX.1's, which keys the RoPE table cache) stays on the
    call path: the tables are reused from the second call on."""
    m = tiny_flux(dtype=torch.bfloat16, layers=(2, 2))
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    if order == "offload_then_accelerate":
        _offload_hook(m)
        h = ditfuse.accelerate(m)
    else:
        h = ditfuse.accelerate(m)
        _offload_hook(m)
    try:
        for cycle in range(3):
            assert_bitwise_equal(_run(m, inp), base, f"cycle {cycle}")
            _free_hooks(m)
            _offload_hook(m)
        assert pos_cache.counts(m)["hits"] >= 2, f"the root site fell off the call path: {pos_cache.counts(m)}"
        assert not any(hook.offload_calls for _, _, hook in site_hooks(m))
    finally:
        h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")


def _plain_forward(m):
    """Nothing is left around the model's own forward (accelerate's restore leaves the bound
    method it saved in the instance dict; that is the class's forward)."""
    f = m.__dict__.get("forward")
    assert f is None or getattr(f, "__func__", None) is type(m).forward, f"a stale forward is left: {f!r}"


@pytest.mark.parametrize("graphs", [False, True], ids=["", "cuda_graph_runner"])
@pytest.mark.parametrize("order", ["hook_then_accelerate", "accelerate_then_hook"])
def test_unmount_keeps_an_accelerate_hook(order, graphs, monkeypatch):
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU build: no CUDA stubs

    m = tiny_flux(dtype=torch.bfloat16, layers=(1, 1))
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    count = _Counting()
    def mount():
        h = ditfuse.accelerate(m)
        if graphs:  # accelerate(cuda_graph=True) needs CUDA; the runner runs eagerly on the CPU
            h.enable_cuda_graphs(4)
        return h

    if order == "hook_then_accelerate":
        add_hook_to_module(m, count.hook)
        h = mount()
    else:
        h = mount()
        add_hook_to_module(m, count.hook)
    assert_bitwise_equal(_run(m, inp), base, "mounted")
    assert count.calls == 1
    h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "unmounted")
    assert count.calls == 2, "unmount dropped accelerate's hook"
    remove_hook_from_module(m)
    _plain_forward(m)
    assert_bitwise_equal(_run(m, inp), base, "both removed")
    assert count.calls == 2


def test_accelerate_hook_removed_while_mounted_then_unmount():
    """remove_all_hooks while ditfuse is mounted, then unmount: no stale wrapper is restored."""
    from accelerate.hooks import add_hook_to_module

    m = tiny_flux(dtype=torch.bfloat16, layers=(1, 1))
    inp = flux_inputs(m, dtype=torch.bfloat16)
    base = _run(m, inp)
    count = _Counting()
    add_hook_to_module(m, count.hook)
    h = ditfuse.accelerate(m)
    _free_hooks(m)
    assert_bitwise_equal(_run(m, inp), base, "hook removed, still mounted")
    h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "unmounted")
    assert count.calls == 0
    _plain_forward(m)


@pytest.mark.slow
@pytest.mark.parametrize("norms", ["default_skips", "norms_cast_too"])
@pytest.mark.parametrize("family", ["flux", "wan", "zimage"])
def test_layerwise_casting_bitwise(family, norms):
    kw = {} if norms == "default_skips" else {"skip_modules_pattern": ()}
    twin = BUILDS[family](torch.bfloat16)
    inp = _case_inputs(family, twin, 1)
    twin.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, **kw)
    ref = _run(twin, inp)
    m = BUILDS[family](torch.bfloat16)
    h = ditfuse.accelerate(m)
    m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, **kw)
    try:
        assert_bitwise_equal(_run(m, inp), ref, f"{family}: layerwise casting ({norms})")
    finally:
        h.unmount()


@pytest.mark.slow
@pytest.mark.parametrize("order", ["offload_then_accelerate", "accelerate_then_offload"])
@pytest.mark.parametrize("vae", ["AutoencoderKL", "AutoencoderKLWan"])
def test_sequential_offload_vae_bitwise(vae, order):
    """The VAE sites read GroupNorm / RMS_norm weights of submodules that are sites themselves."""
    if vae == "AutoencoderKL":
        from .test_vae_adapter import _decode, _vae

        data, run = torch.randn(1, 4, 9, 7), _decode
    else:
        from .test_wan_vae_adapter import _roundtrip, _vae

        data, run = torch.randn(1, 3, 5, 16, 16), lambda v, x: _roundtrip(v, x)[1]
    base = run(_vae(), data)
    v = _vae()
    h = _offloaded_and_accelerated(v, order)
    try:
        assert_bitwise_equal(run(v, data), base, f"{vae}: sequential offload ({order})")
        assert any(hook.offload_calls for _, _, hook in site_hooks(v))
    finally:
        h.unmount()
