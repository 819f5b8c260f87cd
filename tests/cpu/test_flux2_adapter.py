"""The FLUX.2 adapter on a tiny random-weight Flux2Transformer2DModel (CPU, Triton interpreter).

On CPU the gate compares each kernel with the eager chain at first sight (the interpreter's exp /
rsqrt are not CUDA's, so some ops are disabled there and run eager): the model's output must be
bitwise unchanged whatever the gate decided, every op must have reached the gate, and the
report must list every site. Bitwise kernels are proved on the GPU (tests/gpu/test_flux2_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import flux2 as flux2_adapter
from ditfuse.models import image_family_configs as ifc


def _model(dtype=torch.bfloat16):
    return ifc.build("flux2", "tiny", dtype=dtype)


def _inputs(m, batch=1, txt=7, hw=(64, 48), dtype=torch.bfloat16):
    return ifc.step_inputs("flux2", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


EXPECTED_SITES = sorted(
    ["flux2.double_block"] * 2 + ["flux2.attention"] * 2 + ["flux2.feed_forward"] * 4
    + ["flux2.single_block"] * 2 + ["flux2.parallel_attention"] * 2 + ["flux2.norm_out"]
    + ["flux2.pos_embed"]  # the RoPE table cache (models/pos_cache.py)
)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch):
    m = _model()
    inp = _inputs(m, batch=batch)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.status == "mounted" and rep.adapter == "flux2"
    assert sorted(s for _, s in rep.sites) == EXPECTED_SITES
    assert not rep.skipped_sites
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    inp2 = _inputs(m, batch=batch, txt=13, hw=(32, 80))  # another resolution and text length
    base2 = None
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
    h = ditfuse.accelerate(m)
    _run(m, inp)
    calls = ditfuse.gate.report().calls
    h.unmount()
    for op in flux2_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert sum(c.values()) > 0, f"{op} never reached the gate: {dict(c)}"


def test_fast_forwards_match_diffusers_call_for_call():
    """Each site's fast forward with the eager reference table equals the module's own forward
    bitwise (the reference table is exactly diffusers' chains), per module, fp32 and bf16."""
    from tests.support.reference_forwards import reference_forwards

    for dtype in (torch.float32, torch.bfloat16):
        m = _model(dtype)
        inp = _inputs(m, batch=2, txt=5, dtype=dtype)
        base = _run(m, inp)
        with reference_forwards(m, flux2_adapter.SITES):
            assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype}")


def test_kv_cache_processor_and_extra_kwargs_keep_diffusers_forward():
    from diffusers.models.transformers import transformer_flux2 as tf

    m = _model()
    m.transformer_blocks[0].attn.set_processor(tf.Flux2KVAttnProcessor())
    m.single_transformer_blocks[1].attn.set_processor(tf.Flux2KVParallelSelfAttnProcessor())
    inp = _inputs(m)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    skipped = dict(rep.skipped_sites)
    assert "Flux2KVAttnProcessor" in skipped["transformer_blocks.0.attn"]
    assert "Flux2KVParallelSelfAttnProcessor" in skipped["single_transformer_blocks.1.attn"]
    assert_bitwise_equal(_run(m, inp), base, "with KV processors")
    h.unmount()


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_flux2 as tf

    def forward(self, x, extra=None):
        pass

    monkeypatch.setattr(tf.Flux2FeedForward, "forward", forward)
    assert "Flux2FeedForward.forward" in flux2_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    assert all(not s.close_ops() for s in flux2_adapter.SITES)


def test_family_fixture_builds_inputs():
    from ditfuse.models import families

    fam = families.get("flux2")
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 12, 8) and inp["encoder_hidden_states"].shape == (2, 9, 24)
    assert _run(m, inp).shape == (2, 12, 8)
