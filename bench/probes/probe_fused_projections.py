"""GPU probe (one run): would FLUX.1's projections be faster as one GEMM each (a quality="high"
candidate: concatenated weights change cuBLAS's kernel, so not bit-exact)? At the 1024x1024 B=1
shapes, bf16, CUDA-graph timing:

- single block: to_q, to_k, to_v (3072 -> 3072 each) and proj_mlp (3072 -> 12288) on the same
  [4608, 3072] input, as four F.linear calls against one 3072 -> 21504 F.linear;
- dual block, image stream: to_q/to_k/to_v on [4096, 3072] against one 3072 -> 9216;
- dual block, text stream: add_q/k/v on [512, 3072] against one 3072 -> 9216.

Prints ms per block-worth and the fused result's max |difference| against the separate ones.

    PYTHONPATH=. python bench/probes/probe_fused_projections.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from bench.probes.common import write_csv

CASES = [
    ("single q,k,v,mlp", 4608, [3072, 3072, 3072, 12288]),
    ("dual img q,k,v", 4096, [3072, 3072, 3072]),
    ("dual txt q,k,v", 512, [3072, 3072, 3072]),
    ("single q,k,v,mlp B=2", 9216, [3072, 3072, 3072, 12288]),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton.testing

    rows = []
    for name, m, ns in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, 3072, device="cuda", generator=g).to(torch.bfloat16)
        ws = [(torch.randn(n, 3072, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for n in ns]
        bs = [(torch.randn(n, device="cuda", generator=g) * 0.1).to(torch.bfloat16) for n in ns]
        wf, bf = torch.cat(ws), torch.cat(bs)
        sep = lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)]  # noqa: E731
        fused = lambda: F.linear(x, wf, bf).split(ns, dim=-1)  # noqa: E731
        t_sep = triton.testing.do_bench_cudagraph(sep, rep=100)
        t_fused = triton.testing.do_bench_cudagraph(fused, rep=100)
        a, b = torch.cat(sep(), dim=-1), torch.cat(fused(), dim=-1)
        d = (a.float() - b.float()).abs()
        flops = 2 * m * 3072 * sum(ns)
        row = dict(case=name, separate_ms=round(t_sep, 4), fused_ms=round(t_fused, 4), speedup=round(t_sep / t_fused, 3),
                   tflops_separate=round(flops / t_sep / 1e9, 1), tflops_fused=round(flops / t_fused / 1e9, 1),
                   max_abs_diff=float(d.max()), differing=round(float((d > 0).float().mean()), 5))
        rows.append(row)
        print(f"{name:<24} separate {t_sep:7.4f} ms ({row['tflops_separate']} TF/s)  fused {t_fused:7.4f} ms "
              f"({row['tflops_fused']} TF/s)  x{row['speedup']:.3f}  max|d| {row['max_abs_diff']:.3g} "
              f"differing {row['differing']:.4f}", flush=True)
    write_csv(args.out, "probe_fused_projections.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
