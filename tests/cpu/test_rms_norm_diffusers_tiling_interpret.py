"""norm.rms_norm_diffusers_triton: the launch's tiling never changes bits (TRITON_INTERPRET=1).

``_launch(mode, ..., block_rows, num_warps, readback)`` picks how many rows a program holds, its
warps, and (MODE 2) whether the last pass re-reads the stored ``h`` instead of recomputing it.
Each row's arithmetic order is fixed by the chunk loop, so every launch must give the default
launch's bits: awkward row counts (1 and 7 rows take more than 32 lanes per row, 37 takes 32
lanes and leaves a partial last program), Z-Image's width and small ones, and Z-Image's operand
layout (gate and scale are ``[B, 1, D]`` chunks of one ``[B, 1, 4D]`` modulation tensor). The
default launch itself is checked against the CUDA-order simulation in
test_rms_norm_diffusers_interpret.py; the GPU probe bench/probes/probe_rms_diffusers_tiling.py
checks every swept launch against the default on the H200. The interpreter ignores
``num_warps``: here it only checks that the argument is accepted; ``block_rows`` and
``readback`` change the interpreted program.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.norm import rms_norm_diffusers_triton as mod

EPS = 1e-6

# (block_rows, num_warps, readback); None: the default launch's choice. The interpreter's time
# grows with programs x chunks: launches with many small programs are skipped on wide rows.
LAUNCHES = [(1, 1, False), (2, 8, True), (32, 2, True), (8, None, True)]


def _operands(B, S, D, g, nan=False):
    s = torch.exp(torch.randn(B, S, 1, generator=g) * 1.5)
    x = (torch.randn(B, S, D, generator=g) * s).to(torch.bfloat16)
    r = (torch.randn(B, S, D, generator=g) * 4).to(torch.bfloat16)
    mods = (torch.randn(B, 1, 4 * D, generator=g) * 0.5).to(torch.bfloat16)
    scale_msa, gate_msa, scale_mlp, gate_mlp = mods.chunk(4, dim=2)  # Z-Image's [B, 1, D] views
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16)
    w2 = (1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16)
    if nan:
        x[0, 0, 5] = float("nan")
        r[-1, -1, 2] = float("inf")
        gate_mlp[0, 0, 1] = float("nan")
    return x, r, gate_mlp, scale_mlp, w, w2


def _run(mode, ops, launch):
    x, r, gate, scale, w, w2 = ops
    br, nw, rb = launch
    if mode == 0:
        return mod._launch(0, x, None, None, scale, w, None, EPS, br, nw, rb)[:1]
    if mode == 1:
        return mod._launch(1, x, r, gate, None, w, None, EPS, br, nw, rb)[1:]
    return mod._launch(2, x, r, gate, scale, w, w2, EPS, br, nw, rb)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("B,S,D", [(1, 1, 3840), (1, 7, 3840), (2, 8, 3840), (1, 37, 96), (1, 37, 256),
                                   (2, 7, 96), (1, 1, 256)])
def test_launch_tiling_is_bitwise_neutral(mode, B, S, D):
    """16 rows at D 3840 is Z-Image's launch (32 lanes x 4-vectors, 30 chunks, 16 rows per
    program by default): one program of 32 rows (half masked) and two of 8 against the default's
    one of 16. 37 rows leave a partial last program at most tilings."""
    ops = _operands(B, S, D, torch.Generator().manual_seed(1000 * mode + 10 * S + D % 97))
    assert ops[2].stride() == (4 * D, 4 * D, 1) and ops[3].stride() == (4 * D, 4 * D, 1)
    want = _run(mode, ops, (None, None, None))
    rows = B * S
    for launch in LAUNCHES:
        W, VEC, _ = mod.reduce_launch(D, rows)
        if launch[0] and -(-rows // launch[0]) * -(-D // (W * VEC)) > 64:
            continue  # more than 64 program-chunks: slow under the interpreter
        got = _run(mode, ops, launch)
        for i, (a, e) in enumerate(zip(got, want)):
            assert_bitwise_equal(a, e, f"mode {mode} [{B},{S},{D}] launch {launch} output {i}")


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_tiling_with_nan_inf_rows(mode):
    """A NaN/Inf row stays NaN/Inf in place whichever launch (and the read-back of a NaN h)."""
    ops = _operands(2, 5, 256, torch.Generator().manual_seed(7), nan=True)
    want = _run(mode, ops, (None, None, None))
    assert torch.isnan(want[-1].float()).any()
    for launch in ((1, 2, True), (16, 8, True), (4, 4, False)):
        for i, (a, e) in enumerate(zip(_run(mode, ops, launch), want)):
            assert_bitwise_equal(a, e, f"mode {mode} launch {launch} output {i}")


def test_readback_equal_on_other_dtypes():
    """fp16 and fp32 rows: the stored h widens back exactly, so read-back equals recompute."""
    for dtype in (torch.float16, torch.float32):
        g = torch.Generator().manual_seed(3)
        x, r, gate, scale, w, w2 = (t.to(dtype) for t in _operands(2, 6, 128, g))
        if dtype == torch.float32:
            w = w2 = None
        a = mod._launch(2, x, r, gate, scale, w, w2, EPS, None, None, False)
        b = mod._launch(2, x, r, gate, scale, w, w2, EPS, 2, 2, True)
        for i in range(2):
            assert_bitwise_equal(b[i], a[i], f"{dtype} output {i}")


def test_block_rows_must_be_power_of_two():
    x = torch.zeros(1, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        mod._launch(0, x, None, None, None, None, None, EPS, 3)
