"""Kernel benchmark: eager chain vs torch.compile of the chain vs ours, one run per GPU.

For every registered bit-exact kernel (loaded through ``ditfuse.kernels.registry.select(op).load()``;
a kernel that fails to import or to run is skipped with a printed note) at the FLUX image shape
[1, 4608, 3072] and the large shape [2, 32760, 5120] (bf16), and Wan's chains (fp32 modulation,
FP32LayerNorm, RMSNorm over all heads + RoPE) at the Wan2.1-1.3B video shape [1, 32760, 1536]
(480x832, 81 frames; ``wan2`` is its CFG batch of 2); ``flux2``: FLUX.2's SwiGLU chains; ``sd3``:
SD3.5-large's joint value cat (``layout.head_cat``):

- providers: ``eager`` (the ditfuse.kernels.reference chain), ``compile`` (torch.compile of the same
  chain, dynamic=False), ``ours`` (the registered kernel);
- ``ms``: median of triton.testing.do_bench (``flush``: L2 flushed before every call, host launch
  cost included) and of triton.testing.do_bench_cudagraph (``graph``: the call captured in a CUDA
  graph and replayed: GPU time without the host's per-call cost, which dominates the small
  image-shape ops in eager timing); ``--timing flush,graph`` (default) writes both, column
  ``timing``;
- ``GB/s`` from an explicit byte count, the same for all providers: every input read once and
  every output written once (the op's logical traffic; intermediates of the eager chain are not
  counted, that is the point of fusing);
- ``pct_of_copy``: GB/s over the device-to-device copy bandwidth measured in the same run
  (``dst.copy_(src)`` of 1 GiB, read + write bytes);
- ``bitwise_equal``: the provider's output vs eager's, integer views (checked before timing).

Writes long-format CSV to --out (default bench/results/kernels_h200.csv) and prints a table.

    python bench/bench_kernels.py [--out PATH] [--kernels a,b] [--shapes image,large,wan,wan2,wan14b,flux2,sd3]
                                  [--no-compile] [--timing flush,graph]
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

SHAPES = {"image": (1, 4608, 3072), "large": (2, 32760, 5120), "wan": (1, 32760, 1536), "wan2": (2, 32760, 1536),
          "wan14b": (2, 32760, 5120), "flux2": (1, 4608, 6144), "sd3": (1, 4096 + 333, 2432)}
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


def make_wan_cases(B: int, S: int, D: int) -> list[Case]:
    """Wan2.1-1.3B's chains as WanTransformerBlock writes them (fp32 [B, 1, D] modulation chunks,
    FP32LayerNorm, norm2 affine in fp32, RMSNorm over all 12 heads + RoPE with fp32 tables)."""
    label = f"{B}x{S}x{D}"
    F32 = torch.float32
    x, attn = _rand((B, S, D), 2.0), _rand((B, S, D), 2.0)
    mods = (torch.randn(1, 6, D, device="cuda") * 0.5 + _rand((B, 6, D), 0.5).float()).chunk(6, dim=1)
    shift, scale, gate = mods[:3]
    w2, b2 = torch.randn(D, device="cuda") * 0.2 + 1, torch.randn(D, device="cuda") * 0.2
    n = _nbytes(x)
    cases = [
        Case("wan norm1+modulate", "norm.layernorm_modulate", label, (x, scale, shift),
             lambda a, b, c: ref.layernorm_modulate(a, b, c, 1e-6, norm_dtype=F32),
             lambda k: (lambda a, b, c: k(a, b, c, 1e-6, norm_dtype=F32)), 2 * n),
        Case("wan gate+residual+norm2", "norm.gate_residual_layernorm_modulate", label, (x, gate, attn),
             lambda a, g, u: ref.gate_residual_layernorm_modulate(a, g, u, None, None, 1e-6, w2, b2, F32),
             lambda k: (lambda a, g, u: k(a, g, u, None, None, 1e-6, w2, b2, F32)), 4 * n),
        Case("wan residual+norm3+modulate", "norm.gate_residual_layernorm_modulate", label, (x, attn, scale, shift),
             lambda a, u, c, d: ref.gate_residual_layernorm_modulate(a, None, u, c, d, 1e-6, norm_dtype=F32),
             lambda k: (lambda a, u, c, d: k(a, None, u, c, d, 1e-6, norm_dtype=F32)), 4 * n),
        Case("wan ff gate residual", "modulate.gate_residual", label, (x, gate, attn), ref.gate_residual,
             lambda k: k, 3 * n),
    ]
    H, Dh = D // 128, 128
    q, k_ = _rand((B, S, D)), _rand((B, S, D))
    wq, wk = _rand((D,), 0.2) + 1, _rand((D,), 0.2) + 1
    ang = torch.rand(S, Dh // 2, device="cuda") * 6.28
    cos = ang.cos().repeat_interleave(2, dim=1)[None, :, None, :].contiguous()
    sin = ang.sin().repeat_interleave(2, dim=1)[None, :, None, :].contiguous()
    cases.append(Case("wan qk rmsnorm(all heads)+rope", "rope.qk_rmsnorm_across_heads_rope", f"{label} ({H} heads)",
                      (q, k_, wq, wk, cos, sin, H, 1e-6), ref.qk_rmsnorm_across_heads_rope, lambda kk: kk,
                      4 * n + _nbytes(cos, sin, wq, wk)))
    return cases


def make_flux2_cases(B: int, S: int, D: int) -> list[Case]:
    """FLUX.2-dev's SwiGLU (mlp hidden I = 3 D = 18432): the feed-forward's ``silu(x[..., :I]) *
    x[..., I:]`` on the fused projection's halves (strided views, no chunk copies), and the single
    block's ``cat([attn, swiglu])`` in one kernel (and the earlier two-kernel way)."""
    label = f"{B}x{S}x{D}"
    inner = 3 * D
    proj = _rand((B, S, 2 * inner), 2.0)
    cases = [Case("activation.swiglu", "activation.swiglu", f"{label} (halves of {2 * inner})", (proj,),
                  ref.swiglu_halves, lambda k: (lambda x: k(x[..., :inner], x[..., inner:])), _nbytes(proj) * 3 // 2)]
    attn = _rand((B, S, D), 1.0)

    def eager_cat(a, x):
        return torch.cat([a, ref.swiglu_halves(x)], dim=2)

    def ours_cat(k):
        def run(a, x):
            buf = torch.empty(B, S, D + inner, device="cuda", dtype=DT)
            buf[:, :, :D].copy_(a)
            k(x[..., :inner], x[..., inner:], out=buf[:, :, D:])
            return buf
        return run

    # ours: one kernel (activation.swiglu_cat, round 8); rounds 3-7 wrote the SwiGLU into the buffer
    # and copied the attention half in (kept for the comparison)
    cases.append(Case("activation.swiglu+cat", "activation.swiglu_cat", f"{label} (single block)", (attn, proj),
                      eager_cat, lambda k: (lambda a, x: k(a, x[..., :inner], x[..., inner:])),
                      _nbytes(attn) * 2 + _nbytes(proj) * 3 // 2))
    cases.append(Case("activation.swiglu+cat (2 kernels)", "activation.swiglu", f"{label} (single block)", (attn, proj),
                      eager_cat, ours_cat, _nbytes(attn) * 2 + _nbytes(proj) * 3 // 2))
    return cases


def make_sd3_cases(B: int, S: int, D: int) -> list[Case]:
    """SD3.5-large's joint value: ``cat([v, v_txt], dim=2)`` of the two value projections viewed
    [B, H, S, 64] (transposed views), 4096 image + 333 text tokens; and the attention output's
    ``transpose(1, 2).reshape(B, S, H * 64)`` of SDPA's contiguous [B, H, S, 64]."""
    s_txt, hd = 333, 64
    s_img, H = S - s_txt, D // hd
    v = _rand((B, s_img, D)).view(B, s_img, H, hd).transpose(1, 2)
    vt = _rand((B, s_txt, D)).view(B, s_txt, H, hd).transpose(1, 2)
    o = _rand((B, H, S, hd))  # SDPA's heads-first output, back in token rows after attention
    return [Case("layout.head_cat", "layout.head_cat", f"{B}x{H}x({s_img}+{s_txt})x{hd}", (v, vt), ref.head_cat,
                 lambda k: k, 2 * _nbytes(v, vt)),
            Case("layout.heads_to_tokens", "layout.heads_to_tokens", f"{B}x{H}x{S}x{hd}", (o,), ref.heads_to_tokens,
                 lambda k: k, 2 * _nbytes(o))]


def make_cases(shape_name: str) -> list[Case]:
    B, S, D = SHAPES[shape_name]
    if shape_name.startswith("wan"):
        return make_wan_cases(B, S, D)
    if shape_name == "sd3":
        return make_sd3_cases(B, S, D)
    if shape_name == "flux2":
        return make_flux2_cases(B, S, D)
    label = "x".join(map(str, (B, S, D)))
    cases: list[Case] = []
    x = _rand((B, S, D), 2.0)
    y = _rand((B, S, D), 2.0)
    sc, sh, g = (_rand((B, D), 0.5) for _ in range(3))

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
    # The single block's cat([attn, gelu(proj_mlp(n))], dim=2): ours is one kernel
    # (activation.gelu_tanh_cat); round 6 wrote the GELU into the buffer and copied the attention half.
    attn = _rand((B, S, D), 1.0)
    mlp_pre = _rand((B, S, 4 * D), 2.0)

    def ours_cat(k):
        def run(a, m):
            buf = torch.empty(B, S, 5 * D, device="cuda", dtype=DT)
            buf[:, :, :D].copy_(a)
            k(m, out=buf[:, :, D:])
            return buf
        return run

    cases.append(Case("activation.gelu_tanh+cat", "activation.gelu_tanh_cat", f"{label} (mlp 4D)", (attn, mlp_pre),
                      ref.single_block_mlp_cat, lambda k: k, _nbytes(attn, mlp_pre) * 2))
    # round 6's way (GELU into the buffer, attention half by copy_), for the comparison
    cases.append(Case("activation.gelu_tanh+cat (2 kernels)", "activation.gelu_tanh", f"{label} (mlp 4D)",
                      (attn, mlp_pre), ref.single_block_mlp_cat, ours_cat, _nbytes(attn, mlp_pre) * 2))
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
    # Qwen-Image's chain on the same q/k: diffusers RMSNorm, complex RoPE with per-stream tables
    ang_i = torch.rand(s_img, 64, device="cuda") * 6.28
    ang_t = torch.rand(S_TXT, 64, device="cuda") * 6.28
    f_img = torch.polar(torch.ones_like(ang_i), ang_i)
    f_txt = torch.polar(torch.ones_like(ang_t), ang_t)
    qwen_args = (q, k_, wq, wk, f_img, 1e-6, qt, kt, wqt, wkt, f_txt)
    cases.append(Case("rope.qk_rmsnorm_diffusers_rope_complex", "rope.qk_rmsnorm_diffusers_rope_complex",
                      f"{B}x{S}x{H}x128 (txt {S_TXT})", qwen_args, ref.qk_rmsnorm_diffusers_rope_complex_cat,
                      lambda kk: kk, _nbytes(q, k_, qt, kt, wq, wk, wqt, wkt, f_img, f_txt) + 2 * _nbytes(q, qt)))
    return cases


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
    ap.add_argument("--shapes", default="image,large,wan,wan2")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    ap.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse)")
    ap.add_argument("--timing", default="flush,graph",
                    help="comma-separated: flush (do_bench, L2 flushed, host cost included), "
                         "graph (do_bench_cudagraph: GPU time only)")
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
    timings = [t for t in args.timing.split(",") if t]
    if not set(timings) <= {"flush", "graph"}:
        raise SystemExit(f"--timing takes flush and/or graph, got {args.timing!r}")
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
            print(f"{row['kernel']:<36} {row['shape']:<26} {row['provider']:<8} {row['timing']:<5} {row['ms']:>8.4f} "
                  f"{row['GB/s']:>7.0f} {row['pct_of_copy']:>6.1f} {row['bitwise_equal']}  "
                  f"[{time.time() - t_start:.0f}s]", flush=True)

    emit(dict(kernel="device_copy", provider="torch.copy_", shape="1GiB", ms=float("nan"),
              **{"GB/s": round(copy_gbs, 1)}, pct_of_copy=100.0, bitwise_equal="", timing="flush", **meta))
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
                for timing in timings:
                    try:
                        if timing == "graph":
                            ms = triton.testing.do_bench_cudagraph(lambda: fn(*case.args), return_mode="median")
                        else:
                            ms = triton.testing.do_bench(lambda: fn(*case.args), return_mode="median")
                    except Exception as e:  # e.g. a provider that cannot be captured
                        print(f"# {case.kernel} [{pname}] {timing} timing failed: {type(e).__name__}: {e}")
                        continue
                    gbs = case.nbytes / (ms * 1e-3) / 1e9
                    emit(dict(kernel=case.kernel, provider=pname, shape=case.shape_label, ms=round(ms, 4),
                              **{"GB/s": round(gbs, 1)}, pct_of_copy=round(100 * gbs / copy_gbs, 1),
                              bitwise_equal=mm is None, timing=timing, **meta))
            del expected, providers
        del cases
        torch.cuda.empty_cache()
    fh.close()

    print(f"{'kernel':<36} {'shape':<26} {'provider':<8} {'time':<5} {'ms':>8} {'GB/s':>7} {'%copy':>6} bitwise")
    for r in rows[1:]:
        print(f"{r['kernel']:<36} {r['shape']:<26} {r['provider']:<8} {r['timing']:<5} {r['ms']:>8.4f} "
              f"{r['GB/s']:>7.0f} {r['pct_of_copy']:>6.1f} {r['bitwise_equal']}")
    print(f"# wrote {args.out} ({len(rows)} rows) in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
