"""Probe (round 32): Wan 2.2 TI2V-5B's per-token modulation ``scale_shift_table + temb.float()``
([1, 1, 6, D] fp32 + [B, S, 6, D] bf16 -> fp32) as eager runs it (an upcast copy, then the
broadcast add: two passes, 2 + 4 and 4 + 4 bytes read + written per element) against torch's
promoted ``table + temb`` (one pass: 2 + 4 bytes per element; round 32's
``models.adaln.table_plus_fp32``), the ``modulate.table_add`` Triton kernel (one pass, what
``table_plus_fp32`` calls since) and torch.compile's kernel for the same expression. Every
variant is checked bitwise against eager first. ms: do_bench_cudagraph median (GPU time only)
and do_bench (L2 flushed, host included); GB/s and % of a 1 GiB copy's bandwidth count each
variant's minimal traffic (temb read once as bf16, the sum written once as fp32).

    PYTHONPATH=. python3 bench/probes/probe_table_sum.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from bench.probes.common import copy_gbs, write_csv
from ditfuse.kernels.compare import first_mismatch
from ditfuse.kernels.modulate.table_add_triton import table_add

# (name, B, S, D): TI2V-5B at its 1280x704x121 default (31 x 22 x 40 tokens), at 832x480x81
# (21 x 15 x 26), B=2 for CFG
SHAPES = [("5b 1280x704x121", 1, 27280, 3072), ("5b 832x480x81", 1, 8190, 3072), ("5b 832x480x81 B=2", 2, 8190, 3072)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args()
    torch.manual_seed(0)
    copy = copy_gbs()
    eager = lambda t, e: t + e.float()  # noqa: E731
    promoted = lambda t, e: t + e  # noqa: E731
    compiled = torch.compile(eager, dynamic=False)
    rows = []
    for name, B, S, D in SHAPES:
        table = torch.randn(1, 1, 6, D, device="cuda") * 0.05
        temb = (torch.randn(B, S, 6, D, device="cuda") * 3).to(torch.bfloat16)
        ref = eager(table, temb)
        nbytes = temb.numel() * (2 + 4)
        for variant, fn in (("eager", eager), ("promoted", promoted), ("table_add", table_add), ("compile", compiled)):
            out = fn(table, temb)
            mm = first_mismatch(out, ref)
            call = lambda fn=fn, t=table, e=temb: fn(t, e)  # noqa: E731
            graph = triton.testing.do_bench_cudagraph(call, return_mode="median")
            flush = triton.testing.do_bench(call, return_mode="median")
            gbs = nbytes / (graph * 1e-3) / 1e9
            rows.append(dict(shape=name, variant=variant, ms_graph=round(graph, 4), ms_flush=round(flush, 4),
                             GBs=round(gbs, 1), pct_of_copy=round(100 * gbs / copy, 1),
                             bitwise_equal=mm is None, gpu=torch.cuda.get_device_name()))
            del out
        del table, temb, ref
        torch.cuda.empty_cache()
    path = write_csv(args.out_dir, "probe_table_sum.csv", rows)
    print(f"copy {copy:.0f} GB/s; {path}")
    print(f"{'shape':<20} {'variant':<16} {'graph ms':>9} {'flush ms':>9} {'% copy':>7} bitwise")
    for r in rows:
        print(f"{r['shape']:<20} {r['variant']:<16} {r['ms_graph']:>9.4f} {r['ms_flush']:>9.4f} {r['pct_of_copy']:>7.1f} {r['bitwise_equal']}")


if __name__ == "__main__":
    main()
