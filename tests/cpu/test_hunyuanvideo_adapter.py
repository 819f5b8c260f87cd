"""The HunyuanVideo (1.0) adapter on a tiny random-weight HunyuanVideoTransformer3DModel (CPU).

The fast forwards on the eager reference chains equal diffusers' forward bitwise (fp32, bf16;
batch 1 and 2 with differently right-padded prompts of 13 tokens; an odd 3 x 3 x 5 token grid
from 3 x 6 x 10 latents); accelerated (interpreter kernels behind the gate, every call
verified: conftest's verify_every_call) the output stays bitwise, every op reaches the gate, both
block chains hand off, unmounting restores diffusers' forwards. Kernels are proved on the GPU (tests/gpu/test_hunyuanvideo_gpu.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models import hunyuanvideo as hy
from tests.support.reference_forwards import reference_forwards

FAM = families.get("hunyuanvideo")
SIZE = "80x48x9"  # latents [B, 16, 3, 6, 10] -> 3 x 3 x 5 = 45 video tokens
TXT = 13  # not a multiple of 8; sample i has 3 + 5 i padding tokens


def _model(dtype=torch.bfloat16):
    m = FAM.build("tiny", device="cpu", dtype=dtype)
    with torch.no_grad():  # a modulation that matters (gates and scales far from 0)
        for name, p in m.named_parameters():
            if "norm" in name and "linear" in name:
                p.mul_(20)
    return m


def _inputs(m, batch, dtype=torch.bfloat16):
    return FAM.make_inputs(m, batch, SIZE, device="cpu", dtype=dtype, txt_tokens=TXT)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fast_forwards_on_reference_chains_match_diffusers(dtype, batch):
    m = _model(dtype)
    inp = _inputs(m, batch, dtype)
    assert int(inp["encoder_attention_mask"].sum()) < batch * TXT  # padding present
    base = _run(m, inp)
    with reference_forwards(m, hy.SITES) as patched:
        out = _run(m, inp)
    # 2 dual + 3 single blocks, their 5 attentions + the refiner's 1 (diffusers' path), norm_out
    assert len(patched) == 12, [type(p).__name__ for p in patched]
    assert_bitwise_equal(out, base, f"B={batch} {SIZE} {dtype}")


def test_guidance_and_padding_reach_the_output():
    """The inputs the test above compares on are live: another guidance or another padding
    changes the output (a fast forward ignoring the mask would not be caught otherwise)."""
    m = _model(torch.float32)
    inp = _inputs(m, 2, torch.float32)
    base = _run(m, inp)
    other = dict(inp, guidance=inp["guidance"] * 0.5)
    assert not torch.equal(_run(m, other), base)
    mask = inp["encoder_attention_mask"].clone()
    mask[:, -1] = 1 - mask[:, -1]
    mask[0, -3:] = 1
    assert not torch.equal(_run(m, dict(inp, encoder_attention_mask=mask)), base)


def _sites(rep):
    return sorted(s for _, s in rep.sites)


EXPECTED_SITES = (["hunyuanvideo.attention"] * 5 + ["hunyuanvideo.block"] * 2 + ["hunyuanvideo.norm_out"]
                  + ["hunyuanvideo.single_block"] * 3)


@pytest.mark.slow  # the tiny model through the Triton interpreter: ~20 s on 2 shared cores
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated_handoff_unmount(batch):
    m = _model()
    inp = _inputs(m, batch)
    base = _run(m, inp)
    forwards = {n: mod.forward for n, mod in m.named_modules()}
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert rep.adapter == "hunyuanvideo" and rep.status == "mounted", rep
        assert _sites(rep) == EXPECTED_SITES
        outs = [_run(m, inp) for _ in range(2)]
        calls = ditfuse.gate.report().calls
        counts = ditfuse.models.handoff_counts(m)
    finally:
        h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"accelerated call {i}")
    for op in hy.ADAPTER.ops():
        assert sum(calls.get(op, {}).values()) > 0, (op, calls)
    # one link in the dual chain (2 blocks), two in the single chain (3): used on both calls
    assert counts["links"] == 3 and counts["used"] == 6 and counts["discarded"] == 0, counts
    assert {n: mod.forward for n, mod in m.named_modules()} == forwards
    assert_bitwise_equal(_run(m, inp), base, "after unmount")


def test_expected_sites_and_skips():
    """The mount (on CPU the ops are unavailable unless the interpreter is on: mount the adapter
    directly) covers every block, attention and norm_out; only the refiner's attention is skipped,
    with the reason."""
    m = _model()
    mnt = hy.ADAPTER.mount(m)
    try:
        assert sorted(s.site for s in mnt.mounted) == EXPECTED_SITES
        assert [p for p, _ in mnt.skipped] == ["context_embedder.token_refiner.refiner_blocks.0.attn"], mnt.skipped
        assert "AttnProcessor2_0" in mnt.skipped[0][1]
    finally:
        hy.ADAPTER.unmount(m)


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_hunyuan_video as tf

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, image_rotary_emb=None,
                token_replace_emb=None, num_tokens=None):
        pass

    assert hy.ADAPTER.version_problem() is None
    monkeypatch.setattr(tf.HunyuanVideoSingleTransformerBlock, "forward", forward)
    assert "HunyuanVideoSingleTransformerBlock.forward" in hy.ADAPTER.version_problem()


def test_guards_name_what_they_refuse():
    m = _model()
    blk, single = m.transformer_blocks[0], m.single_transformer_blocks[0]
    assert hy.SITES[0].applies(blk) is None and hy.SITES[1].applies(single) is None
    assert hy.SITES[2].applies(blk.attn) is None and hy.SITES[2].applies(single.attn) is None
    single.act_mlp = torch.nn.GELU()
    assert "tanh" in hy.SITES[1].applies(single)
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    blk.attn.norm_added_k = torch.nn.RMSNorm(16, eps=1e-6)
    assert "norm_added_k" in hy.SITES[2].applies(blk.attn)
    assert type(single.attn.processor) is HunyuanVideoAttnProcessor2_0


def test_dev_config_is_diffusers_defaults_and_inputs_shapes():
    from diffusers import HunyuanVideoTransformer3DModel

    defaults = {k: p.default for k, p in inspect.signature(HunyuanVideoTransformer3DModel.__init__).parameters.items()
                if k != "self"}
    dev = FAM.config("dev")
    assert {k: defaults[k] for k in dev} == dev
    assert FAM.config("tiny", (1, 1))["num_single_layers"] == 1
    m = _model()
    inp = FAM.make_inputs(m, 2, "848x480x61", device="cpu", txt_tokens=5)
    assert tuple(inp["hidden_states"].shape) == (2, 4, 16, 60, 106)
    assert inp["timestep"].dtype == torch.float32 and inp["guidance"].dtype == torch.bfloat16
    assert inp["encoder_attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="4k\\+1"):
        FAM.make_inputs(m, 1, "64x48x4", device="cpu")
