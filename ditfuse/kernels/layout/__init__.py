"""layout: copies removed or moved (one file per op family, backend as filename suffix).

joint_buffers_torch.py: torch-only helpers (views, one preallocated buffer) with no op of their
own; pad_channels_last_triton.py: a zero-bordered channels-last buffer for a producer to fill (no
op either: exact by construction). conv_channels_last_torch.py: cuDNN's convolution on
channels-last memory (no transposes), an op under the gate — the descriptor is here; importing
this imports neither torch nor triton.
"""

from ..spec import Backend, Capability, Contract, Impl, KeyArg as K, OpDescriptor

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
)

DESCRIPTORS = (CONV_CHANNELS_LAST,)
