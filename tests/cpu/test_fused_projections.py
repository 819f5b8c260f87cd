"""``fuse_qkv_projections()`` (one GEMM for q, k, v) before or after ``accelerate``: the fast
forwards take the projections from diffusers' own ``_get_qkv_projections``, which follows
``attn.fused_projections``, so the output stays bitwise diffusers' fused output. Reference chains
(``DITFUSE_DISABLE=all``): which code runs is under test. SD3's dual-attention blocks fail fused in
plain diffusers 0.42.1 (attn2 gets no encoder states), and Qwen-Image and Z-Image do not fuse
(no attention of theirs sets ``fused_projections``): those are left out."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal

from .test_handoff import CASES, _case_inputs


@pytest.mark.slow  # tiny models, reference chains: a few seconds each
@pytest.mark.parametrize("order", ["fuse_then_accelerate", "accelerate_then_fuse"])
@pytest.mark.parametrize("family", ["flux", "flux2", "wan"])
def test_fused_qkv_bitwise(family, order, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    build = CASES[family][0]
    twin = build(torch.bfloat16)
    inp = _case_inputs(family, twin, 1)
    twin.fuse_qkv_projections()
    assert any(getattr(m, "fused_projections", False) for m in twin.modules())
    with torch.no_grad():
        ref = twin(**inp)[0]
        m = build(torch.bfloat16)
        if order == "fuse_then_accelerate":
            m.fuse_qkv_projections()
            h = ditfuse.accelerate(m)
        else:
            h = ditfuse.accelerate(m)
            m(**inp)
            m.fuse_qkv_projections()
        try:
            assert_bitwise_equal(m(**inp)[0], ref, f"{family}: fused projections ({order})")
        finally:
            h.unmount()
