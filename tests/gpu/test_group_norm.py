"""norm.group_norm_silu vs eager on CUDA, bitwise (integer views), over the issue-10 sweep.

Each sweep test loops over its cases inside and reports every failing case at once. For a
failing case it says which stage differs: the statistics (fp32 mean/rstd of the exact kernels vs
``torch.native_group_norm`` on the same values in fp32, eps as the dtype rounds it), the
GroupNorm output (silu=False) or only the SiLU on top. bench/probes/probe_group_norm_order.py
then tells which contraction / instruction to change.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ditfuse.kernels import exact
from ditfuse.kernels import reference as ref
from ditfuse.kernels.common.rounding import round_to
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm import group_norm_silu_triton as gn

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# AutoencoderKL (FLUX / SD3 VAE) decoder at 1024x1024: every GroupNorm input shape.
DECODER = [(512, 128, 128), (512, 256, 256), (512, 512, 512), (256, 512, 512), (256, 1024, 1024), (128, 1024, 1024)]


def _rand(shape, dtype, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale + offset).to(dtype)


def _params(C, dtype, gen):
    return _rand((C,), dtype, gen, 0.3, 1.0), _rand((C,), dtype, gen, 0.2)


def _diagnose(x, G, w, b, label):
    """Which stage differs, for a failing case (statistics, GroupNorm, SiLU)."""
    notes = []
    xf = x.float().contiguous()
    N, C = x.shape[:2]
    HxW = x.numel() // (N * C)
    _, m_t, r_t = torch.native_group_norm(xf, None, None, N, C, HxW, G, gn._eps_for_kernel(x.dtype, EPS))
    m_k, r_k = gn.group_stats(xf, G, EPS, eps_override=gn._eps_for_kernel(x.dtype, EPS))
    dm = int((m_k.view(torch.int32) != m_t.view(torch.int32)).sum())
    dr = int((r_k.view(torch.int32) != r_t.view(torch.int32)).sum())
    notes.append(f"stats: mean differs in {dm}/{m_t.numel()} groups, rstd in {dr}/{r_t.numel()}")
    mm = compare_outputs(gn._launch(x, G, w, b, EPS, False), ref.group_norm(x, G, w, b, EPS), "GN only")
    notes.append("GN output equal" if mm is None else str(mm))
    return f"{label}: " + "; ".join(notes)


def _case(x, G, w, b, silu, label, failures):
    assert gn.can_use_group_norm_silu(x, G, w, b, EPS, silu), label
    got = gn.group_norm_silu(x, G, w, b, EPS, silu)
    exp = ref.group_norm_silu(x, G, w, b, EPS, silu)
    mm = compare_outputs(got, exp, label)
    if mm is not None:
        failures.append(str(mm) + "\n    " + _diagnose(x, G, w, b, label))
    del got, exp


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_decoder_shapes(dtype):
    """The 1024x1024 decoder's shapes, batch 1 and 2, GroupNorm+SiLU (and GroupNorm alone at
    the mid-block shape, the attention's group_norm)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    failures: list[str] = []
    for C, H, W in DECODER:
        for B in (1, 2):
            if dtype == torch.float32 and B == 2 and H >= 1024:
                continue  # 2 GiB per tensor; batch 1 covers the arithmetic
            x = _rand((B, C, H, W), dtype, gen, 2.0, 0.3)
            w, b = _params(C, dtype, gen)
            _case(x, 32, w, b, True, f"[{B},{C},{H},{W}] {dtype} silu", failures)
            if (C, H) == (512, 128):
                _case(x, 32, w, b, False, f"[{B},{C},{H},{W}] {dtype} GN", failures)
            del x
        torch.cuda.empty_cache()
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_channels_last_output(dtype):
    """norm.group_norm_silu_cl: the exact kernels with the epilogue written channels-last (the
    lossless AutoencoderKL decode's ResnetBlock2D norms): eager's values at the decoder shapes,
    batch 1 and 2, odd sizes, a channels-last input (made contiguous first, as eager does), no
    affine; NaN/Inf placement as eager's."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    failures: list[str] = []
    shapes = [(1, C, H, W) for C, H, W in DECODER] + [(2, 512, 128, 128), (1, 96, 33, 17), (2, 64, 7, 9),
                                                       (1, 128, 1, 1)]
    for B, C, H, W in shapes:
        if dtype == torch.float32 and H >= 1024:
            continue
        x = _rand((B, C, H, W), dtype, gen, 2.0, 0.3)
        if (C, H) == (96, 33):
            x.view(-1)[:2] = torch.tensor([float("nan"), float("inf")], device="cuda").to(dtype)
        w, b = _params(C, dtype, gen)
        for xin, aff, silu in ((x, True, True), (x.contiguous(memory_format=torch.channels_last), True, True),
                               (x, False, False)):
            ww, bb = (w, b) if aff else (None, None)
            got = gn.group_norm_silu_cl(xin, 32, ww, bb, EPS, silu)
            assert got.is_contiguous(memory_format=torch.channels_last)
            mm = compare_outputs(got, ref.group_norm_silu(xin, 32, ww, bb, EPS, silu),
                                 f"cl-out [{B},{C},{H},{W}] {dtype} in={'cl' if xin is not x else 'nchw'} "
                                 f"affine={aff} silu={silu}")
            if mm is not None:
                failures.append(str(mm))
        del x
    torch.cuda.empty_cache()
    assert not failures, "\n".join(failures)


AWKWARD = [
    ((1, 96, 33, 17), 32), ((2, 96, 7, 9), 32), ((1, 128, 1, 1), 32), ((2, 96, 1, 1), 32),
    ((2, 64), 32), ((2, 512, 4096), 32), ((1, 512, 4, 4), 32), ((1, 512, 5, 5), 32),
    ((1, 32, 3, 5), 32), ((2, 256, 16, 16), 8), ((1, 16, 100, 101), 1), ((2, 320, 2, 24, 24), 32),
    ((3, 1536, 13, 11), 32),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_awkward_shapes(dtype):
    """Odd spatial sizes, HxW == 1 (GroupNorm1dForward), 2-D/3-D/5-D inputs, L around 32 and 512
    (the one-warp / 512-thread switch), 1 and 8 groups, batch 1-3; with and without SiLU."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    failures: list[str] = []
    for shape, G in AWKWARD:
        x = _rand(shape, dtype, gen, 3.0, 1.0)
        w, b = _params(shape[1], dtype, gen)
        for silu in (True, False):
            _case(x, G, w, b, silu, f"{list(shape)} G={G} {dtype} silu={silu}", failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_affine_variants(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    failures: list[str] = []
    for shape in ((2, 64, 9, 7), (2, 64, 1, 1), (1, 64, 64, 64)):
        x = _rand(shape, dtype, gen, 2.0, 0.5)
        w, b = _params(64, dtype, gen)
        for ww, bb, name in ((w, None, "w"), (None, b, "b"), (None, None, "none")):
            _case(x, 32, ww, bb, True, f"{list(shape)} {dtype} affine={name}", failures)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_statistics_bits(dtype):
    """mean/rstd of the exact kernels == native_group_norm's (fp32 values of the dtype, so every
    bit of the statistics is visible), many groups and scales, both thread counts."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    failures: list[str] = []
    for shape in ((4, 512, 128, 128), (8, 64, 7, 9), (16, 32, 4, 4), (2, 128, 64, 64), (1, 512, 32, 33)):
        N, C = shape[:2]
        scale = torch.exp(torch.randn(N, C, 1, 1, generator=gen, device="cuda") * 3)
        x = (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype).float()
        x[:, C // 2:] += 4.0
        eps_k = gn._eps_for_kernel(dtype, EPS)
        _, m_t, r_t = torch.native_group_norm(x, None, None, N, C, x[0, 0].numel(), 32, eps_k)
        for fast in (False, True):
            m_k, r_k = gn.group_stats(x, 32, EPS, eps_override=eps_k, variant=dict(FAST_DIV=fast))
            dm = int((m_k.view(torch.int32) != m_t.view(torch.int32)).sum())
            dr = int((r_k.view(torch.int32) != r_t.view(torch.int32)).sum())
            if dm or dr:
                failures.append(f"{list(shape)} {dtype} FAST_DIV={fast}: mean differs in {dm}, rstd in {dr} "
                                f"of {m_t.numel()} groups")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_fast_division_variant(dtype):
    """FAST_DIV (the default since 2026-12-04, asked for explicitly here): the decoder shapes and
    tiny / special inputs, bitwise."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    failures: list[str] = []
    for C, H, W in DECODER[:2] + DECODER[-1:]:
        x = _rand((1, C, H, W), dtype, gen, 2.0, 0.3)
        w, b = _params(C, dtype, gen)
        got = gn._launch(x, 32, w, b, EPS, True, variant=dict(FAST_DIV=True))
        mm = compare_outputs(got, ref.group_norm_silu(x, 32, w, b, EPS), f"FAST_DIV [1,{C},{H},{W}] {dtype}")
        if mm:
            failures.append(str(mm))
    x = _rand((2, 64, 40, 40), dtype, gen, 3.0)
    x[0, 2:4] *= 1e-20  # tiny deltas: blocks redone with div.rn
    x[0, 6, 0, 0] = float("inf")
    x[1, 8:10] = 0.0
    got = gn._launch(x, 32, None, None, EPS, True, variant=dict(FAST_DIV=True))
    mm = compare_outputs(got, ref.group_norm_silu(x, 32, None, None, EPS), f"FAST_DIV special {dtype}")
    if mm:
        failures.append(str(mm))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_special_values(dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _rand((2, 64, 24, 24), dtype, gen, 3.0)
    x[0, 0, 1, 2] = float("nan")
    x[0, 2, 3, 4] = float("inf")
    x[0, 4, 0, 0] = float("inf")
    x[0, 6, 0, 0] = float("-inf")
    x[1, 8:10] = 0.0  # zero-variance group: rstd = rsqrt(T(eps))
    x[1, 10:12] = 5.0
    x[1, 12, :3] = -0.0
    x[1, 14:16] = 1e-3 * x[1, 14:16]  # variance far below eps
    w, b = _params(64, dtype, gen)
    w[20] = 0.0
    w[21] = -0.0
    b[21] = -0.0
    b[22] = float("inf")
    failures: list[str] = []
    for silu in (True, False):
        _case(x, 32, w, b, silu, f"special {dtype} silu={silu}", failures)
    assert not failures, "\n".join(failures)


def test_strided_and_channels_last_inputs():
    """native_group_norm copies non-contiguous input to NCHW first: same statistics, NCHW output."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    failures: list[str] = []
    for dtype in DTYPES:
        base = _rand((2, 128, 64, 48), dtype, gen, 2.0)
        w, b = _params(128, dtype, gen)
        wide = _rand((2, 128, 64, 64), dtype, gen)
        wide[..., 8:56] = base
        for name, x in (("channels_last", base.to(memory_format=torch.channels_last)),
                        ("sliced", wide[..., 8:56]), ("transposed", base.transpose(2, 3).contiguous().transpose(2, 3))):
            assert not x.is_contiguous()
            got = gn.group_norm_silu(x, 32, w, b, EPS, True)
            exp = ref.group_norm_silu(x, 32, w, b, EPS, True)
            mm = compare_outputs(got, exp, f"{name} {dtype}")
            if mm:
                failures.append(str(mm))
            if got.stride() != exp.stride():
                failures.append(f"{name} {dtype}: strides {got.stride()} vs eager {exp.stride()}")
    assert not failures, "\n".join(failures)


def test_mixed_dtype_rejected():
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = _rand((1, 64, 8, 8), torch.bfloat16, gen)
    w, b = _params(64, torch.float32, gen)
    assert not gn.can_use_group_norm_silu(x, 32, w, b, EPS, True)
    with pytest.raises(UnsupportedInput):
        gn.group_norm_silu(x, 32, w, b, EPS, True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert not gn.can_use_group_norm_silu(x, 32, w.bfloat16(), b.bfloat16(), EPS, True)


_silu = gn._silu


@triton.jit
def _silu_only_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    tl.store(o_ptr + offs, round_to(_silu(x, 0, 0), DTYPE), mask=m)


def test_silu_epilogue_exhaustive():
    """The SiLU part on every bf16 and fp16 bit pattern and on random fp32: == F.silu."""
    k = _silu_only_kernel
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).cuda()
    gen = torch.Generator(device="cuda").manual_seed(8)
    inputs = [bits.view(torch.bfloat16), bits.view(torch.float16),
              torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=gen, device="cuda", dtype=torch.int32).view(torch.float32),
              torch.linspace(-100, 100, 1 << 22, device="cuda")]
    failures = []
    for x in inputs:
        out = torch.empty_like(x)
        k[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, DTYPE=gn._DTYPES[x.dtype],
                                             enable_fp_fusion=False, enable_reflect_ftz=False)
        mm = compare_outputs(out, F.silu(x), f"silu {x.dtype}")
        if mm:
            failures.append(str(mm))
    assert not failures, "\n".join(failures)


def test_close_variant_accuracy():
    """quality="high" (EXACT=False): at least as accurate as eager against fp64 at decoder shapes."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    for C, H in ((512, 128), (128, 256)):
        x = _rand((1, C, H, H), torch.bfloat16, gen, 2.0, 0.3)
        w, b = _params(C, torch.bfloat16, gen)
        f64 = exact.group_norm_silu_fp64(x, 32, w, b, EPS)
        err_e = (ref.group_norm_silu(x, 32, w, b, EPS).double() - f64)
        err_c = (gn.group_norm_silu_fp32(x, 32, w, b, EPS, True).double() - f64)
        rms_e, rms_c = float(err_e.pow(2).mean().sqrt()), float(err_c.pow(2).mean().sqrt())
        assert rms_c <= 1.5 * rms_e, (C, H, rms_c, rms_e)
        assert float(err_c.abs().max()) <= 1.5 * float(err_e.abs().max())
        assert abs(float(err_c.mean())) <= 0.25 * rms_e


@pytest.mark.parametrize("C,H", [(512, 128), (512, 256), (256, 512), (128, 1024), (512, 37)],
                         ids=["512x128", "512x256", "256x512", "128x1024", "512x37"])
def test_close_variant_channels_last(C, H):
    """quality="high"'s channels-last decode: the close op reads [N, S, C] rows in place, keeps the
    layout, and is at least as accurate as eager (on the same values, NCHW) against fp64; a NaN
    poisons its own group only; the mid-block attention's [N, C, L] view (channels innermost)."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = _rand((1, C, H, H), torch.bfloat16, gen, 2.0, 0.3).contiguous(memory_format=torch.channels_last)
    w, b = _params(C, torch.bfloat16, gen)
    assert gn._cl_path(x, 32)
    f64 = exact.group_norm_silu_fp64(x, 32, w, b, EPS)
    got = gn.group_norm_silu_fp32(x, 32, w, b, EPS, True)
    assert got.stride() == x.stride(), (got.stride(), x.stride())
    err_e = ref.group_norm_silu(x, 32, w, b, EPS).double() - f64
    err_c = got.double() - f64
    rms_e, rms_c = float(err_e.pow(2).mean().sqrt()), float(err_c.pow(2).mean().sqrt())
    assert rms_c <= 1.5 * rms_e, (rms_c, rms_e)
    assert float(err_c.abs().max()) <= 1.5 * float(err_e.abs().max())
    assert abs(float(err_c.mean())) <= 0.25 * rms_e
    x[0, 3, 1, 2] = float("nan")  # channel 3: group 0 (D = C / 32 >= 4)
    got = gn.group_norm_silu_fp32(x, 32, w, b, EPS, True)
    D = C // 32
    assert torch.isnan(got[0, :D]).all() and torch.isfinite(got[0, D:]).all()
    rows = _rand((1, H * H, C), torch.bfloat16, gen)
    v = rows.transpose(1, 2)
    got = gn.group_norm_silu_fp32(v, 32, w, b, EPS, False)
    assert got.stride() == v.stride()
    err = (got.double() - torch.nn.functional.group_norm(v.double(), 32, w.double(), b.double(), EPS)).abs()
    assert float(err.max()) <= 2.0**-7 * float(got.double().abs().max())


def test_compile_and_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(10)
    x = _rand((1, 256, 64, 64), torch.bfloat16, gen, 2.0)
    w, b = _params(256, torch.bfloat16, gen)
    exp = ref.group_norm_silu(x, 32, w, b, EPS)
    fn = torch.compile(lambda a, c, d: torch.ops.ditfuse.group_norm_silu(a, 32, c, d, EPS, True),
                       fullgraph=True, backend="aot_eager")
    assert compare_outputs(fn(x, w, b), exp) is None
    static_out = gn.group_norm_silu(x, 32, w, b, EPS)  # warm up (compiles)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = gn.group_norm_silu(x, 32, w, b, EPS)
    x.copy_(_rand(x.shape, torch.bfloat16, gen, 3.0, 1.0))
    g.replay()
    torch.cuda.synchronize()
    mm = compare_outputs(static_out, ref.group_norm_silu(x, 32, w, b, EPS), "graph replay")
    assert mm is None, str(mm)
