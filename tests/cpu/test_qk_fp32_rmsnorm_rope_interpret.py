"""rope.qk_fp32_rmsnorm_rope (FLUX.3's QK chain) under TRITON_INTERPRET=1.

The chain is ``norm_q(q.float())`` with an fp32 ``torch.nn.RMSNorm``, the interleaved RoPE in
fp32 and one ``.to(q.dtype)``. The kernel is compared bitwise with tests/support/rms_sim.py run on
the fp32 copies (torch's CUDA ``_fused_rms_norm`` order, the interpreter's rsqrt) and then
rounded once, which is that chain; against the CPU eager chain (another reduction order) within
one output ulp. The GPU test compares it with the live eager chain (tests/gpu/test_flux3_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import (can_use_qk_fp32_rmsnorm_rope, qk_fp32_rmsnorm_rope,
                                                         qk_rmsnorm_rope, qk_rmsnorm_rope_fp32)
from tests.cpu.test_qk_rmsnorm_rope_interpret import _make, _misaligned
from tests.support import rms_sim


def _fp32_weights(args):
    for n in ("q_weight", "k_weight", "q_txt_weight", "k_txt_weight"):
        if args[n] is not None:
            args[n] = args[n].float()
    return args


def _sim(args):
    dt = args["q"].dtype
    up = {n: (t.float() if isinstance(t, torch.Tensor) and n in ("q", "k", "q_txt", "k_txt") else t)
          for n, t in args.items()}
    q, k = rms_sim.qk_rmsnorm_rope(**up, rsqrt=rms_sim.interp_rsqrt)
    return q.to(dt), k.to(dt)


def _check(args):
    assert can_use_qk_fp32_rmsnorm_rope(**args), "predicate refused"
    out = qk_fp32_rmsnorm_rope(**args)
    assert_bitwise_equal(out, _sim(args), "qk_fp32_rmsnorm_rope vs simulation")
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("S", [1, 7])
def test_flux3_shapes_bitwise(dtype, S):
    """FLUX.3 passes one stream (mode blocks: one mode's tokens; single blocks: text + image
    already concatenated) with its RoPE table; batch 2 for CFG."""
    out = _check(_fp32_weights(_make(2, S, 0, 3, 128, dtype, seed=S)))
    assert out[0].shape == (2, S, 3, 128) and out[0].dtype == dtype and out[0].is_contiguous()


@pytest.mark.parametrize("D", [64, 96, 136, 256])
def test_head_dims(D):
    _check(_fp32_weights(_make(1, 3, 2, 2, D, torch.bfloat16, seed=D)))


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False)])
def test_no_weight_no_rope(weights, rope):
    _check(_fp32_weights(_make(1, 4, 0, 2, 128, torch.bfloat16, seed=7, weights=weights, rope=rope)))


def test_is_the_close_arithmetic_and_differs_from_flux1():
    """Same arithmetic as FLUX.1's close variant (whose bf16 weights are exact in fp32), and not
    FLUX.1's exact chain, which rounds the normalised value before RoPE."""
    args = _make(2, 5, 0, 2, 128, torch.bfloat16, seed=11)
    close = qk_rmsnorm_rope_fp32(**args)
    ours = qk_fp32_rmsnorm_rope(**_fp32_weights(dict(args)))
    assert_bitwise_equal(ours, close, "fp32-norm op vs FLUX.1 close variant")
    flux1 = qk_rmsnorm_rope(**args)
    assert not torch.equal(ours[0].view(torch.int16), flux1[0].view(torch.int16))


def test_close_to_cpu_reference():
    args = _fp32_weights(_make(2, 5, 0, 3, 128, torch.bfloat16, seed=12))
    out = qk_fp32_rmsnorm_rope(**args)
    exp = reference.qk_fp32_rmsnorm_rope(**args)
    for a, e in zip(out, exp):
        assert a.dtype == e.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=1e-5)


def test_strided_views_and_misaligned_input():
    """Chunks of a fused qkv projection (``to_qkv``), and a misaligned contiguous bf16 input:
    torch normalises a fresh fp32 copy, so the input's alignment does not matter."""
    B, S, H, D = 2, 5, 2, 128
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, 3 * H * D, generator=g).to(torch.bfloat16)
    q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1))
    args = _fp32_weights(_make(B, S, 0, H, D, torch.bfloat16, seed=5))
    args.update(q=q, k=_misaligned(k.contiguous()))
    out = _check(args)
    contiguous = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    assert_bitwise_equal(out, qk_fp32_rmsnorm_rope(**contiguous), "strided vs contiguous")


def test_nan_inf_zero_rows():
    args = _fp32_weights(_make(1, 4, 0, 2, 128, torch.bfloat16, seed=9))
    args["q"][0, 1, 0, 5] = float("nan")
    args["q"][0, 2, 1, 7] = float("inf")
    args["k"][0, 3, 0, :] = 0.0
    out = _check(args)
    assert torch.isnan(out[0][0, 1, 0]).all()


def test_overflowing_squares():
    """bf16 values whose squares overflow fp32 (the fp32 copy has bf16's range)."""
    _check(_fp32_weights(_make(1, 3, 0, 2, 128, torch.bfloat16, seed=12, scale=3e19)))


REJECTIONS = {
    # a bf16 weight with the fp32 copy: F.rms_norm's composite path (several roundings)
    "weight_bf16": lambda a: a.update(q_weight=a["q_weight"].to(torch.bfloat16)),
    "weight_shape": lambda a: a.update(k_weight=a["k_weight"][:64]),
    "dtype_mix": lambda a: a.update(k=a["k"].float()),
    "rope_half": lambda a: a.update(sin=None),
    "fp32_input_misaligned": lambda a: a.update(q=_misaligned(a["q"].float()), k=a["k"].float()),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_predicate_rejects_and_kernel_raises(case):
    args = _fp32_weights(_make(1, 2, 0, 2, 128, torch.bfloat16, seed=1))
    REJECTIONS[case](args)
    assert not can_use_qk_fp32_rmsnorm_rope(**args)
    with pytest.raises(UnsupportedInput):
        qk_fp32_rmsnorm_rope(**args)
