"""GPU probe: the runtime-loop LayerNorm kernel (rows wider than the held ones, D > 3072) with and
without the next step's prefetch (``PREFETCH``, DITFUSE_LN_PREFETCH), x rows per program.

Issue 13 asks the gated residual + LayerNorm + modulate at [2, 32760, 5120] for >= 85 % of copy
bandwidth and never slower than torch.compile; round 20 (H100) measured 81.5 % against compile's
82.7 %. The loop kernel issues one dependent load per step and waits for it; the prefetch keeps
step j + 1's load in flight during step j's arithmetic (two tiles live, +10-13 registers, no
spills: tests/support/layernorm_codegen.py ``lnpf``). Same element order, same bits: every
variant is checked bitwise against the eager chain before it is timed.
Shapes: FLUX.1's large [2, 32760, 5120] (the issue's), Wan2.1-14B [1, 32760, 5120] (fp32
modulation, FP32LayerNorm), FLUX.2-dev [1, 4608, 6144], LTX-Video 13B [2, 6144, 4096]; then
Wan2.1-14B's QK RMSNorm + RoPE loop at [1, 32760, 5120] x rows per program (not yet changed).

    PYTHONPATH=. OUT=/tmp/probe_out python3 bench/probes/probe_ln_prefetch.py
"""

from __future__ import annotations

import torch

from bench.probes.probe_held_rows import ROWS, copy_bandwidth, ln_cases, row, wan_qk_case, write_rows
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

SHAPES = [((2, 32760, 5120), False), ((1, 32760, 5120), True), ((1, 4608, 6144), False), ((2, 6144, 4096), False)]


def main() -> None:
    copy_gbs = copy_bandwidth()
    for (B, S, D), wan in SHAPES:
        label = f"{B}x{S}x{D}{' wan' if wan else ''}"
        for name, args, eager, nbytes, nout in ln_cases(B, S, D, wan):
            expected = eager()
            case = f"{name} {label}"

            def launch(R, prefetch, args=args, nout=nout):
                h, out = lnm._launch(*args[:9], True, rows_per_program=R, unroll=False, warp=False, prefetch=prefetch)
                return out if nout == 1 else (h, out)
            for R in (None, 1, 2, 4):
                for pf in (False, True):
                    row(case, f"loop R={R or 'default'}{' prefetch' if pf else ''}",
                        lambda R=R, pf=pf: launch(R, pf), expected, nbytes, copy_gbs)
            row(case, "production default", lambda args=args, nout=nout: (
                lambda r: r[1] if nout == 1 else r)(lnm._launch(*args[:9], True)), expected, nbytes, copy_gbs)
            expected = None
            torch.cuda.empty_cache()
    # Wan2.1-14B's q RMSNorm (40 heads) + RoPE: the same runtime loop (10 steps) in the RoPE kernel,
    # R = 4 by default (common/host.py rows_per_program); round 22 changed only the LayerNorm's.
    case, (q, w, cos, sin, H), expected, nbytes = wan_qk_case(1, 32760, 5120, 40)
    for R in (None, 1, 2, 4):
        row(case, f"loop R={R or 'default'}", lambda R=R: wr._launch_one(q, w, cos, sin, H, 1e-6, True,
                                                                        rows_per_program=R, unroll=False),
            expected, nbytes, copy_gbs)
    write_rows("probe_ln_prefetch.csv", ROWS)


if __name__ == "__main__":
    main()
