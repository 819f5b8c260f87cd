"""modulate: gated residuals — the op descriptors. Data only. Kernel: gate_residual_triton.py."""

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

DESCRIPTORS = (GATE_RESIDUAL,)
