"""CUDA graphs follow the model: after a LoRA is loaded, scaled or disabled, or a parameter is
replaced, the next outputs are bitwise equal to plain diffusers in the same state (the stale graph
is dropped and a new one captured), never a replay of the old model: the replay that runs before
the state check (models/cuda_graph.py) is discarded. The bookkeeping is CPU-tested
(tests/cpu/test_cuda_graph_cache.py); this is the capture and replay itself."""

import copy

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

from tests.cpu.tiny import flux_inputs
from tests.gpu.test_flux_adapter_gpu import DEV, _model, assert_engaged

peft = pytest.importorskip("peft")


def _lora(m, seed):
    targets = [n for n, mod in m.named_modules() if type(mod) is torch.nn.Linear]
    torch.manual_seed(seed)
    m.add_adapter(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets))


def test_graphs_follow_lora_and_parameter_changes():
    m = _model(24, (1, 1), True)
    twin = copy.deepcopy(m)  # plain diffusers, changed the same way at each stage
    inp = flux_inputs(m, batch=1, img=1024, txt=512, dtype=torch.bfloat16, device=DEV)

    def stage(what, change):
        change(m)
        change(twin)
        with torch.no_grad():
            ref = twin(**inp)[0]
            outs = [m(**inp)[0] for _ in range(3)]  # warm-up, capture, replay
        for i, o in enumerate(outs):
            assert_bitwise_equal(o, ref, f"{what}, call {i}")
        return ref

    with torch.no_grad():
        h = ditfuse.accelerate(m, cuda_graph=True)
    runner = h._graphs["FluxTransformer2DModel"]
    def new_proj_out(x):  # before the LoRA: a LoRA-wrapped proj_out has no weight of its own
        torch.manual_seed(11)
        x.proj_out.weight = torch.nn.Parameter(torch.randn_like(x.proj_out.weight) * 0.02)
        # the next call replays the stale graph before it sees the change: the old weight's
        # memory must still be there (GraphRunner.pinned) even with the allocator's cache emptied
        torch.cuda.empty_cache()

    try:
        stage("plain", lambda x: None)
        assert (runner.captures, runner.state_changes) == (1, 0)
        base = stage("proj_out replaced", new_proj_out)
        lora = stage("LoRA loaded", lambda x: _lora(x, 3))
        assert not torch.equal(lora, base)
        stage("LoRA weight 0.5", lambda x: x.set_adapters(["default"], weights=[0.5]))
        off = stage("LoRA disabled", lambda x: x.disable_adapters())
        assert_bitwise_equal(off, base, "LoRA disabled vs no LoRA")
        # each change dropped the graph once and captured a new one, which then replayed; the
        # first call after each change replayed the stale graph, saw the change, discarded it
        assert runner.state_changes == 4 and runner.captures == 5 and runner.replays >= 5
        assert runner.discarded == 4
    finally:
        h.unmount()
    assert_engaged()
