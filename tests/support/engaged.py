"""Model-level bitwise comparison shared by the GPU adapter tests: accelerated vs plain diffusers,
and proof that the fast path engaged (every op verified, nothing fell back, kernels ran)."""

from __future__ import annotations

import os
from typing import Any

import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal


# AutoencoderKL's channels-last convolutions (models/autoencoder_kl.py): exactness against cuDNN's
# NCHW convolution is observed per problem (a per-signature refusal is the gate's verdict), and
# they decline convolutions with fewer than 32 input channels (CL_MIN_IN_CHANNELS, round 24), which
# the tiny presets' VAEs have. A whole-pipeline test on a tiny VAE allows both.
TINY_VAE_CL_CONVS = ("modulate.conv_bias_cl", "modulate.conv_bias_residual_cl")


def assert_engaged(ops, per_signature_ok: tuple[str, ...] = (), declined_ok: tuple[str, ...] = ()) -> None:
    """Every op in ``ops`` verified, ran its kernel, nothing disabled or fallen back. For the ops in
    ``per_signature_ok`` (``OpDescriptor.per_signature``: exactness observed per cuDNN problem) a
    signature the gate found unequal and sent to eager is the gate doing its job: allowed, printed.
    For the ops in ``declined_ok`` a signature the kernel declined (``UnsupportedInput``: an input
    outside what it reproduces, e.g. a norm torch splits across thread blocks) is allowed, printed;
    the op must still have run its kernel on other signatures."""
    rep = ditfuse.gate.report()
    assert not rep.disabled, f"ops disabled: {rep.disabled}"
    allowed = [f for f in rep.fallbacks
               if (f.op in per_signature_ok and f.reason.startswith("bitwise mismatch"))
               or (f.op in declined_ok and f.reason.startswith("unsupported input"))]
    for f in allowed:
        print(f"[engaged] {f.op}: one signature runs eager by the gate's verdict: {f.reason}")
    rest = [f for f in rep.fallbacks if f not in allowed]
    assert not rest, f"fallbacks: {[(f.op, f.reason) for f in rest]}"
    for op in ops:
        c = rep.calls.get(op, {})
        assert rep.verified.get(op), f"{op} never verified; calls {dict(c)}"
        assert op in declined_ok or c.get("unsupported", 0) == 0, f"{op} raised UnsupportedInput {c['unsupported']}x"
        assert c.get("kernel", 0) > 0, f"{op}: kernel never ran; calls {dict(c)}"


def compare_accelerated(model: torch.nn.Module, inputs: dict[str, Any], ops, label: str = "") -> None:
    """Plain forward, accelerated forward twice (first sight verifies; then kernels only), plain
    again after unmount: all bitwise equal; then :func:`assert_engaged`."""
    ditfuse.gate.reset()
    with torch.no_grad():
        base = model(**inputs)[0]
        h = ditfuse.accelerate(model)
        try:
            assert h.report().components[0].status == "mounted", h.report().summary()
            first = model(**inputs)[0]
            second = model(**inputs)[0]
        finally:
            h.unmount()
        after = model(**inputs)[0]
    assert_bitwise_equal(first, base, f"{label} first call")
    assert_bitwise_equal(second, base, f"{label} second call (kernels only)")
    assert_bitwise_equal(after, base, f"{label} after unmount")
    assert_engaged(ops)


def handoff_counts_after(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, int]:
    """Mount, run one forward, unmount: the cross-block hand-off's counts for that forward
    (``{"links", "used", "discarded"}``, models/handoff.py)."""
    with torch.no_grad():
        h = ditfuse.accelerate(model)
        try:
            model(**inputs)
            return ditfuse.models.handoff_counts(model)
        finally:
            h.unmount()


def compare_cuda_graph(model: torch.nn.Module, inputs: dict[str, Any], inputs2: dict[str, Any], label: str = "") -> None:
    """``accelerate(model, cuda_graph=True)``: the first call warms up (eager, first-sight
    verification), the second captures, the third replays; then new inputs of the same shapes
    replay. Every output bitwise equal to the plain model's; exactly one capture, at least two
    replays."""
    with torch.no_grad():
        base, base2 = model(**inputs)[0], model(**inputs2)[0]
        h = ditfuse.accelerate(model, cuda_graph=True)
        try:
            runner = h._graphs[type(model).__name__]
            outs = [model(**inputs)[0] for _ in range(3)]  # warm-up, capture, replay
            out2 = model(**inputs2)[0]
            assert runner.captures == 1 and runner.replays >= 2, (label, runner.captures, runner.replays)
        finally:
            h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"{label} graph call {i}")
    assert_bitwise_equal(out2, base2, f"{label} graph, new inputs")


def assert_gate_clean(rep: Any, label: str = "") -> None:
    """No gated op fell back or was disabled (``rep``: ``ditfuse.gate.report()``), with one
    exception under Triton's interpreter (the CPU suite): a *bitwise mismatch* is allowed and
    printed. There the kernels follow CUDA's reduction order in NumPy while the gate's reference
    is torch's CPU code: for some data and some hosts one bf16 element rounds 1 ulp away (tests/
    cpu/test_videos_wan_i2v.py, conftest ``verify_every_call``), and the gate falling back is it
    doing its job; the output is the reference's bits either way. A kernel that raised, an input a
    kernel declined and an output in another layout are never allowed; on CUDA nothing is."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()

    def allowed(reason: str) -> bool:
        return interpreted and reason.startswith("bitwise mismatch")

    for f in rep.fallbacks:
        if allowed(f.reason):
            print(f"[gate] {label} {f.op}: interpreter vs CPU eager: {f.reason}")
    rest = [(f.op, f.reason) for f in rep.fallbacks if not allowed(f.reason)]
    disabled = {op: why for op, why in rep.disabled.items() if not allowed(why)}
    assert not rest and not disabled, f"{label}: fallbacks {rest}; disabled {disabled}"
