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


def interpreter_on() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on the CPU with numpy (the CPU tests)."""
    return env("TRITON_INTERPRET", "0") not in ("", "0")


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
