"""Eager reference chains of the issue-12 families that no existing ditfuse op reproduces.

Qwen-Image, SD3/3.5, FLUX.2 and Z-Image as diffusers 0.42.1 runs them, written with plain torch
ops in diffusers' order and dtypes (the chains they share with FLUX.1 are in
:mod:`ditfuse.kernels.reference`; notes/families.md maps every chain to one or the other).
tests/cpu/test_family_chains.py proves each function bitwise equal to the diffusers module or
function it stands for. Notation as in reference.py: ``r(.)`` rounds to the activation dtype (an
eager op stored), ``r32(.)`` is an fp32 intermediate.

Torch only, like reference.py: no diffusers import here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import _per_token, layer_norm, scale_shift

_HALF = (torch.float16, torch.bfloat16)


# -- diffusers' own RMSNorm (normalization.RMSNorm), two roundings ------------------------------


def rms_norm_diffusers(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """diffusers ``RMSNorm.forward`` (the non-NPU branch), op for op.

    ``ms = r32(mean(r32(x32 * x32)))`` over the last dim; ``rstd = r32(rsqrt(r32(ms + eps)))``;
    ``h = r32(x * rstd)`` (x is promoted: bf16/fp16 times an fp32 tensor is fp32). Then:

    - weight bf16/fp16: ``out = r(r(h) * w)`` (+ bias: ``r(out + b)``), in the weight's dtype;
    - weight fp32 (an fp32 model, or a bf16 input with weights kept in fp32): ``out = r32(h * w)``
      and the output is **fp32** whatever the input dtype;
    - weight None (``elementwise_affine=False``): ``out = r(h)`` in the input dtype (one rounding).

    The mean is torch's generic reduction: on CUDA ``sum * r32(n_rows / numel)`` (``MeanOps``),
    on CPU ``sum / n`` — equal when the row width is a power of two. Its summation order is the
    reduce kernel's, not the layer-norm template's.
    """
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight is None:
        return h.to(input_dtype)
    if weight.dtype in _HALF:
        h = h.to(weight.dtype)
    h = h * weight
    if bias is not None:
        h = h + bias
    return h


def rms_norm_diffusers_scale(
    x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor, eps: float
) -> torch.Tensor:
    """Z-Image ``attention_norm1(x) * scale_msa`` / ``ffn_norm1(x) * scale_mlp`` with
    ``scale_* = 1.0 + chunk``: ``out = r(rms_norm_diffusers(x, w) * r(1 + scale))``.

    ``scale`` is the raw modulation chunk ([B, D], [B, 1, D] or per token [B, S, D]); the
    ``1.0 + scale`` diffusers computes in the block is the ``r(1 + scale)`` here (a Python float
    plus a bf16 tensor stays bf16). There is no shift.
    """
    return rms_norm_diffusers(x, weight, eps) * (1.0 + _per_token(scale, x.dim()))


def gate_residual_rms_norm_diffusers(
    residual: torch.Tensor,
    gate: torch.Tensor | None,
    update: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Z-Image ``x + gate * attention_norm2(attn_out)`` / ``x + gate * ffn_norm2(ffn_out)``:
    ``h = r(residual + r(gate * rms_norm_diffusers(update, w)))``; ``gate`` is the block's
    ``tanh(chunk)`` (already rounded by its own eager op). Unmodulated refiner blocks have no gate:
    ``h = r(residual + rms_norm_diffusers(update, w))``.
    """
    n = rms_norm_diffusers(update, weight, eps)
    if gate is None:
        return residual + n
    return residual + _per_token(gate, update.dim()) * n


def gate_residual_rms_norm_diffusers_scale(
    residual: torch.Tensor,
    gate: torch.Tensor | None,
    update: torch.Tensor,
    out_weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Z-Image block middle, one pass over a row:
    ``h = r(residual + r(gate * RMS_d(update; out_weight)))`` then
    ``n = r(RMS_d(h; next_weight) * r(1 + scale))`` (``n = RMS_d(h)`` when ``scale`` is None,
    the unmodulated refiner); returns ``(h, n)``."""
    h = gate_residual_rms_norm_diffusers(residual, gate, update, out_weight, eps)
    if scale is None:
        return h, rms_norm_diffusers(h, next_weight, eps)
    return h, rms_norm_diffusers_scale(h, next_weight, scale, eps)


# -- LayerNorm variants -----------------------------------------------------------------------


def layernorm_scale(x: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Z-Image FinalLayer ``norm_final(x) * (1.0 + adaLN(c))``: ``out = r(r(LN(x)) * r(1 + scale))``.

    Not ``layernorm_modulate`` with a zero shift: ``r(y + 0)`` turns ``-0.0`` into ``+0.0``.
    """
    return layer_norm(x, eps) * (1.0 + _per_token(scale, x.dim()))


def layernorm_dual_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    scale2: torch.Tensor,
    shift2: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3.5 ``SD35AdaLayerNormZeroX``: one LayerNorm, two modulations of the same ``y = r(LN(x))``:
    ``n1 = r(r(y * r(1 + scale)) + shift)``, ``n2 = r(r(y * r(1 + scale2)) + shift2)``."""
    y = layer_norm(x, eps)
    return scale_shift(y, scale, shift), scale_shift(y, scale2, shift2)


# -- activations ------------------------------------------------------------------------------


def swiglu(gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``out = r(r(silu(gate_in)) * up)`` — FLUX.2's ``Flux2SwiGLU`` (``gate_in`` = first half of
    the fused projection, ``up`` = second half) and Z-Image's ``F.silu(w1(x)) * w3(x)``.
    SiLU is ``x / (1 + exp(-x))`` in fp32, one rounding; the product rounds again."""
    return F.silu(gate_in) * up


def swiglu_halves(x: torch.Tensor) -> torch.Tensor:
    """``Flux2SwiGLU``: ``swiglu(x[..., :I], x[..., I:])`` with ``I = x.shape[-1] // 2``."""
    half = x.shape[-1] // 2
    return swiglu(x[..., :half], x[..., half:])


# -- complex RoPE (Qwen-Image, Z-Image) ---------------------------------------------------------


def _freqs_for(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """[S, D/2] (Qwen-Image: ``unsqueeze(1)``) or [B, S, D/2] (Z-Image: ``unsqueeze(2)``) -> a
    tensor broadcasting over the head axis of x [B, S, H, D/2]."""
    if freqs.dim() == 2:
        return freqs.unsqueeze(1)
    return freqs.unsqueeze(2)


def rope_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Qwen-Image ``apply_rotary_emb_qwen(x, freqs, use_real=False)`` and Z-Image's in-processor
    ``apply_rotary_emb``: x [B, S, H, D], freqs complex64 [S, D/2] or [B, S, D/2].

    Pairs are interleaved, ``(x[2i], x[2i+1])`` is one complex number; the product is one
    complex64 multiply ``(a + ib)(c + id)`` and the result is rounded once to x's dtype:
    ``o[2i] = r(a*c - b*d)``, ``o[2i+1] = r(a*d + b*c)`` with whatever contraction the device's
    ``c10::complex`` multiply has (see :func:`rope_complex_fma_model`). freqs stay complex64 under
    a bf16 model (they are plain attributes, not buffers).
    """
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * _freqs_for(x, freqs)).flatten(3).type_as(x)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Exact fp32 fused multiply-add ``r32(a * b + c)`` (one rounding), on any device.

    The fp32 product is exact in fp64; the fp64 sum is rounded to odd (TwoSum gives the exact
    error) so the final fp64 -> fp32 rounding is correct (fp64 has more than fp32's 24 + 2 bits).
    """
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bp = s - c
    err = (p - bp) + (c - (s - bp))  # TwoSum: p + c == s + err exactly
    bits = s.view(torch.int64)
    even = (bits & 1) == 0
    inexact = (err != 0) & torch.isfinite(s)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact & even, torch.nextafter(s, toward), s)
    return s.float()


def rope_complex_fma_model(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A real-arithmetic model of :func:`rope_complex` where the compiler contracted
    ``c10::complex<float>::operator*=`` (``real = a*c - b*d; imag = a*d + b*c``) into
    ``real = fma(a, c, -r32(b*d))``, ``imag = fma(a, d, r32(b*c))`` — what GCC emits for the
    scalar loop on x86 CPUs (tested) and the first candidate for nvcc on CUDA (to be probed).
    The uncontracted model is :func:`ditfuse.kernels.reference.rope_interleaved` with
    ``cos``/``sin`` repeated per pair. x [B, S, H, D]; cos, sin fp32 [S, D/2] or [B, S, D/2]
    (``freqs.real`` / ``freqs.imag``)."""
    c = _freqs_for(x, cos)
    s = _freqs_for(x, sin)
    a, b = x.float()[..., 0::2], x.float()[..., 1::2]
    re = fma32(a, c, -(b * s))
    im = fma32(a, s, b * c)
    return torch.stack([re, im], dim=-1).flatten(3).to(x.dtype)


# -- QK chains between the projections and attention --------------------------------------------


def qk_rmsnorm_diffusers_rope_complex_cat(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
    txt_freqs: torch.Tensor | None = None,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QwenDoubleStreamAttnProcessor2_0 (and, without text, ZSingleStreamAttnProcessor) from the
    unflattened projections [B, S, H, D] to the tensors attention consumes.

    Each stream is normalised with diffusers' RMSNorm (two roundings; ``norm=False`` when the
    attention has no QK norm) and rotated with its **own** complex frequencies (image: ``freqs``,
    text: ``txt_freqs``) *before* the text-first concat:
    ``q_joint = cat([rope_c(RMS_d(q_txt)), rope_c(RMS_d(q))], dim=1)``, same for k. A weight of
    None is an affine-free RMSNorm. freqs None: no RoPE.
    """

    def one(x, w, f):
        if norm:
            x = rms_norm_diffusers(x, w, eps)
        if f is not None:
            x = rope_complex(x, f)
        return x

    q = one(q, q_weight, freqs)
    k = one(k, k_weight, freqs)
    if q_txt is not None:
        q = torch.cat([one(q_txt, q_txt_weight, txt_freqs), q], dim=1)
        k = torch.cat([one(k_txt, k_txt_weight, txt_freqs), k], dim=1)
    return q, k


def qk_rmsnorm_diffusers_cat_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
    norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SD3 ``JointAttnProcessor2_0``: q, k are [B, H, S, D] (transposed views of the
    projections); each is normalised with diffusers' RMSNorm when ``norm`` (SD3.5's
    ``qk_norm="rms_norm"``; SD3 has none), then **image first**:
    ``q_joint = cat([RMS_d(q), RMS_d(q_txt)], dim=2)`` (a contiguous [B, H, S_img + S_txt, D]).
    No RoPE."""

    def one(x, w):
        return rms_norm_diffusers(x, w, eps) if norm else x

    q, k = one(q, q_weight), one(k, k_weight)
    if q_txt is not None:
        q = torch.cat([q, one(q_txt, q_txt_weight)], dim=2)
        k = torch.cat([k, one(k_txt, k_txt_weight)], dim=2)
    return q, k


__all__ = [
    "rms_norm_diffusers",
    "rms_norm_diffusers_scale",
    "gate_residual_rms_norm_diffusers",
    "gate_residual_rms_norm_diffusers_scale",
    "layernorm_scale",
    "layernorm_dual_modulate",
    "swiglu",
    "swiglu_halves",
    "rope_complex",
    "fma32",
    "rope_complex_fma_model",
    "qk_rmsnorm_diffusers_rope_complex_cat",
    "qk_rmsnorm_diffusers_cat_heads_first",
]
