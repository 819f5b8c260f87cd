"""modulate: gated residuals, a convolution's bias + residual — the op descriptors. Data only.
Kernels: gate_residual_triton.py, bias_residual_triton.py."""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

GATE_RESIDUAL = OpDescriptor(
    op="modulate.gate_residual",
    contract=Contract.BIT_EXACT,
    replaces="r_res(residual + r(gate * update))",
    summary="gated residual add: the product rounded in its promoted dtype, the sum in the residual's",
    reference="ditfuse.kernels.reference:gate_residual",
    impls=(triton_impl("modulate.gate_residual_triton", "gate_residual"),),
    key=(K("residual", dims=(-1,)), K("gate", rank=True), K("update")),
    key_note="elementwise: no shape dim changes the arithmetic (the width only picks the tile)",
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

DESCRIPTORS = (GATE_RESIDUAL, BIAS_RESIDUAL)
