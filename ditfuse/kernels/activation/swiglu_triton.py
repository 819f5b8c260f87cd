"""SwiGLU, bit-exact vs torch 2.11 CUDA eager ``F.silu(gate_in) * up``, optionally written into a
strided slice of a preallocated buffer.

What eager does (FLUX.2's ``Flux2SwiGLU``: ``gate_in = x[..., :I]``, ``up = x[..., I:]`` of the
fused projection; Z-Image's ``F.silu(w1(x)) * w3(x)``): two elementwise kernels and two stores::

    s   = r(silu(gate_in))           # ActivationSiluKernel: y / (1 + expf(-y)) in fp32, one rounding
    out = r(f32(s) * f32(up))        # the binary mul in fp32 ("opmath"), one rounding

so ``out = r(r(silu(a)) * b)``; for fp32 inputs both roundings are the identity of an fp32 op.
Here one pass loads ``a`` and ``b`` (any strides: the two column halves of one projection output),
keeps the intermediate rounding of ``s`` to the input dtype, and stores once: 6 bytes per output
element in bf16 instead of eager's 10. ``out`` may be a strided view, e.g. the MLP columns of the
FLUX.2 single block's ``[B, S, D + I]`` ``to_out`` input, so ``cat([attn, swiglu], -1)`` is never
materialised. Launched with ``enable_reflect_ftz=False`` (libdevice's non-FTZ ``expf``, as torch
is built) and ``enable_fp_fusion=False`` (there is nothing to contract; kept explicit).

Under ``TRITON_INTERPRET=1`` numpy's exp replaces ``expf``, so CPU results agree with eager only to
an ulp or so before the rounding (the gate then disables the kernel; the output stays eager's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import (
    act_cat_fire, act_cat_recipe, as_3d, fits_int32, launch_act_cat, load_f32, overlap_reason, silu_f32, tile,
    tile_cols_first, tile_grid, tile_rows_cols,
)
from ..common.host import SUPPORTED_DTYPES, device_reason, grad_reason, tl_dtype, use_custom_op
from ..common.plans import Recipes, call_key
from ..common.rounding import round_to, rround
from ..errors import UnsupportedInput
from ..common.launch import launch


@triton.jit
def _swiglu_tile(a_ptrs, u_ptrs, mask, DTYPE: tl.constexpr, P: tl.constexpr):
    """``r(r(silu(a)) * u)`` of one tile, loaded from ``a_ptrs`` / ``u_ptrs``, in the stored dtype
    (also the activation half of common/elementwise.py act_cat_kernel; ``P`` unused)."""
    a = load_f32(a_ptrs, mask)
    u = load_f32(u_ptrs, mask)
    g = rround(silu_f32(a), DTYPE)  # eager stores silu's result before the multiply reads it
    return round_to(g * u, DTYPE)


@triton.jit
def _swiglu_kernel(
    a_ptr, b_ptr, out_ptr,
    R, S, D,
    sab, sas, sad,
    sbb, sbs, sbd,
    sob, sos, sod,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    I64: tl.constexpr = True,
    COLS_FIRST: tl.constexpr = False,
):
    b, s, c, mask = tile_rows_cols(R, S, D, BLOCK_R, BLOCK_D, I64, COLS_FIRST)
    y = _swiglu_tile(a_ptr + (b * sab + s * sas) + c * sad, b_ptr + (b * sbb + s * sbs) + c * sbd, mask, DTYPE, 0)
    tl.store(out_ptr + (b * sob + s * sos) + c * sod, y, mask=mask)


def _launch(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    if out.numel() == 0:
        return
    view = as_3d(gate_in, up, out)
    assert view is not None
    (B, S, D), (sa, sb, so) = view
    block_r, block_d, warps = tile(D, per_program=4096)
    R = B * S
    cols_first = tile_cols_first()
    grid = tile_grid(R, D, block_r, block_d, cols_first)
    launch(_swiglu_kernel, grid,
        gate_in, up, out,
        R, S, D,
        sa[0], sa[1], sa[2],
        sb[0], sb[1], sb[2],
        so[0], so[1], so[2],
        DTYPE=tl_dtype(gate_in.dtype), BLOCK_R=block_r, BLOCK_D=block_d,
        I64=not fits_int32(gate_in, up, out), COLS_FIRST=cols_first, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False,
    )


def _unsupported_reason(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    if not isinstance(gate_in, torch.Tensor) or not isinstance(up, torch.Tensor) or (
        out is not None and not isinstance(out, torch.Tensor)
    ):
        return "gate_in, up (and out, when given) must be tensors"
    if gate_in.dtype not in SUPPORTED_DTYPES:
        return f"dtype {gate_in.dtype} is not bf16, fp16 or fp32"
    if up.dtype != gate_in.dtype:
        return f"up dtype {up.dtype} differs from gate_in dtype {gate_in.dtype} (eager would promote)"
    if tuple(up.shape) != tuple(gate_in.shape):
        return f"up shape {tuple(up.shape)} differs from gate_in shape {tuple(gate_in.shape)} (no broadcasting)"
    tensors = (gate_in, up) if out is None else (gate_in, up, out)
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if out is not None:
        if out.dtype != gate_in.dtype:
            return f"out dtype {out.dtype} differs from the input dtype {gate_in.dtype}"
        if tuple(out.shape) != tuple(gate_in.shape):
            return f"out shape {tuple(out.shape)} differs from the input shape {tuple(gate_in.shape)}"
        reason = overlap_reason(out, gate_in, up)
        if reason:
            return reason
        if as_3d(gate_in, up, out) is None:
            return "leading dims of gate_in/up/out cannot be viewed as two strided dims"
    elif as_3d(gate_in, up) is None:
        return "leading dims of gate_in/up cannot be viewed as two strided dims"
    return None


def can_use_swiglu(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """True when :func:`swiglu` reproduces eager for these inputs. Rejected (False): non-tensors;
    dtypes other than bf16/fp16/fp32; ``up`` with another dtype or shape than ``gate_in`` (eager
    would promote or broadcast); ``out`` of another dtype or shape, or partially overlapping an
    input (the same view as an input, i.e. in place, is fine); tensors on different devices or on
    the CPU without TRITON_INTERPRET=1; an input that requires grad with grad mode on; leading
    dims that cannot be expressed as two strided dims in every tensor."""
    return _unsupported_reason(gate_in, up, out) is None


@torch.library.custom_op("ditfuse::swiglu", mutates_args=("out",))
def _swiglu_op(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    _launch(gate_in, up, out)


@_swiglu_op.register_fake
def _(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    return None


def swiglu(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r(r(gate_in / (1 + expf(-gate_in))) * up)``, bitwise equal to torch 2.11 CUDA
    ``F.silu(gate_in) * up`` (r = round to the inputs' dtype, nearest-even; see module doc).

    gate_in, up: same shape and dtype (bf16, fp16 or fp32), any strides whose leading dims form at
    most two strided dims (``x[..., :I]`` and ``x[..., I:]`` of one projection output). ``out``:
    None (a new contiguous tensor is returned) or a same-shape, same-dtype tensor, possibly a
    strided slice of a larger buffer; it is written in place and returned. Runs as the custom op
    ``ditfuse::swiglu`` (``mutates_args=("out",)``: torch.compile functionalises the write).
    Raises :class:`UnsupportedInput` exactly where :func:`can_use_swiglu` is False.
    """
    return _keyed_swiglu(None, gate_in, up, out)


def _keyed_swiglu(key: tuple | None, gate_in: torch.Tensor, up: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    # With ``out`` the predicate checks memory overlap, which depends on addresses, not geometry:
    # only the out=None form is cached.
    if out is None and not use_custom_op():
        if key is None:
            key = call_key((gate_in, up))
        # only the predicate's verdict is kept (its launch arithmetic is a few integer ops)
        _SWIGLU_RECIPES.checked(key, lambda: _unsupported_reason(gate_in, up, None), lambda: True)
        out = torch.empty(gate_in.shape, dtype=gate_in.dtype, device=gate_in.device)
        _launch(gate_in, up, out)
        return out
    reason = _unsupported_reason(gate_in, up, out)
    if reason is not None:
        raise UnsupportedInput(reason)
    if out is None:
        out = torch.empty(gate_in.shape, dtype=gate_in.dtype, device=gate_in.device)
    if use_custom_op():
        torch.ops.ditfuse.swiglu(gate_in, up, out)
    else:
        _launch(gate_in, up, out)
    return out


swiglu.keyed = _keyed_swiglu




def _cat_reason(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> str | None:
    if not all(isinstance(t, torch.Tensor) for t in (attn, gate_in, up)):
        return "attn, gate_in and up must be tensors"
    if attn.dim() != 3 or gate_in.dim() != 3:
        return f"attn {tuple(attn.shape)} and gate_in {tuple(gate_in.shape)} must be [B, S, D]"
    if tuple(up.shape) != tuple(gate_in.shape):
        return f"up shape {tuple(up.shape)} differs from gate_in shape {tuple(gate_in.shape)} (no broadcasting)"
    if attn.shape[:2] != gate_in.shape[:2]:
        return f"attn {tuple(attn.shape)} and gate_in {tuple(gate_in.shape)} differ in [B, S]"
    if gate_in.dtype not in SUPPORTED_DTYPES:
        return f"dtype {gate_in.dtype} is not bf16, fp16 or fp32"
    if up.dtype != gate_in.dtype or attn.dtype != gate_in.dtype:
        return (f"dtypes attn {attn.dtype}, gate_in {gate_in.dtype}, up {up.dtype} differ "
                "(eager would promote)")
    return device_reason(attn, gate_in, up) or grad_reason(attn, gate_in, up)


@torch.library.custom_op("ditfuse::swiglu_cat", mutates_args=())
def _swiglu_cat_op(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return launch_act_cat(_swiglu_tile, 0, attn, gate_in, up, tl_dtype(gate_in.dtype))


@_swiglu_cat_op.register_fake
def _(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    B, S, DA = attn.shape
    return gate_in.new_empty((B, S, DA + gate_in.shape[2]))


def can_use_swiglu_cat(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> bool:
    """True when :func:`swiglu_cat` reproduces eager for these inputs. Rejected (False):
    non-tensors; attn and gate_in not both [B, S, *] with the same B and S; up of another shape
    than gate_in; dtypes other than bf16/fp16/fp32 or not all one dtype (eager would promote);
    different devices, or the CPU without TRITON_INTERPRET=1; an input that requires grad with grad
    mode on. Any strides."""
    return _cat_reason(attn, gate_in, up) is None


def swiglu_cat(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``cat([attn, r(r(silu(gate_in)) * up)], dim=-1)`` in one kernel, bitwise equal to torch 2.11
    CUDA eager (``ditfuse.kernels.reference.single_block_swiglu_cat``): the attention half copied
    bit for bit, the other half :func:`swiglu`'s arithmetic. Returns a new contiguous
    ``[B, S, DA + DM]`` tensor (FLUX.2's parallel block: the ``to_out`` input). attn ``[B, S, DA]``,
    gate_in / up ``[B, S, DM]`` (the two column halves of the fused projection's MLP part), any
    strides, one dtype. Raises :class:`UnsupportedInput` exactly where :func:`can_use_swiglu_cat`
    is False. Runs as the custom op ``ditfuse::swiglu_cat``."""
    return _keyed_cat(None, attn, gate_in, up)


_CAT_RECIPES = Recipes()
_SWIGLU_RECIPES = Recipes()


def _keyed_cat(key: tuple | None, attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if use_custom_op():
        reason = _cat_reason(attn, gate_in, up)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.swiglu_cat(attn, gate_in, up)
    if key is None:
        key = call_key((attn, gate_in, up))
    r = _CAT_RECIPES.checked(key, lambda: _cat_reason(attn, gate_in, up), lambda: act_cat_recipe(attn, gate_in, up))
    return act_cat_fire(r, _swiglu_tile, 0, attn, gate_in, up, tl_dtype(gate_in.dtype))


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
swiglu_cat.keyed = _keyed_cat


__all__ = ["swiglu", "can_use_swiglu", "swiglu_cat", "can_use_swiglu_cat"]
