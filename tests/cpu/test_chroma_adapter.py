"""The Chroma adapter on a tiny random-weight ChromaTransformer2DModel (CPU, Triton interpreter).

Chroma runs FLUX.1's chains on per-block modulation slices and FLUX.1's attention with a
text-padding mask. The fast forwards on the eager reference chains must equal diffusers bitwise
(fp32 and bf16, with and without the mask); mounted, the model's output stays bitwise whatever
the gate decided, and every op reaches the gate. Bitwise kernels are proved on the GPU
(tests/gpu/test_chroma_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import chroma as chroma_adapter
from ditfuse.models import families
from ditfuse.models import image_family_configs as ifc
from tests.support.reference_forwards import reference_forwards

CHROMA = families.get("chroma")


def _model(dtype=torch.bfloat16):
    return CHROMA.build("tiny", device="cpu", dtype=dtype)


def _inputs(m, batch=1, txt=9, hw=(64, 48), dtype=torch.bfloat16, mask=True):
    """``mask``: True (the pipeline's float 1 / 0 mask in the model dtype), "bool" (a caller's
    bool mask), False (none)."""
    inp = ifc.step_inputs("chroma", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype)
    if not mask:
        inp["attention_mask"] = None
    elif mask == "bool":
        inp["attention_mask"] = inp["attention_mask"].bool()
    return inp


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


EXPECTED_SITES = sorted(["chroma.dual_block"] * 2 + ["chroma.single_block"] * 2 + ["chroma.attention"] * 4
                        + ["chroma.norm_out", "chroma.transformer", "chroma.pos_embed", "chroma.timestep_embed"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask", [True, "bool", False], ids=["masked", "bool-masked", "unmasked"])
def test_fast_forwards_match_diffusers_call_for_call(dtype, mask):
    m = _model(dtype)
    inp = _inputs(m, batch=2, dtype=dtype, mask=mask)
    base = _run(m, inp)
    with reference_forwards(m, chroma_adapter.SITES, require_applies=True) as patched:
        assert len(patched) == len(EXPECTED_SITES)
        assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype} mask={mask}")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch):
    m = _model()
    inp = _inputs(m, batch=batch)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "chroma"
        assert sorted(s for _, s in rep.sites) == EXPECTED_SITES
        assert not rep.skipped_sites
        assert_bitwise_equal(_run(m, inp), base, "accelerated")
        assert_bitwise_equal(_run(m, inp), base, "accelerated, second call")
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    for op in chroma_adapter.ADAPTER.ops():
        assert sum(calls.get(op, {}).values()) > 0, f"{op} never reached the gate"


def test_pos_embed_tables_reused_across_steps():
    """The transformer site names txt_ids / img_ids as the sources of the embedder's ids: the
    second step with the same ids reuses the tables."""
    from ditfuse.models import pos_cache

    m = _model(torch.float32)
    inp = _inputs(m, dtype=torch.float32, mask=False)
    h = ditfuse.accelerate(m, quality="lossless")
    try:
        before = pos_cache.counts(m)
        _run(m, inp)
        _run(m, inp)
        after = pos_cache.counts(m)
    finally:
        h.unmount()
    assert after["hits"] - before["hits"] >= 1, (before, after)


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_chroma as tc

    def forward(self, hidden_states, temb, image_rotary_emb=None, extra=None):
        pass

    monkeypatch.setattr(tc.ChromaSingleTransformerBlock, "forward", forward)
    assert "ChromaSingleTransformerBlock.forward" in chroma_adapter.ADAPTER.version_problem()


def test_family_fixture_builds_inputs():
    m = CHROMA.build("tiny", device="cpu")
    inp = CHROMA.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 12, 8) and inp["attention_mask"].shape == (2, 21)
    assert _run(m, inp).shape == (2, 12, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_timestep_embed_keeps_guidance_rows(dtype, monkeypatch):
    """The embedder site computes diffusers' CPU guidance projection once per (batch, dtype,
    device) and returns diffusers' exact output at every call; batch 1 and 2 get their own rows,
    unmount drops them."""
    from diffusers.models.transformers import transformer_chroma as tc

    m = _model(dtype)
    embed = next(mod for mod in m.modules() if isinstance(mod, tc.ChromaCombinedTimestepTextProjEmbeddings))
    projected = []
    real = type(embed.guidance_proj).forward

    def counting(self, t):
        if self is embed.guidance_proj:
            projected.append(tuple(t.shape))
        return real(self, t)

    monkeypatch.setattr(type(embed.guidance_proj), "forward", counting)
    steps = [torch.tensor([0.25], dtype=dtype), torch.tensor([0.5, 0.75], dtype=dtype), torch.tensor([1.0], dtype=dtype)]
    with torch.no_grad():
        want = [embed(t) for t in steps]
    assert len(projected) == 3
    projected.clear()
    h = ditfuse.accelerate(m)
    try:
        assert ("chroma.timestep_embed" in [s for _, s in h.report().components[0].sites])
        with torch.no_grad():
            for _ in range(2):
                for t, w in zip(steps, want):
                    assert_bitwise_equal(embed(t), w, f"timestep embed B={t.shape[0]}")
        assert projected == [(1,), (2,)], projected
        assert len(embed.__dict__[chroma_adapter._GUIDANCE_ATTR]) == 2
    finally:
        h.unmount()
    assert chroma_adapter._GUIDANCE_ATTR not in embed.__dict__


def test_joint_mask_built_once_per_mask_tensor(monkeypatch):
    """The [B, 1, S, S] joint mask is built by the first block and shared by the others (4 blocks
    in the tiny model); the same mask tensor at the next step reuses it, an in-place write to the
    mask or a new mask tensor rebuilds it; outputs stay bitwise equal to diffusers throughout."""
    m = _model(torch.float32)
    inp = _inputs(m, batch=2, dtype=torch.float32)
    base = _run(m, inp)
    other_mask = inp["attention_mask"].clone()
    other_mask[0, 0] = not bool(other_mask[0, 0])
    want_other = _run(m, dict(inp, attention_mask=other_mask.clone()))
    assert not torch.equal(want_other, base)
    built = []
    real = chroma_adapter.joint_mask_value

    def counting(mask):
        built.append(mask)
        return real(mask)

    monkeypatch.setattr(chroma_adapter, "joint_mask_value", counting)
    h = ditfuse.accelerate(m)
    try:
        assert_bitwise_equal(_run(m, inp), base, "step 1")
        assert len(built) == 1, len(built)
        assert_bitwise_equal(_run(m, inp), base, "step 2, same mask tensor")
        assert len(built) == 1, len(built)
        inp["attention_mask"].copy_(other_mask)
        assert_bitwise_equal(_run(m, inp), want_other, "after an in-place write to the mask")
        assert len(built) == 2, len(built)
        assert_bitwise_equal(_run(m, dict(inp, attention_mask=other_mask.clone())), want_other, "a new mask tensor")
        assert len(built) == 3, len(built)
    finally:
        h.unmount()
