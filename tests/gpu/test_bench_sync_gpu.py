"""bench_step.sync_points: finds where a step waits for the GPU, and nothing where it does not."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "bench_step", Path(__file__).resolve().parents[2] / "bench" / "bench_step.py")
bench_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_step)


def test_sync_points_names_the_item_call_and_nothing_else():
    x = torch.randn(1024, device="cuda")

    def no_sync():
        return (x * 2).sum()

    def with_sync():
        y = (x * 2).sum()
        return y.item()

    assert bench_step.sync_points(no_sync) == ""
    got = bench_step.sync_points(with_sync)
    assert got.startswith("1 at test_bench_sync_gpu.py:"), got
    assert torch.cuda.get_sync_debug_mode() == 0
