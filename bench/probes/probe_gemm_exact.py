"""GPU probe (one run): can a Triton GEMM reproduce cuBLAS's ``F.linear`` bit for bit at FLUX.1's
shapes, and how fast is it? If it can, a GEMM epilogue (tanh-GELU, gate-residual) becomes a
*bit-exact* fusion: the epilogue rounds the accumulator + bias to bf16 exactly as cuBLAS's store
does, then applies eager's next op to that bf16 value, and the [M, N] round trip through memory
between the two kernels goes away (issue 13: the GELU passes alone are ~4 ms of a FLUX.1 step).

Why it might hold: for bf16 on sm_90 both cuBLAS and Triton run the K loop as a chain of
``wgmma ... k16`` instructions into one fp32 accumulator, from k = 0 upwards, then add the bias in
fp32 and round once. The products are exact; the order of the chain is the same; so each output
element should get the same bits unless cuBLAS splits K (split-K / stream-K, or K sliced across
warpgroups) or uses another instruction shape. This probe measures it instead of assuming it.

Per shape (FLUX.1-dev, 1024x1024, B=1; M = tokens, K -> N the projection):
- the cuBLAS kernel ``F.linear`` picks (torch.profiler);
- per Triton config (plain: the production kernel of kernels/linear/linear_gelu_triton.py at that
  tile; tma: a persistent TMA-fed variant with the same K chain): mismatches against
  ``F.linear(x, w, b)`` (count, max |ulp|), CUDA-graph ms, TFLOP/s, and cuBLAS's ms over it;
- for the 3072 -> 12288 projections: the fused GEMM + tanh-GELU epilogue against eager's
  ``F.gelu(F.linear(x, w, b), approximate="tanh")``: mismatches, and eager's two kernels' ms over
  the fused one's.

    PYTHONPATH=. python bench/probes/probe_gemm_exact.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.probes.common import write_csv
from ditfuse.kernels.activation.gelu_tanh_triton import TANH_APPROX, TANH_PTX, _gelu_f32
from ditfuse.kernels.common.rounding import round_to, rround
from ditfuse.kernels.linear import linear_gelu_triton as lg

_TANH: tl.constexpr = tl.constexpr(TANH_PTX)  # a jitted function reads only constexpr globals
_TANH_FAST: tl.constexpr = tl.constexpr(TANH_APPROX)

# (name, M, K, N, gelu epilogue candidate)
SHAPES = [
    ("dual img qkv/out", 4096, 3072, 3072, False),
    ("dual img ff up", 4096, 3072, 12288, True),
    ("dual img ff down", 4096, 12288, 3072, False),
    ("dual txt ff up", 512, 3072, 12288, True),
    ("single qkv", 4608, 3072, 3072, False),
    ("single mlp up", 4608, 3072, 12288, True),
    ("single proj_out", 4608, 15360, 3072, False),
    ("single mlp up B=2", 9216, 3072, 12288, True),
]

# (BM, BN, BK, GROUP_M, stages, warps)
TMA_CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 128, 64, 8, 4, 8),
]

CONFIGS = [
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (256, 128, 64, 8, 3, 8),
]


@triton.jit
def _linear_tma_kernel(
    a_desc, b_desc, bias_ptr, c_desc,
    M, N, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
    GELU: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr = False,
):
    """Persistent, TMA-fed variant of :func:`_linear_kernel`: the same K chain per tile.
    ``FAST`` (a close candidate, not eager's bits): the GELU of the unrounded fp32 pre-activation
    with the hardware ``tanh.approx.f32``, one rounding at the store."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    k_tiles: tl.constexpr = (K + BK - 1) // BK
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        gid = tile // group
        first_m = gid * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % gsize
        pid_n = (tile % group) // gsize
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            b = b_desc.load([pid_n * BN, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rn = pid_n * BN + tl.arange(0, BN)
        bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc + bias[None, :]
        if GELU:
            if FAST:
                y = _gelu_f32(y, True, _TANH_FAST)
            else:
                y = _gelu_f32(rround(y, DTYPE), True, _TANH)
        c_desc.store([pid_m * BM, pid_n * BN], round_to(y, DTYPE))


_SMS = None


def triton_linear_tma(x, w, b, out, cfg, gelu=False, fast=False, ctas_per_sm=1):
    from triton.tools.tensor_descriptor import TensorDescriptor

    global _SMS
    if _SMS is None:
        _SMS = torch.cuda.get_device_properties(x.device).multi_processor_count
    BM, BN, BK, GM, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    c_desc = TensorDescriptor.from_tensor(out, [BM, BN])
    # ctas_per_sm > 1: that many persistent programs per SM, so one program's epilogue can run
    # while another's MMAs do (if shared memory lets them share the SM)
    programs = _SMS * ctas_per_sm
    grid = (min(programs, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _linear_tma_kernel[grid](
        a_desc, b_desc, b, c_desc, M, N, K,
        BM=BM, BN=BN, BK=BK, GROUP_M=GM, NUM_SMS=programs, GELU=gelu, DTYPE=tl.bfloat16, FAST=fast,
        num_stages=stages, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False,
    )
    return out


def triton_linear(x, w, b, out, cfg, gelu=False):
    """The production kernel (kernels/linear/linear_gelu_triton.py) at tile ``cfg``."""
    lg._launch(x, w, b, out, gelu=gelu, tile=cfg)
    return out


def mismatch(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, str]:
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    diff = (ai - bi).abs()
    n = int((diff != 0).sum())
    if n == 0:
        return 0, 0, ""
    idx = int((diff != 0).flatten().nonzero()[0])
    first = f"[{idx}] {a.flatten()[idx].item():.6g} vs {b.flatten()[idx].item():.6g}"
    return n, int(diff.max()), first


def gelu_fp64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The exact math of ``gelu_tanh(x @ w^T + b)`` in fp64 (for the fast variant's error)."""
    y = x.double() @ w.double().T + b.double()
    return 0.5 * y * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))


def err_ratio(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(rms, max) of |got - exact| over those of |eager - exact|: admission's measures."""
    eg, ee = (got.double() - exact).abs(), (eager.double() - exact).abs()
    return float(eg.pow(2).mean().sqrt() / ee.pow(2).mean().sqrt()), float(eg.max() / ee.max())


def cublas_kernel(x, w, b) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, w, b)
        torch.cuda.synchronize()
    # cuBLAS may zero its workspace first: name the GEMM, not the memset before it
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset")]
    return names[0][:90] if names else "?"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="first two configs only")
    ap.add_argument("--only", nargs="+", default=None, help="shapes whose name contains one of these")
    ap.add_argument("--configs", nargs="+", default=None, metavar="BMxBNxBKxGMxSTAGESxWARPS",
                    help="plain-kernel tiles to run instead of CONFIGS")
    ap.add_argument("--tma-configs", nargs="+", default=None, metavar="BMxBNxBKxGMxSTAGESxWARPS",
                    help="TMA-kernel tiles to run instead of TMA_CONFIGS")
    ap.add_argument("--ctas-per-sm", type=int, nargs="+", default=[1],
                    help="persistent TMA programs per SM (each value is a variant)")
    args = ap.parse_args()
    from triton.testing import do_bench_cudagraph

    torch.manual_seed(0)
    dev = "cuda"
    rows = []
    def parse(cfgs):
        return [tuple(int(v) for v in c.split("x")) for c in cfgs]

    configs = parse(args.configs) if args.configs else (CONFIGS[:2] if args.quick else CONFIGS)
    tma_configs = parse(args.tma_configs) if args.tma_configs else TMA_CONFIGS
    shapes = [s for s in SHAPES if args.only is None or any(o in s[0] for o in args.only)]
    for name, M, K, N, gelu_case in shapes:
        # activations of a LayerNorm-ish scale, weights at nn.Linear's init scale
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5).to(torch.bfloat16)
        b = (torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.02).to(torch.bfloat16)
        ref = F.linear(x, w, b)
        ref_gelu = F.gelu(ref, approximate="tanh") if gelu_case else None
        exact_rows = gelu_fp64(x[:256], w, b) if gelu_case else None
        kname = cublas_kernel(x, w, b)
        cub_ms = do_bench_cudagraph(lambda: F.linear(x, w, b))
        flops = 2.0 * M * N * K
        cub_gelu_ms = do_bench_cudagraph(lambda: F.gelu(F.linear(x, w, b), approximate="tanh")) if gelu_case else None
        print(f"{name}: M={M} K={K} N={N} cuBLAS {cub_ms:.4f} ms ({flops / cub_ms / 1e9:.0f} TF/s) {kname}", flush=True)
        out = torch.empty_like(ref)
        variants = [("plain", triton_linear, c) for c in configs]
        variants += [("tma" if n == 1 else f"tma{n}", functools.partial(triton_linear_tma, ctas_per_sm=n), c)
                     for c in tma_configs for n in args.ctas_per_sm]
        for kind, fn, cfg in variants:
            row = dict(shape=name, M=M, K=K, N=N, kind=kind, cfg="x".join(map(str, cfg)), cublas_kernel=kname,
                       cublas_ms=round(cub_ms, 4))
            try:
                out.zero_()
                fn(x, w, b, out, cfg)
                torch.cuda.synchronize()
                n, ulp, first = mismatch(out, ref)
                ms = do_bench_cudagraph(lambda: fn(x, w, b, out, cfg))
                row.update(mismatches=n, max_ulp=ulp, first=first, ms=round(ms, 4),
                           tflops=round(flops / ms / 1e9), vs_cublas=round(cub_ms / ms, 3))
                if gelu_case:
                    fn(x, w, b, out, cfg, gelu=True)
                    torch.cuda.synchronize()
                    gn, gulp, gfirst = mismatch(out, ref_gelu)
                    gms = do_bench_cudagraph(lambda: fn(x, w, b, out, cfg, gelu=True))
                    row.update(gelu_mismatches=gn, gelu_max_ulp=gulp, gelu_first=gfirst, gelu_ms=round(gms, 4),
                               eager_linear_gelu_ms=round(cub_gelu_ms, 4), gelu_vs_eager=round(cub_gelu_ms / gms, 3))
                    if kind.startswith("tma"):  # the close candidate: approx tanh, one rounding
                        fn(x, w, b, out, cfg, gelu=True, fast=True)
                        torch.cuda.synchronize()
                        rms, mx = err_ratio(out[:256], ref_gelu[:256], exact_rows)
                        fms = do_bench_cudagraph(lambda: fn(x, w, b, out, cfg, gelu=True, fast=True))
                        row.update(fast_ms=round(fms, 4), fast_vs_eager=round(cub_gelu_ms / fms, 3),
                                   fast_rms_ratio=round(rms, 3), fast_max_ratio=round(mx, 3))
            except Exception as e:  # a config that does not compile (shared memory) is a row, not a stop
                row.update(error=f"{type(e).__name__}: {str(e)[:120]}")
            rows.append(row)
            print("   ", {k: v for k, v in row.items() if k not in ("shape", "M", "K", "N", "cublas_kernel")}, flush=True)
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    path = write_csv(args.out, "probe_gemm_exact.csv", rows, fieldnames=fields)
    print("\nshape                 kind  cfg              mism   ulp  ms      vs cuBLAS  gelu_mism gelu/eager "
          "fast/eager fast_rms_ratio")
    for r in rows:
        print(f"{r['shape']:<21} {r['kind']:<5} {r['cfg']:<16} {r.get('mismatches', '-')!s:>6} {r.get('max_ulp', '-')!s:>4} "
              f"{r.get('ms', '-')!s:<7} {r.get('vs_cublas', '-')!s:<10} {r.get('gelu_mismatches', '')!s:>9} "
              f"{r.get('gelu_vs_eager', '')!s} {r.get('fast_vs_eager', '')!s} {r.get('fast_rms_ratio', '')!s} "
              f"{r.get('error', '')}")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
