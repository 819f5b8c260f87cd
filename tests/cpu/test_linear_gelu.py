"""linear.linear_gelu_tanh (kernels/linear/linear_gelu_triton.py): a bf16 GEMM with the tanh-GELU
in its epilogue, and the FLUX.1 sites that use it under DITFUSE_GEMM_GELU=1.

Whether the accumulator's bits equal cuBLAS's is the gate's first-sight check on a GPU
(tests/gpu/test_linear_gelu_gpu.py, bench/probes/probe_gemm_exact.py). Here, under the
interpreter: the epilogue bitwise (roundings where eager has them, the GELU's code, the bias, the
writes into a buffer slice) on inputs whose GEMM sums are exact in any order; random inputs to an
ulp of the pre-activation; every rejection; and that the sites call the op exactly when they
should, bitwise diffusers either way.
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.contracts.ops import LOSSLESS
from ditfuse.kernels import reference as ref
from ditfuse.kernels.activation.gelu_tanh_triton import gelu_tanh
from ditfuse.kernels.compare import assert_bitwise_equal, first_mismatch
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.linear import linear_gelu_triton as lg
from ditfuse.models import families


def _exact(*shape, num: int, den: int, seed: int) -> torch.Tensor:
    """Multiples of 1/den in [-num/den, num/den]: products and their sums over a few hundred terms
    are exact in fp32 (and bf16-representable), so every summation order gives the same value."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-num, num + 1, shape, generator=g).float() / den).to(torch.bfloat16)


def _exact_problem(lead, K, N, bias=True, seed=0):
    x = _exact(*lead, K, num=8, den=8, seed=seed)
    w = _exact(N, K, num=8, den=16, seed=seed + 1)
    b = _exact(N, num=64, den=128, seed=seed + 2) if bias else None
    pre = x.double() @ w.double().t()
    if b is not None:
        pre = pre + b.double()
    return x, w, b, pre.to(torch.bfloat16)  # exact sums: one rounding, as cuBLAS's store


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("lead,K,N", [((1, 1), 64, 80), ((2, 37), 64, 96), ((1, 13), 40, 131),
                                      ((61,), 96, 32), ((2, 5), 8, 257)],
                         ids=["M1", "B2-S37", "K40-N131-prime", "2d-M61", "K8-N257"])
def test_epilogue_bitwise_on_exact_sums(lead, K, N, bias):
    """r16(gelu(r16(acc + bias))): the GELU applied to the rounded pre-activation, the same code
    as activation.gelu_tanh, bit for bit."""
    x, w, b, pre = _exact_problem(lead, K, N, bias)
    got = lg.linear_gelu_tanh(x, w, b)
    assert got.shape == (*lead, N) and got.is_contiguous()
    assert_bitwise_equal(got, gelu_tanh(pre), name="linear_gelu_tanh vs gelu_tanh(exact GEMM)")


@pytest.mark.parametrize("kernel", ["tma", "plain"])
@pytest.mark.parametrize("lead,K,N", [((1, 1), 64, 80), ((2, 37), 64, 96), ((61,), 96, 32), ((2, 5), 8, 264),
                                      ((1, 70), 40, 72)],
                         ids=["M1", "B2-S37", "2d-M61", "K8-N264", "K40-tail"])
def test_both_bodies_bitwise_on_exact_sums(lead, K, N, kernel):
    """The persistent TMA body (sm_90; one tile per program under the interpreter) and the cp.async
    body give the same bits: tiles past M, N and K (zero padding, clipped stores) included."""
    x, w, b, pre = _exact_problem(lead, K, N)
    out = torch.full((*lead, N), 5.0, dtype=torch.bfloat16)
    lg._launch(x, w, b, out, kernel=kernel)
    assert_bitwise_equal(out, gelu_tanh(pre), name=f"{kernel} body")


@pytest.mark.parametrize("kernel", ["tma", "plain"])
def test_both_bodies_write_a_buffer_slice_only(kernel):
    x, w, b, pre = _exact_problem((2, 37), 48, 72)
    buf = torch.full((2, 37, 24 + 72 + 8), 3.0, dtype=torch.bfloat16)
    lg._launch(x, w, b, buf[:, :, 24:96], kernel=kernel)
    assert_bitwise_equal(buf[:, :, 24:96], gelu_tanh(pre), name=f"{kernel} slice")
    assert (buf[:, :, :24] == 3.0).all() and (buf[:, :, 96:] == 3.0).all(), "columns outside the slice were written"


def test_body_choice():
    """TMA wherever it can address the tensors (16-byte bases, a row stride of 8k elements);
    the cp.async body otherwise."""
    x, w, b, _ = _exact_problem((2, 9), 32, 48)
    assert lg._tma_reason(x, w, None) is None
    assert lg._tma_reason(x, w, torch.empty(2, 9, 48 + 16, dtype=torch.bfloat16)[:, :, 16:]) is None
    assert "row stride" in lg._tma_reason(x, w, torch.empty(2, 9, 60, dtype=torch.bfloat16)[:, :, 8:56])
    assert "16-byte" in lg._tma_reason(x, w, torch.empty(2, 9, 51, dtype=torch.bfloat16)[:, :, 3:])


def _fast_problem(lead, K, N, seed=0):
    x, w, b, _ = _exact_problem(lead, K, N, seed=seed)
    return x, w, b, (x.double() @ w.double().t() + b.double()).float()  # exact in fp32 too


@pytest.mark.parametrize("lead,K,N", [((2, 37), 64, 96), ((1, 1), 64, 80), ((61,), 96, 32)])
def test_fast_is_one_rounding_of_the_fp32_gelu(lead, K, N, monkeypatch):
    """``linear_gelu_tanh_fast``: the GELU of the unrounded fp32 pre-activation, rounded once.
    (Under the interpreter the hardware ``tanh.approx`` is libdevice's tanh, so the bits are
    checkable here; on the GPU the GPU tests measure its error against fp64.)"""
    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)
    x, w, b, pre32 = _fast_problem(lead, K, N)
    got = lg.linear_gelu_tanh_fast(x, w, b)
    assert_bitwise_equal(got, gelu_tanh(pre32).to(torch.bfloat16), name="fast = r16(gelu32(acc + bias))")
    two = gelu_tanh(pre32.to(torch.bfloat16))  # eager's two roundings
    assert first_mismatch(got, two) is not None, "no element differs from eager: the one rounding did not happen"


def test_fast_into_a_slice(monkeypatch):
    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)
    x, w, b, pre32 = _fast_problem((2, 11), 48, 72)
    buf = torch.full((2, 11, 24 + 72), 3.0, dtype=torch.bfloat16)
    ret = lg.linear_gelu_tanh_fast(x, w, b, out=buf[:, :, 24:])
    assert ret.data_ptr() == buf[:, :, 24:].data_ptr() and (buf[:, :, :24] == 3.0).all()
    assert_bitwise_equal(buf[:, :, 24:], gelu_tanh(pre32).to(torch.bfloat16), name="fast slice")


@pytest.mark.parametrize("case", ["few rows", "misaligned out", "out row stride", "fp16", "strided x"])
def test_fast_declines(case, monkeypatch):
    x, w, b, _ = _exact_problem((2, 9), 32, 48)
    out = None
    if case != "few rows":
        monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)
    if case == "misaligned out":
        out = torch.empty(2, 9, 51, dtype=torch.bfloat16)[:, :, 3:]
    elif case == "out row stride":
        out = torch.empty(2, 9, 60, dtype=torch.bfloat16)[:, :, 8:56]
    elif case == "fp16":
        x, w, b = x.half(), w.half(), b.half()
    elif case == "strided x":
        x = x.transpose(0, 1)
    assert not lg.can_use_linear_gelu_tanh_fast(x, w, b, out)
    with pytest.raises(UnsupportedInput):
        lg.linear_gelu_tanh_fast(x, w, b, out)
    if case in ("misaligned out", "out row stride"):
        assert lg.can_use_linear_gelu_tanh(x, w, b, out)  # the exact op's cp.async body takes it


def test_fast_rows_threshold():
    x, w, b, _ = _exact_problem((1, lg.FAST_MIN_ROWS - 1), 8, 16)
    assert "rows" in lg._fast_reason(x, w, b)
    x, w, b, _ = _exact_problem((1, lg.FAST_MIN_ROWS), 8, 16)
    assert lg._fast_reason(x, w, b) is None


def test_writes_into_a_buffer_slice_only():
    x, w, b, pre = _exact_problem((2, 11), 48, 72)
    buf = torch.full((2, 11, 24 + 72), 3.0, dtype=torch.bfloat16)
    ret = lg.linear_gelu_tanh(x, w, b, out=buf[:, :, 24:])
    assert ret.data_ptr() == buf[:, :, 24:].data_ptr()
    assert_bitwise_equal(buf[:, :, 24:], gelu_tanh(pre), name="slice")
    assert (buf[:, :, :24] == 3.0).all(), "the attention columns were written"


@pytest.mark.parametrize("lead,K,N", [((1, 29), 136, 72), ((2, 16), 64, 40)])
def test_random_inputs_within_an_ulp_of_the_reference(lead, K, N):
    """The interpreter's MMA is numpy's fp32 matmul (another order than the CPU's bf16 GEMM), so
    pre-activations may differ by an ulp; the GELU moves that by at most about an ulp."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*lead, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16)
    b = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16)
    got = lg.linear_gelu_tanh(x, w, b).float()
    want = ref.linear_gelu_tanh(x, w, b).float()
    tol = 2 * 2.0 ** -8 * want.abs().clamp_min(2.0 ** -6)
    bad = (got - want).abs() > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements beyond 2 ulp; first at "
                           f"{bad.flatten().nonzero()[0].item()}: {got.flatten()[bad.flatten()][0]} vs "
                           f"{want.flatten()[bad.flatten()][0]}")


def test_reference_is_diffusers_gelu_module():
    from diffusers.models.activations import GELU

    m = GELU(24, 40, approximate="tanh").to(torch.bfloat16)
    x = torch.randn(3, 5, 24).to(torch.bfloat16)
    assert_bitwise_equal(ref.linear_gelu_tanh(x, m.proj.weight, m.proj.bias), m(x), name="reference")


def _args(case):
    x = _exact(2, 9, 32, num=4, den=4, seed=1)
    w = _exact(48, 32, num=4, den=4, seed=2)
    b = _exact(48, num=4, den=4, seed=3)
    out = None
    if case == "fp32":
        x, w, b = x.float(), w.float(), b.float()
    elif case == "fp16":
        x, w, b = x.half(), w.half(), b.half()
    elif case == "mixed dtypes":
        b = b.float()
    elif case == "strided x":
        x = _exact(2, 32, 9, num=4, den=4, seed=1).transpose(1, 2)
    elif case == "transposed weight":
        w = _exact(32, 48, num=4, den=4, seed=2).t()
    elif case == "wrong K":
        w = _exact(48, 24, num=4, den=4, seed=2)
    elif case == "K not a multiple of 8":
        x, w = x[..., :30].contiguous(), w[:, :30].contiguous()
    elif case == "bias shape":
        b = b[:40]
    elif case == "out shape":
        out = torch.empty(2, 9, 40, dtype=torch.bfloat16)
    elif case == "out columns strided":
        out = torch.empty(2, 9, 96, dtype=torch.bfloat16)[:, :, ::2]
    elif case == "out rows uneven":
        out = torch.empty(2, 10, 48, dtype=torch.bfloat16)[:, :9]
    elif case == "1-d x":
        x = x[0, 0]
    elif case == "empty":
        x = x[:, :0]
    elif case == "grad":
        w = w.clone().requires_grad_(True)
    elif case == "out overlaps x":
        mem = torch.zeros(2 * 9 * 32 + 2 * 9 * 48, dtype=torch.bfloat16)
        mem[:576].copy_(x.flatten())
        x, out = mem[:576].view(2, 9, 32), mem[400:400 + 864].view(2, 9, 48)
    return x, w, b, out


@pytest.mark.parametrize("case", ["fp32", "fp16", "mixed dtypes", "strided x", "transposed weight", "wrong K",
                                  "K not a multiple of 8", "bias shape", "out shape", "out columns strided",
                                  "out rows uneven", "1-d x", "empty", "grad", "out overlaps x"])
def test_rejections(case):
    x, w, b, out = _args(case)
    reason = lg._unsupported_reason(x, w, b, out)
    assert reason is not None, case
    assert not lg.can_use_linear_gelu_tanh(x, w, b, out)
    with pytest.raises(UnsupportedInput):
        lg.linear_gelu_tanh(x, w, b, out)


def test_accepts_an_unevenly_stored_batch_of_one():
    """A size-1 leading dim's stride does not matter (its rows are one block of rows)."""
    buf = torch.empty(1, 9, 64, dtype=torch.bfloat16)
    out = buf[:, :, 16:]
    x, w, b, _ = _args("none")
    assert lg.can_use_linear_gelu_tanh(x[:1], w, b, out)


# -- the sites ------------------------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = LOSSLESS.linear_gelu_tanh

    def linear_gelu_tanh(*a, **k):
        out = a[3] if len(a) > 3 else k.get("out")
        calls.append((tuple(a[0].shape), tuple(a[1].shape), out is not None))
        return real(*a, **k)

    monkeypatch.setattr(LOSSLESS, "linear_gelu_tanh", linear_gelu_tanh)
    return calls


def _flux(layers=(2, 1)):
    fam = families.get("flux")
    cfg = fam.config("tiny", layers)
    torch.manual_seed(0)
    m = fam.load_class()(**cfg)
    return m.to(torch.bfloat16).eval().requires_grad_(False)


def _run(m, inp):
    with torch.no_grad():
        want = m(**inp)[0]
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            got = m(**inp)[0]
    finally:
        h.unmount()
    return got, want


@pytest.mark.parametrize("case", ["on", "off", "batch 2", "hooked proj_mlp"])
def test_flux_sites_call_the_op_exactly_when_they_should(case, spy, monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")  # reference chains: isolates the sites' restructuring
    if case != "off":
        monkeypatch.setenv("DITFUSE_GEMM_GELU", "1")
    m = _flux()
    if case == "hooked proj_mlp":
        m.single_transformer_blocks[0].proj_mlp.register_forward_hook(lambda mod, i, o: None)
    inp = families.get("flux").make_inputs(m, 2 if case == "batch 2" else 1, "64x48", device="cpu", txt_tokens=9)
    got, want = _run(m, inp)
    assert_bitwise_equal(got, want, name=f"flux {case}")
    if case == "off":
        assert spy == []
        return
    dual = [c for c in spy if not c[2]]
    single = [c for c in spy if c[2]]
    assert len(dual) == 4, spy  # ff and ff_context of each of the two dual blocks
    assert len(single) == (0 if case == "hooked proj_mlp" else 1), spy


def test_flux_kernel_through_the_gate_is_bitwise_diffusers(monkeypatch):
    """The kernels themselves (not the references) behind the gate: whatever the gate decides per
    GEMM problem on this CPU, the output is diffusers' bits, and every problem was seen by it."""
    from ditfuse.contracts.bitexact import gate

    monkeypatch.setenv("DITFUSE_GEMM_GELU", "1")
    m = _flux()
    inp = families.get("flux").make_inputs(m, 1, "64x48", device="cpu", txt_tokens=9)
    got, want = _run(m, inp)
    assert_bitwise_equal(got, want, name="flux with the GEMM-GELU behind the gate")
    seen = gate.report().calls.get("linear.linear_gelu_tanh", {})
    assert sum(seen.values()) >= 5, seen


# -- the sm_90 code (compiled on the CPU) -----------------------------------------------------------


def test_sm90_code_is_a_wgmma_chain_without_spills():
    """Both kernels (cp.async and persistent TMA, the TMA one with the exact and the close
    epilogue) compile for the GPU at their production tiles (the interpreter runs code the GPU
    compiler rejects), their K loops lower to ``wgmma ... k16`` MMAs with an fp32 accumulator
    (the chain the equality with cuBLAS rests on), and nothing spills."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.support.linear_gelu_codegen"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [f["kernel"] for f in facts] == ["plain"] * 4 + ["tma"] * 2, out.stdout
    for f in facts:
        assert f["mma"] and all(m.startswith("m64n") and m.endswith("k16.f32.bf16.bf16") for m in f["mma"]), f
        assert f["wgmma"] > 0 and f["local_bytes"] == 0, f
        assert f["shared"] <= 227 * 1024, f  # sm_90's shared memory per block
    with_gelu = [f for f in facts if f["gelu"]]
    assert all(f["fma_rn"] > 0 for f in with_gelu), "the GELU's explicit fma (kKappa * x^3 + x) is missing"
    exact_tma, fast_tma = facts[4:]
    assert exact_tma["tma_loads"] > 0 and fast_tma["tma_loads"] > 0, facts[4:]
    # the exact epilogue is libdevice's tanh written out; the close one is the hardware tanh
    assert exact_tma["tanh_approx"] == 0 and fast_tma["tanh_approx"] > 0, facts[4:]


# (family, layer counts, size, extra make_inputs kwargs, calls per forward at batch 1)
OTHER_FAMILIES = [
    ("chroma", (2, 1), "64x48", {}, 5),  # ff and ff_context per dual block, proj_mlp per single block
    ("hunyuanvideo", (2, 1), "64x48x5", {}, 5),  # the same (its refiner's FeedForward is linear-SiLU)
    ("sd3", (3,), "64x48", {}, 5),  # ff per block, ff_context except the last (context_pre_only)
    ("qwenimage", (2,), "64x48", {}, 4),  # img_mlp and txt_mlp per block
    ("wan", (2,), "32x16x5", {}, 2),  # ffn per block
    ("ltx", (2,), "64x32x9", {}, 2),  # ff per block
    ("hunyuanvideo15", (2,), "64x48x5", dict(byt5_tokens=7, image_tokens=5), 4),  # ff and ff_context
]


@pytest.mark.parametrize("family,layers,size,kw,calls", OTHER_FAMILIES, ids=[f[0] for f in OTHER_FAMILIES])
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_other_families_feed_forwards(family, layers, size, kw, calls, on, spy, monkeypatch):
    """Every adapter whose blocks run diffusers' FeedForward with a tanh-GELU routes it through
    models.base.feed_forward, and every FLUX.1-style single block its proj_mlp through
    flux.single_block_mix: under DITFUSE_GEMM_GELU=1 one GEMM-GELU per FeedForward (its output
    projection stays diffusers' Linear) and per single block (written into proj_out's input),
    bitwise diffusers on the reference chains; off, none."""
    monkeypatch.setenv("DITFUSE_DISABLE", "all")
    if on:
        monkeypatch.setenv("DITFUSE_GEMM_GELU", "1")
    fam = families.get(family)
    torch.manual_seed(0)
    m = fam.load_class()(**fam.config("tiny", layers)).to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(m, 1, size, device="cpu", dtype=torch.bfloat16, txt_tokens=7, **kw)
    got, want = _run(m, inp)
    assert_bitwise_equal(got, want, name=f"{family} GEMM-GELU {'on' if on else 'off'}")
    assert len(spy) == (calls if on else 0), spy


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast"])
def test_under_torch_compile_through_the_custom_ops(fast, monkeypatch):
    """Traced by torch.compile, both ops are opaque custom ops (``ditfuse::linear_gelu_tanh``,
    ``ditfuse::linear_gelu_tanh_fast``) writing ``out``, with the eager call's bits."""
    monkeypatch.setattr(lg, "FAST_MIN_ROWS", 1)
    fn = lg.linear_gelu_tanh_fast if fast else lg.linear_gelu_tanh
    x, w, b, _ = _exact_problem((2, 9), 32, 48)
    want = fn(x, w, b)
    buf = torch.zeros(2, 9, 16 + 48, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, b, out: fn(x, w, b, out), backend="eager", fullgraph=True)
    compiled(x, w, b, buf[:, :, 16:])
    assert_bitwise_equal(buf[:, :, 16:], want, name="compiled")
    assert (buf[:, :, :16] == 0).all()
