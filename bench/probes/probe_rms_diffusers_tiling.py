"""GPU probe: which launch of the bit-exact diffusers-RMSNorm kernel (Z-Image's Z1 / Z6 / Z3+Z4,
ditfuse.kernels.norm.rms_norm_diffusers_triton) is fastest at Z-Image's shapes. Measured before:
12.65 ms for 102 calls per step, ~124 us per call at ~4608 rows x 3840 (floor ~25-40 us).

Sweep, per shape (D 3840 bf16, rows B*S: B 1/2 x S 4608/4096/512) and MODE 0/1/2:

- ``block_rows`` 1..32 x ``num_warps`` 1..8 (x ``readback`` False/True for MODE 2: the last pass
  re-reads the stored h instead of recomputing it from update/residual/gate), keeping tiles of
  4..64 fp32 elements per thread per chunk (BR * CW / (32 * warps); CW = 128 columns here): fewer
  leaves threads with replicated or idle lanes, more spills (an sm_90a AOT compile of the default
  build: MODE 2 already uses 255 registers and spills at 16 elements per thread);
- two builds of the same kernel body: ``asis`` (the module's kernel: ``D`` is in
  ``do_not_specialize``) and ``dspec`` (``D`` specialized like any int argument, i.e. known to be
  a multiple of 16). The sm_90a PTX of ``asis`` has only 2-byte accesses (ld/st.global.b16: the
  mask ``cols < D`` and the row offset ``rows * D`` have unknown divisibility, so nothing
  vectorizes); ``dspec`` gets 16-byte ld/st.global.v4.b32 and 96 instead of 255 registers (MODE
  2). Neither touches the arithmetic: each row's order is fixed by the chunk loop.

Every launch's outputs are checked bitwise against the default launch (``_launch`` with no
tiling arguments); the default launch once against the eager reference chain
(ditfuse.kernels.reference) on CUDA. Timing: triton.testing.do_bench median (L2 flushed) of the
bare kernel launch with pre-bound arguments (``_launch``'s host-side preparation excluded), and
of the eager chain. GB/s counts the minimal traffic (each input read once, outputs written once;
gate/scale as [B, D], weights [D]); ``pct_copy`` is that against ``dst.copy_(src)`` of one
[rows, D] bf16 tensor measured the same way. Kernels are compiled up front in parallel threads.
A time budget (``--budget-s``, 70 s) skips the remaining launches (counted in the output) so the
run stays under 90 s on an H200 even if the parallel compile falls back to lazy compiles.

Usage: PYTHONPATH=. python3 bench/probes/probe_rms_diffusers_tiling.py [--out DIR]
CPU smoke test of the pure-Python parts (interpreter, rows 3, D 256, two configs, no timing):
       python3 bench/probes/probe_rms_diffusers_tiling.py --interpret-smoke [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

D_ZIMAGE = 3840
EPS = 1e-5  # Z-Image's norm_eps
SHAPES = [(1, 4608), (2, 4608), (1, 4096), (2, 4096), (1, 512), (2, 512)]  # (B, S)
BLOCK_ROWS = (1, 2, 4, 8, 16, 32)
WARPS = (1, 2, 4, 8)
MIN_PER_THREAD, MAX_PER_THREAD = 4, 64
COLUMNS = ["shape", "mode", "block_rows", "num_warps", "readback", "ms", "gbps", "pct_copy", "bitwise", "variant"]


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for probe_rms_diffusers_tiling.csv")
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="CPU, TRITON_INTERPRET=1, rows 3 x D 256, two configs, no timing")
    ap.add_argument("--rep", type=float, default=20.0, help="do_bench rep (ms)")
    ap.add_argument("--warmup", type=float, default=5.0, help="do_bench warmup (ms)")
    ap.add_argument("--budget-s", type=float, default=70.0,
                    help="after this many seconds (from the end of the imports) skip the remaining launches")
    ap.add_argument("--variants", default="asis,dspec", help="comma list of asis, dspec")
    ap.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES), help="BxS,BxS,...")
    ap.add_argument("--width", type=int, default=D_ZIMAGE)
    ap.add_argument("--device", default="cuda", help="cpu: only under TRITON_INTERPRET=1, to test this script")
    return ap.parse_args()


def tile_configs(mode: int, cw: int, smoke: bool) -> list[tuple[int, int, bool]]:
    """(block_rows, num_warps, readback) to sweep for chunks of ``cw`` columns."""
    readbacks = (False, True) if mode == 2 else (False,)
    if smoke:
        pairs = [(1, 1), (4, 2)]
    else:
        pairs = [(br, nw) for br in BLOCK_ROWS for nw in WARPS
                 if br * cw <= 16384 and MIN_PER_THREAD <= br * cw / (32 * nw) <= MAX_PER_THREAD]
    return [(br, nw, rb) for br, nw in pairs for rb in readbacks]


def min_bytes(mode: int, B: int, rows: int, D: int, esize: int) -> int:
    """Each input read once, each output written once (gate/scale [B, D], weights [D])."""
    big = {0: 2, 1: 3, 2: 4}[mode]  # x+out | update+residual+h | update+residual+h+out
    small = {0: B * D + D, 1: B * D + D, 2: 2 * B * D + 2 * D}[mode]
    return (big * rows * D + small) * esize


class _Capture:
    """Stands in for the kernel inside ``_launch``: records the grid and arguments it would launch."""

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return record


def main() -> None:
    args = _parse()
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton / ditfuse are imported
    import torch
    import triton
    import triton.testing

    from ditfuse.kernels import reference as rf
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.kernels.norm import rms_norm_diffusers_triton as mod

    smoke = args.interpret_smoke
    device = "cpu" if smoke else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --interpret-smoke)")
    t0 = time.perf_counter()
    real = mod._rms_d_kernel
    dns = [n for n in getattr(real, "do_not_specialize", ["n_rows", "S", "D", "factor", "eps"]) if n != "D"]
    kernels = {"asis": real, "dspec": triton.jit(real.fn, do_not_specialize=dns)}
    variants = [v for v in args.variants.split(",") if v]
    shapes = [(1, 3)] if smoke else [tuple(int(v) for v in bs.split("x")) for bs in args.shapes.split(",")]
    D = 256 if smoke else args.width

    def operands(B, S):
        torch.manual_seed(1000 * B + S)
        rs = torch.exp(torch.randn(B, S, 1, device=device) * 1.5)
        x = (torch.randn(B, S, D, device=device) * rs).bfloat16()  # MODE 0's rows, MODE 1/2's update
        residual = (torch.randn(B, S, D, device=device) * 4).bfloat16()
        mods = (torch.randn(B, 1, 4 * D, device=device) * 0.5).bfloat16()  # adaLN(c).unsqueeze(1)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mods.chunk(4, dim=2)  # [B, 1, D] views, stride 4D
        w = (1 + 0.3 * torch.randn(D, device=device)).bfloat16()
        w2 = (1 + 0.3 * torch.randn(D, device=device)).bfloat16()
        return x, residual, gate_mlp.tanh(), scale_mlp, w, w2

    def launch_args(mode, ops):
        x, r, gate, scale, w, w2 = ops
        return {0: (0, x, None, None, scale, w, None, EPS), 1: (1, x, r, gate, None, w, None, EPS),
                2: (2, x, r, gate, scale, w, w2, EPS)}[mode]

    def outputs(mode, out_h):
        out, h = out_h
        return {0: (out,), 1: (h,), 2: (h, out)}[mode]

    def reference(mode, ops):
        x, r, gate, scale, w, w2 = ops
        if mode == 0:
            return (rf.rms_norm_diffusers_scale(x, w, scale, EPS),)
        if mode == 1:
            return (rf.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS),)
        return tuple(rf.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS))

    def bind(mode, ops, br, nw, rb):
        cap = _Capture()
        mod._rms_d_kernel = cap
        try:
            out_h = mod._launch(*launch_args(mode, ops), br, nw, rb)
        finally:
            mod._rms_d_kernel = real
        return cap, out_h

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    # compile every (variant, mode, config) once, in parallel threads (Triton's AsyncCompileMode);
    # the int arguments' specialization is the same for every swept shape (strides multiples of 16
    # or 0), so later launches hit the in-memory cache
    if not smoke:
        tc = time.perf_counter()
        ops = operands(*shapes[0])
        try:
            from concurrent.futures import ThreadPoolExecutor

            from triton.runtime._async_compile import AsyncCompileMode
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as ex, AsyncCompileMode(ex):
                for mode in (0, 1, 2):
                    cap, _ = bind(mode, ops, None, None, None)
                    cw = cap.kwargs["VEC"] * cap.kwargs["W"]
                    for br, nw, rb in [(None, None, None)] + tile_configs(mode, cw, False):
                        cap, _ = bind(mode, ops, br, nw, rb)
                        for v in variants:
                            kernels[v].warmup(*cap.args, grid=cap.grid, **cap.kwargs)
            print(f"compiled up front in {time.perf_counter() - tc:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - fall back to compiling at first launch
            print(f"parallel compile failed ({type(e).__name__}: {e}); compiling lazily", flush=True)
        del ops

    rows_csv, summary, skipped = [], [], 0
    for B, S in shapes:
        rows_n = B * S
        label = f"{B}x{S}x{D}"
        ops = operands(B, S)
        esize = ops[0].element_size()
        if smoke:
            copy_gbps = None
        else:
            src = torch.randn(rows_n, D, device=device).bfloat16()
            dst = torch.empty_like(src)
            t = bench(lambda: dst.copy_(src))
            copy_gbps = 2 * src.numel() * esize / t / 1e6
            rows_csv.append(dict(shape=label, mode="copy", block_rows="", num_warps="", readback="", ms=round(t, 5),
                                 gbps=round(copy_gbps, 1), pct_copy=100.0, bitwise="", variant="copy"))
            del src, dst
        for mode in (0, 1, 2):
            nbytes = min_bytes(mode, B, rows_n, D, esize)

            def record(ms, br, nw, rb, ok, variant):
                gbps = nbytes / ms / 1e6 if ms else None
                row = dict(shape=label, mode=mode, block_rows=br, num_warps=nw, readback=rb,
                           ms=round(ms, 5) if ms else "", gbps=round(gbps, 1) if gbps else "",
                           pct_copy=round(100 * gbps / copy_gbps, 1) if gbps and copy_gbps else "",
                           bitwise=ok, variant=variant)
                rows_csv.append(row)
                return row

            want = outputs(mode, mod._launch(*launch_args(mode, ops)))
            if smoke:
                eager_ok = "n/a (CPU reference: another mean order and rsqrt)"
                t_eager = None
            else:
                ref = reference(mode, ops)
                mm = compare_outputs(want, ref, f"default launch vs eager, mode {mode} {label}")
                eager_ok = mm is None
                if mm is not None:
                    print("MISMATCH", mm, flush=True)
                t_eager = bench(lambda: reference(mode, ops))
                del ref
            record(t_eager, "", "", "", eager_ok, "eager")
            cap0, _ = bind(mode, ops, None, None, None)
            default_cfg = (cap0.kwargs["BR"], cap0.kwargs["num_warps"], bool(cap0.kwargs["READBACK"]))
            cw = cap0.kwargs["VEC"] * cap0.kwargs["W"]
            configs = tile_configs(mode, cw, smoke)
            if default_cfg not in configs:
                configs = [default_cfg] + configs
            results = {}
            for variant in variants:
                kern = kernels[variant]
                for br, nw, rb in configs:
                    if not smoke and time.perf_counter() - t0 > args.budget_s:
                        skipped += 1  # neither run nor timed: a lazy compile could take long
                        continue
                    cap, out_h = bind(mode, ops, br, nw, rb)
                    kern[cap.grid](*cap.args, **cap.kwargs)
                    mm = compare_outputs(outputs(mode, out_h), want, f"{variant} {(br, nw, rb)} mode {mode} {label}")
                    if mm is not None:
                        print("MISMATCH", mm, flush=True)
                    ms = None if smoke else bench(lambda: kern[cap.grid](*cap.args, **cap.kwargs))
                    results[(variant, br, nw, rb)] = record(ms, br, nw, rb, mm is None, variant)
                    del cap, out_h
            summary.append((label, mode, default_cfg, results, t_eager, eager_ok, nbytes, copy_gbps))
        del ops

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "probe_rms_diffusers_tiling.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows_csv)
        print(f"wrote {path} ({len(rows_csv)} rows)")
    if skipped:
        print(f"time budget {args.budget_s:.0f} s reached: {skipped} launches skipped (not run, not timed)")
    bad = [r for r in rows_csv if r["bitwise"] is False]
    print(f"bitwise: {sum(r['bitwise'] is True for r in rows_csv)} launches equal, {len(bad)} differ"
          + "".join(f"\n  DIFFERS: {r['variant']} {r['shape']} mode {r['mode']} BR {r['block_rows']} "
                    f"nw {r['num_warps']} rb {r['readback']}" for r in bad))
    print(f"total {time.perf_counter() - t0:.1f} s")

    def cfg(k):
        return f"BR{k[1]} w{k[2]}{' rb' if k[3] else ''}"

    def ms_s(ms):
        return f"{ms * 1e3:7.1f}" if ms else "      -"

    print("\nshape          mode  eager=  eager_us  floor_us  default_us  best asis (us)          "
          "best dspec (us)         best %copy")
    for label, mode, dc, results, t_eager, eager_ok, nbytes, copy_gbps in summary:
        d = next((results[(v, *dc)] for v in ("asis", "dspec") if (v, *dc) in results), None)
        best = {}
        for k, r in results.items():
            if r["ms"] != "" and r["bitwise"] is True and (k[0] not in best or r["ms"] < best[k[0]][1]["ms"]):
                best[k[0]] = (k, r)
        floor = nbytes / copy_gbps / 1e6 if copy_gbps else None
        cols = []
        for v in ("asis", "dspec"):
            cols.append(f"{cfg(best[v][0]):15s} {ms_s(best[v][1]['ms'])}" if v in best else f"{'-':23s}")
        pct = max((b[1]["pct_copy"] for b in best.values()), default="")
        print(f"{label:14s} {mode:4d}  {str(eager_ok)[:5]:6s} {ms_s(t_eager):>9s} {ms_s(floor):>9s} "
              f"{ms_s(d['ms'] if d else None):>11s}  {cols[0]}  {cols[1]}  {pct}")


if __name__ == "__main__":
    main()
