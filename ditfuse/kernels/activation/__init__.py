"""activation: tanh-GELU — the op descriptor. Data only. Kernel: gelu_tanh_triton.py."""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

GELU_TANH = OpDescriptor(
    op="activation.gelu_tanh",
    contract=Contract.BIT_EXACT,
    replaces="r(gelu(x, approximate='tanh')) then cat([attn, mlp], dim=2)",
    summary="tanh-GELU written straight into a slice of a preallocated buffer (the cat disappears)",
    reference="ditfuse.kernels.reference:gelu_tanh",
    impls=(triton_impl("activation.gelu_tanh_triton", "gelu_tanh"),),
    key=(K("x"), K("out")),
    key_note="elementwise: no shape dim changes the arithmetic",
)

DESCRIPTORS = (GELU_TANH,)
