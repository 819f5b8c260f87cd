"""FLUX.1 request-gated sites: the quality="high" fast forwards and their static guards.

:func:`mark_high_sites` marks (``ditfuse.contracts.quality.mark``) on a FluxTransformer2DModel:

- every ``FluxTransformerBlock`` (``flux.dual_block``): adaLN-Zero with the single-pass fp32
  LayerNorm + modulate, the gated residual + norm2 + modulate in fp32;
- the first layer of each of its FeedForwards (diffusers ``GELU(approximate="tanh")``,
  ``flux.linear_gelu_tanh``): bias + tanh-GELU folded into the GEMM epilogue;
- every ``FluxSingleTransformerBlock`` (``flux.single_block``): fp32 LN + modulate, and
  ``proj_mlp`` + GELU as one GEMM with the GELU epilogue;
- every ``FluxAttention`` (``flux.attention``): QK RMSNorm + RoPE without the intermediate rounding;
- ``norm_out`` (``flux.norm_out``): fp32 LN + modulate.

The fast forwards are the lossless ones of :mod:`ditfuse.models.flux` run with the op set
:data:`HIGH` (close kernels swapped in, :mod:`ditfuse.contracts.close`); the hooks stack on top of
the lossless hooks, so unmounting brings the lossless forward (and its bitwise equality with
diffusers) back. Every site carries static guards: fp16/bf16 parameters, the module configured as
the fast forward reproduces it, no diffusers/accelerate hook (offloading, casting, caches) on it,
plain ``nn.Linear`` layers with a 2-D plain-tensor weight and a bias of the same dtype where a GEMM
is fused, each close op admitted (:mod:`ditfuse.contracts.admission`) and available on the
module's device. ``quality.mount`` installs all of a transformer's sites or none.

:func:`capture_admission_batches` records the inputs each close op would see during one forward of
an *unaccelerated* model, for the admission test (bench/admit.py, tests/gpu).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..contracts import admission, close, ops
from ..contracts.quality import Guard, mark
from . import flux
from .base import hook_factory

OP_LINEAR_GELU = "activation.linear_gelu_tanh"
OP_LN = "norm.layernorm_modulate_fp32"
OP_GR_LN = "norm.gate_residual_layernorm_modulate_fp32"
OP_QK = "rope.qk_rmsnorm_rope_fp32"


def _single_mlp_gelu(block, norm_hidden_states: torch.Tensor) -> torch.Tensor:
    return close.linear_gelu_tanh(norm_hidden_states, block.proj_mlp.weight, block.proj_mlp.bias)


def _single_cat(block, attn_output: torch.Tensor, mlp: torch.Tensor) -> torch.Tensor:
    return torch.cat([attn_output, mlp], dim=2)


HIGH = flux.FluxOps(
    layernorm_modulate=close.layernorm_modulate_fp32,
    gate_residual_layernorm_modulate=close.gate_residual_layernorm_modulate_fp32,
    gate_residual=ops.gate_residual,  # already exact: a single fused rounding chain
    qk_rmsnorm_rope=close.qk_rmsnorm_rope_fp32,
    single_mlp=_single_mlp_gelu,
    single_attn_mlp_cat=_single_cat,
)


# ------------------------------------------------------------------------------ hooks


def gelu_linear_forward(gelu, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers ``GELU(approximate="tanh")``: ``gelu(proj(x))`` as one GEMM with the GELU epilogue."""
    return close.linear_gelu_tanh(hidden_states, gelu.proj.weight, gelu.proj.bias)


_with_high = functools.partial


# ------------------------------------------------------------------------------ guards


def _dtype(module: torch.nn.Module) -> str | None:
    dtypes = {p.dtype for p in module.parameters()}
    if not dtypes:
        return "module has no parameters"
    bad = dtypes - {torch.bfloat16, torch.float16}
    if bad or len(dtypes) > 1:
        return f"parameter dtypes {sorted(str(d) for d in dtypes)}: close kernels need one of bf16/fp16"
    return None


def _no_foreign_hooks(module: torch.nn.Module) -> str | None:
    for name, sub in module.named_modules():
        if hasattr(sub, "_hf_hook"):
            return f"{name or 'module'} has an accelerate hook (offloaded or dispatched weights)"
        reg = getattr(sub, "_diffusers_hook", None)
        if reg is not None:
            foreign = [h for h in reg.hooks if not h.startswith("ditfuse.")]
            if foreign:
                return f"{name or 'module'} has diffusers hook(s) {foreign} (offloading/casting/caching is not composed with quality=high)"
    for name, p in module.named_parameters():
        if p.device.type == "meta":
            return f"parameter {name} is on the meta device (offloaded)"
    return None


def _plain_linear(lin: Any, what: str) -> str | None:
    if type(lin) is not torch.nn.Linear:
        return f"{what} is {type(lin).__name__}, not torch.nn.Linear"
    w, b = lin.weight, lin.bias
    if type(w.data) is not torch.Tensor:
        return f"{what}.weight is a {type(w.data).__name__} (quantized or wrapped weight)"
    if w.dim() != 2:
        return f"{what}.weight is {w.dim()}-D"
    if w.dtype not in (torch.bfloat16, torch.float16):
        return f"{what}.weight dtype {w.dtype} is not bf16/fp16"
    if b is None:
        return f"{what} has no bias (the GELU epilogue fuses the bias)"
    if b.dtype != w.dtype:
        return f"{what}.bias dtype {b.dtype} != weight dtype {w.dtype}"
    if type(b.data) is not torch.Tensor:
        return f"{what}.bias is a {type(b.data).__name__}"
    return None


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _admitted_and_available(op_ids: tuple[str, ...]) -> list[Guard]:
    guards = []
    for op in op_ids:
        guards.append(Guard(f"admitted:{op}", lambda m, op=op: admission.admission_problem(op)))
        guards.append(Guard(f"available:{op}", lambda m, op=op: close.ALL[op].problem(_device(m))))
    return guards


def _common(structure: Callable[[torch.nn.Module], "str | None"]) -> list[Guard]:
    return [
        Guard("dtype", _dtype),
        Guard("structure", structure),
        Guard("no offload", _no_foreign_hooks),
    ]


def _gelu_structure(gelu: torch.nn.Module) -> str | None:
    if type(gelu).__name__ != "GELU" or not hasattr(gelu, "proj"):
        return f"FeedForward's first layer is {type(gelu).__name__}, not diffusers GELU"
    if getattr(gelu, "approximate", None) != "tanh":
        return f"GELU approximate={getattr(gelu, 'approximate', None)!r}, not 'tanh'"
    return None


def _single_structure(block: torch.nn.Module) -> str | None:
    return flux._single_applies(block) or _plain_linear(block.proj_mlp, "proj_mlp")


def mark_high_sites(model: torch.nn.Module) -> int:
    """Mark the quality="high" sites of a FluxTransformer2DModel; returns how many."""
    n = 0
    for _, mod in model.named_modules():
        cls = type(mod).__name__
        if cls == "FluxTransformerBlock":
            mark(mod, "flux.dual_block",
                 _common(flux._dual_applies) + _admitted_and_available((OP_LN, OP_GR_LN)),
                 hook_factory("flux.dual_block", _with_high(flux.dual_block_forward, _ops=HIGH)))
            n += 1
            for ff_name in ("ff", "ff_context"):
                ff = getattr(mod, ff_name, None)
                first = ff.net[0] if ff is not None and hasattr(ff, "net") and len(ff.net) else None
                if first is None:
                    continue
                guards = _common(_gelu_structure) + [
                    Guard("linear", lambda m: _plain_linear(getattr(m, "proj", None), "proj")),
                ] + _admitted_and_available((OP_LINEAR_GELU,))
                mark(first, "flux.linear_gelu_tanh", guards, hook_factory("flux.linear_gelu_tanh", gelu_linear_forward))
                n += 1
        elif cls == "FluxSingleTransformerBlock":
            mark(mod, "flux.single_block",
                 _common(_single_structure) + _admitted_and_available((OP_LN, OP_LINEAR_GELU)),
                 hook_factory("flux.single_block", _with_high(flux.single_block_forward, _ops=HIGH)))
            n += 1
        elif cls == "FluxAttention":
            mark(mod, "flux.attention",
                 _common(flux._attn_applies) + _admitted_and_available((OP_QK,)),
                 hook_factory("flux.attention", _with_high(flux.attention_forward, _ops=HIGH)))
            n += 1
        elif cls == "AdaLayerNormContinuous":
            mark(mod, "flux.norm_out",
                 _common(flux._norm_out_applies) + _admitted_and_available((OP_LN,)),
                 hook_factory("flux.norm_out", _with_high(flux.norm_out_forward, _ops=HIGH)))
            n += 1
    return n


HIGH_OPS = (OP_LINEAR_GELU, OP_LN, OP_GR_LN, OP_QK)


# ------------------------------------------------------------------------------ admission capture


def capture_admission_batches(
    model: torch.nn.Module, inputs: dict[str, Any], max_per_op: int | None = None
) -> dict[str, list[admission.Batch]]:
    """Run one forward of ``model`` (plain diffusers: not accelerated) with ``inputs`` and record,
    for each close op, the arguments it would get at every site: ``op -> [(args, kwargs), ...]``.
    """
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    out: dict[str, list[admission.Batch]] = {op: [] for op in HIGH_OPS}

    def add(op: str, *args: Any) -> None:
        if max_per_op is None or len(out[op]) < max_per_op:
            out[op].append((tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args), {}))

    handles = []
    block_state: dict[int, dict[str, Any]] = {}

    def ada_zero_pre(norm, args, kwargs):
        x, emb = args[0], kwargs.get("emb", args[4] if len(args) > 4 else None)
        shift, scale, *_ = norm.linear(norm.silu(emb)).chunk(6, dim=1)
        add(OP_LN, x, scale, shift, norm.norm.eps)

    def ada_single_pre(norm, args, kwargs):
        x, emb = args[0], kwargs.get("emb", args[1] if len(args) > 1 else None)
        shift, scale, _ = norm.linear(norm.silu(emb)).chunk(3, dim=1)
        add(OP_LN, x, scale, shift, norm.norm.eps)

    def ada_cont_pre(norm, args, kwargs):
        x = args[0]
        cond = kwargs.get("conditioning_embedding", args[1] if len(args) > 1 else None)
        scale, shift = torch.chunk(norm.linear(norm.silu(cond).to(x.dtype)), 2, dim=1)
        add(OP_LN, x, scale, shift, norm.norm.eps)

    def linear_pre(lin, args):
        add(OP_LINEAR_GELU, args[0], lin.weight, lin.bias)

    def attn_pre(attn, args, kwargs):
        names = ("hidden_states", "encoder_hidden_states", "attention_mask", "image_rotary_emb")
        a = dict(zip(names, args))
        a.update({k: v for k, v in kwargs.items() if k in names})
        hs, ehs, rot = a["hidden_states"], a.get("encoder_hidden_states"), a.get("image_rotary_emb")
        q, k, _, eq, ek, _ = _get_qkv_projections(attn, hs, ehs)
        un = lambda t: t.unflatten(-1, (-1, attn.head_dim))  # noqa: E731
        cos, sin = rot if rot is not None else (None, None)
        if attn.added_kv_proj_dim is not None and ehs is not None:
            add(OP_QK, un(q), un(k), attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps,
                un(eq), un(ek), attn.norm_added_q.weight, attn.norm_added_k.weight)
        else:
            add(OP_QK, un(q), un(k), attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps)

    def block_pre(block, args, kwargs):
        names = ("hidden_states", "encoder_hidden_states", "temb")
        a = dict(zip(names, args))
        a.update({k: v for k, v in kwargs.items() if k in names})
        block_state[id(block)] = a

    def attn_post_for(block):
        def hook(attn, args, kwargs, output):
            block_state[id(block)]["attn"] = output
        return hook

    def block_post(block, args, kwargs, output):
        st = block_state.pop(id(block))
        attn_out = st["attn"]
        for norm, norm2, res, upd in (
            (block.norm1, block.norm2, st["hidden_states"], attn_out[0]),
            (block.norm1_context, block.norm2_context, st["encoder_hidden_states"], attn_out[1]),
        ):
            _, _, gate_msa, shift_mlp, scale_mlp, _ = norm.linear(norm.silu(st["temb"])).chunk(6, dim=1)
            add(OP_GR_LN, res, gate_msa, upd, scale_mlp, shift_mlp, norm2.eps)

    for _, mod in model.named_modules():
        cls = type(mod).__name__
        if cls == "AdaLayerNormZero":
            handles.append(mod.register_forward_pre_hook(ada_zero_pre, with_kwargs=True))
        elif cls == "AdaLayerNormZeroSingle":
            handles.append(mod.register_forward_pre_hook(ada_single_pre, with_kwargs=True))
        elif cls == "AdaLayerNormContinuous":
            handles.append(mod.register_forward_pre_hook(ada_cont_pre, with_kwargs=True))
        elif cls == "FluxAttention":
            handles.append(mod.register_forward_pre_hook(attn_pre, with_kwargs=True))
        elif cls == "FluxTransformerBlock":
            handles.append(mod.register_forward_pre_hook(block_pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(block_post, with_kwargs=True))
            handles.append(mod.attn.register_forward_hook(attn_post_for(mod), with_kwargs=True))
            for ff in (mod.ff, mod.ff_context):
                if type(ff.net[0]).__name__ == "GELU":
                    handles.append(ff.net[0].proj.register_forward_pre_hook(linear_pre))
        elif cls == "FluxSingleTransformerBlock":
            handles.append(mod.proj_mlp.register_forward_pre_hook(linear_pre))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return out


__all__ = ["HIGH", "HIGH_OPS", "mark_high_sites", "capture_admission_batches", "gelu_linear_forward"]
