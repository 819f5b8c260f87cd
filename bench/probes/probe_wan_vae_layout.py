"""GPU probe (one run): where the AutoencoderKLWan decode's time goes, and which of its convolution
copies could go bit-exactly (issue 10).

A. profile of one eager and one lossless decode at 480x832x17: GPU busy, categories, top kernels
   (the "copies" category also holds cuDNN's own NCDHW <-> NDHWC transposes, if it runs any).
B. every distinct convolution the decoder runs (captured by hooks on F.conv2d/F.conv3d inputs during
   one decode): eager (contiguous NCDHW, F.pad'ed input) vs
     cl   the same input and weight in channels_last(_3d) memory format,
     pad  the unpadded input with the spatial zero padding given to the convolution instead,
   each checked bitwise against eager, timed (CUDA events, median), and the kernel names cuDNN ran.
   A variant that is bitwise equal at every shape and faster is a lossless candidate behind the
   gate's first-sight verification; one that is not is a quality="high" candidate at best.

    PYTHONPATH=. python bench/probes/probe_wan_vae_layout.py [--out DIR] [--frames 17]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.bench_step import profile_breakdown  # noqa: E402


def _time(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key[:90] for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--skip-profile", action="store_true")
    args = ap.parse_args()
    from diffusers import AutoencoderKLWan

    import ditfuse
    from tests.gpu.test_vae_gpu import WAN_VAE

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN_VAE).to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 16, (args.frames - 1) // 4 + 1, 60, 104, device="cuda").to(torch.bfloat16)
    dec = lambda: vae.decode(z, return_dict=False)[0]  # noqa: E731
    rep: dict = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                     cudnn=torch.backends.cudnn.version())
    with torch.no_grad():
        if not args.skip_profile:
            rep["A_eager"] = profile_breakdown(dec, "wan vae eager")
            h = ditfuse.accelerate(vae)
            try:
                rep["A_lossless"] = profile_breakdown(dec, "wan vae lossless")
            finally:
                h.unmount()
            print("A.", json.dumps({k: {c: round(v, 2) for c, v in rep[k].items()} for k in ("A_eager", "A_lossless")}))

        # B: capture conv calls
        seen: dict = {}
        orig3, orig2 = F.conv3d, F.conv2d

        def cap(kind, orig):
            def f(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
                key = (kind, tuple(x.shape), tuple(w.shape), str(stride), str(padding))
                if key not in seen:
                    seen[key] = dict(x=x.detach().clone(), w=w.detach(), b=None if b is None else b.detach(),
                                     stride=stride, padding=padding, n=0)
                seen[key]["n"] += 1
                return orig(x, w, b, stride, padding, dilation, groups)
            return f

        torch.nn.modules.conv.F.conv3d = cap("3d", orig3)
        torch.nn.modules.conv.F.conv2d = cap("2d", orig2)
        try:
            dec()
        finally:
            torch.nn.modules.conv.F.conv3d, torch.nn.modules.conv.F.conv2d = orig3, orig2
        rows = []
        for key, s in seen.items():
            kind = key[0]
            conv = orig3 if kind == "3d" else orig2
            cl = torch.channels_last_3d if kind == "3d" else torch.channels_last
            x, w, b = s["x"], s["w"], s["b"]
            ref = conv(x, w, b, s["stride"], s["padding"])
            row = dict(kind=kind, x=list(x.shape), w=list(w.shape), calls=s["n"], stride=str(s["stride"]),
                       eager_ms=round(_time(lambda: conv(x, w, b, s["stride"], s["padding"])), 4))
            xc, wc = x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)
            out = conv(xc, wc, b, s["stride"], s["padding"])
            row["cl_bitwise"] = bool(torch.equal(out.contiguous(), ref))
            row["cl_ms"] = round(_time(lambda: conv(xc, wc, b, s["stride"], s["padding"])), 4)
            # the spatial border given to cuDNN as padding instead of F.pad (only for 3x3 spatial kernels
            # whose input carries a 1-pixel zero border, as WanCausalConv3d / Conv2d(padding=1) build it)
            kh = w.shape[-2]
            if kh == 3 and s["padding"] in (0, (0, 0, 0), [0, 0, 0]) and kind == "3d":
                xi = x[..., 1:-1, 1:-1].contiguous()
                if bool((x[..., 0, :] == 0).all() and (x[..., -1, :] == 0).all()):
                    o2 = conv(xi, w, b, s["stride"], (0, 1, 1))
                    row["pad_bitwise"] = bool(torch.equal(o2, ref))
                    row["pad_ms"] = round(_time(lambda: conv(xi, w, b, s["stride"], (0, 1, 1))), 4)
                    xic = xi.contiguous(memory_format=cl)
                    o3 = conv(xic, wc, b, s["stride"], (0, 1, 1))
                    row["clpad_bitwise"] = bool(torch.equal(o3.contiguous(), ref))
                    row["clpad_ms"] = round(_time(lambda: conv(xic, wc, b, s["stride"], (0, 1, 1))), 4)
            row["eager_kernels"] = _kernels(lambda: conv(x, w, b, s["stride"], s["padding"]))
            row["cl_kernels"] = _kernels(lambda: conv(xc, wc, b, s["stride"], s["padding"]))
            rows.append(row)
            print("B.", json.dumps({k: v for k, v in row.items() if not k.endswith("kernels")}), flush=True)
            print("   eager:", row["eager_kernels"], "\n   cl:   ", row["cl_kernels"], flush=True)
        rep["B"] = rows
        tot = {k: sum(r.get(k, 0) * r["calls"] for r in rows) for k in ("eager_ms", "cl_ms")}
        print("B total (ms x calls):", {k: round(v, 2) for k, v in tot.items()})
    with open(os.path.join(args.out, "probe_wan_vae_layout.json"), "w") as f:
        json.dump(rep, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
