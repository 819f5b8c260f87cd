"""RoPE tables reused across steps (ditfuse/models/pos_cache.py) on CUDA: FLUX.1 and FLUX.2 at real
head sizes, several steps with the pipelines' way of passing the same ids tensors, bitwise equal
to plain diffusers, with the reuse counted; a CUDA-graph run; an in-place edit of the ids on the
GPU recomputes."""

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import adapters, families

from tests.support.engaged import assert_engaged

DEV = "cuda"
# family -> (config overrides: real head size and RoPE axes, few layers), embedder calls per forward
CASES = {
    "flux": (dict(num_layers=1, num_single_layers=1, num_attention_heads=4), 1),
    "flux2": (dict(num_layers=1, num_single_layers=1, num_attention_heads=4), 2),
}


def _model(family):
    fam = families.get(family)
    over, _ = CASES[family]
    cfg = fam.config("dev")
    cfg.update({k: v for k, v in over.items() if k in cfg})
    torch.manual_seed(0)
    with torch.device(DEV):
        m = fam.load_class()(**cfg)
    return m.to(torch.bfloat16).eval().requires_grad_(False)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("batch", [1, 2])
def test_steps_reuse_tables_bitwise(family, batch):
    m = _model(family)
    inp = families.get(family).make_inputs(m, batch, "512x512", device=DEV, txt_tokens=77)
    want = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        for step in range(3):
            assert_bitwise_equal(_run(m, inp), want, name=f"{family} step {step}")
        n = CASES[family][1]
        assert h.report().components[0].pos_tables == {"hits": 2 * n, "misses": n, "uncached": 0}
        assert_engaged(next(a for a in adapters() if a.family == family).ops())
        inp["img_ids"].add_(1.0)  # an in-place edit on the GPU: the next step recomputes
        got = _run(m, inp)
        assert h.report().components[0].pos_tables["misses"] == n + 1
    finally:
        h.unmount()
    assert_bitwise_equal(got, _run(m, inp), name=f"{family} after an in-place edit")


def test_flux_cuda_graph_with_cached_tables():
    m = _model("flux")
    inp = families.get("flux").make_inputs(m, 1, "512x512", device=DEV, txt_tokens=77)
    want = _run(m, inp)
    h = ditfuse.accelerate(m, cuda_graph=True)
    try:
        for step in range(4):  # eager (fills the cache), capture (uncached), replays
            assert_bitwise_equal(_run(m, inp), want, name=f"graph step {step}")
    finally:
        h.unmount()
