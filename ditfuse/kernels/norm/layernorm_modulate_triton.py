"""Affine-free LayerNorm + adaLN modulate (and the gated residual before it), bit-exact vs eager.

``layernorm_modulate(x, scale, shift, eps)``::

    out = r(r(r(LN(x)) * r(1 + scale)) + shift)

``gate_residual_layernorm_modulate(residual, gate, update, scale, shift, eps)``::

    h = r(residual + r(gate * update));  n = r(r(r(LN(h)) * r(1 + scale)) + shift);  returns (h, n)

``r`` rounds to the input dtype (bf16, fp16 or fp32) round-to-nearest-even, where eager stores.
``LN`` is torch 2.11's CUDA ``vectorized_layer_norm_kernel`` reproduced bit for bit: per-thread
Welford over 4-element vectors in element order, the shfl-down fold tree and the cross-warp tree,
IEEE ``m2 / N``, ``rsqrt.approx`` (ditfuse/kernels/common/welford.py documents each step). 4 warps
per program: the 128 per-thread states of a row are exactly torch's 128 threads. v2 (default)
handles R rows per program and folds with one ``tl.reduce``; v1 (``DITFUSE_LN_IMPL=v1``) is the
first one-row-per-program kernel; same bits (notes/layernorm.md, "v2 performance design").
The kernels are launched with ``enable_fp_fusion=False``: eager never contracts ``a * b + c``
across ops, and the FMAs torch's own Welford code has are written out with ``fma_rn``.

AdaLayerNormContinuous (``norm_out``) chunks its embedding as ``scale, shift`` (scale first);
it is the same kernel: pass ``scale=`` and ``shift=`` by name in the order diffusers unpacks them.

Shapes: x / residual / update [B, S, D]; scale, shift, gate [B, D] (per sample) or [B, S, D]
(per token). Any strides (the statistics do not depend on the layout: for a non-contiguous
input ``F.layer_norm`` first makes a fresh, aligned contiguous copy and then takes the same
vectorized path). Outputs are new contiguous tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.rounding import round_to, rround
from ditfuse.kernels.common.welford import (
    LN_THREADS,
    LN_VEC,
    rsqrt_approx,
    welford_block_fold,
    welford_fold_rows,
    welford_update,
)
from ditfuse.kernels.errors import UnsupportedInput

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_MAX_N = 1 << 24  # torch: N <= 2**24 so that a float count is exact, else RowwiseMoments


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _tile(ptr, b, s, sb, ss, sd, vec, k4, valid):
    """Load one [128, 4] tile (thread x vector element) of a row, as fp32."""
    offs = b * sb + s * ss + (vec[:, None] * 4 + k4[None, :]).to(tl.int64) * sd
    return tl.load(ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _row_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                vec, k4, valid, DTYPE: tl.constexpr, GATED: tl.constexpr):
    """The LayerNorm input tile: x, or h = r(residual + r(gate * update)) when GATED."""
    x = _tile(x_ptr, b, s, xsb, xss, xsd, vec, k4, valid)
    if GATED:
        g = _tile(g_ptr, b, s, gsb, gss, gsd, vec, k4, valid)
        u = _tile(u_ptr, b, s, usb, uss, usd, vec, k4, valid)
        x = rround(x + rround(g * u, DTYPE), DTYPE)
    return x


# ``while`` rather than ``range(J)``: Triton 3.6's interpreter cannot index with a scalar
# argument under numpy 2. S, J and NVEC are not specialised (one compile serves every token count and width); strides
# are, so contiguous rows get vector loads.
@triton.jit(do_not_specialize=["S", "N", "NVEC", "J", "eps"])
def _ln_modulate_kernel(
    x_ptr, g_ptr, u_ptr, sc_ptr, sh_ptr, h_ptr, out_ptr,
    S, N, NVEC, J, eps,
    xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
    scsb, scss, scsd, shsb, shss, shsd,
    DTYPE: tl.constexpr, GATED: tl.constexpr,
    MEAN_MODE: tl.constexpr = 0, M2_FMA: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    t = tl.arange(0, LN_THREADS)
    k4 = tl.arange(0, LN_VEC)

    # Pass 1: per-thread Welford, vectors t, t + 128, ... in element order (cuWelfordOnlineSum).
    mean = tl.zeros([LN_THREADS], dtype=tl.float32)
    m2 = tl.zeros([LN_THREADS], dtype=tl.float32)
    j = 0
    while j < J:
        vec = j * LN_THREADS + t
        valid = vec < NVEC
        x = _row_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                        vec, k4, valid, DTYPE, GATED)
        if GATED:
            dst = row * N + vec[:, None] * 4 + k4[None, :]
            tl.store(h_ptr + dst, round_to(x, DTYPE), mask=valid[:, None])
        x02, x13 = tl.split(tl.reshape(x, [LN_THREADS, 2, 2]))
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        mean, m2 = welford_update(mean, m2, x0, j * 4 + 1.0, valid)
        mean, m2 = welford_update(mean, m2, x1, j * 4 + 2.0, valid)
        mean, m2 = welford_update(mean, m2, x2, j * 4 + 3.0, valid)
        mean, m2 = welford_update(mean, m2, x3, j * 4 + 4.0, valid)
        j += 1
    nvecs_t = tl.maximum((NVEC - t + LN_THREADS - 1) // LN_THREADS, 0)
    count = (nvecs_t * LN_VEC).to(tl.float32)

    # Shfl-down fold inside warps, then the shared-memory tree across the 4 warps.
    mean_r, m2_r, _ = welford_block_fold(mean, m2, count, MEAN_MODE, M2_FMA)
    var = tl.math.div_rn(m2_r, N.to(tl.float32))
    rstd = rsqrt_approx(var + eps)

    # Pass 2: normalise (one rounding, torch's store), then eager's modulate roundings.
    j = 0
    while j < J:
        vec = j * LN_THREADS + t
        valid = vec < NVEC
        x = _row_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                        vec, k4, valid, DTYPE, GATED)
        sc = _tile(sc_ptr, b, s, scsb, scss, scsd, vec, k4, valid)
        sh = _tile(sh_ptr, b, s, shsb, shss, shsd, vec, k4, valid)
        n = rround(rstd * (x - mean_r), DTYPE)
        y = rround(n * rround(1.0 + sc, DTYPE), DTYPE) + sh
        dst = row * N + vec[:, None] * 4 + k4[None, :]
        tl.store(out_ptr + dst, round_to(y, DTYPE), mask=valid[:, None])
        j += 1


@triton.jit
def _tile_rows(ptr, b, s, sb, ss, sd, vec, k4, valid):
    """Load one [128, R, 4] tile (thread x row x vector element) as fp32; b, s: [R] indices.

    The thread axis comes first on purpose: Triton's coalescing pass then lays the tile out as
    32 lanes x 4 warps along axis 0 (thread t = lane + 32 * warp holds all R rows of its 4
    elements), which is the layout the fold's ``tl.reduce`` needs (see welford_fold_rows)."""
    base = b * sb + s * ss
    offs = base[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :]).to(tl.int64) * sd
    return tl.load(ptr + offs, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _rows_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                 vec, k4, valid, DTYPE: tl.constexpr, GATED: tl.constexpr):
    x = _tile_rows(x_ptr, b, s, xsb, xss, xsd, vec, k4, valid)
    if GATED:
        g = _tile_rows(g_ptr, b, s, gsb, gss, gsd, vec, k4, valid)
        u = _tile_rows(u_ptr, b, s, usb, uss, usd, vec, k4, valid)
        x = rround(x + rround(g * u, DTYPE), DTYPE)
    return x


# v2: R rows per program (R independent rows; per row the arithmetic is v1's, op for op).
# The per-thread Welford runs on [128, R] states, so each step's four updates are R-wide
# (independent FMA chains instead of one), the reciprocal ``1 / count'`` stays one scalar per
# step (count' is the same for every thread that holds data at that step; threads past the last
# vector keep their state through ``valid``), and the fold over the 128 threads is a single
# ``tl.reduce`` (see welford_fold_rows) instead of v1's reshape/permute/split tree, whose
# layout conversions cost shared-memory round trips and ~160 registers per thread.
@triton.jit(do_not_specialize=["M", "S", "N", "NVEC", "J", "eps"])
def _ln_modulate_kernel_v2(
    x_ptr, g_ptr, u_ptr, sc_ptr, sh_ptr, h_ptr, out_ptr,
    M, S, N, NVEC, J, eps,
    xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
    scsb, scss, scsd, shsb, shss, shsd,
    DTYPE: tl.constexpr, GATED: tl.constexpr, R: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < M
    rows = tl.where(row_ok, rows, 0)
    b = rows // S
    s = rows % S
    # Output rows start at rows * N with N % 4 == 0 (the predicate guarantees it): telling
    # Triton lets the stores stay 4-element vectors in the load layout (no layout conversion).
    out_row = tl.multiple_of(rows * N, 4)
    t = tl.arange(0, LN_THREADS)
    k4 = tl.arange(0, LN_VEC)

    mean = tl.zeros([LN_THREADS, R], dtype=tl.float32)
    m2 = tl.zeros([LN_THREADS, R], dtype=tl.float32)
    j = 0
    while j < J:
        vec = j * LN_THREADS + t
        valid_t = vec < NVEC
        valid = valid_t[:, None, None] & row_ok[None, :, None]
        x = _rows_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                         vec, k4, valid, DTYPE, GATED)
        if GATED:
            dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
            tl.store(h_ptr + dst, round_to(x, DTYPE), mask=valid)
        x02, x13 = tl.split(tl.reshape(x, [LN_THREADS, R, 2, 2]))
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        v = valid_t[:, None]
        mean, m2 = welford_update(mean, m2, x0, j * 4 + 1.0, v)
        mean, m2 = welford_update(mean, m2, x1, j * 4 + 2.0, v)
        mean, m2 = welford_update(mean, m2, x2, j * 4 + 3.0, v)
        mean, m2 = welford_update(mean, m2, x3, j * 4 + 4.0, v)
        j += 1
    nvecs_t = tl.maximum((NVEC - t + LN_THREADS - 1) // LN_THREADS, 0)
    count = tl.broadcast_to((nvecs_t * LN_VEC).to(tl.float32)[:, None], [LN_THREADS, R])

    mean_r, m2_r, _ = welford_fold_rows(mean, m2, count, R)
    var = tl.math.div_rn(m2_r, N.to(tl.float32))
    rstd = rsqrt_approx(var + eps)
    mean_r = mean_r[None, :, None]
    rstd = rstd[None, :, None]

    j = 0
    while j < J:
        vec = j * LN_THREADS + t
        valid = (vec < NVEC)[:, None, None] & row_ok[None, :, None]
        x = _rows_values(x_ptr, g_ptr, u_ptr, b, s, xsb, xss, xsd, gsb, gss, gsd, usb, uss, usd,
                         vec, k4, valid, DTYPE, GATED)
        sc = _tile_rows(sc_ptr, b, s, scsb, scss, scsd, vec, k4, valid)
        sh = _tile_rows(sh_ptr, b, s, shsb, shss, shsd, vec, k4, valid)
        n = rround(rstd * (x - mean_r), DTYPE)
        y = rround(n * rround(1.0 + sc, DTYPE), DTYPE) + sh
        dst = out_row[None, :, None] + (vec[:, None, None] * 4 + k4[None, None, :])
        tl.store(out_ptr + dst, round_to(y, DTYPE), mask=valid)
        j += 1


def _check_mod(name: str, t: object, x: torch.Tensor) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    if t.dtype != x.dtype:
        return f"{name} dtype {t.dtype} != input dtype {x.dtype} (eager would promote; not reproduced)"
    if t.device != x.device:
        return f"{name} is on {t.device}, input on {x.device}"
    B, S, D = x.shape
    if tuple(t.shape) not in ((B, D), (B, S, D)):
        return f"{name} shape {tuple(t.shape)} is neither [B, D]={[B, D]} nor [B, S, D]={[B, S, D]}"
    return None


def _unsupported_reason(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    update: torch.Tensor | None = None,
) -> str | None:
    """Why the kernel does not reproduce eager for these inputs, or None when it does.

    Rejected (each is a case where torch takes a path the kernel does not reproduce, or an
    input outside the contract):
    - not a 3-D [B, S, D] tensor, or a dtype other than bf16 / fp16 / fp32;
    - scale / shift / gate / update of another dtype (eager would promote), device or shape;
    - not on CUDA (on CPU only under TRITON_INTERPRET=1, for tests): the contract is CUDA eager;
    - D == 0, D % 4 != 0 or D > 2**24: torch's dispatcher falls back to RowwiseMomentsCUDAKernel
      (512-thread WelfordOps block reduce, a different order);
    - x contiguous but its data pointer not aligned to 4 elements (4 * itemsize bytes): torch
      passes contiguous inputs through unchanged and the misaligned pointer sends it to
      RowwiseMomentsCUDAKernel too. (A non-contiguous x is copied by F.layer_norm into a fresh,
      aligned buffer first and is therefore handled. In the gated op the LayerNorm input h is a
      fresh eager output, always aligned, so only D is checked.)
    - eps not a real number.
    """
    if not isinstance(x, torch.Tensor):
        return "input is not a tensor"
    if x.dim() != 3:
        return f"input must be [B, S, D], got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} not supported (bf16, fp16, fp32)"
    if x.device.type == "cuda":
        pass
    elif x.device.type == "cpu" and _interpreting():
        pass
    else:
        return f"device {x.device} not supported (CUDA; CPU only under TRITON_INTERPRET=1)"
    for name, t in (("scale", scale), ("shift", shift), ("gate", gate)):
        if name == "gate" and update is None:
            continue
        reason = _check_mod(name, t, x)
        if reason:
            return reason
    if update is not None:
        if not isinstance(update, torch.Tensor):
            return "update is not a tensor"
        if update.dtype != x.dtype or update.device != x.device or update.shape != x.shape:
            return (
                f"update {tuple(update.shape)}/{update.dtype}/{update.device} does not match "
                f"residual {tuple(x.shape)}/{x.dtype}/{x.device}"
            )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps must be a float, got {type(eps).__name__}"
    D = x.shape[-1]
    if D == 0 or D % 4 != 0:
        return f"width D={D} is not a positive multiple of 4: torch uses RowwiseMomentsCUDAKernel (not reproduced)"
    if D > _MAX_N:
        return f"width D={D} > 2**24: torch uses RowwiseMomentsCUDAKernel (not reproduced)"
    if update is None and x.is_contiguous() and x.data_ptr() % (4 * x.element_size()) != 0:
        return (
            "contiguous input whose data pointer is not aligned to 4 elements: torch uses "
            "RowwiseMomentsCUDAKernel (not reproduced)"
        )
    return None


def _mod_strides(t: torch.Tensor) -> tuple[int, int, int]:
    if t.dim() == 2:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _impl() -> str:
    """``DITFUSE_LN_IMPL``: ``v2`` (default, several rows per program) or ``v1`` (one row per
    program, the first version; kept for A/B runs). Same output bits either way."""
    impl = os.environ.get("DITFUSE_LN_IMPL", "v2").strip().lower() or "v2"
    if impl not in ("v1", "v2"):
        raise ValueError(f"DITFUSE_LN_IMPL={impl!r}: expected 'v1' or 'v2'")
    return impl


def _rows_per_program(M: int) -> int:
    """Rows per v2 program: 4 when there are enough rows to fill the GPU several times over,
    fewer for short inputs (more programs). Never changes numerics (rows are independent)."""
    if M >= 2048:
        return 4
    if M >= 512:
        return 2
    return 1


def _launch(x, gate, update, scale, shift, eps, gated: bool, impl: str | None = None,
            rows_per_program: int | None = None):
    B, S, D = x.shape
    out = torch.empty((B, S, D), dtype=x.dtype, device=x.device)
    h = torch.empty((B, S, D), dtype=x.dtype, device=x.device) if gated else out
    M = B * S
    if M == 0:
        return h, out
    nvec = D // 4
    J = triton.cdiv(nvec, 128)
    g = gate if gated else x
    u = update if gated else x
    strides = (*x.stride(), *_mod_strides(g), *u.stride(), *_mod_strides(scale), *_mod_strides(shift))
    if (impl or _impl()) == "v1":
        _ln_modulate_kernel[(M,)](
            x, g, u, scale, shift, h, out,
            S, D, nvec, J, float(eps), *strides,
            DTYPE=_DTYPES[x.dtype], GATED=gated,
            num_warps=4, enable_fp_fusion=False,
        )
        return h, out
    R = rows_per_program or _rows_per_program(M)
    _ln_modulate_kernel_v2[(triton.cdiv(M, R),)](
        x, g, u, scale, shift, h, out,
        M, S, D, nvec, J, float(eps), *strides,
        DTYPE=_DTYPES[x.dtype], GATED=gated, R=R,
        num_warps=4, enable_fp_fusion=False,
    )
    return h, out


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("ditfuse::layernorm_modulate", mutates_args=())
def _layernorm_modulate_op(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, None, scale, shift, eps, gated=False)[1]


@_layernorm_modulate_op.register_fake
def _(x, scale, shift, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("ditfuse::gate_residual_layernorm_modulate", mutates_args=())
def _gate_residual_layernorm_modulate_op(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(residual, gate, update, scale, shift, eps, gated=True)


@_gate_residual_layernorm_modulate_op.register_fake
def _(residual, gate, update, scale, shift, eps):
    mk = lambda: torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)  # noqa: E731
    return mk(), mk()


# ----------------------------------------------------------------------------- public API


def can_use_layernorm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> bool:
    """True when :func:`layernorm_modulate` reproduces eager bit for bit for these inputs
    (see ``_unsupported_reason`` for every rejection)."""
    return _unsupported_reason(x, scale, shift, eps) is None


def layernorm_modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``out = r(r(r(LN(x)) * r(1 + scale)) + shift)``, bit-exact vs torch 2.11 CUDA eager
    (``F.layer_norm(x, (D,), None, None, eps)`` then ``* (1 + scale[:, None]) + shift[:, None]``).

    x: [B, S, D]; scale, shift: [B, D] or [B, S, D], same dtype (bf16, fp16, fp32). For
    AdaLayerNormContinuous pass its first chunk as ``scale``. Raises UnsupportedInput where
    :func:`can_use_layernorm_modulate` is False.
    """
    reason = _unsupported_reason(x, scale, shift, eps)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.layernorm_modulate(x, scale, shift, float(eps))


def can_use_gate_residual_layernorm_modulate(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
) -> bool:
    """True when :func:`gate_residual_layernorm_modulate` is bit-exact for these inputs."""
    return _unsupported_reason(residual, scale, shift, eps, gate, update) is None


def gate_residual_layernorm_modulate(
    residual: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
    scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX dual-block middle in one pass: ``h = r(residual + r(gate * update))``,
    ``n = r(r(r(LN(h)) * r(1 + scale)) + shift)``; returns ``(h, n)``, both bit-exact vs eager.

    residual, update: [B, S, D]; gate, scale, shift: [B, D] or [B, S, D]; one dtype.
    Raises UnsupportedInput where :func:`can_use_gate_residual_layernorm_modulate` is False.
    """
    reason = _unsupported_reason(residual, scale, shift, eps, gate, update)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.gate_residual_layernorm_modulate(residual, gate, update, scale, shift, float(eps))


__all__ = [
    "layernorm_modulate",
    "can_use_layernorm_modulate",
    "gate_residual_layernorm_modulate",
    "can_use_gate_residual_layernorm_modulate",
]
