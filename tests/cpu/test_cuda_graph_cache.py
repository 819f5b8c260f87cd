"""The CUDA-graph runner's bookkeeping (no GPU needed): at most ``max_graphs`` captured graphs, the
least recently replayed one released first, an evicted shape starting over from one eager call.
The captures and replays themselves are GPU-tested (tests/gpu/test_flux_adapter_gpu.py)."""

import pytest
import torch

import ditfuse
from ditfuse.models.cuda_graph import GraphRunner, _Entry


class _M(torch.nn.Module):
    def forward(self, x):
        return x


def _captured(runner: GraphRunner, key: str) -> _Entry:
    e = runner.entries.setdefault(key, _Entry())
    e.graph, e.calls, e.static_in, e.static_out = object(), 5, {"x": torch.zeros(1)}, torch.zeros(1)
    runner.live[key] = None
    return e


def test_least_recently_replayed_graph_is_released():
    r = GraphRunner(_M(), max_graphs=2)
    a, b = _captured(r, "a"), _captured(r, "b")
    r.live.move_to_end("a")  # "a" replayed after "b"
    r._make_room()  # room for one more: "b" goes
    assert list(r.live) == ["a"] and r.evictions == 1
    assert b.graph is None and b.static_in == {} and b.static_out is None and b.calls == 0
    assert a.graph is not None and a.calls == 5
    r._make_room()  # below the cap: nothing to release
    assert list(r.live) == ["a"] and r.evictions == 1
    r.invalidate()
    assert not r.live and not r.entries


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_graphs"):
        GraphRunner(_M(), max_graphs=0)
    with pytest.raises(ValueError, match="max_cuda_graphs"):
        ditfuse.accelerate(_M(), cuda_graph=True, max_cuda_graphs=0)


# -- the model's state: a change drops the graphs (models/cuda_graph.py model_state) --------------


def _tiny():
    from .tiny import tiny_flux

    return tiny_flux(dtype=torch.bfloat16, layers=(1, 1))


def _runner_with_graph(m) -> GraphRunner:
    r = GraphRunner(m, max_graphs=4)
    assert r.state_allows(m)
    _captured(r, "shape")
    return r


def _dropped(r: GraphRunner, m) -> bool:
    """The runner saw a change: its graph is gone (and it still allows graphs)."""
    assert r.state_allows(m)
    return not r.entries and not r.live


def test_unchanged_model_keeps_its_graphs():
    m = _tiny()
    r = _runner_with_graph(m)
    assert r.state_allows(m) and r.state_allows(m)
    assert list(r.live) == ["shape"] and r.state_changes == 0
    with torch.no_grad():
        m.transformer_blocks[0].attn.to_q.weight.mul_(2)  # in place: a replay reads the new values
    assert r.state_allows(m) and list(r.live) == ["shape"]


@pytest.mark.parametrize("change", [
    "replace_parameter", "replace_module", "dtype", "processor", "forward_hook", "pre_hook", "global_hook",
    "train", "diffusers_ditfuse_hook",
])
def test_model_changes_drop_the_graphs(change):
    m = _tiny()
    r = _runner_with_graph(m)
    attn = m.transformer_blocks[0].attn
    handles = []
    if change == "replace_parameter":
        attn.to_q.weight = torch.nn.Parameter(attn.to_q.weight.detach().clone())
    elif change == "replace_module":
        old = attn.to_k
        attn.to_k = torch.nn.Linear(old.in_features, old.out_features).to(torch.bfloat16)
    elif change == "dtype":
        m.to(torch.float16)
    elif change == "processor":
        attn.set_processor(type(attn.processor)())
    elif change == "forward_hook":
        handles.append(attn.register_forward_hook(lambda *a: None))
    elif change == "pre_hook":
        handles.append(m.proj_out.register_forward_pre_hook(lambda *a: None))
    elif change == "global_hook":
        handles.append(torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
    elif change == "train":
        m.transformer_blocks[0].train()
    elif change == "diffusers_ditfuse_hook":  # e.g. the high tier's sites mounted: a new forward
        from diffusers.hooks import HookRegistry, ModelHook

        HookRegistry.check_if_exists_or_initialize(m.norm_out).register_hook(ModelHook(), "ditfuse.test")
    try:
        assert _dropped(r, m), f"{change}: the graph survived"
        assert r.state_changes == 1
        assert r.state_allows(m) and r.state_changes == 1  # and the new state is the reference now
    finally:
        for h in handles:
            h.remove()


def test_lora_load_scale_disable_and_fuse_drop_the_graphs():
    peft = pytest.importorskip("peft")
    m = _tiny()
    r = _runner_with_graph(m)
    targets = [n for n, mod in m.named_modules() if type(mod) is torch.nn.Linear]
    m.add_adapter(peft.LoraConfig(r=2, init_lora_weights=False, target_modules=targets))
    assert _dropped(r, m), "LoRA loaded: the graph survived"
    steps = [
        ("set_adapters weight", lambda: m.set_adapters(["default"], weights=[0.5])),
        ("disable_adapters", m.disable_adapters),
        ("enable_adapters", m.enable_adapters),
        ("fuse_lora", lambda: m.fuse_lora(lora_scale=1.0)),
        ("unload_lora", m.unload_lora),
    ]
    for what, step in steps:
        _captured(r, "shape")
        step()
        assert _dropped(r, m), f"{what}: the graph survived"


def test_offload_hooks_keep_the_model_eager(caplog):
    from accelerate.hooks import CpuOffload, add_hook_to_module, remove_hook_from_module

    m = _tiny()
    r = _runner_with_graph(m)
    add_hook_to_module(m.transformer_blocks[0], CpuOffload())
    with caplog.at_level("WARNING", logger="ditfuse.cuda_graph"):
        assert not r.state_allows(m)
        assert not r.state_allows(m)
    assert not r.entries and not r.live  # stale graphs released
    warned = [rec.getMessage() for rec in caplog.records if "CUDA graphs are off" in rec.getMessage()]
    assert len(warned) == 1 and "transformer_blocks.0" in warned[0] and "accelerate hook" in warned[0]
    remove_hook_from_module(m.transformer_blocks[0])
    assert r.state_allows(m) and r.refused is None


def test_foreign_diffusers_hook_keeps_the_model_eager():
    from diffusers.hooks import HookRegistry, ModelHook

    m = _tiny()
    r = _runner_with_graph(m)
    HookRegistry.check_if_exists_or_initialize(m.single_transformer_blocks[0]).register_hook(ModelHook(), "cache")
    assert not r.state_allows(m)
    assert "single_transformer_blocks.0" in r.refused and "cache" in r.refused


def test_a_model_that_changes_every_call_is_named(caplog):
    m = _tiny()
    r = GraphRunner(m)
    with caplog.at_level("WARNING", logger="ditfuse.cuda_graph"):
        for i in range(5):
            m.proj_out.weight = torch.nn.Parameter(m.proj_out.weight.detach().clone())
            assert r.state_allows(m)
    warned = [rec.getMessage() for rec in caplog.records if "changes between every call" in rec.getMessage()]
    assert len(warned) == 1 and "proj_out" in warned[0]
    assert r.state_changes == 4


# -- a replay's state check runs after the replay is enqueued (models/cuda_graph.py _replay) ------


class _FakeGraph:
    def __init__(self, log: list) -> None:
        self.log = log

    def replay(self) -> None:
        self.log.append("replay")


def _replay_setup(monkeypatch):
    """A tiny FLUX.1 with one 'captured' signature whose graph logs its replays, the state walk
    logging too, and an eager forward that logs and returns a marker."""
    import ditfuse.models.cuda_graph as cg

    m = _tiny()
    r = _runner_with_graph(m)
    log: list = []
    walk = cg.model_state
    monkeypatch.setattr(cg, "model_state", lambda mod: (log.append("state"), walk(mod))[1])
    e = r.entries["shape"]
    e.graph = _FakeGraph(log)
    e.static_in = {"x": torch.zeros(3)}
    e.static_out = torch.arange(3.0)
    r.pinned = [m.proj_out.weight.untyped_storage()]
    eager_out = torch.full((3,), 7.0)

    def original(*a, **k):
        log.append("eager")
        return eager_out

    def call():
        return r._replay(m, "shape", e, {"x": torch.ones(3)}, original, (), {})

    return m, r, e, log, call, eager_out


def test_a_replay_is_enqueued_before_the_state_walk(monkeypatch):
    m, r, e, log, call, _ = _replay_setup(monkeypatch)
    out = call()
    assert log == ["replay", "state"], log  # the GPU works while the host walks the modules
    assert torch.equal(out, torch.arange(3.0)) and out is not e.static_out
    assert torch.equal(e.static_in["x"], torch.ones(3))
    assert (r.replays, r.discarded, r.state_changes) == (1, 0, 0) and list(r.live) == ["shape"]


def test_a_change_seen_after_the_replay_discards_it(monkeypatch):
    m, r, e, log, call, eager_out = _replay_setup(monkeypatch)
    m.proj_out.weight = torch.nn.Parameter(m.proj_out.weight.detach().clone())
    out = call()
    assert log == ["replay", "state", "eager"], log
    assert out is eager_out  # the stale replay's output is never returned
    assert (r.replays, r.discarded, r.state_changes) == (0, 1, 1)
    assert not r.live and r.pinned == []  # every graph dropped, the old weights let go
    fresh = r.entries["shape"]
    assert fresh is not e and fresh.graph is None and fresh.calls == 1  # the next call captures


def test_a_refusal_seen_after_the_replay_discards_it(monkeypatch):
    from accelerate.hooks import CpuOffload, add_hook_to_module

    m, r, e, log, call, eager_out = _replay_setup(monkeypatch)
    add_hook_to_module(m.transformer_blocks[0], CpuOffload())
    assert call() is eager_out and log == ["replay", "state", "eager"]
    assert r.discarded == 1 and not r.entries and not r.live and r.state is None
