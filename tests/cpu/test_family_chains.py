"""Issue 12 families (Qwen-Image, SD3/3.5, FLUX.2, Z-Image): every eager chain between GEMMs and
attention equals, bitwise, a ditfuse reference function — the existing ones in
ditfuse.kernels.reference where the math is FLUX.1's, the proposed ones in
ditfuse.kernels.reference (its "image families" section) where it differs (notes/families.md has the map).

Three levels: (1) module / function units against the diffusers module that runs the chain;
(2) each block type's forward rebuilt from reference chains + the block's own Linear layers and
diffusers' attention call, against the diffusers block; (3) whole tiny transformers with every
block (and the final norm) running its rebuilt forward, against the plain transformer. Level 2
is the blueprint of the adapters' fast forwards. CPU, fp32 and bf16, tiny shapes.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from ditfuse.kernels import reference as ref
from ditfuse.kernels import reference as rf
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.models import image_family_configs as fc

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _randomize_norm_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights start at ones; make them random so a wrong weight order would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))


def _tiny(name: str, dtype) -> torch.nn.Module:
    m = fc.build(name, "tiny", dtype=dtype)
    _randomize_norm_weights(m)
    return m


# =============================================================================================
# (1) units
# =============================================================================================


@pytest.mark.parametrize(
    "x_dtype,w_kind",
    [
        (torch.float32, "same"),
        (torch.bfloat16, "same"),
        (torch.float16, "same"),
        (torch.bfloat16, "fp32"),  # weights kept in fp32 under a bf16 model: fp32 output
        (torch.bfloat16, "none"),  # elementwise_affine=False: one rounding
        (torch.bfloat16, "bias"),
        (torch.float32, "none"),
    ],
)
@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 7, 3, 16), (2, 13, 96), (1, 5, 120)], ids=str)
def test_rms_norm_diffusers_equals_module(x_dtype, w_kind, shape):
    from diffusers.models.normalization import RMSNorm

    d = shape[-1]
    m = RMSNorm(d, eps=1e-6, elementwise_affine=w_kind != "none", bias=w_kind == "bias")
    with torch.no_grad():
        if m.weight is not None:
            m.weight.copy_(_rand(d, seed=1, scale=0.3) + 1)
        if m.bias is not None:
            m.bias.copy_(_rand(d, seed=2, scale=0.1))
    m = m.to(torch.float32 if w_kind == "fp32" else x_dtype)
    x = _rand(*shape, dtype=x_dtype, seed=3, scale=3.0)
    with torch.no_grad():
        out = m(x)
        got = rf.rms_norm_diffusers(x, m.weight, m.eps, m.bias)
    assert out.dtype == (torch.float32 if w_kind == "fp32" else x_dtype)
    assert_bitwise_equal(got, out, "diffusers RMSNorm")


def test_rms_norm_diffusers_is_not_torch_rms_norm():
    """Two roundings vs one: the two RMSNorm classes are never interchangeable in bf16."""
    from diffusers.models.normalization import RMSNorm

    m = RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_((_rand(128, seed=1, scale=0.3) + 1).to(torch.bfloat16))
    x = _rand(64, 128, dtype=torch.bfloat16, seed=4, scale=2.0)
    with torch.no_grad():
        mm = first_mismatch(ref.rms_norm(x, m.weight, 1e-6), m(x))
    assert mm is not None and mm.count > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "zero_cond_t"])
def test_qwen_modulate_is_layernorm_modulate(dtype, per_token):
    """QwenImageTransformerBlock: img_norm1/txt_norm1 + ``_modulate`` (shift, scale, gate order);
    with ``zero_cond_t`` the modulation is selected per token by ``modulate_index``."""
    m = _tiny("qwenimage", dtype)
    block = m.transformer_blocks[0]
    B, S, D = 2, 11, block.dim
    x = _rand(B, S, D, dtype=dtype, seed=5)
    temb = _rand(2 * B if per_token else B, D, dtype=dtype, seed=6)
    index = (torch.arange(S)[None].expand(B, S) >= 4).to(torch.int) if per_token else None
    with torch.no_grad():
        mod1, mod2 = block.img_mod(temb).chunk(2, dim=-1)
        for mod in (mod1, mod2):
            out, gate = block._modulate(block.img_norm1(x), mod, index)
            shift, scale, g = mod.chunk(3, dim=-1)
            if per_token:
                sel = (index == 0).unsqueeze(-1)
                shift = torch.where(sel, shift[:B, None], shift[B:, None])
                scale = torch.where(sel, scale[:B, None], scale[B:, None])
                g = torch.where(sel, g[:B, None], g[B:, None])
            assert_bitwise_equal(ref.layernorm_modulate(x, scale, shift, block.img_norm1.eps), out, "qwen modulate")
            assert_bitwise_equal(g if per_token else g[:, None], gate, "qwen gate")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fhw,txt", [((1, 1, 1), 1), ((1, 3, 5), 7), ((1, 4, 4), 2)], ids=str)
def test_qwen_rope_complex_equals_apply_rotary_emb_qwen(dtype, fhw, txt):
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    m = _tiny("qwenimage", dtype)
    img_freqs, txt_freqs = m.pos_embed([fhw], max_txt_seq_len=txt, device=torch.device("cpu"))
    assert img_freqs.dtype == torch.complex64 and txt_freqs.dtype == torch.complex64
    H, Dh = 2, m.config.attention_head_dim
    for seed, (freqs, S) in enumerate(((img_freqs, fhw[0] * fhw[1] * fhw[2]), (txt_freqs, txt))):
        for B in (1, 2):
            x = _rand(B, S, H, Dh, dtype=dtype, seed=10 + seed, scale=3.0)
            assert_bitwise_equal(rf.rope_complex(x, freqs), apply_rotary_emb_qwen(x, freqs, use_real=False), "rope_complex")


_X86_FMA = platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.skipif(not _X86_FMA, reason="the contraction under test is GCC's for x86 AVX2/AVX-512 builds")
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 5, 3, 16), (1, 7, 2, 128)], ids=str)
def test_complex_mul_rounding_models_on_cpu(shape):
    """torch's complex64 multiply rounds differently by code path, and each path matches one
    real-arithmetic model: the AVX loop (contiguous operands, full vectors) has no FMA, which is
    FLUX's ``rope_interleaved``; the scalar ``c10::complex`` loop (forced here by strided freqs)
    is ``fma(a, c, -b*d)``, ``fma(a, d, b*c)`` (:func:`rope_complex_fma_model`). Which one CUDA
    runs is a GPU question (notes/families.md); fp32 inputs so the product roundings show."""
    B, S, H, D = shape
    x = _rand(B, S, H, D, seed=20, scale=3.0)
    ang = _rand(S, D, seed=21, scale=5.0)
    wide = torch.polar(torch.ones_like(ang), ang)
    strided = wide[:, ::2]  # [S, D/2], stride 2: TensorIterator cannot vectorize
    got = rf.rope_complex(x, strided)
    assert_bitwise_equal(rf.rope_complex_fma_model(x, strided.real, strided.imag), got, "scalar loop = fma model")
    if D // 2 >= 16:  # whole AVX-512 / AVX2 vectors per row
        contiguous = strided.contiguous()
        got = rf.rope_complex(x, contiguous)
        cos = contiguous.real.repeat_interleave(2, -1)
        sin = contiguous.imag.repeat_interleave(2, -1)
        assert_bitwise_equal(ref.rope_interleaved(x, cos, sin), got, "vector loop = no-fma model")
        assert first_mismatch(rf.rope_complex_fma_model(x, contiguous.real, contiguous.imag), got) is not None


def test_fma32_is_single_rounding():
    """fma32 against exact rational arithmetic. The last case is a double-rounding trap: the
    exact result is 1 + 2^-24 + 2^-70, just above the fp32 midpoint between 1 and 1 + 2^-23;
    rounding to fp64 first lands on the midpoint and ties-to-even would then give 1.0."""
    from fractions import Fraction

    a = torch.tensor([1.0 + 2**-23, 3.0, -1.5, 2.0**-20, 1.0, -(2.0**-24) * (1 - 2**-23)], dtype=torch.float32)
    b = torch.tensor([1.0 - 2**-23, 1.0 / 3.0, 2.0**30, 2.0**-20, 1.0, 1.0 + 2**-23], dtype=torch.float32)
    c = torch.tensor([-1.0, -1.0, 1.5 * 2.0**30, 2.0**-70, -(2.0**-60), 1.0 + 2**-23], dtype=torch.float32)
    naive = (a.double() * b.double() + c.double()).float()
    assert naive[-1].item() == 1.0  # the trap is real
    got = rf.fma32(a, b, c)
    assert got[-1].item() == 1.0 + 2**-23
    for i in range(a.numel()):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        want = torch.tensor(float(exact), dtype=torch.float64)  # correctly rounded to fp64 ...
        lo = want.float()
        # ... then to fp32 by hand: pick the fp32 neighbour nearest to the exact value (ties even).
        cand = [lo, torch.nextafter(lo, torch.tensor(float("inf"))), torch.nextafter(lo, torch.tensor(float("-inf")))]
        best = min(cand, key=lambda t: (abs(Fraction(t.item()) - exact), t.view(torch.int32).item() & 1))
        assert got[i].view(torch.int32).item() == best.view(torch.int32).item(), i


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sd35_ada_layernorm_zero_x_is_layernorm_dual_modulate(dtype):
    from diffusers.models.normalization import SD35AdaLayerNormZeroX

    torch.manual_seed(0)
    norm = SD35AdaLayerNormZeroX(24).to(dtype)
    x, temb = _rand(2, 7, 24, dtype=dtype, seed=30), _rand(2, 24, dtype=dtype, seed=31)
    with torch.no_grad():
        out, gate, shift_mlp, scale_mlp, gate_mlp, out2, gate2 = norm(x, emb=temb)
        chunks = norm.linear(norm.silu(temb)).chunk(9, dim=1)
        shift, scale, _, _, _, _, shift2, scale2, _ = chunks
        n1, n2 = rf.layernorm_dual_modulate(x, scale, shift, scale2, shift2, norm.norm.eps)
    assert_bitwise_equal((n1, n2), (out, out2), "SD35AdaLayerNormZeroX")
    assert_bitwise_equal((gate, shift_mlp, scale_mlp, gate_mlp, gate2), (chunks[2], chunks[3], chunks[4], chunks[5], chunks[8]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("inner", [1, 7, 85])
def test_swiglu_equals_flux2_and_zimage(dtype, inner):
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU
    from diffusers.models.transformers.transformer_z_image import FeedForward

    x = _rand(2, 5, 2 * inner, dtype=dtype, seed=40, scale=4.0)
    assert_bitwise_equal(rf.swiglu_halves(x), Flux2SwiGLU()(x), "Flux2SwiGLU")
    ff = FeedForward(8, inner)
    a, b = x[..., :inner], x[..., inner:]
    assert_bitwise_equal(rf.swiglu(a, b), ff._forward_silu_gating(a, b), "Z-Image silu gating")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_zimage_final_layer_is_layernorm_scale_not_modulate_with_zero_shift(dtype):
    from diffusers.models.transformers.transformer_z_image import FinalLayer

    torch.manual_seed(0)
    fl = FinalLayer(24, 12).to(dtype)
    c = _rand(2, 24, dtype=dtype, seed=50)
    x = _rand(2, 9, 24, dtype=dtype, seed=51, scale=2.0)
    x[:, 3] = 0.0  # a zero row: LN gives +0, times a negative scale gives -0
    with torch.no_grad():
        fl.adaLN_modulation[1].bias[:12] = -3.0
        raw = fl.adaLN_modulation(c)
        normed = fl.norm_final(x) * (1.0 + raw).unsqueeze(1)  # FinalLayer.forward minus the Linear
        got = rf.layernorm_scale(x, raw, fl.norm_final.eps)
        assert_bitwise_equal(got, normed, "FinalLayer norm * scale")
        assert_bitwise_equal(fl.linear(got), fl(x, c=c), "FinalLayer")
        zero_shift = ref.layernorm_modulate(x, raw, torch.zeros_like(raw), fl.norm_final.eps)
    assert torch.signbit(got[:, 3, :12]).all()  # -0.0 kept
    assert not torch.signbit(zero_shift[:, 3, :12]).any()  # r(-0.0 + 0) = +0.0
    assert first_mismatch(zero_shift, got) is not None


# =============================================================================================
# (2) block forwards rebuilt from reference chains
# =============================================================================================


def _dispatch(attn, q, k, v, mask=None, **kw):
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    return dispatch_attention_fn(
        q, k, v, attn_mask=mask, backend=attn.processor._attention_backend,
        parallel_config=attn.processor._parallel_config, **kw,
    )


# -- Qwen-Image -------------------------------------------------------------------------------


def qwen_attention(attn, img, txt, txt_mask, rotary):
    """QwenDoubleStreamAttnProcessor2_0 with the QK chain as one reference op."""
    mask = None
    if txt_mask is not None:
        ones = torch.ones(img.shape[:2], dtype=torch.bool, device=img.device)
        mask = torch.cat([txt_mask, ones], dim=1)[:, None, None, :]
    head_dim = attn.inner_dim // attn.heads

    def heads(t):
        return t.unflatten(-1, (-1, head_dim))

    q, k = rf.qk_rmsnorm_diffusers_rope_complex_cat(
        heads(attn.to_q(img)), heads(attn.to_k(img)), attn.norm_q.weight, attn.norm_k.weight,
        rotary[0], attn.norm_q.eps,
        heads(attn.add_q_proj(txt)), heads(attn.add_k_proj(txt)),
        attn.norm_added_q.weight, attn.norm_added_k.weight, rotary[1],
    )
    v = torch.cat([heads(attn.add_v_proj(txt)), heads(attn.to_v(img))], dim=1)
    out = _dispatch(attn, q, k, v, mask, dropout_p=0.0, is_causal=False).flatten(2, 3).to(q.dtype)
    s_txt = txt.shape[1]
    img_out = attn.to_out[1](attn.to_out[0](out[:, s_txt:].contiguous()))
    txt_out = attn.to_add_out(out[:, :s_txt].contiguous())
    return img_out, txt_out


def _ff_gelu(ff, x):
    """diffusers FeedForward("gelu-approximate"): Linear -> tanh-GELU -> Linear."""
    proj = ff.net[0].proj
    return ff.net[2](ff.net[1](ref.gelu_tanh(torch.nn.functional.linear(x, proj.weight, proj.bias))))


def qwen_block_forward(block, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                       image_rotary_emb=None, joint_attention_kwargs=None, modulate_index=None):
    assert not joint_attention_kwargs
    img_mod = block.img_mod(temb)
    if block.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_mod = block.txt_mod(temb)

    def split(mod, index):
        shift, scale, gate = mod.chunk(3, dim=-1)
        if index is None:
            return shift, scale, gate
        n = shift.shape[0] // 2
        sel = (index == 0).unsqueeze(-1)
        return tuple(torch.where(sel, t[:n, None], t[n:, None]) for t in (shift, scale, gate))

    (i_sh1, i_sc1, i_g1), (i_sh2, i_sc2, i_g2) = (split(m, modulate_index) for m in img_mod.chunk(2, dim=-1))
    (t_sh1, t_sc1, t_g1), (t_sh2, t_sc2, t_g2) = (split(m, None) for m in txt_mod.chunk(2, dim=-1))
    eps = block.img_norm1.eps
    img_n = ref.layernorm_modulate(hidden_states, i_sc1, i_sh1, eps)
    txt_n = ref.layernorm_modulate(encoder_hidden_states, t_sc1, t_sh1, eps)
    img_a, txt_a = qwen_attention(block.attn, img_n, txt_n, encoder_hidden_states_mask, image_rotary_emb)
    hidden_states, img_n = ref.gate_residual_layernorm_modulate(hidden_states, i_g1, img_a, i_sc2, i_sh2, eps)
    hidden_states = ref.gate_residual(hidden_states, i_g2, _ff_gelu(block.img_mlp, img_n))
    encoder_hidden_states, txt_n = ref.gate_residual_layernorm_modulate(encoder_hidden_states, t_g1, txt_a, t_sc2, t_sh2, eps)
    encoder_hidden_states = ref.gate_residual(encoder_hidden_states, t_g2, _ff_gelu(block.txt_mlp, txt_n))
    return encoder_hidden_states, hidden_states


def norm_out_forward(norm, x, conditioning_embedding):
    """AdaLayerNormContinuous (Qwen-Image, SD3, FLUX.2 norm_out; SD3's last norm1_context)."""
    emb = norm.linear(norm.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return ref.layernorm_modulate(x, scale, shift, norm.norm.eps)


def _qwen_inputs(m, dtype, batch, fhw, txt, masked, seed=60):
    inp = fc.step_inputs("qwenimage", m, batch=batch, height=16 * fhw[1], width=16 * fhw[2],
                         text_tokens=txt, dtype=dtype, seed=seed)
    if masked:
        mask = torch.ones(batch, txt, dtype=torch.bool)
        mask[-1, txt // 2 + 1:] = False
        inp["encoder_hidden_states_mask"] = mask
    return inp


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch,fhw,txt,masked", [(1, (1, 1, 1), 1, False), (2, (1, 3, 5), 7, True), (2, (1, 2, 2), 3, False)], ids=str)
def test_qwen_block_from_reference_chains(dtype, batch, fhw, txt, masked):
    m = _tiny("qwenimage", dtype)
    inp = _qwen_inputs(m, dtype, batch, fhw, txt, masked)
    blk = m.transformer_blocks[0]
    with torch.no_grad():
        h = m.img_in(inp["hidden_states"])
        e = m.txt_in(m.txt_norm(inp["encoder_hidden_states"]))
        temb = m.time_text_embed(inp["timestep"], h)
        rot = m.pos_embed(inp["img_shapes"], max_txt_seq_len=txt, device=h.device)
        mask = inp["encoder_hidden_states_mask"]
        want = blk(h, e, mask, temb, rot)
        got = qwen_block_forward(blk, h, e, mask, temb, rot)
    assert_bitwise_equal(got, want, "QwenImageTransformerBlock")


# -- SD3 / SD3.5 ------------------------------------------------------------------------------


def sd3_attention(attn, hidden_states, encoder_hidden_states=None):
    """JointAttnProcessor2_0: [B, H, S, D] layout, optional diffusers-RMSNorm QK norm, image-first
    concat, SDPA, split; the QK chain as one reference op."""
    B = hidden_states.shape[0]
    q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    head_dim = k.shape[-1] // attn.heads

    def heads(t):
        return t.view(B, -1, attn.heads, head_dim).transpose(1, 2)

    norm = attn.norm_q is not None
    wq = attn.norm_q.weight if norm else None
    wk = attn.norm_k.weight if norm else None
    eps = attn.norm_q.eps if norm else 0.0
    q, k, v = heads(q), heads(k), heads(v)
    if encoder_hidden_states is None:
        q, k = rf.qk_rmsnorm_diffusers_cat_heads_first(q, k, wq, wk, eps, norm=norm)
    else:
        tq = heads(attn.add_q_proj(encoder_hidden_states))
        tk = heads(attn.add_k_proj(encoder_hidden_states))
        tv = heads(attn.add_v_proj(encoder_hidden_states))
        q, k = rf.qk_rmsnorm_diffusers_cat_heads_first(
            q, k, wq, wk, eps, tq, tk,
            attn.norm_added_q.weight if norm else None, attn.norm_added_k.weight if norm else None, norm=norm,
        )
        v = torch.cat([v, tv], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(B, -1, attn.heads * head_dim).to(q.dtype)
    ctx = None
    if encoder_hidden_states is not None:
        s = hidden_states.shape[1]
        out, ctx = out[:, :s], out[:, s:]
        if not attn.context_pre_only:
            ctx = attn.to_add_out(ctx)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if encoder_hidden_states is None else (out, ctx)


def sd3_block_forward(block, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    assert not joint_attention_kwargs and block._chunk_size is None
    n1 = block.norm1
    emb = n1.linear(n1.silu(temb))
    if block.use_dual_attention:
        sh, sc, g, sh_mlp, sc_mlp, g_mlp, sh2, sc2, g2 = emb.chunk(9, dim=1)
        norm_h, norm_h2 = rf.layernorm_dual_modulate(hidden_states, sc, sh, sc2, sh2, n1.norm.eps)
    else:
        sh, sc, g, sh_mlp, sc_mlp, g_mlp = emb.chunk(6, dim=1)
        norm_h = ref.layernorm_modulate(hidden_states, sc, sh, n1.norm.eps)
    if block.context_pre_only:
        norm_e = norm_out_forward(block.norm1_context, encoder_hidden_states, temb)
    else:
        nc = block.norm1_context
        c_sh, c_sc, c_g, c_sh_mlp, c_sc_mlp, c_g_mlp = nc.linear(nc.silu(temb)).chunk(6, dim=1)
        norm_e = ref.layernorm_modulate(encoder_hidden_states, c_sc, c_sh, nc.norm.eps)
    attn_out, ctx_out = sd3_attention(block.attn, norm_h, norm_e)
    eps2 = block.norm2.eps
    if block.use_dual_attention:
        hidden_states = ref.gate_residual(hidden_states, g, attn_out)
        attn2_out = sd3_attention(block.attn2, norm_h2)
        hidden_states, norm_h = ref.gate_residual_layernorm_modulate(hidden_states, g2, attn2_out, sc_mlp, sh_mlp, eps2)
    else:
        hidden_states, norm_h = ref.gate_residual_layernorm_modulate(hidden_states, g, attn_out, sc_mlp, sh_mlp, eps2)
    hidden_states = ref.gate_residual(hidden_states, g_mlp, _ff_gelu(block.ff, norm_h))
    if block.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_e = ref.gate_residual_layernorm_modulate(
        encoder_hidden_states, c_g, ctx_out, c_sc_mlp, c_sh_mlp, block.norm2_context.eps
    )
    encoder_hidden_states = ref.gate_residual(encoder_hidden_states, c_g_mlp, _ff_gelu(block.ff_context, norm_e))
    return encoder_hidden_states, hidden_states


@pytest.mark.parametrize("name", ["sd35", "sd3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch,hw,txt", [(1, (2, 2), 1), (2, (6, 10), 7)], ids=str)
def test_sd3_blocks_from_reference_chains(name, dtype, batch, hw, txt):
    m = _tiny(name, dtype)
    inp = fc.step_inputs(name, m, batch=batch, height=8 * hw[0], width=8 * hw[1], text_tokens=txt, dtype=dtype, seed=70)
    with torch.no_grad():
        h = m.pos_embed(inp["hidden_states"]).contiguous()
        temb = m.time_text_embed(inp["timestep"], inp["pooled_projections"])
        e = m.context_embedder(inp["encoder_hidden_states"])
        for i, blk in enumerate(m.transformer_blocks):  # dual, plain, context_pre_only (sd35)
            want = blk(h, e, temb)
            got = sd3_block_forward(blk, h, e, temb)
            assert_bitwise_equal(got[1], want[1], f"block {i} image")
            if want[0] is None:
                assert got[0] is None
            else:
                assert_bitwise_equal(got[0], want[0], f"block {i} text")
            e, h = want


# -- FLUX.2 ------------------------------------------------------------------------------------


def flux2_attention(attn, hidden_states, encoder_hidden_states, image_rotary_emb):
    """Flux2AttnProcessor: torch.nn.RMSNorm QK norms, text-first concat, interleaved fp32 RoPE on
    the joint tensors — FLUX.1's ``qk_rmsnorm_rope``."""
    cos, sin = image_rotary_emb

    def heads(t):
        return t.unflatten(-1, (-1, attn.head_dim))

    q, k = ref.qk_rmsnorm_rope(
        heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), attn.norm_q.weight, attn.norm_k.weight,
        cos, sin, attn.norm_q.eps, heads(attn.add_q_proj(encoder_hidden_states)),
        heads(attn.add_k_proj(encoder_hidden_states)), attn.norm_added_q.weight, attn.norm_added_k.weight,
    )
    v = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), heads(attn.to_v(hidden_states))], dim=1)
    out = _dispatch(attn, q, k, v).flatten(2, 3).to(q.dtype)
    s_txt = encoder_hidden_states.shape[1]
    ctx, out = out.split_with_sizes([s_txt, out.shape[1] - s_txt], dim=1)
    return attn.to_out[1](attn.to_out[0](out)), attn.to_add_out(ctx)


def _flux2_ff(ff, x):
    return ff.linear_out(rf.swiglu_halves(ff.linear_in(x)))


def flux2_block_forward(block, hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt,
                        image_rotary_emb=None, joint_attention_kwargs=None):
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    assert not joint_attention_kwargs
    (sh, sc, g), (sh_mlp, sc_mlp, g_mlp) = Flux2Modulation.split(temb_mod_img, 2)
    (c_sh, c_sc, c_g), (c_sh_mlp, c_sc_mlp, c_g_mlp) = Flux2Modulation.split(temb_mod_txt, 2)
    eps = block.norm1.eps
    norm_h = ref.layernorm_modulate(hidden_states, sc, sh, eps)  # (1 + scale) * LN + shift
    norm_e = ref.layernorm_modulate(encoder_hidden_states, c_sc, c_sh, eps)
    attn_out, ctx_out = flux2_attention(block.attn, norm_h, norm_e, image_rotary_emb)
    hidden_states, norm_h = ref.gate_residual_layernorm_modulate(hidden_states, g, attn_out, sc_mlp, sh_mlp, eps)
    hidden_states = ref.gate_residual(hidden_states, g_mlp, _flux2_ff(block.ff, norm_h))
    encoder_hidden_states, norm_e = ref.gate_residual_layernorm_modulate(encoder_hidden_states, c_g, ctx_out, c_sc_mlp, c_sh_mlp, eps)
    encoder_hidden_states = ref.gate_residual(encoder_hidden_states, c_g_mlp, _flux2_ff(block.ff_context, norm_e))
    return encoder_hidden_states, hidden_states


def flux2_single_forward(block, hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb=None,
                         joint_attention_kwargs=None, split_hidden_states=False, text_seq_len=None):
    from diffusers.models.transformers.transformer_flux2 import Flux2Modulation

    assert not joint_attention_kwargs
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    sh, sc, g = Flux2Modulation.split(temb_mod, 1)[0]
    norm_h = ref.layernorm_modulate(hidden_states, sc, sh, block.norm.eps)
    attn = block.attn
    proj = attn.to_qkv_mlp_proj(norm_h)
    qkv, mlp = torch.split(proj, [3 * attn.inner_dim, proj.shape[-1] - 3 * attn.inner_dim], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
    cos, sin = image_rotary_emb
    q, k = ref.qk_rmsnorm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, cos, sin, attn.norm_q.eps)
    out = _dispatch(attn, q, k, v).flatten(2, 3).to(q.dtype)
    cat = torch.cat([out, rf.swiglu_halves(mlp)], dim=-1)
    hidden_states = ref.gate_residual(hidden_states, g, attn.to_out(cat))
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


def _flux2_prelude(m, inp):
    temb = m.time_guidance_embed(inp["timestep"].to(inp["hidden_states"].dtype) * 1000,
                                 inp["guidance"].to(inp["hidden_states"].dtype) * 1000)
    h = m.x_embedder(inp["hidden_states"])
    e = m.context_embedder(inp["encoder_hidden_states"])
    ir, tr = m.pos_embed(inp["img_ids"]), m.pos_embed(inp["txt_ids"])
    rot = (torch.cat([tr[0], ir[0]], dim=0), torch.cat([tr[1], ir[1]], dim=0))
    return temb, h, e, rot


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch,hw,txt", [(1, (1, 1), 1), (2, (3, 5), 7)], ids=str)
def test_flux2_blocks_from_reference_chains(dtype, batch, hw, txt):
    m = _tiny("flux2", dtype)
    inp = fc.step_inputs("flux2", m, batch=batch, height=16 * hw[0], width=16 * hw[1], text_tokens=txt, dtype=dtype, seed=80)
    with torch.no_grad():
        temb, h, e, rot = _flux2_prelude(m, inp)
        mi, mt = m.double_stream_modulation_img(temb), m.double_stream_modulation_txt(temb)
        for blk in m.transformer_blocks:
            want = blk(h, e, mi, mt, rot)
            assert_bitwise_equal(flux2_block_forward(blk, h, e, mi, mt, rot), want, "Flux2TransformerBlock")
            e, h = want
        ms = m.single_stream_modulation(temb)
        x = torch.cat([e, h], dim=1)
        for blk in m.single_transformer_blocks:
            want = blk(x, None, ms, rot)
            assert_bitwise_equal(flux2_single_forward(blk, x, None, ms, rot), want, "Flux2SingleTransformerBlock")
            x = want


# -- Z-Image ----------------------------------------------------------------------------------


def zimage_attention(attn, x, attention_mask, freqs_cis):
    """ZSingleStreamAttnProcessor: diffusers-RMSNorm QK norms, complex RoPE, no concat."""

    def heads(t):
        return t.unflatten(-1, (attn.heads, -1))

    norm = attn.norm_q is not None
    q, k = rf.qk_rmsnorm_diffusers_rope_complex_cat(
        heads(attn.to_q(x)), heads(attn.to_k(x)), attn.norm_q.weight if norm else None,
        attn.norm_k.weight if norm else None, freqs_cis, attn.norm_q.eps if norm else 0.0, norm=norm,
    )
    if attention_mask is not None and attention_mask.ndim == 2:
        attention_mask = attention_mask[:, None, None, :]
    out = _dispatch(attn, q, k, heads(attn.to_v(x)), attention_mask, dropout_p=0.0, is_causal=False)
    out = out.flatten(2, 3).to(q.dtype)
    return attn.to_out[1](attn.to_out[0](out))


def zimage_block_forward(block, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None,
                         adaln_noisy=None, adaln_clean=None):
    assert noise_mask is None, "omni mode (per-token noisy/clean modulation) is not rebuilt here"
    ff, eps = block.feed_forward, block.attention_norm1.eps
    if block.modulation:
        sc, g, sc_mlp, g_mlp = block.adaLN_modulation(adaln_input).unsqueeze(1).chunk(4, dim=2)
        g, g_mlp = g.tanh(), g_mlp.tanh()
        n = rf.rms_norm_diffusers_scale(x, block.attention_norm1.weight, sc, eps)
    else:
        sc_mlp = g = g_mlp = None
        n = rf.rms_norm_diffusers(x, block.attention_norm1.weight, eps)
    a = zimage_attention(block.attention, n, attn_mask, freqs_cis)
    x, n = rf.gate_residual_rms_norm_diffusers_scale(
        x, g, a, block.attention_norm2.weight, block.ffn_norm1.weight, sc_mlp, eps
    )
    f = ff.w2(rf.swiglu(ff.w1(n), ff.w3(n)))
    return rf.gate_residual_rms_norm_diffusers(x, g_mlp, f, block.ffn_norm2.weight, eps)


def zimage_final_forward(final, x, c=None, noise_mask=None, c_noisy=None, c_clean=None):
    assert noise_mask is None
    return final.linear(rf.layernorm_scale(x, final.adaLN_modulation(c), final.norm_final.eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("masked", [False, True], ids=["equal_len", "padded_batch"])
def test_zimage_blocks_from_reference_chains(dtype, masked):
    m = _tiny("zimage", dtype)
    torch.manual_seed(0)
    B, S, D = 2, 13, m.dim
    x = _rand(B, S, D, dtype=dtype, seed=90)
    ang = _rand(B, S, D // m.n_heads // 2, seed=91, scale=4.0)
    freqs = torch.polar(torch.ones_like(ang), ang)
    adaln = _rand(B, min(D, 256), dtype=dtype, seed=92)
    mask = None
    if masked:
        mask = torch.ones(B, S, dtype=torch.bool)
        mask[1, 9:] = False
    with torch.no_grad():
        for blk in (m.noise_refiner[0], m.context_refiner[0], m.layers[0]):
            args = (x, mask, freqs, adaln if blk.modulation else None)
            assert_bitwise_equal(zimage_block_forward(blk, *args), blk(*args), f"ZImage block modulation={blk.modulation}")
        final = m.all_final_layer["2-1"]
        assert_bitwise_equal(zimage_final_forward(final, x, c=adaln), final(x, c=adaln), "FinalLayer")


# =============================================================================================
# (3) whole tiny transformers, every block on its rebuilt forward
# =============================================================================================


_CALLS: dict[str, int] = {}


def _patch(module: torch.nn.Module, fn) -> None:
    def forward(*a, **k):
        _CALLS[fn.__name__] = _CALLS.get(fn.__name__, 0) + 1
        return fn(module, *a, **k)

    module.forward = forward


_MODEL_CASES = {
    "qwenimage": lambda m: (
        [_patch(b, qwen_block_forward) for b in m.transformer_blocks],
        _patch(m.norm_out, norm_out_forward),
    ),
    "sd35": lambda m: ([_patch(b, sd3_block_forward) for b in m.transformer_blocks], _patch(m.norm_out, norm_out_forward)),
    "sd3": lambda m: ([_patch(b, sd3_block_forward) for b in m.transformer_blocks], _patch(m.norm_out, norm_out_forward)),
    "flux2": lambda m: (
        [_patch(b, flux2_block_forward) for b in m.transformer_blocks],
        [_patch(b, flux2_single_forward) for b in m.single_transformer_blocks],
        _patch(m.norm_out, norm_out_forward),
    ),
    "zimage": lambda m: (
        [_patch(b, zimage_block_forward) for b in (*m.noise_refiner, *m.context_refiner, *m.layers)],
        [_patch(f, zimage_final_forward) for f in m.all_final_layer.values()],
    ),
}


@pytest.mark.parametrize("name", sorted(_MODEL_CASES))
@pytest.mark.parametrize("batch", [1, 2])
def test_tiny_transformer_from_reference_chains(name, batch):
    dtype = torch.bfloat16
    base = _tiny(name, dtype)
    fast = _tiny(name, dtype)
    _MODEL_CASES[name](fast)
    inp = fc.step_inputs(name, base, batch=batch, height=48, width=80, text_tokens=5, dtype=dtype, seed=100 + batch)
    _CALLS.clear()
    with torch.no_grad():
        want = base(**inp)[0]
        got = fast(**inp)[0]
    n_blocks = sum(1 for mod in fast.modules() if type(mod).__name__.endswith("Block"))
    assert sum(v for k, v in _CALLS.items() if k.endswith("block_forward") or k.endswith("single_forward")) == n_blocks
    assert sum(v for k, v in _CALLS.items() if "block" not in k and "single" not in k) == 1  # the final norm
    assert_bitwise_equal(got, want, f"{name} transformer")
