"""The HunyuanVideo 1.5 adapter on a tiny random-weight HunyuanVideo15Transformer3DModel (CPU).

The block's fast forward on the eager reference chains equals diffusers' forward bitwise (fp32,
bf16, fp16; batch 1 and 2 with differently padded prompts; odd latent grids); accelerated
(interpreter kernels behind the gate) the output stays bitwise, every op reaches the gate and the
blocks hand off. Kernels are proved on the GPU (tests/gpu/test_hunyuanvideo15_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models import hunyuanvideo15 as hy
from tests.support.reference_forwards import reference_forwards

FAM = families.get("hunyuanvideo15")


def _model(dtype=torch.bfloat16):
    m = FAM.build("tiny", device="cpu", dtype=dtype)
    with torch.no_grad():  # a modulation that matters
        for name, p in m.named_parameters():
            if ".norm1" in name and "linear" in name:
                p.mul_(20)
    return m


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("batch,size", [(1, "64x48x5"), (2, "80x48x1")])
def test_fast_forwards_on_reference_chains_match_diffusers(dtype, batch, size):
    m = _model(dtype)
    inp = FAM.make_inputs(m, batch, size, device="cpu", dtype=dtype, txt_tokens=13, byt5_tokens=7, image_tokens=5)
    base = _run(m, inp)
    # the token refiner's Attention (AttnProcessor2_0) is patched too and runs diffusers' forward
    assert all(s.applies(mod) is None for s in hy.SITES[:2] for mod in
               [blk if s is hy.SITES[0] else blk.attn for blk in m.transformer_blocks])
    with reference_forwards(m, hy.SITES):
        out = _run(m, inp)
    assert_bitwise_equal(out, base, f"B={batch} {size} {dtype}")


@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated_and_handoff():
    m = _model()
    inp = FAM.make_inputs(m, 2, "64x48x5", device="cpu", txt_tokens=13, byt5_tokens=7, image_tokens=5)
    base = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert rep.adapter == "hunyuanvideo15" and rep.status == "mounted"
        # the token refiner's attention is not HunyuanVideo's processor: skipped, with the reason
        assert rep.skipped_sites and all("AttnProcessor2_0" in str(x) for x in rep.skipped_sites), rep.skipped_sites
        assert sorted(s for _, s in rep.sites) == (["hunyuanvideo15.attention"] * 3 + ["hunyuanvideo15.block"] * 3
                                                   + ["hunyuanvideo15.norm_out"])
        outs = [_run(m, inp) for _ in range(2)]
        calls = ditfuse.gate.report().calls
        counts = ditfuse.models.handoff_counts(m)
    finally:
        h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"accelerated call {i}")
    for op in hy.ADAPTER.ops():
        assert sum(calls.get(op, {}).values()) > 0, (op, calls)
    assert counts["links"] == 2 and counts["used"] == 4 and counts["discarded"] == 0, counts


def test_guards_name_what_they_refuse():
    m = _model()
    site = hy.SITES[0]
    blk = m.transformer_blocks[0]
    assert site.applies(blk) is None
    blk.norm2_context = torch.nn.LayerNorm(blk.norm2_context.normalized_shape, eps=1e-6)
    assert "norm2_context" in site.applies(blk) and "affine" in site.applies(blk)


def test_family_inputs_shapes():
    m = _model()
    inp = FAM.make_inputs(m, 1, "848x480x121", device="cpu", txt_tokens=4, byt5_tokens=3,
                          image_tokens=2)
    assert tuple(inp["hidden_states"].shape) == (1, 9, 31, 30, 53)
    with pytest.raises(ValueError, match="4k\\+1"):
        FAM.make_inputs(m, 1, "64x48x4", device="cpu")


def test_joint_mask_built_once_per_forward():
    m = _model()
    inp = FAM.make_inputs(m, 2, "64x48x5", device="cpu", txt_tokens=13, byt5_tokens=7, image_tokens=5)
    built = []
    real = hy.joint_mask
    hy.joint_mask = lambda *a: built.append(a[1:]) or real(*a)
    try:
        with reference_forwards(m, hy.SITES):
            _run(m, inp)
            _run(m, inp)
    finally:
        hy.joint_mask = real
    assert len(built) == 2, built  # once per forward, not once per block
    import gc

    gc.collect()
    assert len(hy._MASKS) == 0


def test_identity_cache_sees_writes_and_other_objects():
    from ditfuse.models.per_forward import IdentityCache

    c = IdentityCache()
    src = [torch.ones(2, 3)]
    made = []

    def f():
        made.append(1)
        return src[0][0]  # a view: the cache must copy it, or the entry would keep the key alive
    a = src[0]
    v = c.get((a,), (1,), f)
    assert v._base is None and c.get((a,), (1,), f) is v and len(made) == 1
    assert c.get((a,), (2,), f) is not v  # another extra key
    a.add_(1)
    assert torch.equal(c.get((a,), (2,), f), a[0]) and len(made) == 3
    assert c.get((a.clone(),), (2,), f) is not None and len(made) == 4
    src.clear()
    a = v = None
    import gc

    gc.collect()
    assert len(c) == 0
