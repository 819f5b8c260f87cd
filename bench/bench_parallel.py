"""Context-parallel scaling: one transformer step on N GPUs vs 1, eager vs ditfuse lossless.

    # 1 GPU (no context parallelism) and 2 GPUs (Ulysses), FLUX.1-dev size at 1024x1024:
    python3 bench/bench_parallel.py --family flux --out out/parallel.csv
    torchrun --standalone --nproc-per-node 2 bench/bench_parallel.py --family flux --out out/parallel.csv
    # Wan2.1-1.3B size at 480x832x81 (32760 tokens), ring attention:
    torchrun --standalone --nproc-per-node 2 bench/bench_parallel.py --family wan --mode ring --out out/parallel.csv
    python3 bench/bench_parallel.py --summarize out/parallel.csv     # speed-up and scaling efficiency

Each run builds the family's real-size random-weight transformer (bf16) on every rank, enables
diffusers' context parallelism over all ranks when there is more than one (``--mode ulysses`` or
``ring``, attention backend ``--backend``), times eager diffusers, then mounts
``ditfuse.accelerate`` (lossless) and times again (median of ``--steps`` CUDA-event-timed steps
after warm-up, every rank in lockstep; rank 0's times are written), and checks the lossless output
bitwise against eager on every rank. Rank 0 appends one row per provider to ``--out`` (CSV).
Scaling efficiency = t(1 GPU) / (N · t(N GPUs)) for the same family, batch and provider.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1), set here before NCCL loads.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_step import _commit, time_steps  # noqa: E402

FIELDS = ["family", "config", "size", "batch", "world", "mode", "backend", "provider", "median_ms", "min_ms", "steps",
          "bitwise_equal", "gpu", "torch", "commit"]


def run(args: argparse.Namespace) -> list[dict]:
    import torch
    import torch.distributed as dist

    import ditfuse
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.models import families

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank = dist.get_rank() if world > 1 else 0
    fam = families.get(args.family)
    size = args.size or fam.default_size
    model = fam.build(args.config, device="cuda", dtype=torch.bfloat16, seed=0)
    if args.backend:
        model.set_attention_backend(args.backend)
    if world > 1:
        from diffusers import ContextParallelConfig

        cfg = ContextParallelConfig(ulysses_degree=world) if args.mode == "ulysses" else ContextParallelConfig(ring_degree=world)
        model.enable_parallelism(config=cfg)
    inputs = fam.make_inputs(model, batch=args.batch, size=size, seed=1, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.no_grad():
            return model(**inputs)[0]

    rows = []
    base = dict(family=args.family, config=args.config, size=size, batch=args.batch, world=world,
                mode=args.mode if world > 1 else "none", backend=args.backend or "default",
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=_commit())
    times, ref = time_steps(step, args.steps, args.warmup)
    rows.append(dict(base, provider="eager", median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
                     steps=args.steps, bitwise_equal=""))
    ditfuse.gate.reset()
    handle = ditfuse.accelerate(model)
    times, out = time_steps(step, args.steps, args.warmup)
    mm = compare_outputs(out, ref, "lossless vs eager")
    rep = ditfuse.gate.report()
    rows.append(dict(base, provider="lossless", median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
                     steps=args.steps, bitwise_equal=mm is None))
    print(f"[rank {rank}/{world}] {args.family} B={args.batch} eager {rows[0]['median_ms']} ms, lossless "
          f"{rows[1]['median_ms']} ms, bitwise={mm is None}{'' if mm is None else f' ({mm})'}, "
          f"disabled={sorted(rep.disabled)}, fallbacks={len(rep.fallbacks)}", flush=True)
    handle.unmount()
    if world > 1:
        # every rank's verdict, so rank 0's row says whether all ranks were bitwise equal
        flags = [None] * world
        dist.all_gather_object(flags, mm is None)
        rows[1]["bitwise_equal"] = all(flags)
        dist.barrier()
        dist.destroy_process_group()
    return rows if rank == 0 else []


def summarize(path: Path) -> list[dict]:
    """Speed-up and scaling efficiency of each N-GPU row against the 1-GPU row of the same
    family, config, size, batch and provider."""
    rows = list(csv.DictReader(path.open()))
    one = {(r["family"], r["config"], r["size"], r["batch"], r["provider"]): float(r["median_ms"])
           for r in rows if r["world"] == "1"}
    out = []
    for r in rows:
        key = (r["family"], r["config"], r["size"], r["batch"], r["provider"])
        n, t = int(r["world"]), float(r["median_ms"])
        t1 = one.get(key)
        out.append(dict(r, speedup="" if t1 is None else round(t1 / t, 3),
                        efficiency="" if t1 is None else round(t1 / (n * t), 3)))
    print(f"{'family':8} {'B':>2} {'GPUs':>4} {'mode':8} {'provider':9} {'ms':>9} {'speed-up':>8} {'eff.':>6} bitwise")
    for r in out:
        print(f"{r['family']:8} {r['batch']:>2} {r['world']:>4} {r['mode']:8} {r['provider']:9} {float(r['median_ms']):9.1f} "
              f"{str(r['speedup']):>8} {str(r['efficiency']):>6} {r['bitwise_equal']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["flux", "wan"], default="flux")
    p.add_argument("--config", default="dev")
    p.add_argument("--size", default=None, help="default: the family's benchmark size")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mode", choices=["ulysses", "ring"], default="ulysses")
    p.add_argument("--backend", default="_native_cudnn", help="attention backend ('' keeps the model's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("out/parallel.csv"))
    p.add_argument("--summarize", type=Path, default=None, help="print speed-up / efficiency of a CSV and exit")
    args = p.parse_args(argv)
    if args.summarize is not None:
        summarize(args.summarize)
        return 0
    rows = run(args)
    if rows:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        new = not args.out.exists()
        with args.out.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                w.writeheader()
            w.writerows(rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
