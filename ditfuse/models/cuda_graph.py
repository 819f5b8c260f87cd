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

A graph also bakes in everything about the *model* that its forward read on the host: which
modules and hooks ran, each parameter's and buffer's address, the attention processors, a LoRA
adapter's scale and on/off state. So every call first takes the model's state
(:func:`model_state`: one walk over its modules, 4-5 ms of Python for FLUX.1's 1279 modules),
and when it differs from the state the graphs were captured under, all of them are dropped
(logged, with the first module that changed) and the next calls warm up and capture again:
loading, scaling, disabling or fusing a LoRA, swapping an attention processor, replacing a
parameter or moving the model never returns a stale graph's output. In-place writes into existing
weights are not a change: a replay reads the memory.

On a call that replays, that walk runs *after* the replay is enqueued, while the GPU computes, not
before it: otherwise the GPU idles for the walk whenever the host is not already a step ahead (a
synchronised step, the first step of a call, a busy host; it made a graph-replayed FLUX.1 step
about 5 ms slower than the same step without graphs on the H100). If the walk then finds a change,
the replay's output is discarded and the call runs the model eagerly, as the first call of a new
state does. A stale replay is memory-safe: each live graph's runner holds the storages of the
parameters and buffers it was captured with (``GraphRunner.pinned``), so a replaced weight stays
allocated until the change is seen and the graphs are dropped; its writes go to the graph's own
pool and static outputs only.
A model with foreign hooks (accelerate's offload ``_hf_hook``, diffusers' offload or cache hooks)
stays eager, logged once: those move weights or decide on the host per call.
"""

from __future__ import annotations

import collections
import inspect
import logging
from typing import Any

import torch

from .base import register_on_top, remove_hook
from .handoff import foreign_hook_names

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


def model_state(model: torch.nn.Module) -> tuple[list, "tuple[torch.nn.Module, str] | None"]:
    """(state, refusal) of ``model`` for its CUDA graphs (module docstring).

    ``state`` compares with ``==`` element by element: per module the module itself, its
    instance ``forward`` (a diffusers or accelerate hook rewrites it), its attention
    ``processor``, ``training``, its torch hook counts, its parameters' and buffers' data
    pointers, and for a PEFT tuner layer its scaling, merged and active adapters and disable
    flag. Objects are compared by identity and held by the state, so a replaced module is never
    mistaken for a new one at a recycled ``id``. ``refusal``: (module, why) when graphs cannot be
    used at all."""
    hooks = torch.nn.modules.module
    state: list = [len(hooks._global_forward_hooks), len(hooks._global_forward_pre_hooks)]
    ap = state.append
    for mod in model.modules():
        d = mod.__dict__
        if "_hf_hook" in d:
            return state, (mod, f"it has an accelerate hook ({type(d['_hf_hook']).__name__}: "
                                "offloading moves its weights between calls)")
        foreign = foreign_hook_names(mod)
        if foreign:
            return state, (mod, f"it has diffusers hooks {foreign} (offloading or caching decide "
                                "on the host per call)")
        ap(mod)
        ap(d.get("forward"))
        ap(d.get("processor"))
        ap(d["training"])
        ap(len(mod._forward_hooks))
        ap(len(mod._forward_pre_hooks))
        for t in mod._parameters.values():
            ap(None if t is None else t.data_ptr())
        for t in mod._buffers.values():
            ap(None if t is None else t.data_ptr())
        if "scaling" in d and "merged_adapters" in d:  # a PEFT (LoRA) layer
            ap(tuple(d["scaling"].items()))
            ap(tuple(d["merged_adapters"]))
            ap(d.get("_disable_adapters"))
            ap(repr(d.get("_active_adapter")))
    return state, None


def _module_name(model: torch.nn.Module, target: torch.nn.Module) -> str:
    for name, mod in model.named_modules():
        if mod is target:
            return name or type(model).__name__
    return type(target).__name__


def _first_change(model: torch.nn.Module, old: list, new: list) -> str:
    """The module whose entry in ``new`` first differs from ``old``, by name (for the log)."""
    i = next((i for i, (a, b) in enumerate(zip(old, new)) if not (a is b or a == b)), min(len(old), len(new)))
    for j in range(min(i, len(new) - 1), -1, -1):
        if isinstance(new[j], torch.nn.Module):
            return _module_name(model, new[j])
    return "the model's global hooks"


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
        self.discarded = 0  # replays whose output was thrown away: the model had changed (_replay)
        self.captures = 0
        self.evictions = 0
        self.parallel_noted = False
        self.state: list | None = None  # the model state the live graphs were captured under
        self.state_changes = 0  # times graphs were dropped because the model changed
        self.refused: str | None = None  # why graphs are off for the model right now (logged once)
        self._unstable = 0  # state changes in a row without a replay between them
        self._unstable_noted = False
        # the parameter and buffer storages the live graphs read (module docstring: a replay
        # enqueued before the state check must never read freed memory)
        self.pinned: list = []

    def invalidate(self) -> None:
        """Drop every captured graph (the forward changed: another quality tier was mounted)."""
        self.entries.clear()
        self.live.clear()
        self.pinned = []

    def state_allows(self, module: torch.nn.Module) -> bool:
        """Take ``module``'s state; drop every graph if it changed since they were captured.
        False: graphs cannot be used for it now (foreign hooks), the call runs eagerly."""
        state, refusal = model_state(module)
        if refusal is not None:
            culprit, why = refusal
            reason = f"{_module_name(module, culprit)}: {why}"
            if reason != self.refused:
                self.refused = reason
                logger.warning("ditfuse: CUDA graphs are off for %s while %s; it runs eagerly",
                               type(module).__name__, reason)
            if self.entries:
                self.invalidate()
            self.state = None
            return False
        if self.refused is not None:
            logger.info("ditfuse: CUDA graphs are on again for %s", type(module).__name__)
            self.refused = None
        if self.state is not None and state != self.state:
            if self.live or any(e.calls for e in self.entries.values()):
                logger.info("ditfuse: %s changed since its CUDA graphs were captured (first at %s: a module, "
                            "hook, attention processor, parameter or LoRA setting): %d graph(s) dropped, "
                            "the next calls warm up and capture again",
                            type(module).__name__, _first_change(module, self.state, state), len(self.live))
            self.invalidate()
            self.state_changes += 1
            self._unstable += 1
            if self._unstable >= 3 and not self._unstable_noted:
                self._unstable_noted = True
                logger.warning("ditfuse: %s changes between every call (%s), so no CUDA graph is ever replayed; "
                               "accelerate(cuda_graph=False) saves the captures", type(module).__name__,
                               _first_change(module, self.state, state))
        self.state = state
        return True

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
        entry = self.entries.get(key)
        if entry is not None and entry.graph is not None and self.state is not None:
            return self._replay(module, key, entry, named, original, args, kwargs)
        if not self.state_allows(module):
            return original(*args, **kwargs)
        entry = self.entries.setdefault(key, _Entry())
        if entry.failed is not None:
            return original(*args, **kwargs)
        entry.calls += 1
        if entry.calls == 1:
            return original(*args, **kwargs)  # eager warm-up: all first-sight verification happens here
        if entry.graph is None:
            self._make_room()
            self._capture(module, entry, original, named)
            if entry.graph is None:
                return original(*args, **kwargs)
            self.live[key] = None
        return self._replay(module, key, entry, named, original, args, kwargs, checked=True)

    def _replay(self, module, key: tuple, entry: _Entry, named: dict[str, Any], original, args, kwargs,
                checked: bool = False):
        """Replay ``entry``'s graph, then (unless ``checked``) take the model's state while the GPU
        runs it: unchanged, the replay's output is returned; changed or refused, it is discarded
        and the call runs eagerly (the warm-up call of the new state)."""
        self.live.move_to_end(key)
        for name, buf in entry.static_in.items():
            buf.copy_(named[name])
        entry.graph.replay()
        out = _clone_out(entry.static_out)
        if not checked:
            allowed = self.state_allows(module)
            if not allowed or self.entries.get(key) is not entry:  # refused, or changed: graphs dropped
                self.discarded += 1
                if allowed:
                    self.entries.setdefault(key, _Entry()).calls = 1
                return original(*args, **kwargs)
        self.replays += 1
        self._unstable = 0
        return out

    def _capture(self, module: torch.nn.Module, entry: _Entry, original, named: dict[str, Any]) -> None:
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
        if not self.pinned:  # the state was just checked: these are the storages the graph reads
            self.pinned = [t.untyped_storage() for t in (*module.parameters(), *module.buffers())]
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
    register_on_top(reg, runner, HOOK_NAME)  # under accelerate's wrapper, if the model has one
    return runner


def remove_graph_runner(model: torch.nn.Module) -> None:
    reg = getattr(model, "_diffusers_hook", None)
    if reg is not None and reg.get_hook(HOOK_NAME) is not None:
        remove_hook(reg, HOOK_NAME)  # keeps an accelerate wrapper above it working
