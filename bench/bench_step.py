"""``ditfuse bench <family>``: one transformer step, eager vs ditfuse vs torch.compile.

A real-size random-weight transformer of the family (``--config``, default ``dev``: FLUX.1-dev
size for flux, Wan2.1-1.3B size for wan; timings do not depend on the weights' values) at the
family's benchmark size (``--size``: 1024x1024 for flux, 832x480x81 for wan), batch 1 and 2.
Providers: diffusers eager, ditfuse lossless, ditfuse lossless + CUDA graph, torch.compile
(default mode, the whole transformer), ditfuse high; on request ``compile_regional`` (torch.compile
of each repeated block, as diffusers' ``compile_repeated_blocks``: one compilation per block class,
so it finishes in a phase's time where compiling a 38-60-block model may not). Median step time over ``--steps`` timed steps after warm-up, each
timed with CUDA events. Each ditfuse lossless provider's output is checked bitwise against eager
(column ``bitwise_equal``); high's and torch.compile's relative difference is reported instead. A
torch.profiler kernel-time breakdown (GEMM, attention, norms, elementwise, copies, other) of eager,
lossless and high is written too. Output: long-format CSV + breakdown CSV + PNG bar chart, named
``<family>_step_h200.*`` (``--tag`` to change the suffix).

    PYTHONPATH=. python3 bench/bench_step.py --family wan [--config ti2v-5b --size 1280x704x121]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

# Attention first: cuDNN/flash SDPA kernel names contain "wgmma"/"gemm" too. Our Triton kernels are
# named after what they do (rounds <= 7 filed _swiglu_kernel, _bias_residual_kernel, the GroupNorm
# kernels and the padded buffer's border launch under "other"; from round 8 they are elementwise,
# norms, copies).
CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient_attention")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "wgmma", "splitk")),
    ("copies", ("copy", "cat_", "catarray", "concat", "direct_copy", "memcpy", "memset", "_border_kernel",
                "_up2_cl_kernel")),
    ("norms", ("layer_norm", "layernorm", "rms", "welford", "norm", "_ln_")),
    ("elementwise", ("elementwise", "vectorized", "gelu", "rope", "scale_shift", "gate_residual", "triton", "mul", "add",
                     "swiglu", "bias_residual")),
)


# Our kernels whose names would match an earlier category's key ("cat_" in the activation + concat kernel)
# or none ("_gn_": the GroupNorm kernels; filed under "other" before round 8).
OWN = (("act_cat_kernel", "elementwise"), ("_gelu_tanh_cat_kernel", "elementwise"), ("_gn_", "norms"))


def categorize(name: str) -> str:
    n = name.lower()
    for key, cat in OWN:
        if key in n:
            return cat
    for cat, keys in CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def _commit() -> str:
    import os

    if os.environ.get("DITFUSE_COMMIT"):
        return os.environ["DITFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def time_steps(fn: Callable[[], Any], steps: int, warmup: int,
               host: list[float] | None = None, clocks: dict[str, float] | None = None) -> tuple[list[float], Any]:
    """Step times (ms, CUDA events, one synchronised step at a time). ``host``, if given, gets the
    host time of each step's call (until it returns, before the synchronisation: the enqueue
    cost; a step whose enqueue time reaches its step time is host-bound). ``clocks``, if given,
    gets what the SM clock and the board power did during the timed steps (bench/gpu_clocks.py:
    the same kernels run slower at the lower clock a power-capped step gets)."""
    import contextlib
    import time as _time

    import torch

    ClockSampler = _gpu_clocks().ClockSampler

    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times: list[float] = []
    sampler = ClockSampler(torch.cuda.current_device()) if clocks is not None else None
    before = torch.cuda.memory_stats()
    with sampler if sampler is not None else contextlib.nullcontext():
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = _time.perf_counter()
            out = fn()
            if host is not None:
                host.append((_time.perf_counter() - t0) * 1e3)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    if sampler is not None:
        clocks.update(sampler.summary)
        if sampler.error:
            print(f"[bench] no clock samples: {sampler.error}", flush=True)
    after = torch.cuda.memory_stats()
    # cudaMalloc / cudaFree inside the timed steps: each may stall the stream (a cudaFree waits for
    # the device), which a step's GPU idle would show but not explain
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
    if any(grew.values()):
        print("[bench] allocator calls in the timed steps: " + ", ".join(f"{k} +{v}" for k, v in grew.items()), flush=True)
    return times, out


def _gpu_clocks() -> Any:
    """bench/gpu_clocks.py, imported by path (this file runs as a script, through ``ditfuse bench``
    and imported by the tests)."""
    import importlib.util
    import sys

    if "gpu_clocks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_clocks", Path(__file__).with_name("gpu_clocks.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_clocks"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gpu_clocks"]


def clock_columns(clocks: dict[str, float]) -> dict[str, Any]:
    """The step CSV's clock columns (empty where nvidia-smi gave nothing)."""
    def r(k: str, nd: int = 0) -> Any:
        return round(clocks[k], nd) if k in clocks else ""
    return dict(sm_mhz=r("sm_mhz"), sm_mhz_min=r("sm_mhz_min"), power_w=r("power_w"),
                power_capped_pct=r("power_capped_pct"))


def sync_points(fn: Callable[[], Any]) -> str:
    """Run ``fn`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and say where the host
    waited for the GPU (``.item()``, a device-to-host copy, ``nonzero``...): "" when nowhere, else
    "N at file:line xK, ...". A step with a sync inside enqueues no further than that point: its
    host time then reaches its step time without being host-bound."""
    import collections
    import os as _os
    import warnings

    import torch

    where: collections.Counter = collections.Counter()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    for w in caught:
        # torch/cuda/__init__.py: torch's own CUDA calls around the run (the mode switch, its
        # first-use initialisation), not the step's; a sync inside the step names its caller
        if "synchroniz" in str(w.message) and not w.filename.replace("\\", "/").endswith("torch/cuda/__init__.py"):
            where[f"{_os.path.basename(w.filename)}:{w.lineno}"] += 1
    if not where:
        return ""
    return f"{sum(where.values())} at " + ", ".join(f"{k} x{v}" for k, v in where.most_common(6))


def _gpu_intervals(prof: Any) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, memcpy and memset in a finished profile."""
    import json
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")))
    return sorted(out)


def gpu_occupancy(intervals: list[tuple[float, float, str]]) -> dict[str, float]:
    """GPU busy time (union of kernel intervals), span and idle time in ms, plus the kernel count.

    idle = span - busy is the time the GPU waited between kernels: host launch cost when it is
    large and a CUDA graph removes it; ~0 for a GPU-bound step.
    """
    if not intervals:
        return {}
    busy = 0.0
    cur_s, cur_e = intervals[0][0], intervals[0][1]
    for s, e, _ in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in intervals) - intervals[0][0]
    return {"gpu_busy": busy / 1000.0, "gpu_span": span / 1000.0, "gpu_idle": (span - busy) / 1000.0,
            "kernels": float(len(intervals))}


def top_kernels(intervals: list[tuple[float, float, str]], n: int = 15) -> list[tuple[str, float, int]]:
    """The n kernels with the most total time: (name, total ms, calls)."""
    agg: dict[str, list[float]] = {}
    for s, e, name in intervals:
        a = agg.setdefault(name, [0.0, 0])
        a[0] += (e - s) / 1000.0
        a[1] += 1
    return sorted(((k, v[0], int(v[1])) for k, v in agg.items()), key=lambda t: -t[1])[:n]


def profile_breakdown(fn: Callable[[], Any], label: str = "") -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    for evt in prof.key_averages():
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "cuda_time_total", 0.0)
        if not dev_us:  # only CUDA activity is recorded: every row with device time is a kernel/memcpy
            continue
        cats[categorize(evt.key)] = cats.get(categorize(evt.key), 0.0) + dev_us / 1000.0
    try:
        intervals = _gpu_intervals(prof)
    except Exception as e:  # the breakdown stands without the trace; say why it is missing
        print(f"[bench] {label}: no kernel trace ({type(e).__name__}: {e})", flush=True)
        return cats
    occ = gpu_occupancy(intervals)
    print(f"[bench] {label}: GPU busy {occ.get('gpu_busy', 0):.2f} ms of a {occ.get('gpu_span', 0):.2f} ms span "
          f"(idle {occ.get('gpu_idle', 0):.2f} ms), {int(occ.get('kernels', 0))} kernels; top kernels:", flush=True)
    for name, ms, calls in top_kernels(intervals):
        print(f"    {ms:8.2f} ms {calls:6d}x  [{categorize(name)}] {name[:110]}", flush=True)
    cats.update(occ)
    return cats


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import triton

    import ditfuse
    from ditfuse.kernels.common import launch as fast_launch
    from ditfuse.kernels.compare import first_mismatch, relative_l2
    from ditfuse.models import families

    if not torch.cuda.is_available():
        raise SystemExit(f"ditfuse bench {args.family} needs a CUDA GPU")
    fam = families.get(args.family)
    size = args.size or fam.default_size
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=_commit())
    import diffusers

    meta["diffusers"] = diffusers.__version__
    layers = tuple(args.layers) if args.layers else None
    t0 = time.time()
    model = fam.build(args.config, layers, load=args.load)
    print(f"[bench] {fam.name} {args.config} model built in {time.time() - t0:.1f}s on {gpu} "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, load={args.load})", flush=True)
    rows: list[dict[str, Any]] = []
    breakdown: list[dict[str, Any]] = []
    providers = args.providers
    stem = f"{fam.name}{'' if args.config == 'dev' else '_' + args.config}_step_{args.tag}"
    csv_path = out_dir / f"{stem}.csv"

    def write_breakdown() -> None:
        if not breakdown:
            return
        cats = sorted({k for b in breakdown for k in b} - {"provider", "batch"})
        with (out_dir / f"{stem.replace('_step_', '_breakdown_')}.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["provider", "batch", *cats])
            w.writeheader()
            for b in breakdown:
                w.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in b.items()})

    for batch in args.batches:
        inp = fam.make_inputs(model, batch, size, **({} if args.txt_tokens is None else {"txt_tokens": args.txt_tokens}))
        # Z-Image returns a list of per-sample latents: stacked into one tensor to compare
        step = lambda: (lambda o: torch.stack(list(o)) if isinstance(o, (list, tuple)) else o)(model(**inp)[0])
        ehs = inp.get("encoder_hidden_states")
        txt = args.txt_tokens if args.txt_tokens is not None else (ehs.shape[1] if hasattr(ehs, "shape") else "")
        with torch.no_grad():
            host: list[float] = []
            clocks: dict[str, float] = {}
            times, ref_out = time_steps(step, args.steps, args.warmup, host, clocks)
            ref_out = ref_out.clone()

        def record(prov, times, bitwise, rel, host, clocks):
            rows.append(
                dict(model=f"{fam.name}-{args.config}", provider=prov, batch=batch, size=size,
                     txt_tokens=txt, median_ms=round(statistics.median(times), 3),
                     min_ms=round(min(times), 3), host_ms=round(statistics.median(host), 3),
                     steps=len(times), bitwise_equal=bitwise,
                     rel_diff_vs_eager=f"{rel:.3e}", **clock_columns(clocks), **meta)
            )
            # after every provider: a phase that runs out of time keeps what it measured
            with csv_path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)

        record("eager", times, True, 0.0, host, clocks)
        with torch.no_grad():
            syncs = sync_points(step)
        print(f"[bench] B={batch} eager {statistics.median(times):.2f} ms "
              f"(host enqueue {statistics.median(host):.1f} ms, {min(host):.1f}-{max(host):.1f}) "
              f"syncs={syncs or 0}; {_gpu_clocks().describe(clocks)}", flush=True)

        def measure(prov):
            handle = None
            fn = step
            saved_env = {k: os.environ.get(k) for k in _AB_ENV}
            for k, v in _AB_ENV.items():  # the A/B providers' switches (see PROVIDERS)
                if prov == v[0]:
                    os.environ[k] = v[1]
            if prov in ("lossless", "lossless_graph", "high", *(v[0] for v in _AB_ENV.values())):
                ditfuse.gate.reset()
                handle = ditfuse.accelerate(
                    model, quality="high" if prov == "high" else "lossless", cuda_graph=(prov == "lossless_graph")
                )
                if prov == "high":
                    hi = handle.report().components[0].high
                    if hi is None or not hi.ok:
                        print(f"[bench] B={batch} high NOT mounted (runs lossless): "
                              f"{hi.failed if hi is not None else 'no request-gated sites'}", flush=True)
                    else:
                        print(f"[bench] B={batch} high mounted on {len(hi.mounted)} sites", flush=True)
            elif prov == "compile":
                torch._dynamo.reset()
                cm = torch.compile(model)
                fn = lambda: (lambda o: torch.stack(list(o)) if isinstance(o, (list, tuple)) else o)(cm(**inp)[0])
            elif prov == "compile_regional":
                torch._dynamo.reset()
                regions = compile_regional(model)
                print(f"[bench] B={batch} compile_regional: torch.compile on {len(regions)} blocks "
                      f"({', '.join(sorted({type(m).__name__ for m in regions}))})", flush=True)
            try:
                t1 = time.time()
                launches0 = fast_launch.stats()
                with torch.no_grad():
                    host = []
                    clocks = {}
                    times, out = time_steps(fn, args.steps, args.warmup, host, clocks)
                    syncs = sync_points(fn) if prov not in COMPILED else "n/a"
                mm = first_mismatch(out, ref_out)
                rel = relative_l2(out, ref_out)
                record(prov, times, mm is None, rel, host, clocks)
                extra = ""
                if handle is not None:
                    rep = ditfuse.gate.report()
                    comp = handle.report().components[0]
                    ho, pt = comp.handoffs, comp.pos_tables
                    extra = (f" disabled={list(rep.disabled)} fallbacks={len(rep.fallbacks)} "
                             f"handoffs={ho.get('used', 0)}/{ho.get('links', 0)}x{len(times) + args.warmup + 1}")  # +1: sync_points' step
                    if any(pt.values()):
                        extra += f" rope_tables={pt['hits']}/{pt['hits'] + pt['misses'] + pt['uncached']}"
                    # kernels/common/launch.py: launches that took the cached launcher / Triton's
                    # JITFunction.run in this provider's steps (first sight and warm-up included)
                    launches = fast_launch.stats()
                    extra += (f" launches=fast {launches['fast'] - launches0['fast']}"
                              f"/triton {launches['slow'] - launches0['slow']}")
                print(f"[bench] B={batch} {prov} {statistics.median(times):.2f} ms "
                      f"(host enqueue {statistics.median(host):.1f} ms, {min(host):.1f}-{max(host):.1f}) "
                      f"syncs={syncs or 0} bitwise={mm is None} "
                      f"rel={rel:.2e} ({time.time() - t1:.0f}s){extra}; {_gpu_clocks().describe(clocks)}", flush=True)
            finally:
                for k, v in saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                if handle is not None:
                    handle.unmount()
                if prov == "compile":
                    del cm
                if prov == "compile_regional":
                    uncompile_regional(regions)
                if prov in COMPILED:
                    torch._dynamo.reset()

        for prov in providers:
            if prov != "eager" and prov not in COMPILED:
                measure(prov)
        # Profiles after the timed providers: a torch.profiler session leaves host-side overhead
        # behind that slowed the next host-bound measurement (FLUX B=1: 155.6 ms vs 129.5 ms for the
        # same lossless path); before torch.compile, whose compilation can run out the phase's time
        # (the FLUX.1 and SD3.5 breakdowns of round 14 were lost that way). The CUDA-graph provider
        # is profiled too: one replay's kernels, to compare with the plain lossless step's.
        if args.profile and batch in (args.profile_batches or args.batches[:1]):
            for prov in ["eager"] + [p for p in ("lossless", "lossless_graph", "high") if p in providers]:
                handle = None if prov == "eager" else ditfuse.accelerate(
                    model, quality="high" if prov == "high" else "lossless", cuda_graph=(prov == "lossless_graph"))
                try:
                    with torch.no_grad():
                        if prov == "lossless_graph":
                            step()  # first sight (verify), then the capture; profile_breakdown warms once more
                        breakdown.append({"provider": prov, "batch": batch,
                                          **profile_breakdown(step, f"{fam.name} B={batch} {prov}")})
                finally:
                    if handle is not None:
                        handle.unmount()
            write_breakdown()
        for prov in COMPILED:
            if prov in providers:
                measure(prov)
        torch.cuda.empty_cache()

    _plot(rows, out_dir / f"{stem}.png")
    print("\nprovider          batch  median ms  bitwise  rel diff   SM MHz  power W  capped %")
    for r in rows:
        print(f"{r['provider']:<17} {r['batch']:>5}  {r['median_ms']:>9.2f}  {str(r['bitwise_equal']):>7}  {r['rel_diff_vs_eager']}"
              f"  {r['sm_mhz']!s:>6}  {r['power_w']!s:>7}  {r['power_capped_pct']!s:>8}")
    for b in breakdown:
        print("breakdown", b["provider"], {k: round(v, 2) for k, v in b.items() if isinstance(v, float)})
    return rows


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib missing: no PNG")
        return
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(provs)
    for i, p in enumerate(provs):
        vals = [next((r["median_ms"] for r in rows if r["provider"] == p and r["batch"] == b), 0) for b in batches]
        bars = ax.bar([j + i * width for j in range(len(batches))], vals, width, label=p)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([j + width * (len(provs) - 1) / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"B={b}" for b in batches])
    ax.set_ylabel("median step time (ms)")
    ax.set_title(f"{rows[0]['model']} transformer step, {rows[0]['size']}, {rows[0]['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# A/B providers: lossless with one switch flipped, asked for by name (not in the defaults).
# lossless_nohandoff: DITFUSE_HANDOFF=0 (cross-block fusion off, models/handoff.py);
# lossless_linear_cat: DITFUSE_LINEAR_CAT=1 (the joint value's projections into one buffer);
# lossless_tritonlaunch: DITFUSE_FAST_LAUNCH=0 (every kernel through Triton's JITFunction.run,
# as before round 16: kernels/common/launch.py); lossless_gemm_gelu: DITFUSE_GEMM_GELU=1 (the
# FeedForward / MLP projection + tanh-GELU as one GEMM, kernels/linear/linear_gelu_triton.py).
_AB_ENV = {"DITFUSE_HANDOFF": ("lossless_nohandoff", "0"), "DITFUSE_LINEAR_CAT": ("lossless_linear_cat", "1"),
           "DITFUSE_FAST_LAUNCH": ("lossless_tritonlaunch", "0"), "DITFUSE_GEMM_GELU": ("lossless_gemm_gelu", "1")}
_AB_PROVIDERS = tuple(v[0] for v in _AB_ENV.values())
PROVIDERS = ["eager", "lossless", *_AB_PROVIDERS, "lossless_graph", "compile", "compile_regional", "high"]
DEFAULT_PROVIDERS = [p for p in PROVIDERS if p not in (*_AB_PROVIDERS, "compile_regional")]
# torch.compile providers: measured last (their compilation may run out a phase's time limit).
# compile: the whole transformer; compile_regional: each repeated block compiled on its own
# (compile_regional below; diffusers' compile_repeated_blocks does the same for models that name
# their blocks), one compilation shared by every block of a class: minutes less compile time.
COMPILED = ("compile", "compile_regional")


def repeated_blocks(model: Any) -> list[Any]:
    """The modules regional compilation compiles: those whose class the model names in diffusers'
    ``_repeated_blocks`` (FLUX.1, FLUX.2, Wan, Qwen-Image, Z-Image in 0.42.1), else the entries of
    every ``nn.ModuleList`` child that holds two or more modules of one class (SD3's
    ``transformer_blocks``: SD3Transformer2DModel names none)."""
    import torch

    names = set(getattr(model, "_repeated_blocks", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    out = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            counts: dict[type, int] = {}
            for m in child:
                counts[type(m)] = counts.get(type(m), 0) + 1
            out += [m for m in child if counts[type(m)] > 1]
    return out


def compile_regional(model: Any, **compile_kwargs: Any) -> list[Any]:
    """torch.compile each of :func:`repeated_blocks` (``nn.Module.compile``: the module's calls go
    through one compiled wrapper; dynamo compiles a block class once and reuses the code for every
    instance of it). Returns the compiled modules, for :func:`uncompile_regional`. Raises when the
    model has no repeated blocks."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__}: no repeated blocks to compile regionally")
    for m in blocks:
        m.compile(**compile_kwargs)
    return blocks


def uncompile_regional(blocks: list[Any]) -> None:
    """Undo :func:`compile_regional`: the modules call their own forward again."""
    for m in blocks:
        m._compiled_call_impl = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ditfuse.models import families

    p.add_argument("--family", default="flux", choices=families.names(), help="model family")
    p.add_argument("--config", default="dev", help="the family's transformer config (dev = its real size)")
    p.add_argument("--load", default="pretrained", choices=["pretrained", "plain"],
                   help="dtypes as from_pretrained(torch_dtype=bf16) leaves them, or all bf16")
    p.add_argument("--size", default=None, help="WxH (image) or WxHxFRAMES (video); default: the family's")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--txt-tokens", type=int, default=None,
                   help="text tokens (default: the family's: 512 for FLUX/FLUX.2, 333 for SD3, Wan's 512)")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="override block counts (flux: DUAL SINGLE; wan: BLOCKS)")
    p.add_argument("--providers", nargs="+", default=DEFAULT_PROVIDERS, choices=PROVIDERS)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--profile-batches", type=int, nargs="+", default=None,
                   help="batch sizes to profile (default: the first of --batches)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tag", default="h200", help="file name suffix")


def main(argv: list[str] | None = None) -> int:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ditfuse.runtime.cli import use_help_formatter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    use_help_formatter(p)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
