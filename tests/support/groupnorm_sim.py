"""Pure-torch simulation of torch's CUDA GroupNorm (torch 2.11, NCHW), usable as a CPU oracle.

Independent of Triton. It follows aten/src/ATen/native/cuda/group_norm_kernel.cu step by step
(notes/groupnorm.md section 3 has the source facts):

- ``L = C/G * HxW`` elements per (sample, group); ``THREADS = 32 if L < 512 else 512``;
- thread ``t`` runs ``WelfordOps::reduce`` over elements ``t, t + THREADS, ...``:
  ``mean' = mean + div(x - mean, n')``, ``m2' = fma(x - mean, x - mean', m2)``;
- lanes fold at shfl-down offsets 16, 8, 4, 2, 1 with ``combine(own, lane + offset)``; with 512
  threads the 16 warp states fold again at 8, 4, 2, 1 (the offset-16 step meets identities);
- ``combine(a, b)``: early returns when a or b is empty, else ``w = b.nf / nf``,
  ``mean = fma(delta, w, a.mean)``, ``m2 = fma(delta*delta*a.nf, w, a.m2 + b.m2)``;
- ``var = m2 / nf``, ``rstd = rsqrt(var + float(T(eps)))``;
- epilogue ``r(fma(a, x, r(r(-a*mean) + beta)))`` with ``a = r(rstd*gamma)`` (HxW > 1), the 1-d variants
  for HxW == 1; optional SiLU ``r(y / (1 + exp(-y)))`` on the rounded output.

Divisions are torch's fp32 divisions (IEEE, like ``div.rn.f32``). FMAs are exact: the fp32
product is exact in fp64, the fp64 sum is rounded to odd (TwoSum + one ulp nudge) and then to
fp32, which gives the correctly rounded fp32 ``fma`` — the same helper the Triton kernel uses under
the interpreter. ``rsqrt`` and ``exp`` are parameters: the defaults are what the Triton interpreter
computes (``1 / sqrt`` in fp32, numpy's ``exp``); on the GPU the kernel uses ``rsqrt.approx.f32``
and libdevice ``expf`` instead, which only the GPU tests can check.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

LANES = 32
BLOCK_THREADS = 512


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``a * b + c`` (one rounding), for fp32 tensors."""
    a, b, c = torch.broadcast_tensors(a.double(), b.double(), c.double())
    p = a * b  # exact: 24 x 24 bits fit in 53, no fp64 under/overflow from fp32 operands
    s = p + c
    # TwoSum: s + e == p + c exactly (when s is finite)
    bv = s - p
    e = (p - (s - bv)) + (c - bv)
    bits = s.view(torch.int64)
    nudge = (e != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    step = torch.where((s > 0) == (e > 0), 1, -1).to(torch.int64)
    s = torch.where(nudge, (bits + step).view(torch.float64), s)  # round to odd
    return s.float()


def rsqrt_cpu(z: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(z)`` in fp32 through numpy: what the Triton interpreter computes for ``rsqrt``
    (torch's CPU ``sqrt`` is not always correctly rounded for fp32; numpy's is)."""
    zn = z.numpy()
    return torch.from_numpy(np.float32(1.0) / np.sqrt(zn)).reshape(z.shape)


def exp_numpy(x: torch.Tensor) -> torch.Tensor:
    """numpy's fp32 ``exp``: what the Triton interpreter computes for ``tl.exp``."""
    return torch.from_numpy(np.exp(x.numpy()))


def eps_as(dtype: torch.dtype, eps: float) -> float:
    """``static_cast<scalar_t>(eps)`` widened back: eps as the GroupNorm kernel sees it."""
    return float(torch.tensor(eps, dtype=torch.float64).float().to(dtype).float())


def threads_for(L: int) -> int:
    return LANES if L < BLOCK_THREADS else BLOCK_THREADS


def combine(a: tuple, b: tuple) -> tuple:
    """``WelfordOps::combine(a, b)`` elementwise on (mean, m2, nf) tensors."""
    mean_a, m2_a, nf_a = a
    mean_b, m2_b, nf_b = b
    delta = mean_b - mean_a
    nf = nf_a + nf_b
    w = nf_b / torch.where(nf > 0, nf, torch.ones_like(nf))
    mean = fma(delta, w, mean_a)
    m2 = fma(delta * delta * nf_a, w, m2_a + m2_b)
    a_empty, b_empty = nf_a == 0, nf_b == 0
    mean = torch.where(a_empty, mean_b, torch.where(b_empty, mean_a, mean))
    m2 = torch.where(a_empty, m2_b, torch.where(b_empty, m2_a, m2))
    nf = torch.where(a_empty, nf_b, torch.where(b_empty, nf_a, nf))
    return mean, m2, nf


def fold(state: tuple, width: int) -> tuple:
    """Fold the last axis (size ``width``, a power of two) the shfl-down way: at each offset the
    lower half combines its own state with the upper half's."""
    while width > 1:
        h = width // 2
        lo = tuple(s[..., :h] for s in state)
        hi = tuple(s[..., h:width] for s in state)
        state = combine(lo, hi)
        width = h
    return tuple(s[..., 0] for s in state)


def thread_states(xg: torch.Tensor, threads: int) -> tuple:
    """Per-thread WelfordOps::reduce chains of each row of ``xg`` [R, L] (fp32):
    (mean, m2, nf), each [R, threads]."""
    R, L = xg.shape
    mean = torch.zeros(R, threads)
    m2 = torch.zeros(R, threads)
    nf = torch.zeros(R, threads)
    t = torch.arange(threads)
    J = -(-L // threads)
    for k in range(J):
        j = k * threads + t
        valid = (j < L)[None, :]
        v = xg[:, j.clamp(max=L - 1)]
        n_new = torch.tensor(float(k + 1))
        delta = v - mean
        new_mean = mean + delta / n_new
        new_m2 = fma(delta, v - new_mean, m2)
        mean = torch.where(valid, new_mean, mean)
        m2 = torch.where(valid, new_m2, m2)
        nf = torch.where(valid, n_new.expand_as(nf), nf)
    return mean, m2, nf


def warp_states(xg: torch.Tensor) -> tuple:
    """Per-warp states after the lane fold: (mean, m2, nf), each [R, threads / 32]."""
    threads = threads_for(xg.shape[1])
    mean, m2, nf = thread_states(xg, threads)
    R = xg.shape[0]
    W = threads // LANES
    st = tuple(s.reshape(R, W, LANES) for s in (mean, m2, nf))
    return fold(st, LANES)


def group_stats(
    x: torch.Tensor,
    num_groups: int,
    eps: float,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] = rsqrt_cpu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) fp32 [N, G] in the order of RowwiseMomentsCUDAKernel; ``eps`` is rounded to
    x's dtype first, as GroupNormKernelImpl does."""
    N, C = x.shape[:2]
    xg = x.detach().contiguous().float().reshape(N * num_groups, -1)
    L = xg.shape[1]
    mean, m2, nf = warp_states(xg)
    W = mean.shape[1]
    if W > 1:  # block fold: lanes 0..15 of warp 0 hold the warp states, 16..31 identities
        mean, m2, nf = fold((mean, m2, nf), W)
    else:
        mean, m2, nf = mean[:, 0], m2[:, 0], nf[:, 0]
    var = m2 / nf
    rstd = rsqrt(var + torch.tensor(eps_as(x.dtype, eps), dtype=torch.float32))
    assert L > 0
    return mean.reshape(N, num_groups), rstd.reshape(N, num_groups)


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] = rsqrt_cpu,
) -> torch.Tensor:
    """The GroupNorm output (x's dtype, NCHW contiguous) with aten's statistics and epilogue."""
    N, C = x.shape[:2]
    G = num_groups
    D = C // G
    HxW = x[0, 0].numel() if x.dim() > 2 else 1
    mean, rstd = group_stats(x, G, eps, rsqrt)
    # aten stores the statistics as T and the epilogue reads them back (rounded for bf16/fp16).
    mean, rstd = mean.to(x.dtype).float(), rstd.to(x.dtype).float()
    xf = x.detach().contiguous().float().reshape(N, G, D, HxW)
    m = mean[:, :, None, None]
    r = rstd[:, :, None, None]
    gam = None if weight is None else weight.detach().float().reshape(1, G, D, 1)
    bet = None if bias is None else bias.detach().float().reshape(1, G, D, 1)
    if HxW == 1:  # GroupNorm1dForward
        t = (xf - m) * r
        if gam is not None and bet is not None:
            y = fma(t, gam, bet)
        elif gam is not None:
            y = t * gam
        elif bet is not None:
            y = fma(xf - m, r, bet)
        else:
            y = t
    elif gam is None and bet is None:
        y = (xf - m) * r
    else:  # ComputeFusedParamsCUDAKernel + gpu_kernel(a * x + b)
        a = r * gam if gam is not None else r.expand(N, G, D, 1)
        b0 = bet if bet is not None else torch.zeros(1, G, D, 1)
        # ComputeFusedParams' -a*mean + beta is NOT contracted on torch 2.11 CUDA (H200 probe).
        b = (-a * m.expand_as(a)) + b0  # without beta the kernel adds 0.0 (-0 -> +0)
        y = fma(a.expand_as(xf), xf, b.expand_as(xf))
    return y.to(x.dtype).reshape(x.shape)


def silu(y: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor] = exp_numpy) -> torch.Tensor:
    """Eager SiLU's arithmetic ``r(y / (1 + exp(-y)))`` with a given fp32 ``exp``."""
    yf = y.float()
    return (yf / (1.0 + exp(-yf))).to(y.dtype)


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    silu_after: bool = True,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] = rsqrt_cpu,
    exp: Callable[[torch.Tensor], torch.Tensor] = exp_numpy,
) -> torch.Tensor:
    """``r(silu(r(GN(x))))`` (or ``r(GN(x))`` when ``silu_after`` is False)."""
    y = group_norm(x, num_groups, weight, bias, eps, rsqrt)
    return silu(y, exp) if silu_after else y


# ------------------------------------------------------------------ scalar cross-check


def scalar_group_stats(values: list[float], eps32: float) -> tuple[float, float]:
    """One group's (mean, var + eps) by a plain scalar loop in numpy float32, written
    independently of the vectorised code above (used by a CPU test to cross-check it).
    Returns (mean, var + eps) before the rsqrt."""
    f = np.float32

    def fma32(a, b, c):
        return f(fma(torch.tensor([float(a)]), torch.tensor([float(b)]), torch.tensor([float(c)]))[0].item())

    def comb(a, b):
        if a[2] == 0:
            return b
        if b[2] == 0:
            return a
        delta = f(b[0] - a[0])
        nf = f(a[2] + b[2])
        w = f(b[2] / nf)
        mean = fma32(delta, w, a[0])
        m2 = fma32(f(f(delta * delta) * a[2]), w, f(a[1] + b[1]))
        return (mean, m2, nf)

    L = len(values)
    threads = threads_for(L)
    states = []
    for t in range(threads):
        mean, m2, n = f(0), f(0), 0
        for j in range(t, L, threads):
            v = f(values[j])
            n += 1
            nf = f(n)
            delta = f(v - mean)
            mean = f(mean + f(delta / nf))
            m2 = fma32(delta, f(v - mean), m2)
        states.append((mean, m2, f(n)))
    warps = []
    for w0 in range(0, threads, LANES):
        lanes = states[w0:w0 + LANES]
        off = 16
        while off >= 1:
            lanes = [comb(lanes[i], lanes[i + off]) for i in range(off)]
            off //= 2
        warps.append(lanes[0])
    if len(warps) > 1:
        off = len(warps) // 2
        while off >= 1:
            warps = [comb(warps[i], warps[i + off]) for i in range(off)]
            off //= 2
    mean, m2, nf = warps[0]
    return float(mean), float(f(f(m2 / nf) + f(eps32)))
