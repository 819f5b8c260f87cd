"""Static checks of the row-norm kernels' sm_90 code (compiled on the CPU, no GPU): the fold's
``tl.reduce`` gets the layout its bitwise argument needs (thread t = lane + 32 * warp along the
reduced axis, one element per thread) and lowers to butterfly shuffles at 16, 8, 4, 2, 1 per row
then 2, 1 across warps; no spills, vector loads/stores, few layout conversions. Kernels: the
LayerNorm+modulate kernel (Welford states) and Wan's RMSNorm+RoPE (sums)."""

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
    # The runtime-loop kernels (widths above 3072, e.g. FLUX's large 5120) and the held-row
    # kernels the launchers pick for FLUX's 3072 (6 vectors per thread: R = 1) and Wan-1.3B's
    # 1536 (3: R = 1 plain, R = 2 gated and RoPE).
    out = subprocess.run([sys.executable, "-m", "tests.support.layernorm_codegen", "ln-R1-plain", "ln-R4-plain",
                          "ln-R4-gated", "lnpf-R4-plain", "lnpf-R4-gated", "ln-R1-plain-held6", "ln-R1-gated-held6", "ln-R1-plain-held3",
                          "ln-R2-gated-held3", "wanrope-R4-plain", "wanrope-R2-plain-held3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.fail(out.stderr[-3000:])
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_reduce_layout_is_one_thread_per_column(facts):
    for f in facts:
        lay = f["reduce_operand_layout"]
        assert lay is not None, f
        if lay.startswith("#ttg.linear"):  # R = 1: the same map written as a linear layout
            assert "lane = [[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]]" in lay, lay
            assert "warp = [[32, 0], [64, 0]]" in lay and "register = []" in lay, lay
        else:
            assert "sizePerThread = [1, 1]" in lay and "threadsPerWarp = [32, 1]" in lay, lay
            assert "warpsPerCTA = [4, 1]" in lay and "order = [0, 1]" in lay, lay


def test_shuffle_tree_order(facts):
    for f in facts:
        R = f["R"]
        n = 3 if f["kind"] in ("ln", "lnpf") else 1  # Welford: mean, m2, count per step; RMS: the sum
        lanes = [o for o in (16, 8, 4, 2, 1) for _ in range(n)]
        assert f["shfl_kinds"] == ["bfly"], f
        assert f["shfl_offsets"] == lanes * R + [2] * n + [1] * n, f["shfl_offsets"]


def test_no_spills_vector_memory(facts):
    for f in facts:
        assert f["local_bytes"] == 0, f
        # LayerNorm: the loads' layout throughout (at R = 1 the held kernel converts between two
        # equivalent layouts: no shared-memory traffic beyond the fold's); RoPE: split/join of
        # the pairs adds two
        assert f["convert_layout"] <= (4 if f["kind"] == "ln" else 4), f
        assert f["st_shared"] <= 3 * f["R"] + 3, f  # the cross-warp fold only
        assert f["bar_sync"] <= 2, f
        if f["kind"] in ("ln", "lnpf"):  # the RoPE kernel also gathers cos/sin element by element
            assert set(f["ld_global"]) == {"ld.global.v2.b32"}, f["ld_global"]
        assert set(f["st_global"]) == {"st.global.v2.b32"}, f["st_global"]
        assert f["rsqrt_approx"] == f["R"], f


def test_held_rows_issue_their_loads_first(facts):
    """The held-row kernels exist to have a whole row's loads in flight at once: at least 3/4 of
    the first pass's global loads come before the first FFMA (the runtime loop issues one
    step's, two with the prefetch)."""
    held = [f for f in facts if f["js"]]
    assert held
    for f in held:
        per_step = 3 if f["gated"] else 1
        assert f["ldg_before_first_ffma"] >= 0.75 * f["js"] * f["R"] * per_step, f
    for f in facts:
        if not f["js"]:
            per_step = f["R"] * (3 if f["gated"] else 1)
            if f["kind"] == "lnpf":  # the prefetch: step 1's loads are issued before step 0's math
                assert per_step < f["ldg_before_first_ffma"] <= 2 * per_step, f
            else:
                assert f["ldg_before_first_ffma"] <= per_step, f


@pytest.fixture(scope="module")
def warp_facts():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The warp-per-row kernels as launched (one row per one-warp program) at Wan-1.3B's 1536 (3
    # steps) and FLUX's 3072 (6), and with four rows (warps) per program, which the guard refuses.
    out = subprocess.run([sys.executable, "-m", "tests.support.layernorm_codegen", "lnwarp-R1-plain-held3",
                          "lnwarp-R1-gated-held3", "lnwarp-R1-plain-held6", "lnwarp-R1-gated-held6",
                          "wanropewarp-R1-plain-held3", "lnwarp-R4-plain-held3", "wanropewarp-R4-plain-held3",
                          "wanropepair-R1-plain-held3"],
                         cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.fail(out.stderr[-3000:])
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_warp_kernel_has_no_shared_memory_and_constant_fold(warp_facts):
    """One warp per row: the four logical warps' trees are butterflies at 16, 8, 4, 2, 1 (mean and
    m2 only: the counts are constants), the cross-warp tree stays in registers (no shared memory,
    no barrier), lane 0's result is broadcast, and the only IEEE division left is ``m2 / N``
    (every reciprocal of the Welford updates and of the fold is folded at compile time)."""
    assert len(warp_facts) == 8
    for f in warp_facts:
        if f["R"] != 1:
            continue
        n = 2 if f["kind"] == "lnwarp" else 1  # Welford: mean and m2 (no count); RMS: the sum
        rows = 2 if f["kind"] == "wanropepair" else 1  # q and k in one program
        assert f["shfl_kinds"] == ["bfly", "idx"], f
        assert sorted(f["shfl_offsets"]) == sorted(([16, 8, 4, 2, 1] * n * 4 + [0] * n) * rows), f["shfl_offsets"]
        assert f["bar_sync"] == 0 and f["st_shared"] == 0 and f["ld_shared"] == 0 and f["shared_bytes"] == 0, f
        assert f["div_rn_f32"] == rows, f
        assert f["rsqrt_approx"] == rows, f
        assert f["local_bytes"] == 0, f
        if f["kind"] == "lnwarp":  # the RoPE kernel also reads weights, cos and sin (fp32)
            assert set(f["ld_global"]) == {"ld.global.v2.b32"}, f["ld_global"]
        assert set(f["st_global"]) == {"st.global.v2.b32"}, f["st_global"]


def test_warp_kernel_issues_its_loads_first(warp_facts):
    """Most of the row's loads (4 tiles per step, 3 tensors when gated) are in flight before the
    first Welford FMA: at least 2/3 of them (ptxas starts the first logical warp's updates after
    17 of 24 loads at 3072, R = 1)."""
    for f in warp_facts:
        if f["kind"] != "lnwarp" or f["R"] != 1:
            continue
        per_step = 4 * (3 if f["gated"] else 1)
        assert f["ldg_before_first_ffma"] >= 2 / 3 * f["js"] * per_step, f


def test_warp_layout_guard(warp_facts):
    """The launched binaries lay the shuffled [1, 32] states out one element per lane, lane i
    holding element i (the guard accepts them); with four rows per program Triton spreads a
    warp's lanes over the rows (threadsPerWarp [4, 8]) and the guard refuses, so the launcher
    falls back to the 128-thread kernel instead of shuffling across rows."""
    for f in warp_facts:
        if f["R"] == 1:
            assert f["warp_layout_reason"] is None, f
        else:
            assert f["warp_layout_reason"] and "threadsPerWarp = [4, 8]" in f["warp_layout_reason"], f


def test_warp_layout_ok_judges_each_binary_once(monkeypatch):
    """warp_layout_ok reads a binary's TTGIR only the first time (one dict lookup per launch
    after that); a binary with no lane-major shuffles is refused; the interpreter (no binary)
    passes."""
    from types import SimpleNamespace

    from ditfuse.kernels.common import warp

    monkeypatch.setattr(warp, "_VERDICTS", {})
    reads = []

    class Asm(dict):
        def __getitem__(self, k):
            reads.append(k)
            return super().__getitem__(k)

    bad = SimpleNamespace(hash="h-bad", asm=Asm(ttgir="module {}"))
    assert not warp.warp_layout_ok(bad, "test") and not warp.warp_layout_ok(bad, "test")
    assert reads == ["ttgir"] and warp._VERDICTS["h-bad"] == "no shuffles found in the TTGIR"
    assert warp.warp_layout_ok(None, "test")


def test_pair_kernel_reads_the_tables_once(warp_facts):
    """q and k in one launch: twice the row loads and stores of the single kernel, the same
    number of cos/sin loads (fp32 vectors), every row load issued before the first FMA."""
    by = {f["kind"]: f for f in warp_facts if f["R"] == 1 and f["kind"].startswith("wanrope")}
    one, pair = by["wanropewarp"], by["wanropepair"]
    def count(f, op):
        return sum(1 for x in f["ld_global"] if x == op)
    assert count(pair, "ld.global.v2.b32") == 2 * count(one, "ld.global.v2.b32")
    assert count(pair, "ld.global.v4.b32") == count(one, "ld.global.v4.b32") > 0
    assert len(pair["st_global"]) == 2 * len(one["st_global"])
    assert pair["ldg_before_first_ffma"] >= 2 * 12


def test_ten_step_warp_rows_hold_without_spills():
    """LN_WARP_MAX_STEPS: at D = 5120 (10 steps) a LayerNorm + modulate row without a residual
    takes the warp-per-row kernel, which holds all ten steps' tiles in registers: no local memory
    (spills) in FLUX's bf16 configuration or Wan's fp32-modulation one, the fold's layout and its
    shuffles unchanged (one warp, no shared memory)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.support.layernorm_codegen", "lnwarp-R1-plain-held10",
                          "lnwarpwan-R1-plain-held10"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.fail(out.stderr[-3000:])
    facts = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [f["kind"] for f in facts] == ["lnwarp", "lnwarpwan"]
    for f in facts:
        assert f["js"] == 10 and f["local_bytes"] == 0, f
        assert f["regs"] <= 255 and f["warp_layout_reason"] is None, f
        assert f["st_shared"] == 0 and f["bar_sync"] == 0, f
        assert f["shfl_kinds"] == ["bfly", "idx"], f  # the butterflies, then lane 0's broadcast
