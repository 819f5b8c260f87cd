"""GPU probe (one run): the order of torch's CUDA ``vector_norm`` over the channel dim (what
F.normalize in diffusers' WanRMS_norm runs) and the fused Wan RMS_norm + SiLU end to end.

A. kernels eager launches for WanRMS_norm + SiLU (profiler), to confirm the 9-op chain.
B. norm order: for shapes covering each branch of setReduceConfig, the norm bits of
   ``sqrt(sumsq(x, H, vt0, fma))`` (tests/support/wan_rms_sim.py, exact fma on the GPU) vs
   ``torch.linalg.vector_norm(x, dim=1)``: the replica's H (default), H = 1, H = the block height
   always, vt0 = 1 / 2 / 8, no fma. Which column is all-equal tells what to change in
   ``reduce_layout`` / the kernel (notes/wan_vae.md).
C. the kernel vs eager at the Wan decoder shapes, and eager / ours time.

    PYTHONPATH=. python bench/probes/probe_wan_rms_order.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ditfuse.kernels import reference as ref  # noqa: E402
from ditfuse.kernels.norm import wan_rms_norm_silu_triton as wk  # noqa: E402
from tests.support import wan_rms_sim as ws  # noqa: E402

SHAPES = [(1, 384, 6240), (1, 384, 12480), (1, 96, 64), (2, 40, 63), (1, 256, 32), (1, 100, 4093),
          (3, 64, 6), (1, 192, 24960), (4, 17, 1000), (1, 128, 130), (1, 512, 2048), (1, 384, 15 * 16 + 2)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton
    import triton.testing

    rep: dict = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(0)
    # A
    try:
        from torch.profiler import ProfilerActivity, profile

        x = torch.randn(1, 384, 2, 60, 104, device="cuda", dtype=torch.bfloat16)
        g = torch.ones(384, 1, 1, 1, device="cuda", dtype=torch.bfloat16)
        ref.wan_rms_norm_silu(x, g)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ref.wan_rms_norm_silu(x, g)
            torch.cuda.synchronize()
        rep["A_kernels"] = [e.key for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]
    except Exception as e:  # noqa: BLE001
        rep["A_kernels"] = f"profiler failed: {type(e).__name__}: {e}"
    print("A.", json.dumps(rep["A_kernels"]))
    # B
    variants = {"replica": None, "H=1": 1, "H=bh": "bh", "vt0=1": ("vt0", 1), "vt0=2": ("vt0", 2),
                "vt0=8": ("vt0", 8), "nofma": ("nofma", None)}
    rows = {}
    for B, C, S in SHAPES:
        x = torch.randn(B, C, S, generator=gen, device="cuda") * torch.exp(torch.randn(B, 1, S, generator=gen, device="cuda"))
        exp = torch.linalg.vector_norm(x, dim=1)
        H, split, bh, _ = wk.reduce_layout(B, C, S)
        row = {"layout": f"H={H} split={split} bh={bh}"}
        for name, v in variants.items():
            kw = {}
            h = H
            if v == 1:
                h = 1
            elif v == "bh":
                h = bh
            elif isinstance(v, tuple) and v[0] == "vt0":
                kw["vt0"] = v[1]
            elif isinstance(v, tuple) and v[0] == "nofma":
                kw["use_fma"] = False
            got = torch.sqrt(ws.sumsq(x, h, **kw))
            row[name] = int((got.view(torch.int32) != exp.view(torch.int32)).sum())
        rows[f"{B}x{C}x{S}"] = row
        print(f"B. {B}x{C}x{S}: " + json.dumps(row))
    rep["B"] = rows
    # C
    res = {}
    for shape in [(1, 384, 1, 60, 104), (1, 384, 2, 60, 104), (1, 384, 4, 120, 208), (1, 192, 4, 240, 416),
                  (1, 96, 4, 480, 832), (1, 384, 60, 104)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(shape, generator=gen, device="cuda") * 2).to(dtype)
            g = (torch.randn(shape[1], *([1] * (len(shape) - 2)), generator=gen, device="cuda") * 0.3 + 1).to(dtype)
            e = ref.wan_rms_norm_silu(x, g)
            try:
                o = wk.wan_rms_norm_silu(x, g)
            except Exception as err:  # noqa: BLE001
                res[f"{list(shape)} {dtype}"] = dict(differ=-1, error=f"{type(err).__name__}: {err}")
                print("C.", f"{list(shape)} {dtype}", res[f"{list(shape)} {dtype}"])
                continue
            ity = torch.int16 if dtype != torch.float32 else torch.int32
            diff = int(((e.view(ity) != o.view(ity)) & ~(torch.isnan(e) & torch.isnan(o))).sum())
            te = triton.testing.do_bench(lambda: ref.wan_rms_norm_silu(x, g), return_mode="median")
            to = triton.testing.do_bench(lambda: wk.wan_rms_norm_silu(x, g), return_mode="median")
            tc = triton.testing.do_bench(lambda: wk.wan_rms_norm_silu_fp32(x, g), return_mode="median")
            res[f"{list(shape)} {dtype}"] = dict(differ=diff, eager_ms=round(te, 4), ours_ms=round(to, 4),
                                                  close_ms=round(tc, 4), GBps_ours=round(2 * x.numel() * x.element_size() / (max(to, 1e-9) * 1e-3) / 1e9, 1))
            print("C.", f"{list(shape)} {dtype}", json.dumps(res[f"{list(shape)} {dtype}"]))
    rep["C"] = res
    ok_b = all(r["replica"] == 0 for r in rows.values())
    ok_c = all(r["differ"] == 0 for r in res.values())  # -1 (an error) counts as a failure
    rep["verdict"] = [
        "B: replica order matches vector_norm" if ok_b else
        "B: replica order DIFFERS; columns all-zero: " + str([n for n in variants if all(r[n] == 0 for r in rows.values())]),
        "C: Wan shapes bitwise equal" if ok_c else "C: Wan shapes DIFFER",
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_wan_rms.json"), "w") as fh:
        json.dump(rep, fh, indent=1)
    print("VERDICT:", *rep["verdict"], sep="\n  ")
    return 0 if ok_b and ok_c else 1


if __name__ == "__main__":
    sys.exit(main())
