"""Pure-torch simulation of torch's CUDA ``_fused_rms_norm`` (vectorized RMS kernel) and of the
FLUX QK-norm + RoPE chain built on it. Independent of Triton.

RMS order (see ditfuse/kernels/common/rms.py for the PyTorch source each step mirrors): thread
t (t = lane + 32 * warp, 128 threads) sums the squares of its 4-element vectors t, t + 128, ...
in element order with FMAs; lanes fold at shfl-down offsets 16, 8, 4, 2, 1; warps fold 0+2, 1+3,
then 0+1; ``ms = sum / N``; ``rstd = rsqrt(ms + eps)``; output ``w * (rstd * x)`` rounded once.
FMAs are computed through fp64 like the Triton helpers under the interpreter (exact for bf16/fp16
squares).

``rsqrt`` is a parameter: on the GPU ``torch.rsqrt`` (the same ``rsqrtf`` the ATen kernel calls),
under the Triton interpreter ``1 / sqrt`` (what the interpreter computes for ``rsqrt``).

Besides the torch order, :func:`sumsq` knows a few alternative orders; the GPU probe
(bench/probes/probe_rms_order.py) runs them all to show which one torch's kernel follows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

THREADS = 128
LANES = 32
VEC = 4


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).float()


def _fold_halves(s: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [...]: repeatedly add the upper half onto the lower half (shfl-down tree)."""
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s[..., 0]


def _thread_sums(x: torch.Tensor, vec: int, threads: int, use_fma: bool) -> torch.Tensor:
    """[..., N] fp32 -> [..., threads]: thread t sums its vec-element vectors t, t + threads, ...
    in element order."""
    N = x.shape[-1]
    n_vec = N // vec
    xv = x.reshape(*x.shape[:-1], n_vec, vec)
    acc = torch.zeros(*x.shape[:-1], threads, dtype=torch.float32, device=x.device)
    for start in range(0, n_vec, threads):
        chunk = xv[..., start : start + threads, :]
        n = chunk.shape[-2]
        a = acc[..., :n]
        for e in range(vec):
            v = chunk[..., e]
            a = fma(v, v, a) if use_fma else a + v * v
        acc = torch.cat([a, acc[..., n:]], dim=-1)
    return acc


def sumsq(x: torch.Tensor, order: str = "torch") -> torch.Tensor:
    """Sum of squares over the last dim of fp32 ``x`` in one of several orders.

    torch: 128 threads x vec4 with FMA, lane tree 16..1 per warp, warps 0+2, 1+3, 0+1.
    torch_nofma: same, the per-thread adds not contracted.
    halving: one halving tree over all N elements (offsets N/2 ... 1).
    sequential: left to right.
    lane_strided: 32 lanes, lane l sums elements l, l + 32, ... (FMA), then the lane tree.
    vec8: 128 threads x 8-element vectors (FMA), lane and warp trees as torch.
    vec2: 128 threads x 2-element vectors (FMA), lane and warp trees as torch.
    torch_sum: torch.sum(x * x) (the device's generic reduction).
    """
    x = x.float()
    if order in ("torch", "torch_nofma", "vec8", "vec2"):
        vec = {"vec8": 8, "vec2": 2}.get(order, VEC)
        t = _thread_sums(x, vec, THREADS, use_fma=order != "torch_nofma")
        warps = _fold_halves(t.reshape(*t.shape[:-1], THREADS // LANES, LANES))
        return _fold_halves(warps)
    if order == "halving":
        return _fold_halves(x * x)
    if order == "sequential":
        acc = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
        for j in range(x.shape[-1]):
            acc = acc + x[..., j] * x[..., j]
        return acc
    if order == "lane_strided":
        t = _thread_sums(x, 1, LANES, use_fma=True)
        return _fold_halves(t)
    if order == "torch_sum":
        return (x * x).sum(-1)
    raise ValueError(order)


def interp_rsqrt(v: torch.Tensor) -> torch.Tensor:
    """The Triton interpreter's ``rsqrt``: numpy ``1 / sqrt`` in fp32 (numpy's, not torch's: the
    CPU ``torch.sqrt`` is not always correctly rounded, numpy's is)."""
    import numpy as np

    a = v.detach().cpu().float().numpy()
    return torch.from_numpy(np.float32(1) / np.sqrt(a)).to(v.device)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] = torch.rsqrt,
    order: str = "torch",
    out_order: str = "w(rx)",
) -> torch.Tensor:
    """``_fused_rms_norm`` over the last dim, one rounding to x.dtype.

    out_order: ``w(rx)`` = torch's ``gamma * (rstd * x)``; ``(wr)x`` the other association."""
    xf = x.float()
    N = x.shape[-1]
    ms = sumsq(xf, order) / torch.tensor(float(N), dtype=torch.float32, device=x.device)
    eps32 = torch.tensor(eps, dtype=torch.float32, device=x.device)
    rstd = rsqrt(ms + eps32)[..., None]
    if weight is None:
        y = rstd * xf
    elif out_order == "w(rx)":
        y = weight.float() * (rstd * xf)
    else:
        y = (weight.float() * rstd) * xf
    return y.to(x.dtype)


def qk_rmsnorm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None,
                    q_txt_weight=None, k_txt_weight=None, rsqrt=torch.rsqrt, order="torch"):
    """ditfuse.kernels.reference.qk_rmsnorm_rope with the RMSNorm simulated (same signature)."""
    from ditfuse.kernels.reference import rope_interleaved

    qn = rms_norm(q, q_weight, eps, rsqrt, order)
    kn = rms_norm(k, k_weight, eps, rsqrt, order)
    if q_txt is not None:
        qn = torch.cat([rms_norm(q_txt, q_txt_weight, eps, rsqrt, order), qn], dim=1)
        kn = torch.cat([rms_norm(k_txt, k_txt_weight, eps, rsqrt, order), kn], dim=1)
    if cos is not None:
        qn = rope_interleaved(qn, cos, sin)
        kn = rope_interleaved(kn, cos, sin)
    return qn, kn


def qk_rmsnorm_across_heads_rope(q, k, q_weight, k_weight, cos, sin, heads, eps=1e-6, rsqrt=torch.rsqrt,
                                 order="torch"):
    """ditfuse.kernels.reference.qk_rmsnorm_across_heads_rope (Wan) with the RMSNorm over all
    heads simulated (several 4-element vectors per thread when H * Dh > 512)."""
    from ditfuse.kernels.reference import rope_pairs

    qn = rms_norm(q, q_weight, eps, rsqrt, order).unflatten(2, (heads, -1))
    kn = rms_norm(k, k_weight, eps, rsqrt, order).unflatten(2, (heads, -1))
    if cos is not None:
        qn, kn = rope_pairs(qn, cos, sin), rope_pairs(kn, cos, sin)
    return qn, kn
