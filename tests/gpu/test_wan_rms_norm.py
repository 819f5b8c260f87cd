"""norm.wan_rms_norm_silu vs eager on CUDA, bitwise, at AutoencoderKLWan decoder shapes (480x832).

The reduce-order model (tests/support/wan_rms_sim.py) is also checked on its own: its norm
against ``torch.linalg.vector_norm`` bit for bit, over shapes that take each branch of the
reduce config (channels split over 4 or 16 warps, not split, vector widths 4/2/1).
bench/probes/probe_wan_rms_order.py says which alternative order matches when this fails.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import exact
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.norm import wan_rms_norm_silu_triton as wk
from tests.support import wan_rms_sim as ws

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Wan 2.1 VAE decoder (base dim 96, mults 1,2,4,4) at 480x832: per-chunk shapes [B, C, T, H, W],
# and the mid-block attention's 4-D [B*T, C, H, W].
WAN = [(1, 384, 1, 60, 104), (1, 384, 2, 60, 104), (1, 384, 4, 120, 208), (1, 192, 4, 240, 416),
       (1, 96, 4, 480, 832), (1, 384, 60, 104), (2, 384, 60, 104)]


def _rand(shape, dtype, gen, scale=2.0, offset=0.3):
    return (torch.randn(shape, generator=gen, device="cuda") * scale + offset).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_wan_decoder_shapes(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    failures = []
    for shape in WAN:
        x = _rand(shape, dtype, gen)
        gam = _rand((shape[1], *([1] * (len(shape) - 2))), dtype, gen, 0.3, 1.0)
        for silu in (True, False):
            assert wk.can_use_wan_rms_norm_silu(x, gam, 0.0, silu), shape
            mm = compare_outputs(wk.wan_rms_norm_silu(x, gam, 0.0, silu), ref.wan_rms_norm_silu(x, gam, 0.0, silu),
                                 f"{list(shape)} {dtype} silu={silu} layout={wk.reduce_layout(shape[0], shape[1], x[0, 0].numel())}")
            if mm:
                failures.append(str(mm))
        del x
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_wan_resample_layout(dtype):
    """The [B, C, T, H, W] view of [B, T, C, H, W] memory that WanResample returns (the next
    block's norm1 input): same bits, same output strides as eager."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    failures = []
    for B, T, C, Hh, Ww in ((1, 2, 384, 120, 208), (1, 4, 192, 240, 416), (2, 2, 96, 30, 50), (1, 4, 256, 3, 10)):
        x = _rand((B, T, C, Hh, Ww), dtype, gen).permute(0, 2, 1, 3, 4)
        gam = _rand((C, 1, 1, 1), dtype, gen, 0.3, 1.0)
        assert wk.can_use_wan_rms_norm_silu(x, gam)
        got, exp = wk.wan_rms_norm_silu(x, gam), ref.wan_rms_norm_silu(x, gam)
        mm = compare_outputs(got, exp, f"T-major {[B, C, T, Hh, Ww]} {dtype}")
        if mm:
            failures.append(str(mm))
        if got.stride() != exp.stride():
            failures.append(f"T-major {[B, C, T, Hh, Ww]}: strides {got.stride()} vs eager {exp.stride()}")
    assert not failures, "\n".join(failures)


NORM_SHAPES = [(1, 384, 6240), (1, 96, 64), (2, 40, 63), (1, 256, 32), (1, 100, 4093), (3, 64, 6),
               (1, 192, 24960), (4, 17, 1000), (1, 128, 130), (1, 512, 2048)]


def test_norm_order_model():
    """The simulation's sum of squares (on the GPU, exact fma) -> sqrt == vector_norm's bits."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    failures = []
    for B, C, S in NORM_SHAPES:
        x = torch.randn(B, C, S, generator=gen, device="cuda") * torch.exp(torch.randn(B, 1, S, generator=gen, device="cuda"))
        H, split, bh, _ = wk.reduce_layout(B, C, S)
        assert ws.reduce_layout(B, C, S)[:2] == (H, split)
        got = torch.sqrt(ws.sumsq(x, H))
        exp = torch.linalg.vector_norm(x, dim=1)
        d = int((got.view(torch.int32) != exp.view(torch.int32)).sum())
        if d:
            failures.append(f"[{B},{C},{S}] H={H} split={split} bh={bh}: {d}/{exp.numel()} norms differ")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_awkward_and_special(dtype):
    gen = torch.Generator(device="cuda").manual_seed(3)
    failures = []
    for shape in ((1, 96, 1, 7, 9), (2, 40, 7, 9), (1, 100, 3, 13, 11), (1, 256, 1, 2, 16), (1, 17, 2, 33, 31)):
        x = _rand(shape, dtype, gen)
        gam = _rand((shape[1], *([1] * (len(shape) - 2))), dtype, gen, 0.3, 1.0)
        x.view(-1)[3] = float("nan")
        x.view(-1)[100] = float("inf")
        sp = x[0].view(shape[1], -1)  # [C, positions] of sample 0 (x is contiguous; 4-D and 5-D)
        sp[:, 0] = 0.0
        sp[:, 1] = -0.0
        bias = _rand(gam.shape, dtype, gen, 0.2, 0.0)
        for b in (0.0, bias):
            if not wk.can_use_wan_rms_norm_silu(x, gam, b):
                failures.append(f"{list(shape)} unexpectedly rejected")
                continue
            mm = compare_outputs(wk.wan_rms_norm_silu(x, gam, b), ref.wan_rms_norm_silu(x, gam, b), f"{list(shape)} {dtype}")
            if mm:
                failures.append(str(mm))
    assert not failures, "\n".join(failures)


def test_close_variant_accuracy():
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = _rand((1, 384, 2, 60, 104), torch.bfloat16, gen)
    gam = _rand((384, 1, 1, 1), torch.bfloat16, gen, 0.3, 1.0)
    f64 = exact.wan_rms_norm_silu_fp64(x, gam)
    e_e = ref.wan_rms_norm_silu(x, gam).double() - f64
    e_c = wk.wan_rms_norm_silu_fp32(x, gam).double() - f64
    assert float(e_c.pow(2).mean().sqrt()) <= 1.5 * float(e_e.pow(2).mean().sqrt())
    assert float(e_c.abs().max()) <= 1.5 * float(e_e.abs().max())
    assert abs(float(e_c.mean())) <= 0.25 * float(e_e.pow(2).mean().sqrt())


@pytest.mark.parametrize("variant", ["pos", "chain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_padded_output_with_cache_frames_at_decoder_shapes(dtype, variant, monkeypatch):
    """norm.wan_rms_norm_silu_pad as the channels-last decode calls it in a later chunk: channels-last
    x, a conv bias first, the 2 cached frames copied into the padded buffer's front by the border
    launch, the last frames kept; both outputs bitwise equal to eager's cat + F.pad and clone (on the
    contiguous tensor the NCDHW decode holds), at the 480x832 decoder's 5-D shapes; both exact
    kernels that take channels-last inputs (``CL_VARIANT``)."""
    monkeypatch.setattr(wk, "CL_VARIANT", variant)
    monkeypatch.delenv("DITFUSE_WAN_RMS_CL", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    failures = []
    pad = (1, 1, 1, 1, 2, 0)
    for shape in [s for s in WAN if len(s) == 5]:
        B, C, T, Hh, Ww = shape
        x = _rand(shape, dtype, gen).contiguous(memory_format=torch.channels_last_3d)
        gam = _rand((C, 1, 1, 1), dtype, gen, 0.3, 1.0)
        pb = _rand((C,), dtype, gen, 0.1, 0.0)
        cache = _rand((B, C, 2, Hh, Ww), dtype, gen).contiguous(memory_format=torch.channels_last_3d)
        keep = min(2, T)
        assert wk.can_use_wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, keep), shape
        got, kept = wk.wan_rms_norm_silu_pad(x, gam, 0.0, True, True, pad, pb, cache, keep)
        y = ref.wan_rms_norm_silu(x.contiguous() + pb.reshape(1, -1, 1, 1, 1), gam, 0.0, True)
        exp = torch.nn.functional.pad(torch.cat([cache.contiguous(), y], 2), [1, 1, 1, 1, 0, 0])
        for name, a, e in (("padded", got, exp), ("kept", kept, y[:, :, -keep:].clone())):
            assert a.is_contiguous(memory_format=torch.channels_last_3d), name
            mm = compare_outputs(a, e, f"{name} {list(shape)} {dtype}")
            if mm:
                failures.append(str(mm))
        del x, got, kept, y, exp
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("variant", ["pos", "chain"])
@pytest.mark.parametrize("shape", [(1, 96, 4, 480, 832), (2, 192, 3, 37, 52), (1, 384, 1, 7, 9)],
                         ids=["480x832", "b2-odd", "few-positions"])
def test_channels_last_special_values(shape, variant, monkeypatch):
    """The channels-last kernels (both variants) on inputs with a zero position (norm 0 -> the
    1e-12 clamp), NaN, +-Inf, -0 and bf16 subnormals, with a conv bias folded into the loads and
    without: bitwise the eager chain on the contiguous tensor, padded output and kept frames."""
    monkeypatch.setattr(wk, "CL_VARIANT", variant)
    monkeypatch.delenv("DITFUSE_WAN_RMS_CL", raising=False)
    gen = torch.Generator(device="cuda").manual_seed(9)
    B, C, T, Hh, Ww = shape
    x = _rand(shape, torch.bfloat16, gen)
    x[0, :, 0, 0, 0] = 0.0
    x[0, 3, 0, 1, 1] = float("nan")
    x[-1, 4, -1, 2, 2] = float("inf")
    x[-1, 5, -1, 3, 3] = float("-inf")
    x[0, :, -1, 1, 2] = -0.0
    x[0, :, 0, 2, 1] = 1e-39  # bf16 subnormal: its square underflows to 0 in fp32
    gam = _rand((C, 1, 1, 1), torch.bfloat16, gen, 0.3, 1.0)
    pb = _rand((C,), torch.bfloat16, gen, 0.1, 0.0)
    xc = x.contiguous(memory_format=torch.channels_last_3d)
    pad, keep = (1, 1, 1, 1, 2, 0), min(2, T)
    failures = []
    for pre in (None, pb):
        if not wk.can_use_wan_rms_norm_silu_pad(xc, gam, 0.0, True, True, pad, pre, None, keep):
            pytest.skip(f"{shape}: torch's reduce config is not reproduced at this shape")
        got, kept = wk.wan_rms_norm_silu_pad(xc, gam, 0.0, True, True, pad, pre, None, keep)
        xin = x if pre is None else x + pre.reshape(1, -1, 1, 1, 1)
        y = ref.wan_rms_norm_silu(xin, gam, 0.0, True)
        for name, a, e in (("padded", got, torch.nn.functional.pad(y, list(pad))), ("kept", kept, y[:, :, T - keep:])):
            mm = compare_outputs(a, e, f"{variant} {name} {list(shape)} pre-bias={pre is not None}")
            if mm:
                failures.append(str(mm))
        plain = wk.wan_rms_norm_silu(xin.contiguous(memory_format=torch.channels_last_3d), gam, 0.0, False, True)
        mm = compare_outputs(plain, ref.wan_rms_norm_silu(xin, gam, 0.0, False), f"{variant} no-pad {list(shape)}")
        if mm:
            failures.append(str(mm))
    assert not failures, "\n".join(failures)
