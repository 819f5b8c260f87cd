"""activation: tanh-GELU and SwiGLU — the op descriptors. Data only. Kernels: gelu_tanh_triton.py,
swiglu_triton.py."""

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

GELU_TANH_CAT = OpDescriptor(
    op="activation.gelu_tanh_cat",
    contract=Contract.BIT_EXACT,
    replaces="cat([attn, r(gelu(mlp_pre, approximate='tanh'))], dim=2)",
    summary="the FLUX single block's proj_out input in one pass: the attention half copied bit for bit, "
            "the MLP half through the tanh-GELU",
    reference="ditfuse.kernels.reference:single_block_mlp_cat",
    impls=(triton_impl("activation.gelu_tanh_triton", "gelu_tanh_cat"),),
    key=(K("attn", dims=(-1,)), K("mlp_pre", dims=(-1,))),
    key_note="elementwise, but the widths place the copy/GELU boundary among the column blocks",
)

SWIGLU = OpDescriptor(
    op="activation.swiglu",
    contract=Contract.BIT_EXACT,
    replaces="r(r(silu(gate_in)) * up) (then cat([attn, mlp], dim=-1))",
    summary="SiLU-gated product of two strided halves in one pass, optionally written into a slice "
            "of a preallocated buffer (FLUX.2's Flux2SwiGLU: the cat disappears)",
    reference="ditfuse.kernels.reference:swiglu",
    impls=(triton_impl("activation.swiglu_triton", "swiglu"),),
    key=(K("gate_in"), K("up"), K("out")),
    key_note="elementwise: no shape dim changes the arithmetic",
)

SWIGLU_CAT = OpDescriptor(
    op="activation.swiglu_cat",
    contract=Contract.BIT_EXACT,
    replaces="cat([attn, r(r(silu(gate_in)) * up)], dim=-1)",
    summary="the FLUX.2 parallel block's to_out input in one pass: the attention half copied bit for "
            "bit, the MLP half through the SwiGLU (the same kernel body as activation.gelu_tanh_cat)",
    reference="ditfuse.kernels.reference:single_block_swiglu_cat",
    impls=(triton_impl("activation.swiglu_triton", "swiglu_cat"),),
    key=(K("attn", dims=(-1,)), K("gate_in", dims=(-1,)), K("up")),
    key_note="elementwise, but the widths place the copy/SwiGLU boundary among the column blocks",
)

DESCRIPTORS = (GELU_TANH, GELU_TANH_CAT, SWIGLU, SWIGLU_CAT)
