"""Latency and throughput of tiny-wan video jobs served on CPU: max video batch 1 vs 2.

Starts the real server (uvicorn on loopback, in this process, with a job store in a temporary data
dir) for each configuration and drives it with the ``openai`` async client: ``concurrency`` jobs
in flight, each ``videos.create_and_poll`` (polling every 50 ms) then ``download_content``.
Latency is client-side, create -> MP4 downloaded (queueing, denoising, VAE decode, H.264 encode,
SQLite, HTTP). jobs/s = jobs / wall time of the run. Prints a table and writes long-format CSV.

    .venv/bin/python bench/bench_videos_cpu.py [--jobs 4] [--size 832x480] [--frames 17] [--steps 8]
                                               [--threads 1] [--csv out.csv]

The preset has random weights (its videos are noise); this measures the serving path, not a model.
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
import tempfile
import threading
import time
import warnings

os.environ.pop("TRITON_INTERPRET", None)  # plain CPU: no fused kernels, no interpreter
warnings.filterwarnings("ignore", category=DeprecationWarning)  # client.videos.* (Sora's shutdown date)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def drive(url: str, jobs: int, concurrency: int, args) -> tuple[list[float], float]:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=1200) as client:
        return await _drive(client, jobs, concurrency, args)


async def _drive(client, jobs: int, concurrency: int, args) -> tuple[list[float], float]:
    sem = asyncio.Semaphore(concurrency)
    lat: list[float] = []

    async def one(i: int) -> None:
        async with sem:
            t = time.perf_counter()
            v = await client.videos.create_and_poll(
                prompt=f"bench {i}", size=args.size, poll_interval_ms=50,
                extra_body={"num_frames": args.frames, "steps": args.steps, "seed": i},
            )
            assert v.status == "completed", v
            (await client.videos.download_content(v.id)).read()
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(jobs)])
    return lat, time.perf_counter() - t0


def run_config(max_batch: int, pad: bool, concurrency: int, args) -> dict:
    import uvicorn

    from ditfuse.runtime.server import build_engine, create_app
    from ditfuse.runtime.videos import VideoJobs

    engine, _ = build_engine("tiny-wan", accelerate=True, max_video_batch_size=max_batch, batch_wait_ms=args.wait_ms,
                             pad_batches=pad)
    with tempfile.TemporaryDirectory() as data_dir:
        jobs = VideoJobs(engine, data_dir, sweep_interval_s=0)
        port = free_port()
        srv = uvicorn.Server(uvicorn.Config(create_app(engine, videos=jobs), host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        while not srv.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(drive(url, 1, 1, args))  # warm-up
        b0, v0 = engine.metrics.batches, engine.metrics.videos
        n = args.jobs if concurrency > 1 else max(2, args.jobs // 2)
        lat, wall = asyncio.run(drive(url, n, concurrency, args))
        batches = engine.metrics.batches - b0
        videos = engine.metrics.videos - v0
        srv.should_exit = True
        th.join()
    lat.sort()
    return {
        "max_video_batch": max_batch,
        "padded": pad,
        "concurrency": concurrency,
        "jobs": n,
        "latency_p50_s": round(statistics.median(lat), 2),
        "latency_max_s": round(lat[-1], 2),
        "jobs_per_s": round(videos / wall, 3),
        "mean_batch": round(videos / max(1, batches), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4, help="jobs per concurrent run (half that, >= 2, at concurrency 1)")
    ap.add_argument("--size", default="832x480")
    ap.add_argument("--frames", type=int, default=17)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--wait-ms", type=float, default=50.0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--configs", default="1p1,1pN,2p1,2n1,2pN",
                    help="max batch, p(added)/n(ot), concurrency (1 or N = --jobs)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for cfg in args.configs.split(","):
        mb, pad, conc = int(cfg[0]), cfg[1] == "p", (args.jobs if cfg[2:] == "N" else int(cfg[2:]))
        row = run_config(mb, pad, conc, args)
        rows.append(row)
        print(row, flush=True)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    header = (f"tiny-wan {args.size} x {args.frames} frames, {args.steps} steps (CFG), CPU {platform.processor() or platform.machine()} "
              f"x{os.cpu_count()}, torch {torch.__version__} threads {torch.get_num_threads()}, load avg {load}, commit {commit}")
    print("\n" + header)
    print(f"{'max_batch':>9} {'padded':>6} {'conc':>4} {'jobs':>4} {'p50 s':>7} {'max s':>7} {'jobs/s':>7} {'mean batch':>10}")
    for r in rows:
        print(f"{r['max_video_batch']:>9} {str(r['padded']):>6} {r['concurrency']:>4} {r['jobs']:>4} {r['latency_p50_s']:>7} "
              f"{r['latency_max_s']:>7} {r['jobs_per_s']:>7} {r['mean_batch']:>10}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["config", "metric", "value", "size", "frames", "steps", "torch", "threads", "load", "commit"])
            for r in rows:
                cfg = f"mb{r['max_video_batch']}-{'pad' if r['padded'] else 'nopad'}-c{r['concurrency']}"
                for k in ("latency_p50_s", "latency_max_s", "jobs_per_s", "mean_batch"):
                    w.writerow([cfg, k, r[k], args.size, args.frames, args.steps, torch.__version__, torch.get_num_threads(), load, commit])
    return 0


if __name__ == "__main__":
    sys.exit(main())
