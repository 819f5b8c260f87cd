"""modulate.bias_residual under TRITON_INTERPRET=1, bitwise against its reference (which is eager's
two adds), on channels-last 5-D/4-D and [N, C] tensors with awkward sizes, NaN/Inf and -0."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.modulate import bias_residual_triton as br

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("shape", [(1, 96, 2, 3, 5), (2, 7, 1, 4, 3), (3, 13, 5, 7), (5, 17)],
                         ids=["5d", "5d-b2-odd", "4d-prime", "2d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_eager_adds(shape, dtype):
    fmt = {5: torch.channels_last_3d, 4: torch.channels_last}.get(len(shape), torch.contiguous_format)
    x = _rand(shape, dtype, 1)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 65000.0]).to(dtype)
    x = x.contiguous(memory_format=fmt)
    h = _rand(shape, dtype, 2).contiguous(memory_format=fmt)
    b = _rand((shape[1],), dtype, 3)
    assert br.can_use_bias_residual(x, b, h)
    got = br.bias_residual(x, b, h)
    assert got.stride() == x.stride()
    mm = compare_outputs(got, ref.bias_residual(x, b, h), f"{shape} {dtype}")
    assert mm is None, str(mm)


def test_rejections():
    x = _rand((1, 8, 2, 3, 4), torch.bfloat16, 4).contiguous(memory_format=torch.channels_last_3d)
    b = _rand((8,), torch.bfloat16, 5)
    assert br.can_use_bias_residual(x, b, x)
    assert br.can_use_bias_residual(x.contiguous(), b, x.contiguous())  # NCDHW both: the NCHW walk
    for args in ((x.contiguous(), b, x),  # x NCDHW, h channels-last
                 (x, b, x.contiguous()),  # h in another layout
                 (x[:, :, :, ::2], b, x[:, :, :, ::2]),  # neither dense
                 (x, b.float(), x),  # dtype mix: eager would promote
                 (x, b[:4], x)):
        assert not br.can_use_bias_residual(*args)


@pytest.mark.parametrize("shape", [(1, 8, 5, 7), (2, 13, 3, 1), (2, 3, 1, 1), (2, 5, 2, 3, 4), (3, 7, 11)],
                         ids=["4d", "4d-b2-prime-w1", "1x1", "5d", "3d"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_nchw_walk_matches_eager_adds(shape, dtype):
    """Contiguous NC... tensors (AutoencoderKL's NCHW decode): the channel of flat index i is
    ``(i // HW) % C``; NaN / Inf / -0 go through eager's two adds."""
    x = _rand(shape, dtype, 6)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("-inf"), -0.0, 65000.0]).to(dtype)
    h = _rand(shape, dtype, 7)
    b = _rand((shape[1],), dtype, 8)
    assert br.can_use_bias_residual(x, b, h)
    got = br.bias_residual(x, b, h)
    assert got.is_contiguous()
    mm = compare_outputs(got, ref.bias_residual(x, b, h), f"NCHW {shape} {dtype}")
    assert mm is None, str(mm)


@pytest.mark.parametrize("case", [dict(k=3, stride=1, padding=1, cin=6, cout=6, hw=(9, 7)),
                                  dict(k=3, stride=1, padding=1, cin=8, cout=4, hw=(5, 5), batch=2),
                                  dict(k=1, stride=1, padding=0, cin=5, cout=5, hw=(1, 13))],
                         ids=["3x3", "3x3-b2-narrowing", "1x1"])
def test_conv_bias_residual_is_its_composition(case):
    """On the CPU the op is checked against its own definition, ``bias_residual(conv2d(x, w,
    bias=None), bias, h)`` (aten's CPU convolutions add the bias inside the convolution, so CPU
    eager ``h + conv2d(x, w, b)`` is not the chain it reproduces; the CUDA comparison with eager is
    tests/gpu/test_vae_gpu.py's and the gate's)."""
    dtype = torch.bfloat16
    x = _rand((case.get("batch", 1), case["cin"], *case["hw"]), dtype, 9)
    w = _rand((case["cout"], case["cin"], case["k"], case["k"]), dtype, 10) * 0.1
    b = _rand((case["cout"],), dtype, 11)
    y = torch.nn.functional.conv2d(x, w, None, case["stride"], case["padding"])
    h = _rand(tuple(y.shape), dtype, 12)
    args = (x, w, b, h, (case["stride"],) * 2, (case["padding"],) * 2, (1, 1), 1)
    assert br.can_use_conv_bias_residual(*args)
    got = br.conv_bias_residual(*args)
    mm = compare_outputs(got, ref.bias_residual(y, b, h), f"conv_bias_residual {case}")
    assert mm is None, str(mm)


def test_conv_bias_residual_channels_last():
    """quality="high" decodes AutoencoderKL channels-last: x and h channels-last, the output too."""
    dtype = torch.bfloat16
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    x = cl(_rand((2, 8, 7, 5), dtype, 23))
    w = _rand((8, 8, 3, 3), dtype, 24) * 0.1
    b = _rand((8,), dtype, 25)
    y = torch.nn.functional.conv2d(x, w, None, 1, 1)
    h = cl(_rand(tuple(y.shape), dtype, 26))
    args = (x, w, b, h, (1, 1), (1, 1), (1, 1), 1)
    assert br.can_use_conv_bias_residual(*args)
    got = br.conv_bias_residual(*args)
    assert got.stride() == h.stride()
    mm = compare_outputs(got, ref.bias_residual(y, b, h), "conv_bias_residual channels-last")
    assert mm is None, str(mm)


@pytest.mark.parametrize("x_cl,h_cl", [(False, True), (True, False)], ids=["x-nchw-h-cl", "x-cl-h-nchw"])
@pytest.mark.parametrize("shape", [(1, 8, 7, 5), (2, 70, 3, 67), (1, 3, 1, 1)], ids=["8ch", "70ch-b2", "1x1"])
def test_conv_bias_residual_mixed_layouts(shape, x_cl, h_cl):
    """In the NCHW decode the residual stream is channels-last after the mid-block attention (its
    output is a channels-last view) while conv2 reads the GroupNorm's NCHW output: eager's ``h + y``
    takes h's layout; the op's tiled pass does too (values and strides), NaN/Inf/-0 included."""
    dtype = torch.bfloat16
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    x = _rand(shape, dtype, 27)
    w = _rand((shape[1], shape[1], 3, 3), dtype, 28) * 0.1
    b = _rand((shape[1],), dtype, 29)
    h = _rand(shape, dtype, 30)
    h.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    x, h = (cl(x) if x_cl else x), (cl(h) if h_cl else h)
    args = (x, w, b, h, (1, 1), (1, 1), (1, 1), 1)
    assert br.can_use_conv_bias_residual(*args)
    got = br.conv_bias_residual(*args)
    y = torch.nn.functional.conv2d(x, w, None, 1, 1)
    exp = h + y.add_(b.reshape(1, -1, 1, 1))
    assert got.stride() == exp.stride(), (got.stride(), exp.stride())
    mm = compare_outputs(got, exp, f"conv_bias_residual mixed {shape} x_cl={x_cl}")
    assert mm is None, str(mm)
    # (opcheck compares with assert_close, for which NaN != NaN: finite values there)
    torch.library.opcheck(torch.ops.ditfuse.bias_residual_mixed, (y, b, torch.nan_to_num(h, 0.0, 0.0, 0.0)))


def test_conv_bias_residual_rejections():
    x = _rand((1, 4, 6, 6), torch.bfloat16, 13)
    w = _rand((4, 4, 3, 3), torch.bfloat16, 14)
    b = _rand((4,), torch.bfloat16, 15)
    h = _rand((1, 4, 6, 6), torch.bfloat16, 16)
    geo = ((1, 1), (1, 1), (1, 1), 1)
    assert br.can_use_conv_bias_residual(x, w, b, h, *geo)
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    assert br.can_use_conv_bias_residual(cl(x), w, b, cl(h), *geo)  # quality="high"'s channels-last decode
    assert br.can_use_conv_bias_residual(x, w, b, cl(h), *geo)  # mixed: the NCHW decode after its attention
    for bad in ((x[..., :5], w, b, h[..., :5]),  # strided (neither layout)
                (x, w, b, h[..., :5]),
                (x, w, b.float(), h),  # dtype mix
                (x[0], w, b, h),  # 3-D input
                (x, w, b[:2], h)):  # bias not [out_channels]
        assert not br.can_use_conv_bias_residual(*bad, *geo)
    with pytest.raises(UnsupportedInput, match="shape"):  # padding 0: a 4x4 output against a 6x6 h
        br.conv_bias_residual(x, w, b, h, (1, 1), (0, 0), (1, 1), 1)


@pytest.mark.parametrize("case", [dict(k=3, s=1, p=1, cin=6, cout=5, hw=(9, 7)),
                                  dict(k=3, s=2, p=0, cin=4, cout=4, hw=(11, 8), batch=2),
                                  dict(k=1, s=1, p=0, cin=5, cout=3, hw=(1, 13))],
                         ids=["3x3", "3x3-stride2-b2", "1x1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_conv_bias_is_its_composition(case, dtype):
    """modulate.conv_bias on the CPU against its definition, ``conv2d(x, w, bias=None)`` then
    eager's broadcast ``add_(bias.reshape(1, C, 1, 1))`` (CPU eager ``conv2d(x, w, b)`` adds the
    bias inside the convolution, so it is not the chain; the CUDA comparison is the GPU test's)."""
    x = _rand((case.get("batch", 1), case["cin"], *case["hw"]), dtype, 17)
    w = _rand((case["cout"], case["cin"], case["k"], case["k"]), dtype, 18) * 0.1
    b = _rand((case["cout"],), dtype, 19)
    b[0] = float("inf")
    geo = ((case["s"],) * 2, (case["p"],) * 2, (1, 1), 1)
    assert br.can_use_conv_bias(x, w, b, *geo)
    got = br.conv_bias(x, w, b, *geo)
    y = torch.nn.functional.conv2d(x, w, None, *geo)
    mm = compare_outputs(got, y.add_(b.reshape(1, -1, 1, 1)), f"conv_bias {case} {dtype}")
    assert mm is None, str(mm)
    # channels-last (quality="high"'s decode): cuDNN's output follows the input, so does the bias pass
    xc = x.contiguous(memory_format=torch.channels_last)
    assert br.can_use_conv_bias(xc, w, b, *geo)
    got = br.conv_bias(xc, w, b, *geo)
    y = torch.nn.functional.conv2d(xc, w, None, *geo)
    assert got.stride() == y.stride()
    mm = compare_outputs(got, y.add_(b.reshape(1, -1, 1, 1)), f"conv_bias channels-last {case} {dtype}")
    assert mm is None, str(mm)
    assert not br.can_use_conv_bias(x[..., :-1], w, b, *geo)  # strided: neither layout
    assert not br.can_use_conv_bias(x, w, b.float() if dtype != torch.float32 else b.half(), *geo)


def test_bias_add_custom_op_for_torch_compile():
    """Under torch.compile tracing conv_bias's bias pass is the custom op ditfuse::bias_add_nchw
    (functional): same bits as the in-place launch, and torch.library.opcheck passes."""
    x = _rand((2, 4, 6, 5), torch.bfloat16, 20)
    w = _rand((3, 4, 3, 3), torch.bfloat16, 21) * 0.1
    b = _rand((3,), torch.bfloat16, 22)
    y = torch.nn.functional.conv2d(x, w, None, 1, 1)
    out = torch.ops.ditfuse.bias_add_nchw(y, b)
    assert out.data_ptr() != y.data_ptr()
    mm = compare_outputs(out, y.clone().add_(b.reshape(1, -1, 1, 1)), "bias_add_nchw")
    assert mm is None, str(mm)
    torch.library.opcheck(torch.ops.ditfuse.bias_add_nchw, (y, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_channels_last_conv_ops_are_their_composition(dtype):
    """modulate.conv_bias_cl / conv_bias_residual_cl on the CPU: the same composition as their NCHW
    siblings (conv2d without bias on the channels-last x, then the bias / bias + residual pass);
    output channels-last / in h's layout. Their reference is the NCHW convolution; that cuDNN's
    NHWC kernel matches it is the GPU test's and the gate's."""
    cl = lambda t: t.contiguous(memory_format=torch.channels_last)  # noqa: E731
    x = cl(_rand((2, 32, 9, 7), dtype, 31))
    w = _rand((5, 32, 3, 3), dtype, 32) * 0.1
    b = _rand((5,), dtype, 33)
    geo = ((1, 1), (1, 1), (1, 1), 1)
    assert br.can_use_conv_bias_cl(x, w, b, *geo)
    got = br.conv_bias_cl(x, w, b, *geo)
    y = torch.nn.functional.conv2d(x, w, None, 1, 1)
    assert got.is_contiguous()  # the bias pass writes NCHW: eager's layout, norm2's statistics' input
    assert compare_outputs(got, y.clone().add_(b.reshape(1, -1, 1, 1)), "conv_bias_cl") is None
    got = br.conv_bias_cl(x.contiguous(), w, b, *geo)  # NCHW x (the norm ran its reference): served too
    assert got.is_contiguous() and compare_outputs(got, y.clone().add_(b.reshape(1, -1, 1, 1)), "NCHW x") is None
    torch.library.opcheck(torch.ops.ditfuse.bias_add_to_nchw, (y, b))
    for h in (_rand(tuple(y.shape), dtype, 34), cl(_rand(tuple(y.shape), dtype, 35))):
        assert br.can_use_conv_bias_residual_cl(x, w, b, h, *geo)
        got = br.conv_bias_residual_cl(x, w, b, h, *geo)
        exp = h + y.clone().add_(b.reshape(1, -1, 1, 1))
        assert got.stride() == exp.stride() == h.stride()
        assert compare_outputs(got, exp, "conv_bias_residual_cl") is None
    # refused: fp32 (cuDNN's NHWC fp32 kernels accumulate differently), groups, strided x
    assert not br.can_use_conv_bias_cl(x.float(), w.float(), b.float(), *geo)
    assert not br.can_use_conv_bias_cl(x[..., :-1], w, b, *geo)
    wg = _rand((6, 16, 3, 3), dtype, 37)
    assert not br.can_use_conv_bias_cl(x, wg, _rand((6,), dtype, 38), (1, 1), (1, 1), (1, 1), 2)
    # fewer than 32 input channels (br.CL_MIN_IN_CHANNELS): cuDNN's NCHW path may run another kernel
    x16, w16 = cl(_rand((1, 16, 9, 7), dtype, 39)), _rand((16, 16, 3, 3), dtype, 40)
    assert not br.can_use_conv_bias_cl(x16, w16, _rand((16,), dtype, 41), *geo)
    assert not br.can_use_conv_bias_residual_cl(x16, w16, _rand((16,), dtype, 41), cl(_rand((1, 16, 9, 7), dtype, 42)), *geo)
    with pytest.raises(UnsupportedInput, match="input channels"):
        br.conv_bias_cl(x16, w16, _rand((16,), dtype, 41), *geo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 24, 3, 5, 7), (1, 96, 2, 4, 6), (1, 3, 1, 2, 2), (2, 40, 9, 11)],
                         ids=["5d-b2", "5d-96", "3-channels", "4d"])
def test_bias_add_inplace_channels_last_matches_aten_add(shape, dtype):
    """The bias pass layout.conv_channels_last now runs after its unbiased cuDNN call: on a
    channels-last(-3d) convolution output, bitwise aten's ``add_(bias.reshape(1, C, 1, ...))``
    (the add aten's ``_convolution`` makes), with NaN, +-Inf, -0 and a -0 bias; in place."""
    g = torch.Generator().manual_seed(11)
    fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
    y = (torch.randn(shape, generator=g) * 3).to(dtype).contiguous(memory_format=fmt)
    y[0, 0, 0, 0] = float("nan")
    y[-1, 1, -1, -1] = float("inf")
    y[0, -1, 0, -1] = -0.0
    b = (torch.randn(shape[1], generator=g) * 0.5).to(dtype)
    b[-1] = -0.0
    exp = y.clone().add_(b.reshape(1, -1, *([1] * (len(shape) - 2))))
    ptr = y.data_ptr()
    got = br.bias_add_inplace(y, b)
    assert got.data_ptr() == ptr and got.stride() == exp.stride()
    mm = compare_outputs(got, exp, f"bias_add_inplace {shape} {dtype}")
    assert mm is None, str(mm)
