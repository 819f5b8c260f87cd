"""Which reduction order does torch's CUDA ``F.rms_norm`` (``_fused_rms_norm``) follow?

Run on the GPU: ``PYTHONPATH=. python3 tests/gpu/probe_rms_order.py``. For several head dims and
dtypes it compares ``F.rms_norm(x, (D,), w, eps)`` bitwise with pure-torch simulations of several
candidate orders (tests/rms_sim.py), with ``torch.rsqrt`` or ``1 / sqrt``, with the two
associations of the output product, and with the Triton kernel itself (rope.qk_rmsnorm_rope
without text and RoPE is just the RMSNorm of q and k). Prints one row per candidate: the number
of rows (of ROWS) whose output differs anywhere. Not a test (no assertion); the pytest file
tests/gpu/test_qk_rmsnorm_rope.py asserts the winner.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import qk_rmsnorm_rope
from tests.support import rms_sim

ROWS = int(os.environ.get("PROBE_ROWS", "8192"))
EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: dry run under TRITON_INTERPRET=1


def _inputs(D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    # Row scales over many binades so that sums of squares round in many different ways.
    scale = torch.exp(torch.randn(ROWS, 1, device=DEVICE, generator=g) * 2)
    x = (torch.randn(ROWS, D, device=DEVICE, generator=g) * scale).to(dtype)
    w = (1 + 0.3 * torch.randn(D, device=DEVICE, generator=g)).to(dtype)
    return x, w


def _rows_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    it = torch.int32 if a.dtype == torch.float32 else torch.int16
    return int((a.view(it) != b.view(it)).any(-1).sum())


def main() -> None:
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}")
    orders = ["torch", "torch_nofma", "halving", "sequential", "lane_strided", "vec8", "vec2", "torch_sum"]
    rsqrts = {"rsqrt": torch.rsqrt, "1/sqrt": lambda v: 1.0 / torch.sqrt(v)}
    results = []
    for D, dtype in [(128, torch.bfloat16), (128, torch.float32), (128, torch.float16),
                     (64, torch.bfloat16), (96, torch.bfloat16), (256, torch.bfloat16),
                     (512, torch.bfloat16), (256, torch.float32),
                     # Wan's norm over all heads: 3 to 10 vectors per thread
                     (1536, torch.bfloat16), (1536, torch.float32), (3072, torch.bfloat16), (5120, torch.bfloat16)]:
        x, w = _inputs(D, dtype, seed=D)
        expected = F.rms_norm(x, (D,), w, EPS)
        expected_nw = F.rms_norm(x, (D,), None, EPS)
        tag = f"D={D} {str(dtype).replace('torch.', '')}"
        for order in orders:
            if D > 128 and order in ("sequential", "lane_strided", "halving"):
                continue
            for rname, rfn in rsqrts.items():
                for out_order in ("w(rx)", "(wr)x"):
                    if (rname, out_order) != ("rsqrt", "w(rx)") and order != "torch":
                        continue
                    got = rms_sim.rms_norm(x, w, EPS, rfn, order, out_order)
                    results.append((tag, f"sim {order} {rname} {out_order}", _rows_differ(got, expected)))
        got_nw = rms_sim.rms_norm(x, None, EPS, torch.rsqrt, "torch")
        results.append((tag, "sim torch rsqrt no-weight", _rows_differ(got_nw, expected_nw)))
        if D <= 512:  # FLUX's per-head kernel: rows as [1, ROWS, 1, D] q and k, no text, no RoPE.
            q = x.view(1, ROWS, 1, D)
            kq, kk = qk_rmsnorm_rope(q, q, w, None, None, None, EPS)
            results.append((tag, "triton kernel (weight)", _rows_differ(kq.view(ROWS, D), expected)))
            results.append((tag, "triton kernel (no weight)", _rows_differ(kk.view(ROWS, D), expected_nw)))
        # Wan's kernel over the whole row (one "head" of width D, no RoPE)
        from ditfuse.kernels.rope.qk_rmsnorm_across_heads_rope_triton import qk_rmsnorm_across_heads_rope

        xq = x.view(1, ROWS, D)
        wq, wk = qk_rmsnorm_across_heads_rope(xq, xq, w, None, None, None, 1, EPS)
        results.append((tag, "wan kernel (weight)", _rows_differ(wq.view(ROWS, D), expected)))
        results.append((tag, "wan kernel (no weight)", _rows_differ(wk.view(ROWS, D), expected_nw)))
    print(f"{'case':<18} {'candidate':<36} rows differing (of {ROWS})")
    for tag, cand, n in results:
        print(f"{tag:<18} {cand:<36} {n}")


if __name__ == "__main__":
    main()
