"""Pure-torch simulation of diffusers' WanRMS_norm on CUDA (torch 2.11), usable as a CPU oracle.

``F.normalize(x32, dim=1)`` computes ``x32 / clamp_min(vector_norm(x32, 2, dim=1), 1e-12)``;
the norm is a ``gpu_reduce_kernel`` with ``NormTwoOps`` (``acc + v*v`` -> ``fma(v, v, acc)``,
combine ``a + b``, project ``sqrt``) over the strided channel dim (Reduce.cuh, "vectorize along
output"). notes/wan_vae.md has the derivation; in short, for a contiguous [B, C, S] fp32 input:

- ``vec`` = largest of 4, 2, 1 dividing S (and the input's element offset);
- ``setReduceConfig``: ``max_threads = 512 / vec``, ``d0 = last_pow2(B*S // vec)`` (capped),
  ``d1 = last_pow2(C)`` (capped), ``bw = min(d0, 32)``, ``bh = min(d1, max_threads / bw)``,
  ``bw = min(d0, max_threads / bh)``; the channels are split over the bh warps of a block when
  ``C >= min(16 bh, 256)`` (else one thread per output, ``bh`` then acts on outputs only);
- thread y (of bh, or the only one) walks channels ``y, y + H, y + 2H, ...`` (H = bh or 1) with
  vt0 = 4 interleaved accumulators: channel c goes to accumulator ``(c // H) % 4``, each chain in
  channel order, then ``((a0 + a1) + a2) + a3``; with the split the bh partial sums fold through
  shared memory at offsets bh/2, ..., 1 (``s[y] += s[y + off]``); ``norm = sqrt(sum)``.

Then ``n = r(x32 / max(norm, 1e-12))``, ``r(r(r(n * float(sqrt(C))) * gamma) + bias)`` and, with
SiLU, ``r(y / (1 + exp(-y)))``. FMAs are exact (tests/support/groupnorm_sim.fma).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tests.support.groupnorm_sim import exp_numpy, fma

VT0 = 4
MAX_THREADS = 512
WARP = 32


def last_pow2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def output_vec_size(S: int, C: int, elem_offset: int = 0, t_major_hw: int | None = None) -> int:
    """get_output_vec_size: 4, halved until it divides the base offset, the iterator's first
    output dim and the other input strides. Contiguous [B, C, S]: first output dim S (all
    spatial dims coalesce), strides S (C) and C*S (B). For the [B, C, T, H, W] view of
    [B, T, C, H, W] memory (``t_major_hw`` = H*W): first output dim HW, strides HW (C) and C*HW
    (T, with B merged into it)."""
    vec = 4
    if t_major_hw is None:
        checks = (elem_offset, S, S * C)
    else:
        checks = (elem_offset, t_major_hw, t_major_hw, C * t_major_hw)
    for n in checks:
        while n % vec:
            vec //= 2
    return vec


def reduce_layout(B: int, C: int, S: int, elem_offset: int = 0,
                  t_major_hw: int | None = None) -> tuple[int, bool, int]:
    """(H, split, vec): threads splitting the channels (1 when not split), and whether they do."""
    vec = output_vec_size(S, C, elem_offset, t_major_hw)
    max_threads = MAX_THREADS // vec
    dim0 = (B * S) // vec
    d0 = last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = last_pow2(C) if C < max_threads else max_threads
    bw = min(d0, WARP)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    split = C >= min(bh * 16, 256)
    return (bh if split else 1), split, vec


def sumsq(x32: torch.Tensor, H: int, vt0: int = VT0, use_fma: bool = True) -> torch.Tensor:
    """Sum of squares over dim 1 of ``x32`` [B, C, S] in the reduce kernel's order (``vt0``
    accumulators per thread, H threads splitting the channels). ``vt0`` / ``use_fma`` other than
    the defaults are alternatives for the GPU probe. Works on any device."""
    B, C, S = x32.shape
    R = vt0 * H
    acc = torch.zeros(B, R, S, device=x32.device)
    for c0 in range(0, C, R):
        blk = torch.zeros(B, R, S, device=x32.device)
        n = min(R, C - c0)
        blk[:, :n] = x32[:, c0:c0 + n]
        acc = fma(blk, blk, acc) if use_fma else acc + blk * blk  # zero rows add +0 exactly
    a = acc.reshape(B, vt0, H, S)  # row r = i * H + y
    part = a[:, 0]
    for i in range(1, vt0):  # thread y's combine: ((a0 + a1) + a2) + a3
        part = part + a[:, i]
    h = H
    while h > 1:  # block_y_reduce
        h //= 2
        part = part[:, :h] + part[:, h:2 * h]
    return part[:, 0]


def rms_norm(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0, elem_offset: int = 0,
    norm_eps: float = 1e-12,
) -> torch.Tensor:
    """``WanRMS_norm`` for contiguous x [B, C, *spatial] with the CUDA reduce order."""
    B, C = x.shape[:2]
    S = x[0, 0].numel()
    x32 = x.float().reshape(B, C, S)
    t_major = x.dim() == 5 and x.shape[2] > 1 and not x.is_contiguous()
    H, _, _ = reduce_layout(B, C, S, elem_offset if x.dtype == torch.float32 else 0,
                            x.shape[3] * x.shape[4] if t_major else None)
    norm = torch.from_numpy(np.sqrt(sumsq(x32, H).numpy()))[:, None, :]  # torch's CPU sqrt is not always RN
    denom = torch.where(torch.isnan(norm), norm, torch.clamp_min(norm, norm_eps))
    n = (x32 / denom).to(x.dtype)
    scale = torch.tensor(C ** 0.5, dtype=torch.float64).float()
    y = (n.float() * scale).to(x.dtype)
    g = gamma.reshape(1, C, 1).float()
    y = (y.float() * g).to(x.dtype)
    b = bias.reshape(1, C, 1).float() if isinstance(bias, torch.Tensor) else float(bias)
    y = (y.float() + b).to(x.dtype)
    return y.reshape(x.shape)


def rms_norm_silu(x, gamma, bias=0.0, silu: bool = True,
                  exp: Callable[[torch.Tensor], torch.Tensor] = exp_numpy) -> torch.Tensor:
    y = rms_norm(x, gamma, bias)
    if not silu:
        return y
    yf = y.float()
    return (yf / (1.0 + exp(-yf))).to(y.dtype)
