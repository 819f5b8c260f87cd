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
