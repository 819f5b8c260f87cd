"""The Qwen-Image adapter on a tiny random-weight QwenImageTransformer2DModel (CPU, Triton
interpreter). On CPU the gate compares each kernel with the eager chain at first sight (the
interpreter's LayerNorm is not CUDA's, so those ops are disabled here and run eager): the output
must be bitwise unchanged whatever the gate decided, and every op must reach the gate. The fast
forwards with the eager reference table must equal diffusers' forwards bitwise. Kernels are
proved on the GPU (tests/gpu/test_qwenimage_gpu.py).
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
def test_mount_unmount_outputs_bitwise_unchanged(batch, dtype):
    m = _model(dtype)
    inp = _inputs(m, batch=batch, dtype=dtype)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.adapter == "qwenimage"
    assert sorted(s for _, s in rep.sites) == ["qwenimage.block"] * 2 + ["qwenimage.norm_out"]
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
    from ditfuse.contracts.ops import LOSSLESS
    from ditfuse.kernels import DESCRIPTORS

    class Ref:
        quality = LOSSLESS.quality

        def __getattr__(self, attr):
            for d in DESCRIPTORS:
                if d.name == attr:
                    return d.load_reference()
            raise AttributeError(attr)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m = _model(dtype)
        inp = _inputs(m, batch=2, txt=5, dtype=dtype)
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[1, 3:] = False
        inp["encoder_hidden_states_mask"] = mask
        base = _run(m, inp)
        saved = []
        by_cls = {s.cls_name: s for s in qwen_adapter.SITES}
        for mod in m.modules():
            site = by_cls.get(type(mod).__name__)
            if site is None:
                continue
            assert site.applies(mod) is None, site.applies(mod)
            orig = mod.forward
            saved.append((mod, orig))
            mod.forward = (lambda site, mod, orig: lambda *a, **k: site.forward(mod, orig, *a, _ops=Ref(), **k))(site, mod, orig)
        assert len(saved) == len(m.transformer_blocks) + 1
        try:
            assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype}")
        finally:
            for mod, orig in saved:
                mod.forward = orig


def test_zero_cond_t_keeps_diffusers_forward():
    m = _model(zero_cond_t=True)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    skipped = dict(rep.skipped_sites)
    assert all("zero_cond_t" in skipped[f"transformer_blocks.{i}"] for i in range(2)), skipped
    h.unmount()


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_qwenimage as tq

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, extra=None):
        pass

    monkeypatch.setattr(tq.QwenImageTransformerBlock, "forward", forward)
    assert "QwenImageTransformerBlock.forward" in qwen_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    assert all(not s.close_ops() for s in qwen_adapter.SITES)


def test_family_fixture_builds_inputs():
    from ditfuse.models import families

    fam = families.get("qwenimage")
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert inp["hidden_states"].shape == (2, 12, 16) and inp["encoder_hidden_states"].shape == (2, 9, 24)
    assert _run(m, inp).shape == (2, 12, 16)
