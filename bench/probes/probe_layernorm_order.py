"""GPU probe: which Welford contraction / rsqrt variant matches torch's CUDA LayerNorm bitwise.

Run on a CUDA machine: ``PYTHONPATH=. python3 bench/probes/probe_layernorm_order.py``. For each
variant of the statistics (where nvcc contracts the combine's products into FMAs, whether the
online update uses FMAs, which rsqrt instruction) it compares the per-row mean and rstd with
``torch.native_layer_norm``'s (fp32 bits) over several widths and input distributions, and
prints a table of matching rows. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from ditfuse.kernels.common.welford import fma_rn, rsqrt_approx, welford_combine


# torch's one-row-per-block fold, spelled out with reshapes (the first kernel's layout), with
# welford_combine's contraction variants as parameters: what this probe compares.
@triton.jit
def _fold_half(mean, m2, n, G: tl.constexpr, W: tl.constexpr, MEAN_MODE: tl.constexpr, M2_FMA: tl.constexpr):
    """[G, W] states -> [G, W // 2]: column i combines with column i + W // 2 (shfl-down by
    W // 2: own state first)."""
    mean_lo, mean_hi = tl.split(tl.permute(tl.reshape(mean, [G, 2, W // 2]), (0, 2, 1)))
    m2_lo, m2_hi = tl.split(tl.permute(tl.reshape(m2, [G, 2, W // 2]), (0, 2, 1)))
    n_lo, n_hi = tl.split(tl.permute(tl.reshape(n, [G, 2, W // 2]), (0, 2, 1)))
    return welford_combine(mean_lo, m2_lo, n_lo, mean_hi, m2_hi, n_hi, MEAN_MODE, M2_FMA)


@triton.jit
def welford_block_fold(mean, m2, n, MEAN_MODE: tl.constexpr = 0, M2_FMA: tl.constexpr = True):
    """Fold the [128] per-thread states (index ``lane + 32 * warp``) the way compute_stats does:
    shfl-down 16, 8, 4, 2, 1 inside each warp, then warps w += w + 2 and w += w + 1 through
    shared memory. Returns the block's (mean, m2, count) as [1, 1] tensors (they broadcast
    against [128, 4] tiles; no reduction, so -0.0 survives)."""
    mean = tl.reshape(mean, [4, 32])
    m2 = tl.reshape(m2, [4, 32])
    n = tl.reshape(n, [4, 32])
    mean, m2, n = _fold_half(mean, m2, n, 4, 32, MEAN_MODE, M2_FMA)
    mean, m2, n = _fold_half(mean, m2, n, 4, 16, MEAN_MODE, M2_FMA)
    mean, m2, n = _fold_half(mean, m2, n, 4, 8, MEAN_MODE, M2_FMA)
    mean, m2, n = _fold_half(mean, m2, n, 4, 4, MEAN_MODE, M2_FMA)
    mean, m2, n = _fold_half(mean, m2, n, 4, 2, MEAN_MODE, M2_FMA)
    # [4, 1] -> one state per warp; warps fold as a [1, 4] row: 0+2, 1+3, then 0+1.
    mean = tl.reshape(mean, [1, 4])
    m2 = tl.reshape(m2, [1, 4])
    n = tl.reshape(n, [1, 4])
    mean, m2, n = _fold_half(mean, m2, n, 1, 4, MEAN_MODE, M2_FMA)
    mean, m2, n = _fold_half(mean, m2, n, 1, 2, MEAN_MODE, M2_FMA)
    return mean, m2, n




@triton.jit(do_not_specialize=["N", "NVEC", "J", "eps"])
def _stats_kernel(x_ptr, mean_ptr, rstd_ptr, N, NVEC, eps, J,
                  ONLINE_FMA: tl.constexpr, MEAN_MODE: tl.constexpr, M2_FMA: tl.constexpr,
                  RSQ: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, 128)
    k4 = tl.arange(0, 4)
    mean = tl.zeros([128], dtype=tl.float32)
    m2 = tl.zeros([128], dtype=tl.float32)
    j = 0
    while j < J:
        vec = j * 128 + t
        valid = vec < NVEC
        x = tl.load(x_ptr + row * N + vec[:, None] * 4 + k4[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        x02, x13 = tl.split(tl.reshape(x, [128, 2, 2]))
        x0, x2 = tl.split(x02)
        x1, x3 = tl.split(x13)
        for k in tl.static_range(4):
            if k == 0:
                v = x0
            elif k == 1:
                v = x1
            elif k == 2:
                v = x2
            else:
                v = x3
            delta = v - mean
            coef = tl.math.div_rn(1.0, j * 4 + k + 1.0)
            if ONLINE_FMA:
                nm = fma_rn(delta, coef, mean)
                nm2 = fma_rn(delta, v - nm, m2)
            else:
                nm = mean + delta * coef
                nm2 = m2 + delta * (v - nm)
            mean = tl.where(valid, nm, mean)
            m2 = tl.where(valid, nm2, m2)
        j += 1
    count = (tl.maximum((NVEC - t + 127) // 128, 0) * 4).to(tl.float32)
    mean_r, m2_r, _ = welford_block_fold(mean, m2, count, MEAN_MODE, M2_FMA)
    var = tl.math.div_rn(m2_r, N.to(tl.float32))
    if RSQ == 0:
        rstd = rsqrt_approx(var + eps)
    elif RSQ == 1:
        rstd = tl.math.rsqrt(var + eps)
    else:
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(var + eps))
    z = tl.arange(0, 1)[None, :]
    tl.store(mean_ptr + row + z, mean_r)
    tl.store(rstd_ptr + row + z, rstd)


VARIANTS = [  # (name, ONLINE_FMA, MEAN_MODE, M2_FMA, RSQ)
    ("A fma(nA,mA,nB*mB) m2fma", True, 0, True, 0),
    ("B fma(nB,mB,nA*mA) m2fma", True, 1, True, 0),
    ("C nofma-mean m2fma", True, 2, True, 0),
    ("D fma(nA..) m2plain", True, 0, False, 0),
    ("E fma(nB..) m2plain", True, 1, False, 0),
    ("F nofma-mean m2plain", True, 2, False, 0),
    ("G A + online-nofma", False, 0, True, 0),
    ("H A + tl.math.rsqrt", True, 0, True, 1),
    ("I A + 1/sqrt_rn", True, 0, True, 2),
]


def inputs(M: int, N: int, dtype, kind: str, gen) -> torch.Tensor:
    if kind == "offset":
        x = torch.randn(M, N, generator=gen, device="cuda") * 3 + 5
    elif kind == "std":
        x = torch.randn(M, N, generator=gen, device="cuda")
    elif kind == "wide":
        x = torch.randn(M, N, generator=gen, device="cuda") * torch.exp(torch.randn(M, 1, generator=gen, device="cuda") * 4)
    else:  # "spiky": a few huge outliers per row
        x = torch.randn(M, N, generator=gen, device="cuda")
        x[:, :: max(N // 7, 1)] *= 300
    return x.to(dtype)


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    widths = [3072, 1536, 2048, 2240, 4096, 5120, 4, 64, 96, 260, 512, 516, 1040, 8192, 12288, 16384]
    eps = 1e-6
    M = 128
    totals = {v[0]: [0, 0, 0] for v in VARIANTS}  # mean ok, rstd ok, rows
    per_width = {}
    for N in widths:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for kind in ("offset", "std", "wide", "spiky"):
                x = inputs(M, N, dtype, kind, gen)
                if dtype == torch.float16 and kind == "wide":
                    x = torch.nan_to_num(x)
                _, m_ref, r_ref = torch.native_layer_norm(x, [N], None, None, eps)
                m_ref, r_ref = m_ref.reshape(M), r_ref.reshape(M)
                xf = x.float().contiguous()
                for name, of, mm, m2f, rsq in VARIANTS:
                    mo = torch.empty(M, device="cuda")
                    ro = torch.empty(M, device="cuda")
                    nvec = N // 4
                    # statistics depend only on the fp32 values: one compile per variant
                    _stats_kernel[(M,)](xf, mo, ro, N, nvec, eps, triton.cdiv(nvec, 128),
                                        ONLINE_FMA=of, MEAN_MODE=mm, M2_FMA=m2f, RSQ=rsq,
                                        num_warps=4, enable_fp_fusion=False)
                    okm = int((mo.view(torch.int32) == m_ref.view(torch.int32)).sum())
                    okr = int((ro.view(torch.int32) == r_ref.view(torch.int32)).sum())
                    tot = totals[name]
                    tot[0] += okm
                    tot[1] += okr
                    tot[2] += M
                    pw = per_width.setdefault((name, N), [0, 0, 0])
                    pw[0] += okm
                    pw[1] += okr
                    pw[2] += M
    print(f"torch {torch.__version__}  triton {triton.__version__}  {torch.cuda.get_device_name()}")
    print("per-width rows with mean AND rstd bits equal, variant A (the default):")
    for N in widths:
        m, r, n = per_width[(VARIANTS[0][0], N)]
        print(f"  N={N:6d}: mean {m}/{n} rstd {r}/{n}")
    print("variant                        mean-equal  rstd-equal  rows")
    for name, (m, r, n) in totals.items():
        print(f"{name:30s} {m:10d}  {r:10d}  {n}")
    a = totals[VARIANTS[0][0]]
    return 0 if a[0] == a[1] == a[2] else 1


if __name__ == "__main__":
    sys.exit(main())
