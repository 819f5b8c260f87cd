"""ControlNets (FLUX.1 single and Union, SD3.5, Qwen-Image) and Wan VACE on CUDA: every output
(each control residual) bitwise equal to plain diffusers, the fast path engaged (every op the gate
saw verified, nothing fell back, kernels ran). Builders and inputs: tests/cpu/test_variants.py
(tiny configs, zero-initialised projections randomised)."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import adapters
from tests.cpu.test_variants import CASES, _randomize_zeros, _run
from tests.support.engaged import assert_engaged

DEV = "cuda"


def _to(v, dtype):
    if isinstance(v, torch.Tensor):
        v = v.to(DEV)
        return v.to(dtype) if v.is_floating_point() else v
    if isinstance(v, list):
        return [_to(x, dtype) for x in v]
    return v


@pytest.mark.parametrize("cls_name", list(CASES))
def test_variant_bitwise_and_engaged(cls_name):
    build, family, _ = CASES[cls_name]
    m, inp = build(cls_name)
    _randomize_zeros(m)
    m = m.to(DEV, torch.bfloat16).eval().requires_grad_(False)
    inp = {k: _to(v, torch.bfloat16) for k, v in inp.items()}
    ditfuse.gate.reset()
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        c = h.report().components[0]
        assert c.status == "mounted", h.report().summary()
        outs = [_run(m, inp) for _ in range(2)]  # first sight verifies; then kernels only
        mounted = {s for _, s in c.sites}
    finally:
        h.unmount()
    after = _run(m, inp)
    for i, out in enumerate([*outs, after]):
        for j, (o, b) in enumerate(zip(out, base)):
            assert_bitwise_equal(o, b, f"{cls_name} call {i} output {j}")
    adapter = next(a for a in adapters() if a.family == family)
    site_ops = {d.op for s in adapter.sites if s.name in mounted for d in s.ops}
    seen = [op for op in site_ops if op in ditfuse.gate.report().calls]
    assert seen, f"{cls_name}: no op of its sites reached the gate"
    assert_engaged(seen)
