"""layout: copies removed or moved (one file per op family, backend as filename suffix).

joint_buffers_torch.py: torch-only helpers (views, one preallocated buffer) with no op of their
own; pad_channels_last_triton.py: a zero-bordered channels-last buffer for a producer to fill (no
op either: exact by construction). conv_channels_last_torch.py: cuDNN's convolution on
channels-last memory (no transposes); upsample_nearest_triton.py: WanUpsample's 2x repeat and
fp32 round trip in one channels-last pass; linear_cat_torch.py: two projections written into
their concatenation (the joint attention value); head_cat_triton.py: SD3's joint value, two
transposed [B, H, S, D] views joined along the sequence in one copy pass, and the attention output's
heads-first -> token-rows copy (the same kernel); all five under the gate — the descriptors are here;
importing this imports neither torch nor triton.
"""

from ..spec import Backend, Capability, Contract, Impl, KeyArg as K, OpDescriptor, triton_impl

_CL = "ditfuse.kernels.layout.conv_channels_last_torch"

CONV_CHANNELS_LAST = OpDescriptor(
    op="layout.conv_channels_last",
    contract=Contract.BIT_EXACT,
    replaces="NCHW->NHWC transpose + NHWC conv + NHWC->NCHW transpose -> the NHWC conv on channels-last x",
    summary="a Conv2d/Conv3d on channels-last memory: cuDNN's NHWC kernel without its two layout "
            "transposes (the same kernel, verified bitwise per signature at first sight)",
    reference="ditfuse.kernels.reference:conv_channels_last",
    impls=(Impl(Backend.TORCH, f"{_CL}:conv_channels_last", frozenset({Capability("cuda", (8, 0))}),
                f"{_CL}:can_use_conv_channels_last"),),
    key=(K("x", dims=(0,), tail_shape=True), K("weight", dims=(0,), tail_shape=True), K("bias"),
         K("stride", value=True), K("padding", value=True)),
    key_note="every shape: cuDNN's heuristic picks its kernel from the whole problem",
    # channels-last out by design (the reference, NCHW's way, writes contiguous); the Wan VAE's
    # decoder site keeps the decode channels-last and returns it contiguous, as eager does
    own_layout=True,
    per_signature=True,
)

UPSAMPLE_NEAREST2X = OpDescriptor(
    op="layout.upsample_nearest2x",
    contract=Contract.BIT_EXACT,
    replaces="r(up2(float(x))): upcast, fp32 nearest-exact x2, cast back -> one channels-last pass",
    summary="WanUpsample on channels-last memory: the 2x2 repeat and the fp32 round trip in one "
            "pass (eager: upcast, fp32 upsample at 4x the size, cast back), the cast back by c10's "
            "own cvt.rn instruction",
    reference="ditfuse.kernels.reference:wan_upsample",
    impls=(triton_impl("layout.upsample_nearest_triton", "upsample_nearest2x"),),
    key=(K("x", dims=(0,), tail_shape=True),),
    key_note="every shape (a copy: the shape fixes the launch)",
)

UPSAMPLE_NEAREST2D = OpDescriptor(
    op="layout.upsample_nearest2d",
    contract=Contract.BIT_EXACT,
    replaces="up2(x) (F.interpolate nearest x2, aten's NHWC kernel) -> one channels-last repeat pass",
    summary="diffusers' Upsample2D nearest x2 on channels-last memory (AutoencoderKL's quality=\"high\" "
            "decode): each value stored 2x2, a bit copy",
    reference="ditfuse.kernels.reference:upsample_nearest2d",
    impls=(triton_impl("layout.upsample_nearest_triton", "upsample_nearest2d"),),
    key=(K("x", dims=(0,), tail_shape=True),),
    key_note="every shape (a copy: the shape fixes the launch)",
)

_LC = "ditfuse.kernels.layout.linear_cat_torch"

LINEAR_CAT = OpDescriptor(
    op="layout.linear_cat",
    contract=Contract.BIT_EXACT,
    replaces="cat([linear(x_a), linear(x_b)], dim=1) -> each GEMM writes its rows of the joint buffer (batch 1)",
    summary="the joint attention value without its cat: the text and image value projections "
            "write their rows of one [1, S, N] buffer (the same addmm F.linear runs, verified "
            "bitwise per signature at first sight)",
    reference="ditfuse.kernels.reference:linear_cat",
    impls=(Impl(Backend.TORCH, f"{_LC}:linear_cat", frozenset({Capability("cuda", (8, 0))}),
                f"{_LC}:can_use_linear_cat"),),
    key=(K("x_a", dims=(0, 1, 2)), K("w_a", dims=(0,)), K("b_a"), K("x_b", dims=(0, 1, 2)), K("w_b"), K("b_b")),
    key_note="every GEMM shape (cuBLASLt picks its kernel from M, N, K)",
)

HEAD_CAT = OpDescriptor(
    op="layout.head_cat",
    contract=Contract.BIT_EXACT,
    replaces="cat([a, b], dim=2) of two [B, H, S, D] transposed views (aten's non-vectorized cat) -> one copy pass",
    summary="the joint attention value of SD3's processor: the image and text values, transposed "
            "views of their projections, copied head row by head row into the contiguous "
            "[B, H, S_img + S_txt, D] (a copy: bit-exact by construction)",
    reference="ditfuse.kernels.reference:head_cat",
    impls=(triton_impl("layout.head_cat_triton", "head_cat"),),
    key=(K("a"), K("b")),
    key_note="dtype and stride class (a copy: no size changes the bits)",
)

HEADS_TO_TOKENS = OpDescriptor(
    op="layout.heads_to_tokens",
    contract=Contract.BIT_EXACT,
    replaces="x.transpose(1, 2).reshape(B, S, H * D) of SDPA's heads-first output (aten's non-vectorized strided copy) -> one copy pass",
    summary="the joint attention output of SD3's processor back in token rows: each head row of "
            "the contiguous [B, H, S, D] copied to its place in the contiguous [B, S, H * D] "
            "(a copy: bit-exact by construction; the head_cat kernel with the output's strides)",
    reference="ditfuse.kernels.reference:heads_to_tokens",
    impls=(triton_impl("layout.head_cat_triton", "heads_to_tokens"),),
    key=(K("x"),),
    key_note="dtype and stride class (a copy: no size changes the bits)",
)

DESCRIPTORS = (CONV_CHANNELS_LAST, UPSAMPLE_NEAREST2X, UPSAMPLE_NEAREST2D, LINEAR_CAT, HEAD_CAT, HEADS_TO_TOKENS)
