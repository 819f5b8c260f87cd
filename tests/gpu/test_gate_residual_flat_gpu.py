"""modulate.gate_residual's flat per-sample launch (the default where it applies;
DITFUSE_GATE_RESIDUAL_FLAT=0 turns it off) on CUDA: bitwise against the eager chain at Wan's and FLUX's shapes (fp32 [B, 1, D]
and bf16 [B, D] gates), widths 1536 / 3072 / 5120 / 3077, tokens 1 / 17 / 4608 / 32760, batch 1 and
2, with NaN / Inf / -0.0 in every operand."""

from __future__ import annotations

import itertools

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import gate_residual_triton as gr
from tests.support.specials import with_specials


@pytest.mark.parametrize("wan", [True, False], ids=["wan-fp32-gate", "flux-bf16-gate"])
def test_flat_matches_eager(monkeypatch, wan):
    monkeypatch.setenv("DITFUSE_GATE_RESIDUAL_FLAT", "1")
    gr._RECIPES.clear()
    gen = torch.Generator(device="cuda").manual_seed(11)
    failures = []
    try:
        for D, S, B in itertools.product((1536, 3072, 5120, 3077), (1, 17, 4608, 32760), (1, 2)):
            if S == 32760 and D != 1536:
                continue
            x = with_specials(torch.randn(B, S, D, generator=gen, device="cuda").to(torch.bfloat16))
            u = with_specials(torch.randn(B, S, D, generator=gen, device="cuda").to(torch.bfloat16))
            gshape, gdt = ((B, 1, D), torch.float32) if wan else ((B, D), torch.bfloat16)
            g = with_specials(torch.randn(gshape, generator=gen, device="cuda").to(gdt))
            assert gr._recipe(x, g, u)[0] is gr._gate_residual_flat_kernel
            mm = compare_outputs(gr.gate_residual(x, g, u), ref.gate_residual(x, g, u), f"B={B} S={S} D={D}")
            if mm is not None:
                failures.append(str(mm))
    finally:
        gr._RECIPES.clear()
    assert not failures, "\n".join(failures)
