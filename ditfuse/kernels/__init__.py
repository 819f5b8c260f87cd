"""ditfuse.kernels: what is fused.

``_SPECS`` is the inventory (data only). Public kernels and predicates are resolved lazily
(PEP 562): ``ditfuse.kernels.layernorm_modulate`` imports its Triton module on first access, so
``import ditfuse`` / ``import ditfuse.kernels`` import no kernel module and no triton.
"""

from __future__ import annotations

from typing import Any

from .errors import UnsupportedInput
from .spec import Backend, Capability, Contract, KernelSpec

# Triton kernels here use bf16 loads/stores and are tuned for Hopper, but need nothing newer
# than Ampere; the interpreter capability lets the CPU tests run them under TRITON_INTERPRET=1.
_TRITON_CAPS = frozenset({Capability("cuda", (8, 0)), Capability("cpu", interpreter=True)})


def _triton(op: str, module: str, fn: str, contract: Contract, replaces: str, summary: str) -> KernelSpec:
    base = f"ditfuse.kernels.{module}"
    return KernelSpec(
        op=op,
        backend=Backend.TRITON,
        target=f"{base}:{fn}",
        predicate=f"{base}:can_use_{fn}",
        capabilities=_TRITON_CAPS,
        contract=contract,
        replaces=replaces,
        summary=summary,
    )


_SPECS: tuple[KernelSpec, ...] = (
    _triton(
        "modulate.scale_shift",
        "modulate.scale_shift_triton",
        "scale_shift",
        Contract.BIT_EXACT,
        "r(r(x * r(1 + scale)) + shift)",
        "adaLN modulate x*(1+scale)+shift with eager's three roundings; per-sample or per-token scale/shift",
    ),
    _triton(
        "modulate.gate_residual",
        "modulate.gate_residual_triton",
        "gate_residual",
        Contract.BIT_EXACT,
        "r(residual + r(gate * update))",
        "gated residual add, product rounded then sum rounded",
    ),
    _triton(
        "norm.layernorm_modulate",
        "norm.layernorm_modulate_triton",
        "layernorm_modulate",
        Contract.BIT_EXACT,
        "r(r(r(LayerNorm(x)) * r(1 + scale)) + shift)",
        "affine-free LayerNorm (torch's vectorized Welford order) + adaLN modulate in one pass",
    ),
    _triton(
        "norm.gate_residual_layernorm_modulate",
        "norm.layernorm_modulate_triton",
        "gate_residual_layernorm_modulate",
        Contract.BIT_EXACT,
        "h = r(residual + r(gate * attn)); n = layernorm_modulate(h)",
        "FLUX dual block middle: gated residual then LayerNorm + modulate; returns (h, n)",
    ),
    _triton(
        "rope.qk_rmsnorm_rope",
        "rope.qk_rmsnorm_rope_triton",
        "qk_rmsnorm_rope",
        Contract.BIT_EXACT,
        "r(rope(r(RMSNorm(q|k)))) for text+image, written into the joint [B, S_txt+S_img, H, D]",
        "per-head RMSNorm + FLUX interleaved RoPE (fp32 cos/sin), writes the concatenated q/k",
    ),
    _triton(
        "activation.gelu_tanh",
        "activation.gelu_tanh_triton",
        "gelu_tanh",
        Contract.BIT_EXACT,
        "r(gelu(x, approximate='tanh')) then cat([attn, mlp], dim=2)",
        "tanh-GELU written straight into a slice of a preallocated buffer (the cat disappears)",
    ),
    # Close kernels (quality="high" only; each must pass the fp64 admission test).
    KernelSpec(
        op="activation.linear_gelu_tanh",
        backend=Backend.TORCH,
        target="ditfuse.kernels.activation.linear_gelu_tanh_torch:linear_gelu_tanh",
        predicate="ditfuse.kernels.activation.linear_gelu_tanh_torch:can_use_linear_gelu_tanh",
        capabilities=frozenset({Capability("cuda", (8, 0)), Capability("cpu", interpreter=True)}),
        contract=Contract.CLOSE,
        replaces="r(gelu_tanh(r(x @ W.T + b))) -> r(gelu_tanh(x @ W.T + b))",
        summary="bias + tanh-GELU in the GEMM epilogue (torch._addmm_activation, cublasLt GELU_BIAS)",
    ),
    _triton(
        "norm.layernorm_modulate_fp32",
        "norm.layernorm_modulate_fp32_triton",
        "layernorm_modulate_fp32",
        Contract.CLOSE,
        "r(r(r(LN(x)) * r(1 + scale)) + shift) -> r(LN32(x) * (1 + scale) + shift)",
        "single-pass fp32 LayerNorm + modulate, one rounding, whole rows in registers",
    ),
    _triton(
        "norm.gate_residual_layernorm_modulate_fp32",
        "norm.layernorm_modulate_fp32_triton",
        "gate_residual_layernorm_modulate_fp32",
        Contract.CLOSE,
        "h = r(res + r(gate * y)); n = ... -> h = r(res + gate * y); n = r(LN32(h32) * (1 + scale) + shift)",
        "gated residual + fp32 LayerNorm + modulate in one pass; returns (h, n)",
    ),
    _triton(
        "rope.qk_rmsnorm_rope_fp32",
        "rope.qk_rmsnorm_rope_fp32_triton",
        "qk_rmsnorm_rope_fp32",
        Contract.CLOSE,
        "r(rope(r(RMSNorm(q|k)))) -> r(rope32(RMSNorm32(q|k))) into the joint [B, S, H, D]",
        "QK RMSNorm + concat + RoPE without the intermediate rounding",
    ),
)

# Public facade: name -> "module:attr". Every spec exports its kernel and its predicate.
_EXPORTS: dict[str, str] = {}
for _spec in _SPECS:
    for _target in (_spec.target, _spec.predicate):
        if _target is not None:
            _EXPORTS.setdefault(_target.partition(":")[2], _target)
    _EXPORTS.update(dict(_spec.exports))
del _spec, _target

__all__ = sorted(
    ["Backend", "Capability", "Contract", "KernelSpec", "UnsupportedInput", *_EXPORTS]
)


def __getattr__(name: str) -> Any:
    target = _EXPORTS.get(name)
    if target is None:
        raise AttributeError(f"module 'ditfuse.kernels' has no attribute {name!r}")
    from .spec import _load_target

    value = _load_target(target)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
