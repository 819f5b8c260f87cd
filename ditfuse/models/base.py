"""The shared machinery every model adapter is declared on: sites, mounting (both tiers), guards,
admission capture.

An adapter is a table: the diffusers model classes it handles, the diffusers versions whose
forward code its fast forwards mirror, and its :class:`Site` s — for each diffusers module class,
the fast forward replacing its ``forward``, the ops that forward calls (the coverage table of the
docs page, the quality="high" guards and admission's captured inputs all derive from it), and
when the fast forward applies to an instance. Nothing else is per family.

Mounting: one diffusers ``ModelHook`` per module (``ditfuse.<site>``, through
``diffusers.hooks.HookRegistry``: named, removable, composes with diffusers' own hooks) whose
``new_forward`` calls the site's fast forward with an op table (:mod:`ditfuse.contracts.ops`):
``LOSSLESS`` when mounted, the site's quality="high" table (``contracts.ops.high_table``: close
variants of the ops it declares) after :meth:`Adapter.set_quality` checked every guard of every
site of the model (all or nothing, contracts/quality.py), back to ``LOSSLESS`` on the way down.
Swapping the table is the only difference between the tiers: there is one fast forward per site.
The hook goes to the bottom of the module's hook chain (:func:`register_innermost`): it replaces
the module's own forward, and hooks the user applied before or after ``accelerate`` (diffusers'
context parallelism, group offloading, caches) keep running around it.

Chained sites (``Site.chained``: the blocks of one ``nn.ModuleList``) are linked to their
successors at mount and fuse the block boundary between them: :mod:`ditfuse.models.handoff`.

Admission capture (:func:`capture_admission_batches`): one forward with a recording table, which
clones the arguments of the close ops' lossless siblings (those the site runs under quality="high",
or with ``scope="all"`` every op that has a close variant) and runs the lossless op. The inputs are
whatever the fast forwards pass, so no per-family code re-derives them.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..contracts import admission
from ..contracts.ops import LOSSLESS, TIERS, OpSet, close_variant, high_table
from ..contracts.quality import Guard, MountResult, Quality, check_all
from ..kernels.spec import OpDescriptor
from ..kernels.env import env
from ..kernels.layout.linear_cat_torch import one_buffer
from .handoff import HOOK_PREFIX, NO_LINK, Link, counts, foreign_hook_names, link_chains

logger = logging.getLogger("ditfuse.models")

_tier_lock = threading.Lock()


class AdapterVersionError(RuntimeError):
    """The installed diffusers is not a version the adapter's fast forwards mirror."""


def _always(module: torch.nn.Module) -> str | None:
    return None


@dataclass(frozen=True)
class Site:
    """One diffusers module class whose forward an adapter replaces.

    ``cls``: ``"module.path:ClassName"`` of the diffusers class. ``params``: the parameter names
    of ``cls.forward`` the fast forward was written against (checked at mount: a changed forward
    refuses the adapter). ``forward(module, original_forward, *args, _ops, **kwargs)`` mirrors
    the diffusers forward with the eager chains replaced by ``_ops.<op>(...)`` calls
    (``original_forward`` serves inputs it does not cover). ``ops``: the descriptors of the ops it
    calls. ``applies(module)``: None when the fast forward reproduces this instance's
    configuration, else why not (the module then keeps its own forward; the report says why).
    ``high=False``: the close variants of ``ops`` are not used under quality="high" (their chains
    were not admitted for this family); the site's high tier is then its ``high_ops`` alone, or
    none without them. ``high_ops``: ops the fast forward calls only under quality="high", through
    their close variants (their lossless form is off by default, e.g. the GEMM-GELU): they join the
    site's high guards (admission) and its high table's ``optional`` ops, not ``Adapter.ops()``.
    ``chained=True``: the site's modules are the blocks of an ``nn.ModuleList`` that hand off
    across block boundaries (:mod:`ditfuse.models.handoff`); the fast forward also gets
    ``_link``, its :class:`~ditfuse.models.handoff.Link`. ``release(module)``, if given, runs when
    the site is unmounted from ``module`` (state the fast forward kept, e.g. cached tables).
    """

    name: str
    cls: str
    params: tuple[str, ...]
    forward: Callable[..., Any]
    ops: tuple[OpDescriptor, ...]
    applies: Callable[[torch.nn.Module], "str | None"] = _always
    high: bool = True
    description: str = ""
    chained: bool = False
    high_ops: tuple[OpDescriptor, ...] = ()
    release: Callable[[torch.nn.Module], None] | None = None

    @property
    def cls_name(self) -> str:
        return self.cls.partition(":")[2]

    @property
    def hook_name(self) -> str:
        return HOOK_PREFIX + self.name

    def load_cls(self) -> type:
        mod, _, name = self.cls.partition(":")
        return getattr(importlib.import_module(mod), name)

    def close_ops(self) -> list[Any]:
        """The close ops this site runs under quality="high" (empty: the site has no high tier)."""
        return [c for c in (close_variant(d) for d in (*self._high_declared(), *self.high_ops)) if c is not None]

    def _high_declared(self) -> tuple[OpDescriptor, ...]:
        return self.ops if self.high else ()

    def high_table(self) -> OpSet:
        """The op table this site runs under quality="high" (:func:`ditfuse.contracts.ops.high_table`):
        with ``high=False``, lossless ops everywhere but the ``high_ops``."""
        return high_table(self._high_declared(), self.high_ops)

    def high_guards(self) -> list[Guard]:
        """What must hold before this site runs its close ops (see the module docstring)."""
        return [
            Guard("dtype", half_precision),
            Guard("structure", self.applies),
            Guard("no offload", no_foreign_hooks),
            *admission.high_guards(self.close_ops()),
        ]


ATTENTION_CLS = "diffusers.models.attention_processor:Attention"
ATTENTION_PARAMS = ("self", "hidden_states", "encoder_hidden_states", "attention_mask", "cross_attention_kwargs")


def attention_site(name: str, forward: Callable[..., Any], ops: tuple[OpDescriptor, ...],
                   applies: Callable[[torch.nn.Module], "str | None"], description: str,
                   high: bool = False) -> Site:
    """A site on diffusers' processor-based ``Attention`` (``attention_processor.Attention``): one
    class for many families, told apart by ``applies`` (each checks for its own processor type)."""
    return Site(name=name, cls=ATTENTION_CLS, params=ATTENTION_PARAMS, forward=forward, ops=ops,
                applies=applies, high=high, description=description)


# ------------------------------------------------------------------------------ guards


def diffusers_rmsnorms(module: torch.nn.Module, names: tuple[str, ...], width: int | None = None) -> str | None:
    """None when ``module.<name>`` for every name is diffusers' own ``RMSNorm`` (the two-rounding
    one the diffusers-RMSNorm kernels reproduce) without bias, with a ``[width]`` weight or none
    (``width=None``: not checked), all with one eps, and torch_npu is absent (diffusers would
    take its NPU path); else why not."""
    from diffusers.models.normalization import RMSNorm
    from diffusers.utils import is_torch_npu_available

    first = eps = None
    for name in names:
        n = getattr(module, name, None)
        if type(n) is not RMSNorm:
            what = "None" if n is None else f"{type(n).__module__}.{type(n).__qualname__}"
            return f"{name} is {what}, not diffusers' RMSNorm"
        if getattr(n, "bias", None) is not None:
            return f"{name} has a bias"
        if width is not None and n.weight is not None and tuple(n.weight.shape) != (width,):
            return f"{name} weight has shape {tuple(n.weight.shape)}, not ({width},)"
        if eps is not None and n.eps != eps:
            return f"{name} eps {n.eps} differs from {first} eps {eps}"
        first, eps = (first or name), (eps if eps is not None else n.eps)
    if is_torch_npu_available():
        return "torch_npu is available: diffusers RMSNorm takes its NPU path"
    return None


def plain_module(module: object, cls: type) -> bool:
    """``module`` is exactly a ``cls`` whose forward nothing but ditfuse's own site intercepts (no
    torch hooks, no accelerate hook, no other diffusers hook, not a PEFT/LoRA wrapper), so a fast
    forward may use its weight and bias directly instead of calling it."""
    return (type(module) is cls and not module._forward_hooks and not module._forward_pre_hooks
            and not hasattr(module, "_hf_hook") and not foreign_hook_names(module))


def plain_linear(module: object) -> bool:
    """``module`` is a plain ``nn.Linear`` (:func:`plain_module`): its output is ``F.linear(x,
    weight, bias)``, so a fast forward may use its weight and bias directly."""
    return plain_module(module, torch.nn.Linear)


def linear_module(module: object) -> torch.nn.Linear | None:
    """The ``nn.Linear`` that computes ``module``'s projection: ``module`` itself, or the base layer
    of a PEFT/LoRA wrapper around one (``get_base_layer()``), else None. For sites that *call* the
    module (so a LoRA delta is applied by its own forward) and only need to know its shape; a site
    that reads ``weight`` / ``bias`` directly must ask :func:`plain_linear` instead."""
    if isinstance(module, torch.nn.Linear):
        return module
    get_base = getattr(module, "get_base_layer", None)
    if callable(get_base) and isinstance(module, torch.nn.Module):
        base = get_base()
        if isinstance(base, torch.nn.Linear):
            return base
    return None


def linear_cat_enabled() -> bool:
    """``DITFUSE_LINEAR_CAT=1``: the joint attention value's two projections write into one buffer
    (``layout.linear_cat``, batch 1). Off by default until a GPU run has measured it: the op is
    gated like every other, but whether cuBLASLt picks the same GEMM for an ``out=`` view is an
    observation to make, not a construction (kernels/layout/linear_cat_torch.py)."""
    return env("DITFUSE_LINEAR_CAT", "0").strip() not in ("", "0")


def gemm_gelu_enabled() -> bool:
    """``DITFUSE_GEMM_GELU=1``: FeedForward / MLP projections followed by a tanh-GELU run as one
    GEMM with the GELU in its epilogue (``linear.linear_gelu_tanh``). Off by default: round 26's
    H100 run found it bitwise equal to cuBLAS + GELU at every FLUX.1 shape but slower (the FLUX.1
    step 136.9 against 128.3 ms; notes/gemm_epilogue.md): the epilogue's GELU arithmetic is not
    overlapped with the MMAs. The op stays gated per GEMM problem (its equality with cuBLAS is an
    observation about cuBLAS's kernel choice, kernels/linear/linear_gelu_triton.py)."""
    return env("DITFUSE_GEMM_GELU", "0").strip() not in ("", "0")


def gelu_projection(module: object) -> torch.nn.Linear | None:
    """The projection of a module computing ``F.gelu(proj(x), approximate="tanh")`` that a fast
    forward may run as one GEMM-GELU (``linear.linear_gelu_tanh``): diffusers' ``GELU`` module
    with ``approximate="tanh"`` around a plain ``nn.Linear``, nothing hooking either; None
    otherwise. Callers ask :func:`gemm_gelu_runs` first."""
    from diffusers.models.activations import GELU

    if not plain_module(module, GELU) or module.approximate != "tanh" or not plain_linear(module.proj):
        return None
    return module.proj


def gemm_gelu_runs(_ops: OpSet) -> bool:
    """A fast forward runs ``linear_gelu_tanh`` with table ``_ops``: the site's quality="high"
    table declares it (``Site.high_ops``: its close variant) or ``DITFUSE_GEMM_GELU=1``."""
    return _ops.runs("linear_gelu_tanh") or gemm_gelu_enabled()


def feed_forward(ff, x: torch.Tensor, _ops: OpSet) -> torch.Tensor:
    """diffusers' FeedForward on ``x``; where :func:`gemm_gelu_runs` and the first layer is a
    plain tanh-GELU, that layer is one GEMM with the GELU in its epilogue
    (``_ops.linear_gelu_tanh``) and the rest of ``ff.net`` (dropout, output projection) runs as
    diffusers' modules."""
    if not gemm_gelu_runs(_ops):  # first: the default path pays a set lookup and one environment lookup
        return ff(x)
    from diffusers.models.attention import FeedForward

    proj = gelu_projection(ff.net[0]) if plain_module(ff, FeedForward) else None
    if proj is None:
        return ff(x)
    x = _ops.linear_gelu_tanh(x, proj.weight, proj.bias)
    for module in ff.net[1:]:
        x = module(x)
    return x


def linear_cat_applies(x_a: torch.Tensor, x_b: torch.Tensor, n: int) -> bool:
    """A site's pre-check before calling ``layout.linear_cat`` (so the op only sees inputs it
    takes): the switch is on, and the op's own shape rule (batch 1, aligned rows) holds."""
    return linear_cat_enabled() and one_buffer(x_a, x_b, n)


def half_precision(module: torch.nn.Module) -> str | None:
    """The module computes in bf16/fp16: most of its GEMM weight elements (nn.Linear; all
    parameters if it has none) are one of those dtypes. Modules a checkpoint keeps in fp32 (Wan's
    time embedder, norms, modulation tables) do not count against it; admission was measured on
    half-precision activations, and an fp32 model gains nothing from close kernels."""
    linears = [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]
    params = linears or list(module.parameters())
    if not params:
        return "module has no parameters"
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    main = max(by_dtype, key=by_dtype.get)
    if main not in (torch.bfloat16, torch.float16):
        return f"weights are mostly {str(main).replace('torch.', '')}: close kernels need bf16/fp16"
    return None


def no_foreign_hooks(module: torch.nn.Module) -> str | None:
    """No offloading / casting / caching hook (accelerate's or diffusers') and no meta weight on
    the module: a close forward is not composed with them."""
    for name, sub in module.named_modules():
        if hasattr(sub, "_hf_hook"):
            return f"{name or 'module'} has an accelerate hook (offloaded or dispatched weights)"
        foreign = foreign_hook_names(sub)
        if foreign:
            return (f"{name or 'module'} has diffusers hook(s) {foreign} "
                    "(offloading/casting/caching is not composed with quality=high)")
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            return f"parameter {name} is on the meta device (offloaded)"
    return None


# ------------------------------------------------------------------------------ the hook


class SiteHook:
    """A diffusers ModelHook (duck-typed here, subclassed from ModelHook in :func:`_make_hook` so
    that importing this module needs no diffusers) running ``site.forward`` with op table ``ops``."""

    _is_stateful = False

    def __init__(self, site: Site, ops: OpSet = LOSSLESS) -> None:
        self.site = site
        self.ops = ops
        self.fn_ref = None
        self.link: Link = NO_LINK
        self._guards: list[dict] | None = None  # __dict__s of the submodules it reads directly
        self.offload_calls = 0  # calls that ran diffusers' forward because of an offload hook

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # diffusers' spelling
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def new_forward(self, module, *args, **kwargs):
        original = self.fn_ref.original_forward
        if self._guards is None:
            self._guards = _read_directly(module)
        held = _offload_hook(self._guards) or (_accelerate_wrapper(original) and "accelerate's hook runs above it")
        if held:
            # A fast forward reads some submodules' weights directly instead of calling them, so
            # a hook that moves weights in a submodule's forward (sequential or group offload,
            # layerwise casting) would be skipped: diffusers' forward runs, with every hook.
            self.offload_calls += 1
            _note_offload(self.site.name, held)
            return original(*args, **kwargs)
        if self.site.chained:
            return self.site.forward(module, original, *args, _ops=self.ops, _link=self.link, **kwargs)
        return self.site.forward(module, original, *args, _ops=self.ops, **kwargs)

    def reset_state(self, module):
        return module

    def __repr__(self) -> str:
        return f"SiteHook({self.site.name}, {self.ops.quality.value})"


# diffusers hooks a fast forward keeps: context parallelism's split/gather hooks sit on modules
# the fast forwards call as modules (a block's inputs, pos_embed, proj_out, rope)
_KEPT_HOOKS = ("cp_input---", "cp_output---", HOOK_PREFIX)
# modules the fast forwards only ever call, never read tensors of (the exceptions ask per call
# whether anything hooks the module: layout.linear_cat's plain_linear, AutoencoderKL's conv2 +
# residual through autoencoder_kl._plain_conv): a hook on one of them runs as in diffusers
_CALLED = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
_offload_noted: set[str] = set()


def _read_directly(module: torch.nn.Module) -> list[dict]:
    """The ``__dict__`` of every submodule of ``module`` whose tensors its site's fast forward
    may read without calling it (norm weights, modulation tables): those with parameters or
    buffers of their own that are not a Linear, a convolution or an embedding (or a PEFT wrapper
    of one). A submodule mounted as a site of its own counts too (a ResnetBlock's fast forward
    reads its GroupNorm site's weight), but what is under it does not: the parent calls it, and
    its own hook checks its submodules."""
    out: list[dict] = []
    stack = [m for m in module._modules.values() if m is not None]
    while stack:
        m = stack.pop()
        if (m._parameters or m._buffers) and not isinstance(m, _CALLED) and linear_module(m) is None:
            out.append(m.__dict__)
        reg = m.__dict__.get("_diffusers_hook")
        if reg is None or not any(isinstance(h, SiteHook) for h in reg.hooks.values()):
            stack.extend(c for c in m._modules.values() if c is not None)
    return out


def _offload_hook(guards: list[dict]) -> str | None:
    """Why a fast forward must not run now: one of the submodules it reads directly has an
    accelerate hook or a diffusers hook other than context parallelism's (sequential or
    leaf-level group offloading, layerwise casting of a norm): the hook moves or casts the
    weights in that module's own forward, which the fast forward does not call. None when
    there is none (~0.1 µs per guarded submodule: a FLUX.1 block has none, its attention four)."""
    for d in guards:
        if "_hf_hook" in d:
            return f"a submodule it reads has an accelerate hook ({type(d['_hf_hook']).__name__})"
        reg = d.get("_diffusers_hook")
        if reg is not None:
            for name in reg.hooks:
                if not name.startswith(_KEPT_HOOKS):
                    return f"a submodule it reads has the diffusers hook {name!r}"
    return None


def _note_offload(site: str, why: str) -> None:
    if site not in _offload_noted:
        _offload_noted.add(site)
        logger.warning("ditfuse: %s runs diffusers' forward while %s (offloading or a hook that moves "
                       "or casts weights: the fast forward would skip it); logged once per site", site, why)


def _make_hook(site: Site) -> SiteHook:
    from diffusers.hooks import ModelHook

    class _Hook(SiteHook, ModelHook):
        pass

    return _Hook(site)


def site_hooks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, SiteHook]]:
    """Every ditfuse site hook under ``model``: (module path, module, hook)."""
    for path, mod in model.named_modules():
        reg = getattr(mod, "_diffusers_hook", None)
        if reg is None:
            continue
        for name, hook in list(reg.hooks.items()):
            if name.startswith(HOOK_PREFIX) and isinstance(hook, SiteHook):
                yield path or "<root>", mod, hook


def handoff_counts(model: torch.nn.Module) -> dict[str, int]:
    """Cross-block hand-offs of ``model``'s chained sites: ``{"links", "used", "discarded"}``."""
    return counts(h.link for _, _, h in site_hooks(model))


def mounted_high(model: torch.nn.Module) -> list[str]:
    """The sites of ``model`` currently running their quality="high" forward ("path:site")."""
    return [f"{p}:{h.site.name}" for p, _, h in site_hooks(model)
            if h.ops.quality is Quality.HIGH and h.site.close_ops()]


# ------------------------------------------------------------------------------ the hook chain
#
# diffusers' HookRegistry chains hooks in registration order: each new hook wraps the module's
# forward as it is then, so the last one registered runs first. A hook with ``new_forward`` (ours)
# does not call the chain below it. Appended after a foreign hook (diffusers' context-parallel
# split/gather hooks from ``enable_parallelism``, group offloading's onload, a cache hook), our
# fast forward would therefore skip that hook's pre/post work: the sequence would not be split,
# the weights not onloaded, the cache not consulted. A ditfuse hook replaces the module's own
# forward body, so it belongs at the bottom of the chain, under every other hook, whichever
# order the user applied them in. The registry has no insert, so these two functions place and
# unlink our hook the way ``register_hook`` / ``remove_hook`` do (diffusers is pinned: the
# adapters refuse any version but the one they mirror).


# accelerate's ``add_hook_to_module`` (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``,
# ``cpu_offload``) does not use that registry: it wraps ``module.forward`` in a partial that calls
# ``module._old_forward``, and ``remove_hook_from_module`` (run by diffusers' ``remove_all_hooks``
# at every ``enable_model_cpu_offload``, so after every pipeline call with offload on) restores
# ``module.forward = module._old_forward``. So a registry chain belongs *under* accelerate's
# wrapper, in ``_old_forward``: there the wrapper moves the weights before our forward runs, the
# restore puts our chain back as the forward, and a new offload hook wraps it again.


def _accelerate_wrapper(f: Any) -> bool:
    """``f`` is the forward accelerate's ``add_hook_to_module`` installed."""
    return isinstance(f, functools.partial) and getattr(f.func, "__qualname__", "").startswith("add_hook_to_module.")


def _chain_top(f: Any, fn_ref: Any) -> bool:
    """``f`` is the forward diffusers' ``register_hook`` installed for chain entry ``fn_ref``."""
    if not isinstance(f, functools.partial):
        return False
    return any(getattr(c, "cell_contents", None) is fn_ref for c in (getattr(f.func, "__closure__", None) or ()))


def register_on_top(reg: Any, hook: Any, name: str) -> None:
    """``reg.register_hook(hook, name)`` (the hook wraps the registry's chain), placed under
    accelerate's wrapper when the module has one (see above)."""
    mod = reg._module_ref
    d = mod.__dict__
    wrapper = d.get("forward")
    if not (_accelerate_wrapper(wrapper) and "_old_forward" in d):
        reg.register_hook(hook, name)
        return
    mod.forward = d["_old_forward"]
    try:
        reg.register_hook(hook, name)
    finally:
        mod._old_forward = d["forward"]
        mod.forward = wrapper


def _inner_forward(fn_ref: Any) -> Callable:
    """The forward a hook's chain entry calls below itself."""
    return fn_ref.original_forward if fn_ref.original_forward is not None else fn_ref.forward


def _set_inner_forward(fn_ref: Any, forward: Callable) -> None:
    if fn_ref.original_forward is not None:  # a new_forward hook reaches below via original_forward
        fn_ref.original_forward = forward
    else:
        fn_ref.forward = forward


def register_innermost(reg: Any, hook: SiteHook, name: str) -> None:
    """Register ``hook`` on ``reg`` (a diffusers HookRegistry) under every hook already there:
    it replaces the module's own forward, and the other hooks keep running around it."""
    from diffusers.hooks.hooks import HookFunctionReference

    if not reg._fn_refs:
        register_on_top(reg, hook, name)
        return
    if name in reg.hooks:
        raise ValueError(f"hook {name} is already registered")
    module = hook.initialize_hook(reg._module_ref)
    bottom = reg._fn_refs[0]
    base = _inner_forward(bottom)
    fn_ref = HookFunctionReference()
    fn_ref.pre_forward = hook.pre_forward
    fn_ref.post_forward = hook.post_forward
    fn_ref.original_forward = base
    fn_ref.forward = functools.update_wrapper(functools.partial(hook.new_forward, module), hook.new_forward)

    def rewritten(module: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = fn_ref.pre_forward(module, *args, **kwargs)
        return fn_ref.post_forward(module, fn_ref.forward(*args, **kwargs))

    _set_inner_forward(bottom, functools.update_wrapper(functools.partial(rewritten, module), base))
    hook.fn_ref = fn_ref
    reg.hooks[name] = hook
    reg._hook_order.insert(0, name)
    reg._fn_refs.insert(0, fn_ref)


def remove_hook(reg: Any, name: str) -> None:
    """Unlink hook ``name`` from ``reg``'s chain, keeping the hooks above it intact (diffusers'
    ``remove_hook`` relinks the next hook's ``forward`` even when that hook is a ``new_forward``
    hook, whose link below is ``original_forward``)."""
    index = reg._hook_order.index(name)
    fn_ref = reg._fn_refs[index]
    below = _inner_forward(fn_ref)
    if index == len(reg._hook_order) - 1:
        mod = reg._module_ref
        d = mod.__dict__
        if _chain_top(d.get("forward"), fn_ref):
            mod.forward = below
        elif _chain_top(d.get("_old_forward"), fn_ref):  # under accelerate's wrapper
            mod._old_forward = below
        # else the module's forward was reset since (accelerate's remove_hook_from_module restores
        # the forward it wrapped): the chain is off the call path already, and overwriting what is
        # there now would drop someone else's wrapper
    else:
        _set_inner_forward(reg._fn_refs[index + 1], below)
    reg._module_ref = reg.hooks[name].deinitalize_hook(reg._module_ref)
    del reg.hooks[name]
    reg._hook_order.pop(index)
    reg._fn_refs.pop(index)


# ------------------------------------------------------------------------------ the adapter


@dataclass
class MountedSite:
    path: str
    site: str
    ops: tuple[str, ...]


@dataclass
class AdapterMount:
    """What one adapter mounted on one model."""

    adapter: str
    mounted: list[MountedSite] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module path, reason)


@dataclass
class Adapter:
    """A model family: which diffusers models it takes, which diffusers versions its fast
    forwards mirror, and its sites."""

    family: str
    model_classes: tuple[str, ...]
    diffusers_versions: tuple[str, ...]
    sites: tuple[Site, ...]

    def handles(self, model: torch.nn.Module) -> bool:
        return type(model).__name__ in self.model_classes

    def version_problem(self) -> str | None:
        """Why this adapter must not mount in this process (None when it may): another diffusers
        version, or a replaced forward whose parameters changed."""
        import diffusers

        if diffusers.__version__ not in self.diffusers_versions:
            return (
                f"the {self.family} adapter mirrors diffusers {', '.join(self.diffusers_versions)} "
                f"forward code, but diffusers {diffusers.__version__} is installed; refusing to mount "
                f"(its fast forwards could silently diverge from this version's forwards)"
            )
        for s in self.sites:
            got = tuple(inspect.signature(s.load_cls().forward).parameters)
            if got != s.params:
                return f"{s.cls_name}.forward has parameters {list(got)}, expected {list(s.params)}"
        return None

    def ops(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for s in self.sites:
            for d in s.ops:
                seen.setdefault(d.op, None)
        return tuple(seen)

    def mount(self, model: torch.nn.Module) -> AdapterMount:
        """Install the lossless fast forward on every module of a site class whose instance it
        applies to; the others keep their forward and are listed as skipped."""
        problem = self.version_problem()
        if problem is not None:
            raise AdapterVersionError(problem)
        from diffusers.hooks import HookRegistry

        result = AdapterMount(self.family)
        # by class object, not name: diffusers has "Copied from" classes of the same name in other
        # modules (transformer_wan_animate.WanTransformerBlock), whose forward was never checked
        by_cls = {s.load_cls(): s for s in self.sites}
        for path, mod in model.named_modules():
            site = by_cls.get(type(mod))
            if site is None:
                continue
            path = path or "<root>"
            reason = site.applies(mod)
            if reason is not None:
                result.skipped.append((path, f"{site.name}: {reason}"))
                continue
            reg = HookRegistry.check_if_exists_or_initialize(mod)
            if reg.get_hook(site.hook_name) is None:
                register_innermost(reg, _make_hook(site), site.hook_name)
            result.mounted.append(MountedSite(path, site.name, tuple(d.op for d in site.ops)))
        HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        link_chains(model, {id(m): h for _, m, h in site_hooks(model) if h.site.chained})
        return result

    def set_quality(self, model: torch.nn.Module, quality: "str | Quality") -> MountResult:
        """Run every site of ``model`` at ``quality``: all of its high-capable sites move to
        their close ops, or none does (the first failing guard is returned). Lossless always
        succeeds. Call between batches only."""
        q = Quality.parse(quality)
        hooks = list(site_hooks(model))
        capable = [(p, m, h) for p, m, h in hooks if h.site.close_ops()]
        with _tier_lock:
            if q is Quality.LOSSLESS:
                res = MountResult(q)
                for p, _, h in capable:
                    if h.ops.quality is Quality.HIGH:
                        res.unmounted.append(f"{p}:{h.site.name}")
                for _, _, h in hooks:
                    h.ops = LOSSLESS
                return res
            failure = check_all((p, h.site.name, m, h.site.high_guards()) for p, m, h in capable)
            if failure is not None:
                res = MountResult(q, failed=failure)
                for p, _, h in hooks:
                    if h.ops.quality is Quality.HIGH and h.site.close_ops():
                        res.unmounted.append(f"{p}:{h.site.name}")
                    h.ops = LOSSLESS
                return res
            res = MountResult(q)
            for p, _, h in capable:
                h.ops = h.site.high_table()
                res.mounted.append(f"{p}:{h.site.name}")
            return res

    def unmount(self, model: torch.nn.Module) -> int:
        removed = 0
        by_name = {s.hook_name: s for s in self.sites}
        for _, mod in model.named_modules():
            reg = getattr(mod, "_diffusers_hook", None)
            if reg is None:
                continue
            for name in list(reg.hooks):
                if name in by_name:
                    remove_hook(reg, name)
                    removed += 1
                    if by_name[name].release is not None:
                        by_name[name].release(mod)
        if hasattr(model, "_diffusers_hook"):
            model._diffusers_hook.invalidate_child_registries_cache()
        return removed


# ------------------------------------------------------------------------------ admission capture


class _Recorder:
    """An op table that records the arguments of every op with a close variant, then runs the
    lossless op (so the forward computes exactly what it computes when mounted lossless)."""

    def __init__(self, out: dict[str, list[admission.Batch]], max_per_op: int | None,
                 optional: frozenset[str] = frozenset(), record: frozenset[str] | None = None) -> None:
        self.quality = Quality.LOSSLESS
        self.optional = optional
        self._out = out
        self._max = max_per_op
        self._record = record  # close op ids to record (None: every op with a close variant)

    def runs(self, name: str) -> bool:
        """The optional paths of the site's own high table run while recording (``optional``):
        a close op's inputs are captured where the site would call it under quality="high"."""
        return name in self.optional

    def __getattr__(self, name: str) -> Any:
        gated = getattr(LOSSLESS, name)
        close = close_variant(gated.descriptor)
        if close is None or (self._record is not None and close.op not in self._record):
            return gated

        def record(*args: Any, **kwargs: Any) -> Any:
            batches = self._out.setdefault(close.op, [])
            if self._max is None or len(batches) < self._max:
                clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
                batches.append((tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()}))
            return gated(*args, **kwargs)

        return record


@contextmanager
def _tables(model: torch.nn.Module, ops_for: Callable[[SiteHook], Any]) -> Iterator[None]:
    """Within the block every site hook of ``model`` runs the table ``ops_for(hook)``."""
    hooks = [h for _, _, h in site_hooks(model)]
    saved = [h.ops for h in hooks]
    try:
        for h in hooks:
            h.ops = ops_for(h)
        yield
    finally:
        for h, s in zip(hooks, saved):
            h.ops = s


def capture_admission_batches(
    model: torch.nn.Module, inputs: dict[str, Any] | None = None, max_per_op: int | None = None,
    run: Callable[[], Any] | None = None, scope: Literal["high", "all"] = "high",
) -> dict[str, list[admission.Batch]]:
    """Run one forward of ``model`` (mounted by its adapter, lossless) with ``inputs`` -- or
    ``run()`` instead, e.g. a VAE's ``decode`` -- and record the arguments each close op's lossless
    sibling gets: ``close op id -> [(args, kwargs), ...]``.

    ``scope="high"``: only the close ops each site runs under quality="high"
    (:meth:`Site.close_ops`; a site without a high tier records nothing) -- what the model's high
    guards need. ``scope="all"``: every op with a close variant at every site, e.g. to survey
    whether a family's chains would admit close kernels it does not declare (bench/admit.py).
    Optional paths (``Site.high_ops``) are taken only where the site declares them, in both."""
    if not any(True for _ in site_hooks(model)):
        raise ValueError("capture_admission_batches needs a model mounted by ditfuse.accelerate()")
    if (inputs is None) == (run is None):
        raise ValueError("give either inputs (for model(**inputs)) or run")
    if scope not in ("high", "all"):
        raise ValueError(f"scope must be 'high' or 'all', not {scope!r}")
    out: dict[str, list[admission.Batch]] = {}
    recorders: dict[tuple[frozenset[str], frozenset[str] | None], _Recorder] = {}

    def recorder(h: SiteHook) -> _Recorder:
        close = h.site.close_ops()
        optional = h.site.high_table().optional if close else frozenset()
        record = frozenset(c.op for c in close) if scope == "high" else None
        return recorders.setdefault((optional, record), _Recorder(out, max_per_op, optional, record))

    with _tables(model, recorder), torch.no_grad():
        if run is not None:
            run()
        else:
            model(**inputs)
    return out


__all__ = [
    "Adapter", "AdapterMount", "AdapterVersionError", "MountedSite", "Site", "SiteHook",
    "capture_admission_batches", "feed_forward", "gelu_projection", "gemm_gelu_enabled", "gemm_gelu_runs", "half_precision", "handoff_counts", "mounted_high", "no_foreign_hooks", "plain_linear", "plain_module",
    "linear_cat_applies",
    "site_hooks", "TIERS",
]
