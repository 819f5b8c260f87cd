"""The Qwen-Image adapter on a tiny random-weight QwenImageTransformer2DModel (CPU, Triton
interpreter). On CPU the gate compares each kernel with the eager chain at first sight (the
interpreter's LayerNorm is not CUDA's, so those ops are disabled here and run eager): the output
must be bitwise unchanged whatever the gate decided, and every op must reach the gate. The fast
forwards with the eager reference table must equal diffusers' forwards bitwise. The attention
site runs the QK-chain op once per block (text lengths not a multiple of 64, with and without a
text mask) and leaves every configuration it does not mirror to diffusers, saying why. Kernels
are proved on the GPU (tests/gpu/test_qwenimage_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import image_family_configs as ifc
from ditfuse.models import qwenimage as qwen_adapter


def _model(dtype=torch.bfloat16, **over):
    import diffusers

    torch.manual_seed(0)
    cfg = dict(ifc.config("qwenimage", "tiny"), **over)
    return diffusers.QwenImageTransformer2DModel(**cfg).to(dtype).eval()


def _inputs(m, batch=1, txt=7, hw=(64, 48), dtype=torch.bfloat16):
    return ifc.step_inputs("qwenimage", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch, dtype):
    m = _model(dtype)
    inp = _inputs(m, batch=batch, dtype=dtype)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.adapter == "qwenimage"
    assert sorted(s for _, s in rep.sites) == ["qwenimage.attention"] * 2 + ["qwenimage.block"] * 2 + ["qwenimage.norm_out"]
    assert not rep.skipped_sites
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    inp2 = _inputs(m, batch=batch, txt=13, hw=(32, 80), dtype=dtype)
    h.unmount()
    base2 = _run(m, inp2)
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp2), base2, "accelerated, second shape")
    h.unmount()


@pytest.mark.slow
def test_every_op_reaches_the_gate():
    m = _model(torch.float32)
    inp = _inputs(m, dtype=torch.float32)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    _run(m, inp)
    calls = ditfuse.gate.report().calls
    h.unmount()
    for op in qwen_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert sum(c.values()) > 0, f"{op} never reached the gate: {dict(c)}"


def test_fast_forwards_match_diffusers_call_for_call():
    """Each site's fast forward with the eager reference table equals the module's own forward
    bitwise, fp32, bf16 and fp16 (its clip), batch 2, with a text mask."""
    from tests.support.reference_forwards import reference_forwards

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = _model(dtype)
        inp = _inputs(m, batch=2, txt=5, dtype=dtype)
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 3:] = False
        inp["encoder_hidden_states_mask"] = mask
        base = _run(m, inp)
        with reference_forwards(m, qwen_adapter.SITES, require_applies=True) as patched:
            assert len(patched) == 2 * len(m.transformer_blocks) + 1  # blocks, their attentions, norm_out
            assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype}")


def _edit_inputs(m, batch=2, txt=5, dtype=torch.bfloat16):
    """An Edit step: the target image (4 x 3 latent patches) followed by a reference image (2 x 5),
    so ``zero_cond_t``'s modulate_index has both 0 (target) and 1 (reference) tokens."""
    g = torch.Generator().manual_seed(3)
    n = 4 * 3 + 2 * 5
    return dict(
        hidden_states=torch.randn(batch, n, m.config.in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt, m.config.joint_attention_dim, generator=g).to(dtype),
        encoder_hidden_states_mask=None,
        timestep=torch.full((batch,), 0.7, dtype=dtype),
        img_shapes=[[(1, 4, 3), (1, 2, 5)]] * batch,
        return_dict=False,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_cond_t_per_token_modulation_on_reference_chains(dtype):
    """The Edit models' per-token modulation (zero_cond_t): every block mounts, and the fast
    forwards on the reference chains equal diffusers bitwise (target and reference-image tokens
    take different modulation rows)."""
    from tests.support.reference_forwards import reference_forwards

    m = _model(dtype, zero_cond_t=True)
    inp = _edit_inputs(m, dtype=dtype)
    base = _run(m, inp)
    with reference_forwards(m, qwen_adapter.SITES, require_applies=True) as patched:
        assert len(patched) == 2 * len(m.transformer_blocks) + 1
        assert_bitwise_equal(_run(m, inp), base, f"zero_cond_t reference fast forwards {dtype}")


@pytest.mark.slow
def test_zero_cond_t_mounts_and_stays_bitwise():
    m = _model(zero_cond_t=True)
    inp = _edit_inputs(m, batch=1)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert not rep.skipped_sites, rep.skipped_sites
        assert sum(s == "qwenimage.block" for _, s in rep.sites) == len(m.transformer_blocks)
        assert_bitwise_equal(_run(m, inp), base, "zero_cond_t accelerated")
        calls = ditfuse.gate.report().calls
        assert sum(calls.get("norm.gate_residual_layernorm_modulate", {}).values()) > 0
    finally:
        h.unmount()


def test_select_matches_diffusers_modulate():
    """_select against QwenImageTransformerBlock._modulate's own selection, per sample and per
    token."""
    m = _model(torch.float32, zero_cond_t=True)
    blk = m.transformer_blocks[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 32, generator=g)
    mod = torch.randn(4, 3 * 32, generator=g)
    index = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 0, 0, 0, 1, 1]], dtype=torch.int)
    out, gate = blk._modulate(x, mod, index)
    shift, scale, g_sel = qwen_adapter._select(mod, index)
    assert_bitwise_equal(x * (1 + scale) + shift, out, "per-token modulate")
    assert_bitwise_equal(g_sel, gate, "per-token gate")
    out, gate = blk._modulate(x, mod[:2])
    shift, scale, g_sel = qwen_adapter._select(mod[:2], None)
    assert_bitwise_equal(x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), out, "per-sample modulate")


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_qwenimage as tq

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, extra=None):
        pass

    monkeypatch.setattr(tq.QwenImageTransformerBlock, "forward", forward)
    assert "QwenImageTransformerBlock.forward" in qwen_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    """Round 30: the close GEMM-GELU declared in round 28 ran slower than cuBLAS + the GELU pass in
    a Qwen-Image-size step on an H100 (GPU busy 130.65 -> 132.09 ms) and was taken back."""
    assert all(not s.close_ops() for s in qwen_adapter.SITES)


def test_family_fixture_builds_inputs():
    from ditfuse.models import families

    fam = families.get("qwenimage")
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 12, 16) and inp["encoder_hidden_states"].shape == (2, 9, 24)
    assert _run(m, inp).shape == (2, 12, 16)


# -- the attention site ------------------------------------------------------------------------

ATTN_SITE = next(s for s in qwen_adapter.SITES if s.name == "qwenimage.attention")
QK_OP = ATTN_SITE.ops[0].op


def _text_mask(batch, txt):
    mask = torch.ones(batch, txt, dtype=torch.bool)
    mask[-1, txt - 4:] = False  # the last sample's prompt is shorter: padded text tokens
    return mask


def _qk_calls():
    """Calls of the QK-chain op that went through the gate: each one is the kernel (a verified
    signature) or its eager reference (first sight, or the op fell back), exactly one of the two."""
    c = ditfuse.gate.report().calls.get(QK_OP, {})
    return c.get("kernel", 0) + c.get("reference", 0), dict(c)


@pytest.mark.slow
@pytest.mark.parametrize("text_mask", [False, True], ids=["no_mask", "text_mask"])
@pytest.mark.parametrize("batch", [1, 2])
def test_attention_site_runs_the_qk_op_in_every_block(batch, text_mask):
    m = _model()
    inp = _inputs(m, batch=batch, txt=13)
    if text_mask:
        inp["encoder_hidden_states_mask"] = _text_mask(batch, 13)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert sorted(p for p, s in rep.sites if s == ATTN_SITE.name) == [
        f"transformer_blocks.{i}.attn" for i in range(len(m.transformer_blocks))
    ]
    ditfuse.gate.reset()
    out = _run(m, inp)
    n, calls = _qk_calls()
    gate = ditfuse.gate.report()
    h.unmount()
    assert_bitwise_equal(out, base, f"accelerated B={batch} mask={text_mask}")
    assert n == len(m.transformer_blocks), calls
    assert calls.get("verify", 0) == 1, calls  # one signature: block 0 verifies, block 1 reuses the verdict
    if QK_OP in gate.disabled:  # on CPU the gate may fall back (CPU's complex multiply is not CUDA's)
        assert "bitwise mismatch" in gate.disabled[QK_OP], gate.disabled[QK_OP]
    else:
        assert gate.verified.get(QK_OP) and calls.get("kernel", 0) == len(m.transformer_blocks) - 1, calls


def _direct_inputs(m, batch=2, txt=13, hw=(4, 3)):
    g = torch.Generator().manual_seed(3)
    dim = m.config.num_attention_heads * m.config.attention_head_dim
    hs = torch.randn(batch, hw[0] * hw[1], dim, generator=g).to(torch.bfloat16)
    ehs = torch.randn(batch, txt, dim, generator=g).to(torch.bfloat16)
    freqs = m.pos_embed([(1, *hw)] * batch, max_txt_seq_len=txt, device=torch.device("cpu"))
    return hs, ehs, freqs


def _processor_call(attn, hs, ehs, **kw):
    """diffusers' path itself: the processor, as Attention.forward calls it."""
    with torch.no_grad():
        return attn.processor(attn, hs, encoder_hidden_states=ehs, **kw)


@pytest.mark.parametrize("text_mask", [False, True], ids=["no_mask", "text_mask"])
def test_attention_without_rope_passes_no_freqs(text_mask):
    """image_rotary_emb=None: the op runs with freqs None (norm + concat only), still diffusers' bits."""
    m = _model()
    attn = m.transformer_blocks[0].attn
    hs, ehs, _ = _direct_inputs(m)
    kw = dict(encoder_hidden_states_mask=_text_mask(2, 13) if text_mask else None, image_rotary_emb=None)
    base = _processor_call(attn, hs, ehs, **kw)
    h = ditfuse.accelerate(m)
    with torch.no_grad():
        out = attn(hidden_states=hs, encoder_hidden_states=ehs, **kw)
    n, calls = _qk_calls()
    h.unmount()
    assert n == 1, calls
    for o, b, name in zip(out, base, ("image", "text")):
        assert_bitwise_equal(o, b, f"{name} stream, no RoPE")


def test_attention_inputs_it_does_not_mirror_go_to_diffusers(caplog):
    """An external attention_mask or no text stream: diffusers' own error. Unknown kwargs:
    Attention.forward's warning and diffusers' output. The QK op never runs for them."""
    m = _model()
    attn = m.transformer_blocks[0].attn
    hs, ehs, freqs = _direct_inputs(m)
    base = _processor_call(attn, hs, ehs, image_rotary_emb=freqs)
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            with pytest.raises(ValueError, match="does not accept an external attention_mask"):
                attn(hs, ehs, torch.ones(2, 1, 1, 25, dtype=torch.bool), image_rotary_emb=freqs)
            with pytest.raises(ValueError, match="requires encoder_hidden_states"):
                attn(hs, None, image_rotary_emb=freqs)
            with caplog.at_level("WARNING"):
                out = attn(hs, ehs, image_rotary_emb=freqs, not_a_qwen_kwarg=1)
        assert "not_a_qwen_kwarg" in caplog.text
        assert _qk_calls()[0] == 0
    finally:
        h.unmount()
    for o, b, name in zip(out, base, ("image", "text")):
        assert_bitwise_equal(o, b, f"{name} stream, extra kwarg")


def _swap_processor(attn):
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    class SubclassedProcessor(QwenDoubleStreamAttnProcessor2_0):
        pass

    attn.set_processor(SubclassedProcessor())


def _set_norm(name, value):
    return lambda attn: setattr(attn, name, value(attn) if callable(value) else value)


def _with_bias(attn):
    attn.norm_k.bias = torch.nn.Parameter(torch.zeros_like(attn.norm_k.weight))


def _other_eps(attn):
    attn.norm_added_q.eps = 1e-5


@pytest.mark.parametrize(
    "change,reason",
    [
        (_swap_processor, "processor is SubclassedProcessor, not QwenDoubleStreamAttnProcessor2_0"),
        (_set_norm("norm_added_k", lambda a: torch.nn.RMSNorm(16, eps=1e-6).to(torch.bfloat16)),
         "norm_added_k is torch.nn.modules.normalization.RMSNorm, not diffusers' RMSNorm"),
        (_set_norm("norm_q", None), "norm_q is None, not diffusers' RMSNorm"),
        (_set_norm("norm_k", lambda a: torch.nn.LayerNorm(16).to(torch.bfloat16)), "norm_k is torch.nn.modules.normalization.LayerNorm"),
        (_with_bias, "norm_k has a bias"),
        (_other_eps, "norm_added_q eps 1e-05 differs from norm_q eps 1e-06"),
    ],
    ids=["subclassed_processor", "torch_rmsnorm", "no_norm_q", "layernorm", "bias", "eps"],
)
def test_attention_guard_keeps_diffusers_forward_and_says_why(change, reason):
    m = _model()
    change(m.transformer_blocks[1].attn)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    h.unmount()
    skipped = dict(rep.skipped_sites)
    assert reason in skipped.get("transformer_blocks.1.attn", ""), skipped
    assert list(skipped) == ["transformer_blocks.1.attn"], skipped
    assert ("transformer_blocks.0.attn", ATTN_SITE.name) in [tuple(s) for s in rep.sites]


@pytest.mark.slow
def test_skipped_and_runtime_swapped_attention_stay_bitwise():
    """Block 1's norm is torch's RMSNorm (not mounted), then block 0's processor is swapped after
    mounting (the fast forward hands over to diffusers): output bitwise diffusers' both times,
    the QK op ran only where it was mounted and the processor unchanged."""
    m = _model()
    m.transformer_blocks[1].attn.norm_added_k = torch.nn.RMSNorm(16, eps=1e-6).to(torch.bfloat16)
    inp = _inputs(m, batch=2, txt=13)
    inp["encoder_hidden_states_mask"] = _text_mask(2, 13)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        ditfuse.gate.reset()
        assert_bitwise_equal(_run(m, inp), base, "block 1 attention skipped")
        assert _qk_calls()[0] == 1
        _swap_processor(m.transformer_blocks[0].attn)
        ditfuse.gate.reset()
        assert_bitwise_equal(_run(m, inp), base, "block 0 processor swapped after mounting")
        assert _qk_calls()[0] == 0
    finally:
        h.unmount()
