"""Launch helpers shared by the elementwise Triton kernels (modulate, activation).

Every elementwise kernel here sees its operands as 3-D strided views ``[B, S, D]``: a row is one
``(b, s)`` pair, ``D`` is the innermost (usually contiguous) dimension. Broadcast operands
(``scale[:, None]``) are plain 3-D views with stride 0 along the broadcast dimensions, so one kernel
body serves per-sample and per-token modulation, contiguous and strided inputs alike; Triton
specialises strides equal to 1, so the contiguous case still gets 16-byte vector accesses.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..env import env
from .host import cdiv, next_pow2
from .rounding import INTERPRET
from .launch import launch


def as_3d(*tensors: torch.Tensor) -> tuple[tuple[int, int, int], list[tuple[int, int, int]]] | None:
    """Common ``[B, S, D]`` sizes (D = the last dim) and each tensor's strides for same-shaped
    tensors, or None when their leading dims cannot be expressed as at most two strided dims
    without a copy.

    Size-1 leading dims are dropped; adjacent leading dims merge when they are mergeable (as in
    ``view``: ``stride[i] == stride[i+1] * size[i+1]``) in *every* tensor. A 0-d tensor is [1, 1, 1].
    """
    shape = tuple(tensors[0].shape)
    if any(tuple(t.shape) != shape for t in tensors):
        return None
    if len(shape) == 0:
        return (1, 1, 1), [(0, 0, 1) for _ in tensors]
    keep = [i for i, n in enumerate(shape[:-1]) if n != 1]
    # groups of leading dims: list of (size, [stride per tensor])
    groups: list[tuple[int, list[int]]] = []
    for i in keep:
        n = shape[i]
        st = [t.stride(i) for t in tensors]
        if groups and all(gs == s * n for gs, s in zip(groups[-1][1], st)):
            groups[-1] = (groups[-1][0] * n, st)
        else:
            groups.append((n, st))
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.insert(0, (1, [0] * len(tensors)))
    (b, sb), (s_, ss) = groups
    strides = [(sb[k], ss[k], t.stride(-1)) for k, t in enumerate(tensors)]
    return (b, s_, shape[-1]), strides


def broadcast_3d(t: torch.Tensor, shape: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """Strides of a ``[B, D]`` / ``[B, 1, D]`` / ``[B, S, D]`` (or broadcastable) operand expanded to
    ``shape`` = (B, S, D), with diffusers' ``t[:, None]`` for 2-D operands (stride 0 along broadcast
    dims); None when it does not broadcast to exactly ``shape``. Integer arithmetic only (no view is
    created: this runs on every call)."""
    nd = t.dim()
    if nd == 2:
        sizes, strides = (t.shape[0], 1, t.shape[1]), (t.stride(0), 0, t.stride(1))
    elif nd == 3:
        sizes, strides = tuple(t.shape), t.stride()
    else:
        return None
    out = []
    for n, st, want in zip(sizes, strides, shape):
        if n == want and n != 1:
            out.append(int(st))
        elif n == 1:
            out.append(0)
        else:
            return None
    return out[0], out[1], out[2]


def tile(d: int, per_program: int = 8192) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps): about ``per_program`` elements per program (8 warps), whole
    16-byte vectors. Callers pick ``per_program``: gate_residual 2K and GELU 4K from H200 sweeps
    (see their call sites), SwiGLU 4K."""
    block_d = min(next_pow2(max(d, 1)), 1024)
    if d % block_d:
        # A partial last column block idles lanes on every row (D = 1536 with 1024: a quarter
        # of all lanes; 768 with 1024 the same): a power-of-two divisor of D >= 256 tiles it
        # exactly. Otherwise (8960 = 2**7 * 70) the waste is small enough to keep the wide block.
        p = d & -d
        if p >= 256:
            block_d = min(p, 1024)
    block_r = max(1, per_program // block_d)
    return block_r, block_d, 8 if block_r * block_d >= 2048 else 4


def fits_int32(*tensors: torch.Tensor, rows_pad: int = 0) -> bool:
    """Whether every element offset of these tensors, with ``rows_pad`` elements of slack for
    masked tail lanes, fits in int32: the kernels may then compute addresses in 32 bits. Bounded by
    each tensor's storage (no offset from a view's start reaches past its storage): one call per
    tensor on every launch, where summing (size - 1) * |stride| cost 3.5 us for four tensors; a
    small view of a huge buffer just takes the 64-bit path."""
    limit = 2**31 - 1 - rows_pad
    for t in tensors:
        if t.untyped_storage().nbytes() // t.element_size() >= limit:
            return False
    return True


def overlap_reason(out: torch.Tensor, *inputs: torch.Tensor) -> str | None:
    """Reject an ``out`` that partially overlaps an input's memory (an identical view is fine:
    every element is read before it is written by the same program). Under torch.compile
    tracing, storage addresses do not exist; the check is skipped there (the kernel then sees the
    buffers functionalisation hands it)."""
    if out.numel() == 0 or torch.compiler.is_compiling():
        return None

    def span(t: torch.Tensor) -> tuple[int, int]:
        lo = t.data_ptr()
        hi = lo + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())) * t.element_size()
        return lo, hi + t.element_size()

    olo, ohi = span(out)
    for t in inputs:
        if t.numel() == 0 or t.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            continue
        lo, hi = span(t)
        if lo < ohi and olo < hi:
            same = t.data_ptr() == out.data_ptr() and t.shape == out.shape and t.stride() == out.stride()
            if not same:
                return "out partially overlaps an input"
    return None


def tile_cols_first() -> bool:
    """``DITFUSE_TILE_ORDER``: the program order of the 2-D-tiled elementwise kernels (GELU,
    SwiGLU and their cat variants): ``cols`` (default) or ``rows`` (:func:`tile_pids`). Round 22
    (H100, bench/probes/probe_tile_order.py, every variant bitwise): the FLUX.1 single block's
    GELU-into-cat kernel 0.0980 -> 0.0945 ms at [1, 4608, 3072 + 12288] and 2.364 -> 2.254 ms at
    [2, 32760, 5120 + 20480] with the same tile, ahead of torch.compile's 0.0972 there; the GELU
    alone within 1 % either way."""
    return env("DITFUSE_TILE_ORDER", "cols") != "rows"


def tile_grid(R: int, D: int, block_r: int, block_d: int, cols_first: bool) -> tuple[int, ...]:
    """The launch grid of a :func:`tile_rows_cols` kernel: ``(row blocks, column blocks)``, or with
    ``cols_first`` one axis of ``row blocks * column blocks`` programs, column block fastest."""
    if cols_first:
        return (cdiv(R, block_r) * cdiv(D, block_d),)
    return (cdiv(R, block_r), cdiv(D, block_d))


@triton.jit
def tile_pids(D, BLOCK_D: tl.constexpr, COLS_FIRST: tl.constexpr):
    """(row block, column block) of this program. ``COLS_FIRST``: a 1-D grid whose consecutive
    programs walk one row block's column blocks in order, so that the programs in flight at any
    moment read and write a few long contiguous runs of memory (the order a flat elementwise
    kernel such as torch.compile's has); otherwise a 2-D grid whose axis 0 (launched fastest)
    is the row block: consecutive programs then touch the same columns of rows BLOCK_R apart.
    The order changes which program runs when, never an element's arithmetic."""
    if COLS_FIRST:
        n_d = tl.cdiv(D, BLOCK_D)
        pid = tl.program_id(0)
        pid_r = pid // n_d
        return pid_r, pid - pid_r * n_d
    else:
        return tl.program_id(0), tl.program_id(1)


@triton.jit
def tile_rows_cols(R, S, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, I64: tl.constexpr,
                   COLS_FIRST: tl.constexpr = False):
    """This program's [BLOCK_R, BLOCK_D] tile of an [R = B * S, D] elementwise problem: per row its
    sample ``b`` and token ``s`` ([BLOCK_R, 1] each), the column index ``c`` ([1, BLOCK_D]) and the
    mask. ``I64=False`` when every element offset of every operand fits in int32
    (:func:`fits_int32`, checked on the host): the row division and the address arithmetic then
    run in 32 bits (the same addresses, about a third of the integer instructions).
    ``COLS_FIRST``: the program order of :func:`tile_pids` (grid from :func:`tile_grid`)."""
    pid_r, pid_d = tile_pids(D, BLOCK_D, COLS_FIRST)
    if I64:
        rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    else:
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    b = rows // S
    s = rows - b * S
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    c = cols[None, :].to(tl.int64) if I64 else cols[None, :]
    return b[:, None], s[:, None], c, mask


@triton.jit
def load_f32(ptr, mask):
    """Load and widen to fp32 exactly. Under TRITON_INTERPRET=1 the interpreter's bf16 -> fp32
    conversion flushes bf16 subnormals to zero (the GPU's widening is exact), so bf16 is widened
    from its bit pattern there. ``mask=None``: an unpredicated load (every address valid)."""
    if mask is None:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    if INTERPRET:
        if v.dtype == tl.bfloat16:
            return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return v.to(tl.float32)
    else:
        return v.to(tl.float32)


@triton.jit
def load_row_tile(ptr, b, s, sb, ss, sd, vec, k4, valid):
    """Load one [128, R, 4] tile (thread x row x vector element) of R rows as fp32: thread t's
    4-element vector ``vec[t]`` of row (b[r], s[r]). This is the layout of torch's LayerNorm /
    RMSNorm kernels (128 threads, 4-element vectors), shared by the norm kernels.

    The thread axis comes first on purpose: Triton's coalescing pass then lays the tile out as
    32 lanes x 4 warps along axis 0 (thread t = lane + 32 * warp holds all R rows of its 4
    elements), which is the layout the folds' ``tl.reduce`` needs (common/welford.py
    ``welford_fold_rows``, common/rms.py ``rms_fold_rows``)."""
    base = b * sb + s * ss
    offs = base[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :]).to(tl.int64) * sd
    return load_f32(ptr + offs, valid)


@triton.jit
def silu_f32(y):
    """aten's ActivationSiluKernel in fp32: ``y / (1 + expf(-y))`` with CUDA's precise ``expf``
    (libdevice ``__nv_expf``, non-FTZ) and an IEEE division; no product feeds an add, so nvcc has
    nothing to contract. ``-y`` is a sign flip (Triton lowers negation to ``0 - y``, which loses
    -0). Under the interpreter, numpy's exp stands in for expf (agrees to an ulp or so)."""
    ny = (y.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)
    if INTERPRET:
        e = tl.exp(ny)
    else:
        e = libdevice.exp(ny)
    return tl.math.div_rn(y, 1.0 + e)


# ``cat([a, act(x[, u])], -1)`` in one pass over the [R, DA + DM] output, for the activation ops
# whose output a concatenation consumes (FLUX.1's single block: tanh-GELU; FLUX.2's: SwiGLU).
# Column blocks inside the ``a`` half copy its bits (a load and a store in the storage dtype: NaN
# payloads too); blocks inside the activation half call ``ACT(x_ptrs, u_ptrs, mask, DTYPE, P)``,
# which loads its operand(s) and returns the stored value; a block straddling the boundary does
# both under complementary masks. The hosts pick BLOCK_D dividing DA when they can, so no block
# straddles. ACT is a @triton.jit function passed as a constexpr (inlined: the same code as a
# kernel written for that activation alone); P is its one constexpr parameter.
@triton.jit
def act_cat_kernel(
    a_ptr, x_ptr, u_ptr, out_ptr,
    R, S, DA, DM,
    sab, sas, sad,
    sxb, sxs, sxd,
    sub, sus, sud,
    sob, sos,
    ACT: tl.constexpr,
    P: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    I64: tl.constexpr,
    COLS_FIRST: tl.constexpr = False,
):
    b, s, c, mask = tile_rows_cols(R, S, DA + DM, BLOCK_R, BLOCK_D, I64, COLS_FIRST)
    dst = out_ptr + (b * sob + s * sos) + c
    col0 = tile_pids(DA + DM, BLOCK_D, COLS_FIRST)[1] * BLOCK_D
    if col0 + BLOCK_D <= DA:
        tl.store(dst, tl.load(a_ptr + (b * sab + s * sas) + c * sad, mask=mask), mask=mask)
    elif col0 >= DA:
        xs = x_ptr + (b * sxb + s * sxs) + (c - DA) * sxd
        us = u_ptr + (b * sub + s * sus) + (c - DA) * sud
        tl.store(dst, ACT(xs, us, mask, DTYPE, P), mask=mask)
    else:
        in_a = mask & (c < DA)
        in_m = mask & (c >= DA)
        tl.store(dst, tl.load(a_ptr + (b * sab + s * sas) + c * sad, mask=in_a), mask=in_a)
        xs = x_ptr + (b * sxb + s * sxs) + (c - DA) * sxd
        us = u_ptr + (b * sub + s * sus) + (c - DA) * sud
        tl.store(dst, ACT(xs, us, in_m, DTYPE, P), mask=in_m)


def act_cat_recipe(attn: torch.Tensor, x: torch.Tensor, u: torch.Tensor | None,
                   tile_: tuple[int, int, int] | None = None, cols_first: bool | None = None) -> tuple | None:
    """The geometry part of :func:`launch_act_cat`'s launch: (grid, scalar arguments, block sizes
    and warps, rows of slack for the int32 check, program order); None for an empty output.
    ``tile_`` (BLOCK_R, BLOCK_D, warps) and ``cols_first`` override the defaults (probes)."""
    B, S, DA = attn.shape
    DM = x.shape[2]
    if B * S * (DA + DM) == 0:
        return None
    # 2048 elements on 4 warps, column block fastest: round 22's H100 sweep (probe_tile_order,
    # every variant bitwise) had it 1.5 % ahead of 4096 on 8 warps at [2, 32760, 5120 + 20480]
    # and within 0.5 % at FLUX.1's [1, 4608, 3072 + 12288].
    block_r, block_d, warps = tile_ or (*tile(math.gcd(DA, DM), per_program=2048)[:2], 4)
    if cols_first is None:
        cols_first = tile_cols_first()
    uu = x if u is None else u
    sa, sx, su = attn.stride(), x.stride(), uu.stride()
    R = B * S
    grid = tile_grid(R, DA + DM, block_r, block_d, cols_first)
    # out: a new contiguous [B, S, DA + DM] tensor
    scalars = (R, S, DA, DM, sa[0], sa[1], sa[2], sx[0], sx[1], sx[2], su[0], su[1], su[2], S * (DA + DM), DA + DM)
    return grid, scalars, (block_r, block_d, warps), block_r * (DA + DM), cols_first


def act_cat_fire(recipe: tuple | None, act, p, attn: torch.Tensor, x: torch.Tensor, u: torch.Tensor | None,
                 dtype_tl) -> torch.Tensor:
    """Allocate the output and launch an :func:`act_cat_recipe` on these tensors."""
    B, S, DA = attn.shape
    out = torch.empty((B, S, DA + x.shape[2]), dtype=x.dtype, device=x.device)
    if recipe is None:
        return out
    grid, scalars, (block_r, block_d, warps), pad, cols_first = recipe
    uu = x if u is None else u
    launch(act_cat_kernel, grid,
        attn, x, uu, out, *scalars,
        ACT=act, P=p, DTYPE=dtype_tl, BLOCK_R=block_r, BLOCK_D=block_d,
        I64=not fits_int32(attn, x, uu, out, rows_pad=pad), COLS_FIRST=cols_first,
        num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False,
    )
    return out


def launch_act_cat(act, p, attn: torch.Tensor, x: torch.Tensor, u: torch.Tensor | None, dtype_tl) -> torch.Tensor:
    """``cat([attn, act(x[, u])], -1)`` as a new contiguous ``[B, S, DA + DM]`` tensor (attn
    ``[B, S, DA]``, x and u ``[B, S, DM]``, any strides; u None: the activation reads x only).
    Column blocks divide gcd(DA, DM) where possible (FLUX: 1024), 2048 elements per program on 4
    warps (act_cat_recipe)."""
    return act_cat_fire(act_cat_recipe(attn, x, u), act, p, attn, x, u, dtype_tl)
