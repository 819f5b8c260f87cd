"""rope.qk_rmsnorm_rope under TRITON_INTERPRET=1 (tiny shapes).

The kernel is compared bitwise with tests/support/rms_sim.py, a pure-torch simulation of torch's CUDA
``_fused_rms_norm`` order followed by the eager RoPE chain; under the interpreter ``rsqrt`` is
numpy's ``1 / sqrt`` and the simulation uses the same (on the GPU both use ``rsqrtf``; the GPU
tests compare with the real eager chain). Against the CPU reference (``F.rms_norm``'s composite
path, another reduction) the kernel is checked within one output ulp.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import can_use_qk_rmsnorm_rope, qk_rmsnorm_rope, qk_rmsnorm_rope_fp32
from tests.support import rms_sim

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _sim(*args, **kwargs):
    return rms_sim.qk_rmsnorm_rope(*args, rsqrt=rms_sim.interp_rsqrt, **kwargs)


def _rope_tables(S: int, D: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX-style tables (each frequency repeated for the pair) with random positions."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (S,), generator=g).double()
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2).double() / D))
    ang = pos[:, None] * freqs[None, :]
    return (
        ang.cos().float().repeat_interleave(2, dim=1),
        ang.sin().float().repeat_interleave(2, dim=1),
    )


def _make(B, S_img, S_txt, H, D, dtype, seed=0, weights=True, rope=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    q, k = rnd(B, S_img, H, D), rnd(B, S_img, H, D)
    q_txt = k_txt = None
    if S_txt:
        q_txt, k_txt = rnd(B, S_txt, H, D), rnd(B, S_txt, H, D)
    ws = [(1.0 + 0.3 * torch.randn(D, generator=g)).to(dtype) if weights else None for _ in range(4)]
    cos = sin = None
    if rope:
        cos, sin = _rope_tables(S_img + S_txt, D, seed)
    return dict(
        q=q, k=k, q_weight=ws[0], k_weight=ws[1], cos=cos, sin=sin, eps=1e-6,
        q_txt=q_txt, k_txt=k_txt,
        q_txt_weight=ws[2] if S_txt else None, k_txt_weight=ws[3] if S_txt else None,
    )


def _check(args):
    assert can_use_qk_rmsnorm_rope(**args)
    out = qk_rmsnorm_rope(**args)
    assert_bitwise_equal(out, _sim(**args), "qk_rmsnorm_rope vs simulation")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("S_txt", [0, 3])
def test_text_image_bitwise(dtype, S_txt):
    out = _check(_make(2, 5, S_txt, 3, 128, dtype, seed=S_txt))
    assert out[0].shape == (2, 5 + S_txt, 3, 128) and out[0].is_contiguous()


@pytest.mark.parametrize("D", [4, 64, 96, 136, 256, 512])
def test_head_dims(D):
    """Non-128 widths: fewer lanes (64, 4), zero-padded lanes (96, 136), two and four warps."""
    _check(_make(1, 3, 2, 2, D, torch.bfloat16, seed=D))


@pytest.mark.parametrize("weights,rope", [(False, True), (True, False), (False, False)])
def test_no_weight_no_rope(weights, rope):
    _check(_make(1, 4, 2, 2, 128, torch.bfloat16, seed=7, weights=weights, rope=rope))


def test_single_block_weights_mixed():
    """Image-only (single block) and text weights present on one stream only."""
    args = _make(2, 6, 0, 2, 128, torch.bfloat16, seed=3)
    _check(args)
    args = _make(1, 3, 2, 2, 128, torch.bfloat16, seed=4)
    args["k_txt_weight"] = None
    args["q_weight"] = None
    _check(args)


def test_close_to_cpu_reference():
    """Against the CPU eager chain (another RMS reduction order): within one ulp of the output."""
    args = _make(2, 5, 3, 3, 128, torch.bfloat16, seed=11)
    out = qk_rmsnorm_rope(**args)
    exp = reference.qk_rmsnorm_rope(**args)
    for a, e in zip(out, exp):
        torch.testing.assert_close(a.float(), e.float(), rtol=2**-7, atol=1e-5)


def test_strided_views():
    """Chunks of a fused qkv projection, a head-major tensor transposed, strided cos/sin."""
    B, S, St, H, D = 1, 5, 2, 2, 128
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, 3 * H * D, generator=g).to(torch.bfloat16)
    q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    qt = torch.randn(B, H, St, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    kt = torch.randn(B, St, D, H, generator=g).to(torch.bfloat16).transpose(2, 3)
    cos, sin = _rope_tables(S + St, D, 5)
    cos = torch.cat([cos, cos], dim=1)[:, ::2]  # stride 2 along D
    w = [(1 + 0.3 * torch.randn(D, generator=g)).to(torch.bfloat16) for _ in range(4)]
    args = dict(q=q, k=k, q_weight=w[0], k_weight=w[1], cos=cos, sin=sin, eps=1e-6,
                q_txt=qt, k_txt=kt, q_txt_weight=w[2], k_txt_weight=w[3])
    out = _check(args)
    contiguous = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    assert_bitwise_equal(out, qk_rmsnorm_rope(**contiguous), "strided vs contiguous")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_nan_inf(dtype):
    args = _make(1, 4, 2, 2, 128, dtype, seed=9)
    args["q"][0, 1, 0, 5] = float("nan")
    args["q"][0, 2, 1, 7] = float("inf")
    args["k_txt"][0, 0, 1, 0] = float("-inf")
    args["k"][0, 3, 0, :] = 0.0  # all-zero row: rstd = rsqrt(eps)
    out = _check(args)
    assert torch.isnan(out[0][0, 3, 0]).all()  # NaN spreads over its row (and its RoPE pair)


def test_large_and_tiny_scales():
    """Squares that overflow fp32 (bf16 keeps fp32's range) and subnormal squares."""
    _check(_make(1, 3, 0, 2, 128, torch.bfloat16, seed=12, scale=3e19))
    _check(_make(1, 3, 0, 2, 128, torch.bfloat16, seed=13, scale=1e-21))


def test_empty_sequence():
    args = _make(1, 0, 0, 2, 128, torch.bfloat16)
    q, k = qk_rmsnorm_rope(**args)
    assert q.shape == (1, 0, 2, 128) and k.shape == (1, 0, 2, 128)


def _base():
    return _make(1, 2, 1, 2, 128, torch.bfloat16, seed=1)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


REJECTIONS = {
    "dtype_mix": lambda a: a.update(k=a["k"].float()),
    "fp64": lambda a: a.update(q=a["q"].double(), k=a["k"].double(), q_txt=a["q_txt"].double(),
                               k_txt=a["k_txt"].double(), q_weight=None, k_weight=None,
                               q_txt_weight=None, k_txt_weight=None),
    "weight_dtype": lambda a: a.update(q_weight=a["q_weight"].float()),
    "weight_shape": lambda a: a.update(k_weight=a["k_weight"][:64]),
    "shape_mismatch": lambda a: a.update(k=a["k"][:, :1]),
    "not_4d": lambda a: a.update(q=a["q"].flatten(2), k=a["k"].flatten(2)),
    "text_half": lambda a: a.update(k_txt=None),
    "rope_half": lambda a: a.update(sin=None),
    "cos_shape": lambda a: a.update(cos=a["cos"][:2], sin=a["sin"][:2]),
    "cos_fp64": lambda a: a.update(cos=a["cos"].double(), sin=a["sin"].double()),
    "head_dim_odd": None,  # built below
    "head_dim_large": None,
    "misaligned": lambda a: a.update(q=_misaligned(a["q"])),
    "channels_last": lambda a: a.update(
        q=torch.empty(1, 2, 1, 128, dtype=torch.bfloat16).as_strided((1, 2, 1, 128), (256, 1, 256, 2)).copy_(a["q"][:, :, :1]),
        k=a["k"][:, :, :1], q_txt=a["q_txt"][:, :, :1], k_txt=a["k_txt"][:, :, :1]),
    "grad": lambda a: a.update(q=a["q"].clone().requires_grad_(True)),
    "text_weight_no_text": lambda a: a.update(q_txt=None, k_txt=None),
}


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_predicate_rejects_and_kernel_raises(case):
    if case.startswith("head_dim"):
        D = 130 if case == "head_dim_odd" else 1024
        args = _make(1, 2, 1, 1, D, torch.bfloat16)
    else:
        args = _base()
        REJECTIONS[case](args)
    assert not can_use_qk_rmsnorm_rope(**args)
    with pytest.raises(UnsupportedInput):
        qk_rmsnorm_rope(**args)


def test_channels_last_helper_matches_torch():
    """Our port of c10's ``is_channels_last_strides_2d_s4`` agrees with torch's Python mirror of
    ``Tensor.suggest_memory_format()``."""
    prims = pytest.importorskip("torch._prims_common")
    if not hasattr(prims, "suggest_memory_format"):
        pytest.skip("this torch has no torch._prims_common.suggest_memory_format")
    from ditfuse.kernels.rope.qk_rmsnorm_rope_triton import _suggests_channels_last

    cases = [
        torch.empty(2, 3, 4, 8),
        torch.empty(2, 3, 4, 8).to(memory_format=torch.channels_last),
        torch.empty(1, 1, 4, 8),
        torch.empty(1, 3, 1, 8),
        torch.empty(2, 8, 4, 3).permute(0, 3, 2, 1),
        torch.empty(1, 2, 1, 128).as_strided((1, 2, 1, 128), (256, 1, 256, 2)),
        torch.empty(2, 3, 8, 4).transpose(2, 3),
        torch.empty(2, 6, 4, 8)[:, ::2],
    ]
    for t in cases:
        expected = prims.suggest_memory_format(t) == torch.channels_last
        assert _suggests_channels_last(t) == expected, (t.shape, t.stride())


def test_custom_op_and_fake():
    args = _make(1, 2, 1, 2, 128, torch.bfloat16, seed=2)
    ordered = [args[n] for n in ("q", "k", "q_weight", "k_weight", "cos", "sin", "eps",
                                 "q_txt", "k_txt", "q_txt_weight", "k_txt_weight")] + [True]
    torch.library.opcheck(
        torch.ops.ditfuse.qk_rmsnorm_rope.default, ordered,
        test_utils=("test_schema", "test_faketensor"),
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in ordered]
        q, k = torch.ops.ditfuse.qk_rmsnorm_rope(*fake)
    assert q.shape == (1, 3, 2, 128) and k.dtype == torch.bfloat16


def test_close_variant_skips_the_rounding_before_rope():
    args = _make(2, 5, 3, 2, 64, torch.bfloat16, seed=11)
    exact = qk_rmsnorm_rope(**args)
    close = qk_rmsnorm_rope_fp32(**args)
    ref64 = __import__("ditfuse.kernels.exact", fromlist=["x"]).qk_rmsnorm_rope_fp64(**args)
    for c, e, r in zip(close, exact, ref64):
        assert not torch.equal(c.view(torch.int16), e.view(torch.int16))
        # one rounding instead of two: at least as close to the fp64 math
        assert (c.double() - r).pow(2).mean() <= (e.double() - r).pow(2).mean() * 1.05
