"""Pure-torch simulation of diffusers' ``RMSNorm`` over [.., D] rows as torch 2.11 runs it on CUDA,
and of the three Z-Image chains built on it (ditfuse/kernels/norm/rms_norm_diffusers_triton.py).
Independent of Triton and of the kernel module: every fp32 op is one torch op (IEEE, one
rounding), the summation order is written out lane by lane.

Mean of the squares (H200 probe, bench/results/probe_diffusers_rms_h200.json): squares
``r32(x32 * x32)``; ``setReduceConfig`` picks W lanes per row (``block_width``; 32 from 16 rows
on, more below) and 4-element vectors for D >= 128; lane l owns vectors (or, below 128, single
elements) l, l + W, l + 2W, ...; accumulator j of the lane sums element j of each of its vectors
in order starting from 0 (lane-strided rows: its j-th element); the lane's value is
``((a0 + a1) + a2) + a3``; lanes fold as a halving tree (lane i += lane i + W/2, then + W/4, ...,
+1). ``ms = r32(sum * factor)`` with ``factor = f32(rows) / f32(rows * D)``.

``rsqrt`` is a parameter: ``torch.rsqrt`` on the GPU, ``tests.support.rms_sim.interp_rsqrt``
(numpy's ``1 / sqrt``) for the Triton interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

_HALF = (torch.float16, torch.bfloat16)


def _last_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def lanes(D: int, rows: int) -> tuple[int, int]:
    """(W, VEC): Reduce.cuh's ``set_block_dimension(dim0 = D / VEC, rows)`` with 512 threads."""
    vec = 4 if D >= 128 else 1
    dim0 = max(D // vec, 1)
    d0 = _last_pow2(dim0) if dim0 < 512 else 512
    d1 = _last_pow2(max(rows, 1)) if rows < 512 else 512
    width = min(d0, 32)
    height = min(d1, 512 // width)
    return min(d0, 512 // height), vec


def factor(rows: int, D: int) -> np.float32:
    return np.float32(rows) / np.float32(rows * D)


def sumsq(x32: torch.Tensor, rows: int) -> torch.Tensor:
    """Row sums of ``r32(x*x)`` over the last dim of fp32 [..., D], in the reduce kernel's order
    for a call over ``rows`` rows."""
    D = x32.shape[-1]
    lead = x32.shape[:-1]
    W, vec = lanes(D, rows)
    sq = x32 * x32
    per_lane_vectors = -(-(D // vec) // W) if vec == 4 else -(-D // W)
    pad = per_lane_vectors * W * vec - D
    sq = torch.cat([sq, sq.new_zeros(*lead, pad)], -1)
    # [..., k, lane, element]: the lane's k-th vector (vec 1: its k-th element)
    assert vec == 4 or per_lane_vectors <= 4, "lane-strided rows hold at most 4 elements per lane"
    t = sq.reshape(*lead, per_lane_vectors, W, vec)
    accs = []
    for j in range(4):
        if vec == 4:
            a = torch.zeros(*lead, W, dtype=torch.float32, device=x32.device)
            for k in range(per_lane_vectors):
                a = a + t[..., k, :, j]
        else:
            a = t[..., j, :, 0] if j < per_lane_vectors else torch.zeros(*lead, W, dtype=torch.float32, device=x32.device)
        accs.append(a)
    lane = ((accs[0] + accs[1]) + accs[2]) + accs[3]
    while lane.shape[-1] > 1:
        half = lane.shape[-1] // 2
        lane = lane[..., :half] + lane[..., half:]
    return lane[..., 0]


def rms_d(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
          rsqrt: Callable[[torch.Tensor], torch.Tensor] = torch.rsqrt, rows: int | None = None) -> torch.Tensor:
    """diffusers ``RMSNorm.forward`` as CUDA computes it (see the module doc)."""
    D = x.shape[-1]
    x32 = x.float()
    n_rows = x32.numel() // D if rows is None else rows
    ms = sumsq(x32, n_rows) * torch.tensor(float(factor(n_rows, D)), dtype=torch.float32, device=x.device)
    rstd = rsqrt(ms + torch.tensor(eps, dtype=torch.float32, device=x.device))
    h = x32 * rstd[..., None]
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype in _HALF:
        return (h.to(weight.dtype).float() * weight.float()).to(weight.dtype)
    return h * weight.float()


def _per_token(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t[:, None] if t.dim() == 2 and ndim == 3 else t


def _times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() * b.float()).to(a.dtype)


def _plus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() + b.float()).to(a.dtype)


def _scaled(n: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return n
    s = _per_token(scale, n.dim())
    one_plus = (1.0 + s.float()).to(s.dtype)
    return _times(n, one_plus.expand_as(n))


def rms_norm_diffusers_scale(x, weight, scale, eps, rsqrt=torch.rsqrt, shift=None):
    """``r(RMS_d(x; w) * r(1 + scale))``, then ``r(. + shift)`` with a shift."""
    n = _scaled(rms_d(x, weight, eps, rsqrt), scale)
    return n if shift is None else _plus(n, _per_token(shift, n.dim()).expand_as(n))


def gate_residual_rms_norm_diffusers(residual, gate, update, weight, eps, rsqrt=torch.rsqrt):
    """``r(residual + r(gate * RMS_d(update; w)))``."""
    n = rms_d(update, weight, eps, rsqrt)
    if gate is not None:
        n = _times(_per_token(gate, n.dim()).expand_as(n), n)
    return _plus(residual, n)


def gate_residual_rms_norm_diffusers_scale(residual, gate, update, out_weight, next_weight, scale, eps,
                                           rsqrt=torch.rsqrt):
    """``(h, r(RMS_d(h; w2) * r(1 + scale)))``."""
    h = gate_residual_rms_norm_diffusers(residual, gate, update, out_weight, eps, rsqrt)
    return h, rms_norm_diffusers_scale(h, next_weight, scale, eps, rsqrt)
