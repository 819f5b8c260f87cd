"""Fused outputs in eager's memory layout (kernels/common/host.py ``in_eager_layout``): the
residual sum of a transposed residual (SD3's stream after PatchEmbed) is transposed in eager, and
the SD3 QK chain without text keeps q / k's layout. Same values and same strides as the eager chain,
under the interpreter (the kernels' host code is what decides the layout)."""

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal, effective_strides
from ditfuse.kernels.modulate.gate_residual_triton import gate_residual
from ditfuse.kernels.norm.layernorm_modulate_triton import gate_residual_layernorm_modulate
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import qk_rmsnorm_diffusers_cat


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _transposed(B, S, D, dtype=torch.bfloat16):
    return torch.randn(B, D, S, dtype=dtype).transpose(1, 2)  # [B, S, D], D not innermost


@pytest.mark.parametrize("B,S,D", [(1, 12, 16), (2, 37, 48)])
def test_gate_residual_keeps_a_transposed_residual_layout(B, S, D):
    torch.manual_seed(0)
    r, u, g = _transposed(B, S, D), torch.randn(B, S, D, dtype=torch.bfloat16), torch.randn(B, D, dtype=torch.bfloat16)
    got, want = gate_residual(r, g, u), ref.gate_residual(r, g, u)
    assert_bitwise_equal(got, want, "gate_residual")
    assert effective_strides(got) == effective_strides(want) == effective_strides(r)
    c = r.contiguous()  # a contiguous residual: no copy, the kernel's own buffer
    assert gate_residual(c, g, u).is_contiguous()


@pytest.mark.parametrize("B,S,D", [(1, 12, 16), (2, 37, 64)])
def test_gated_layernorm_residual_output_keeps_the_layout(B, S, D):
    torch.manual_seed(1)
    r, u = _transposed(B, S, D), torch.randn(B, S, D, dtype=torch.bfloat16)
    g, sc, sh = (torch.randn(B, D, dtype=torch.bfloat16) for _ in range(3))
    h, out = gate_residual_layernorm_modulate(r, g, u, sc, sh, 1e-6)
    hw, ow = ref.gate_residual_layernorm_modulate(r, g, u, sc, sh, 1e-6)
    assert_bitwise_equal((h, out), (hw, ow), "gated LN")
    assert effective_strides(h) == effective_strides(hw) == effective_strides(r)
    assert out.is_contiguous() and effective_strides(out) == effective_strides(ow)


def test_sd3_qk_without_text_keeps_the_projection_layout():
    torch.manual_seed(2)
    B, S, H, D = 1, 12, 2, 64
    q = torch.randn(B, S, H * D, dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    k = torch.randn(B, S, H * D, dtype=torch.bfloat16).view(B, S, H, D).transpose(1, 2)
    w = torch.randn(D, dtype=torch.bfloat16)
    got = qk_rmsnorm_diffusers_cat(q, k, w, w, 1e-6)
    want = ref.qk_rmsnorm_diffusers_cat(q, k, w, w, 1e-6)
    for a, e, src in zip(got, want, (q, k)):
        assert effective_strides(a) == effective_strides(e) == effective_strides(src)


def test_gate_routes_a_layout_difference_to_eager_for_that_signature_only():
    """A kernel whose output is contiguous where eager keeps channels-last (group_norm_silu on a
    channels-last AutoencoderKL): the gate hands that signature to eager, and the op stays on
    for NCHW inputs (docs/numerics.md, "Layout counts too")."""
    from ditfuse.contracts.bitexact import BitExactGate
    from ditfuse.kernels.compare import layout_mismatch
    from ditfuse.kernels.norm.group_norm_silu_triton import group_norm_silu

    torch.manual_seed(3)
    x_cl = torch.randn(2, 16, 9, 7).to(memory_format=torch.channels_last)
    w, b = torch.randn(16), torch.randn(16)
    k_out, r_out = group_norm_silu(x_cl, 4, w, b, 1e-6, True), ref.group_norm_silu(x_cl, 4, w, b, 1e-6, True)
    assert k_out.is_contiguous() and r_out.is_contiguous(memory_format=torch.channels_last)
    assert layout_mismatch(k_out, r_out) is not None
    g = BitExactGate()
    g.is_compiling = g.is_capturing = lambda: False
    # eager's values written contiguous: what the kernel does, minus the CPU's summation order
    contiguous_eager = lambda *a: ref.group_norm_silu(*a).contiguous()  # noqa: E731
    out = g.call("t.gn", ("cl",), contiguous_eager, ref.group_norm_silu, x_cl, 4, w, b, 1e-6, True)
    assert out.is_contiguous(memory_format=torch.channels_last) and not g.is_disabled("t.gn")
    assert g.report().calls["t.gn"]["layout"] == 1
