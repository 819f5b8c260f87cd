"""linear: GEMMs with an eager op in their epilogue — the op descriptors. Data only. Kernels:
linear_gelu_triton.py."""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

LINEAR_GELU_TANH = OpDescriptor(
    op="linear.linear_gelu_tanh",
    contract=Contract.BIT_EXACT,
    replaces="r(gelu(r(linear(x, W, b)), approximate='tanh')) (then cat([attn, mlp], dim=2))",
    summary="bf16 GEMM with the tanh-GELU in its epilogue, optionally written into a slice of a "
            "preallocated buffer: the pre-activation's round trip through memory (and the cat) "
            "disappear; equal to cuBLAS + GELU where cuBLAS chains K the same way (verified per "
            "GEMM problem at first sight)",
    reference="ditfuse.kernels.reference:linear_gelu_tanh",
    impls=(triton_impl("linear.linear_gelu_triton", "linear_gelu_tanh"),),
    key=(K("x", dims=(0, -2, -1), rank=True), K("weight", dims=(0,)), K("bias"), K("out")),
    key_note="every GEMM shape (cuBLAS picks its kernel from M, N, K)",
    per_signature=True,
)

DESCRIPTORS = (LINEAR_GELU_TANH,)
