"""Cross-block fusion (ditfuse/models/handoff.py): a block's closing gated residual computes its
successor's opening LayerNorm + modulate in the same pass, and the successor uses it only when it
is called with exactly the tensors its predecessor returned.

Two modes per family: ``reference`` (DITFUSE_DISABLE=all: every op is its eager reference chain,
so the hand-off's composition of chains is proved bitwise against diffusers independently of the
interpreter's LayerNorm) and ``kernels`` (the Triton kernels under TRITON_INTERPRET=1, gated).
Then everything that may stand between two blocks: a block skipped by a user hook, a block
removed from the list after mounting, SD3's skip_layers, a residual added or an in-place edit
between blocks, fp16, the kill switch. Each compares with plain diffusers given the same
intervention, bit for bit, and checks how many hand-offs were used or discarded. Those run on the
reference chains: on CPU the interpreted LayerNorm kernels reproduce CUDA's reduction order, not
the CPU eager one, so once verified at first sight they can differ from CPU eager by an ulp on
other values (a hook's +0.25) — a CPU-only artifact that would hide what these tests check. The same paths at
real widths on the GPU: tests/gpu/test_handoff_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models.base import handoff_counts, site_hooks

from .tiny import flux_inputs, tiny_flux


@pytest.fixture
def reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def _build(family: str, layers: tuple[int, ...], dtype=torch.bfloat16, **over):
    fam = families.get(family)
    torch.manual_seed(0)
    m = fam.load_class()(**dict(fam.config("tiny", layers), **over))
    return m.to(dtype).eval().requires_grad_(False)


def _inputs(family: str, m, batch: int, dtype=torch.bfloat16, **kw):
    fam = families.get(family)
    size = "32x16x5" if family == "wan" else "64x48"
    return fam.make_inputs(m, batch, size, device="cpu", dtype=dtype, txt_tokens=7, **kw)


# family -> (model builder, links with a successor)
CASES = {
    # 3 dual (0->1, 1->2) + 3 single (0->1, 1->2); the last dual hands nothing to the first single
    "flux": (lambda dt: tiny_flux(dtype=dt, layers=(3, 3), guidance=True), 4),
    # blocks 0, 1 dual attention (SD35AdaLayerNormZeroX), 2 plain, 3 context_pre_only
    "sd3": (lambda dt: _build("sd3", (4,), dt, dual_attention_layers=(0, 1)), 3),
    "qwenimage": (lambda dt: _build("qwenimage", (3,), dt), 2),
    "flux2": (lambda dt: _build("flux2", (3, 3), dt), 4),
    "wan": (lambda dt: _build("wan", (3,), dt), 2),
}


def _case_inputs(family, m, batch, dtype=torch.bfloat16):
    if family == "flux":
        return flux_inputs(m, batch=batch, img=24, txt=7, dtype=dtype)
    return _inputs(family, m, batch, dtype)


@pytest.mark.slow  # tiny models through the interpreter: seconds on 2 cores
@pytest.mark.parametrize("mode", ["reference", "kernels"])
@pytest.mark.parametrize("family", list(CASES))
def test_handoff_bitwise_and_used(family, mode, monkeypatch):
    if mode == "reference":
        monkeypatch.setenv("DITFUSE_DISABLE", "all")
    build, links = CASES[family]
    m = build(torch.bfloat16)
    inp = _case_inputs(family, m, batch=2)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        first, second = _run(m, inp), _run(m, inp)
        counts = handoff_counts(m)
    finally:
        h.unmount()
    assert_bitwise_equal(first, base, f"{family} {mode} first call")
    assert_bitwise_equal(second, base, f"{family} {mode} second call")
    assert counts == {"links": links, "used": 2 * links, "discarded": 0}, counts
    assert_bitwise_equal(_run(m, inp), base, f"{family} after unmount")


@pytest.mark.slow
def test_first_and_last_blocks_and_op_counts():
    """The first block of each list opens itself; the last closes with a plain gated residual
    (the next list's / norm_out's opening is not fused); every boundary inside a list is one
    gate_residual_layernorm_modulate per stream."""
    m = tiny_flux(dtype=torch.bfloat16, layers=(3, 3))
    inp = flux_inputs(m, batch=2, img=24, txt=7, dtype=torch.bfloat16)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        links = {p: hk.link for p, _, hk in site_hooks(m) if hk.site.chained}
        assert links["transformer_blocks.0"].successor is m.transformer_blocks[1]
        assert links["transformer_blocks.2"].successor is None
        assert links["single_transformer_blocks.1"].successor is m.single_transformer_blocks[2]
        assert links["single_transformer_blocks.2"].successor is None
        _run(m, inp)  # first sight: verification
        ditfuse.gate.reset()
        out = _run(m, inp)
        # verified at first sight: each call now counts once, as "kernel" or (eager) "reference"
        calls = {op: c.get("kernel", 0) + c.get("reference", 0) for op, c in ditfuse.gate.report().calls.items()}
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "accelerated")
    # dual block 0 (image, text) + single block 0 + norm_out
    assert calls["norm.layernorm_modulate"] == 4, calls
    # last dual (image, text) + last single
    assert calls["modulate.gate_residual"] == 3, calls
    # 3 dual norm2 x 2 streams + 2 dual boundaries x 2 streams + 2 single boundaries
    assert calls["norm.gate_residual_layernorm_modulate"] == 12, calls


class _SkipBlock(ModelHook):
    """A user hook that skips the block: returns its inputs as its outputs."""

    def new_forward(self, module, *args, **kwargs):
        if "temb_mod" in kwargs:  # FLUX.2 single block: one joint stream
            return kwargs["hidden_states"]
        return kwargs["encoder_hidden_states"], kwargs["hidden_states"]


def _skip(block, name="user.skip"):
    HookRegistry.check_if_exists_or_initialize(block).register_hook(_SkipBlock(), name)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["before", "after"])
def test_block_skipped_by_a_user_hook(when, reference_chains):
    """A user's diffusers hook skips dual block 1 and single block 1 (registered before or after
    accelerate). A block whose successor carries a foreign hook does not speculate; the skipped
    block's successor opens itself; the output is diffusers' with the same hooks."""
    m = tiny_flux(dtype=torch.bfloat16, layers=(4, 4))
    inp = flux_inputs(m, batch=2, img=24, txt=7, dtype=torch.bfloat16)
    if when == "before":
        _skip(m.transformer_blocks[1])
        _skip(m.single_transformer_blocks[1])
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        if when == "after":
            _skip(m.transformer_blocks[1])
            _skip(m.single_transformer_blocks[1])
            base = None
        out = _run(m, inp)
        counts = handoff_counts(m)
    finally:
        h.unmount()
    if base is None:
        base = _run(m, inp)  # the user hooks stay after unmount
    assert_bitwise_equal(out, base, f"user hook skipping blocks ({when} accelerate)")
    # per list: 0->1 not speculated (foreign hook), 1->2 never produced (1 skipped), 2->3 used
    assert counts == {"links": 6, "used": 2, "discarded": 0}, counts


@pytest.mark.slow
def test_block_removed_from_the_list_after_mounting(reference_chains):
    """Dual block 1 deleted from the ModuleList after accelerate (layer pruning): block 0 still
    links to it and speculates, its payload's target is never called, block 2 must not use it."""
    m = tiny_flux(dtype=torch.bfloat16, layers=(3, 1))
    inp = flux_inputs(m, batch=1, img=24, txt=7, dtype=torch.bfloat16)
    h = ditfuse.accelerate(m)
    try:
        del m.transformer_blocks[1]
        out = _run(m, inp)
        out2 = _run(m, inp)
        counts = handoff_counts(m)
    finally:
        h.unmount()
    base = _run(m, inp)
    assert_bitwise_equal(out, base, "pruned list")
    assert_bitwise_equal(out2, base, "pruned list, second call")
    # block 0 -> (removed) 1: discarded once, then block 0 stops speculating
    assert counts["discarded"] == 1 and counts["used"] == 0, counts


@pytest.mark.slow
def test_sd3_skip_layers(reference_chains):
    """SD3's own skip_layers: block 1 is not called, block 2 gets block 0's outputs unchanged and
    must open itself with its own modulation."""
    m = _build("sd3", (4,), torch.bfloat16, dual_attention_layers=(0, 1))
    inp = _inputs("sd3", m, 2)
    inp["skip_layers"] = [1]
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        out, out2 = _run(m, inp), _run(m, inp)
        counts = handoff_counts(m)
        del inp["skip_layers"]
        plain = _run(m, inp)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "skip_layers=[1]")
    assert_bitwise_equal(out2, base, "skip_layers=[1], second call")
    # 0 -> 1: discarded once (target skipped), then not speculated; 2 -> 3 used twice
    assert counts == {"links": 3, "used": 2, "discarded": 1}, counts
    assert_bitwise_equal(plain, _run(m, inp), "no skip after a skipping call")


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["residual", "in_place"])
def test_outputs_changed_between_blocks(edit, reference_chains):
    """A forward hook on dual block 0 adds to its image output (a ControlNet-style residual: a new
    tensor) or edits it in place (same object, bumped version counter): block 1 must not use the
    payload computed from the unedited output."""
    def hook(module, args, out):
        enc, hid = out
        if edit == "residual":
            return enc, hid + 0.25
        hid.add_(0.25)
        return out

    m = tiny_flux(dtype=torch.bfloat16, layers=(3, 1))
    inp = flux_inputs(m, batch=2, img=24, txt=7, dtype=torch.bfloat16)
    handle = m.transformer_blocks[0].register_forward_hook(hook)
    try:
        base = _run(m, inp)
        h = ditfuse.accelerate(m)
        try:
            out, out2 = _run(m, inp), _run(m, inp)
            counts = handoff_counts(m)
        finally:
            h.unmount()
    finally:
        handle.remove()
    assert_bitwise_equal(out, base, f"{edit} between blocks")
    assert_bitwise_equal(out2, base, f"{edit} between blocks, second call")
    # 0 -> 1 discarded once, then not speculated; 1 -> 2 used twice
    assert counts == {"links": 2, "used": 2, "discarded": 1}, counts


@pytest.mark.slow
def test_speculation_resumes_when_the_edit_stops(reference_chains):
    m = tiny_flux(dtype=torch.bfloat16, layers=(2, 1))
    inp = flux_inputs(m, batch=1, img=24, txt=7, dtype=torch.bfloat16)
    base = _run(m, inp)
    handle = m.transformer_blocks[0].register_forward_hook(lambda mod, a, out: (out[0], out[1] + 0))
    h = ditfuse.accelerate(m)
    try:
        _run(m, inp)
        handle.remove()
        outs = [_run(m, inp) for _ in range(3)]
        counts = handoff_counts(m)
    finally:
        h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"call {i} after the hook went")
    # discarded once; the next call records a match without a payload; the two after use theirs
    assert counts == {"links": 1, "used": 2, "discarded": 1}, counts


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fp16", "off"])
def test_no_handoff_for_fp16_or_when_switched_off(case, monkeypatch, reference_chains):
    """fp16 clips after the residual (the fused LayerNorm would see the unclipped sum): no
    hand-off. DITFUSE_HANDOFF=0: none either. Both bitwise diffusers."""
    dtype = torch.float16 if case == "fp16" else torch.bfloat16
    if case == "off":
        monkeypatch.setenv("DITFUSE_HANDOFF", "0")
    m = tiny_flux(dtype=dtype, layers=(2, 2))
    inp = flux_inputs(m, batch=2, img=24, txt=7, dtype=dtype)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        out = _run(m, inp)
        counts = handoff_counts(m)
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, case)
    assert counts == {"links": 2, "used": 0, "discarded": 0}, counts


def test_report_counts_handoffs():
    m = tiny_flux(layers=(2, 1))
    h = ditfuse.accelerate(m)
    try:
        rep = h.report()
        if rep.components[0].status != "mounted":
            pytest.skip("fused ops unavailable here (no CUDA, no interpreter)")
        assert rep.components[0].handoffs == {"links": 1, "used": 0, "discarded": 0}
        assert "cross-block hand-offs: 1 link" in rep.summary()
        assert rep.to_dict()["components"][0]["handoffs"]["links"] == 1
    finally:
        h.unmount()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
def test_inference_mode_runs_without_handoff(family, reference_chains):
    """Under torch.inference_mode every tensor is an inference tensor, which has no version
    counter: the hand-off cannot see an in-place edit between blocks, so it stands down (round
    9's hand-off raised "Inference tensors do not track version counter" there). Bitwise
    diffusers, none used."""
    build, links = CASES[family]
    m = build(torch.bfloat16)
    with torch.inference_mode():
        inp = _case_inputs(family, m, batch=2)
        base = m(**inp)[0]
    h = ditfuse.accelerate(m)
    try:
        with torch.inference_mode():
            outs = [m(**inp)[0] for _ in range(2)]
        counts = handoff_counts(m)
    finally:
        h.unmount()
    for out in outs:
        assert_bitwise_equal(out, base, f"{family} under inference_mode")
    assert counts == {"links": links, "used": 0, "discarded": 0}, counts
