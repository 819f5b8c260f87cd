"""GPU probe: which SDPA backend torch picks for diffusers' attention shapes, how fast each
backend is, and how accurate (vs fp64 on a subset of query rows).

A faster attention backend would be a *close* op (another accumulation order, not bit-exact):
this probe measures whether one pays before any such site is written. FLUX.1-dev: [B, 24, 4608,
128]; Wan2.1-1.3B: [B, 12, 32760, 128]; B = 1 and 2. Prints a table; writes CSV to --out.

    PYTHONPATH=. python3 bench/probes/probe_attention.py [--out attention.csv]
"""

from __future__ import annotations

import argparse
import csv

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {"flux": (24, 4608), "wan": (12, 32760)}


def main() -> int:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/attention_probe.csv")
    args = ap.parse_args()
    rows = []
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    for name, (H, S) in SHAPES.items():
        for B in (1, 2):
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, S, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
            default = F.scaled_dot_product_attention(q, k, v)
            sub = 256
            qs = q[:, :, :sub].double()
            ref = torch.softmax(qs @ k.double().transpose(-1, -2) / 128 ** 0.5, dim=-1) @ v.double()
            for bname, be in backends.items():
                try:
                    with sdpa_kernel([be]):
                        out = F.scaled_dot_product_attention(q, k, v)
                        ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v),
                                                     return_mode="median")
                except Exception as e:
                    print(f"{name} B={B} {bname}: unavailable ({type(e).__name__}: {str(e)[:80]})")
                    continue
                err = (out[:, :, :sub].double() - ref)
                rms = err.pow(2).mean().sqrt().item()
                same = torch.equal(out.view(torch.int16), default.view(torch.int16))
                flops = 4 * B * H * S * S * 128
                rows.append(dict(shape=name, B=B, backend=bname, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                                 rms_vs_fp64=f"{rms:.3e}", max_vs_fp64=f"{err.abs().max().item():.3e}",
                                 equals_default=same))
            del q, k, v, default
            torch.cuda.empty_cache()
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'shape':<6} {'B':>2} {'backend':<10} {'ms':>8} {'TFLOP/s':>8} {'rms vs fp64':>12} {'max':>10}  = default")
    for r in rows:
        print(f"{r['shape']:<6} {r['B']:>2} {r['backend']:<10} {r['ms']:>8.3f} {r['tflops']:>8.1f} "
              f"{r['rms_vs_fp64']:>12} {r['max_vs_fp64']:>10}  {r['equals_default']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
