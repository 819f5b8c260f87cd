"""GPU probe (one run): launch parameters of the channels-last WanRMS_norm + SiLU kernel
(``norm.wan_rms_norm_silu_pad``, the channels-last Wan decode's) at the Wan 2.1 decoder's shapes
(480x832, 17 frames: 4-frame chunks), every variant checked bitwise against the reference.

Variants: chain blocks per step (ksub 1/2/4), positions per program (BP), warps. Baseline rows:
the NCDHW kernel on the contiguous tensor (``norm.wan_rms_norm_silu``) and eager's chain.
Writes probe_wan_rms_cl_tiling.csv (OUT or --out) and prints the best launch per shape.

    PYTHONPATH=. python bench/probes/probe_wan_rms_cl_tiling.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.probes.common import write_csv  # noqa: E402
from ditfuse.kernels import reference as ref  # noqa: E402
from ditfuse.kernels.norm import wan_rms_norm_silu_triton as wk  # noqa: E402

SHAPES = [(1, 96, 4, 480, 832), (1, 192, 4, 240, 416), (1, 384, 2, 120, 208), (1, 384, 1, 60, 104)]
PAD = (1, 1, 1, 1, 2, 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton.testing

    rows = []
    for shape in SHAPES:
        C = shape[1]
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.3).to(torch.bfloat16)
        xc = x.contiguous(memory_format=torch.channels_last_3d)
        gam = (torch.randn(C, 1, 1, 1, device="cuda", generator=g) * 0.3 + 1).to(torch.bfloat16)
        pb = (torch.randn(C, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        exp = ref.wan_rms_norm_silu_pad(xc, gam, 0.0, True, True, PAD, pb)[0]
        mb = x.numel() * 2 * 2 / 1e6  # read + write, bf16
        t = triton.testing.do_bench(lambda: ref.wan_rms_norm_silu_pad(xc, gam, 0.0, True, True, PAD, pb),
                                    return_mode="median")
        rows.append(dict(shape="x".join(map(str, shape)), variant="eager", ksub="", bp="", warps="", ms=round(t, 4),
                         gbps=round(mb / t, 1), bitwise=True))
        xb = x + pb.reshape(1, -1, 1, 1, 1)
        t = triton.testing.do_bench(lambda: wk._launch(xb, gam, 0.0, True), return_mode="median")
        rows.append(dict(shape=rows[-1]["shape"], variant="ncdhw kernel (no pad)", ksub=1, bp="", warps=4,
                         ms=round(t, 4), gbps=round(mb / t, 1), bitwise=True))
        for ksub in (1, 2, 4):
            for bp in (16, 32, 64, 128):
                for nw in (2, 4, 8):
                    fn = lambda: wk._launch(xc, gam, 0.0, True, ncdhw=True, pad=PAD, pre_bias=pb,  # noqa: E731
                                            ksub=ksub, block_positions=bp, num_warps=nw)
                    try:
                        ok = torch.equal(fn().contiguous().view(torch.int16), exp.contiguous().view(torch.int16))
                        t = triton.testing.do_bench(fn, return_mode="median")
                    except Exception as e:  # noqa: BLE001 (a launch that does not compile is a data point)
                        print(f"  {shape} ksub={ksub} bp={bp} w={nw}: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    rows.append(dict(shape=rows[-1]["shape"], variant="cl pad", ksub=ksub, bp=bp, warps=nw,
                                     ms=round(t, 4), gbps=round(mb / t, 1), bitwise=ok))
        best = min((r for r in rows if r["shape"] == rows[-1]["shape"] and r["variant"] == "cl pad" and r["bitwise"]),
                   key=lambda r: r["ms"])
        base = [r for r in rows if r["shape"] == best["shape"] and r["variant"] != "cl pad"]
        cur = [r for r in rows if r["shape"] == best["shape"] and r["variant"] == "cl pad"
               and (r["ksub"], r["bp"], r["warps"]) == wk.CL_LAUNCH]
        print(f"{best['shape']}: " + ", ".join(f"{r['variant']} {r['ms']} ms" for r in base)
              + f"; current {wk.CL_LAUNCH} {cur[0]['ms'] if cur else '?'} ms; best ksub={best['ksub']} bp={best['bp']} "
              f"warps={best['warps']} {best['ms']} ms ({best['gbps']} GB/s); all bitwise: "
              f"{all(r['bitwise'] for r in rows if r['shape'] == best['shape'])}", flush=True)
    write_csv(args.out, "probe_wan_rms_cl_tiling.csv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
