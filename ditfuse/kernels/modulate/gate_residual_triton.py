"""Gated residual: ``out = r_res(residual + r_p(gate * update))``, bit-exact vs torch 2.11 CUDA eager.

FLUX.1 writes ``gate.unsqueeze(1) * update`` and then ``residual + that`` in bf16: two eager
kernels, each computing in fp32 and rounding once to bf16 when it stores. Wan writes
``(x.float() + ff.float() * gate_fp32).type_as(x)``: the product and the sum in fp32 (r32 each),
one rounding to bf16 at the end. Both are this kernel: the product is rounded to ``r_p`` =
promote(gate, update) (an identity for fp32), the sum is computed in fp32 (which is eager's r32,
or the fp32 opmath of a bf16 add) and stored once in the residual's dtype. Launched with
``enable_fp_fusion=False`` so the product is never fused into the add (an FMA would skip the
product's rounding, which in fp32 is the fp32 product itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import broadcast_3d, fits_int32, load_f32, tile, tile_rows_cols
from ..common.host import (cdiv, SUPPORTED_DTYPES, device_reason, grad_reason, in_eager_layout, promote, tl_dtype,
                           use_custom_op)
from ..common.plans import Recipes, call_key
from ..common.rounding import round_to, rround
from ..env import env
from ..errors import UnsupportedInput
from ..common.launch import launch


@triton.jit
def _gate_residual_kernel(
    res_ptr, gate_ptr, upd_ptr, out_ptr, gt_ptr,
    R, S, D,
    srb, srs, srd,
    sgb, sgs, sgd,
    sub, sus, sud,
    sob, sos, sgtd,
    DTYPE: tl.constexpr,
    P_DT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    I64: tl.constexpr = True,
    G_TAB: tl.constexpr = False,
):
    b, s, c, mask = tile_rows_cols(R, S, D, BLOCK_R, BLOCK_D, I64)
    res = load_f32(res_ptr + (b * srb + s * srs) + c * srd, mask)
    g = load_f32(gate_ptr + (b * sgb + s * sgs) + c * sgd, mask)
    if G_TAB:
        # eager's ``scale_shift_table + temb.float()`` chunk: one fp32 add, formed here
        g = load_f32(gt_ptr + (b * 0 + s * 0) + c * sgtd, mask) + g
    u = load_f32(upd_ptr + (b * sub + s * sus) + c * sud, mask)
    prod = rround(g * u, P_DT)  # eager op 1: gate[:, None] * update
    out = round_to(res + prod, DTYPE)  # eager op 2: residual + product (fp32 opmath), stored
    tl.store(out_ptr + (b * sob + s * sos) + c, out, mask=mask)


# The flat kernel's tile: 1024 elements, 4 warps (torch.compile's pointwise default). On an H100
# (bench/results/probe_gate_residual_flat_round13_h100.log) it moved 100.2 / 101.2 / 95.7 / 101.8 %
# of copy bandwidth at [1|2, 32760, 1536] (fp32 gate), [1, 4608, 3072] and [2, 32760, 5120]
# against the tile kernel's 97.4 / 98.6 / 94.0 / 98.5 and torch.compile's 100.3 / 101.1 / 95.5 /
# 101.8. DITFUSE_GATE_RESIDUAL_FLAT=0 keeps the tile kernel (a switch in the call key, plans.py).
_FLAT_BLOCK, _FLAT_WARPS = 1024, 4


def _flat_enabled() -> bool:
    return env("DITFUSE_GATE_RESIDUAL_FLAT", "1") not in ("", "0")


@triton.jit
def _gate_residual_flat_kernel(
    res_ptr, gate_ptr, upd_ptr, out_ptr,
    SD, sgb, sgd,
    D: tl.constexpr,
    DTYPE: tl.constexpr,
    P_DT: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    I64: tl.constexpr = True,
):
    # _gate_residual_kernel's arithmetic over one sample's flat index (grid: blocks per sample x
    # B) for contiguous residual / update / out and a gate broadcast over tokens: no per-row
    # division, no mask when the block divides S * D, the gate column a remainder by the
    # compile-time width (one compile per model width, not per token count)
    b = tl.program_id(1)
    if I64:
        b = b.to(tl.int64)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = b * SD
    mask = None if EVEN else offs < SD
    res = load_f32(res_ptr + base + offs, mask)
    u = load_f32(upd_ptr + base + offs, mask)
    g = load_f32(gate_ptr + b * sgb + (offs % D) * sgd, mask)
    out = round_to(res + rround(g * u, P_DT), DTYPE)
    if EVEN:
        tl.store(out_ptr + base + offs, out)
    else:
        tl.store(out_ptr + base + offs, out, mask=mask)


def _unsupported_reason(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                        gate_table: torch.Tensor | None = None) -> str | None:
    if not all(isinstance(t, torch.Tensor) for t in (residual, gate, update)):
        return "residual, gate and update must be tensors"
    if gate_table is not None:
        if not isinstance(gate_table, torch.Tensor):
            return "gate_table is not a tensor"
        if gate_table.dim() != 1 or residual.dim() != 3 or gate_table.shape[0] != residual.shape[-1]:
            return f"gate_table shape {tuple(gate_table.shape)} is not [D] for residual {tuple(residual.shape)}"
        if gate_table.dtype not in SUPPORTED_DTYPES:
            return f"gate_table dtype {gate_table.dtype} not bf16, fp16 or fp32"
        reason = device_reason(residual, gate_table) or grad_reason(gate_table)
        if reason:
            return reason
    if residual.dim() != 3:
        return f"residual must be 3-D [B, S, D], got {residual.dim()}-D"
    if tuple(update.shape) != tuple(residual.shape):
        # Eager would broadcast; FLUX never does, and the output shape would no longer be residual's.
        return f"update shape {tuple(update.shape)} differs from residual {tuple(residual.shape)}"
    if any(t.dtype not in SUPPORTED_DTYPES for t in (residual, gate, update)):
        return f"dtypes (residual {residual.dtype}, gate {gate.dtype}, update {update.dtype}) not all bf16, fp16 or fp32"
    reason = device_reason(residual, gate, update) or grad_reason(residual, gate, update)
    if reason:
        return reason
    if broadcast_3d(gate, tuple(residual.shape)) is None:
        return (
            f"gate of shape {tuple(gate.shape)} is not [B, D], [B, 1, D] or [B, S, D] broadcastable "
            f"to {tuple(residual.shape)}"
        )
    return None


def can_use_gate_residual(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                          gate_table: torch.Tensor | None = None) -> bool:
    """True when :func:`gate_residual` reproduces eager for these inputs. Rejected (False):
    non-tensors (``gate=None`` too: a plain add is one eager op, nothing to fuse); residual not
    3-D; update shape != residual shape; dtypes other than bf16/fp16/fp32; different devices, or
    the CPU without TRITON_INTERPRET=1; an input requiring grad with grad mode on (no backward);
    gate not [B, D], [B, 1, D] or [B, S, D] broadcastable to residual. Mixed dtypes follow torch's
    promotion (the product in promote(gate, update), the result in the residual's dtype). Any
    strides are handled. ``gate_table``: a [D] row (bf16 / fp16 / fp32) on the same device."""
    return _unsupported_reason(residual, gate, update, gate_table) is None


def _recipe(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
            gate_table: torch.Tensor | None = None) -> tuple | None:
    """(grid, scalar arguments, constexprs) from the inputs' geometry, or None for an empty output
    (cached per geometry by :func:`gate_residual`, common/plans.py). With ``gate_table`` the gate
    operand is fp32 (``table + gate.float()``) and the tile kernel runs (per-token gates only
    come with tables; the flat kernel is the per-sample path)."""
    B, S, D = residual.shape
    if B * S * D == 0:
        return None
    sr, su = residual.stride(), update.stride()
    sg = broadcast_3d(gate, (B, S, D))
    assert sg is not None
    gate_dt = torch.float32 if gate_table is not None else gate.dtype
    consts = dict(DTYPE=tl_dtype(residual.dtype), P_DT=tl_dtype(promote(gate_dt, update.dtype)),
                  enable_fp_fusion=False)
    if gate_table is None and sg[1] == 0 and residual.is_contiguous() and update.is_contiguous() and _flat_enabled():
        sd = S * D
        return (_gate_residual_flat_kernel, (cdiv(sd, _FLAT_BLOCK), B), (sd, sg[0], sg[2]),
                dict(consts, D=D, BLOCK=_FLAT_BLOCK, EVEN=sd % _FLAT_BLOCK == 0, num_warps=_FLAT_WARPS))
    # 2048 elements per program (8 warps, 8 per thread): 97.7 % of copy bandwidth at Wan's
    # [1, 32760, 1536] vs 87.7 % with 8192, and never slower elsewhere (H200 sweep,
    # bench/results/probe_gate_residual_tile_h200.csv)
    block_r, block_d, warps = tile(D, per_program=2048)
    R = B * S
    grid = (cdiv(R, block_r), cdiv(D, block_d))
    # out is contiguous [B, S, D]: strides (S * D, D, 1)
    scalars = (R, S, D, sr[0], sr[1], sr[2], sg[0], sg[1], sg[2], su[0], su[1], su[2], S * D, D,
               0 if gate_table is None else gate_table.stride(0))
    return _gate_residual_kernel, grid, scalars, dict(consts, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
                                                      G_TAB=gate_table is not None)


def _fire(r: tuple | None, residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
          gate_table: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    if r is None:
        return out
    kernel, grid, scalars, consts = r
    # int32 addressing depends on the storages' sizes, which the geometry key does not hold
    if kernel is _gate_residual_flat_kernel:
        i64 = not fits_int32(residual, gate, update, out)
        launch(kernel, grid, residual, gate, update, out, *scalars, I64=i64, **consts)
    else:
        gt = out if gate_table is None else gate_table
        i64 = not fits_int32(residual, gate, update, out, gt)
        launch(kernel, grid, residual, gate, update, out, gt, *scalars, I64=i64, **consts)
    return in_eager_layout(out, residual)


def _launch(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
            gate_table: torch.Tensor | None = None) -> torch.Tensor:
    return _fire(_recipe(residual, gate, update, gate_table), residual, gate, update, gate_table)


@torch.library.custom_op("ditfuse::gate_residual", mutates_args=())
def _gate_residual_op(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                      gate_table: torch.Tensor | None = None) -> torch.Tensor:
    return _launch(residual, gate, update, gate_table)


@_gate_residual_op.register_fake
def _(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
      gate_table: torch.Tensor | None = None) -> torch.Tensor:
    return residual.new_empty(residual.shape)


def gate_residual(residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                  gate_table: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r(residual + r(gate * update))``, bitwise equal to torch 2.11 CUDA eager
    ``residual + gate.unsqueeze(1) * update`` (r = round to the dtype, nearest-even).

    residual, update: [B, S, D] (any strides); gate: [B, D] / [B, 1, D] per sample or [B, S, D] per
    token; all bf16, fp16 or fp32. Returns a new contiguous [B, S, D] tensor. FLUX's fp16 ``clip``
    after the single block's residual is a separate op and not part of this kernel. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_gate_residual` is False. Runs as the
    custom op ``ditfuse::gate_residual``. ``gate_table`` ([D] or None): the gate is ``gate_table +
    gate.float()`` (Wan 2.2 TI2V's per-token ``scale_shift_table + temb.float()`` chunk), that one
    fp32 add done in the kernel on the embedding as the model holds it.
    """
    return _keyed(None, residual, gate, update, gate_table)


_RECIPES = Recipes()


def _keyed(key: tuple | None, residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
           gate_table: torch.Tensor | None = None) -> torch.Tensor:
    if use_custom_op():
        reason = _unsupported_reason(residual, gate, update, gate_table)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.gate_residual(residual, gate, update, gate_table)
    if key is None:
        key = call_key((residual, gate, update) if gate_table is None else (residual, gate, update, gate_table))
    r = _RECIPES.checked(key, lambda: _unsupported_reason(residual, gate, update, gate_table),
                         lambda: _recipe(residual, gate, update, gate_table))
    return _fire(r, residual, gate, update, gate_table)


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
gate_residual.keyed = _keyed


__all__ = ["gate_residual", "can_use_gate_residual"]
