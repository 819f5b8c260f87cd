"""norm: LayerNorm (+ the residual before it, + adaLN modulate), GroupNorm (+ SiLU), WanRMS_norm
(+ SiLU), diffusers RMSNorm (+ Z-Image's gate/residual/scale) — the op descriptors.

Data only (importing this imports neither torch nor triton). Kernels:
layernorm_modulate_triton.py, group_norm_silu_triton.py, wan_rms_norm_silu_triton.py: each one
kernel body for both contracts (a constexpr rounding switch); rms_norm_diffusers_triton.py: one
body for three bit-exact chains (a constexpr mode).
"""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

_KERNEL = "norm.layernorm_modulate_triton"
_REF = "ditfuse.kernels.reference"
_EXACT = "ditfuse.kernels.exact"
# Row statistics follow torch's per-row reduction tree, which is fixed by the width D; batch and
# sequence length only change the grid, so they are left out of the key.
_ROWS_NOTE = "batch and sequence length only change the grid: every row runs the same reduction tree"

_LN_KEY = (K("scale", rank=True), K("shift", rank=True), K("eps", value=True), K("weight"), K("bias"),
           K("norm_dtype", value=True), K("scale_table"), K("shift_table"))

LAYERNORM_MODULATE = OpDescriptor(
    op="norm.layernorm_modulate",
    contract=Contract.BIT_EXACT,
    replaces="r(r(r(LN(x)) * r(1 + scale)) + shift)  (shift optional)",
    summary="LayerNorm (torch's vectorized Welford order; affine or not; in the model dtype or fp32) "
            "+ adaLN modulate in one pass; per-token modulation may come as table row + embedding "
            "(Wan 2.2 TI2V's fp32 sum formed in registers)",
    reference=f"{_REF}:layernorm_modulate",
    exact=f"{_EXACT}:layernorm_modulate_fp64",
    impls=(triton_impl(_KERNEL, "layernorm_modulate"),),
    key=(K("x", dims=(-1,)), *_LN_KEY),
    key_note=_ROWS_NOTE,
)

GATE_RESIDUAL_LAYERNORM_MODULATE = OpDescriptor(
    op="norm.gate_residual_layernorm_modulate",
    contract=Contract.BIT_EXACT,
    replaces="h = r(residual + r(gate * update)); n = layernorm_modulate(h)",
    summary="residual add (gated or plain) then LayerNorm (+ modulate) in one pass; returns (h, n)",
    reference=f"{_REF}:gate_residual_layernorm_modulate",
    exact=f"{_EXACT}:gate_residual_layernorm_modulate_fp64",
    impls=(triton_impl(_KERNEL, "gate_residual_layernorm_modulate"),),
    key=(K("residual", dims=(-1,)), K("gate", rank=True), K("update"), *_LN_KEY, K("gate_table")),
    key_note=_ROWS_NOTE,
)

LAYERNORM_MODULATE_FP32 = OpDescriptor(
    op="norm.layernorm_modulate_fp32",
    contract=Contract.CLOSE,
    replaces="r(r(r(LN(x)) * r(1 + scale)) + shift) -> r(LN32(x) * (1 + scale) + shift)",
    summary="the same kernel with the rounding switch off: fp32 epilogue, one rounding",
    impls=(triton_impl(_KERNEL, "layernorm_modulate_fp32"),),
    lossless=LAYERNORM_MODULATE,
)

GATE_RESIDUAL_LAYERNORM_MODULATE_FP32 = OpDescriptor(
    op="norm.gate_residual_layernorm_modulate_fp32",
    contract=Contract.CLOSE,
    replaces="h = r(res + r(gate * y)); n = ... -> h = r(res + gate * y); n = r(LN32(h32) * (1 + scale) + shift)",
    summary="residual + LayerNorm + modulate in fp32, the norm of the unrounded sum; returns (h, n)",
    impls=(triton_impl(_KERNEL, "gate_residual_layernorm_modulate_fp32"),),
    lossless=GATE_RESIDUAL_LAYERNORM_MODULATE,
)

_GN = "norm.group_norm_silu_triton"
_GN_KEY = (K("x", tail_shape=True), K("num_groups", value=True), K("weight"), K("bias"), K("eps", value=True),
           K("silu", value=True))
_GN_NOTE = "the batch only changes the grid; channels, groups and spatial size fix every chain and tree"

GROUP_NORM_SILU = OpDescriptor(
    op="norm.group_norm_silu",
    contract=Contract.BIT_EXACT,
    replaces="r(silu(r(GroupNorm(x))))",
    summary="GroupNorm (aten's RowwiseMoments chains and block tree, one program per aten warp: "
            "statistics over many SMs) + fused-params epilogue + the SiLU after it",
    reference=f"{_REF}:group_norm_silu",
    exact=f"{_EXACT}:group_norm_silu_fp64",
    impls=(triton_impl(_GN, "group_norm_silu"),),
    key=_GN_KEY,
    key_note=_GN_NOTE,
)

GROUP_NORM_SILU_FP32 = OpDescriptor(
    op="norm.group_norm_silu_fp32",
    contract=Contract.CLOSE,
    replaces="r(silu(r(GN(x)))) -> r(silu(GN32(x)))",
    summary="the same kernels with the rounding switch off: fp32 tile statistics (Chan merge), one rounding",
    impls=(triton_impl(_GN, "group_norm_silu_fp32"),),
    lossless=GROUP_NORM_SILU,
)

GROUP_NORM_SILU_CL = OpDescriptor(
    op="norm.group_norm_silu_cl",
    contract=Contract.BIT_EXACT,
    replaces="r(silu(r(GN(x)))) + the NCHW->NHWC transpose cuDNN makes of it before a convolution",
    summary="the exact GroupNorm (+ SiLU) with its epilogue writing channels-last, for a convolution "
            "to read without cuDNN's transpose (AutoencoderKL's ResnetBlock2D norms and decoder head)",
    reference=f"{_REF}:group_norm_silu",
    exact=f"{_EXACT}:group_norm_silu_fp64",
    impls=(triton_impl(_GN, "group_norm_silu_cl"),),
    key=_GN_KEY,
    key_note=_GN_NOTE,
    # channels-last out by design (eager writes NCHW): the values are compared, and the sites
    # calling it hand the output to a channels-last convolution (modulate.conv_bias_cl)
    own_layout=True,
)

_WR = "norm.wan_rms_norm_silu_triton"

WAN_RMS_NORM_SILU = OpDescriptor(
    op="norm.wan_rms_norm_silu",
    contract=Contract.BIT_EXACT,
    replaces="r(silu(r(r(r(r(x32 / max(||x32||_C, 1e-12)) * sqrt(C)) * gamma) + bias)))",
    summary="WanRMS_norm (F.normalize's CUDA reduce order: setReduceConfig replica, 4 interleaved "
            "FMA accumulators, block-y fold) + its 4 elementwise ops + the SiLU after it, one pass",
    reference=f"{_REF}:wan_rms_norm_silu",
    exact=f"{_EXACT}:wan_rms_norm_silu_fp64",
    impls=(triton_impl(_WR, "wan_rms_norm_silu"),),
    key=(K("x", dims=(0,), tail_shape=True), K("gamma"), K("bias", value=True), K("silu", value=True),
         K("ncdhw", value=True)),
    key_note="the whole shape: batch x positions pick torch's reduce config (vector size, block height)",
)

WAN_RMS_NORM_SILU_PAD = OpDescriptor(
    op="norm.wan_rms_norm_silu_pad",
    contract=Contract.BIT_EXACT,
    replaces="y = r(silu(WanRMS_norm(r(conv + b)))); y[:, :, -2:].clone(); F.pad(cat([cache, y], 2), causal "
             "padding) -> one channels-last buffer + the kept frames",
    summary="the WanRMS_norm + SiLU kernel writing into the interior of the next causal "
            "convolution's zero-padded channels-last input, the border launch copying the cached "
            "frames in front, the last frames stored a second time as the next cache (no clone, "
            "cat or pad copy)",
    reference=f"{_REF}:wan_rms_norm_silu_pad",
    impls=(triton_impl(_WR, "wan_rms_norm_silu_pad"),),
    key=(K("x", dims=(0,), tail_shape=True), K("gamma"), K("bias", value=True), K("silu", value=True),
         K("ncdhw", value=True), K("pad", value=True), K("pre_bias"), K("cache", dims=(2,)), K("keep", value=True)),
    key_note="as norm.wan_rms_norm_silu, plus the padding, whether a convolution bias comes first, the "
             "cached frames and how many are kept",
)

WAN_RMS_NORM_SILU_FP32 = OpDescriptor(
    op="norm.wan_rms_norm_silu_fp32",
    contract=Contract.CLOSE,
    replaces="r(silu(r(r(r(r(x32 / ||x32||)) * sqrt(C)) * gamma) + b))) -> r(silu(x * sqrt(C) / ||x|| * gamma + b))",
    summary="the same kernel with the rounding switch off: fp32 throughout, one rounding",
    impls=(triton_impl(_WR, "wan_rms_norm_silu_fp32"),),
    lossless=WAN_RMS_NORM_SILU,
)

_RD = "norm.rms_norm_diffusers_triton"
# diffusers' RMSNorm mean runs torch's generic reduce kernel: its lane count (for < 16 rows) and
# MeanOps' fp32 factor rows / (rows * D) depend on the number of rows of the eager call, so the
# whole shape of the normed tensor is in the key.
_RD_NOTE = ("the whole shape of the normed rows: their count B*S sets MeanOps' fp32 factor "
            "f32(rows)/f32(rows*D) (the mean is sum * factor, not sum / D; the factor leaves r32(1/D) "
            "once rows times D's odd part reaches 2^24) and, below 16 rows, torch's lanes per row")

RMS_NORM_DIFFUSERS_SCALE = OpDescriptor(
    op="norm.rms_norm_diffusers_scale",
    contract=Contract.BIT_EXACT,
    replaces="r(RMS_d(x; w) * r(1 + scale)) (scale None: RMS_d(x; w)); with a shift r(that + shift)",
    summary="diffusers RMSNorm (torch's generic-reduce mean order and MeanOps factor, rsqrt.approx, "
            "two roundings) + Z-Image's scale or LTX-Video's scale and shift in one pass",
    reference=f"{_REF}:rms_norm_diffusers_scale",
    exact=f"{_EXACT}:rms_norm_diffusers_scale_fp64",
    impls=(triton_impl(_RD, "rms_norm_diffusers_scale"),),
    key=(K("x", dims=(0,), tail_shape=True), K("weight"), K("scale", rank=True), K("eps", value=True),
         K("shift", rank=True)),
    key_note=_RD_NOTE,
)

GATE_RESIDUAL_RMS_NORM_DIFFUSERS = OpDescriptor(
    op="norm.gate_residual_rms_norm_diffusers",
    contract=Contract.BIT_EXACT,
    replaces="r(residual + r(gate * RMS_d(update; w))) (gate None: r(residual + RMS_d(update; w)))",
    summary="diffusers RMSNorm of the update + gate + residual add in one pass (Z-Image's FFN residual)",
    reference=f"{_REF}:gate_residual_rms_norm_diffusers",
    exact=f"{_EXACT}:gate_residual_rms_norm_diffusers_fp64",
    impls=(triton_impl(_RD, "gate_residual_rms_norm_diffusers"),),
    key=(K("residual"), K("gate", rank=True), K("update", dims=(0,), tail_shape=True), K("weight"),
         K("eps", value=True)),
    key_note=_RD_NOTE,
)

GATE_RESIDUAL_RMS_NORM_DIFFUSERS_SCALE = OpDescriptor(
    op="norm.gate_residual_rms_norm_diffusers_scale",
    contract=Contract.BIT_EXACT,
    replaces="h = r(residual + r(gate * RMS_d(update; w))); n = r(RMS_d(h; w2) * r(1 + scale))",
    summary="Z-Image block middle: RMSNorm of the attention output, gate, residual, then the next "
            "RMSNorm (+ scale) of the sum, one pass; returns (h, n)",
    reference=f"{_REF}:gate_residual_rms_norm_diffusers_scale",
    exact=f"{_EXACT}:gate_residual_rms_norm_diffusers_scale_fp64",
    impls=(triton_impl(_RD, "gate_residual_rms_norm_diffusers_scale"),),
    key=(K("residual"), K("gate", rank=True), K("update", dims=(0,), tail_shape=True), K("out_weight"),
         K("next_weight"), K("scale", rank=True), K("eps", value=True)),
    key_note=_RD_NOTE,
)

DESCRIPTORS = (LAYERNORM_MODULATE, GATE_RESIDUAL_LAYERNORM_MODULATE, LAYERNORM_MODULATE_FP32,
               GATE_RESIDUAL_LAYERNORM_MODULATE_FP32, GROUP_NORM_SILU, GROUP_NORM_SILU_FP32,
               GROUP_NORM_SILU_CL,
               WAN_RMS_NORM_SILU, WAN_RMS_NORM_SILU_PAD, WAN_RMS_NORM_SILU_FP32, RMS_NORM_DIFFUSERS_SCALE,
               GATE_RESIDUAL_RMS_NORM_DIFFUSERS, GATE_RESIDUAL_RMS_NORM_DIFFUSERS_SCALE)
