"""Pure-torch simulation of Qwen-Image's QK chain as torch 2.11 runs it on CUDA: diffusers'
``RMSNorm`` (``x.float().pow(2).mean(-1)`` in the generic reduce kernel's order and MeanOps'
factor, ``rsqrtf``, two roundings) and the complex64 RoPE multiply under each candidate
contraction. Independent of Triton: fp32 adds in explicit order, FMAs through
:func:`ditfuse.kernels.reference.fma32` (exact), so it runs on CUDA (the GPU probe) and on the CPU.

The derivation of each step is in ``ditfuse/kernels/common/rms.py`` (``rms_sumsq_reduce_order``)
and ``ditfuse/kernels/rope/qk_rmsnorm_rope_triton.py`` (``_reduce_launch``, ``_mean_factor``,
``_cmul``); this file re-implements them without sharing code with the kernel (only the launch
rules -- block width from (D, rows) -- are restated here from Reduce.cuh).

``rsqrt`` is a parameter: on the GPU ``torch.rsqrt`` (the ``rsqrtf`` ATen calls), under the
Triton interpreter ``tests.support.rms_sim.interp_rsqrt`` (what the interpreter computes).
``mean`` is a parameter too: ``None`` is the CUDA order; a callable (e.g. ``cpu_mean``) replaces
the whole ``pow(2).mean(-1)`` so the rest of the chain can be checked against the CPU reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ditfuse.kernels.reference import fma32

_HALF = (torch.float16, torch.bfloat16)
CMUL_MODES = (0, 1, 2, 3, 4)


def _last_pow2(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def reduce_width(D: int, rows: int) -> tuple[int, int]:
    """(lanes per row W, vector width) of ``setReduceConfig`` for a mean over the contiguous
    last dim of an fp32 [rows, D] tensor: vectors of 4 when D >= 128; ``block_width =
    min(last_pow2(dim0), 32)``, ``block_height = min(last_pow2(rows), 512 // block_width)``, then
    ``block_width = min(last_pow2(dim0), 512 // block_height)`` (dim0, rows capped at 512)."""
    vec = 4 if D >= 128 else 1
    dim0 = D // vec
    d0 = _last_pow2(dim0) if dim0 < 512 else 512
    d1 = _last_pow2(max(rows, 1)) if rows < 512 else 512
    width = min(d0, 32)
    height = min(d1, 512 // width)
    return min(d0, 512 // height), vec


def mean_factor(rows: int, D: int) -> np.float32:
    """``static_cast<float>(rows) / (rows * D)``: int64 -> float, then an fp32 division."""
    return np.float32(rows) / np.float32(rows * D)


def _lane_tree(s: torch.Tensor) -> torch.Tensor:
    """[..., W] -> [...]: block_x_reduce as the H200 probe found it in torch 2.11: lane i adds
    lane i + offset for offsets W/2, ..., 2, 1 (a halving tree; lane 0 is the result)."""
    W = s.shape[-1]
    vals = [s[..., i] for i in range(W)]
    offset = W // 2
    while offset >= 1:
        for i in range(offset):
            vals[i] = vals[i] + vals[i + offset]
        offset //= 2
    return vals[0]


def sumsq_reduce_order(x32: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Sum of ``r32(x*x)`` over the last dim of fp32 ``x32`` [..., D] in torch's generic CUDA
    reduce order (Reduce.cuh, ``MeanOps``). ``rows``: the number of outputs of the mean call
    (default: all leading elements), which sets the lane count W."""
    x32 = x32.float()
    D = x32.shape[-1]
    lead = x32.shape[:-1]
    if rows is None:
        rows = x32[..., 0].numel() if D else 0
    W, vec = reduce_width(D, rows)
    sq = x32 * x32
    zero = torch.zeros(*lead, W, dtype=torch.float32, device=x32.device)
    if vec == 1:
        # Lane l: elements l, l + W, ...; element j of the lane goes to accumulator j % 4.
        n_per_lane = -(-D // W)
        pad = torch.cat([sq, torch.zeros(*lead, n_per_lane * W - D, dtype=torch.float32, device=x32.device)], -1)
        per = pad.reshape(*lead, n_per_lane, W)
        acc = [zero.clone() for _ in range(4)]
        for j in range(n_per_lane):
            acc[j % 4] = acc[j % 4] + per[..., j, :]
    else:
        assert D % 4 == 0
        n_vec = D // 4
        v_per_lane = -(-n_vec // W)
        pad = torch.cat([sq, torch.zeros(*lead, (v_per_lane * W - n_vec) * 4, dtype=torch.float32,
                                         device=x32.device)], -1)
        per = pad.reshape(*lead, v_per_lane, W, 4)
        acc = [zero.clone() for _ in range(4)]
        for m in range(v_per_lane):
            for i in range(4):
                acc[i] = acc[i] + per[..., m, :, i]
    lane = ((acc[0] + acc[1]) + acc[2]) + acc[3]
    return _lane_tree(lane)


def cpu_mean(x32: torch.Tensor) -> torch.Tensor:
    """The CPU's ``x.pow(2).mean(-1)`` (sum / D in the CPU's order): for checks against the CPU
    reference."""
    return x32.float().pow(2).mean(-1)


def rms_norm_diffusers_cuda(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    factor: float | None = None,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] = torch.rsqrt,
    mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """diffusers ``RMSNorm.forward`` as CUDA computes it: ``ms = r32(sum * factor)`` (the sum in
    reduce order, ``factor`` = MeanOps' ``float(rows) / numel`` unless given), ``rstd =
    rsqrt(r32(ms + eps))``, ``h = r32(x * rstd)``; weight bf16/fp16: ``r(r(h) * w)`` in the
    weight's dtype; fp32 weight: ``r32(h * w)`` (fp32 output); None: ``r(h)``."""
    D = x.shape[-1]
    x32 = x.float()
    if mean is None:
        rows = x32[..., 0].numel() if D else 0
        f = mean_factor(rows, D) if factor is None else np.float32(factor)
        ms = sumsq_reduce_order(x32, rows) * torch.tensor(float(f), dtype=torch.float32, device=x.device)
    else:
        ms = mean(x32)
    rstd = rsqrt(ms + torch.tensor(eps, dtype=torch.float32, device=x.device))
    h = x32 * rstd[..., None]
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype in _HALF:
        return (h.to(weight.dtype).float() * weight.float()).to(weight.dtype)
    return h * weight.float()


def _neg(t: torch.Tensor) -> torch.Tensor:
    return -t  # torch's neg flips the sign bit (-0 stays signed)


def cmul_fp32(a, b, c, d, mode: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a + ib)(c + id)`` in fp32 under contraction ``mode`` (see the kernel's ``_cmul``):
    0: no FMA; 1: fma(a,c,-bd), fma(a,d,bc); 2: fma(-b,d,ac), fma(b,c,ad);
    3: fma(a,c,-bd), fma(b,c,ad); 4: fma(-b,d,ac), fma(a,d,bc)."""
    if mode == 0:
        return a * c - b * d, a * d + b * c
    if mode == 1:
        return fma32(a, c, _neg(b * d)), fma32(a, d, b * c)
    if mode == 2:
        return fma32(_neg(b), d, a * c), fma32(b, c, a * d)
    if mode == 3:
        return fma32(a, c, _neg(b * d)), fma32(b, c, a * d)
    if mode == 4:
        return fma32(_neg(b), d, a * c), fma32(a, d, b * c)
    raise ValueError(f"cmul mode {mode} is not 0..4")


def rope_complex_cuda(x: torch.Tensor, freqs: torch.Tensor, cmul: int) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x, freqs, use_real=False)``: x [B, S, H, D], freqs complex64
    [S, D/2]; pairs (a, b) = (x[2i], x[2i+1]) times (Re, Im) of freqs[s, i], rounded once to
    x's dtype."""
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    f = freqs[None] if freqs.dim() == 2 else freqs  # [S, D/2] or per sample [B, S, D/2] (Z-Image)
    c = f.real.float()[:, :, None, :]
    d = f.imag.float()[:, :, None, :]
    re, im = cmul_fp32(a, b, c, d, cmul)
    return torch.stack([re, im], dim=-1).flatten(3).to(x.dtype)


def qk_chain_cuda(
    q, k, q_weight, k_weight, freqs, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None,
    k_txt_weight=None, txt_freqs=None, norm=True, cmul=1, rsqrt=torch.rsqrt, mean=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.qk_rmsnorm_diffusers_rope_complex_cat`` with the norm and the complex multiply
    simulated (same arguments, plus the contraction ``cmul`` and the ``rsqrt``/``mean`` hooks).
    Each stream is its own mean call: its own rows count, lane count and factor."""

    def one(x, w, f):
        if norm:
            x = rms_norm_diffusers_cuda(x, w, eps, rsqrt=rsqrt, mean=mean)
        if f is not None:
            x = rope_complex_cuda(x, f, cmul)
        return x

    qo = one(q, q_weight, freqs)
    ko = one(k, k_weight, freqs)
    if q_txt is not None:
        qo = torch.cat([one(q_txt, q_txt_weight, txt_freqs), qo], dim=1)
        ko = torch.cat([one(k_txt, k_txt_weight, txt_freqs), ko], dim=1)
    return qo, ko


def qk_cat_heads_first_cuda(
    q, k, q_weight, k_weight, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None, k_txt_weight=None,
    rsqrt=torch.rsqrt, mean=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.qk_rmsnorm_diffusers_cat_heads_first`` (SD3.5) with the norm simulated: each
    [B, H, S, D] stream is its own mean call (rows B*H*S), then the image-first concat on dim 2."""

    def one(x, w):
        return rms_norm_diffusers_cuda(x, w, eps, rsqrt=rsqrt, mean=mean)

    qo, ko = one(q, q_weight), one(k, k_weight)
    if q_txt is not None:
        qo = torch.cat([qo, one(q_txt, q_txt_weight)], dim=2)
        ko = torch.cat([ko, one(k_txt, k_txt_weight)], dim=2)
    return qo, ko


def qk_img_first_cuda(
    q, k, q_weight, k_weight, cos, sin, eps=1e-6, q_txt=None, k_txt=None, q_txt_weight=None, k_txt_weight=None,
    rsqrt=torch.rsqrt, mean=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.qk_rmsnorm_diffusers_rope_img_first`` (HunyuanVideo 1.5) with the norm
    simulated: each [B, S, H, D] stream its own mean call (rows B*S*H), FLUX's real RoPE (the
    reference's own ops: fp32 products and sum, one rounding; identical on CPU and CUDA) on the
    image stream, then the image-first concat on dim 1."""
    from ditfuse.kernels.reference import rope_interleaved

    def one(x, w):
        return rms_norm_diffusers_cuda(x, w, eps, rsqrt=rsqrt, mean=mean)

    qo, ko = one(q, q_weight), one(k, k_weight)
    if cos is not None:
        qo, ko = rope_interleaved(qo, cos, sin), rope_interleaved(ko, cos, sin)
    if q_txt is not None:
        qo = torch.cat([qo, one(q_txt, q_txt_weight)], dim=1)
        ko = torch.cat([ko, one(k_txt, k_txt_weight)], dim=1)
    return qo, ko
