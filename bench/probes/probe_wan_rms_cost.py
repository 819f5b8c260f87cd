"""GPU probe (one run): where the channels-last WanRMS_norm + SiLU kernel's time goes, at the Wan
2.1 decoder's shapes (480x832, 4-frame chunks). Times the production launch
(``norm.wan_rms_norm_silu_pad``) against the same kernel with parts of its arithmetic switched off
(close math instead of exact: no division by the norm, no intermediate roundings; no SiLU; no
pre-bias), the contiguous (NCDHW) kernel, and a plain copy of the same bytes. If the variants with
less arithmetic are much faster, the kernel is instruction-bound, not bandwidth-bound. Then the
position-major channels-last kernel (``variant="pos"``) over its launch parameters, each checked
bitwise against the production kernel's output.

    PYTHONPATH=. python bench/probes/probe_wan_rms_cost.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.probes.common import write_csv  # noqa: E402
from ditfuse.kernels.norm import wan_rms_norm_silu_triton as wk  # noqa: E402

SHAPES = [(1, 96, 4, 480, 832), (1, 192, 4, 240, 416), (1, 384, 2, 120, 208)]
PAD = (1, 1, 1, 1, 2, 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton.testing

    bench = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=50)  # noqa: E731
    rows = []
    for shape in SHAPES:
        C = shape[1]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.3).to(torch.bfloat16)
        xc = x.contiguous(memory_format=torch.channels_last_3d)
        gam = (torch.randn(C, 1, 1, 1, device="cuda", generator=g) * 0.3 + 1).to(torch.bfloat16)
        pb = (torch.randn(C, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        mb = x.numel() * 2 * 2 / 1e6
        variants = {
            "copy (clone)": lambda: xc.clone(memory_format=torch.channels_last_3d),
            "cl pad exact (production)": lambda: wk._launch(xc, gam, 0.0, True, ncdhw=True, pad=PAD, pre_bias=pb),
            "cl pad exact, no pre-bias": lambda: wk._launch(xc, gam, 0.0, True, ncdhw=True, pad=PAD),
            "cl pad exact, no silu": lambda: wk._launch(xc, gam, 0.0, False, ncdhw=True, pad=PAD, pre_bias=pb),
            "cl pad close math": lambda: wk._launch(xc, gam, 0.0, True, exact=False, ncdhw=True, pad=PAD, pre_bias=pb),
            "cl pad close math, no silu": lambda: wk._launch(xc, gam, 0.0, False, exact=False, ncdhw=True, pad=PAD,
                                                             pre_bias=pb),
            "cl no pad exact": lambda: wk._launch(xc, gam, 0.0, True, ncdhw=True),
            "ncdhw exact": lambda: wk._launch(x, gam, 0.0, True),
            "ncdhw close math": lambda: wk._launch(x, gam, 0.0, True, exact=False),
        }
        chain = wk._launch(xc, gam, 0.0, True, ncdhw=True, pad=PAD, pre_bias=pb, variant="chain")
        for bp in (64, 128, 256):
            for ck in (16, 32, 64):
                for nw in (4, 8):
                    variants[f"cl pad pos bp={bp} ck={ck} w={nw}"] = (
                        lambda bp=bp, ck=ck, nw=nw: wk._launch(xc, gam, 0.0, True, ncdhw=True, pad=PAD, pre_bias=pb,
                                                               variant="pos", pos_launch=(bp, ck, nw)))
        copy_ms = None
        for name, fn in variants.items():
            try:
                out = fn()
                if " pos " in name:  # bitwise against the production kernel
                    same = torch.equal(out.contiguous().view(torch.int16), chain.contiguous().view(torch.int16))
                    name += "" if same else " NOT BITWISE"
                ms = bench(fn)
            except Exception as e:  # noqa: BLE001 (a launch that does not compile is a data point)
                print(f"{name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            copy_ms = copy_ms or ms
            rows.append(dict(shape="x".join(map(str, shape)), variant=name, ms=round(ms, 4),
                             gbps=round(mb / ms, 1), pct_copy=round(100 * copy_ms / ms, 1)))
            print(f"{rows[-1]['shape']:>18} {name:<30} {ms:8.4f} ms {mb / ms:8.1f} GB/s {100 * copy_ms / ms:6.1f} % of copy",
                  flush=True)
    write_csv(args.out, "probe_wan_rms_cost.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
