"""bench_step's GPU occupancy from a kernel trace: busy = union of intervals, idle = span - busy."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_step", Path(__file__).resolve().parents[2] / "bench" / "bench_step.py")
bench_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_step)


def test_occupancy_overlaps_and_gaps():
    # µs: [0,10) and [5,20) overlap (busy 20), gap 20..30, [30,35), nested [31,33), gap 35..100, [100,101)
    iv = [(0.0, 10.0, "a"), (5.0, 20.0, "b"), (30.0, 35.0, "c"), (31.0, 33.0, "c"), (100.0, 101.0, "gemm_x")]
    occ = bench_step.gpu_occupancy(iv)
    assert occ["gpu_busy"] == pytest.approx(26 / 1000)
    assert occ["gpu_span"] == pytest.approx(101 / 1000)
    assert occ["gpu_idle"] == pytest.approx(75 / 1000)
    assert occ["kernels"] == 5


def test_occupancy_empty_and_single():
    assert bench_step.gpu_occupancy([]) == {}
    occ = bench_step.gpu_occupancy([(7.0, 9.5, "k")])
    assert occ["gpu_idle"] == 0 and occ["gpu_busy"] == pytest.approx(2.5 / 1000)


def test_top_kernels_sums_per_name():
    iv = [(0.0, 1000.0, "a"), (2000.0, 2500.0, "b"), (3000.0, 4000.0, "a"), (5000.0, 5100.0, "c")]
    top = bench_step.top_kernels(iv, n=2)
    assert top == [("a", 2.0, 2), ("b", 0.5, 1)]


@pytest.mark.parametrize("name,cat", [
    ("_swiglu_kernel", "elementwise"), ("_bias_residual_kernel", "elementwise"), ("_border_kernel", "copies"),
    ("_zero_border_kernel", "copies"), ("_up2_cl_kernel", "copies"), ("_wan_rms_kernel", "norms"),
    ("_ln_warp_kernel", "norms"), ("_gelu_tanh_cat_kernel", "elementwise"), ("act_cat_kernel", "elementwise"), ("_gn_chain_kernel", "norms"),
    ("_gn_apply_kernel", "norms"), ("fmha_cutlassF_bf16_aligned_32x128_gmem_sm80", "attention"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16", "gemm"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>", "other"),
])
def test_breakdown_categories(name, cat):
    """Each of our kernels lands in the category of what it does (none in "other")."""
    assert bench_step.categorize(name) == cat
