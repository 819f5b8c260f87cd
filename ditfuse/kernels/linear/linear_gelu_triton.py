"""A bf16 GEMM with the tanh-GELU in its epilogue: ``F.gelu(F.linear(x, weight, bias),
approximate="tanh")`` in one kernel, optionally written into a strided slice of a buffer (the FLUX
single block's ``cat([attn, gelu(proj_mlp(n))], dim=2)``).

Eager runs two kernels: cuBLAS's GEMM, whose epilogue adds the bias to the fp32 accumulator and
rounds once to bf16 (``out = r16(acc + bias)``), then ATen's tanh-GELU, which reads that bf16
value, computes in fp32 and rounds once more. Between the two, the ``[M, N]`` pre-activation makes
a round trip through memory: at FLUX.1's shapes 4-5 ms of a 1024² step (issue 13).

This kernel keeps the two roundings where eager has them: ``y = r16(gelu32(r16(acc + bias)))``
with the GELU being :func:`ditfuse.kernels.activation.gelu_tanh_triton._gelu_f32`, bit for bit
ATen's. What makes it *equal* to eager is the accumulator: for bf16 on sm_90 both cuBLAS and this
kernel build each output element as one chain of tensor-core MMAs over K, from k = 0 upwards, into
one fp32 accumulator (the products are exact; each MMA adds its 16 products and the accumulator
in the hardware's fixed way). That holds as long as cuBLAS's kernel for the problem does not split
K (split-K, stream-K, or K slices across warp groups) and runs the same MMA instructions: an
observation about cuBLAS's choice per GEMM shape, not a construction. So the op is
``per_signature`` under the bit-exact gate: the first call of each problem (M, N, K, layout) is
compared with the live eager chain, and a mismatch sends that problem to eager for good, with a
log line. bench/probes/probe_gemm_exact.py measures the equality and the speed at FLUX.1's shapes.

Two kernel bodies run the same K chain. On sm_90 (and under the interpreter) a persistent one fed
by TMA descriptors (one program per SM walks the output tiles in grouped order): 0.95-1.01x
cuBLAS's GEMM time at FLUX.1's shapes on the H200 (round 27, bench/results/probe_gemm_exact_round27_a_h200.csv).
Elsewhere (sm_80 / sm_89, or rows TMA cannot address: a base or row stride not 16-byte aligned)
the cp.async one, 0.72-0.87x cuBLAS.

The close variant :func:`linear_gelu_tanh_fast` (quality="high") is the TMA kernel with one
rounding: ``y = r16(gelu32(acc + bias))``, the GELU of the unrounded fp32 pre-activation with the
hardware ``tanh.approx.f32``. On the H200 it ran at 1.05-1.13x eager's GEMM + GELU at the FLUX.1
image-stream shapes (M >= 4096) with 0.64x eager's RMS and 0.95-0.97x its max error against fp64
(fewer roundings than eager); at M = 512 (the text stream) 0.96x, so it declines rows below
:data:`FAST_MIN_ROWS`.

Only bf16: fp32 F.linear does not use bf16 tensor-core MMAs, and fp16 GEMMs may reduce in fp16
(``allow_fp16_reduced_precision_reduction``). Under ``TRITON_INTERPRET=1`` (CPU tests) the MMA is a
numpy fp32 matmul (other summation order), so CPU results agree with eager to an ulp of the
pre-activation; the CPU tests check the epilogue bitwise on inputs whose sums are exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..activation.gelu_tanh_triton import TANH_APPROX, TANH_PTX, _gelu_f32
from ..common.elementwise import overlap_reason
from ..common.host import cdiv, device_reason, grad_reason, sm_count, use_custom_op
from ..common.launch import launch
from ..common.rounding import INTERPRET, round_to, rround
from ..errors import UnsupportedInput

# Tile (BM, BN, BK), programs grouped along M (GROUP_M) so a group's weight tiles stay in L2,
# pipeline stages, warps. bench/probes/probe_gemm_exact.py sweeps the candidates.
_BM, _BN, _BK, _GROUP_M, _STAGES, _WARPS = 128, 256, 64, 8, 3, 8
_INTERPRET_TILE = (32, 32, 32)  # the interpreter runs each program in Python: few, small tiles


@triton.jit
def _grouped_tile(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile ``tile``: tiles walk GROUP_M row blocks per
    column block, so a group's weight tiles stay in L2."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (tile // group) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % group) % gsize, (tile % group) // gsize


@triton.jit
def _epilogue(acc, b_ptr, rn, N, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EXACT: tl.constexpr,
              DTYPE: tl.constexpr, TANH: tl.constexpr):
    """fp32 accumulator -> the value both bodies store (before the store's rounding): + bias, then
    the GELU (``EXACT``: of the rounded pre-activation, as eager reads it back)."""
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GELU:
        if EXACT:
            acc = rround(acc, DTYPE)  # the GEMM's store rounds; the GELU reads that value back
        acc = _gelu_f32(acc, True, TANH)
    return acc


@triton.jit
def _linear_gelu_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N,
    sxm, swn, som,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    EXACT: tl.constexpr,
    DTYPE: tl.constexpr,
    TANH: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    I64: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if I64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
    a_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
    b_ptrs = w_ptr + rn[None, :] * swn + rk[:, None]  # weight is [N, K]: B = weight^T, K-major
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # k = 0 upwards into one accumulator: cuBLAS's chain (module docstring)
    for k in range(0, K, BK):
        kmask = rk + k < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(rn[None, :] < N) & kmask[:, None], other=0.0)
        if INTERPRET:  # the interpreter's bf16 dot multiplies raw bits (Triton 3.6)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    acc = _epilogue(acc, b_ptr, rn, N, HAS_BIAS, GELU, EXACT, DTYPE, TANH)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None] * som + rn[None, :], round_to(acc, DTYPE), mask=mask)


@triton.jit
def _tma_tile(
    a_desc, b_desc, b_ptr, c_desc, tile, M, N,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EXACT: tl.constexpr,
    DTYPE: tl.constexpr, TANH: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Output tile ``tile`` of the TMA kernel (grouped order, as :func:`_linear_gelu_kernel`)."""
    pid_m, pid_n = _grouped_tile(tile, M, N, BM, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # k = 0 upwards into one accumulator (cuBLAS's chain); rows past M and columns past K load
    # as zeros (the descriptor's padding), adding exact zeros
    for ki in range((K + BK - 1) // BK):
        a = a_desc.load([pid_m * BM, ki * BK])
        b = b_desc.load([pid_n * BN, ki * BK])
        if INTERPRET:  # the interpreter's bf16 dot multiplies raw bits (Triton 3.6)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc)
    acc = _epilogue(acc, b_ptr, pid_n * BN + tl.arange(0, BN), N, HAS_BIAS, GELU, EXACT, DTYPE, TANH)
    # the descriptor's shape is the output's [M, N]: a tile's store is clipped there (columns
    # past N of a buffer slice are never written)
    c_desc.store([pid_m * BM, pid_n * BN], round_to(acc, DTYPE))


@triton.jit
def _linear_gelu_tma_kernel(
    a_desc, b_desc, b_ptr, c_desc,
    M, N,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, EXACT: tl.constexpr,
    DTYPE: tl.constexpr, TANH: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    """Persistent on the GPU: program p computes tiles p, p + PROGRAMS, ... (``flatten``: the
    next tile's loads are issued while this tile's epilogue runs). The interpreter cannot run a
    persistent loop over a program id (Triton 3.6), so there each program computes one tile."""
    if INTERPRET:
        _tma_tile(a_desc, b_desc, b_ptr, c_desc, tl.program_id(0), M, N, K, HAS_BIAS, GELU, EXACT, DTYPE, TANH,
                  BM, BN, BK, GROUP_M)
    else:
        for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), PROGRAMS, flatten=True):
            _tma_tile(a_desc, b_desc, b_ptr, c_desc, tile, M, N, K, HAS_BIAS, GELU, EXACT, DTYPE, TANH,
                      BM, BN, BK, GROUP_M)


def _rows(t: torch.Tensor) -> int | None:
    """The uniform row stride of ``t``'s leading dims seen as one dim of rows (last dim
    contiguous), or None when they cannot be: ``buf[:, :, D:]`` of a contiguous ``[B, S, Dt]``
    buffer has rows every ``Dt`` elements."""
    if t.dim() < 2 or t.stride(-1) != 1:
        return None
    row = t.stride(-2)
    expect = row * t.shape[-2]
    for d in range(t.dim() - 3, -1, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return None
        expect *= t.shape[d]
    return row


def _unsupported_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        out: torch.Tensor | None = None) -> str | None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return "x and weight must be tensors"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return "bias must be a tensor or None"
    if out is not None and not isinstance(out, torch.Tensor):
        return "out must be a tensor or None"
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype}: bf16 only (fp32 GEMMs run other math, fp16 ones may reduce in fp16)"
    tensors = [t for t in (x, weight, bias, out) if t is not None]
    if any(t.dtype != x.dtype for t in tensors):
        return "weight, bias and out must have x's dtype (F.linear would promote or reject)"
    if x.dim() < 2:
        return f"x {tuple(x.shape)}: at least [M, K]"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or not weight.is_contiguous():
        return f"weight {tuple(weight.shape)} is not a contiguous [N, K] with K = {x.shape[-1]}"
    N = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N or not bias.is_contiguous()):
        return f"bias {tuple(bias.shape)} is not a contiguous [{N}]"
    if not x.is_contiguous():
        return "x is not contiguous (F.linear would copy it first or take another GEMM path)"
    if out is not None:
        if tuple(out.shape) != (*x.shape[:-1], N):
            return f"out {tuple(out.shape)} is not {(*x.shape[:-1], N)}"
        if _rows(out) is None:
            return "out's leading dims are not evenly strided rows with a contiguous last dim"
        overlap = overlap_reason(out, *(t for t in (x, weight, bias) if t is not None))
        if overlap:  # (skipped while torch.compile traces: no addresses there)
            return overlap
    if x.numel() == 0 or N == 0:
        return "an empty problem"
    if x.shape[-1] % 8:
        return f"K = {x.shape[-1]} is not a multiple of 8 (cuBLAS pads such rows: another kernel)"
    reason = device_reason(*tensors) or grad_reason(*tensors)
    if reason:
        return reason
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is on (eager would run another chain)"
    return None


def can_use_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                             out: torch.Tensor | None = None) -> bool:
    """True when :func:`linear_gelu_tanh` takes these arguments. Rejected (False): non-tensors;
    a dtype other than bf16 in any of them; x not at least 2-D or not contiguous; weight not a
    contiguous ``[N, K]`` matching x's last dim, K not a multiple of 8; a bias not a contiguous
    ``[N]``; ``out`` not of shape ``x.shape[:-1] + (N,)``, not evenly strided rows with a
    contiguous last dim, or overlapping x; an empty problem; tensors on different devices or on
    the CPU without TRITON_INTERPRET=1; grad required with grad mode on; autocast on. (Whether
    cuBLAS's bits are met for a problem is the gate's first-sight check.)"""
    return _unsupported_reason(x, weight, bias, out) is None


_TMA_TILE = (128, 256, 64, 8, 3, 8)  # the H200 sweep's fastest at every FLUX.1 shape (round 27)
# Below this many rows the close kernel ran slower than eager's GEMM + GELU (M = 512: 0.96x on the
# H200, the text stream's FeedForward), so it declines them and eager runs.
FAST_MIN_ROWS = 1024
def _tma_reason(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> str | None:
    """None when the TMA kernel can address these tensors: sm_90 (or the interpreter), every base
    16-byte aligned, out's row stride a multiple of 8 elements (x and weight are contiguous with
    K a multiple of 8 by the shared rules)."""
    if torch.compiler.is_compiling():
        return None  # no addresses while tracing: the custom op picks the body when it runs
    if not INTERPRET:
        major, _ = torch.cuda.get_device_capability(x.device)
        if major != 9:
            return f"sm_{major}x: the TMA kernel is built for sm_90"
    for name, t in (("x", x), ("weight", weight), ("out", out)):
        if t is not None and t.data_ptr() % 16:
            return f"{name}'s address is not 16-byte aligned (TMA)"
    if out is not None and _rows(out) % 8:
        return f"out's row stride {_rows(out)} is not a multiple of 8 elements (TMA)"
    return None


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            *, gelu: bool = True, exact: bool = True, tile: tuple[int, ...] | None = None,
            kernel: str | None = None) -> None:
    """Launch (no checks). ``gelu=False`` stores ``r16(acc + bias)`` alone (F.linear's bits: the
    probe's accumulator check); ``exact=False`` is the close epilogue (one rounding, tanh.approx);
    ``tile`` = (BM, BN, BK, GROUP_M, stages, warps) for the probe's sweep, None for the production
    tile; ``kernel`` "tma" / "plain" forces a body (tests, probe), None picks TMA where it can."""
    K = x.shape[-1]
    N = weight.shape[0]
    M = x.numel() // K
    som = _rows(out)
    if kernel is None:
        kernel = "tma" if _tma_reason(x, weight, out) is None else "plain"
    tanh = TANH_PTX if exact else TANH_APPROX
    if kernel == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        bm, bn, bk, group_m, stages, warps = tile or ((*_INTERPRET_TILE, 8, 1, 4) if INTERPRET else _TMA_TILE)
        tiles = cdiv(M, bm) * cdiv(N, bn)
        programs = tiles if INTERPRET else min(tiles, sm_count(x.device))
        launch(_linear_gelu_tma_kernel, (programs,),
               TensorDescriptor(x, [M, K], [K, 1], [bm, bk]),
               TensorDescriptor(weight, [N, K], [K, 1], [bn, bk]),
               weight if bias is None else bias,
               TensorDescriptor(out, [M, N], [som, 1], [bm, bn]),
               M, N,
               K=K, HAS_BIAS=bias is not None, GELU=gelu, EXACT=exact, DTYPE=tl.bfloat16, TANH=tanh,
               BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PROGRAMS=programs,
               num_stages=stages, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False)
        return
    bm, bn, bk, group_m, stages, warps = tile or (*(_INTERPRET_TILE if INTERPRET else (_BM, _BN, _BK)),
                                                  _GROUP_M, _STAGES, _WARPS)
    i64 = max(M * K, M * som, N * K) >= 2 ** 31
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    launch(_linear_gelu_kernel, grid,
           x, weight, weight if bias is None else bias, out,
           M, N,
           K, weight.stride(0), som,
           K=K, HAS_BIAS=bias is not None, GELU=gelu, EXACT=exact, DTYPE=tl.bfloat16, TANH=tanh,
           BM=bm, BN=bn, BK=bk, GROUP_M=group_m, I64=i64,
           num_stages=stages, num_warps=warps, enable_fp_fusion=False, enable_reflect_ftz=False)


@torch.library.custom_op("ditfuse::linear_gelu_tanh", mutates_args=("out",))
def _linear_gelu_tanh_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         out: torch.Tensor) -> None:
    _launch(x, weight, bias, out)


@_linear_gelu_tanh_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    return None


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r16(gelu_tanh(r16(x @ weight^T + bias)))``: bitwise equal to torch 2.11 CUDA
    ``F.gelu(F.linear(x, weight, bias), approximate="tanh")`` wherever cuBLAS's kernel for the
    problem chains K as this one does (module docstring; the gate checks each problem at first
    sight).

    x: ``[..., K]`` contiguous bf16; weight: ``[N, K]`` (an ``nn.Linear``'s); bias: ``[N]`` or
    None. ``out``: None (a new contiguous ``[..., N]`` is returned) or a same-shape bf16 tensor
    whose rows are evenly strided, e.g. ``buf[:, :, D:]`` of the FLUX single block's
    ``[B, S, D + 4D]`` proj_out input: written in place and returned. Runs as the custom op
    ``ditfuse::linear_gelu_tanh`` under torch.compile. Raises :class:`UnsupportedInput` exactly
    where :func:`can_use_linear_gelu_tanh` is False."""
    return _run(_unsupported_reason(x, weight, bias, out), x, weight, bias, out, exact=True)


def _run(reason: str | None, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out: torch.Tensor | None, exact: bool) -> torch.Tensor:
    """Both ops' calls: raise on ``reason``, allocate ``out`` if None, launch (through the custom
    op when torch.compile may trace the call)."""
    if reason is not None:
        raise UnsupportedInput(reason)
    if out is None:
        out = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
    if use_custom_op():
        (torch.ops.ditfuse.linear_gelu_tanh if exact else torch.ops.ditfuse.linear_gelu_tanh_fast)(x, weight, bias, out)
    else:
        _launch(x, weight, bias, out, exact=exact)
    return out


def _fast_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> str | None:
    reason = _unsupported_reason(x, weight, bias, out)
    if reason is not None:
        return reason
    rows = x.numel() // x.shape[-1]
    if rows < FAST_MIN_ROWS:
        return f"{rows} rows < {FAST_MIN_ROWS}: eager's GEMM + GELU is faster there"
    return _tma_reason(x, weight, out)


def can_use_linear_gelu_tanh_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                  out: torch.Tensor | None = None) -> bool:
    """True when :func:`linear_gelu_tanh_fast` takes these arguments: everything
    :func:`can_use_linear_gelu_tanh` takes, with at least :data:`FAST_MIN_ROWS` rows, on sm_90
    (or the interpreter), every base 16-byte aligned and out's row stride a multiple of 8."""
    return _fast_reason(x, weight, bias, out) is None


@torch.library.custom_op("ditfuse::linear_gelu_tanh_fast", mutates_args=("out",))
def _linear_gelu_tanh_fast_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              out: torch.Tensor) -> None:
    _launch(x, weight, bias, out, exact=False)


@_linear_gelu_tanh_fast_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    return None


def linear_gelu_tanh_fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r16(gelu_tanh32(x @ weight^T + bias))``: the close variant of
    :func:`linear_gelu_tanh` (quality="high"). The GELU reads the unrounded fp32 pre-activation and
    uses ``tanh.approx.f32``; one rounding at the store instead of eager's two. Not eager's bits;
    admitted by the fp64 test (contracts/admission.py): against fp64 it is more accurate than
    eager (H200, round 27: admission on FLUX.1-dev activations rms 0.61x, max 0.48x eager's
    error; the probe's random inputs 0.64x and 0.95-0.97x).

    Arguments as :func:`linear_gelu_tanh`. Raises :class:`UnsupportedInput` where
    :func:`can_use_linear_gelu_tanh_fast` is False (the close op then runs eager's chain): off
    sm_90 always, in eager. While torch.compile traces, device addresses and hence TMA's
    alignment are unknown, so the traced custom op picks the body when it runs: the TMA one on
    sm_90 when it can address the tensors, else the cp.async body with the same close epilogue
    (on other GPUs too; not timed)."""
    return _run(_fast_reason(x, weight, bias, out), x, weight, bias, out, exact=False)
