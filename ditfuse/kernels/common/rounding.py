"""Rounding helpers that mirror eager PyTorch's stores.

Eager PyTorch rounds fp32 -> bf16 round-to-nearest-even (``c10::BFloat16`` / ``cvt.rn.bf16.f32``)
every time an op stores. On the GPU ``x.to(tl.bfloat16)`` compiles to the same ``cvt.rn``.
Triton 3.6's interpreter (``TRITON_INTERPRET=1``, used by the CPU tests) does *not* round to
nearest-even (about half of random values differ), so under the interpreter
:func:`round_to_bf16` rounds explicitly with integer arithmetic: add ``0x7FFF + lsb`` to the
fp32 bit pattern, keep the high 16 bits and reinterpret them as bf16 (NaN is quieted the way
c10::BFloat16 does it).
"""

import os

import triton
import triton.language as tl

INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@triton.jit
def _rne_bf16_as_f32(x):
    """fp32 -> nearest-even bf16 value, kept in fp32 bits (exact: the low 16 bits are zero)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) & 0xFFFF0000
    # NaN: keep sign and quiet the payload the way c10::BFloat16 does (0x7FC0 pattern).
    is_nan = x != x
    rounded = tl.where(is_nan, (bits & 0x80000000) | 0x7FC00000, rounded)
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _rne_bf16_bits(x):
    # Reinterpret the top half instead of converting: the interpreter's conversion also
    # flushes bf16 subnormals to zero.
    rounded = _rne_bf16_as_f32(x).to(tl.uint32, bitcast=True)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round-to-nearest-even, on the GPU and under the interpreter alike."""
    if INTERPRET:
        return _rne_bf16_bits(x)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 -> ``dtype`` (bf16, fp16 or fp32) with eager's round-to-nearest-even store."""
    if dtype == tl.bfloat16:
        return round_to_bf16(x)
    else:
        return x.to(dtype)


@triton.jit
def rround(x, dtype: tl.constexpr):
    """Round an fp32 value to ``dtype`` and back to fp32: the value an eager op would store and
    the next eager op would load. Identity for fp32. Under the interpreter a bf16 result stays in
    fp32 bits (its bf16 -> fp32 conversion would flush subnormals)."""
    if dtype == tl.float32:
        return x
    elif INTERPRET and dtype == tl.bfloat16:
        return _rne_bf16_as_f32(x)
    else:
        return round_to(x, dtype).to(tl.float32)
