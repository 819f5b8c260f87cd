"""``ditfuse bench vae``: VAE decode, eager vs ditfuse lossless vs torch.compile; median ms over
``--steps`` decodes, bitwise check against eager; CSV. Random bf16 weights.

``--model flux``: AutoencoderKL, the FLUX.1 VAE (16 latent channels, blocks 128/256/512/512) at
``--sizes`` 1024 and 2048 (square). ``--model flux2``: AutoencoderKLFlux2, the FLUX.2 / FLUX.3 VAE
as its class defaults declare it (32 latent channels, the same blocks), same sizes. ``--model
qwenimage``: AutoencoderKLQwenImage, Qwen-Image's VAE (the Wan 2.1 VAE's blocks at its defaults),
decoding 1024 images (one latent frame). ``--model wan22``: the Wan 2.2 TI2V-5B VAE (48 latent
channels, 16x spatial, residual up blocks) at 704x1280 with ``--frames``. ``--model wan``: AutoencoderKLWan, the Wan 2.1 VAE (base 96,
mults 1/2/4/4, two residual blocks per stage) at 480x832 with ``--frames`` 17 (5 latent frames).

    PYTHONPATH=. python3 bench/bench_vae.py [--model flux|flux2|qwenimage|wan|wan22] [--sizes 1024 2048 | 480x832]
        [--frames 17] [--no-compile] [--out PATH] [--breakdown PATH]
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def interleaved_ab(vae, dec, var: str, pairs: int, row: dict) -> list[dict]:
    """Eager once (the reference), then the lossless decode with ``var`` = 0 and 1 alternately on
    one accelerated VAE (the order flips every pair); rows with each setting's median and the
    median of the paired differences (B - A)."""
    import torch

    import ditfuse
    from ditfuse.kernels.compare import first_mismatch

    def one(value: str):
        os.environ[var] = value
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = dec()
        b.record()
        b.synchronize()
        return a.elapsed_time(b), out

    ref = dec()
    old = os.environ.get(var)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(vae)
    times: dict[str, list[float]] = {"0": [], "1": []}
    ok = {}
    try:
        for value in ("0", "1", "0", "1"):  # warm-ups: the gate verifies each new signature once
            ok[value] = first_mismatch(one(value)[1], ref) is None
        for i in range(pairs):
            for value in (("0", "1") if i % 2 == 0 else ("1", "0")):
                times[value].append(one(value)[0])
    finally:
        h.unmount()
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
    diffs = [b - a for a, b in zip(times["0"], times["1"])]
    out = []
    for value in ("0", "1"):
        med = statistics.median(times[value])
        out.append(dict(row, provider=f"lossless {var}={value}", median_ms=round(med, 2), bitwise_equal=ok[value]))
        print(f"[vae ab] {row['size']} B={row['batch']} {var}={value}: median {med:.2f} ms "
              f"(min {min(times[value]):.2f}, max {max(times[value]):.2f}) bitwise={ok[value]}", flush=True)
    print(f"[vae ab] {var}=1 minus {var}=0, median of {pairs} pairs: {statistics.median(diffs):+.2f} ms "
          f"(range {min(diffs):+.2f} .. {max(diffs):+.2f})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("flux", "flux2", "qwenimage", "wan", "wan22"), default="flux")
    p.add_argument("--sizes", nargs="+", default=None, help="HxW or a square size (default 1024 2048 / 480x832)")
    p.add_argument("--frames", type=int, default=17, help="wan: video frames (4k + 1)")
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-high", action="store_true", help="skip the quality=\"high\" provider")
    p.add_argument("--out", default="bench/results/vae_decode_h200.csv")
    p.add_argument("--ab", metavar="VAR", default=None,
                   help="only an interleaved A/B of the lossless decode with VAR=0 and VAR=1 on one accelerated "
                        "VAE: the two settings alternate decode by decode (so clock and power drift hit both "
                        "alike), --steps pairs; medians, the median paired difference, bitwise for both")
    p.add_argument("--breakdown", default=None,
                   help="also profile one decode per provider (eager, lossless, high) and write the kernel-time "
                        "categories (ms) here")
    args = p.parse_args(argv)

    import torch
    import triton
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLQwenImage, AutoencoderKLWan

    import ditfuse
    from ditfuse.kernels.compare import first_mismatch, relative_l2
    from tests.gpu.test_vae_gpu import FLUX_VAE, WAN22_VAE, WAN_VAE

    torch.manual_seed(0)
    if args.model == "flux":
        vae = AutoencoderKL(**FLUX_VAE).to("cuda", torch.bfloat16).eval()
        sizes = args.sizes or ["1024", "2048"]
    elif args.model == "flux2":
        vae = AutoencoderKLFlux2().to("cuda", torch.bfloat16).eval()
        sizes = args.sizes or ["1024", "2048"]
    elif args.model == "qwenimage":
        vae = AutoencoderKLQwenImage().to("cuda", torch.bfloat16).eval()
        sizes = args.sizes or ["1024"]
    elif args.model == "wan22":
        vae = AutoencoderKLWan(**WAN22_VAE).to("cuda", torch.bfloat16).eval()
        sizes = args.sizes or ["704x1280"]
    else:
        vae = AutoencoderKLWan(**WAN_VAE).to("cuda", torch.bfloat16).eval()
        sizes = args.sizes or ["480x832"]
    meta = dict(model=args.model, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, commit=os.environ.get("DITFUSE_COMMIT", "unknown"))
    rows = []

    breakdown: list[dict] = []

    def profiled(fn, label, **row):
        if args.breakdown:
            from bench.bench_step import profile_breakdown

            cats = profile_breakdown(fn, label)
            breakdown.append(dict(row, **{k: round(v, 2) for k, v in cats.items()}, **meta))

    def timed(fn):
        # Each provider starts from an empty allocator cache: round 27's H200 run timed the
        # providers in order with the earlier ones' cached blocks still held, and the GPU idle of
        # the Wan decode grew run by run (11.0, 21.2, 29.2 ms) with the same kernels.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        # two warm-ups: the Wan adapter's first decode records eager's layouts (NCDHW), the second
        # is the first channels-last one (the gate verifies each new convolution signature)
        fn()
        fn()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        ts = []
        from bench.bench_step import _gpu_clocks

        with _gpu_clocks().ClockSampler(torch.cuda.current_device()) as clocks:
            for _ in range(args.steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
        after = torch.cuda.memory_stats()
        # cudaMalloc / cudaFree inside the timed decodes (each may stall the stream); the clock
        # and power the decodes ran at (the same convolutions run slower at a power-capped clock)
        print("[vae]   timed decodes: " + ", ".join(
            f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in ("num_device_alloc", "num_device_free", "num_alloc_retries"))
            + f"; {_gpu_clocks().describe(clocks.summary)}" + (f" ({clocks.error})" if clocks.error else ""),
            flush=True)
        return statistics.median(ts), out

    for size in sizes:
        H, _, W = size.partition("x")
        H, W = int(H), int(W or H)
        video = args.model in ("wan", "wan22")
        label = f"{H}x{W}x{args.frames}f" if video else f"{H}x{W}"
        down = 16 if args.model == "wan22" else 8
        for batch in args.batches:
            lat = ((args.frames - 1) // 4 + 1, H // down, W // down) if video else (H // 8, W // 8)
            if args.model == "qwenimage":
                lat = (1, *lat)  # an image is one latent frame of the video VAE
            channels = vae.config.z_dim if args.model in ("wan", "wan22", "qwenimage") else vae.config.latent_channels
            z = torch.randn(batch, channels, *lat, device="cuda").to(torch.bfloat16)

            dec = lambda: vae.decode(z, return_dict=False)[0]  # noqa: E731
            if args.ab:
                with torch.no_grad():
                    rows += interleaved_ab(vae, dec, args.ab, args.steps, dict(size=label, batch=batch, **meta))
                del z
                continue
            with torch.no_grad():
                ms, ref = timed(dec)
                rows.append(dict(size=label, batch=batch, provider="eager", median_ms=round(ms, 2), bitwise_equal=True, **meta))
                print(f"[vae] {label} B={batch} eager {ms:.2f} ms", flush=True)
                profiled(dec, f"{label} B={batch} eager", size=label, batch=batch, provider="eager")
                ditfuse.gate.reset()
                h = ditfuse.accelerate(vae)
                try:
                    ms, out = timed(dec)
                    profiled(dec, f"{label} B={batch} lossless", size=label, batch=batch, provider="lossless")
                finally:
                    h.unmount()
                rep = ditfuse.gate.report()
                ok = first_mismatch(out, ref) is None
                rows.append(dict(size=label, batch=batch, provider="lossless", median_ms=round(ms, 2), bitwise_equal=ok, **meta))
                print(f"[vae] {label} B={batch} lossless {ms:.2f} ms bitwise={ok} disabled={list(rep.disabled)}", flush=True)
                def env_row(provider: str, var: str, value: str, profile: bool = False) -> None:
                    """The lossless decode again with ``var=value`` (an A/B on this machine), gate reset."""
                    os.environ[var] = value
                    ditfuse.gate.reset()
                    h = ditfuse.accelerate(vae)
                    try:
                        ms, out = timed(dec)
                        if profile:
                            profiled(dec, f"{label} B={batch} {provider}", size=label, batch=batch, provider=provider)
                    finally:
                        h.unmount()
                        os.environ.pop(var)
                    ok = first_mismatch(out, ref) is None
                    rows.append(dict(size=label, batch=batch, provider=provider, median_ms=round(ms, 2),
                                     bitwise_equal=ok, **meta))
                    print(f"[vae] {label} B={batch} {provider} {ms:.2f} ms bitwise={ok}", flush=True)

                if args.model in ("wan", "wan22", "qwenimage"):
                    # the same kernels on the NCDHW decode
                    env_row("lossless_ncdhw", "DITFUSE_WAN_VAE_CL", "0")
                    # the convolutions' bias in ditfuse's vectorized pass (off by default: round 21
                    # measured less GPU time and more host-bound idle on different machines)
                    env_row("lossless_bias_pass", "DITFUSE_CONV_BIAS_PASS", "1", profile=True)
                if not args.no_high:
                    h = ditfuse.accelerate(vae, quality="high")
                    hi = h.report().components[0].high
                    try:
                        if hi is None or not hi.ok:
                            print(f"[vae] {label} B={batch} high NOT mounted (runs lossless): "
                                  f"{hi.failed if hi is not None else 'no request-gated sites'}", flush=True)
                        ms, out = timed(dec)
                        profiled(dec, f"{label} B={batch} high", size=label, batch=batch, provider="high")
                    finally:
                        h.unmount()
                    rel = relative_l2(out, ref)
                    rows.append(dict(size=label, batch=batch, provider="high", median_ms=round(ms, 2),
                                     bitwise_equal=first_mismatch(out, ref) is None, **meta))
                    print(f"[vae] {label} B={batch} high {ms:.2f} ms (mounted on "
                          f"{len(hi.mounted) if hi is not None and hi.ok else 0} sites) rel={rel:.2e}", flush=True)
                if not args.no_compile:
                    t0 = time.time()
                    torch._dynamo.reset()
                    cdec = torch.compile(vae.decode)
                    ms, out = timed(lambda: cdec(z, return_dict=False)[0])
                    rows.append(dict(size=label, batch=batch, provider="compile", median_ms=round(ms, 2),
                                     bitwise_equal=first_mismatch(out, ref) is None, **meta))
                    print(f"[vae] {label} B={batch} compile {ms:.2f} ms ({time.time() - t0:.0f}s)", flush=True)
                    torch._dynamo.reset()
            del z, ref, out
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if breakdown:
        keys = list(dict.fromkeys(k for r in breakdown for k in r))
        with open(args.breakdown, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(breakdown)
        for r in breakdown:
            print(f"[vae] breakdown {r['size']} B={r['batch']} {r['provider']}: " + ", ".join(
                f"{k} {r[k]}" for k in ("gemm", "copies", "elementwise", "norms", "attention", "other", "gpu_busy") if k in r))
    for r in rows:
        print(f"{r['model']} {r['size']:>11} B={r['batch']} {r['provider']:<9} {r['median_ms']:>9.2f} ms  bitwise={r['bitwise_equal']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
