"""Tiling probe for rope.qk_rmsnorm_rope on the GPU: the tile kernel's former default against
the vector-per-lane kernel's rows per program x num_warps.

Tiling does not change any row's arithmetic, so every configuration must stay bitwise equal to
the eager chain (checked here for each one); the table picks the default. Shapes as in
bench/bench_kernels.py: image [1, 4608 (512 text), 24 heads] and large [2, 32760 (512 text), 40
heads], bf16, head_dim 128. ms = median of do_bench (L2 flushed); GB/s from the logical bytes
(inputs read once, outputs written once).

    PYTHONPATH=. python3 bench/probes/probe_qk_rmsnorm_rope.py
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from ditfuse.kernels import reference as ref
from ditfuse.kernels.common import warp
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import _launch, qk_rmsnorm_rope

S_TXT = 512
SHAPES = {"image": (1, 4608, 24), "large": (2, 32760, 40)}


def _args(B, S, H):
    def r(*shape):
        return torch.randn(*shape, device="cuda").to(torch.bfloat16)

    s_img = S - S_TXT
    ang = torch.rand(S, 64, device="cuda") * 6.28
    cos = ang.cos().repeat_interleave(2, dim=1).contiguous()
    sin = ang.sin().repeat_interleave(2, dim=1).contiguous()
    w = [(1 + 0.2 * torch.randn(128, device="cuda")).to(torch.bfloat16) for _ in range(4)]
    return (r(B, s_img, H, 128), r(B, s_img, H, 128), w[0], w[1], cos, sin, 1e-6,
            r(B, S_TXT, H, 128), r(B, S_TXT, H, 128), w[2], w[3])


def main() -> None:
    n = 1 << 29
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 4 * n / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    del src, dst
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy {copy_gbs:.0f} GB/s")
    print(f"{'shape':<6} {'provider':<22} {'ms':>8} {'GB/s':>6} {'%copy':>6} bitwise")
    for name, (B, S, H) in SHAPES.items():
        args = _args(B, S, H)
        q, k, qt = args[0], args[1], args[7]
        nbytes = sum(t.numel() * t.element_size() for t in args if isinstance(t, torch.Tensor))
        nbytes += 2 * (q.numel() + qt.numel()) * q.element_size()
        expected = ref.qk_rmsnorm_rope(*args)

        def row(label, fn, check=True):
            ok = compare_outputs(fn(), expected) is None if check else ""
            ms = triton.testing.do_bench(fn, return_mode="median")
            gbs = nbytes / (ms * 1e-3) / 1e9
            print(f"{name:<6} {label:<22} {ms:8.4f} {gbs:6.0f} {100 * gbs / copy_gbs:6.1f} {ok}", flush=True)

        row("eager", lambda: ref.qk_rmsnorm_rope(*args), check=False)
        row("ours (custom op)", lambda: qk_rmsnorm_rope(*args))
        row("tile R=8 warps=2", lambda: _launch(*args, kernel="tile", rows_per_program=8, num_warps=2))
        for R, warps, V in ((8, 4, 1), (4, 2, 1), (8, 2, 2), (8, 4, 2), (16, 4, 2), (16, 8, 2), (4, 2, 2),
                            (8, 2, 4), (8, 1, 4), (16, 4, 4), (16, 2, 4)):
            row(f"lanes R={R} w={warps} V={V}", lambda R=R, warps=warps, V=V: _launch(
                *args, kernel="lanes", lanes_tiling=(R, warps, V)))
        refused = {k: v for k, v in warp._LANE_VERDICTS.items() if v}
        print(f"{name:<6} lane binaries judged: {len(warp._LANE_VERDICTS)}, refused by the layout guard "
              f"(those rows ran the tile kernel): {sorted(set(refused.values())) or 'none'}", flush=True)
        del args, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
