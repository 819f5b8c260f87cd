"""Probe: the row-norm kernels' two ways over a row (held tiles vs runtime loop) x rows per
program, the gate-residual column tile, and the GELU tile size, on the GPU.

None of these choices changes any element's arithmetic, so every variant must be bitwise equal
to the eager chain (checked for each one before timing); the table picks the launchers'
defaults. Shapes: Wan2.1-1.3B video [B, 32760, 1536] (B = 1, 2), FLUX.1 large [2, 32760, 5120]
and image [1, 4608, 3072], bf16 activations (Wan: fp32 modulation and FP32LayerNorm).
ms: median of triton.testing.do_bench_cudagraph (GPU time, no host cost); % of copy from the
logical bytes (inputs read once, outputs written once) over the device copy bandwidth.

    PYTHONPATH=. OUT=/tmp/probe_out python3 bench/probes/probe_held_rows.py
"""

from __future__ import annotations

import os

import torch
import triton
import triton.testing

from bench.probes.common import write_csv
from ditfuse.kernels import reference as ref
from ditfuse.kernels.activation import gelu_tanh_triton as gt
from ditfuse.kernels.common import elementwise as ew
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import gate_residual_triton as grt
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

F32, BF = torch.float32, torch.bfloat16
ROWS: list[dict] = []


def _r(shape, scale=1.0, dtype=BF):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


def _nb(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=60)


def row(case, variant, fn, expected, nbytes, copy_gbs):
    got = fn()
    bad = compare_outputs(got, expected)
    ms = bench(fn)
    pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs
    ROWS.append(dict(case=case, variant=variant, ms=round(ms, 4), pct_of_copy=round(pct, 1), bitwise=bad is None))
    print(f"{case:<34} {variant:<22} {ms:8.4f} {pct:6.1f} {'ok' if bad is None else 'MISMATCH ' + str(bad)[:80]}",
          flush=True)


def write_rows(name: str, rows: list[dict]) -> None:
    """A probe's rows as CSV ``name`` under $OUT (default /tmp/probe_out)."""
    write_csv(os.environ.get("OUT", "/tmp/probe_out"), name, rows)


def ln_cases(B, S, D, wan):
    x, u = _r((B, S, D), 2.0), _r((B, S, D), 2.0)
    n = _nb(x)
    if wan:
        sc, sh, g = (_r((B, 1, D), 0.5, F32) for _ in range(3))
        w, b = torch.randn(D, device="cuda") * 0.2 + 1, torch.randn(D, device="cuda") * 0.2
        return [
            ("wan norm1+modulate", (x, None, None, sc, sh, 1e-6, None, None, F32),
             lambda: ref.layernorm_modulate(x, sc, sh, 1e-6, norm_dtype=F32), 2 * n, 1),
            ("wan gate+residual+norm2", (x, g, u, None, None, 1e-6, w, b, F32),
             lambda: ref.gate_residual_layernorm_modulate(x, g, u, None, None, 1e-6, w, b, F32), 4 * n, 2),
            ("wan residual+norm3+modulate", (x, None, u, sc, sh, 1e-6, None, None, F32),
             lambda: ref.gate_residual_layernorm_modulate(x, None, u, sc, sh, 1e-6, norm_dtype=F32), 4 * n, 2),
        ]
    sc, sh, g = (_r((B, D), 0.5) for _ in range(3))
    return [
        ("flux layernorm_modulate", (x, None, None, sc, sh, 1e-6, None, None, None),
         lambda: ref.layernorm_modulate(x, sc, sh, 1e-6), 2 * n, 1),
        ("flux gate_residual_layernorm_mod", (x, g, u, sc, sh, 1e-6, None, None, None),
         lambda: ref.gate_residual_layernorm_modulate(x, g, u, sc, sh, 1e-6), 4 * n, 2),
    ]


def wan_qk_case(B: int, S: int = 32760, D: int = 1536, H: int = 12):
    """Wan-1.3B's q RMSNorm (all heads) + RoPE at 480x832x81: (case name, (q, w, cos, sin, heads),
    eager's q, bytes moved)."""
    q, w = _r((B, S, D)), _r((D,), 0.2) + 1
    ang = torch.rand(S, 64, device="cuda") * 6.28
    cos = ang.cos().repeat_interleave(2, dim=1)[None, :, None, :].contiguous()
    sin = ang.sin().repeat_interleave(2, dim=1)[None, :, None, :].contiguous()
    expected = ref.qk_rmsnorm_across_heads_rope(q, q, w, w, cos, sin, H, 1e-6)[0]
    return f"wan rmsnorm+rope (q) {B}x{S}x{D}", (q, w, cos, sin, H), expected, 2 * _nb(q)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device copy (read + write), the % of copy baseline; printed with the setup."""
    n = 1 << 29
    src = torch.empty(n, device="cuda", dtype=BF).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 4 * n / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s")
    return copy_gbs


def main() -> None:
    copy_gbs = copy_bandwidth()
    shapes = [((1, 32760, 1536), True), ((2, 32760, 1536), True), ((2, 32760, 5120), False),
              ((1, 4608, 3072), False)]
    for (B, S, D), wan in shapes:
        label = f"{B}x{S}x{D}"
        J = triton.cdiv(D // 4, 128)
        for name, args, eager, nbytes, nout in ln_cases(B, S, D, wan):
            expected = eager()
            case = f"{name} {label}"

            def launch(unroll, R, args=args, nout=nout):
                h, out = lnm._launch(*args[:9], True, rows_per_program=R, unroll=unroll)
                return out if nout == 1 else (h, out)
            row(case, "loop R=default", lambda: launch(False, None), expected, nbytes, copy_gbs)
            for R in (1, 2, 4):
                if J * R <= 16:
                    row(case, f"held R={R}", lambda R=R: launch(True, R), expected, nbytes, copy_gbs)
            torch.cuda.empty_cache()
    for B in (1, 2):
        S, D = 32760, 1536
        case, (q, w, cos, sin, H), expected, nbytes = wan_qk_case(B)
        row(case, "loop R=default", lambda: wr._launch_one(q, w, cos, sin, H, 1e-6, True, unroll=False), expected,
            nbytes, copy_gbs)
        for R in (1, 2, 4):
            row(case, f"held R={R}", lambda R=R: wr._launch_one(q, w, cos, sin, H, 1e-6, True, rows_per_program=R),
                expected, nbytes, copy_gbs)
        # gate residual: the exact-divisor column tile vs the old 1024-wide one
        x, u, g = _r((B, S, D), 2.0), _r((B, S, D), 2.0), _r((B, 1, D), 0.5, F32)
        expected = ref.gate_residual(x, g, u)
        case = f"wan ff gate residual {B}x{S}x{D}"
        row(case, "tile 512 (new)", lambda: grt._launch(x, g, u), expected, 3 * _nb(x), copy_gbs)
        new_tile = grt.tile
        grt.tile = lambda d, per_program=8192: (per_program // 1024, 1024, 8)
        try:
            row(case, "tile 1024 (old)", lambda: grt._launch(x, g, u), expected, 3 * _nb(x), copy_gbs)
        finally:
            grt.tile = new_tile
        torch.cuda.empty_cache()
    # GELU at FLUX's large shape: elements per program x warps
    for shape in ((2, 32760, 5120), (1, 4608, 12288)):
        y = _r(shape, 2.0)
        expected = ref.gelu_tanh(y)
        case = f"gelu_tanh {'x'.join(map(str, shape))}"
        for per_program in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                def run(per_program=per_program, warps=warps):
                    out = torch.empty_like(y)
                    (Bq, Sq, Dq), (sx, so) = ew.as_3d(y, out)
                    br, bd, _ = ew.tile(Dq, per_program=per_program)
                    gt._gelu_tanh_kernel[(triton.cdiv(Bq * Sq, br), triton.cdiv(Dq, bd))](
                        y, out, Bq * Sq, Sq, Dq, *sx, *so, DTYPE=gt.tl_dtype(y.dtype), BLOCK_R=br, BLOCK_D=bd,
                        FMA_INNER=True, TANH_IMPL=gt.TANH_PTX, num_warps=warps, enable_fp_fusion=False,
                        enable_reflect_ftz=False)
                    return out
                row(case, f"{per_program}/prog {warps}w", run, expected, 2 * _nb(y), copy_gbs)
        row(case, "eager", lambda: ref.gelu_tanh(y), expected, 2 * _nb(y), copy_gbs)
        y = expected = None
        torch.cuda.empty_cache()
    write_rows("probe_held_rows_h200.csv", ROWS)


if __name__ == "__main__":
    main()
