"""Proofs that each reference chain equals the diffusers module it stands for, bitwise.

Shared by tests/cpu/test_reference.py and tests/gpu/test_reference_gpu.py (device, dtype are
parameters), so the references cannot drift from diffusers on either device.
"""

from __future__ import annotations

import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal


def _rand(*shape, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def check_ada_layernorm_zero(device, dtype, B=2, S=7, D=48):
    from diffusers.models.normalization import AdaLayerNormZero

    torch.manual_seed(0)
    norm = AdaLayerNormZero(D).to(device=device, dtype=dtype)
    x, temb = _rand(B, S, D, device=device, dtype=dtype, seed=1), _rand(B, D, device=device, dtype=dtype, seed=2)
    with torch.no_grad():
        out, *_ = norm(x, emb=temb)
        shift, scale, *_ = norm.linear(norm.silu(temb)).chunk(6, dim=1)
        assert_bitwise_equal(ref.layernorm_modulate(x, scale, shift, norm.norm.eps), out, "AdaLayerNormZero")
        assert_bitwise_equal(ref.modulate(ref.layer_norm(x, 1e-6), scale, shift), out, "LN then modulate")


def check_ada_layernorm_zero_single(device, dtype, B=2, S=5, D=40):
    from diffusers.models.normalization import AdaLayerNormZeroSingle

    torch.manual_seed(0)
    norm = AdaLayerNormZeroSingle(D).to(device=device, dtype=dtype)
    x, temb = _rand(B, S, D, device=device, dtype=dtype, seed=3), _rand(B, D, device=device, dtype=dtype, seed=4)
    with torch.no_grad():
        out, gate = norm(x, emb=temb)
        shift, scale, _ = norm.linear(norm.silu(temb)).chunk(3, dim=1)
        assert_bitwise_equal(ref.layernorm_modulate(x, scale, shift, 1e-6), out, "AdaLayerNormZeroSingle")


def check_ada_layernorm_continuous(device, dtype, B=2, S=5, D=40):
    from diffusers.models.normalization import AdaLayerNormContinuous

    torch.manual_seed(0)
    norm = AdaLayerNormContinuous(D, D, elementwise_affine=False, eps=1e-6).to(device=device, dtype=dtype)
    x, c = _rand(B, S, D, device=device, dtype=dtype, seed=5), _rand(B, D, device=device, dtype=dtype, seed=6)
    with torch.no_grad():
        out = norm(x, c)
        scale, shift = norm.linear(norm.silu(c).to(x.dtype)).chunk(2, dim=1)  # scale first
        assert_bitwise_equal(ref.layernorm_modulate(x, scale, shift, 1e-6), out, "AdaLayerNormContinuous")


def check_rope(device, dtype, B=2, S=9, H=3, D=16):
    from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed

    x = _rand(B, S, H, D, device=device, dtype=dtype, seed=7)
    cos, sin = get_1d_rotary_pos_embed(D, torch.arange(S, dtype=torch.float32), repeat_interleave_real=True,
                                       use_real=True, freqs_dtype=torch.float64)
    cos, sin = cos.to(device), sin.to(device)
    assert cos.dtype == torch.float32
    assert_bitwise_equal(ref.rope_interleaved(x, cos, sin), apply_rotary_emb(x, (cos, sin), sequence_dim=1), "rope")


def check_qk_rmsnorm_rope(device, dtype, B=2, S_img=6, S_txt=3, H=2, D=16):
    """The processor's norm -> cat -> rope sequence, reproduced from FluxAttention's own modules."""
    from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    attn = FluxAttention(query_dim=H * D, heads=H, dim_head=D, added_kv_proj_dim=H * D, bias=True, eps=1e-6).to(device, dtype)
    for n in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        torch.nn.init.normal_(n.weight, 1.0, 0.2)
    q, k = _rand(B, S_img, H, D, device=device, dtype=dtype, seed=8), _rand(B, S_img, H, D, device=device, dtype=dtype, seed=9)
    qt, kt = _rand(B, S_txt, H, D, device=device, dtype=dtype, seed=10), _rand(B, S_txt, H, D, device=device, dtype=dtype, seed=11)
    cos, sin = get_1d_rotary_pos_embed(D, torch.arange(S_txt + S_img, dtype=torch.float32), repeat_interleave_real=True,
                                       use_real=True, freqs_dtype=torch.float64)
    cos, sin = cos.to(device), sin.to(device)
    with torch.no_grad():
        eq = apply_rotary_emb(torch.cat([attn.norm_added_q(qt), attn.norm_q(q)], 1), (cos, sin), sequence_dim=1)
        ek = apply_rotary_emb(torch.cat([attn.norm_added_k(kt), attn.norm_k(k)], 1), (cos, sin), sequence_dim=1)
        got = ref.qk_rmsnorm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, 1e-6, qt, kt,
                                  attn.norm_added_q.weight, attn.norm_added_k.weight)
        assert_bitwise_equal(got, (eq, ek), "qk_rmsnorm_rope")
        single = ref.qk_rmsnorm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, cos[:S_img], sin[:S_img], 1e-6)
        assert_bitwise_equal(single[0], apply_rotary_emb(attn.norm_q(q), (cos[:S_img], sin[:S_img]), sequence_dim=1))


def check_gelu(device, dtype):
    from diffusers.models.activations import GELU

    x = _rand(3, 5, 24, device=device, dtype=dtype, seed=12) * 4
    act = torch.nn.GELU(approximate="tanh")
    assert_bitwise_equal(ref.gelu_tanh(x), act(x), "nn.GELU(tanh)")
    g = GELU(8, 24, approximate="tanh").to(device, dtype)
    with torch.no_grad():
        assert_bitwise_equal(ref.gelu_tanh(g.proj(x[..., :8])), g(x[..., :8]), "diffusers GELU")
    mlp = _rand(3, 5, 24, device=device, dtype=dtype, seed=13)
    assert_bitwise_equal(ref.single_block_mlp_cat(x, mlp), torch.cat([x, act(mlp)], dim=2), "cat")


def check_wan_chains(device, dtype, B=2, S=7, D=48):
    """Wan's FP32LayerNorm chains (diffusers' spelling) == the references with norm_dtype=fp32."""
    from diffusers.models.normalization import FP32LayerNorm

    torch.manual_seed(0)
    x = _rand(B, S, D, device=device, dtype=dtype, seed=14)
    attn = _rand(B, S, D, device=device, dtype=dtype, seed=15)
    for table_dtype in (torch.float32, dtype):  # from_pretrained keeps it fp32; .to(dtype) does not
        mods = (_rand(1, 6, D, device=device, dtype=table_dtype, seed=16)
                + _rand(B, 6, D, device=device, dtype=dtype, seed=17).float()).chunk(6, dim=1)
        shift, scale, gate = mods[:3]
        norm1 = FP32LayerNorm(D, 1e-6, elementwise_affine=False).to(device)
        norm2 = FP32LayerNorm(D, 1e-6, elementwise_affine=True).to(device, table_dtype)
        torch.nn.init.normal_(norm2.weight, 1.0, 0.2)
        torch.nn.init.normal_(norm2.bias, 0.0, 0.2)
        with torch.no_grad():
            n1 = (norm1(x.float()) * (1 + scale) + shift).type_as(x)
            assert_bitwise_equal(ref.layernorm_modulate(x, scale, shift, 1e-6, norm_dtype=torch.float32), n1, "norm1")
            h = (x.float() + attn * gate).type_as(x)
            n2 = norm2(h.float()).type_as(h)
            got = ref.gate_residual_layernorm_modulate(x, gate, attn, None, None, 1e-6, norm2.weight, norm2.bias,
                                                       torch.float32)
            assert_bitwise_equal(got, (h, n2), "gate residual + norm2")
            h2 = h + attn
            n3 = (norm1(h2.float()) * (1 + mods[4]) + mods[3]).type_as(h2)
            got = ref.gate_residual_layernorm_modulate(h, None, attn, mods[4], mods[3], 1e-6, norm_dtype=torch.float32)
            assert_bitwise_equal(got, (h2, n3), "residual + norm3")
            ff = attn
            out = (h2.float() + ff.float() * mods[5]).type_as(h2)
            assert_bitwise_equal(ref.gate_residual(h2, mods[5], ff), out, "ff gate residual")
            # the model tail: temb + a [1, 2, D] table, chunk(2, dim=1)
            tail_shift, tail_scale = (_rand(1, 2, D, device=device, dtype=table_dtype, seed=18)
                                      + _rand(B, D, device=device, dtype=dtype, seed=19).unsqueeze(1)).chunk(2, dim=1)
            tail = (norm1(x.float()) * (1 + tail_scale) + tail_shift).type_as(x)
            assert_bitwise_equal(ref.layernorm_modulate(x, tail_scale, tail_shift, 1e-6, norm_dtype=torch.float32),
                                 tail, "norm_out tail")


def check_model_with_references(model, inputs, label="transformer"):
    """The adapter's fast forwards with every op on its reference chain (DITFUSE_DISABLE=all)
    reproduce the diffusers model bitwise: proves the chains as the fast forwards call them."""
    import ditfuse

    with torch.no_grad():
        base = model(**inputs)[0]
        handle = ditfuse.accelerate(model)
        try:
            assert handle.report().components[0].status == "mounted"
            got = model(**inputs)[0]
        finally:
            handle.unmount()
    assert_bitwise_equal(got, base, f"{label} (reference chains)")


def check_flux_blocks_with_references(model, inputs):
    """The adapter's fast forwards with every op on its reference chain (DITFUSE_DISABLE=all)
    reproduce the diffusers blocks bitwise: proves the gate-residual / LN chains too."""
    import ditfuse

    with torch.no_grad():
        base = model(**inputs)[0]
        handle = ditfuse.accelerate(model)
        try:
            got = model(**inputs)[0]
        finally:
            handle.unmount()
    assert_bitwise_equal(got, base, "flux transformer (reference chains)")


ALL = [
    check_ada_layernorm_zero,
    check_ada_layernorm_zero_single,
    check_ada_layernorm_continuous,
    check_rope,
    check_qk_rmsnorm_rope,
    check_gelu,
    check_wan_chains,
]
