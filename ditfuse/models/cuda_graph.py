"""Lossless CUDA graphs for an accelerated transformer's forward.

For each static input signature (shapes, dtypes, devices of the tensor arguments and the values of
the others) the first call runs eagerly — that call performs every first-sight verification of
the bit-exact gate — and the second captures the forward into a CUDA graph with static input
buffers. Later calls copy their inputs into those buffers, replay, and return copies of the
outputs. Verification never runs inside capture: the gate runs verified signatures' kernels and
unverified ones' references while capturing, so a replay computes exactly what eager computed.
A capture that fails (a host sync inside the forward, say) leaves that signature eager, logged
once.

At most ``max_graphs`` signatures hold a captured graph at a time. Each graph keeps a private
memory pool about one forward's activations in size, so a server that sees many shapes (batch
sizes x resolutions) would otherwise grow without bound. Capturing one more evicts the least
recently replayed one: its graph and buffers are released, and the signature starts again from
a single eager call if it comes back.
"""

from __future__ import annotations

import collections
import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger("ditfuse.cuda_graph")

HOOK_NAME = "ditfuse.cuda_graph"


def _key(bound: dict[str, Any]) -> tuple:
    parts = []
    for name, v in bound.items():
        if isinstance(v, torch.Tensor):
            parts.append((name, tuple(v.shape), v.dtype, str(v.device), v.stride()))
        elif isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
            parts.append((name, "unsupported-sequence"))
        else:
            parts.append((name, repr(v)))
    return tuple(parts)


def _clone_out(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_clone_out(o) for o in out)
    if isinstance(out, list):
        return [_clone_out(o) for o in out]
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):  # diffusers BaseOutput
        return type(out)(**{k: _clone_out(out[k]) for k in out.keys()})
    return out


class _Entry:
    def __init__(self) -> None:
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: dict[str, torch.Tensor] = {}
        self.static_out: Any = None
        self.failed: str | None = None


class GraphRunner:
    """diffusers ModelHook-compatible runner (duck-typed; see ditfuse.models.base)."""

    _is_stateful = False

    def __init__(self, model: torch.nn.Module, max_graphs: int = 8) -> None:
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        self.fn_ref = None
        self.entries: dict[tuple, _Entry] = {}
        # signatures holding a captured graph, least recently replayed first
        self.live: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self.max_graphs = int(max_graphs)
        self.signature = inspect.signature(type(model).forward)
        self.replays = 0
        self.captures = 0
        self.evictions = 0
        self.parallel_noted = False

    def invalidate(self) -> None:
        """Drop every captured graph (the forward changed: another quality tier was mounted)."""
        self.entries.clear()
        self.live.clear()

    def _make_room(self) -> None:
        """Evict least recently replayed graphs until one more fits under ``max_graphs``."""
        while len(self.live) >= self.max_graphs:
            key, _ = self.live.popitem(last=False)
            entry = self.entries.get(key)
            if entry is not None:
                entry.graph = None
                entry.static_in = {}
                entry.static_out = None
                entry.calls = 0  # if it returns: one eager call, then a capture again
            self.evictions += 1
            logger.info("ditfuse: CUDA graph evicted (at most %d kept): %s", self.max_graphs, key)

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def reset_state(self, module):
        return module

    def new_forward(self, module, *args, **kwargs):
        original = self.fn_ref.original_forward
        if torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
            return original(*args, **kwargs)
        if getattr(module, "_parallel_config", None) is not None:
            # Context parallelism: the forward runs NCCL collectives (all-to-all / ring) inside;
            # capturing them is not verified here, so such a model stays eager (said once).
            if not self.parallel_noted:
                self.parallel_noted = True
                logger.warning("ditfuse: CUDA graphs are off for %s: context parallelism is enabled "
                               "(collectives inside a captured graph are not verified)", type(module).__name__)
            return original(*args, **kwargs)
        bound = self.signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        named = dict(list(bound.arguments.items())[1:])
        if any(isinstance(v, torch.Tensor) and v.device.type != "cuda" for v in named.values()):
            return original(*args, **kwargs)
        key = _key(named)
        entry = self.entries.setdefault(key, _Entry())
        if entry.failed is not None:
            return original(*args, **kwargs)
        entry.calls += 1
        if entry.calls == 1:
            return original(*args, **kwargs)  # eager warm-up: all first-sight verification happens here
        if entry.graph is None:
            self._make_room()
            self._capture(entry, original, named)
            if entry.graph is None:
                return original(*args, **kwargs)
            self.live[key] = None
        self.live.move_to_end(key)
        for name, buf in entry.static_in.items():
            buf.copy_(named[name])
        entry.graph.replay()
        self.replays += 1
        return _clone_out(entry.static_out)

    def _capture(self, entry: _Entry, original, named: dict[str, Any]) -> None:
        static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in named.items()}
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                original(**static)  # settle allocator/caches outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = original(**static)
        except Exception as e:  # host sync in the forward, unsupported op ...
            entry.failed = f"{type(e).__name__}: {e}"
            logger.warning("ditfuse: CUDA graph capture failed, this shape stays eager: %s", entry.failed)
            return
        entry.graph = graph
        entry.static_in = {k: v for k, v in static.items() if isinstance(v, torch.Tensor)}
        entry.static_out = out
        self.captures += 1


def install_graph_runner(model: torch.nn.Module, max_graphs: int = 8) -> GraphRunner:
    from diffusers.hooks import HookRegistry, ModelHook

    class _Runner(GraphRunner, ModelHook):
        pass

    reg = HookRegistry.check_if_exists_or_initialize(model)
    existing = reg.get_hook(HOOK_NAME)
    if existing is not None:
        existing.max_graphs = int(max_graphs)
        return existing
    runner = _Runner(model, max_graphs=max_graphs)
    reg.register_hook(runner, HOOK_NAME)
    return runner


def remove_graph_runner(model: torch.nn.Module) -> None:
    reg = getattr(model, "_diffusers_hook", None)
    if reg is not None and reg.get_hook(HOOK_NAME) is not None:
        reg.remove_hook(HOOK_NAME, recurse=False)
