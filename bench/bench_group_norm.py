"""GroupNorm (+ SiLU) benchmark at the AutoencoderKL 1024x1024 decoder shapes: eager vs
torch.compile vs ours (exact and close), one run per GPU.

- shapes: every GroupNorm input of the FLUX/SD3 VAE decoder at 1024x1024 ([B, C, H, W] with
  (C, H) in (512, 128), (512, 256), (512, 512), (256, 512), (256, 1024), (128, 1024)), batch 1
  and 2, 32 groups, eps 1e-6, bf16 by default (``--dtypes``);
- ops: ``gn_silu`` (nn.GroupNorm -> nn.SiLU, the ResnetBlock2D / conv_norm_out chain) and ``gn``
  (GroupNorm alone, the mid-block attention's, at the 128x128 shape only);
- providers: ``eager`` (ditfuse.kernels.reference), ``compile`` (torch.compile of the same chain,
  dynamic=False), ``ours`` (bit-exact), ``ours-close`` (quality="high"), and the two exact kernels
  alone: ``ours:stats`` (the Welford-chain kernel) and ``ours:apply`` (fold + epilogue + SiLU);
- ``ms``: median of triton.testing.do_bench (L2 flushed before every call);
- ``GB/s``: the op's logical traffic, x read once and the output written once (2 x size; the
  stats kernel alone is credited 1 x size, what it reads), ``pct_of_copy``: over the measured
  device copy bandwidth (``dst.copy_(src)`` of 1 GiB, read + write); ``bytes_moved_GB/s`` also
  counts the exact path's second read of x (3 x size for the whole op);
- ``bitwise_equal``: vs eager (integer views), checked before timing.

Writes long-format CSV to --out and prints a table.

    python bench/bench_group_norm.py --out bench/results/group_norm_h200.csv [--dtypes bf16,fp16]
                                     [--batches 1,2] [--no-compile] [--chain-steps 16,32,64]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ditfuse.kernels import reference as ref  # noqa: E402
from ditfuse.kernels.compare import compare_outputs  # noqa: E402
from ditfuse.kernels.norm import group_norm_silu_triton as gn  # noqa: E402

DECODER = [(512, 128), (512, 256), (512, 512), (256, 512), (256, 1024), (128, 1024)]
G = 32
EPS = 1e-6
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def copy_bandwidth_gbs() -> float:
    import triton.testing

    n = 1 << 29
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def _split_launchers(x, w, b, silu, chain_steps, fast_div=False):
    """The two exact kernels as separate callables (same workspace), for per-kernel timing."""
    import triton

    N, C = x.shape[:2]
    HxW = x[0, 0].numel()
    L = (C // G) * HxW
    NG = N * G
    threads = gn._threads(L)
    W = threads // gn.LANES
    J = triton.cdiv(L, threads)
    K = min(chain_steps or gn.CHAIN_STEPS, triton.next_power_of_2(J))
    ws = torch.empty((3, NG * W), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    v = dict(gn.DEFAULT_VARIANT, FAST_DIV=fast_div)
    block, iters, per_group, uniform, warps = gn._apply_tiling(NG, L, HxW)

    def stats():
        gn._gn_chain_kernel[(NG, W)](x, ws, L, triton.cdiv(J, K), NG * W, THREADS=threads, K=K,
                                     **{k: v[k] for k in gn.CHAIN_VARIANTS}, num_warps=1, enable_fp_fusion=False)

    def apply():
        gn._gn_apply_kernel[(NG, per_group)](
            x, w, b, ws, out, L, HxW, C // G, G, NG * W, W, iters, gn._eps_for_kernel(x.dtype, EPS),
            DTYPE=gn._DTYPES[x.dtype], BLOCK=block, W=W, EXACT=True, HAS_W=True, HAS_B=True, ONE_D=False,
            CH_UNIFORM=uniform, SILU=silu, **{k: v[k] for k in gn.APPLY_VARIANTS},
            num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False)

    return stats, apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/group_norm_h200.csv")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--chain-steps", default="", help="extra K values to time for ours:stats, e.g. 16,64")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    import triton
    import triton.testing

    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
        except Exception:
            commit = "unknown"
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, commit=commit)
    copy_gbs = copy_bandwidth_gbs()
    print(f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {commit}; "
          f"copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    fields = ["op", "provider", "shape", "dtype", "ms", "GB/s", "pct_of_copy", "bytes_moved_GB/s", "bitwise_equal",
              "gpu", "torch", "triton", "commit"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fh = open(args.out, "w", newline="")
    writer = csv.DictWriter(fh, fieldnames=fields)
    writer.writeheader()
    t0 = time.time()
    rows = []

    def emit(**row):
        row.update(meta)
        rows.append(row)
        writer.writerow(row)
        fh.flush()
        print(f"{row['op']:<8} {row['shape']:<18} {row['dtype']:<5} {row['provider']:<14} {row['ms']:>9.4f} "
              f"{row['GB/s']:>7.0f} {row['pct_of_copy']:>6.1f} {row['bitwise_equal']}  [{time.time() - t0:.0f}s]",
              flush=True)

    emit(op="copy", provider="torch.copy_", shape="1GiB", dtype="bf16", ms=float("nan"),
         **{"GB/s": round(copy_gbs, 1), "bytes_moved_GB/s": round(copy_gbs, 1)}, pct_of_copy=100.0, bitwise_equal="")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dname in [d for d in args.dtypes.split(",") if d]:
        dtype = DT[dname]
        for B in [int(b) for b in args.batches.split(",") if b]:
            for C, H in DECODER:
                x = (torch.randn((B, C, H, H), generator=gen, device="cuda") * 2 + 0.3).to(dtype)
                w = (torch.randn(C, generator=gen, device="cuda") * 0.3 + 1).to(dtype)
                b = (torch.randn(C, generator=gen, device="cuda") * 0.2).to(dtype)
                size = x.numel() * x.element_size()
                label = f"{B}x{C}x{H}x{H}"
                ops = [("gn_silu", True)] + ([("gn", False)] if (C, H) == (512, 128) else [])
                for op, silu in ops:
                    eager = (lambda s: lambda: ref.group_norm_silu(x, G, w, b, EPS, s))(silu)
                    providers = {"eager": eager}
                    if not args.no_compile:
                        cfn = torch.compile(lambda a, c, d, s=silu: ref.group_norm_silu(a, G, c, d, EPS, s), dynamic=False)
                        providers["compile"] = (lambda f: lambda: f(x, w, b))(cfn)
                    providers["ours"] = (lambda s: lambda: gn.group_norm_silu(x, G, w, b, EPS, s))(silu)
                    providers["ours-fastdiv"] = (lambda s: lambda: gn._launch(x, G, w, b, EPS, s,
                                                                              variant=dict(FAST_DIV=True)))(silu)
                    providers["ours-close"] = (lambda s: lambda: gn.group_norm_silu_fp32(x, G, w, b, EPS, s))(silu)
                    expected = eager()
                    for pname, fn in providers.items():
                        try:
                            got = fn()
                            torch.cuda.synchronize()
                        except Exception as e:  # noqa: BLE001
                            print(f"# skip {op} {label} [{pname}]: {type(e).__name__}: {e}")
                            continue
                        eq = compare_outputs(got, expected) is None
                        del got
                        ms = triton.testing.do_bench(fn, return_mode="median")
                        gbs = 2 * size / (ms * 1e-3) / 1e9
                        moved = (3 if pname == "ours" else 2) * size / (ms * 1e-3) / 1e9
                        emit(op=op, provider=pname, shape=label, dtype=dname, ms=round(ms, 4),
                             **{"GB/s": round(gbs, 1), "bytes_moved_GB/s": round(moved, 1)},
                             pct_of_copy=round(100 * gbs / copy_gbs, 1), bitwise_equal=eq)
                    steps = [None] + [int(k) for k in args.chain_steps.split(",") if k]
                    for fast in (False, True):
                        for K in steps:
                            stats, apply = _split_launchers(x, w, b, silu, K, fast)
                            stats()
                            apply()
                            for pname, fn, nbytes in (("ours:stats", stats, size), ("ours:apply", apply, 2 * size)):
                                if (K is not None or fast) and pname == "ours:apply":
                                    continue
                                ms = triton.testing.do_bench(fn, return_mode="median")
                                gbs = nbytes / (ms * 1e-3) / 1e9
                                tag = ("(fast)" if fast else "") + (f"(K={K})" if K else "")
                                emit(op=op, provider=pname + tag, shape=label, dtype=dname,
                                     ms=round(ms, 4), **{"GB/s": round(gbs, 1), "bytes_moved_GB/s": round(gbs, 1)},
                                     pct_of_copy=round(100 * gbs / copy_gbs, 1), bitwise_equal="")
                    del expected, providers
                del x
                torch.cuda.empty_cache()
    fh.close()
    # decoder totals: the sum over one decode's GroupNorm calls is in the model benchmark; here a
    # per-shape summary of ours vs eager
    print(f"# wrote {args.out} ({len(rows)} rows) in {time.time() - t0:.0f}s")
    by = {}
    for r in rows:
        by.setdefault((r["op"], r["shape"], r["dtype"]), {})[r["provider"]] = r["ms"]
    print(f"{'op':<8} {'shape':<18} {'dtype':<5} {'eager':>9} {'compile':>9} {'ours':>9} {'close':>9} {'speedup':>8}")
    for (op, shape, dt), d in by.items():
        if op == "copy":
            continue
        e, o = d.get("eager", float("nan")), d.get("ours", float("nan"))
        print(f"{op:<8} {shape:<18} {dt:<5} {e:>9.4f} {d.get('compile', float('nan')):>9.4f} {o:>9.4f} "
              f"{d.get('ours-close', float('nan')):>9.4f} {e / o:>8.1f}")


if __name__ == "__main__":
    main()
