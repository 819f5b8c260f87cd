"""Host-side helpers shared by every kernel module: interpreter detection, dtype maps, device and
grad checks, torch's type promotion. One place for what each kernel's predicate asks."""

from __future__ import annotations

import torch
import triton.language as tl

from ..env import env

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TL_DTYPE[dtype]


# Host-side launch arithmetic. In Triton 3.6 ``triton.cdiv`` and ``triton.next_power_of_2`` are
# constexpr_function objects: about 2 us per call from Python (argument unwrapping), against
# 0.05 us for the same integer arithmetic here, and a fused op's launch does two to six of them.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0 (``triton.cdiv`` without its call overhead)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0): ``triton.next_power_of_2``'s values."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def interpreter_on() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on the CPU with numpy (the CPU tests)."""
    return env("TRITON_INTERPRET", "0") not in ("", "0")


# The row-norm kernels (LayerNorm + modulate, Wan's RMSNorm + RoPE) hold a row's tiles in
# registers when it has at most this many 4-element vectors per thread (D <= 3072): at 5120 (10
# vectors) the held kernel was 26 % slower than the runtime loop on the H200 (occupancy), at 3072
# and 1536 7-15 % faster (bench/results/probe_held_rows_h200.csv).
MAX_HELD_STEPS = 6


def held_steps(steps: int, unroll: bool = True) -> int:
    """The ``JS`` constexpr of a row-norm kernel with ``steps`` vectors per thread: ``steps`` when
    the row is held in registers, 0 for the runtime loop."""
    return steps if unroll and steps <= MAX_HELD_STEPS else 0


def rows_per_program(M: int, held: int = 0, held_budget: int = 6) -> int:
    """Rows per program of a row-norm kernel over ``M`` rows: 4 when there are enough rows to fill
    the GPU several times over, fewer for short inputs; held rows (``held`` vectors per thread)
    at most ``held_budget`` held vectors per thread, in powers of two. Under the interpreter few,
    wide programs (numpy runs each program in Python). Never changes numerics (rows are
    independent)."""
    if interpreter_on():
        return min(32 if not held else 8, next_pow2(M))
    r = 4 if M >= 2048 else (2 if M >= 512 else 1)
    if held:
        budget = max(1, held_budget // held)
        r = min(r, 1 << (budget.bit_length() - 1))
    return r


# Rows that are whole 128-thread steps (D % 512 == 0) of at most this many steps (D <= 3072) take
# the warp-per-row kernels (one warp runs torch's 128 threads as 4 register sets; the fold needs
# no shared memory and, for the Welford, no runtime reciprocals).
WARP_MAX_STEPS = 6
# LayerNorm rows without a residual add take it up to 10 steps (D = 5120): forced there in round
# 9 (H200, probe_warp_rows, bitwise), FLUX's LN + modulate at [2, 32760, 5120] went from 58.5 to
# 74.0 % of copy bandwidth; the sm_90 code holds the row without spills (201 registers with bf16
# modulation, 254 with Wan's fp32 one; tests/cpu/test_layernorm_codegen.py). Rows with a residual
# keep WARP_MAX_STEPS (the gated kernel needs 255 registers there and lost at 3072 already).
LN_WARP_MAX_STEPS = 10


def warp_path(nvec: int, max_steps: int = WARP_MAX_STEPS) -> bool:
    """Whether a row of ``nvec`` 4-element vectors takes a warp-per-row kernel: whole 128-thread
    steps (every thread holds the same number of elements), at most ``max_steps`` of them (held
    in registers)."""
    return nvec > 0 and nvec % 128 == 0 and nvec // 128 <= max_steps


ROW_KERNELS = ("auto", "block", "warp")

# "auto": where the warp-per-row kernels won on the H200 (round 9, commit 8edb7a4,
# bench/results/probe_warp_rows_round9_h200.csv; % of copy bandwidth, 128-thread -> warp):
# D = 1536 (Wan-1.3B): norm1 + modulate 51.8 -> 85.2, gated residual + norm2 85.2 -> 92.4,
# residual + norm3 + modulate 86.8 -> 93.3, RMSNorm + RoPE (q) 65.9 -> 76.1; D = 3072 (FLUX):
# LayerNorm + modulate 52.9 -> 53.2 (a tie) but gated residual + LayerNorm 80.6 -> 69.3 (a loss).
# So: every qualifying row without a residual, and rows with one up to this width.
WARP_AUTO_MAX_RESIDUAL_D = 2048


def row_kernel_mode() -> str:
    """``DITFUSE_ROW_KERNEL``: ``auto`` (default: the measured winner, :data:`WARP_AUTO_MAX_RESIDUAL_D`),
    ``warp`` (every row that qualifies, :func:`warp_path`) or ``block`` (the 128-thread kernels
    always). All three give the same bits; an unknown value is an error."""
    v = env("DITFUSE_ROW_KERNEL", "auto").strip().lower() or "auto"
    if v not in ROW_KERNELS:
        raise ValueError(f"DITFUSE_ROW_KERNEL={v!r}: expected one of {', '.join(ROW_KERNELS)}")
    return v


def warp_rows_enabled(D: int | None = None, residual: bool = False) -> bool:
    """Whether a qualifying row of width ``D`` (with a residual add before the norm or not) takes
    the warp-per-row kernel under :func:`row_kernel_mode` (``D=None``: whether any row can)."""
    mode = row_kernel_mode()
    if mode != "auto":
        return mode == "warp"
    return D is None or not residual or D <= WARP_AUTO_MAX_RESIDUAL_D


def warp_rows_per_program(M: int) -> int:
    """Rows (= warps) per program of a warp-per-row kernel: one on the GPU (with more, Triton
    spreads a warp's lanes over several rows and the shuffles would not be CUDA's; see
    common/warp.py), few wide programs under the interpreter. Never changes numerics."""
    if interpreter_on():
        return min(8, next_pow2(M))
    return 1


def warp_plan(D: int, M: int, warp: bool | None, unroll: bool = True,
              rows_per_program: int | None = None, residual: bool = False,
              max_steps: int = WARP_MAX_STEPS) -> int | None:
    """Whether a row-norm launch over ``M`` rows of width ``D`` takes the warp-per-row kernel, and
    with how many rows per program (None: the 128-thread kernel). ``warp``: True forces it (an
    error unless D % 512 == 0), False refuses it, None decides (:func:`warp_path`, the
    ``DITFUSE_ROW_KERNEL`` switch with ``residual``: whether a residual add precedes the norm,
    ``unroll``). ``rows_per_program`` only tiles the interpreter's programs: on the GPU a program
    is one row in one warp, the layout its shuffles need. ``max_steps``: the most 128-thread steps
    a row may have (:func:`warp_path`)."""
    nvec = D // 4
    if warp is None:
        warp = unroll and warp_path(nvec, max_steps) and warp_rows_enabled(D, residual)
    if not warp:
        return None
    if nvec == 0 or nvec % 128:
        raise ValueError(f"the warp-per-row kernel needs D % 512 == 0 (D={D})")
    if interpreter_on():
        return rows_per_program or warp_rows_per_program(M)
    return warp_rows_per_program(M)


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA ``device`` (cached per device); 4 elsewhere (the
    interpreter: a small stand-in for grids sized by SMs)."""
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def promote(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype an eager op on tensors of these dtypes stores (torch's type promotion)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def device_reason(*tensors: torch.Tensor) -> str | None:
    """Why these tensors cannot be launched on (None when they can): one device, CUDA, or the CPU
    only under ``TRITON_INTERPRET=1``."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            return f"tensors on different devices ({dev} and {t.device})"
    if dev.type == "cuda":
        return None
    if dev.type == "cpu" and interpreter_on():
        return None
    return f"device {dev} is not CUDA (the CPU runs Triton only under TRITON_INTERPRET=1)"


def grad_reason(*tensors: torch.Tensor) -> str | None:
    """The kernels have no backward: reject inputs that would need one."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "an input requires grad and grad mode is on (the kernel has no backward)"
    return None


def use_custom_op() -> bool:
    """Call through the registered ``torch.library`` custom op only while torch.compile traces
    (it must see one opaque node with a fake implementation); eager calls and CUDA-graph capture
    launch directly, which saves the custom-op dispatch (~10 µs a call) on every step."""
    return torch.compiler.is_compiling()


def in_eager_layout(result: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``result``, which a kernel wrote contiguous, in the memory layout eager gives the
    elementwise op whose first operand is ``first`` (same shape): TensorIterator's output takes
    the stride order of its first operand, so ``residual + gate * update`` on a transposed
    residual (the SD3 ControlNet's stream after PatchEmbed's ``flatten(2).transpose(1, 2)``; the
    SD3 transformer makes its stream contiguous) is transposed too.
    The values are the same either way, but what reads them next may round differently in
    another layout (a GEMM picks its kernel by its operands' strides), and the gate compares
    layouts. ``result`` itself when ``first`` is contiguous (no cost); else one copy into
    ``empty_like(first)``."""
    if first.is_contiguous() or first.shape != result.shape:
        return result
    like = torch.empty_like(first, dtype=result.dtype)
    if like.stride() == result.stride():
        return result
    like.copy_(result)
    return like
