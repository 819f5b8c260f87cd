"""The SD3 / SD3.5 adapter on tiny random-weight SD3Transformer2DModels (CPU, Triton interpreter).

Tiny configs: ``sd35`` (block 0 dual attention with SD35AdaLayerNormZeroX + attn2, block 1 a
plain joint block, block 2 the context_pre_only last block, QK RMSNorm) and ``sd3`` (no QK norm,
no dual attention). On CPU the gate compares each kernel with the eager chain at first sight (the
interpreter's LayerNorm is not CUDA's, so those ops are disabled here and run eager): the output
must be bitwise unchanged whatever the gate decided, and every op must reach the gate. The fast
forwards with the eager reference table must equal diffusers' forwards bitwise — this is what
proves the fast forwards are diffusers' chains. Kernels are proved on the GPU
(tests/gpu/test_sd3_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import image_family_configs as ifc
from ditfuse.models import sd3 as sd3_adapter


def _model(name="sd35", dtype=torch.bfloat16):
    return ifc.build(name, "tiny", dtype=dtype)


def _inputs(m, batch=1, txt=7, hw=(64, 48), dtype=torch.bfloat16):
    return ifc.step_inputs("sd3", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name,blocks,attns", [("sd35", 3, 4), ("sd3", 2, 2)])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(name, blocks, attns, batch):
    m = _model(name)
    inp = _inputs(m, batch=batch)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.adapter == "sd3"
    # the model's norm_out and the last block's norm1_context are both AdaLayerNormContinuous;
    # sd35: every attn and block 0's attn2; sd3 (no QK norm): attention not mounted, with a reason
    assert sorted(s for _, s in rep.sites) == (["sd3.attention"] * attns + ["sd3.joint_block"] * blocks
                                               + ["sd3.norm_out"] * 2)
    # sd3 (no QK norm): the attention site mounts too, for its q / k / v cats (layout.head_cat)
    assert not rep.skipped_sites
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    inp2 = _inputs(m, batch=batch, txt=13, hw=(32, 80))
    h.unmount()
    base2 = _run(m, inp2)
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp2), base2, "accelerated, second shape")
    h.unmount()


@pytest.mark.slow
def test_every_op_reaches_the_gate():
    m = _model("sd35", torch.float32)
    inp = _inputs(m, dtype=torch.float32)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    _run(m, inp)
    calls = ditfuse.gate.report().calls
    h.unmount()
    for op in sd3_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert sum(c.values()) > 0, f"{op} never reached the gate: {dict(c)}"


@pytest.mark.parametrize("name", ["sd35", "sd3"])
def test_fast_forwards_match_diffusers_call_for_call(name):
    """Each site's fast forward with the eager reference table equals the module's own forward
    bitwise (the reference table is exactly diffusers' chains), fp32 and bf16, batch 2."""
    from tests.support.reference_forwards import reference_forwards

    for dtype in (torch.float32, torch.bfloat16):
        m = _model(name, dtype)
        inp = _inputs(m, batch=2, txt=5, dtype=dtype)
        base = _run(m, inp)
        with reference_forwards(m, sd3_adapter.SITES, require_applies=True) as patched:
            attns = len(m.transformer_blocks) + (0 if name == "sd3" else 1)  # sd35: + block 0's attn2
            assert len(patched) == len(m.transformer_blocks) + 2 + attns
            assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {name} {dtype}")


def test_chunked_feed_forward_runs_diffusers_forward():
    m = _model("sd3")
    m.enable_forward_chunking(chunk_size=1, dim=1)
    inp = _inputs(m)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp), base, "chunked FF")
    h.unmount()


def test_skip_layers_and_fp16():
    m = _model("sd35", torch.float16)
    inp = _inputs(m, batch=2, dtype=torch.float16)
    inp["skip_layers"] = [1]
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp), base, "skip_layers, fp16")
    h.unmount()


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models import attention

    def forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None, extra=None):
        pass

    monkeypatch.setattr(attention.JointTransformerBlock, "forward", forward)
    assert "JointTransformerBlock.forward" in sd3_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    """SD3.5's FF shapes (2432 -> 9728) were never timed with the close GEMM-GELU: no high tier
    (Chroma, Qwen-Image and HunyuanVideo declare it at FLUX.1's timed shapes; round 28)."""
    assert all(not s.close_ops() for s in sd3_adapter.SITES)


def test_family_fixture_builds_inputs():
    from ditfuse.models import families

    fam = families.get("sd3")
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 4, 6, 8) and inp["encoder_hidden_states"].shape == (2, 9, 20)
    assert _run(m, inp).shape == (2, 4, 6, 8)
    assert set(fam.configs) >= {"tiny", "tiny-sd3", "dev", "medium", "sd3-medium"}


QK_OP = "rope.qk_rmsnorm_diffusers_cat"


@pytest.mark.parametrize("batch", [1, 2])
def test_qk_op_runs_in_every_attention_bf16(batch):
    """SD3.5 tiny, bf16, text 13: the QK op reaches the gate in every attention (joint attn with
    text, context_pre_only last block, attn2 without text), is verified (kernel == reference on
    first sight) and then runs as the kernel; the output stays bitwise diffusers'."""
    m = _model("sd35")
    inp = _inputs(m, batch=batch, txt=13)
    base = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    seen = []
    for name, mod in m.named_modules():
        if name.endswith((".attn", ".attn2")):
            mod.register_forward_pre_hook(lambda mod, a, name=name: seen.append(name))
    try:
        assert_bitwise_equal(_run(m, inp), base, "sd35 with the QK op")
        gate = ditfuse.gate.report()
    finally:
        h.unmount()
    assert sorted(seen) == sorted(["transformer_blocks.0.attn", "transformer_blocks.0.attn2",
                                   "transformer_blocks.1.attn", "transformer_blocks.2.attn"])
    calls = gate.calls.get(QK_OP, {})
    assert QK_OP not in gate.disabled, gate.disabled
    assert len(gate.verified.get(QK_OP, [])) == 2  # one key with text, one without (attn2)
    # every attention call went through the gate: each first sight is verify (+ reference), then kernel
    assert calls.get("verify", 0) + calls.get("kernel", 0) == len(seen), calls
    assert calls.get("kernel", 0) >= 2, calls


def test_sd3_without_qk_norm_runs_its_three_cats_through_head_cat():
    """SD3 (qk_norm None): the attention site mounts for the joint attention's q / k / v cats of
    transposed views (``layout.head_cat``, three per attention), bitwise diffusers."""
    m = _model("sd3")
    inp = _inputs(m, batch=2, txt=9)
    base = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        assert_bitwise_equal(_run(m, inp), base, "sd3 without QK norm")
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    c = calls.get("layout.head_cat", {})
    assert c.get("kernel", 0) + c.get("verify", 0) == 3 * len(m.transformer_blocks), calls  # a call is one of the two
    assert not calls.get("rope.qk_rmsnorm_diffusers_cat")
    # SDPA's heads-first output back in token rows: one copy per attention (CPU SDPA writes it
    # contiguous [B, H, S, D], as cuDNN does for contiguous q)
    t = calls.get("layout.heads_to_tokens", {})
    assert t.get("kernel", 0) + t.get("verify", 0) == len(m.transformer_blocks), calls
