"""GPU probe: SM clock and board power while a family's steps run back to back, eager vs
ditfuse lossless (issue 13: the same cuBLAS/cuDNN kernels run 5-12 % longer inside the lossless
FLUX step than inside the eager one; a power-limited clock would explain it). Round 14 added the
CUDA-graph replay of the lossless step.

bench/gpu_clocks.py samples ``nvidia-smi`` (SM clock, power, clock-event reasons: 0x4 SW power
cap, 0x20 SW thermal, 0x40 HW thermal, 0x80 HW power brake) every 50 ms while ``--steps`` steps run
without synchronisation between them; per provider it prints the step time (CUDA events over all
steps), the SM clock, the power and the share of samples with the power cap engaged.

``--gemm-duty`` (round 28) asks the causal question directly, without a model: FLUX.1's largest
GEMM (the dual block's image FF, 4096 x 3072 -> 12288 bf16 with bias) runs for ``--gemm-seconds``
back to back (after as long again to heat the GPU), then again with a spin kernel of a few µs between GEMMs (``torch.cuda._sleep``: a
single-warp kernel that draws little power). If the power cap sets the clock, the GEMM itself runs
faster when the GPU gets those low-power gaps; each GEMM is timed alone with CUDA events, so the
gaps are not in its time.

    PYTHONPATH=. python3 bench/probes/probe_clocks.py --family flux [--steps 20] [--gemm-duty]
    PYTHONPATH=. python3 bench/probes/probe_clocks.py --gemm-duty --no-steps --out $OUT

Providers, in order: eager, lossless, lossless_graph, eager again (drift check).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import statistics
import sys
from pathlib import Path


def _clocks():
    if "gpu_clocks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_clocks", Path(__file__).resolve().parents[1] / "gpu_clocks.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_clocks"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gpu_clocks"]


def steps(args: argparse.Namespace, rows: list[dict]) -> None:
    import torch

    import ditfuse
    from ditfuse.models import families

    gc = _clocks()
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
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with gc.ClockSampler(torch.cuda.current_device()) as cs:
                    a.record()
                    for _ in range(args.steps):
                        model(**inp)
                    b.record()
                    b.synchronize()
        finally:
            if h is not None:
                h.unmount()
        ms = a.elapsed_time(b) / args.steps
        print(f"[clocks] {args.family} {prov}: step {ms:.2f} ms; {gc.describe(cs.summary)}"
              + (f" ({cs.error})" if cs.error else ""), flush=True)
        rows.append(dict(experiment="steps", case=prov, ms=round(ms, 3), **{k: round(v, 1) for k, v in cs.summary.items()}))


def gemm_duty(args: argparse.Namespace, rows: list[dict]) -> None:
    import torch

    gc = _clocks()
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16)
    w = torch.randn(12288, 3072, device=dev, dtype=torch.bfloat16) * 0.02
    bias = torch.randn(12288, device=dev, dtype=torch.bfloat16) * 0.02
    out = torch.empty(4096, 12288, device=dev, dtype=torch.bfloat16)
    # Round 28's first run (H100) timed a fixed 400 GEMMs per case from a cool GPU: ~0.2 s, five
    # nvidia-smi samples, the first case's power cap seen in 40 % of them. Now the GPU is heated
    # back to back first and each case runs ~--gemm-seconds, so every case starts power-capped.
    for _ in range(int(args.gemm_seconds / 0.45e-3)):
        torch.addmm(bias, x, w.t(), out=out)
    torch.cuda.synchronize()
    # torch.cuda._sleep spins for a number of cycles: ~1.98 GHz on an H200 at full boost
    for gap_us in args.gaps_us:
        cycles = int(gap_us * 1980)
        reps = max(50, int(args.gemm_seconds / ((450 + gap_us) * 1e-6)))
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        total_a, total_b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with gc.ClockSampler(torch.cuda.current_device()) as cs:
            total_a.record()
            for a, b in ev:
                a.record()
                torch.addmm(bias, x, w.t(), out=out)
                b.record()
                if cycles:
                    torch.cuda._sleep(cycles)
            total_b.record()
            total_b.synchronize()
        per = [a.elapsed_time(b) for a, b in ev]
        med = statistics.median(per)
        span = total_a.elapsed_time(total_b)
        busy = 100.0 * sum(per) / span
        tflops = 2 * 4096 * 3072 * 12288 / (med * 1e-3) / 1e12
        print(f"[clocks] gemm 4096x3072->12288 gap {gap_us:>4} us: GEMM median {med:.4f} ms ({tflops:.0f} TFLOP/s), "
              f"GEMM share of the span {busy:.0f} %; {gc.describe(cs.summary)}" + (f" ({cs.error})" if cs.error else ""),
              flush=True)
        rows.append(dict(experiment="gemm_duty", case=f"gap_{gap_us}us", ms=round(med, 4), gemm_share_pct=round(busy, 1),
                         tflops=round(tflops, 1), **{k: round(v, 1) for k, v in cs.summary.items()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="flux")
    ap.add_argument("--config", default="dev")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-steps", dest="run_steps", action="store_false", help="skip the model steps")
    ap.add_argument("--gemm-duty", action="store_true", help="the GEMM with and without low-power gaps")
    ap.add_argument("--gaps-us", type=int, nargs="+", default=[0, 20, 60, 150, 400])
    ap.add_argument("--gemm-seconds", type=float, default=1.5, help="time per --gemm-duty case (and the heat-up)")
    ap.add_argument("--out", default=None, help="folder for probe_clocks_<card>.csv")
    args = ap.parse_args()
    rows: list[dict] = []
    if args.gemm_duty:
        gemm_duty(args, rows)
    if args.run_steps:
        steps(args, rows)
    if args.out and rows:
        import torch

        card = "h200" if "H200" in torch.cuda.get_device_name() else "h100"
        path = Path(args.out) / f"probe_clocks_{card}.csv"
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"[clocks] wrote {path}", flush=True)


if __name__ == "__main__":
    main()
