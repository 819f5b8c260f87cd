"""norm.group_norm_silu under TRITON_INTERPRET=1, bitwise against tests/support/groupnorm_sim.py.

The interpreter computes ``rsqrt`` as ``1 / sqrt`` and ``exp`` with numpy (the GPU uses
``rsqrt.approx.f32`` and libdevice ``expf``); the simulation's defaults do the same, so kernel
and simulation are compared bit for bit. Everything else — the Welford chains, both folds, the
fused-params epilogue, the roundings — is the same arithmetic on the GPU (the GPU tests compare
against eager itself).

Shapes are small (the interpreter runs ~1 ms per Triton call per program): the 512-thread
statistics path (L >= 512) uses 1 or 2 groups, 32 groups appear with small L.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditfuse.kernels import exact
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm import group_norm_silu_triton as gn
from tests.support import groupnorm_sim as sim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

EPS = 1e-6


def _rand(shape, dtype, seed, scale=3.0, offset=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _params(C, dtype, seed):
    return _rand((C,), dtype, seed, 0.5, 1.0), _rand((C,), dtype, seed + 1, 0.3, 0.0)


def _check(x, G, w, b, silu, **launch):
    got = gn._launch(x, G, w, b, EPS, silu, **launch)
    exp = sim.group_norm_silu(x, G, w, b, EPS, silu_after=silu)
    mm = compare_outputs(got, exp, f"{tuple(x.shape)} G={G} {x.dtype} silu={silu}")
    assert mm is None, str(mm)
    assert got.is_contiguous()
    return got


# ----------------------------------------------------------------------------- kernel == sim


@pytest.mark.parametrize(
    "shape,G,dtype,silu",
    [
        ((2, 96, 1, 1), 32, torch.bfloat16, True),  # HxW == 1 (GroupNorm1dForward), D = 3, batch 2
        ((1, 128, 7, 9), 32, torch.float32, False),  # L = 252 < 512: one warp per group
        ((1, 4, 33, 17), 2, torch.bfloat16, True),  # L = 1122: 512 threads, ragged last step
        ((2, 6, 5, 3), 3, torch.float16, True),  # L = 30 < 32: lanes without data
        ((1, 64, 9), 32, torch.bfloat16, False),  # 3-D input [N, C, L]
    ],
    ids=["1x1-C96-B2", "7x9-C128-fp32", "33x17-T512", "L30-fp16", "3d"],
)
def test_kernel_matches_sim(shape, G, dtype, silu):
    w, b = _params(shape[1], dtype, 11)
    _check(_rand(shape, dtype, 7), G, w, b, silu)


def test_group_stats_match_sim():
    """mean / rstd bits (fp32) of the exact kernels, before any epilogue: groups of very different
    scales around mean 0 and 5, where the combine's and the update's roundings show."""
    g = torch.Generator().manual_seed(83)
    x = torch.randn(1, 32, 16, 16, generator=g) * torch.exp(torch.randn(1, 32, 1, 1, generator=g) * 3)
    x[:, 16:] += 5.0
    mean, rstd = gn.group_stats(x, 32, EPS)
    m_sim, r_sim = sim.group_stats(x, 32, EPS)
    assert torch.equal(mean.view(torch.int32), m_sim.view(torch.int32))
    assert torch.equal(rstd.view(torch.int32), r_sim.view(torch.int32))
    # the switches the GPU probe tries are live: the reciprocal-multiply update differs here
    m1, _ = gn.group_stats(x, 32, EPS, variant=dict(MEAN_MODE=1, FAST_DIV=False))  # FAST_DIV has one update
    assert not torch.equal(m1.view(torch.int32), m_sim.view(torch.int32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fast_division_chain_matches_sim():
    """FAST_DIV (div.rn's fast path, block redone with div.rn on unsafe dividends): same stats
    and outputs, through unmasked blocks, the masked last block and the redo path (1e-30, inf,
    NaN force it)."""
    g = torch.Generator().manual_seed(89)
    x = torch.randn(1, 16, 12, 12, generator=g) * torch.exp(torch.randn(1, 16, 1, 1, generator=g) * 3)
    x[0, 3, 0, 0] = 1e-30
    x[0, 5, 2, 2] = float("inf")
    x[0, 7, 1, 1] = float("nan")
    x[0, 9] = 0.0
    x[0, 11] *= 1e-25  # every delta below 2^-60: each block of this group is redone with div.rn
    fast = dict(FAST_DIV=True)
    for K in (2, 32):  # L = 144 (32 threads, 5 steps): K = 2 -> unmasked + masked blocks
        mean, rstd = gn.group_stats(x, 16, EPS, variant=fast, chain_steps=K)
        m_sim, r_sim = sim.group_stats(x, 16, EPS)
        assert compare_outputs(mean, m_sim, "mean") is None and compare_outputs(rstd, r_sim, "rstd") is None
    y = gn._launch(x.bfloat16(), 8, None, None, EPS, True, variant=fast, chain_steps=2)
    assert compare_outputs(y, sim.group_norm_silu(x.bfloat16(), 8, None, None, EPS)) is None


def test_chain_tiling_does_not_change_bits():
    """K (steps prefetched per thread) 1, 2 and the default; the apply kernel with one channel
    per block (CH_UNIFORM), several blocks per program (ITERS > 1) and per-element channels."""
    x = _rand((1, 2, 16, 32), torch.bfloat16, 3)  # G = 1: L = 1024, HxW = 512
    w, b = _params(2, torch.bfloat16, 5)
    base = _check(x, 1, w, b, True)
    for kw in (dict(chain_steps=1, apply_block=1024), dict(chain_steps=2, apply_block=128, apply_iters=3)):
        mm = compare_outputs(gn._launch(x, 1, w, b, EPS, True, **kw), base, str(kw))
        assert mm is None, str(mm)
    assert gn._apply_tiling(1, 1024, 512, 128, 3)[3] is True  # CH_UNIFORM taken above
    assert gn._apply_tiling(1, 1024, 512, 1024, None)[3] is False


@pytest.mark.parametrize("hw", [True, False], ids=["w", "no-w"])
@pytest.mark.parametrize("hb", [True, False], ids=["b", "no-b"])
def test_affine_variants(hw, hb):
    """weight / bias None, for HxW > 1 (fused params) and HxW == 1 (GroupNorm1dForward)."""
    for shape, G, dtype in (((1, 4, 5, 3), 2, torch.bfloat16), ((2, 6), 3, torch.float32)):
        w, b = _params(shape[1], dtype, 13)
        _check(_rand(shape, dtype, 17), G, w if hw else None, b if hb else None, True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf under the interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_special_values(dtype):
    x = _rand((1, 10, 5, 7), dtype, 19)  # G = 5: L = 70
    x[0, 0, 1, 2] = float("nan")  # group 0: NaN
    x[0, 2, 0, 0] = float("inf")  # group 1: +inf -> mean inf, var nan
    x[0, 4, 0, 0] = float("inf")
    x[0, 5, 3, 3] = float("-inf")  # group 2: +inf and -inf
    x[0, 6:8] = 0.0  # group 3: all zero: var 0, rstd = rsqrt(T(eps))
    x[0, 8, :2] = -0.0  # group 4: some -0.0
    w, b = _params(10, dtype, 23)
    w[9] = -0.0
    b[9] = -0.0
    b[6] = -0.0
    got = _check(x, 5, w, b, True)
    assert torch.isnan(got[0, :2]).all() and torch.isnan(got[0, 2:6]).all()
    assert torch.isfinite(got[0, 6:]).all()


def test_strided_and_channels_last_inputs():
    """native_group_norm makes x contiguous first; the kernel does the same (any strides)."""
    base = _rand((1, 8, 5, 7), torch.bfloat16, 29)
    w, b = _params(8, torch.bfloat16, 31)
    exp = sim.group_norm_silu(base, 4, w, b, EPS)
    cl = base.to(memory_format=torch.channels_last)
    wide = _rand((1, 8, 5, 9), torch.bfloat16, 37)
    wide[..., 1:8] = base
    for name, x in (("channels_last", cl), ("sliced", wide[..., 1:8])):
        assert not x.is_contiguous()
        assert gn.can_use_group_norm_silu(x, 4, w, b, EPS, True)
        got = gn.group_norm_silu(x, 4, w, b, EPS, True)
        assert got.is_contiguous()
        mm = compare_outputs(got, exp, name)
        assert mm is None, str(mm)


def test_empty_input():
    x = torch.empty(0, 8, 5, 5, dtype=torch.bfloat16)
    w, b = _params(8, torch.bfloat16, 41)
    out = gn.group_norm_silu(x, 4, w, b, EPS, True)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_eps_is_rounded_to_the_input_dtype():
    """GroupNormKernelImpl passes ``static_cast<scalar_t>(eps)`` to the statistics kernel."""
    assert gn._eps_for_kernel(torch.bfloat16, 1e-6) == 9.98377799987793e-07  # 0x3586
    assert gn._eps_for_kernel(torch.float16, 1e-6) == 17 * 2.0**-24  # subnormal
    assert gn._eps_for_kernel(torch.float32, 1e-6) == float(torch.tensor(1e-6).item())
    assert sim.eps_as(torch.bfloat16, 1e-6) == gn._eps_for_kernel(torch.bfloat16, 1e-6)
    # and it matters: an all-equal group's rstd is rsqrt(eps) exactly
    x = torch.full((1, 2, 4, 4), 3.0, dtype=torch.float32)
    _, rstd = sim.group_stats(x, 1, 1e-6)
    assert float(rstd) == pytest.approx(1e-6 ** -0.5, rel=1e-6)


# ----------------------------------------------------------------------------- close variant


@pytest.mark.parametrize(
    "shape,G,dtype,silu,affine",
    [
        ((1, 64, 7, 5), 32, torch.bfloat16, True, True),
        ((2, 8, 33, 17), 2, torch.bfloat16, True, True),  # 512-thread chains, batch 2
        ((1, 6, 5, 3), 3, torch.float16, False, False),  # no affine, C not a power of two
        ((1, 70, 3, 67), 10, torch.float32, True, True),  # several channel and position tiles
        ((1, 8, 1, 1), 4, torch.bfloat16, True, True),  # 1x1: GroupNorm1dForward, NCHW is channels-last
    ],
    ids=["C64", "T512-B2", "fp16-noaffine", "fp32-tiles", "1x1"],
)
def test_channels_last_output_is_the_exact_kernel(shape, G, dtype, silu, affine):
    """norm.group_norm_silu_cl: the exact statistics, the epilogue from NCHW tiles into
    channels-last rows: bitwise the simulation's values (and the NCHW op's), channels-last."""
    x = _rand(shape, dtype, 79)
    x.view(-1)[5] = float("inf")
    w, b = _params(shape[1], dtype, 83) if affine else (None, None)
    assert gn.can_use_group_norm_silu_cl(x, G, w, b, EPS, silu)
    got = gn.group_norm_silu_cl(x, G, w, b, EPS, silu)
    assert got.is_contiguous(memory_format=torch.channels_last)
    exp = sim.group_norm_silu(x, G, w, b, EPS, silu_after=silu)
    mm = compare_outputs(got, exp, f"cl-out {shape} G={G} {dtype}")
    assert mm is None, str(mm)
    again = gn.group_norm_silu_cl(x.contiguous(memory_format=torch.channels_last), G, w, b, EPS, silu)
    assert compare_outputs(again, exp, "channels-last input") is None
    assert not gn.can_use_group_norm_silu_cl(x.flatten(2), G, w, b, EPS, silu)  # 3-D: not a conv input


@pytest.mark.parametrize("tile", [(64, 64, 4), (32, 16, 4), (128, 32, 8), (16, 128, 4), (16, 256, 4)], ids=str)
@pytest.mark.parametrize(
    "shape,G,dtype",
    [((1, 64, 8, 8), 32, torch.bfloat16),  # EVEN for every tile but (128, 32): HxW 64
     ((2, 32, 16, 8), 4, torch.float16),  # EVEN for (64, 64), (32, 16), (128, 32)
     ((1, 24, 5, 7), 3, torch.bfloat16)],  # never EVEN
    ids=["C64-8x8", "B2-C32", "odd"],
)
def test_channels_last_epilogue_tiles(tile, shape, G, dtype):
    """The channels-last epilogue's tile (and with it the unmasked EVEN path) never changes bits:
    every tile the probe sweeps equals the simulation, NaN/Inf included."""
    x = _rand(shape, dtype, 97)
    x.view(-1)[3] = float("nan")
    x.view(-1)[-2] = float("-inf")
    w, b = _params(shape[1], dtype, 101)
    stat = gn._exact_stats(x, G, EPS)
    got = gn._apply_cl_out(x, G, stat, w, b, True, tile=tile)
    assert got.is_contiguous(memory_format=torch.channels_last)
    exp = sim.group_norm_silu(x, G, w, b, EPS, silu_after=True)
    mm = compare_outputs(got, exp, f"cl-out tile {tile} {shape} G={G} {dtype}")
    assert mm is None, str(mm)


def test_close_variant_tracks_fp64():
    x = _rand((1, 8, 33, 17), torch.bfloat16, 43, 2.0, 0.5)
    w, b = _params(8, torch.bfloat16, 47)
    got = gn._launch(x, 4, w, b, EPS, True, exact=False).double()
    f64 = exact.group_norm_silu_fp64(x, 4, w, b, EPS)
    eager_like = sim.group_norm_silu(x, 4, w, b, EPS).double()
    err_close = (got - f64).abs()
    err_eager = (eager_like - f64).abs()
    # one rounding at the end: within half a bf16 ulp (plus fp32 noise) of the fp64 value
    assert float((err_close / f64.abs().clamp(min=2.0**-10)).max()) < 2.0**-8 * 1.01
    assert float(err_close.pow(2).mean().sqrt()) <= float(err_eager.pow(2).mean().sqrt())
    # same bits whatever the statistics tiling
    again = gn._launch(x, 4, w, b, EPS, True, exact=False, apply_block=64, apply_iters=4).double()
    assert torch.equal(again, got)


def _close_vs_fp64(got, x, G, w, b, silu, what):
    f64 = exact.group_norm_silu_fp64(x, G, w, b, EPS) if silu else F.group_norm(
        x.double(), G, None if w is None else w.double(), None if b is None else b.double(), EPS)
    err = (got.double() - f64).abs()
    # one rounding at the end: within half an ulp of the dtype (plus fp32 noise) of the fp64 value
    # (fp32: the fp32 arithmetic itself dominates; measured against the output's scale instead)
    ulp, floor = {torch.bfloat16: (2.0**-8, 2.0**-10), torch.float16: (2.0**-11, 2.0**-10),
                  torch.float32: (2.0**-20, 1.0)}[x.dtype]
    rel = err / f64.abs().clamp(min=floor)
    worst = int(rel.argmax())
    assert float(rel.max()) < ulp * 1.01, (
        f"{what}: worst relative error {float(rel.max()):.3e} at flat index {worst}: "
        f"got {float(got.flatten()[worst])}, fp64 {float(f64.flatten()[worst])}")


@pytest.mark.parametrize(
    "shape,G,dtype,silu,affine",
    [
        ((1, 64, 7, 5), 32, torch.bfloat16, True, True),  # D = 2, S = 35 (one ragged tile)
        ((2, 128, 9, 13), 32, torch.bfloat16, True, True),  # batch 2 (CFG), prime-ish spatial
        ((1, 512, 3, 67), 32, torch.bfloat16, False, True),  # decoder width, S = 201: several programs
        ((3, 16, 11, 1), 4, torch.float16, True, False),  # W = 1, no affine
        ((1, 32, 2, 3), 8, torch.float32, False, True),
    ],
    ids=["C64", "C128-B2", "C512", "fp16-noaffine", "fp32"],
)
def test_close_channels_last_path(shape, G, dtype, silu, affine):
    """quality="high"'s channels-last decode: the close op reads [N, S, C] rows in place and
    writes its output channels-last (no transposes), within half an ulp of fp64."""
    x = _rand(shape, dtype, 53, 3.0, 1.0).contiguous(memory_format=torch.channels_last)
    w, b = _params(shape[1], dtype, 59) if affine else (None, None)
    assert gn._cl_path(x, G)
    got = gn.group_norm_silu_fp32(x, G, w, b, EPS, silu)
    assert got.stride() == x.stride(), f"layout not kept: {got.stride()} vs {x.stride()}"
    _close_vs_fp64(got, x, G, w, b, silu, f"{shape} G={G}")
    # the NCHW close path computes the same function (another tiling): equal within rounding
    nchw = gn.group_norm_silu_fp32(x.contiguous(), G, w, b, EPS, silu)
    assert float((nchw.double() - got.double()).abs().max()) <= float(nchw.double().abs().max()) * 2.0**-7


def test_close_channels_last_attention_view_and_nonfinite():
    """The mid-block attention's GroupNorm gets [N, C, L], a transposed view of [N, L, C] rows
    (channels innermost in 3-D); a NaN / Inf poisons exactly its own group, as in eager."""
    rows = _rand((2, 37, 64), torch.bfloat16, 61)
    rows[1, 5, 3] = float("nan")
    rows[0, 36, 40] = float("inf")
    x = rows.transpose(1, 2)
    assert gn._cl_path(x, 32)
    got = gn.group_norm_silu_fp32(x, 32, None, None, EPS, False)
    assert got.stride() == x.stride()
    eager = F.group_norm(x.float(), 32, None, None, EPS)
    assert torch.equal(torch.isfinite(got), torch.isfinite(eager)), "non-finite placement differs from eager"
    assert torch.isnan(got[1, 2:4]).all() and torch.isfinite(got[1, 4:]).all()  # channel 3: group 1
    assert torch.isnan(got[0, 40:42]).all() and torch.isfinite(got[0, :40]).all()
    clean = rows.clone()
    clean[1, 5, 3] = 0.0
    clean[0, 36, 40] = 0.0
    xc = clean.transpose(1, 2)
    _close_vs_fp64(gn.group_norm_silu_fp32(xc, 32, None, None, EPS, False), xc, 32, None, None, False, "attention view")


def test_close_channels_last_falls_back_to_nchw_where_it_must():
    """Widths the row tile does not take (C or C/G not a power of two) go the NCHW way (a copy)."""
    x = _rand((1, 48, 5, 5), torch.bfloat16, 67).contiguous(memory_format=torch.channels_last)
    assert not gn._cl_path(x, 16)  # C = 48
    got = gn.group_norm_silu_fp32(x, 16, None, None, EPS, True)
    assert got.is_contiguous()
    _close_vs_fp64(got, x, 16, None, None, True, "C48")
    y = _rand((1, 96, 4, 4), torch.bfloat16, 71).contiguous(memory_format=torch.channels_last)
    assert not gn._cl_path(y, 32)  # C = 96 (D = 3)


# ----------------------------------------------------------------------------- simulation


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("shape,G", [((1, 64, 3, 5), 32), ((1, 4, 33, 17), 2), ((2, 6, 1, 1), 3)])
def test_sim_matches_scalar_loop(shape, G):
    """The vectorised simulation against an independent scalar loop of the same order."""
    x = _rand(shape, torch.bfloat16, 53)
    x.view(-1)[5] = float("inf") if shape[0] == 2 else x.view(-1)[5]
    mean, rstd = sim.group_stats(x, G, EPS, rsqrt=lambda z: z)  # keep var + eps
    xs = x.float().reshape(shape[0] * G, -1)
    eps32 = sim.eps_as(x.dtype, EPS)
    for i in range(xs.shape[0]):
        m, v = sim.scalar_group_stats(xs[i].tolist(), eps32)
        assert torch.equal(torch.tensor(m), mean.flatten()[i]) or (m != m and mean.flatten()[i] != mean.flatten()[i])
        assert torch.equal(torch.tensor(v), rstd.flatten()[i]) or (v != v and rstd.flatten()[i] != rstd.flatten()[i])


def test_sim_fma_is_correctly_rounded():
    """The fp64 sum rounded to odd, then to fp32: correct where plain fp64 double-rounds."""
    a = torch.tensor([1 + 2.0**-23])
    b = torch.tensor([1 - 2.0**-24])
    c = torch.tensor([2.0**-47 + 2.0**-70])  # a*b + c = 1 + 2^-24 + 2^-70: just above the midpoint
    assert float(sim.fma(a, b, c)) == 1 + 2.0**-23
    assert float((a.double() * b.double() + c.double()).float()) == 1.0  # double rounding


@pytest.mark.parametrize("shape,G,affine", [((2, 64, 5, 7), 32, True), ((1, 4, 33, 17), 2, False), ((3, 6), 3, True)])
def test_sim_close_to_torch_cpu(shape, G, affine):
    """torch's CPU GroupNorm is another algorithm (cascade sums), so only closeness is asserted."""
    x = _rand(shape, torch.float32, 59)
    w, b = _params(shape[1], torch.float32, 61) if affine else (None, None)
    got = sim.group_norm(x, G, w, b, EPS)
    torch.testing.assert_close(got, F.group_norm(x, G, w, b, EPS), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- contract


def _rejects(x, G, w, b, eps=EPS, silu=True):
    assert not gn.can_use_group_norm_silu(x, G, w, b, eps, silu)
    with pytest.raises(UnsupportedInput):
        gn.group_norm_silu(x, G, w, b, eps, silu)
    assert not gn.can_use_group_norm_silu_fp32(x, G, w, b, eps, silu)
    with pytest.raises(UnsupportedInput):
        gn.group_norm_silu_fp32(x, G, w, b, eps, silu)


def test_rejections():
    x = _rand((1, 8, 3, 3), torch.bfloat16, 67)
    w, b = _params(8, torch.bfloat16, 71)
    assert gn.can_use_group_norm_silu(x, 4, w, b, EPS, True)
    _rejects(x.double(), 4, w.double(), b.double())  # fp64
    _rejects(x, 4, w.float(), b.float())  # mixed dtype (CUDA reads gamma/beta as T)
    _rejects(x, 3, w, b)  # C % G
    _rejects(x, 0, w, b)
    _rejects(x, True, w, b)
    _rejects(x, 4, w[:4], b)  # weight shape
    _rejects(x, 4, w, b.reshape(2, 4))
    _rejects(x[0, 0, 0], 4, None, None)  # 1-D
    _rejects(x, 4, w, b, eps=float("nan"))
    _rejects(x, 4, w, b, silu=1)
    _rejects("x", 4, None, None)
    xg = x.clone().requires_grad_(True)
    _rejects(xg, 4, w, b)
    with torch.no_grad():
        assert gn.can_use_group_norm_silu(xg, 4, w, b, EPS, True)


def test_cpu_rejected_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = _rand((1, 8, 3, 3), torch.bfloat16, 73)
    assert not gn.can_use_group_norm_silu(x, 4, None, None, EPS, True)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        w = torch.empty(8, dtype=torch.bfloat16)
        out = torch.ops.ditfuse.group_norm_silu(x, 4, w, w, EPS, True)
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
        # the close op keeps a channels-last input's layout (its in-place channels-last path)
        out = torch.ops.ditfuse.group_norm_silu_fp32(x, 4, w, w, EPS, True)
        assert out.shape == x.shape and out.stride() == x.stride()
        out = torch.ops.ditfuse.group_norm_silu_fp32(x.contiguous(), 4, w, w, EPS, True)
        assert out.is_contiguous()
        out = torch.ops.ditfuse.group_norm_silu_cl(x.contiguous(), 4, w, w, EPS, True)
        assert out.shape == x.shape and out.is_contiguous(memory_format=torch.channels_last)


# ----------------------------------------------------------------------------- references


def test_reference_equals_diffusers_modules():
    """ref.group_norm_silu == ResnetBlock2D's norm1 -> nonlinearity and the decoder's
    conv_norm_out -> conv_act; ref.group_norm == the mid-block Attention's group_norm call."""
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    blk = ResnetBlock2D(in_channels=64, out_channels=64, temb_channels=None, groups=32, eps=1e-6).eval()
    with torch.no_grad():
        blk.norm1.weight.normal_(1.0, 0.3)
        blk.norm1.bias.normal_(0.0, 0.3)
    for dtype in (torch.float32, torch.bfloat16):
        b = blk.to(dtype)
        x = _rand((2, 64, 6, 5), dtype, 79)
        with torch.no_grad():
            got = ref.group_norm_silu(x, 32, b.norm1.weight, b.norm1.bias, b.norm1.eps)
            exp = b.nonlinearity(b.norm1(x))
            assert compare_outputs(got, exp) is None
            assert b.norm1.eps == 1e-6 and b.norm1.num_groups == 32
            assert compare_outputs(ref.group_norm(x, 32, b.norm1.weight, b.norm1.bias, 1e-6), b.norm1(x)) is None
            # Attention's call shape: group_norm(view(B, C, HW).transpose(1, 2).transpose(1, 2))
            hs = x.view(2, 64, 30).transpose(1, 2)
            arg = hs.transpose(1, 2)
            assert arg.is_contiguous()
            assert compare_outputs(ref.group_norm(arg, 32, b.norm1.weight, b.norm1.bias, 1e-6), b.norm1(arg)) is None


def test_channels_last_input_copy_is_a_bit_copy():
    """native_group_norm's ``X.contiguous()`` for a channels-last x runs as a tiled Triton copy
    (aten's strided copy was slow): the same bits, NaN payloads included, NCHW out."""
    x = _rand((2, 70, 5, 9), torch.bfloat16, 89)
    x.view(torch.int16).view(-1)[:3] = torch.tensor([0x7FC1, -91, 1], dtype=torch.int16)
    x = x.contiguous(memory_format=torch.channels_last)
    got = gn._contiguous(x)
    assert got.is_contiguous()
    assert torch.equal(got.view(torch.int16), x.contiguous().view(torch.int16))
    sl = x[:, :, 1:]  # not canonical channels-last: aten's copy
    assert torch.equal(gn._contiguous(sl).view(torch.int16), sl.contiguous().view(torch.int16))
