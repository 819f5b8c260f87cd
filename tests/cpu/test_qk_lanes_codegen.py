"""Static checks of the QK ops' vector-per-lane kernel on its sm_90 code (compiled on the CPU):
every launch the launcher builds passes the layout guard, folds with butterfly shuffles at
T/2 .. 1 per row (torch's lane tree), uses no shared memory, barrier or spill, and moves rows
with vector loads/stores; the guard refuses layouts that are not one row's lanes in one warp."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.support.qk_codegen"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.fail(out.stderr[-3000:])
    return {f["name"]: f for f in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}


def _launched(facts):
    return [f for n, f in facts.items() if not n.startswith("refused")]


def test_guard_accepts_every_launch_the_launcher_builds(facts):
    assert len(_launched(facts)) >= 9
    for f in _launched(facts):
        assert f["guard"] is None, f


def test_fold_is_the_lane_tree(facts):
    for f in _launched(facts):
        T, R, nw, V = f["T"], f["R"], f["warps"], f["V"]
        P = T // V  # threads per row; the tree's top levels (offsets >= P) are in-register adds
        tree = [o for o in (16, 8, 4, 2, 1) if o < P]
        # One tree per register row per tensor (q, k): R rows over nw warps of 32 / P rows each.
        regs_rows = R // (nw * (32 // P))
        assert f["shfl_kinds"] == ["bfly"], f
        assert f["shfl_offsets"] == tree * (2 * regs_rows), f
        assert f["rsqrt_approx"] == 2 * regs_rows, f


def test_no_shared_memory_no_spills_vector_rows(facts):
    for f in _launched(facts):
        assert f["st_shared"] == 0 and f["bar_sync"] == 0 and f["shared_bytes"] == 0, f
        assert f["local_bytes"] == 0, f
        assert f["st_global"] == ["st.global.v2.b32"], f  # 4 bf16 per lane and row
        loads = set(f["ld_global"])
        if f["name"] == "qwen-strided":  # the unpacked table gathers its floats one by one
            loads -= {"ld.global.b32"}
        assert loads <= {"ld.global.v2.b32", "ld.global.v4.b32"}, f
        # Two conversions remain, both of the [R] rstd between equivalent slice layouts (no
        # shared memory, as st_shared shows).
        assert f["convert_layout"] <= 2, f


def test_guard_refuses_split_layouts(facts):
    """Rows whose lanes Triton spreads over several warps: the fold is not one warp's butterfly
    (it crosses warps through shared memory), and the guard says so."""
    for name in ("refused-R1-w4", "refused-R2-w8"):
        assert facts[name]["guard"] and "lane axis" in facts[name]["guard"], facts[name]
        assert facts[name]["st_shared"] > 0, facts[name]


def test_virtual_lanes_cut_the_code(facts):
    """Two of torch's lanes per thread (V = 2, the default) halve the butterflies per row and need
    fewer instructions than one lane per thread at the same rows and warps."""
    assert facts["flux"]["V"] == 2 and facts["flux-V1"]["V"] == 1
    assert facts["flux"]["sass_instructions"] < facts["flux-V1"]["sass_instructions"]
    assert len(facts["flux"]["shfl_offsets"]) < len(facts["flux-V1"]["shfl_offsets"])
