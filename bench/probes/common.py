"""What the GPU probes share: their CSV output and the device-copy bandwidth yardstick."""

from __future__ import annotations

import csv
import os


def write_csv(out_dir: str, name: str, rows: list[dict], fieldnames: list[str] | None = None) -> str:
    """``rows`` as CSV ``out_dir/name`` (the directory made if needed; columns: ``fieldnames`` or
    the first row's keys); returns the path. Nothing is written for no rows."""
    path = os.path.join(out_dir, name)
    if not rows:
        return path
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def copy_gbs() -> float:
    """GB/s (read + write) of a 1 GiB bf16 device copy, CUDA-graph timed (GPU time only): the
    probes' % of copy bandwidth baseline."""
    import torch
    import triton.testing

    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench_cudagraph(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9
