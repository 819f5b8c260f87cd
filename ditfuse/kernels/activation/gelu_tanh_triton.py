"""tanh-GELU, bit-exact vs torch 2.11 CUDA ``F.gelu(x, approximate="tanh")``, optionally written
into a strided slice of a preallocated buffer.

What ATen does (``GeluCUDAKernelImpl``, tanh branch, aten/src/ATen/native/cuda/ActivationGeluKernel.cu):
one elementwise kernel, math in fp32 ("opmath") for bf16/fp16/fp32 inputs, one rounding at the store::

    kBeta  = float(M_SQRT2 * M_2_SQRTPI * 0.5)       # constexpr, computed in double
    kKappa = 0.044715f
    x_cube = x * x * x                                 # (x*x)*x
    inner  = kBeta * (x + kKappa * x_cube)
    out    = 0.5f * x * (1 + tanhf(inner))             # (0.5*x) * (1 + t)

nvcc compiles it with its default ``--fmad=true``, so ``x + kKappa * x_cube`` is contracted into
``fma(kKappa, x_cube, x)``; no other product feeds an add (``1 + tanhf(.)`` adds the result of an
fma or of a copysign). ``tanhf`` is CUDA's precise tanhf (inlined, non-FTZ): for |a| >= 0.6,
``copysign(1 - 2 * rcp.approx(1 + ex2.approx(2*log2(e) * |a|)), a)`` (1 from |a| >= 9.0109),
else an odd polynomial evaluated with fmas. libdevice's ``__nv_tanhf`` is the same code; Triton
selects its FTZ variant by default (``enable_reflect_ftz``), so the kernel is launched with
``enable_reflect_ftz=False`` and with ``enable_fp_fusion=False`` (the one fma is explicit).
notes/elementwise.md records the GPU probe that settled the contraction (exhaustive over all
65,536 bf16 and fp16 bit patterns and random fp32).

Under ``TRITON_INTERPRET=1`` (CPU tests) libdevice and inline PTX do not exist; the kernel then runs
the same branch structure with numpy's exp2 and an exact division instead of the ``.approx``
instructions (and the interpreter's fma is a rounded multiply-add), so CPU results agree with eager
only to a couple of ulps before the final rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..common.elementwise import (as_3d, act_cat_fire, act_cat_recipe, fits_int32, launch_act_cat, load_f32,
                                  overlap_reason, tile, tile_cols_first, tile_grid, tile_rows_cols)
from ..common.host import SUPPORTED_DTYPES, device_reason, grad_reason, tl_dtype, use_custom_op
from ..common.plans import Recipes, call_key
from ..common.rounding import INTERPRET, round_to
from ..errors import UnsupportedInput
from ..common.launch import launch

# float(M_SQRT2 * M_2_SQRTPI * 0.5) and 0.044715f: exactly representable fp32 values.
_K_BETA: tl.constexpr = tl.constexpr(0.7978845834732056)  # 0x3F4C422A
_K_KAPPA: tl.constexpr = tl.constexpr(0.044714998453855515)  # 0x3D372713

# tanh implementations (TANH_IMPL constexpr). Production uses the PTX one: the same bits as
# libdevice (0 mismatches over all 65,536 bf16 inputs and every probed shape, H200) and 6-9 %
# faster at FLUX/Wan shapes (bench/probes/probe_gelu_speed.py, bench/results/probe_gelu_speed_h200.csv:
# 0.420 vs 0.456 ms at [2, 32760, 5120], 0.073 vs 0.078 ms for the FLUX single block's GELU).
TANH_LIBDEVICE = 0
TANH_PTX = 1  # libdevice's algorithm written out with inline ex2.approx / rcp.approx
TANH_APPROX = 2  # tanh.approx.f32 (fast-math), for diagnosis only


@triton.jit
def _ex2_approx(x):
    if INTERPRET:
        return tl.exp2(x)
    else:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _rcp_approx(x):
    if INTERPRET:
        return 1.0 / x
    else:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _tanhf_written_out(a):
    """CUDA's precise tanhf (= libdevice ``__nv_tanhf``, non-FTZ), instruction for instruction."""
    # tl.fma does not broadcast scalars: constants become full tensors (0 + C == C exactly).
    zero = tl.zeros_like(a)
    t = tl.abs(a)
    # |a| >= 0.6: 1 - 2 / (1 + 2^(2*log2(e)*|a|)), with the sign of a
    e = _ex2_approx(t * 2.885390043258667)
    r = _rcp_approx(1.0 + e)
    big = tl.fma(r, zero - 2.0, zero + 1.0)
    big = tl.where(t >= 9.010913848876953, 1.0, big)
    sign = a.to(tl.uint32, bitcast=True) & 0x80000000
    big = (big.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # |a| < 0.6 (and NaN): odd polynomial a + a * a^2 * p(a^2)
    a2 = a * a
    p = tl.fma(zero + 0.01573968306183815, a2, zero - 0.05230396240949631)
    p = tl.fma(p, a2, zero + 0.13315297663211823)
    p = tl.fma(p, a2, zero - 0.33332768082618713)
    p = tl.fma(p, a2, zero)
    small = tl.fma(p, a, a)
    return tl.where(t >= 0.6000000238418579, big, small)


@triton.jit
def _tanh(a, TANH_IMPL: tl.constexpr):
    if INTERPRET:
        return _tanhf_written_out(a)
    elif TANH_IMPL == 0:
        return libdevice.tanh(a)
    elif TANH_IMPL == 1:
        return _tanhf_written_out(a)
    else:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _gelu_tanh_kernel(
    x_ptr, out_ptr,
    R, S, D,
    sxb, sxs, sxd,
    sob, sos, sod,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FMA_INNER: tl.constexpr,
    TANH_IMPL: tl.constexpr,
    I64: tl.constexpr = True,
    COLS_FIRST: tl.constexpr = False,
):
    b, s, c, mask = tile_rows_cols(R, S, D, BLOCK_R, BLOCK_D, I64, COLS_FIRST)
    x = load_f32(x_ptr + (b * sxb + s * sxs) + c * sxd, mask)
    tl.store(out_ptr + (b * sob + s * sos) + c * sod, round_to(_gelu_f32(x, FMA_INNER, TANH_IMPL), DTYPE), mask=mask)


@triton.jit
def _gelu_f32(x, FMA_INNER: tl.constexpr, TANH_IMPL: tl.constexpr):
    """ATen's tanh-GELU on fp32 x, before the store's rounding (module docstring)."""
    x_cube = x * x * x
    if FMA_INNER:
        a = tl.fma(tl.zeros_like(x) + _K_KAPPA, x_cube, x)  # nvcc's contraction of x + kKappa * x_cube
    else:
        a = x + _K_KAPPA * x_cube
    inner = _K_BETA * a
    return 0.5 * x * (1.0 + _tanh(inner, TANH_IMPL))


@triton.jit
def _gelu_cat_act(xs, us, mask, DTYPE: tl.constexpr, TANH_IMPL: tl.constexpr):
    """The activation half of ``cat([attn, gelu(mlp)], dim=2)`` (common/elementwise.py
    act_cat_kernel): the GELU above on x; ``us`` unused."""
    return round_to(_gelu_f32(load_f32(xs, mask), True, TANH_IMPL), DTYPE)


def _launch(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    fma_inner: bool = True,
    tanh_impl: int = TANH_PTX,
    fp_fusion: bool = False,
    reflect_ftz: bool = False,
) -> None:
    """Launch the kernel (no checks). The keyword variants exist for the contraction probe
    (bench/probe_elementwise.py); the defaults are the bit-exact configuration."""
    if x.numel() == 0:
        return
    view = as_3d(x, out)
    assert view is not None
    (B, S, D), (sx, so) = view
    # 4096 elements per program on 8 warps: 10 % faster than 2048 at FLUX's [2, 32760, 5120] and
    # 8 % at the single block's [1, 4608, 12288] (H200 sweep, bench/results/probe_held_rows_h200.csv)
    block_r, block_d, warps = tile(D, per_program=4096)
    R = B * S
    cols_first = tile_cols_first()
    grid = tile_grid(R, D, block_r, block_d, cols_first)
    launch(_gelu_tanh_kernel, grid,
        x, out,
        R, S, D,
        sx[0], sx[1], sx[2],
        so[0], so[1], so[2],
        DTYPE=tl_dtype(x.dtype), BLOCK_R=block_r, BLOCK_D=block_d,
        FMA_INNER=fma_inner, TANH_IMPL=tanh_impl, I64=not fits_int32(x, out), COLS_FIRST=cols_first,
        num_warps=warps, enable_fp_fusion=fp_fusion, enable_reflect_ftz=reflect_ftz,
    )


def _unsupported_reason(x: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    if not isinstance(x, torch.Tensor) or (out is not None and not isinstance(out, torch.Tensor)):
        return "x (and out, when given) must be tensors"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not bf16, fp16 or fp32"
    tensors = (x,) if out is None else (x, out)
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if out is not None:
        if out.dtype != x.dtype:
            return f"out dtype {out.dtype} differs from x dtype {x.dtype}"
        if tuple(out.shape) != tuple(x.shape):
            return f"out shape {tuple(out.shape)} differs from x shape {tuple(x.shape)}"
        reason = overlap_reason(out, x)
        if reason:
            return reason
        if as_3d(x, out) is None:
            return "leading dims of x/out cannot be viewed as two strided dims (x[B, S, D]-like views only)"
    elif as_3d(x) is None:
        return "leading dims of x cannot be viewed as two strided dims (x[B, S, D]-like views only)"
    return None


def can_use_gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """True when :func:`gelu_tanh` reproduces eager for these inputs. Rejected (False):
    non-tensors; dtypes other than bf16/fp16/fp32 (fp64 would need double tanh); out with another
    dtype or shape than x; out partially overlapping x (an identical view, i.e. in place, is
    fine); tensors on different devices or on the CPU without TRITON_INTERPRET=1; an input that
    requires grad with grad mode on (no backward); leading dims that cannot be expressed as two
    strided dims in both x and out (e.g. a 4-D view with three incompatible leading strides).
    Strided x and out are handled, e.g. ``out = buf[:, :, D:]`` of a ``[B, S, 5D]`` buffer."""
    return _unsupported_reason(x, out) is None


@torch.library.custom_op("ditfuse::gelu_tanh", mutates_args=("out",))
def _gelu_tanh_op(x: torch.Tensor, out: torch.Tensor) -> None:
    _launch(x, out)


@_gelu_tanh_op.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r(0.5*x*(1 + tanhf(kBeta*fma(kKappa, x*x*x, x))))``, bitwise equal to torch 2.11 CUDA
    ``F.gelu(x, approximate="tanh")`` (r = round to x's dtype, nearest-even; see module doc).

    x: any shape whose leading dims form at most two strided dims; bf16, fp16 or fp32. ``out``:
    None (a new contiguous tensor is returned) or a same-shape, same-dtype tensor, possibly a
    strided slice of a larger buffer (``buf[:, :, D:]`` of the FLUX single block's ``[B, S, 5D]``
    ``proj_out`` input, so that ``cat([attn, gelu(mlp)], dim=2)`` is never materialised); it is
    written in place and returned. Runs as the custom op ``ditfuse::gelu_tanh``, which mutates
    ``out`` (``mutates_args=("out",)``) and returns nothing, so torch.compile functionalises the
    write into the buffer view correctly. Raises :class:`UnsupportedInput` exactly where
    :func:`can_use_gelu_tanh` is False.
    """
    reason = _unsupported_reason(x, out)
    if reason is not None:
        raise UnsupportedInput(reason)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if use_custom_op():
        torch.ops.ditfuse.gelu_tanh(x, out)
    else:
        _launch(x, out)
    return out


def _cat_reason(attn: torch.Tensor, mlp_pre: torch.Tensor) -> str | None:
    if not isinstance(attn, torch.Tensor) or not isinstance(mlp_pre, torch.Tensor):
        return "attn and mlp_pre must be tensors"
    if attn.dim() != 3 or mlp_pre.dim() != 3:
        return f"attn {tuple(attn.shape)} and mlp_pre {tuple(mlp_pre.shape)} must be [B, S, D]"
    if attn.shape[:2] != mlp_pre.shape[:2]:
        return f"attn {tuple(attn.shape)} and mlp_pre {tuple(mlp_pre.shape)} differ in [B, S]"
    if mlp_pre.dtype not in SUPPORTED_DTYPES:
        return f"dtype {mlp_pre.dtype} is not bf16, fp16 or fp32"
    if attn.dtype != mlp_pre.dtype:
        return f"attn dtype {attn.dtype} differs from mlp_pre dtype {mlp_pre.dtype} (torch.cat would promote)"
    reason = device_reason(attn, mlp_pre) or grad_reason(attn, mlp_pre)
    if reason:
        return reason
    return None


def _launch_cat(attn: torch.Tensor, mlp_pre: torch.Tensor, tanh_impl: int = TANH_PTX) -> torch.Tensor:
    return launch_act_cat(_gelu_cat_act, tanh_impl, attn, mlp_pre, None, tl_dtype(mlp_pre.dtype))


@torch.library.custom_op("ditfuse::gelu_tanh_cat", mutates_args=())
def _gelu_tanh_cat_op(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    return _launch_cat(attn, mlp_pre)


@_gelu_tanh_cat_op.register_fake
def _(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    B, S, DA = attn.shape
    return mlp_pre.new_empty((B, S, DA + mlp_pre.shape[2]))


def can_use_gelu_tanh_cat(attn: torch.Tensor, mlp_pre: torch.Tensor) -> bool:
    """True when :func:`gelu_tanh_cat` reproduces eager for these inputs. Rejected (False):
    non-tensors; not both [B, S, *] with the same B and S; dtypes other than bf16/fp16/fp32 or two
    different dtypes (torch.cat would promote); different devices, or the CPU without
    TRITON_INTERPRET=1; an input that requires grad with grad mode on. Any strides."""
    return _cat_reason(attn, mlp_pre) is None


def gelu_tanh_cat(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    """``cat([attn, r(gelu_tanh(mlp_pre))], dim=2)`` in one kernel, bitwise equal to torch 2.11 CUDA
    eager (``ditfuse.kernels.reference.single_block_mlp_cat``): the attention half is copied bit
    for bit, the MLP half is :func:`gelu_tanh`'s arithmetic. Returns a new contiguous
    ``[B, S, DA + DM]`` tensor (the FLUX single block's ``proj_out`` input). attn: ``[B, S, DA]``
    (e.g. the flattened attention output), mlp_pre: ``[B, S, DM]``, any strides, one dtype. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_gelu_tanh_cat` is False. Runs as the
    custom op ``ditfuse::gelu_tanh_cat``."""
    return _keyed_cat(None, attn, mlp_pre)


_CAT_RECIPES = Recipes()


def _keyed_cat(key: tuple | None, attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    if use_custom_op():
        reason = _cat_reason(attn, mlp_pre)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.gelu_tanh_cat(attn, mlp_pre)
    if key is None:
        key = call_key((attn, mlp_pre))
    r = _CAT_RECIPES.checked(key, lambda: _cat_reason(attn, mlp_pre), lambda: act_cat_recipe(attn, mlp_pre, None))
    return act_cat_fire(r, _gelu_cat_act, TANH_PTX, attn, mlp_pre, None, tl_dtype(mlp_pre.dtype))


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
gelu_tanh_cat.keyed = _keyed_cat


__all__ = ["gelu_tanh", "can_use_gelu_tanh", "gelu_tanh_cat", "can_use_gelu_tanh_cat"]
