"""modulate: gated residuals, a modulation table plus its embedding, a convolution's bias (+
residual) — the op descriptors. Data only.
Kernels: gate_residual_triton.py, table_add_triton.py, bias_residual_triton.py."""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

GATE_RESIDUAL = OpDescriptor(
    op="modulate.gate_residual",
    contract=Contract.BIT_EXACT,
    replaces="r_res(residual + r(gate * update))",
    summary="gated residual add: the product rounded in its promoted dtype, the sum in the residual's",
    reference="ditfuse.kernels.reference:gate_residual",
    impls=(triton_impl("modulate.gate_residual_triton", "gate_residual"),),
    key=(K("residual", dims=(-1,)), K("gate", rank=True), K("update"), K("gate_table")),
    key_note="elementwise: no shape dim changes the arithmetic (the width only picks the tile)",
)

TABLE_ADD = OpDescriptor(
    op="modulate.table_add",
    contract=Contract.BIT_EXACT,
    replaces="table + temb.float() -> r32(f32(table) + f32(temb)) in one pass (no fp32 copy of temb)",
    summary="Wan's / SkyReels-V2's fp32 modulation: the table plus the bf16 / fp16 / fp32 "
            "embedding, read once in its own dtype, the fp32 sum written once",
    reference="ditfuse.kernels.reference:table_add",
    impls=(triton_impl("modulate.table_add_triton", "table_add"),),
    key=(K("table", tail_shape=True), K("temb", rank=True)),
    key_note="elementwise, one fp32 add: no size changes the arithmetic; the table's shape and temb's "
             "rank pick the broadcast pattern (the addressing), so each pattern is verified once",
)

BIAS_RESIDUAL = OpDescriptor(
    op="modulate.bias_residual",
    contract=Contract.BIT_EXACT,
    replaces="r(r(conv + bias[c]) + h)",
    summary="a cuDNN convolution's bias (aten adds it in a separate pass) and the residual add after "
            "it, one pass over channels-last memory",
    reference="ditfuse.kernels.reference:bias_residual",
    impls=(triton_impl("modulate.bias_residual_triton", "bias_residual"),),
    key=(K("x", dims=(1,)), K("bias"), K("h")),
    key_note="elementwise: only the channel count (the bias index) matters",
)

CONV_BIAS_RESIDUAL = OpDescriptor(
    op="modulate.conv_bias_residual",
    contract=Contract.BIT_EXACT,
    replaces="r(h + r(conv2d(x) + bias[c])) -> the convolution without its bias, then bias + residual in one pass (NCHW, channels-last or mixed: out in h's layout)",
    summary="AutoencoderKL's ResnetBlock2D tail: conv2 without the separate bias pass aten makes "
            "(a broadcast add TensorIterator cannot vectorize), its bias and the residual add in "
            "one pass (verified with the convolution at first sight of each signature)",
    reference="ditfuse.kernels.reference:conv_bias_residual",
    impls=(triton_impl("modulate.bias_residual_triton", "conv_bias_residual"),),
    key=(K("x", dims=(0,), tail_shape=True), K("weight", dims=(0,), tail_shape=True), K("bias"), K("h"),
         K("stride", value=True), K("padding", value=True), K("dilation", value=True), K("groups", value=True)),
    key_note="every shape: cuDNN's heuristic picks its kernel from the whole problem",
)

CONV_BIAS = OpDescriptor(
    op="modulate.conv_bias",
    contract=Contract.BIT_EXACT,
    replaces="r(conv2d(x) + bias[c]) with aten's non-vectorized broadcast bias add -> one vectorized pass",
    summary="a biased Conv2d (NCHW or channels-last): cuDNN's convolution (the call aten makes), then the bias in one "
            "vectorized pass into its output (verified with the convolution at first sight of "
            "each signature)",
    reference="ditfuse.kernels.reference:conv_bias",
    impls=(triton_impl("modulate.bias_residual_triton", "conv_bias"),),
    key=(K("x", dims=(0,), tail_shape=True), K("weight", dims=(0,), tail_shape=True), K("bias"),
         K("stride", value=True), K("padding", value=True), K("dilation", value=True), K("groups", value=True)),
    key_note="every shape: cuDNN's heuristic picks its kernel from the whole problem",
)

_CONV_KEY = (K("x", dims=(0,), tail_shape=True), K("weight", dims=(0,), tail_shape=True), K("bias"),
             K("stride", value=True), K("padding", value=True), K("dilation", value=True), K("groups", value=True))

CONV_BIAS_CL = OpDescriptor(
    op="modulate.conv_bias_cl",
    contract=Contract.BIT_EXACT,
    replaces="NCHW->NHWC transpose + conv + NHWC->NCHW transpose + broadcast bias add -> the NHWC conv "
             "on channels-last x + one bias pass writing NCHW",
    summary="a biased Conv2d whose input eager has in NCHW, run on the channels-last copy a "
            "norm_cl op wrote: cuDNN's NHWC kernel without its transposes (verified against the "
            "NCHW convolution at first sight), then the bias in one tiled pass that writes NCHW "
            "(eager's layout: cuDNN's output transpose and aten's bias add in one)",
    reference="ditfuse.kernels.reference:conv_bias_nchw",
    impls=(triton_impl("modulate.bias_residual_triton", "conv_bias_cl"),),
    key=_CONV_KEY,
    key_note="every shape: cuDNN's heuristic picks its kernel from the whole problem",
    per_signature=True,
)

CONV_BIAS_RESIDUAL_CL = OpDescriptor(
    op="modulate.conv_bias_residual_cl",
    contract=Contract.BIT_EXACT,
    replaces="r(h + r(conv2d(x) + bias[c])) with x NCHW in eager -> the NHWC conv on channels-last x, "
             "then bias + residual in one pass (out in h's layout, as eager's)",
    summary="AutoencoderKL's ResnetBlock2D tail on conv2's channels-last input: no cuDNN transposes, "
            "bias and residual in one pass (verified against the NCHW chain at first sight)",
    reference="ditfuse.kernels.reference:conv_bias_residual_nchw",
    impls=(triton_impl("modulate.bias_residual_triton", "conv_bias_residual_cl"),),
    key=(*_CONV_KEY[:3], K("h"), *_CONV_KEY[3:]),
    key_note="every shape: cuDNN's heuristic picks its kernel from the whole problem",
    per_signature=True,
)

DESCRIPTORS = (GATE_RESIDUAL, TABLE_ADD, BIAS_RESIDUAL, CONV_BIAS_RESIDUAL, CONV_BIAS, CONV_BIAS_CL, CONV_BIAS_RESIDUAL_CL)
