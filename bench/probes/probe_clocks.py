"""GPU probe: SM clock and board power while a family's steps run back to back, eager vs
ditfuse lossless (issue 13: the same cuBLAS/cuDNN kernels run 5-11 % longer inside the lossless
FLUX step than inside the eager one; a power-limited clock would explain it). Round 14 added the
CUDA-graph replay of the lossless step: on an H100 graphs ran slower than the plain lossless step
for FLUX.2 and Qwen-Image, and SD3.5's graph step did not move when copy kernels went away.

A thread samples ``nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_event_reasons.active``
every ~50 ms while ``--steps`` steps run without synchronisation between them; per provider it
prints the step time (CUDA events over all steps) and the median / min SM clock, median power
and the throttle-reason bitmask seen most often (0x4 SW power cap, 0x20 SW thermal, 0x40 HW
thermal, 0x80 HW power brake; 0x1 idle).

    PYTHONPATH=. python3 bench/probes/probe_clocks.py --family flux [--steps 20]

Providers, in order: eager, lossless, lossless_graph, eager again (drift check).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import threading
import time


def _sampler(stop: threading.Event, out: list) -> None:
    q = "clocks.sm,power.draw,clocks_event_reasons.active"
    while not stop.is_set():
        try:
            r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", "0"],
                               capture_output=True, text=True, timeout=5)
            f = [x.strip() for x in r.stdout.strip().split(",")]
            out.append((float(f[0]), float(f[1]), f[2]))
        except Exception as e:  # keep sampling; say once what failed
            if not out or out[-1] != ("error", str(e)):
                out.append(("error", str(e)))
        time.sleep(0.05)


def main() -> None:
    import torch

    import ditfuse
    from ditfuse.models import families

    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="flux")
    ap.add_argument("--config", default="dev")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    fam = families.get(args.family)
    model = fam.build(args.config, load="pretrained")
    inp = fam.make_inputs(model, 1, fam.default_size)
    for prov in ("eager", "lossless", "lossless_graph", "eager"):
        # lossless_graph: the same step replayed from a CUDA graph (no host gaps between kernels)
        h = ditfuse.accelerate(model, cuda_graph=(prov == "lossless_graph")) if prov != "eager" else None
        try:
            with torch.no_grad():
                for _ in range(3):
                    model(**inp)
                torch.cuda.synchronize()
                samples: list = []
                stop = threading.Event()
                t = threading.Thread(target=_sampler, args=(stop, samples), daemon=True)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t.start()
                time.sleep(0.2)
                a.record()
                for _ in range(args.steps):
                    model(**inp)
                b.record()
                b.synchronize()
                stop.set()
                t.join()
        finally:
            if h is not None:
                h.unmount()
        ok = [s for s in samples if s[0] != "error"]
        errs = [s for s in samples if s[0] == "error"]
        if not ok:
            print(f"[clocks] {prov}: no samples ({errs[:1]})", flush=True)
            continue
        clk = [s[0] for s in ok]
        pw = [s[1] for s in ok]
        reasons = collections.Counter(s[2] for s in ok).most_common(3)
        print(f"[clocks] {args.family} {prov}: step {a.elapsed_time(b) / args.steps:.2f} ms; SM clock median "
              f"{statistics.median(clk):.0f} MHz (min {min(clk):.0f}, max {max(clk):.0f}); power median "
              f"{statistics.median(pw):.0f} W (max {max(pw):.0f}); reasons {reasons}; {len(ok)} samples",
              flush=True)


if __name__ == "__main__":
    main()
