"""Pure-torch simulation of torch's CUDA ``vectorized_layer_norm_kernel`` statistics order.

Independent of Triton: per-thread Welford over 4-element vectors (thread t reads vectors
t, t + 128, ...), shfl-down fold 16, 8, 4, 2, 1 inside each of 4 warps, then warps 0+2, 1+3,
0+1; ``var = m2 / N``, ``rstd = rsqrt(var + eps)``. See ditfuse/kernels/common/welford.py for the
PyTorch source each step mirrors. FMAs are computed through fp64 (exact product, one fp64
rounding of the sum, then one fp32 rounding), like the Triton helpers under the interpreter.

Used by the CPU tests (interpreter kernel == simulation, bitwise) and the GPU order probe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

THREADS = 128
VEC = 4


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (a.double() * b.double() + c.double()).float()


def combine(b: tuple, a: tuple, mean_mode: int = 0, m2_fma: bool = True) -> tuple:
    """cuWelfordCombine(dataB=b, dataA=a); b = own state, a = received state."""
    mean_b, m2_b, n_b = b
    mean_a, m2_a, n_a = a
    delta = mean_b - mean_a
    n = n_a + n_b
    coef = 1.0 / torch.where(n > 0, n, torch.ones_like(n))
    na = n_a * coef
    nb = n_b * coef
    if mean_mode == 0:
        mean = fma(na, mean_a, nb * mean_b)
    elif mean_mode == 1:
        mean = fma(nb, mean_b, na * mean_a)
    else:
        mean = na * mean_a + nb * mean_b
    if m2_fma:
        m2 = fma(delta * delta * n_a, nb, m2_a + m2_b)
    else:
        m2 = m2_a + m2_b + delta * delta * n_a * nb
    zero = torch.zeros_like(mean)
    return torch.where(n > 0, mean, zero), torch.where(n > 0, m2, zero), n


def row_stats(
    x: torch.Tensor,
    eps: float,
    mean_mode: int = 0,
    m2_fma: bool = True,
    rsqrt: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd) per row of ``x`` [M, N] (any float dtype; computed in fp32), N % 4 == 0."""
    x = x.float()
    M, N = x.shape
    assert N % VEC == 0
    nvec = N // VEC
    J = -(-nvec // THREADS)
    dev = x.device
    mean = torch.zeros(M, THREADS, device=dev)
    m2 = torch.zeros(M, THREADS, device=dev)
    t = torch.arange(THREADS, device=dev)
    for j in range(J):
        vec = j * THREADS + t
        valid = (vec < nvec)[None, :]
        vec_c = vec.clamp(max=nvec - 1)
        for k in range(VEC):
            v = x[:, vec_c * VEC + k]
            new_count = torch.tensor(float(j * VEC + k + 1), device=dev)
            delta = v - mean
            coef = 1.0 / new_count
            new_mean = fma(delta, coef.expand_as(delta), mean)
            new_m2 = fma(delta, v - new_mean, m2)
            mean = torch.where(valid, new_mean, mean)
            m2 = torch.where(valid, new_m2, m2)
    n_vecs = ((nvec - t + THREADS - 1) // THREADS).clamp(min=0)
    n = (n_vecs * VEC).float()[None, :].expand(M, THREADS).contiguous()
    state = (mean.view(M, 4, 32), m2.view(M, 4, 32), n.view(M, 4, 32))
    w = 32
    while w > 1:  # shfl-down w//2: lane i (< w//2) combines own state with lane i + w//2
        h = w // 2
        lo = tuple(s[..., :h] for s in state)
        hi = tuple(s[..., h:w] for s in state)
        state = combine(lo, hi, mean_mode, m2_fma)
        w = h
    state = tuple(s[..., 0] for s in state)  # [M, 4] warps
    lo = tuple(s[:, :2] for s in state)
    hi = tuple(s[:, 2:4] for s in state)
    state = combine(lo, hi, mean_mode, m2_fma)
    lo = tuple(s[:, :1] for s in state)
    hi = tuple(s[:, 1:2] for s in state)
    mean_f, m2_f, _ = combine(lo, hi, mean_mode, m2_fma)
    var = m2_f / torch.tensor(float(N), device=dev)
    z = var + torch.tensor(eps, dtype=torch.float32, device=dev)
    # fp32 sqrt through fp64 (correctly rounded; exact for sqrt), then an fp32 division: what the
    # interpreter's numpy and CUDA's IEEE sqrtf give. torch's CPU sqrt is not correctly rounded
    # on AVX512 machines (SLEEF), which made this simulation machine-dependent.
    rstd = rsqrt(z) if rsqrt is not None else 1.0 / torch.sqrt(z.double()).float()
    return mean_f, rstd


def layer_norm(x: torch.Tensor, eps: float, weight=None, bias=None, norm_dtype=None, **kw) -> torch.Tensor:
    """LayerNorm over the last dim with torch CUDA's vectorized-kernel statistics; output
    ``r(fma(w, rstd * (x - mean), b))`` (or without the affine) in the LayerNorm's input dtype
    (x's, or ``norm_dtype``)."""
    shape = x.shape
    out_dtype = norm_dtype or x.dtype
    x2 = x.reshape(-1, shape[-1])
    mean, rstd = row_stats(x2, eps, **kw)
    n = rstd * (x2.float() - mean)
    if weight is not None and bias is not None:
        n = fma(weight.float().expand_as(n), n, bias.float().expand_as(n))
    elif weight is not None:
        n = weight.float() * n
    elif bias is not None:
        n = n + bias.float()
    return n.to(out_dtype).reshape(shape)


def layernorm_modulate(x, scale, shift, eps: float, weight=None, bias=None, norm_dtype=None, **kw) -> torch.Tensor:
    """Simulated LN followed by eager modulate (the same ops as ditfuse.kernels.reference), cast
    back to x's dtype when the LayerNorm ran in ``norm_dtype``."""
    from ditfuse.kernels.reference import modulate

    n = layer_norm(x, eps, weight, bias, norm_dtype, **kw)
    if scale is not None:
        n = modulate(n, scale, shift)
    return n if norm_dtype is None else n.to(x.dtype)
