"""The Qwen-Image 2.1 adapter on a tiny random-weight QwenImage21Transformer2DModel (CPU).

The fast forwards on the eager reference chains (tests/support/reference_forwards.py) must equal
diffusers' forward bitwise in every mode the pipeline runs the model in: the uncached step
(block-causal prefill of text + image tokens), the KV-cache ``extract`` step and the ``cached``
decode (target tokens only), with and without a condition image (an edit), batch 1 and 2, fp32 /
bf16 / fp16. Accelerated (interpreter kernels behind the gate), the output stays bitwise
diffusers', every op reaches the gate, the blocks hand off, and the shared modulation rows are
made once per forward. Kernels are proved on the GPU (tests/gpu/test_qwenimage21_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import image_family_configs as ifc
from ditfuse.models import qwenimage21 as q21
from ditfuse.models.qwenimage21_configs import make_inputs
from tests.support.reference_forwards import ReferenceOps, reference_forwards


def _model(dtype=torch.bfloat16, **over):
    import diffusers

    torch.manual_seed(0)
    m = diffusers.QwenImage21Transformer2DModel(**dict(ifc.config("qwenimage21", "tiny"), **over)).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-trivial QK-norm weights and a modulation that matters
        for name, p in m.named_parameters():
            if "norm_q" in name or "norm_k" in name:
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))
            elif name.startswith("modulation") or name.startswith("norm_out"):
                p.mul_(20)
    return m


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def _cases():
    for mode in ("prefill", "cached"):
        for cond in (0, 4):
            for batch in (1, 2):
                yield mode, cond, batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fast_forwards_on_reference_chains_match_diffusers(dtype):
    m = _model(dtype)
    for mode, cond, batch in _cases():
        inp = make_inputs(m, batch, "64x48", device="cpu", dtype=dtype, txt_tokens=13, mode=mode, cond=cond)
        base = _run(m, inp)
        with reference_forwards(m, q21.SITES, require_applies=True) as mods:
            out = _run(m, inp)
        # 3 blocks, their attentions, norm_out
        assert len(mods) == 7
        assert_bitwise_equal(out, base, f"{mode} cond={cond} B={batch} {dtype}")


def test_extract_step_fills_the_cache_as_diffusers_does():
    """The fast attention writes the prefix K / V the cached steps read: the cache after an
    accelerated-forward extract equals diffusers' bitwise."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    m = _model()
    inp = make_inputs(m, 2, "64x48", device="cpu", txt_tokens=13, mode="prefill", cond=4)
    caches = []
    for fast in (False, True):
        cache = QwenImage21KVCache(len(m.transformer_blocks))
        if fast:
            with reference_forwards(m, q21.SITES, require_applies=True):
                out = _run(m, dict(inp, kv_cache=cache, kv_cache_mode="extract"))
        else:
            out = _run(m, dict(inp, kv_cache=cache, kv_cache_mode="extract"))
        caches.append((cache, out))
    assert_bitwise_equal(caches[1][1], caches[0][1], "extract output")
    for i, (a, b) in enumerate(zip(caches[0][0].layer_caches, caches[1][0].layer_caches)):
        assert_bitwise_equal(b.k, a.k, f"layer {i} k")
        assert_bitwise_equal(b.v, a.v, f"layer {i} v")


@pytest.mark.parametrize("mode", ["prefill", "cached"])
@pytest.mark.usefixtures("verify_every_call")
def test_accelerated_bitwise_every_op_gated_and_handoff(mode):
    m = _model()
    inp = make_inputs(m, 2, "64x48", device="cpu", txt_tokens=13, mode=mode, cond=4)
    base = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert rep.adapter == "qwenimage21" and rep.status == "mounted" and not rep.skipped_sites
        assert sorted(s for _, s in rep.sites) == (["qwenimage21.attention"] * 3 + ["qwenimage21.block"] * 3
                                                   + ["qwenimage21.norm_out"])
        out = _run(m, inp)
        out2 = _run(m, inp)
        calls = ditfuse.gate.report().calls
        counts = ditfuse.models.handoff_counts(m)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, f"accelerated {mode}")
    assert_bitwise_equal(out2, base, f"accelerated {mode}, second call")
    for op in q21.ADAPTER.ops():
        assert sum(calls.get(op, {}).values()) > 0, (op, calls)
    # two links (block 0 -> 1 -> 2), used on both calls
    assert counts["links"] == 2 and counts["used"] == 4 and counts["discarded"] == 0, counts


def test_shared_rows_made_once_per_forward_and_released():
    m = _model()
    inp = make_inputs(m, 2, "64x48", device="cpu", txt_tokens=13, mode="prefill", cond=4)
    made = []
    real = q21.select_rows

    def counting(mod, mask):
        made.append(mod.shape)
        return real(mod, mask)

    q21.select_rows = counting
    try:
        with reference_forwards(m, q21.SITES):
            _run(m, inp)
            _run(m, inp)
    finally:
        q21.select_rows = real
    assert len(made) == 2, made  # once per forward, not once per block
    import gc

    gc.collect()
    assert len(q21.SHARED_ROWS) == 0  # the entry died with its modulation tensor


def test_shared_rows_see_an_in_place_write():
    m = _model()
    g = torch.Generator().manual_seed(5)
    mod = torch.randn(3, 4 * m.inner_dim, generator=g).bfloat16()
    mask = torch.tensor([False, True, True, False, True])
    a = q21.SHARED_ROWS.get(mod, mask)
    assert q21.SHARED_ROWS.get(mod, mask) is a
    mod.mul_(2)
    b = q21.SHARED_ROWS.get(mod, mask)
    assert b is not a
    assert_bitwise_equal(b[0], q21.select_rows(mod, mask)[0], "scale1 after the write")
    assert q21.SHARED_ROWS.get(mod, mask.clone()) is not b  # another mask object


def test_selected_rows_are_diffusers_rows():
    """:func:`select_rows` (tanh before the selection; [B, 1, D] when every token is a target
    token) gives the values diffusers' ``_select_modulation_rows`` then ``tanh`` give, bitwise."""
    from diffusers.models.transformers.transformer_qwenimage21 import _select_modulation_rows as sel

    g = torch.Generator().manual_seed(6)
    D = 8
    mod = (3 * torch.randn(3, 4 * D, generator=g)).bfloat16()
    for mask in (None, torch.tensor([False, True, True, False, True]), torch.ones(4, dtype=torch.bool)):
        got = q21.select_rows(mod, mask)
        m1, m2 = mod.chunk(2, dim=-1)
        (s1, g1), (s2, g2) = m1.chunk(2, dim=-1), m2.chunk(2, dim=-1)
        exp = (sel(s1, mask), sel(g1, mask).tanh(), sel(s2, mask), sel(g2, mask).tanh())
        for name, a, b in zip(("scale1", "gate1", "scale2", "gate2"), got, exp):
            assert_bitwise_equal(a.expand_as(b), b, f"{name} mask={None if mask is None else mask.tolist()}")


def test_guards_name_what_they_refuse():
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor

    m = _model()
    block_site, attn_site, out_site = q21.SITES
    blk = m.transformer_blocks[0]
    assert block_site.applies(blk) is None and attn_site.applies(blk.attn) is None
    assert out_site.applies(m.norm_out) is None
    blk.img_norm2 = torch.nn.LayerNorm(m.inner_dim, eps=1e-6)
    assert "img_norm2" in block_site.applies(blk) and "affine" in block_site.applies(blk)
    blk.img_norm2 = torch.nn.LayerNorm(m.inner_dim, eps=1e-6, elementwise_affine=False)
    blk.img_mlp.activation_fn = torch.nn.GELU()
    assert "SiLU" in block_site.applies(blk)
    blk.img_mlp.activation_fn = torch.nn.SiLU()
    proc = blk.attn.processor
    blk.attn.set_processor(QwenImage21FlexAttnProcessor())
    assert "flex" in attn_site.applies(blk.attn)
    blk.attn.set_processor(proc)
    blk.attn.norm_k = torch.nn.RMSNorm(16, eps=1e-6)
    assert "norm_k" in attn_site.applies(blk.attn)


def test_fp32_norm_weights_keep_the_cast():
    """QK-norm weights in fp32 under a bf16 model: diffusers' RMSNorm then returns fp32 and the
    processor's ``.to(value.dtype)`` rounds; the fast forward runs that chain (not the op) and
    stays bitwise."""
    m = _model()
    for blk in m.transformer_blocks:
        blk.attn.norm_q.weight.data = blk.attn.norm_q.weight.data.float()
        blk.attn.norm_k.weight.data = blk.attn.norm_k.weight.data.float()
    inp = make_inputs(m, 1, "64x48", device="cpu", txt_tokens=13, mode="prefill")
    base = _run(m, inp)
    ops = ReferenceOps()
    blk = m.transformer_blocks[0]
    x = torch.randn(1, 9, m.inner_dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        a = blk.attn(x)
        b = q21.attention_forward(blk.attn, blk.attn.forward, x, _ops=ops)
    assert_bitwise_equal(b, a, "fp32-weight attention")
    with reference_forwards(m, q21.SITES):
        assert_bitwise_equal(_run(m, inp), base, "model with fp32 QK-norm weights")


def test_inference_mode_stays_bitwise_without_per_block_syncs(monkeypatch):
    """Under torch.inference_mode the rows are not shared (inference tensors have no version
    counter): each block selects its rows itself, per token, without reading the mask on the host."""
    m = _model()
    inp = make_inputs(m, 2, "64x48", device="cpu", txt_tokens=13, mode="cached")
    base = _run(m, inp)
    syncs = []
    real = q21._all_target
    monkeypatch.setattr(q21, "_all_target", lambda mask: syncs.append(1) or real(mask))
    with torch.inference_mode(), reference_forwards(m, q21.SITES):
        out = m(**inp)[0]
    assert_bitwise_equal(out, base, "inference_mode")
    assert not syncs
