"""The eager reference chains: plain torch ops exactly as diffusers 0.42.1 runs them.

Each function is the contract a bit-exact kernel is held to: same op order, same dtypes, same
casts, so each intermediate is rounded where eager rounds it. Notation in the docstrings:
``r(.)`` is a rounding to the dtype the eager op stores (torch's type promotion decides it),
``r16`` / ``r32`` a rounding to bf16 / fp32. tests/cpu/test_reference.py proves every chain equal
(bitwise) to the diffusers module it stands for; tests/gpu repeats that on CUDA. Torch only: used
by tests, benchmarks and the bit-exact gate alike.

The families differ in where they upcast: FLUX.1 runs its chains in the model dtype (bf16:
``r16`` at every op), Wan upcasts to fp32 (``FP32LayerNorm`` on ``x.float()``, fp32 modulation
tables) and casts back with ``.type_as``. The chains take that as data (``norm_dtype``, the
dtypes of ``scale``/``shift``/``gate``) rather than as separate functions, and the kernels derive
their rounding points from the same dtypes with torch's promotion rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_token(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B, D] -> [B, 1, D] (diffusers' ``t[:, None]``); [B, 1, D] / [B, S, D] pass through."""
    return t[:, None] if t.dim() == 2 and ndim == 3 else t


def with_table(t: torch.Tensor | None, table: torch.Tensor | None) -> torch.Tensor | None:
    """A modulation operand as eager forms it: ``t`` itself, or with its [D] table row given,
    ``table + t.float()`` -- one chunk of Wan's / SkyReels-V2's per-token ``scale_shift_table +
    temb.float()`` (the chunk of the sum is the sum of the chunks: ``chunk`` is a view), the fp32
    operand the fused ops compute in registers instead of reading it (``*_table`` arguments)."""
    if table is None:
        return t
    if t is None:
        raise ValueError("a modulation table row given without its operand")
    return table + t.float()


def gate_residual(residual: torch.Tensor, gate: torch.Tensor | None, update: torch.Tensor,
                  gate_table: torch.Tensor | None = None) -> torch.Tensor:
    """``h = r_res(residual + r(gate * update))`` (``gate=None``: ``r(residual + update)``).

    FLUX: ``residual + gate.unsqueeze(1) * attn`` in bf16 (two r16). Wan:
    ``(x.float() + attn * gate_fp32).type_as(x)``: the product and the sum in fp32, one r16 at the
    end (``x.float() + p`` has the value of ``x + p`` for fp32 ``p``, so the upcast is implicit
    here). The result always has the residual's dtype. ``gate_table``: the gate is
    ``gate_table + gate.float()`` (:func:`with_table`).
    """
    gate = with_table(gate, gate_table)
    y = update if gate is None else _per_token(gate, update.dim()) * update
    return (residual + y).to(residual.dtype)


def layer_norm(
    x: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``nn.LayerNorm(D, eps)`` over the last dim: one rounding, to x's dtype. With
    ``norm_dtype`` (diffusers ``FP32LayerNorm(x.float())``): input and affine parameters cast to
    ``norm_dtype`` first, the result stays in ``norm_dtype``."""
    if norm_dtype is not None:
        x = x.to(norm_dtype)
        weight = None if weight is None else weight.to(norm_dtype)
        bias = None if bias is None else bias.to(norm_dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def modulate(n: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """adaLN modulate ``r(r(n * r(1 + scale)) + shift)``; ``1 + scale`` keeps scale's dtype, the
    product and the sum are promoted (bf16 * fp32 -> fp32). ``shift=None``: ``r(n * r(1 + scale))``
    (Qwen-Image 2.1's ``norm(x) * (1 + scale)``)."""
    m = n * (1 + _per_token(scale, n.dim()))
    return m if shift is None else m + _per_token(shift, n.dim())


def layernorm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
    scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = r(r(r(LN(x)) * r(1 + scale)) + shift)`` (``shift=None``: ``r(r(LN(x)) * r(1 + scale))``).

    FLUX.1 (AdaLayerNormZero / ...Single / norm2 + modulate / AdaLayerNormContinuous, whose
    ``chunk`` yields scale first: pass the chunks by name): all bf16, ``norm_dtype=None``.
    Wan (``(norm(x.float()) * (1 + scale) + shift).type_as(x)``): ``norm_dtype=torch.float32``;
    the result is cast back to x's dtype. ``scale=shift=None``: the LayerNorm alone (Wan's affine
    ``norm2``: ``weight``/``bias``). ``scale_table`` / ``shift_table``: Wan 2.2 TI2V's per-token
    modulation, the operands are ``table + scale.float()`` / ``table + shift.float()``
    (:func:`with_table`).
    """
    scale, shift = with_table(scale, scale_table), with_table(shift, shift_table)
    if scale is None and shift is not None:
        raise ValueError("shift given without scale")
    n = layer_norm(x, eps, weight, bias, norm_dtype)
    if scale is not None:
        n = modulate(n, scale, shift)
    return n if norm_dtype is None else n.to(x.dtype)


def gate_residual_layernorm_modulate(
    residual: torch.Tensor,
    gate: torch.Tensor | None,
    update: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_dtype: torch.dtype | None = None,
    gate_table: torch.Tensor | None = None,
    scale_table: torch.Tensor | None = None,
    shift_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add then the next LayerNorm (+ modulate): ``h = gate_residual(...)``,
    ``n = layernorm_modulate(h, ...)``; returns ``(h, n)``. FLUX's dual block middle; Wan's
    self-attention residual + affine ``norm2`` and cross-attention residual + ``norm3`` modulate.
    ``*_table``: per-token modulation operands formed as in :func:`with_table`."""
    h = gate_residual(residual, gate, update, gate_table)
    return h, layernorm_modulate(h, scale, shift, eps, weight, bias, norm_dtype, scale_table, shift_table)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm(D, eps)`` over the last dim (``_fused_rms_norm`` on CUDA: one rounding)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers ``apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1,
    sequence_dim=1)`` for x [B, S, H, D] and fp32 cos/sin [S, D] (FLUX):
    ``o[2i] = r(r32(r32(x[2i]·c) + r32(-x[2i+1]·s)))``, ``o[2i+1] = r(r32(r32(x[2i+1]·c) + r32(x[2i]·s)))``.
    """
    cos = cos[None, :, None, :].to(x.device)
    sin = sin[None, :, None, :].to(x.device)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxAttnProcessor from the unflattened projections to the tensors attention consumes.

    q, k: image (or, in single blocks, joint) tokens [B, S_img, H, D]; q_txt, k_txt: text tokens
    [B, S_txt, H, D] or None (single blocks). Each is RMS-normalised per head with its own weight
    (``torch.nn.RMSNorm``, one rounding), text and image are concatenated along the sequence (text
    first), then RoPE (if cos/sin given) is applied to the joint tensors. Returns (q_joint, k_joint),
    each [B, S_txt + S_img, H, D].
    """
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    if q_txt is not None:
        q = torch.cat([rms_norm(q_txt, q_txt_weight, eps), q], dim=1)
        k = torch.cat([rms_norm(k_txt, k_txt_weight, eps), k], dim=1)
    if cos is not None:
        q = rope_interleaved(q, cos, sin)
        k = rope_interleaved(k, cos, sin)
    return q, k


def qk_fp32_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux3AttnProcessor (diffusers 0.42.1) from the unflattened projections to the tensors
    attention consumes: ``norm_q(query.float())`` (``torch.nn.RMSNorm`` kept in fp32 by
    ``_keep_in_fp32_modules``: fp32 in, fp32 weight, fp32 out), ``apply_rotary_emb`` on the fp32
    result (fp32 out), then ``.to(value.dtype)``: one rounding to q's dtype. Arguments as
    :func:`qk_rmsnorm_rope` (FLUX.3 itself passes no text stream)."""
    dtype = q.dtype

    def up(t):
        return None if t is None else t.float()

    qn, kn = qk_rmsnorm_rope(up(q), up(k), q_weight, k_weight, cos, sin, eps, up(q_txt), up(k_txt),
                             q_txt_weight, k_txt_weight)
    return qn.to(dtype), kn.to(dtype)


def rope_pairs(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's ``apply_rotary_emb`` (WanAttnProcessor, diffusers 0.42.1) for x [B, S, H, D] and
    repeat-interleaved freqs [1, S, 1, D] (fp32, or bf16 after a plain ``.to(bf16)``)::

        o[2i]   = r(r_p(r_p(x[2i] * cos[2i]) - r_p(x[2i+1] * sin[2i+1])))
        o[2i+1] = r(r_p(r_p(x[2i] * sin[2i+1]) + r_p(x[2i+1] * cos[2i])))

    with ``r_p`` the promoted dtype of x and the freqs (fp32 freqs: fp32), ``r`` x's dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def qk_rmsnorm_across_heads_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    heads: int,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WanAttnProcessor from the projections to attention's q/k: ``norm_q``/``norm_k``
    (``torch.nn.RMSNorm(H * Dh)`` over all heads at once, one rounding), ``unflatten(2, (H, -1))``,
    then Wan's RoPE (:func:`rope_pairs`) when ``cos``/``sin`` are given. q, k: [B, S, H * Dh];
    returns [B, S, H, Dh] each."""
    q = rms_norm(q, q_weight, eps).unflatten(2, (heads, -1))
    k = rms_norm(k, k_weight, eps).unflatten(2, (heads, -1))
    if cos is not None:
        q = rope_pairs(q, cos, sin)
        k = rope_pairs(k, cos, sin)
    return q, k


def gelu_tanh(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` (nn.GELU(approximate="tanh") / diffusers GELU): one
    rounding. With ``out`` the result is copied there (the copy a ``cat`` would make) and ``out``
    is returned."""
    y = F.gelu(x, approximate="tanh")
    if out is None:
        return y
    out.copy_(y)
    return out


def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' ``GELU(approximate="tanh")`` module on its projection (FeedForward's first layer,
    the FLUX single block's ``act_mlp(proj_mlp(n))``): ``F.linear`` (cuBLAS: one rounding of
    accumulator + bias), then ``F.gelu`` (one rounding). With ``out`` the result is copied there
    (the copy a ``cat`` would make) and ``out`` is returned."""
    return gelu_tanh(F.linear(x, weight, bias), out)


def single_block_mlp_cat(attn: torch.Tensor, mlp_pre: torch.Tensor) -> torch.Tensor:
    """FluxSingleTransformerBlock: ``cat([attn, gelu_tanh(proj_mlp(n))], dim=2)``; mlp_pre is
    ``proj_mlp(n)``. The cat copies bits, so only the GELU rounds."""
    return torch.cat([attn, gelu_tanh(mlp_pre)], dim=2)


__all__ = [
    "gate_residual",
    "layer_norm",
    "modulate",
    "layernorm_modulate",
    "gate_residual_layernorm_modulate",
    "rms_norm",
    "rope_interleaved",
    "qk_rmsnorm_rope",
    "rope_pairs",
    "qk_rmsnorm_across_heads_rope",
    "gelu_tanh",
    "single_block_mlp_cat",
    "linear_gelu_tanh",
]


# ---------------------------------------------------------------------- VAE (issue 10), appended


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``nn.GroupNorm(num_groups, C, eps)`` (``F.group_norm``): one rounding, ``out = r(GN(x))``.
    diffusers' ResnetBlock2D norm1/norm2, the VAE decoder's conv_norm_out and the mid-block
    Attention's group_norm (on a contiguous ``[B, C, H*W]`` view) run exactly this."""
    return F.group_norm(x, num_groups, weight, bias, eps)


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-6,
    silu: bool = True,
) -> torch.Tensor:
    """``out = r(silu(r(GN(x))))``: ``nn.GroupNorm`` then ``nn.SiLU`` as two eager ops
    (ResnetBlock2D's ``norm1 -> nonlinearity``, ``norm2 -> nonlinearity``; the decoder's
    ``conv_norm_out -> conv_act``). ``silu=False`` is :func:`group_norm`."""
    y = group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


__all__ += ["group_norm", "group_norm_silu"]


def wan_rms_norm(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0) -> torch.Tensor:
    """diffusers 0.42.1 ``WanRMS_norm`` (channel_first=True, AutoencoderKLWan), op for op:
    ``r(r(r(r(x32 / max(||x32||_2 over C, 1e-12)) * sqrt(C)) * gamma) + bias)`` with
    ``x32 = x.float()`` for bf16/fp16 inputs (x itself for fp32); the ``+ bias`` is a real op even
    when bias is the float 0.0 (it turns -0 into +0). x: [B, C, *spatial]; gamma [C, 1, ...]."""
    needs_fp32 = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if needs_fp32 else x, dim=1).to(x.dtype)
    return normalized * (x.shape[1] ** 0.5) * gamma + bias


def channels_last_format(x: torch.Tensor) -> torch.memory_format | None:
    """The channels-last memory format (``channels_last`` for 4-D, ``channels_last_3d`` for 5-D) x
    is dense in, if it is not also contiguous; else None. The one test of "x is channels-last" that
    the Wan VAE's kernels, references and adapter share."""
    if x.dim() not in (4, 5) or x.is_contiguous():
        return None
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    return fmt if x.is_contiguous(memory_format=fmt) else None


def dense_channels_last(t: torch.Tensor) -> bool:
    """t is 5-D and its elements lie as a dense ``[B, T, H, W, C]`` array (the strides of size-1
    dims do not matter): the one layout the Wan decode's cache frames are copied from by address
    arithmetic."""
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def wan_rms_norm_silu(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float = 0.0, silu: bool = True,
    ncdhw: bool = False,
) -> torch.Tensor:
    """``WanRMS_norm`` then ``nn.SiLU`` (WanResidualBlock's norm1/norm2 + nonlinearity, the Wan
    decoder's norm_out + nonlinearity): ``r(silu(wan_rms_norm(x)))``.

    ``ncdhw=True``: x is channels-last memory standing in for the contiguous tensor the NCDHW
    decode holds there (ditfuse's channels-last Wan decode, models/autoencoder_kl_wan.py); the
    norm's reduction order follows the layout, so the chain runs on ``x.contiguous()`` and the
    values come back in x's layout. Without it (and for any other layout) the chain runs on x."""
    fmt = channels_last_format(x) if ncdhw else None
    if fmt is not None:
        return wan_rms_norm_silu(x.contiguous(), gamma, bias, silu).contiguous(memory_format=fmt)
    y = wan_rms_norm(x, gamma, bias)
    return F.silu(y) if silu else y


def wan_rms_norm_silu_pad(
    x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | float, silu: bool, ncdhw: bool,
    pad: tuple[int, ...], pre_bias: torch.Tensor | None = None, cache: torch.Tensor | None = None,
    keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal convolution's padded input and cache, from the norm in front of it, as
    WanResidualBlock and WanCausalConv3d make them: ``y = wan_rms_norm_silu(x + pre_bias, ...)``,
    ``kept = y[:, :, -keep:].clone()`` (the frames cached for the next chunk), and
    ``F.pad(cat([cache, y], 2), pad)`` with ``pad``'s front frames reduced by the cache's
    (``WanCausalConv3d.forward``). Both channels-last-3d like x. ``pre_bias``: the bias of the
    convolution that produced x, added as aten adds a cuDNN convolution's bias
    (``output.add_(bias.reshape(1, C, 1, 1, 1))``, one rounding)."""
    if pre_bias is not None:
        x = x + pre_bias.reshape(1, -1, *([1] * (x.dim() - 2)))
    y = wan_rms_norm_silu(x, gamma, bias, silu, ncdhw)
    kept = y[:, :, y.shape[2] - keep:].contiguous(memory_format=torch.channels_last_3d)
    pad = list(pad)
    if cache is not None:
        y = torch.cat([cache, y], dim=2)
        pad[4] -= cache.shape[2]
    return F.pad(y, pad).contiguous(memory_format=torch.channels_last_3d), kept


def wan_upsample(x: torch.Tensor) -> torch.Tensor:
    """``WanUpsample.forward`` (``nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact")`` on
    ``x.float()``, then ``.type_as(x)``): each value repeated 2x2, through an fp32 round trip.
    Keeps x's memory format (channels-last in, channels-last out)."""
    return F.interpolate(x.float(), None, (2.0, 2.0), "nearest-exact", None, recompute_scale_factor=None).type_as(x)


def upsample_nearest2d(x: torch.Tensor) -> torch.Tensor:
    """diffusers' ``Upsample2D`` interpolation: ``F.interpolate(x, scale_factor=2.0, mode="nearest")``
    (each value repeated 2x2; channels-last in, channels-last out)."""
    return F.interpolate(x, scale_factor=2.0, mode="nearest")


def bias_residual(x: torch.Tensor, bias: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """A cuDNN convolution's bias as aten adds it (``output.add_(bias.reshape(1, C, 1, ...))``),
    then the residual block's ``x + h``: ``r(r(x + bias) + h)``."""
    return (x + bias.reshape(1, -1, *([1] * (x.dim() - 2)))) + h


def conv_bias_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, h: torch.Tensor,
                       stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                       groups: int) -> torch.Tensor:
    """ResnetBlock2D's tail as diffusers writes it: ``conv2`` (aten adds its bias in a pass of its
    own after cuDNN) and ``input_tensor + hidden_states``."""
    return h + F.conv2d(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def conv_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: tuple[int, int],
              padding: tuple[int, int], dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """A biased ``nn.Conv2d`` (zero padding) as eager runs it."""
    return F.conv2d(x, weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def conv_bias_nchw(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: tuple[int, int],
                   padding: tuple[int, int], dilation: tuple[int, int], groups: int) -> torch.Tensor:
    """A biased ``nn.Conv2d`` as eager runs it on the NCHW tensor the model has where ditfuse holds
    a channels-last copy (``x.contiguous()``: the same values)."""
    return F.conv2d(x.contiguous(), weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def conv_bias_residual_nchw(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, h: torch.Tensor,
                            stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                            groups: int) -> torch.Tensor:
    """:func:`conv_bias_residual` with conv2's input in NCHW as eager has it (``x.contiguous()``)."""
    return h + F.conv2d(x.contiguous(), weight, bias, tuple(stride), tuple(padding), tuple(dilation), groups)


def conv_channels_last(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       stride: tuple[int, ...], padding: tuple[int, ...]) -> torch.Tensor:
    """``F.conv2d`` / ``F.conv3d`` as the NCHW / NCDHW model runs it: contiguous input and weight
    (cuDNN transposes to NHWC inside, runs its kernel, transposes back), whatever layout x has."""
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    return conv(x.contiguous(), weight.contiguous(), bias, stride, padding)


def linear_cat(x_a: torch.Tensor, w_a: torch.Tensor, b_a: torch.Tensor | None,
               x_b: torch.Tensor, w_b: torch.Tensor, b_b: torch.Tensor | None) -> torch.Tensor:
    """The joint attention value as FLUX.1's and Qwen-Image's processors build it: each stream's
    projection, then ``cat`` along the sequence (text first)."""
    return torch.cat([F.linear(x_a, w_a, b_a), F.linear(x_b, w_b, b_b)], dim=1)


def head_cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SD3's joint value (``JointAttnProcessor2_0``): the image and text values, each a
    ``[B, H, S, D]`` transposed view of its projection, joined along the sequence (image first)."""
    return torch.cat([a, b], dim=2)


def heads_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """SD3's attention output (``JointAttnProcessor2_0``): SDPA's heads-first ``[B, H, S, D]``
    back in token rows, ``[B, S, H * D]`` (a copy unless heads and head dim merge as a view)."""
    B, H, S, D = x.shape
    return x.transpose(1, 2).reshape(B, S, H * D)


__all__ += ["channels_last_format", "dense_channels_last", "wan_rms_norm", "wan_rms_norm_silu", "wan_rms_norm_silu_pad", "wan_upsample", "bias_residual", "conv_channels_last", "linear_cat", "head_cat",
            "heads_to_tokens", "conv_bias_residual", "conv_bias", "conv_bias_nchw", "conv_bias_residual_nchw",
            "upsample_nearest2d"]


# ----------------------------------------------------------------------------- image families
# Issue 12 groundwork (notes/families.md): the eager chains of Qwen-Image, SD3/3.5, FLUX.2 and
# Z-Image that no op covers yet, op for op as diffusers 0.42.1 runs them; tests/cpu/
# test_family_chains.py checks each against the diffusers modules bitwise. No kernel uses them yet.


def _scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``r(r(x * r(1 + scale)) + shift)``, scale/shift [B, D] or [B, S, D]."""
    return x * (1 + _per_token(scale, x.dim())) + _per_token(shift, x.dim())

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
    x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor | None, eps: float,
    shift: torch.Tensor | None = None,
) -> torch.Tensor:
    """Z-Image ``attention_norm1(x) * scale_msa`` / ``ffn_norm1(x) * scale_mlp`` with
    ``scale_* = 1.0 + chunk``: ``out = r(rms_norm_diffusers(x, w) * r(1 + scale))``; LTX-Video's
    ``norm1(h) * (1 + scale_msa) + shift_msa`` adds ``shift``: ``r(out + shift)``.

    ``scale`` / ``shift`` are raw modulation chunks ([B, D], [B, 1, D] or per token [B, S, D]);
    the ``1.0 + scale`` diffusers computes in the block is the ``r(1 + scale)`` here (a Python
    float plus a bf16 tensor stays bf16). ``scale=None`` (an unmodulated refiner block's
    ``attention_norm1``) is ``rms_norm_diffusers(x, weight, eps)`` alone (plus the shift if given).
    """
    out = rms_norm_diffusers(x, weight, eps)
    if scale is not None:
        out = out * (1.0 + _per_token(scale, x.dim()))
    return out if shift is None else out + _per_token(shift, x.dim())


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
    return _scale_shift(y, scale, shift), _scale_shift(y, scale2, shift2)


# -- activations ------------------------------------------------------------------------------


def swiglu(gate_in: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = r(r(silu(gate_in)) * up)`` — FLUX.2's ``Flux2SwiGLU`` (``gate_in`` = first half of
    the fused projection, ``up`` = second half) and Z-Image's ``F.silu(w1(x)) * w3(x)``.
    SiLU is ``x / (1 + exp(-x))`` in fp32, one rounding; the product rounds again. With ``out``
    the result is copied there (the copy a ``cat`` would make) and ``out`` is returned."""
    y = F.silu(gate_in) * up
    if out is None:
        return y
    out.copy_(y)
    return out


def single_block_swiglu_cat(attn: torch.Tensor, gate_in: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Flux2ParallelSelfAttnProcessor: ``cat([attn, mlp_act_fn(mlp)], dim=-1)`` with Flux2SwiGLU's
    ``silu(x1) * x2`` on the halves of ``mlp`` (gate_in, up). The cat copies bits, so only the
    SwiGLU rounds."""
    return torch.cat([attn, swiglu(gate_in, up)], dim=-1)


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


def qk_rmsnorm_diffusers_rope_complex(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    freqs: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
    txt_freqs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of op ``rope.qk_rmsnorm_diffusers_rope_complex``: the kernel's signature (eps
    defaults to 1e-6, no ``norm`` switch) over :func:`qk_rmsnorm_diffusers_rope_complex_cat`."""
    return qk_rmsnorm_diffusers_rope_complex_cat(
        q, k, q_weight, k_weight, freqs, eps, q_txt, k_txt, q_txt_weight, k_txt_weight, txt_freqs
    )


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



def qk_rmsnorm_diffusers_cat(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of op ``rope.qk_rmsnorm_diffusers_cat``: the kernel's signature (eps defaults
    to 1e-6, no ``norm`` switch) over :func:`qk_rmsnorm_diffusers_cat_heads_first`."""
    return qk_rmsnorm_diffusers_cat_heads_first(
        q, k, q_weight, k_weight, eps, q_txt, k_txt, q_txt_weight, k_txt_weight
    )


def qk_rmsnorm_diffusers_rope_img_first(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
    q_txt: torch.Tensor | None = None,
    k_txt: torch.Tensor | None = None,
    q_txt_weight: torch.Tensor | None = None,
    k_txt_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of op ``rope.qk_rmsnorm_diffusers_rope_img_first``:
    ``HunyuanVideo15AttnProcessor2_0`` from the unflattened projections [B, S, H, D] to the
    tensors attention consumes. Each stream is normalised with diffusers' RMSNorm (two
    roundings); the image stream is then rotated with FLUX's real interleaved RoPE
    (:func:`rope_interleaved`, cos/sin [S_img, D]); the text stream is not; **image first**:
    ``q_joint = cat([rope(RMS_d(q)), RMS_d(q_txt)], dim=1)``, same for k."""
    q = rms_norm_diffusers(q, q_weight, eps)
    k = rms_norm_diffusers(k, k_weight, eps)
    if cos is not None:
        q = rope_interleaved(q, cos, sin)
        k = rope_interleaved(k, cos, sin)
    if q_txt is not None:
        q = torch.cat([q, rms_norm_diffusers(q_txt, q_txt_weight, eps)], dim=1)
        k = torch.cat([k, rms_norm_diffusers(k_txt, k_txt_weight, eps)], dim=1)
    return q, k


def qk_rmsnorm_diffusers_rope_joint(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
    n_txt: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of op ``rope.qk_rmsnorm_diffusers_rope_joint``: ``HunyuanVideoAttnProcessor2_0``
    in a single block (no ``add_q_proj``), from the unflattened joint projections [B, S, H, D]:
    diffusers' RMSNorm on the whole joint q (and k) — one mean call over all rows — then FLUX's real
    interleaved RoPE (:func:`rope_interleaved`, cos/sin [S - n_txt, D]) on the video rows and the
    re-concat ``cat([rope(n[:, :-n_txt]), n[:, -n_txt:]], dim=1)``."""
    q = rms_norm_diffusers(q, q_weight, eps)
    k = rms_norm_diffusers(k, k_weight, eps)
    s = q.shape[1] - n_txt
    q = torch.cat([rope_interleaved(q[:, :s], cos, sin), q[:, s:]], dim=1)
    k = torch.cat([rope_interleaved(k[:, :s], cos, sin), k[:, s:]], dim=1)
    return q, k


__all__ += [
    "qk_rmsnorm_diffusers_rope_img_first",
    "qk_rmsnorm_diffusers_rope_joint",
    "qk_rmsnorm_diffusers_cat",
    "rms_norm_diffusers",
    "rms_norm_diffusers_scale",
    "gate_residual_rms_norm_diffusers",
    "gate_residual_rms_norm_diffusers_scale",
    "layernorm_scale",
    "layernorm_dual_modulate",
    "swiglu",
    "swiglu_halves",
    "single_block_swiglu_cat",
    "rope_complex",
    "fma32",
    "rope_complex_fma_model",
    "qk_rmsnorm_diffusers_rope_complex_cat",
    "qk_rmsnorm_diffusers_rope_complex",
    "qk_rmsnorm_diffusers_cat_heads_first",
]


def table_add(table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """Wan's fp32 modulation ``scale_shift_table + temb.float()`` (SkyReels-V2's too): temb
    converted to fp32 (exact from bf16 / fp16), then one broadcast fp32 add."""
    return table + temb.float()


__all__ += ["table_add"]
