"""Kernel benchmark: eager chain vs torch.compile of the chain vs ours, one run per GPU.

For every registered bit-exact kernel (loaded through ``ditfuse.kernels.registry.select(op).load()``;
a kernel that fails to import or to run is skipped with a printed note) at the FLUX image shape
[1, 4608, 3072] and the large shape [2, 32760, 5120] (bf16):

- providers: ``eager`` (the ditfuse.kernels.reference chain), ``compile`` (torch.compile of the same
  chain, dynamic=False), ``ours`` (the registered kernel);
- ``ms``: median of triton.testing.do_bench (L2 flushed before every call, return_mode="median"),
  or with ``--timing graph`` of triton.testing.do_bench_cudagraph (the call captured in a CUDA
  graph and replayed: GPU time without the host's per-call launch cost, which dominates the
  small image-shape ops in eager timing; column ``timing``);
- ``GB/s`` from an explicit byte count, the same for all providers: every input read once and
  every output written once (the op's logical traffic; intermediates of the eager chain are not
  counted, that is the point of fusing);
- ``pct_of_copy``: GB/s over the device-to-device copy bandwidth measured in the same run
  (``dst.copy_(src)`` of 1 GiB, read + write bytes);
- ``bitwise_equal``: the provider's output vs eager's, integer views (checked before timing).

Writes long-format CSV to --out (default bench/results/kernels_h200.csv) and prints a table.

    python bench/bench_kernels.py [--out PATH] [--kernels a,b] [--shapes image,large] [--no-compile]
                                  [--ln-impl v1,v2]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ditfuse.kernels import reference as ref  # noqa: E402
from ditfuse.kernels.compare import compare_outputs  # noqa: E402

SHAPES = {"image": (1, 4608, 3072), "large": (2, 32760, 5120)}
HEADS = {3072: 24, 5120: 40}
S_TXT = 512
DT = torch.bfloat16


def _nbytes(*ts: Any) -> int:
    total = 0
    for t in ts:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, (tuple, list)):
            total += _nbytes(*t)
    return total


@dataclass
class Case:
    kernel: str  # label in the CSV
    op: str  # registry op id
    shape_label: str
    args: tuple
    eager: Callable[..., Any]
    ours: Callable[[Callable[..., Any]], Callable[..., Any]]  # loaded kernel -> callable(*args)
    nbytes: int


def _rand(shape, scale=1.0):
    return (torch.randn(shape, device="cuda", dtype=torch.float32) * scale).to(DT)


def make_cases(shape_name: str) -> list[Case]:
    B, S, D = SHAPES[shape_name]
    label = "x".join(map(str, (B, S, D)))
    cases: list[Case] = []
    x = _rand((B, S, D), 2.0)
    y = _rand((B, S, D), 2.0)
    sc, sh, g = (_rand((B, D), 0.5) for _ in range(3))

    cases.append(Case("modulate.scale_shift", "modulate.scale_shift", label, (x, sc, sh), ref.scale_shift,
                      lambda k: k, _nbytes(x, sc, sh) + _nbytes(x)))
    cases.append(Case("modulate.gate_residual", "modulate.gate_residual", label, (x, g, y), ref.gate_residual,
                      lambda k: k, _nbytes(x, g, y) + _nbytes(x)))
    cases.append(Case("norm.layernorm_modulate", "norm.layernorm_modulate", label, (x, sc, sh),
                      lambda a, b, c: ref.layernorm_modulate(a, b, c, 1e-6),
                      lambda k: (lambda a, b, c: k(a, b, c, 1e-6)), _nbytes(x, sc, sh) + _nbytes(x)))
    cases.append(Case("norm.gate_residual_layernorm_modulate", "norm.gate_residual_layernorm_modulate", label,
                      (x, g, y, sc, sh), lambda *a: ref.gate_residual_layernorm_modulate(*a, 1e-6),
                      lambda k: (lambda *a: k(*a, 1e-6)), _nbytes(x, g, y, sc, sh) + 2 * _nbytes(x)))
    cases.append(Case("activation.gelu_tanh", "activation.gelu_tanh", label, (y,), ref.gelu_tanh,
                      lambda k: k, 2 * _nbytes(y)))
    # The single block's cat([attn, gelu(proj_mlp(n))], dim=2): ours writes GELU into the buffer
    # and copies only the attention half (SingleBlockBuffer.write_attention).
    attn = _rand((B, S, D), 1.0)
    mlp_pre = _rand((B, S, 4 * D), 2.0)

    def ours_cat(k):
        def run(a, m):
            buf = torch.empty(B, S, 5 * D, device="cuda", dtype=DT)
            buf[:, :, :D].copy_(a)
            k(m, out=buf[:, :, D:])
            return buf
        return run

    cases.append(Case("activation.gelu_tanh+cat", "activation.gelu_tanh", f"{label} (mlp 4D)", (attn, mlp_pre),
                      ref.single_block_mlp_cat, ours_cat, _nbytes(attn, mlp_pre) * 2))
    del attn, mlp_pre
    # rope: q/k [B, S, H, 128] with 512 text tokens first
    H = HEADS[D]
    s_img = S - S_TXT
    q, k_ = _rand((B, s_img, H, 128)), _rand((B, s_img, H, 128))
    qt, kt = _rand((B, S_TXT, H, 128)), _rand((B, S_TXT, H, 128))
    wq, wk, wqt, wkt = (_rand((128,), 0.2) + 1 for _ in range(4))
    ang = torch.rand(S, 64, device="cuda") * 6.28
    cos = ang.cos().repeat_interleave(2, dim=1).contiguous()
    sin = ang.sin().repeat_interleave(2, dim=1).contiguous()
    rope_args = (q, k_, wq, wk, cos, sin, 1e-6, qt, kt, wqt, wkt)
    cases.append(Case("rope.qk_rmsnorm_rope", "rope.qk_rmsnorm_rope", f"{B}x{S}x{H}x128 (txt {S_TXT})", rope_args,
                      ref.qk_rmsnorm_rope, lambda kk: kk,
                      _nbytes(q, k_, qt, kt, wq, wk, wqt, wkt, cos, sin) + 2 * _nbytes(q, qt)))
    return cases


def _with_ln_impl(fn: Callable[..., Any], impl: str) -> Callable[..., Any]:
    """Run ``fn`` with DITFUSE_LN_IMPL=impl (read by the LayerNorm kernels at each launch)."""
    def run(*a):
        old = os.environ.get("DITFUSE_LN_IMPL")
        os.environ["DITFUSE_LN_IMPL"] = impl
        try:
            return fn(*a)
        finally:
            if old is None:
                os.environ.pop("DITFUSE_LN_IMPL", None)
            else:
                os.environ["DITFUSE_LN_IMPL"] = old
    return run


def copy_bandwidth_gbs() -> float:
    import triton.testing

    n = 1 << 29  # 1 GiB of bf16
    src = torch.empty(n, device="cuda", dtype=DT).normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    del src, dst
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/kernels_h200.csv")
    ap.add_argument("--kernels", default="", help="comma-separated kernel labels (default: all)")
    ap.add_argument("--shapes", default="image,large")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse)")
    ap.add_argument("--timing", choices=["flush", "graph"], default="flush",
                    help="flush: do_bench with L2 flushed (default); graph: do_bench_cudagraph")
    ap.add_argument("--ln-impl", default="v2",
                    help="LayerNorm kernel versions to time, e.g. v1,v2: v2 (the default) is provider "
                         "'ours', v1 is 'ours-v1' (DITFUSE_LN_IMPL=v1 around each call)")
    args = ap.parse_args()

    import triton
    import triton.testing

    from ditfuse.kernels.registry import select

    t_start = time.time()
    commit = args.commit
    if commit is None:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                             stderr=subprocess.DEVNULL).strip()
        except Exception:
            commit = "unknown"
    gpu = torch.cuda.get_device_name()
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, commit=commit)
    copy_gbs = copy_bandwidth_gbs()
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, commit {commit}; "
          f"copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    wanted = {k for k in args.kernels.split(",") if k}
    loaded: dict[str, Callable[..., Any] | None] = {}
    fields = ["kernel", "provider", "shape", "ms", "GB/s", "pct_of_copy", "bitwise_equal", "timing", "gpu",
              "torch", "triton", "commit"]
    meta["timing"] = args.timing
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fh = open(args.out, "w", newline="")  # rows are written as they are measured (partial runs keep them)
    writer = csv.DictWriter(fh, fieldnames=fields)
    writer.writeheader()
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        writer.writerow(row)
        fh.flush()
        if row["provider"] != "torch.copy_":
            print(f"{row['kernel']:<40} {row['shape']:<26} {row['provider']:<8} {row['ms']:>8.4f} "
                  f"{row['GB/s']:>7.0f} {row['pct_of_copy']:>6.1f} {row['bitwise_equal']}  "
                  f"[{time.time() - t_start:.0f}s]", flush=True)

    emit(dict(kernel="device_copy", provider="torch.copy_", shape="1GiB", ms=float("nan"),  # timing: do_bench
              **{"GB/s": round(copy_gbs, 1)}, pct_of_copy=100.0, bitwise_equal="", **meta))
    for shape_name in [s for s in args.shapes.split(",") if s]:
        cases = make_cases(shape_name)
        for case in cases:
            if wanted and case.kernel not in wanted:
                continue
            if case.op not in loaded:
                try:
                    loaded[case.op] = select(case.op).load()
                except Exception as e:  # another helper's kernel may not exist yet
                    print(f"# skip {case.op}: failed to import ({type(e).__name__}: {e})")
                    loaded[case.op] = None
            kern = loaded[case.op]
            providers: dict[str, Callable[..., Any]] = {"eager": case.eager}
            if not args.no_compile:
                providers["compile"] = torch.compile(case.eager, dynamic=False)
            if kern is not None:
                ln_impls = [i for i in args.ln_impl.split(",") if i]
                if case.op.startswith("norm.layernorm") or case.op.startswith("norm.gate_residual_layernorm"):
                    for impl in ln_impls:
                        providers["ours" if impl == "v2" else f"ours-{impl}"] = _with_ln_impl(case.ours(kern), impl)
                else:
                    providers["ours"] = case.ours(kern)
            expected = case.eager(*case.args)
            for pname, fn in providers.items():
                try:
                    got = fn(*case.args)
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"# skip {case.kernel} [{pname}] at {case.shape_label}: {type(e).__name__}: {e}")
                    continue
                mm = compare_outputs(got, expected, case.kernel)
                del got
                if args.timing == "graph":
                    ms = triton.testing.do_bench_cudagraph(lambda: fn(*case.args), return_mode="median")
                else:
                    ms = triton.testing.do_bench(lambda: fn(*case.args), return_mode="median")
                gbs = case.nbytes / (ms * 1e-3) / 1e9
                emit(dict(kernel=case.kernel, provider=pname, shape=case.shape_label, ms=round(ms, 4),
                          **{"GB/s": round(gbs, 1)}, pct_of_copy=round(100 * gbs / copy_gbs, 1),
                          bitwise_equal=mm is None, **meta))
            del expected, providers
        del cases
        torch.cuda.empty_cache()
    fh.close()

    print(f"{'kernel':<40} {'shape':<26} {'provider':<8} {'ms':>8} {'GB/s':>7} {'%copy':>6} bitwise")
    for r in rows[1:]:
        print(f"{r['kernel']:<40} {r['shape']:<26} {r['provider']:<8} {r['ms']:>8.4f} {r['GB/s']:>7.0f} "
              f"{r['pct_of_copy']:>6.1f} {r['bitwise_equal']}")
    print(f"# wrote {args.out} ({len(rows)} rows) in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
