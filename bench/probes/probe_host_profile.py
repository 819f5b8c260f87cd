"""GPU probe: where a family's step spends host (CPU) time, eager vs ditfuse lossless (and high).

For each provider: the host time to enqueue one step (wall time of the forward call with no
synchronisation inside; the GPU queue absorbs the kernels unless it fills), the synchronised
step time, and a cProfile of one step (top functions by own time and by cumulative time). A
step whose enqueue time exceeds its GPU time is host-bound: the GPU idles between kernels and
only a CUDA graph turns fused kernels into wall time.

    PYTHONPATH=. python3 bench/probes/probe_host_profile.py --family sd3 [--config dev] [--top 25]
        [--providers eager lossless high]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time


def main() -> None:
    import torch

    import ditfuse
    from ditfuse.models import families

    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="sd3")
    ap.add_argument("--config", default="dev")
    ap.add_argument("--size", default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--providers", nargs="+", default=["eager", "lossless", "lossless+reset"],
                    choices=["eager", "lossless", "lossless+reset", "high"],
                    help="high: quality='high' (its close ops), profiled like lossless")
    args = ap.parse_args()

    fam = families.get(args.family)
    model = fam.build(args.config, load="pretrained")
    inp = fam.make_inputs(model, 1, args.size or fam.default_size)

    def step():
        return model(**inp)[0]

    # "lossless+reset": the gate's verified signatures cleared before mounting, as ditfuse bench
    # does per provider (the SD3 bench measured 145.9 ms lossless where this probe saw 95.4)
    for prov in args.providers:
        if prov == "lossless+reset":
            ditfuse.gate.reset()
        handle = None
        if prov != "eager":
            handle = ditfuse.accelerate(model, quality="high" if prov == "high" else "lossless")
        try:
            with torch.no_grad():
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                enq, tot = [], []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    enq.append((t1 - t0) * 1e3)
                    tot.append((t2 - t0) * 1e3)
                pr = cProfile.Profile()
                pr.enable()
                step()
                torch.cuda.synchronize()
                pr.disable()
        finally:
            if handle is not None:
                handle.unmount()
        print(f"[host] {args.family} {prov}: enqueue {statistics.median(enq):.1f} ms, "
              f"step {statistics.median(tot):.1f} ms (median of {args.steps})", flush=True)
        for key in (("tottime", "cumulative") if prov in ("lossless", "high") else ()):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(args.top)
            lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
            start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls")), 0)
            print(f"[host] {prov} top {args.top} by {key}:")
            print("\n".join(lines[start:start + args.top + 1]), flush=True)


if __name__ == "__main__":
    main()
