"""layout.linear_cat on CUDA: the two value projections written into one buffer are bitwise the
cat of the two F.linear calls at FLUX.1's and Qwen-Image's real shapes (text lengths that are and
are not multiples of 64), and with DITFUSE_LINEAR_CAT=1 the FLUX.1 and Qwen-Image adapters use it
at batch 1, bitwise equal to diffusers, the op verified and run."""

import pytest
import torch

import ditfuse
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.layout import linear_cat_torch as lc
from ditfuse.models import families

DEV = "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s_txt,s_img,k_txt,n", [(512, 4096, 3072, 3072), (77, 4096, 3072, 3072),
                                                  (512, 4096, 3584, 3072), (333, 1024, 3072, 3072)])
def test_op_bitwise_at_real_shapes(dtype, s_txt, s_img, k_txt, n):
    g = torch.Generator(device=DEV).manual_seed(0)
    x_a = torch.randn(1, s_txt, k_txt, device=DEV, generator=g).to(dtype)
    x_b = torch.randn(1, s_img, n, device=DEV, generator=g).to(dtype)
    w_a = (torch.randn(n, k_txt, device=DEV, generator=g) * 0.02).to(dtype)
    w_b = (torch.randn(n, n, device=DEV, generator=g) * 0.02).to(dtype)
    b_a, b_b = torch.randn(n, device=DEV, generator=g).to(dtype), torch.randn(n, device=DEV, generator=g).to(dtype)
    assert lc.can_use_linear_cat(x_a, w_a, b_a, x_b, w_b, b_b)
    assert_bitwise_equal(lc.linear_cat(x_a, w_a, b_a, x_b, w_b, b_b),
                         ref.linear_cat(x_a, w_a, b_a, x_b, w_b, b_b), name="linear_cat")


@pytest.mark.parametrize("family", ["flux", "qwenimage"])
def test_adapters_use_it_at_batch_1(family, monkeypatch):
    monkeypatch.setenv("DITFUSE_LINEAR_CAT", "1")
    fam = families.get(family)
    cfg = fam.config("dev", (2, 1) if family == "flux" else (2,))
    cfg["num_attention_heads"] = 4
    torch.manual_seed(0)
    with torch.device(DEV):
        m = fam.load_class()(**cfg)
    m = m.to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(m, 1, "512x512", device=DEV, txt_tokens=77)
    with torch.no_grad():
        want = m(**inp)[0]
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert_bitwise_equal(m(**inp)[0], want, name=f"{family} with linear_cat")
    finally:
        h.unmount()
    rep = ditfuse.gate.report()
    assert not rep.disabled and not rep.fallbacks, (rep.disabled, rep.fallbacks)
    assert rep.verified.get("layout.linear_cat") and rep.kernel_calls("layout.linear_cat") > 0
