"""layout.linear_cat (kernels/layout/linear_cat_torch.py): the joint attention value's two
projections written into one buffer, and the FLUX.1 / Qwen-Image sites that use it under
DITFUSE_LINEAR_CAT=1. The bits on CUDA are the gate's first-sight check and
tests/gpu/test_linear_cat_gpu.py; here: the writes equal the reference on the CPU's GEMM, every
rejection, and that the sites call the op exactly when they should, bitwise diffusers either way.
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.contracts.ops import LOSSLESS
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.layout import linear_cat_torch as lc
from ditfuse.models import families


def _t(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("s_a,s_b,k_a,k_b,n", [(8, 13, 32, 48, 64), (1, 5, 16, 16, 128), (77, 1, 24, 40, 32)])
def test_writes_equal_the_reference(dtype, bias, s_a, s_b, k_a, k_b, n):
    x_a, x_b = _t(1, s_a, k_a, dtype=dtype, seed=1), _t(1, s_b, k_b, dtype=dtype, seed=2)
    w_a, w_b = _t(n, k_a, dtype=dtype, seed=3), _t(n, k_b, dtype=dtype, seed=4)
    b_a, b_b = (_t(n, dtype=dtype, seed=5), _t(n, dtype=dtype, seed=6)) if bias else (None, None)
    got = lc.linear_cat_into(x_a, w_a, b_a, x_b, w_b, b_b)
    assert_bitwise_equal(got, ref.linear_cat(x_a, w_a, b_a, x_b, w_b, b_b), name="linear_cat")


def _args(b=1, s_a=8, s_b=4, k=16, n=128, dtype=torch.bfloat16):
    return [_t(b, s_a, k, dtype=dtype), _t(n, k, dtype=dtype), _t(n, dtype=dtype),
            _t(b, s_b, k, dtype=dtype), _t(n, k, dtype=dtype), _t(n, dtype=dtype)]


@pytest.mark.parametrize("case", ["batch 2", "strided input", "misaligned rows", "one bias", "mixed dtypes",
                                  "wrong K", "cpu"])
def test_rejections(case):
    a = _args(b=2 if case == "batch 2" else 1)
    if case == "strided input":
        a[0] = _t(1, 16, 8, dtype=torch.bfloat16).transpose(1, 2)
    elif case == "misaligned rows":
        a = _args(s_a=3, n=40)  # 3 * 40 * 2 bytes: not a multiple of 256
    elif case == "one bias":
        a[5] = None
    elif case == "mixed dtypes":
        a[3] = a[3].float()
    elif case == "wrong K":
        a[1] = _t(128, 12, dtype=torch.bfloat16)
    reason = lc._unsupported_reason(*a)
    assert reason is not None
    # the device is checked last: on this CPU every other case must be rejected for its own reason
    assert ("device" in reason) == (case == "cpu"), reason


# -- the sites ------------------------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = LOSSLESS.linear_cat

    def linear_cat(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(LOSSLESS, "linear_cat", linear_cat)
    monkeypatch.setenv("DITFUSE_DISABLE", "all")  # reference chains: isolates the site's restructuring
    return calls


def _model(family):
    fam = families.get(family)
    layers = {"flux": (2, 1), "qwenimage": (2,)}[family]
    cfg = fam.config("tiny", layers)
    cfg["num_attention_heads"] = 128 // cfg["attention_head_dim"]  # inner width 128
    torch.manual_seed(0)
    m = fam.load_class()(**cfg)
    return m.to(torch.bfloat16).eval().requires_grad_(False)


def _inputs(family, m, batch, txt):
    return families.get(family).make_inputs(m, batch, "64x48", device="cpu", txt_tokens=txt)


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
@pytest.mark.parametrize("case", ["on", "off", "batch 2"])
def test_sites_call_the_op_exactly_when_they_should(family, case, spy, monkeypatch):
    if case != "off":
        monkeypatch.setenv("DITFUSE_LINEAR_CAT", "1")
    m = _model(family)  # inner width 128 in bf16: 256 bytes per row, every text length aligns
    inp = _inputs(family, m, 2 if case == "batch 2" else 1, txt=9)
    with torch.no_grad():
        want = m(**inp)[0]
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            got = m(**inp)[0]
    finally:
        h.unmount()
    assert_bitwise_equal(got, want, name=f"{family} {case}")
    if case == "on":
        assert len(spy) == 2, spy  # one per dual block
    else:
        assert spy == []


def test_site_precheck(monkeypatch):
    from ditfuse.models.base import linear_cat_applies

    x1, x2 = _t(1, 9, 8), _t(1, 5, 8)
    assert not linear_cat_applies(x1, x2, 64), "off by default"
    monkeypatch.setenv("DITFUSE_LINEAR_CAT", "1")
    assert linear_cat_applies(x1, x2, 64)  # 9 * 64 * 4 bytes = 2304: a multiple of 256
    assert not linear_cat_applies(x1, x2, 40), "9 * 40 * 4 bytes: not 256-byte aligned"
    assert not linear_cat_applies(_t(2, 9, 8), _t(2, 5, 8), 64), "batch 2"
