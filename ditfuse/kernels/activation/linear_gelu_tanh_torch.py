"""Linear + bias + tanh-GELU with the activation folded into the GEMM epilogue (contract: close).

``linear_gelu_tanh(x, weight, bias)``::

    out = r(gelu_tanh(x @ weight.T + bias))          (one rounding)

instead of eager's ``r(gelu_tanh(r(x @ weight.T + bias)))`` (diffusers ``GELU(approximate="tanh")``:
``proj`` then ``F.gelu``; two roundings and a round trip of the [M, N] pre-activation through
memory). On CUDA it is ``torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)``: torch
2.11's ``addmm_out_cuda_impl`` (aten/src/ATen/native/cuda/Blas.cpp) sends it to cublasLt with the
``GEMMAndBiasActivationEpilogue::GELU`` epilogue (``CUBLASLT_EPILOGUE_GELU_BIAS``; cuBLAS's GELU
epilogue is the tanh approximation) when the bias is a contiguous 1-D tensor of the GEMM dtype,
the output is contiguous and both weight dims are > 1; otherwise the same function runs the GEMM
and then ``gelu_(result, "tanh")``, i.e. exactly eager. The GELU then runs on the fp32
accumulator before the single store. Whether that is as accurate as eager is what the fp64
admission test decides (ditfuse/contracts/admission.py); the kernel is mounted only under
quality="high".

On the CPU ``torch._addmm_activation(use_gelu=True)`` applies the *erf* GELU
(``addmm_activation_out_cpu`` calls ``gelu_`` without ``"tanh"``), which is not this op. The CPU
path (tests only, under TRITON_INTERPRET=1 like the Triton kernels) therefore computes
``addmm`` in fp32 and the tanh-GELU in fp32, rounding once: the same math as the CUDA epilogue.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ditfuse.kernels.errors import UnsupportedInput

_DTYPES = (torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _unsupported_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the fused path does not take these inputs, or None.

    Rejected: non-tensors; a dtype other than bf16/fp16 (the epilogue fusion is the point of a
    16-bit GEMM; fp32 gains nothing); weight not a plain 2-D contiguous [N, K] tensor (quantized
    tensor subclasses, transposed views); no bias or a bias that is not a contiguous [N] tensor
    of the same dtype (cublasLt's bias epilogue needs exactly that); x whose last dim is not K or
    that is empty; tensors on different devices; a device other than CUDA (CPU only under
    TRITON_INTERPRET=1, for tests); an input that requires grad in grad mode (no backward).
    """
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is {'missing' if t is None else type(t).__name__}, not a tensor"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or type(weight.data) is not torch.Tensor:
        return f"weight is a {type(weight.data).__name__} (quantized or wrapped weights are not fused)"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} is not bf16 or fp16"
    if weight.dtype != x.dtype or bias.dtype != x.dtype:
        return f"weight/bias dtypes {weight.dtype}/{bias.dtype} differ from the input dtype {x.dtype}"
    if weight.dim() != 2 or not weight.is_contiguous():
        return f"weight must be a contiguous 2-D [N, K] tensor, got {tuple(weight.shape)} strides {weight.stride()}"
    N, K = weight.shape
    if N < 2 or K < 2:
        return f"weight {tuple(weight.shape)}: cublasLt's bias epilogue needs both dims > 1"
    if bias.dim() != 1 or bias.shape[0] != N or not bias.is_contiguous():
        return f"bias must be a contiguous [{N}] tensor, got {tuple(bias.shape)}"
    if x.dim() < 1 or x.shape[-1] != K:
        return f"x last dim {x.shape[-1] if x.dim() else None} != in_features {K}"
    if x.numel() == 0:
        return "empty input"
    if x.device != weight.device or bias.device != weight.device:
        return "x, weight, bias on different devices"
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _interpreting()):
        return f"device {x.device} is not CUDA (the CPU path exists only under TRITON_INTERPRET=1, for tests)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, bias)):
        return "an input requires grad and grad mode is on (no backward)"
    return None


def _compute(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    K = x.shape[-1]
    x2d = x.reshape(-1, K)
    if x.device.type == "cuda":
        out = torch._addmm_activation(bias, x2d, weight.t(), use_gelu=True)
    else:  # see the module docstring: CPU's _addmm_activation is erf-GELU
        pre = torch.addmm(bias.float(), x2d.float(), weight.float().t())
        out = F.gelu(pre, approximate="tanh").to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("ditfuse::linear_gelu_tanh", mutates_args=())
def _linear_gelu_tanh_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _compute(x, weight, bias)


@_linear_gelu_tanh_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def can_use_linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """True when :func:`linear_gelu_tanh` takes these inputs (see ``_unsupported_reason``)."""
    return _unsupported_reason(x, weight, bias) is None


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out = r(gelu_tanh(x @ weight.T + bias))`` with one rounding (cublasLt GELU-bias epilogue).

    x: [..., K]; weight: [N, K]; bias: [N]; bf16 or fp16, one dtype. Close to eager's
    ``F.gelu(F.linear(x, weight, bias), approximate="tanh")``, not bit-exact. Raises
    :class:`UnsupportedInput` exactly where :func:`can_use_linear_gelu_tanh` is False.
    """
    reason = _unsupported_reason(x, weight, bias)
    if reason is not None:
        raise UnsupportedInput(reason)
    return torch.ops.ditfuse.linear_gelu_tanh(x, weight, bias)


__all__ = ["linear_gelu_tanh", "can_use_linear_gelu_tanh"]
