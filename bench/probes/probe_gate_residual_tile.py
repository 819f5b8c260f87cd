"""Probe: modulate.gate_residual's tile (elements per program x warps) at Wan's and FLUX's shapes,
against torch.compile of the same chain. Tiling never changes an element's arithmetic; every
variant is checked bitwise against eager before timing. ms: do_bench_cudagraph median.

    PYTHONPATH=. OUT=/tmp/probe_out python3 bench/probes/probe_gate_residual_tile.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_held_rows import write_rows  # noqa: E402

from ditfuse.kernels import reference as ref
from ditfuse.kernels.common import elementwise as ew
from ditfuse.kernels.common.host import promote, tl_dtype
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import gate_residual_triton as grt


def main() -> None:
    n = 1 << 29
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 4 * n / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    src = dst = None
    rows = []
    cases = [((1, 32760, 1536), (1, 1, 1536), torch.float32), ((2, 32760, 1536), (2, 1, 1536), torch.float32),
             ((2, 32760, 5120), (2, 5120), torch.bfloat16), ((1, 4608, 3072), (1, 3072), torch.bfloat16)]
    for shape, gshape, gdt in cases:
        x = torch.randn(shape, device="cuda").to(torch.bfloat16)
        u = torch.randn(shape, device="cuda").to(torch.bfloat16)
        g = torch.randn(gshape, device="cuda").to(gdt)
        expected = ref.gate_residual(x, g, u)
        nbytes = 3 * x.numel() * x.element_size()
        label = "x".join(map(str, shape))
        B, S, D = shape
        sg = ew.broadcast_3d(g, shape)
        variants = {}
        for per_program in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                def run(per_program=per_program, warps=warps):
                    out = torch.empty_like(x)
                    br, bd, _ = ew.tile(D, per_program=per_program)
                    grt._gate_residual_kernel[(triton.cdiv(B * S, br), triton.cdiv(D, bd))](
                        x, g, u, out, out, B * S, S, D, *x.stride(), *sg, *u.stride(), out.stride(0), out.stride(1), 0,
                        DTYPE=tl_dtype(x.dtype), P_DT=tl_dtype(promote(g.dtype, u.dtype)), BLOCK_R=br, BLOCK_D=bd,
                        num_warps=warps, enable_fp_fusion=False)
                    return out
                variants[f"{per_program}/prog {warps}w"] = run
        variants["compile"] = torch.compile(ref.gate_residual, dynamic=False)
        for name, fn in variants.items():
            fn_args = (x, g, u) if name == "compile" else ()
            got = fn(*fn_args)
            ok = compare_outputs(got, expected) is None
            ms = triton.testing.do_bench_cudagraph(lambda: fn(*fn_args), rep=60)
            pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs
            rows.append(dict(shape=label, variant=name, ms=round(ms, 4), pct_of_copy=round(pct, 1), bitwise=ok))
            print(f"{label:<16} {name:<18} {ms:8.4f} {pct:6.1f} {ok}", flush=True)
    write_rows("probe_gate_residual_tile_h200.csv", rows)


if __name__ == "__main__":
    main()
