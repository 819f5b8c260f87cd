"""Latency and throughput of the tiny-flux preset served on CPU: batch 1 vs batch 4.

Starts the real server (uvicorn on loopback, in this process) for each configuration and drives it
with the ``openai`` async client at a fixed concurrency. Prints a table and writes long-format CSV.

    .venv/bin/python bench/bench_serve_cpu.py [--requests 48] [--size 256x256] [--steps 8] [--csv out.csv]

The preset has random weights (images are noise); this measures the serving path (queueing,
batching, padding, PNG encoding, HTTP), not a real model.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

os.environ.pop("TRITON_INTERPRET", None)  # plain CPU: no fused kernels, no interpreter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def drive(url: str, n_requests: int, concurrency: int, size: str, steps: int) -> tuple[list[float], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            await client.images.generate(prompt=f"bench {i}", size=size, extra_body={"seed": i, "num_inference_steps": steps})
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(n_requests)])
    return lat, time.perf_counter() - t0


def run_config(max_batch: int, pad: bool, concurrency: int, args) -> dict:
    import uvicorn

    from ditfuse.runtime.server import build_engine, create_app

    engine, _ = build_engine("tiny-flux", accelerate=True, max_batch_size=max_batch, batch_wait_ms=args.wait_ms, pad_batches=pad)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(drive(url, max(4, concurrency), concurrency, args.size, args.steps))  # warm-up
    b0, i0 = engine.metrics.batches, engine.metrics.images
    lat, wall = asyncio.run(drive(url, args.requests, concurrency, args.size, args.steps))
    batches = engine.metrics.batches - b0
    images = engine.metrics.images - i0
    srv.should_exit = True
    th.join()
    lat.sort()
    return {
        "max_batch_size": max_batch,
        "padded": pad,
        "concurrency": concurrency,
        "requests": args.requests,
        "latency_p50_ms": round(statistics.median(lat) * 1000, 1),
        "latency_p90_ms": round(lat[int(0.9 * (len(lat) - 1))] * 1000, 1),
        "images_per_s": round(images / wall, 2),
        "mean_batch": round(images / max(1, batches), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--size", default="256x256")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--wait-ms", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    configs = [(1, True, 1), (1, True, 8), (4, True, 1), (4, False, 1), (4, True, 8)]
    rows = []
    for mb, pad, conc in configs:
        row = run_config(mb, pad, conc, args)
        rows.append(row)
        print(row, flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    header = f"tiny-flux {args.size} {args.steps} steps, CPU {platform.processor() or platform.machine()} x{os.cpu_count()}, torch {torch.__version__} threads {torch.get_num_threads()}, commit {commit}"
    print("\n" + header)
    print(f"{'max_batch':>9} {'padded':>6} {'conc':>4} {'p50 ms':>8} {'p90 ms':>8} {'img/s':>7} {'mean batch':>10}")
    for r in rows:
        print(f"{r['max_batch_size']:>9} {str(r['padded']):>6} {r['concurrency']:>4} {r['latency_p50_ms']:>8} {r['latency_p90_ms']:>8} {r['images_per_s']:>7} {r['mean_batch']:>10}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["config", "metric", "value", "size", "steps", "torch", "threads", "commit"])
            for r in rows:
                cfg = f"mb{r['max_batch_size']}-{'pad' if r['padded'] else 'nopad'}-c{r['concurrency']}"
                for k in ("latency_p50_ms", "latency_p90_ms", "images_per_s", "mean_batch"):
                    w.writerow([cfg, k, r[k], args.size, args.steps, torch.__version__, torch.get_num_threads(), commit])
    return 0


if __name__ == "__main__":
    sys.exit(main())
