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
    exact="ditfuse.kernels.exact:linear_gelu_tanh_fp64",
    impls=(triton_impl("linear.linear_gelu_triton", "linear_gelu_tanh"),),
    key=(K("x", dims=(0, -2, -1), rank=True), K("weight", dims=(0,)), K("bias"), K("out")),
    key_note="every GEMM shape (cuBLAS picks its kernel from M, N, K)",
    per_signature=True,
)

LINEAR_GELU_TANH_FAST = OpDescriptor(
    op="linear.linear_gelu_tanh_fast",
    contract=Contract.CLOSE,
    replaces="r(gelu(r(linear(x, W, b)))) -> r(gelu32(linear32(x, W, b))) with tanh.approx",
    summary="the GEMM-GELU with one rounding: the GELU of the fp32 pre-activation (hardware tanh), "
            "persistent TMA GEMM on sm_90; declines fewer than 1024 rows (eager is faster there)",
    impls=(triton_impl("linear.linear_gelu_triton", "linear_gelu_tanh_fast"),),
    lossless=LINEAR_GELU_TANH,
)

DESCRIPTORS = (LINEAR_GELU_TANH, LINEAR_GELU_TANH_FAST)
