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


def test_an_op_owning_its_layout_is_compared_by_value():
    """``layout.conv_channels_last`` writes channels-last by design (the Wan VAE's decoder site
    keeps the decode channels-last and returns it contiguous); its reference, NCHW's way, writes
    contiguous. The gate compares such an op's values only (OpDescriptor.own_layout): round 12's
    stride check had sent every Wan VAE convolution back to eager (found by the round-13 GPU run)."""
    from ditfuse.contracts import ops  # noqa: F401  (registers the descriptors with the gate)
    from ditfuse.contracts.bitexact import BitExactGate, gate
    from ditfuse.kernels.layout import CONV_CHANNELS_LAST

    assert CONV_CHANNELS_LAST.own_layout and "layout.conv_channels_last" in gate._own_layout
    torch.manual_seed(4)
    x_cl = torch.randn(2, 8, 6, 5).to(memory_format=torch.channels_last)
    w, b = torch.randn(4, 8, 3, 3), torch.randn(4)
    ref_conv = lambda x, w, b: torch.nn.functional.conv2d(x.contiguous(), w, b, 1, 1)  # noqa: E731
    cl_conv = lambda x, w, b: ref_conv(x, w, b).contiguous(memory_format=torch.channels_last)  # noqa: E731
    for owned in (True, False):
        g = BitExactGate()
        g.is_compiling = g.is_capturing = lambda: False
        if owned:
            g.owns_layout("t.conv")
        g.call("t.conv", ("sig",), cl_conv, ref_conv, x_cl, w, b)
        rep = g.report()
        assert bool(rep.verified.get("t.conv")) is owned
        assert rep.calls["t.conv"].get("layout", 0) == (0 if owned else 1)
        # a verified owned signature then runs the kernel, in its own layout
        out = g.call("t.conv", ("sig",), cl_conv, ref_conv, x_cl, w, b)
        assert out.is_contiguous(memory_format=torch.channels_last) is owned
