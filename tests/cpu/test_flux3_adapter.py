"""The FLUX.3 adapter on a tiny random-weight Flux3Transformer2DModel (CPU, Triton interpreter).

On CPU the gate compares each kernel with the eager chain at first sight: the model's output must
be bitwise unchanged whatever the gate decided, every op must have reached the gate, and the
report must list every site. The fast forwards with the eager reference chains are bitwise
diffusers' forwards, call for call (fp32 and bf16). Bitwise kernels are proved on the GPU
(tests/gpu/test_flux3_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models import flux3 as flux3_adapter
from ditfuse.models import image_family_configs as ifc

FLUX3 = families.get("flux3")


def _model(dtype=torch.bfloat16, load="pretrained"):
    return FLUX3.build("tiny", device="cpu", dtype=dtype, load=load)


def _inputs(m, batch=1, txt=7, hw=(64, 48), dtype=torch.bfloat16, cond=0):
    return ifc.step_inputs("flux3", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype,
                           cond_tokens=cond)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def _expected(cond: bool) -> list[str]:
    modes = 3 if cond else 2  # text + image (+ reference image) mode blocks, 2 each
    blocks = 2 * modes + 2
    return sorted(["flux3.mode_block"] * 2 * 3 + ["flux3.single_block"] * 2 + ["flux3.attention"] * blocks
                  + ["flux3.feed_forward"] * blocks + ["flux3.norm_out", "flux3.pos_embed"])


@pytest.mark.slow
@pytest.mark.parametrize("batch,cond", [(1, 0), (2, 5)], ids=["B1", "B2-reference-image"])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch, cond):
    m = _model()
    inp = _inputs(m, batch=batch, cond=cond)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.status == "mounted" and rep.adapter == "flux3"
    # every module is mounted (the reference-image mode blocks too, whether or not this call uses them)
    assert sorted(s for _, s in rep.sites) == _expected(True)
    assert not rep.skipped_sites
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    inp2 = _inputs(m, batch=batch, txt=13, hw=(32, 80), cond=cond)  # another resolution and text length
    h.unmount()
    base2 = _run(m, inp2)
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp2), base2, "accelerated, second shape")
    h.unmount()


@pytest.mark.slow
def test_every_op_reaches_the_gate():
    m = _model(torch.float32)
    inp = _inputs(m, dtype=torch.float32, cond=3)
    h = ditfuse.accelerate(m)
    _run(m, inp)
    calls = ditfuse.gate.report().calls
    h.unmount()
    for op in flux3_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert sum(c.values()) > 0, f"{op} never reached the gate: {dict(c)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fast_forwards_match_diffusers_call_for_call(dtype):
    """Each site's fast forward with the eager reference table equals the module's own forward
    bitwise (the reference table is exactly diffusers' chains), with and without a reference image."""
    from tests.support.reference_forwards import reference_forwards

    m = _model(dtype)
    for cond in (0, 4):
        inp = _inputs(m, batch=2, txt=5, dtype=dtype, cond=cond)
        base = _run(m, inp)
        with reference_forwards(m, flux3_adapter.SITES, require_applies=True) as patched:
            # (2 per-mode blocks x 3 modes + 2 joint blocks) x (block, attention, FF), norm_out, pos_embed
            assert len(patched) == (2 * 3 + 2) * 3 + 2
            assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype} cond={cond}")


def test_bf16_qk_norms_keep_diffusers_attention():
    """A model cast with ``.to(bf16)`` has bf16 QK-norm weights: torch then runs its composite
    RMSNorm on the fp32 query, so the attention sites stay diffusers' (with the reason), the rest
    mounts, and the output is unchanged."""
    m = _model(load="plain")
    assert m.mode_blocks["image"][0].attn.norm_q.weight.dtype == torch.bfloat16
    inp = _inputs(m)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    skipped = dict(rep.skipped_sites)
    attn = [n for n, _ in m.named_modules() if n.endswith(".attn")]
    assert sorted(skipped) == sorted(attn)
    assert all("composite RMSNorm" in r for r in skipped.values())
    assert "flux3.mode_block" in {s for _, s in rep.sites}
    assert_bitwise_equal(_run(m, inp), base, "bf16 QK norms")
    h.unmount()


def test_fused_projections_and_custom_processor():
    """``fuse_qkv_projections`` (q / k / v as strided chunks of one projection) runs the fast
    path; another processor keeps diffusers' forward."""
    from diffusers.models.transformers import transformer_flux3 as tf

    class MyProcessor(tf.Flux3AttnProcessor):
        pass

    m = _model()
    inp = _inputs(m, batch=2)
    base = _run(m, inp)
    m.single_transformer_blocks[0].attn.fuse_projections()
    m.single_transformer_blocks[1].attn.set_processor(MyProcessor())
    assert_bitwise_equal(_run(m, inp), base, "diffusers with fused projections")
    h = ditfuse.accelerate(m)
    skipped = dict(h.report().components[0].skipped_sites)
    assert "MyProcessor" in skipped["single_transformer_blocks.1.attn"]
    assert "single_transformer_blocks.0.attn" not in skipped
    assert_bitwise_equal(_run(m, inp), base, "accelerated, fused projections")
    h.unmount()


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_flux3 as tf

    def forward(self, hidden_states, temb_mod, image_rotary_emb, extra=None):
        pass

    monkeypatch.setattr(tf.Flux3ModeTransformerBlock, "forward", forward)
    assert "Flux3ModeTransformerBlock.forward" in flux3_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    assert all(not s.close_ops() for s in flux3_adapter.SITES)


def test_family_fixture_builds_inputs():
    m = FLUX3.build("tiny", device="cpu", load="pretrained")
    assert m.single_transformer_blocks[0].attn.norm_k.weight.dtype == torch.float32
    assert m.single_transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    inp = FLUX3.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 12, 8) and inp["encoder_hidden_states"].shape == (2, 9, 24)
    assert _run(m, inp).shape == (2, 12, 8)


@pytest.mark.parametrize("cond", [0, 5], ids=["no-reference", "reference-image"])
def test_blocks_hand_off_bitwise(cond):
    """Every mode's blocks and the single blocks share their modulation tensors, so each block's
    closing residual computes its successor's opening (models/handoff.py): one link per ModuleList
    of two blocks (text, image, reference-image modes, single), used on every call whose blocks
    run, and the output stays bitwise diffusers'. A hook that replaces a block's output makes the
    successor discard the payload and compute its own opening (still bitwise)."""
    m = _model()
    inp = _inputs(m, batch=2, cond=cond)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        outs = [_run(m, inp) for _ in range(2)]
        counts = ditfuse.models.handoff_counts(m)
        handle = m.single_transformer_blocks[0].register_forward_hook(
            lambda mod, args, out: tuple(t.clone() for t in out))
        hooked = _run(m, inp)
        handle.remove()
        after = ditfuse.models.handoff_counts(m)
    finally:
        h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"accelerated call {i}")
    assert_bitwise_equal(hooked, base, "a hook replacing block 0's outputs")
    used_per_call = 4 if cond else 3  # the reference-image mode's blocks run only with a reference
    assert counts["links"] == 4 and counts["used"] == 2 * used_per_call and counts["discarded"] == 0, counts
    assert after["discarded"] == 1, after
