"""linear.linear_gelu_tanh on CUDA: the bf16 GEMM with the tanh-GELU in its epilogue is bitwise
``F.gelu(F.linear(x, w, b), approximate="tanh")`` at FLUX.1's FeedForward / single-block MLP
shapes (B=1 and B=2 at 1024², the text stream, written into proj_out's input buffer), and with
DITFUSE_GEMM_GELU=1 the FLUX.1 adapter at real width is bitwise diffusers, the op verified and run
with no fallback. The equality is an observation about cuBLAS's kernel (no split K, the same MMA
chain): these tests are where it is observed (bench/probes/probe_gemm_exact.py times it)."""

import pytest
import torch

import ditfuse
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.linear import linear_gelu_triton as lg
from ditfuse.models import families

DEV = "cuda"


def _problem(lead, K, N, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*lead, K, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device=DEV, generator=g) * K ** -0.5).to(torch.bfloat16)
    b = (torch.randn(N, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    return x, w, b


@pytest.mark.parametrize("lead,K,N,into", [
    ((1, 4096), 3072, 12288, 0),     # dual block, image stream FF
    ((1, 512), 3072, 12288, 0),      # dual block, text stream FF
    ((1, 4608), 3072, 12288, 3072),  # single block: proj_mlp into proj_out's [.., 3072 + 12288] input
    ((2, 4096), 3072, 12288, 0),     # B=2 (CFG or two prompts)
    ((2, 4608), 3072, 12288, 3072),
], ids=["dual-img", "dual-txt", "single-into", "dual-img-B2", "single-into-B2"])
def test_op_bitwise_at_flux_shapes(lead, K, N, into):
    x, w, b = _problem(lead, K, N)
    assert lg.can_use_linear_gelu_tanh(x, w, b)
    want = ref.linear_gelu_tanh(x, w, b)
    if into:
        buf = torch.full((*lead, into + N), 7.0, device=DEV, dtype=torch.bfloat16)
        lg.linear_gelu_tanh(x, w, b, out=buf[..., into:])
        assert (buf[..., :into] == 7.0).all()
        got = buf[..., into:]
    else:
        got = lg.linear_gelu_tanh(x, w, b)
    assert_bitwise_equal(got, want, name=f"linear_gelu_tanh {lead}x{K}->{N}")


def test_flux_adapter_real_width(monkeypatch):
    monkeypatch.setenv("DITFUSE_GEMM_GELU", "1")
    fam = families.get("flux")
    cfg = fam.config("dev", (1, 1))
    torch.manual_seed(0)
    with torch.device(DEV):
        m = fam.load_class()(**cfg)
    m = m.to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(m, 1, "1024x1024", device=DEV, txt_tokens=512)
    with torch.no_grad():
        want = m(**inp)[0]
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert_bitwise_equal(m(**inp)[0], want, name="flux with the GEMM-GELU")
    finally:
        h.unmount()
    rep = ditfuse.gate.report()
    assert not rep.disabled and not rep.fallbacks, (rep.disabled, rep.fallbacks)
    assert rep.verified.get("linear.linear_gelu_tanh") and rep.kernel_calls("linear.linear_gelu_tanh") > 0
