"""Single-pass fp32 LayerNorm + adaLN modulate (contract: close).

``layernorm_modulate_fp32(x, scale, shift, eps)``::

    out = r(LN32(x) * (1 + scale) + shift)                        (one rounding)

``gate_residual_layernorm_modulate_fp32(residual, gate, update, scale, shift, eps)``::

    h32 = residual + gate * update;  h = r(h32)
    n   = r(LN32(h32) * (1 + scale) + shift);                     returns (h, n)

versus eager's ``r(r(r(LN(x)) * r(1 + scale)) + shift)`` (and ``h = r(residual + r(gate * update))``,
LN of the rounded ``h``): every intermediate stays in fp32 and each output is rounded once.
``LN32`` is an affine-free LayerNorm with two-pass statistics over the row held in registers
(``mean = sum(x) / D``, ``var = sum((x - mean)^2) / D``, ``rstd = 1 / sqrt(var + eps)``), which is
at least as accurate as torch's Welford. The LayerNorm of the gated variant reads the unrounded
fp32 ``h32`` (the value the fp64 evaluation of the same math normalises); ``h`` itself is stored
rounded, as the residual stream is. Contractions into FMAs are allowed (they only reduce error).
Not bit-exact vs eager: mounted only under quality="high", after passing the fp64 admission test
(ditfuse/contracts/admission.py).

Bandwidth: one read of each input and one write of each output per element; each program holds
``ROWS`` whole rows (width padded to a power of two) in registers, so there is no second pass
over memory.

Shapes: x / residual / update [B, S, D]; scale, shift, gate [B, D] (per sample) or [B, S, D]
(per token); any strides; one dtype (bf16, fp16 or fp32). Outputs are new contiguous tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.rounding import round_to
from ditfuse.kernels.errors import UnsupportedInput

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_MAX_D = 16384  # whole row in registers: wider rows would spill


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _load_rows(ptr, b, s, sb, ss, sd, d, mask):
    offs = (b * sb + s * ss)[:, None] + d[None, :].to(tl.int64) * sd
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["M", "S", "eps"])
def _ln_modulate_fp32_kernel(
    x_ptr, g_ptr, u_ptr, sc_ptr, sh_ptr, h_ptr, out_ptr,
    M, S, D, eps,
    xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
    scsb, scss, scsd, shsb, shss, shsd,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, GATED: tl.constexpr, DTYPE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < M
    b = rows // S
    s = rows % S
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < D)[None, :]
    dst = rows[:, None] * D + d[None, :]

    x = _load_rows(x_ptr, b, s, xsb, xss, xsd, d, mask)
    if GATED:
        g = _load_rows(g_ptr, b, s, gsb, gss, gsd, d, mask)
        u = _load_rows(u_ptr, b, s, usb, uss, usd, d, mask)
        x = x + g * u
        tl.store(h_ptr + dst, round_to(x, DTYPE), mask=mask)

    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / D
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    sc = _load_rows(sc_ptr, b, s, scsb, scss, scsd, d, mask)
    sh = _load_rows(sh_ptr, b, s, shsb, shss, shsd, d, mask)
    y = (xc * rstd[:, None]) * (1.0 + sc) + sh
    tl.store(out_ptr + dst, round_to(y, DTYPE), mask=mask)


def _check_mod(name: str, t: object, x: torch.Tensor) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if t.dtype != x.dtype:
        return f"{name} dtype {t.dtype} != input dtype {x.dtype}"
    if t.device != x.device:
        return f"{name} is on {t.device}, input on {x.device}"
    B, S, D = x.shape
    if tuple(t.shape) not in ((B, D), (B, S, D)):
        return f"{name} shape {tuple(t.shape)} is neither [B, D]={[B, D]} nor [B, S, D]={[B, S, D]}"
    return None


def _unsupported_reason(x, scale, shift, eps, gate=None, update=None) -> str | None:
    """Why the kernel does not take these inputs, or None.

    Rejected: x not a 3-D [B, S, D] tensor of bf16/fp16/fp32; scale/shift/gate of another dtype,
    device or shape ([B, D] or [B, S, D]); update not of x's shape/dtype/device; D == 0 or
    D > 16384 (whole rows live in registers); a device other than CUDA (CPU only under
    TRITON_INTERPRET=1); eps not a real number; an input requiring grad in grad mode.
    """
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() != 3:
        return f"input must be [B, S, D], got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _interpreting()):
        return f"device {x.device} not supported (CUDA; CPU only under TRITON_INTERPRET=1)"
    for name, t in (("scale", scale), ("shift", shift)) + ((("gate", gate),) if update is not None else ()):
        reason = _check_mod(name, t, x)
        if reason:
            return reason
    if update is not None:
        if not isinstance(update, torch.Tensor):
            return "update is not a tensor"
        if update.dtype != x.dtype or update.device != x.device or update.shape != x.shape:
            return (f"update {tuple(update.shape)}/{update.dtype}/{update.device} does not match "
                    f"residual {tuple(x.shape)}/{x.dtype}/{x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps must be a float, got {type(eps).__name__}"
    D = x.shape[-1]
    if D == 0 or D > _MAX_D:
        return f"width D={D} outside 1..{_MAX_D} (whole rows are held in registers)"
    tensors = [t for t in (x, scale, shift, gate, update) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on (no backward)"
    return None


def _mod_strides(t: torch.Tensor) -> tuple[int, int, int]:
    if t.dim() == 2:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _config(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps): about 8K fp32 elements per program (32 per thread at 8 warps)
    so that loads stay wide and several rows share a program at small widths."""
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(16, 8192 // block_d))
    warps = 8 if block_d * rows >= 8192 else 4
    return block_d, rows, warps


def _launch(x, gate, update, scale, shift, eps, gated: bool):
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    h = torch.empty((B, S, D), dtype=x.dtype, device=x.device) if gated else out
    M = B * S
    if M == 0:
        return h, out
    block_d, rows, warps = _config(D)
    g = gate if gated else x
    u = update if gated else x
    _ln_modulate_fp32_kernel[(triton.cdiv(M, rows),)](
        x, g, u, scale, shift, h, out,
        M, S, D, float(eps),
        *x.stride(), *_mod_strides(g), *u.stride(),
        *_mod_strides(scale), *_mod_strides(shift),
        BLOCK_D=block_d, ROWS=rows, GATED=gated, DTYPE=_DTYPES[x.dtype],
        num_warps=warps,
    )
    return h, out


@torch.library.custom_op("ditfuse::layernorm_modulate_fp32", mutates_args=())
def _layernorm_modulate_fp32_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, None, scale, shift, eps, gated=False)[1]


@_layernorm_modulate_fp32_op.register_fake
def _(x, scale, shift, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("ditfuse::gate_residual_layernorm_modulate_fp32", mutates_args=())
def _gate_residual_layernorm_modulate_fp32_op(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(residual, gate, update, scale, shift, eps, gated=True)


@_gate_residual_layernorm_modulate_fp32_op.register_fake
def _(residual, gate, update, scale, shift, eps):
    mk = lambda: torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)  # noqa: E731
    return mk(), mk()


def can_use_layernorm_modulate_fp32(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> bool:
    """True when :func:`layernorm_modulate_fp32` takes these inputs."""
    return _unsupported_reason(x, scale, shift, eps) is None


def layernorm_modulate_fp32(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``out = r(LN32(x) * (1 + scale) + shift)``, one rounding (close to eager's
    ``r(r(r(LN(x)) * r(1 + scale)) + shift)``; see the module docstring).

    x: [B, S, D]; scale, shift: [B, D] or [B, S, D]; one dtype. Raises UnsupportedInput where
    :func:`can_use_layernorm_modulate_fp32` is False.
    """
    reason = _unsupported_reason(x, scale, shift, eps)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.layernorm_modulate_fp32(x, scale, shift, float(eps))


def can_use_gate_residual_layernorm_modulate_fp32(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
) -> bool:
    """True when :func:`gate_residual_layernorm_modulate_fp32` takes these inputs."""
    return _unsupported_reason(residual, scale, shift, eps, gate, update) is None


def gate_residual_layernorm_modulate_fp32(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = r(residual + gate * update)``, ``n = r(LN32(residual + gate * update) * (1 + scale) + shift)``
    in one pass, each rounded once; returns ``(h, n)``. Raises UnsupportedInput where
    :func:`can_use_gate_residual_layernorm_modulate_fp32` is False.
    """
    reason = _unsupported_reason(residual, scale, shift, eps, gate, update)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.gate_residual_layernorm_modulate_fp32(residual, gate, update, scale, shift, float(eps))


__all__ = [
    "layernorm_modulate_fp32",
    "can_use_layernorm_modulate_fp32",
    "gate_residual_layernorm_modulate_fp32",
    "can_use_gate_residual_layernorm_modulate_fp32",
]
