"""Probe: the warp-per-row row-norm kernels against the 128-thread ones, and the Wan FF
gate-residual tile, on the GPU.

The warp-per-row kernels (norm/layernorm_modulate_triton.py ``_ln_warp_kernel``,
rope/qk_rmsnorm_across_heads_rope_triton.py ``_rms_rope_warp_kernel``) run torch's 128 threads of
a row as four register sets of one warp: same arithmetic in the same order, so every variant must
be bitwise equal to the eager chain (checked for each before timing). Shapes: Wan2.1-1.3B video
[B, 32760, 1536] (B = 1, 2; fp32 modulation, FP32LayerNorm), FLUX.1 image [1, 4608, 3072] and large
[2, 32760, 5120] (bf16; at 5120 the plain warp kernel holds 10 steps, forced: the default there is
the runtime loop). ms: median of triton.testing.do_bench_cudagraph (GPU time only); % of copy from
the logical bytes over the device copy bandwidth. Also the layout guard's verdict on each warp
binary (common/warp.py) and the gate-residual tile sweep (32- and 64-bit addresses) against
torch.compile's kernel.

    PYTHONPATH=. OUT=/tmp/probe_out python3 bench/probes/probe_warp_rows.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_held_rows import ROWS, _nb, _r, copy_bandwidth, ln_cases, row, wan_qk_case, write_rows  # noqa: E402  (the round-6 probe's cases and timing)

from ditfuse.kernels import reference as ref
from ditfuse.kernels.common import warp as cw
from ditfuse.kernels.modulate import gate_residual_triton as grt
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

F32, BF = torch.float32, torch.bfloat16


def main() -> None:
    copy_gbs = copy_bandwidth()
    for (B, S, D), wan in [((1, 32760, 1536), True), ((2, 32760, 1536), True), ((1, 4608, 3072), False),
                           ((2, 32760, 5120), False)]:
        label = f"{B}x{S}x{D}"
        for name, args, eager, nbytes, nout in ln_cases(B, S, D, wan):
            expected = eager()
            case = f"{name} {label}"

            def launch(nout=nout, args=args, **kw):
                h, out = lnm._launch(*args[:9], True, **kw)
                return out if nout == 1 else (h, out)
            if D <= 3072:
                row(case, "128-thread held", lambda: launch(warp=False), expected, nbytes, copy_gbs)
            else:
                row(case, "128-thread loop", lambda: launch(unroll=False), expected, nbytes, copy_gbs)
            if D <= 3072 or nout == 1:  # gated at 5120 would hold 120 tiles: not worth compiling
                row(case, "warp per row", lambda: launch(warp=True), expected, nbytes, copy_gbs)
            torch.cuda.empty_cache()
    for B in (1, 2):
        case, (q, w, cos, sin, H), expected, nbytes = wan_qk_case(B)
        row(case, "128-thread held", lambda: wr._launch_one(q, w, cos, sin, H, 1e-6, True, warp=False), expected,
            nbytes, copy_gbs)
        row(case, "warp per row", lambda: wr._launch_one(q, w, cos, sin, H, 1e-6, True, warp=True), expected,
            nbytes, copy_gbs)
        torch.cuda.empty_cache()
    print("layout guard verdicts:", {k[:12]: v for k, v in cw._VERDICTS.items()}, flush=True)
    for k, v in cw._VERDICTS.items():
        ROWS.append(dict(case="layout guard", variant=k[:16], ms=0.0, pct_of_copy=0.0, bitwise=v is None))

    # Wan's FF gate residual (x.float() + ff.float() * gate_fp32).type_as(x): tiles vs compile
    B, S, D = 1, 32760, 1536
    x, u, g = _r((B, S, D), 2.0), _r((B, S, D), 2.0), _r((B, 1, D), 0.5, F32)
    expected = ref.gate_residual(x, g, u)
    case = f"wan ff gate residual {B}x{S}x{D}"
    new_tile = grt.tile
    try:
        for per_program in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                grt.tile = lambda d, per_program=8192, pp=per_program, nw=warps: (*new_tile(d, pp)[:2], nw)
                row(case, f"{per_program}/prog {warps}w", lambda: grt._launch(x, g, u), expected, 3 * _nb(x),
                    copy_gbs)
    finally:
        grt.tile = new_tile
    fits = grt.fits_int32
    grt.fits_int32 = lambda *a, **k: False
    try:
        row(case, "default tile, int64 addresses", lambda: grt._launch(x, g, u), expected, 3 * _nb(x), copy_gbs)
    finally:
        grt.fits_int32 = fits
    compiled = torch.compile(lambda a, b, c: (a.float() + b.float() * c).type_as(a))
    row(case, "torch.compile", lambda: compiled(x, u, g), ref.gate_residual(x, g, u), 3 * _nb(x), copy_gbs)

    write_rows("probe_warp_rows_h200.csv", ROWS)


if __name__ == "__main__":
    main()
