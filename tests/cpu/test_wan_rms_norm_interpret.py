"""norm.wan_rms_norm_silu under TRITON_INTERPRET=1, bitwise against tests/support/wan_rms_sim.py
(the simulation of torch's CUDA reduce order for F.normalize + the eager elementwise chain); the
reference chain against diffusers' WanRMS_norm module; the reduce-config replica's decisions."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import exact
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm import wan_rms_norm_silu_triton as wk
from tests.support import wan_rms_sim as ws

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


@pytest.fixture(params=["chain", "pos"])
def cl_variant(request, monkeypatch):
    """Both exact kernels that take channels-last inputs (``CL_VARIANT``): chains as tile rows, and
    positions as tile rows."""
    monkeypatch.setattr(wk, "CL_VARIANT", request.param)
    return request.param


def _rand(shape, dtype, seed, scale=2.0, offset=0.3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _gamma(C, nd, dtype, seed):
    return _rand((C, *([1] * nd)), dtype, seed, 0.3, 1.0)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 384, 1, 8, 16), torch.bfloat16),  # channels split over 4 warps (the Wan case)
        ((1, 96, 2, 4, 8), torch.float32),  # no split (few outputs): one thread per position
        ((1, 256, 1, 2, 16), torch.float16),  # split over 16 warps
        ((2, 40, 7, 9), torch.bfloat16),  # 4-D (the attention block's norm), odd sizes, batch 2
        ((1, 100, 1, 3, 13), torch.float32),  # C not a multiple of the 4H chains, S odd
    ],
    ids=["384-split4", "96-nosplit", "256-split16", "4d-odd", "ragged"],
)
@pytest.mark.parametrize("silu", [True, False])
def test_kernel_matches_sim(shape, dtype, silu):
    x = _rand(shape, dtype, 1)
    gam = _gamma(shape[1], len(shape) - 2, dtype, 2)
    got = wk._launch(x, gam, 0.0, silu)
    mm = compare_outputs(got, ws.rms_norm_silu(x, gam, 0.0, silu), f"{shape} {dtype}")
    assert mm is None, str(mm)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf under the interpreter
def test_t_major_layout_from_wan_resample():
    """WanResample returns ``x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)``: handled, output with
    the same strides as eager's. HW = 12 (vec 4) and HW = 30 (vec 2; channels split over 8 warps)."""
    for (T, Hh, Ww, C) in ((2, 3, 4, 64), (4, 3, 10, 256)):
        mem = _rand((1, T, C, Hh, Ww), torch.bfloat16, 14)
        x = mem.permute(0, 2, 1, 3, 4)
        assert not x.is_contiguous()
        gam = _gamma(C, 3, torch.bfloat16, 15)
        assert wk.can_use_wan_rms_norm_silu(x, gam)
        got = wk.wan_rms_norm_silu(x, gam)
        exp = ref.wan_rms_norm_silu(x, gam)
        assert got.stride() == exp.stride() == x.stride()
        mm = compare_outputs(got, ws.rms_norm_silu(x, gam))
        assert mm is None, str(mm)
    # the layouts disagree on the vector width for HW = 6, T = 4: 4 for contiguous, 2 here
    assert ws.output_vec_size(24, 256) == 4 and ws.output_vec_size(24, 256, 0, 6) == 2


@pytest.mark.parametrize("shape", [(1, 64, 2, 4, 6), (2, 40, 3, 8), (1, 384, 1, 4, 8), (2, 24, 3, 2, 6)],
                         ids=["5d-T2", "4d-b2", "384-split4", "5d-b2"])
@pytest.mark.parametrize("silu", [True, False])
def test_channels_last_reduces_in_the_ncdhw_order(shape, silu, cl_variant):
    """The channels-last Wan decode hands the norm channels-last tensors; the NCDHW decode it
    stands in for had them contiguous: the kernel (and the reference) give the contiguous bits,
    in the input's channels-last layout."""
    fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    x = _rand(shape, torch.bfloat16, 16).contiguous(memory_format=fmt)
    assert not x.is_contiguous() and wk.channels_last(x)
    gam = _gamma(shape[1], len(shape) - 2, torch.bfloat16, 17)
    assert not wk.can_use_wan_rms_norm_silu(x, gam, 0.0, silu)  # eager's own channels-last order: not ours
    assert wk.can_use_wan_rms_norm_silu(x, gam, 0.0, silu, ncdhw=True)
    got = wk.wan_rms_norm_silu(x, gam, 0.0, silu, ncdhw=True)
    exp = ref.wan_rms_norm_silu(x, gam, 0.0, silu, ncdhw=True)
    assert got.stride() == exp.stride() == x.stride()
    sim = ws.rms_norm_silu(x.contiguous(), gam, 0.0, silu)
    mm = compare_outputs(got, sim, f"channels-last {shape}")
    assert mm is None, str(mm)
    assert compare_outputs(exp, ref.wan_rms_norm_silu(x.contiguous(), gam, 0.0, silu)) is None


@pytest.mark.parametrize("shape,pad", [((1, 64, 2, 4, 6), (1, 1, 1, 1, 2, 0)), ((2, 24, 3, 2, 6), (1, 1, 1, 1, 1, 0)),
                                       ((1, 40, 1, 3, 4), (0, 0, 0, 0, 0, 0))], ids=["causal", "b2-front1", "nopad"])
def test_padded_output_is_the_causal_conv_input(shape, pad, cl_variant):
    """wan_rms_norm_silu_pad: the norm's output written into the interior of the causal conv's
    zero-padded channels-last buffer equals F.pad of the norm's output, border zeros included."""
    x = _rand(shape, torch.bfloat16, 18).contiguous(memory_format=torch.channels_last_3d)
    gam = _gamma(shape[1], 3, torch.bfloat16, 19)
    assert wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad)
    assert not wk.can_use_wan_rms_norm_silu_pad(x.contiguous(), gam, 0.0, True, True, pad)
    got, kept = wk.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad)
    assert got.is_contiguous(memory_format=torch.channels_last_3d) and kept.shape[2] == 0
    exp = torch.nn.functional.pad(ws.rms_norm_silu(x.contiguous(), gam), list(pad))
    mm = compare_outputs(got, exp, f"padded {shape} {pad}")
    assert mm is None, str(mm)
    assert compare_outputs(ref.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad)[0],
                           torch.nn.functional.pad(ref.wan_rms_norm_silu(x.contiguous(), gam), list(pad))) is None
    # the producing convolution's bias, added first (aten's separate add_, one rounding)
    pb = _rand((shape[1],), torch.bfloat16, 20, 0.5, 0.1)
    got = wk.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb)[0]
    xb = x.contiguous() + pb.reshape(1, -1, 1, 1, 1)
    mm = compare_outputs(got, torch.nn.functional.pad(ws.rms_norm_silu(xb, gam), list(pad)), f"pre-bias {shape}")
    assert mm is None, str(mm)
    assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb.float())


@pytest.mark.parametrize(
    "shape,pad,tc,keep",
    [
        ((1, 64, 4, 4, 6), (1, 1, 1, 1, 2, 0), 2, 2),  # a later chunk at full resolution: 2 cached, 2 kept
        ((2, 24, 3, 3, 5), (1, 1, 1, 1, 2, 0), 2, 2),  # batch 2 (CFG), odd frame size
        ((1, 40, 1, 2, 6), (1, 1, 1, 1, 2, 0), 2, 1),  # one new frame: one kept (the caller cats the old one)
        ((2, 16, 2, 2, 4), (1, 1, 1, 1, 2, 0), 1, 2),  # one cached frame, one zero front frame
        ((1, 24, 3, 2, 4), (0, 0, 0, 0, 2, 0), 0, 3),  # no cache (first chunk), every frame kept
    ],
    ids=["full-res", "b2-odd", "t1", "tc1", "no-cache"],
)
def test_cache_frames_in_front_and_kept_frames_out(shape, pad, tc, keep, cl_variant):
    """The cache plumbing of a causal convolution, in the op: ``cache`` copied into the buffer's
    front frames by the border launch, the norm's last ``keep`` frames stored a second time.
    Equal to eager's ``F.pad(cat([cache, y], 2), ...)`` and ``y[:, :, -keep:].clone()``, with a
    cache holding NaN payloads and -0 (bit copies), and with a conv bias first."""
    B, C, T, Hh, Ww = shape
    x = _rand(shape, torch.bfloat16, 21).contiguous(memory_format=torch.channels_last_3d)
    gam = _gamma(C, 3, torch.bfloat16, 22)
    pb = _rand((C,), torch.bfloat16, 23, 0.5, 0.1)
    cache = None
    if tc:
        cache = _rand((B, C, tc, Hh, Ww), torch.bfloat16, 24)
        cache.view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("-inf")], dtype=torch.bfloat16)
        cache.view(torch.int16).view(-1)[3] = 0x7FC1  # a NaN with a payload
        cache = cache.contiguous(memory_format=torch.channels_last_3d)
    assert wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, keep)
    got, kept = wk.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, keep)
    y = ws.rms_norm_silu(x.contiguous() + pb.reshape(1, -1, 1, 1, 1), gam)
    front = list(pad)
    front[4] -= tc
    exp = torch.nn.functional.pad(y if cache is None else torch.cat([cache.contiguous(), y], 2), front)
    for name, a, e in (("padded", got, exp), ("kept", kept, y[:, :, T - keep:])):
        assert a.is_contiguous(memory_format=torch.channels_last_3d), name
        assert a.shape == e.shape, (name, a.shape, e.shape)
        assert torch.equal(a.view(torch.int16), e.contiguous(memory_format=torch.channels_last_3d).view(torch.int16)), \
            str(compare_outputs(a, e, f"{name} {shape} tc={tc} keep={keep}"))
    r_out, r_kept = ref.wan_rms_norm_silu_pad(x.contiguous(memory_format=torch.channels_last_3d), gam, 0.0, True,
                                              False, pad, pb, cache, keep)
    assert r_out.shape == got.shape and r_kept.shape == kept.shape
    # refusals: the cache not dense channels-last, of another size or more frames than the front pad; keep > T
    if cache is not None:
        assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache.contiguous(), keep)
        assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache[:, :, :, :1], keep)
        assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache.float(), keep)
        short = list(pad)
        short[4] = tc - 1
        assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, tuple(short), pb, cache, keep)
    assert not wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, T + 1)
    with pytest.raises(UnsupportedInput, match="keep"):
        wk.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, -1)


def test_channels_last_rejected_where_ncdhw_layouts_disagree():
    """With T > 1 and H*W not a multiple of 4 the NCDHW decode's contiguous and T-major inputs may
    reduce in different orders; a channels-last input does not say which it was: rejected there,
    taken where both agree."""
    found = 0
    for C in (16, 64, 96, 128, 200, 384):
        for T, Hh, Ww in ((2, 1, 3), (4, 2, 3), (3, 3, 5), (2, 5, 6), (8, 3, 3)):
            B, HW = 1, Hh * Ww
            orders = {wk.reduce_layout(B, C, T * HW, 0, v)[0] for v in ((T * HW, T * HW * C), (HW, HW, C * HW))}
            x = torch.zeros(B, C, T, Hh, Ww, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
            reason = wk._unsupported_reason(x, _gamma(C, 3, torch.bfloat16, 0), 0.0, True, True)
            if len(orders) > 1:
                found += 1
                assert reason is not None, (C, T, Hh, Ww)
            elif max(orders) <= wk.MAX_H:
                assert reason is None, (C, T, Hh, Ww, reason)
    assert found, "no shape with disagreeing orders was tried"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf under the interpreter
@pytest.mark.parametrize("shape,bp", [((1, 96, 2, 16, 16), (64, 32, 4)), ((2, 80, 3, 8, 12), (64, 32, 4)),
                                      ((1, 128, 1, 8, 8), (32, 64, 4)), ((1, 24, 3, 3, 5), (16, 16, 4))],
                         ids=["96-split4-even", "80-b2-ragged", "128-split8", "24-nosplit"])
def test_position_major_kernel_special_values(shape, bp):
    """The position-major channels-last kernel at launches whose tiles divide the shape (no masks)
    and do not: bitwise the simulation of the NCDHW chain, with a zero position, NaN, Inf, -0, a
    conv bias folded into the loads, and its padded output's kept frames."""
    B, C, T, Hh, Ww = shape
    x = _rand(shape, torch.bfloat16, 31)
    x[0, :, 0, 0, 0] = 0.0
    x[0, 5, 0, 1, 1] = float("nan")
    x[-1, 6, -1, 2, 2] = float("inf")
    x[0, :, -1, 1, 0] = -0.0
    x = x.contiguous(memory_format=torch.channels_last_3d)
    gam = _gamma(C, 3, torch.bfloat16, 32)
    pb = _rand((C,), torch.bfloat16, 33, 0.5, 0.1)
    pb[2] = -0.0
    pad, keep = (1, 1, 1, 1, 2, 0), min(2, T)
    kept = wk._kept_buffer(x, keep)
    got = wk._launch(x, gam, 0.0, True, ncdhw=True, pad=pad, pre_bias=pb, kept=kept, variant="pos", pos_launch=bp)
    y = ws.rms_norm_silu(x.contiguous() + pb.reshape(1, -1, 1, 1, 1), gam)
    for name, a, e in (("padded", got, torch.nn.functional.pad(y, list(pad))), ("kept", kept, y[:, :, T - keep:])):
        mm = compare_outputs(a, e, f"pos {name} {shape} {bp}")
        assert mm is None, str(mm)
    plain = wk._launch(x, gam, 0.0, False, ncdhw=True, variant="pos", pos_launch=bp)
    assert plain.stride() == x.stride()
    mm = compare_outputs(plain, ws.rms_norm_silu(x.contiguous(), gam, 0.0, False), f"pos no-pad {shape}")
    assert mm is None, str(mm)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: inf - inf under the interpreter
def test_bias_tensor_and_special_values():
    x = _rand((1, 64, 1, 4, 16), torch.bfloat16, 3)
    x[0, :, 0, 0, 0] = 0.0  # zero vector: norm 0 -> clamp_min(1e-12); n = 0
    x[0, 5, 0, 1, 1] = float("nan")
    x[0, 6, 0, 2, 2] = float("inf")
    x[0, :, 0, 3, 3] = -0.0  # -0 / eps = -0; "+ 0.0" makes it +0
    gam = _gamma(64, 3, torch.bfloat16, 4)
    bias = _rand((64, 1, 1, 1), torch.bfloat16, 5, 0.2, 0.0)
    for b in (0.0, bias):
        for silu in (True, False):
            got = wk._launch(x, gam, b, silu)
            mm = compare_outputs(got, ws.rms_norm_silu(x, gam, b, silu))
            assert mm is None, str(mm)
    y = wk._launch(x, gam, 0.0, False)
    assert (y[0, :, 0, 3, 3].view(torch.int16) == 0).all()  # +0, not -0


def test_reduce_layout_replica():
    """setReduceConfig's choices for the shapes that matter (notes/wan_vae.md)."""
    assert wk.reduce_layout(1, 384, 60 * 104)[:2] == (4, True)  # Wan decoder, 480x832
    assert wk.reduce_layout(1, 96, 480 * 832 * 4)[:2] == (4, True)
    assert wk.reduce_layout(1, 96, 64)[:2] == (1, False)  # 16 vector outputs: no split
    assert wk.reduce_layout(1, 256, 32)[:2] == (16, True)
    assert wk.reduce_layout(1, 384, 15)[0] == 64 > wk.MAX_H  # odd S (vec 1), few outputs: rejected
    for args in ((1, 384, 6240), (2, 40, 63), (1, 256, 32), (3, 17, 5)):
        assert wk.reduce_layout(*args)[:2] == ws.reduce_layout(*args)[:2]


def test_sim_norm_close_to_torch():
    x = _rand((2, 96, 3, 5, 7), torch.float32, 6)
    for H in (1, 4, 16):
        n = torch.sqrt(ws.sumsq(x.reshape(2, 96, -1), H).double())
        torch.testing.assert_close(n.float(), torch.linalg.vector_norm(x.reshape(2, 96, -1), dim=1), rtol=1e-6, atol=0)


def test_reference_equals_diffusers_module():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    for images, shape in ((False, (2, 48, 3, 5, 7)), (True, (3, 32, 5, 6))):
        for dtype in (torch.bfloat16, torch.float32):
            m = WanRMS_norm(shape[1], images=images).to(dtype)
            with torch.no_grad():
                m.gamma.normal_(1.0, 0.3)
                x = _rand(shape, dtype, 7)
                assert compare_outputs(ref.wan_rms_norm(x, m.gamma, m.bias), m(x)) is None
                assert compare_outputs(ref.wan_rms_norm_silu(x, m.gamma, m.bias), torch.nn.SiLU()(m(x))) is None


def test_close_variant_tracks_fp64():
    x = _rand((1, 96, 1, 8, 16), torch.bfloat16, 8)
    gam = _gamma(96, 3, torch.bfloat16, 9)
    f64 = exact.wan_rms_norm_silu_fp64(x, gam)
    err_c = wk._launch(x, gam, 0.0, True, exact=False).double() - f64
    err_e = ws.rms_norm_silu(x, gam).double() - f64
    assert float(err_c.pow(2).mean()) <= float(err_e.pow(2).mean())


def test_rejections():
    x = _rand((1, 64, 1, 4, 8), torch.bfloat16, 10)
    gam = _gamma(64, 3, torch.bfloat16, 11)
    assert wk.can_use_wan_rms_norm_silu(x, gam)
    bad = [
        (x.transpose(3, 4), gam, 0.0),  # a layout other than contiguous / WanResample's
        (x.float(), gam, 0.0),  # gamma dtype mismatch
        (x, gam[:32], 0.0),
        (x, gam, 0.5),  # a non-zero float bias is not WanRMS_norm's
        (x[0, 0], gam, 0.0),  # too few dims
        (_rand((1, 384, 1, 3, 5), torch.bfloat16, 12), _gamma(384, 3, torch.bfloat16, 13), 0.0),  # 64-warp split
        (x.double(), gam.double(), 0.0),
    ]
    for xx, gg, bb in bad:
        assert not wk.can_use_wan_rms_norm_silu(xx, gg, bb)
        with pytest.raises(UnsupportedInput):
            wk.wan_rms_norm_silu(xx, gg, bb)
    got = wk.wan_rms_norm_silu(x, gam)
    assert compare_outputs(got, ws.rms_norm_silu(x, gam)) is None


@pytest.mark.parametrize("pad", [(1, 1, 1, 1, 2, 0), (0, 2, 1, 0, 0, 0), (1, 1, 1, 1, 0, 0)])
@pytest.mark.parametrize("C,W", [(5, 4), (40, 9)], ids=["narrow", "border-wider-than-block"])
def test_zero_border_zeroes_exactly_the_border(pad, C, W):
    """The padded buffer's border launch: zeros outside x's place, nothing written inside (a
    buffer of NaNs shows both); with border columns narrower and wider than the launch's block
    (interior rows only visit their border columns)."""
    wl, wr, ht, hb, front, back = pad
    B, T, H = 2, 2, 3
    out = torch.full((B, C, front + T, ht + H + hb, wl + W + wr), float("nan"), dtype=torch.bfloat16)
    out = out.contiguous(memory_format=torch.channels_last_3d)
    Tp, Hp, Wp = out.shape[2:]
    from ditfuse.kernels.layout import pad_channels_last_triton as pc

    pc.launch_border(out, None, pad, (16, 1))
    inner = torch.zeros_like(out, dtype=torch.bool)
    inner[:, :, front:front + T, ht:ht + H, wl:wl + W] = True
    assert out[inner].isnan().all()
    assert (out[~inner] == 0).all() and not out[~inner].signbit().any()


@pytest.mark.parametrize("block", [None, (16, 1)], ids=["launch", "rows-over-blocks"])
@pytest.mark.parametrize("B,tc,front", [(1, 2, 2), (2, 1, 2), (2, 2, 3)])
def test_padded_buffer_takes_the_cache_frames(B, tc, front, block, monkeypatch):
    """padded_channels_last with a cache: the cached frames (bit copies, NaN payload and -0 kept) in
    the last ``tc`` front frames, zero around them and in the other front frames, the interior
    untouched (NaN); the refusals name the problem."""
    from ditfuse.kernels.layout import pad_channels_last_triton as pc
    from ditfuse.kernels.layout.pad_channels_last_triton import padded_channels_last

    if block is not None:  # rows of 24 elements over blocks of 16: border columns on both sides of a block edge
        monkeypatch.setattr(pc, "BORDER_LAUNCH", block)
    C, T, H, W = 3, 2, 3, 5
    cache = _rand((B, C, tc, H, W), torch.bfloat16, 25)
    cache.view(torch.int16).view(-1)[:2] = torch.tensor([0x7FA3, -32768], dtype=torch.int16)  # NaN payload, -0
    cache = cache.contiguous(memory_format=torch.channels_last_3d)
    pad = (1, 2, 1, 1, front, 0)
    out = padded_channels_last((B, C, T, H, W), pad, torch.bfloat16, torch.device("cpu"), cache)
    out[:, :, front:, 1:1 + H, 1:1 + W] = float("nan")  # the producer's part
    exp = torch.nn.functional.pad(torch.cat([cache.contiguous(), torch.full((B, C, T, H, W), float("nan"),
                                                                             dtype=torch.bfloat16)], 2),
                                  [1, 2, 1, 1, front - tc, 0])
    assert torch.equal(out.contiguous().view(torch.int16), exp.view(torch.int16))
    with pytest.raises(ValueError, match="dense channels-last"):
        padded_channels_last((B, C, T, H, W), pad, torch.bfloat16, torch.device("cpu"), cache.contiguous())
    with pytest.raises(ValueError, match="frames"):
        padded_channels_last((B, C, T, H, W), (1, 2, 1, 1, tc - 1, 0), torch.bfloat16, torch.device("cpu"), cache)


def test_padded_op_schema_and_fake_impl():
    """ditfuse::wan_rms_norm_silu_pad (two outputs, an optional cache) and ditfuse::upsample_nearest2x:
    schema and FakeTensor implementations agree with the kernels (shapes, strides, dtypes)."""
    from ditfuse.kernels.layout import upsample_nearest_triton  # noqa: F401 (registers the op)

    cl = torch.channels_last_3d
    x = _rand((1, 16, 2, 2, 4), torch.bfloat16, 30).contiguous(memory_format=cl)
    gam = _gamma(16, 3, torch.bfloat16, 31)
    cache = _rand((1, 16, 2, 2, 4), torch.bfloat16, 32).contiguous(memory_format=cl)
    torch.library.opcheck(torch.ops.ditfuse.wan_rms_norm_silu_pad.default,
                          (x, gam, None, True, True, [1, 1, 1, 1, 2, 0], None, cache, 2),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.ditfuse.wan_rms_norm_silu_pad.default,
                          (x, gam, None, True, True, [1, 1, 1, 1, 2, 0], None, None, 0),
                          test_utils=("test_schema", "test_faketensor"))
    u = _rand((2, 8, 3, 5), torch.bfloat16, 33).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(torch.ops.ditfuse.upsample_nearest2x.default, (u,),
                          test_utils=("test_schema", "test_faketensor"))
