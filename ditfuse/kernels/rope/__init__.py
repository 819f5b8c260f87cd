"""rope: QK RMSNorm + rotary embeddings — the op descriptors. Data only.

Kernels: qk_rmsnorm_rope_triton.py (FLUX: per-head norm, text/image concat, interleaved RoPE;
and, in the same kernel body, FLUX.3's fp32 norm + RoPE and Qwen-Image's diffusers-RMSNorm +
complex RoPE) and qk_rmsnorm_across_heads_rope_triton.py (Wan: one norm over all heads, pair RoPE), each with both
contracts in one kernel body.
"""

from ..spec import Contract, KeyArg as K, OpDescriptor, triton_impl

_REF = "ditfuse.kernels.reference"
_EXACT = "ditfuse.kernels.exact"

QK_RMSNORM_ROPE = OpDescriptor(
    op="rope.qk_rmsnorm_rope",
    contract=Contract.BIT_EXACT,
    replaces="r(rope(r(RMSNorm(q|k)))) for text+image, written into the joint [B, S_txt+S_img, H, D]",
    summary="per-head RMSNorm + FLUX interleaved RoPE (fp32 cos/sin), writes the concatenated q/k",
    reference=f"{_REF}:qk_rmsnorm_rope",
    exact=f"{_EXACT}:qk_rmsnorm_rope_fp64",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_rope"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("cos"), K("sin"), K("eps", value=True),
         K("q_txt"), K("k_txt"), K("q_txt_weight"), K("k_txt_weight")),
    key_note="head_dim fixes the RMS reduction; heads and sequence lengths only change the grid",
)

QK_RMSNORM_ROPE_FP32 = OpDescriptor(
    op="rope.qk_rmsnorm_rope_fp32",
    contract=Contract.CLOSE,
    replaces="r(rope(r(RMSNorm(q|k)))) -> r(rope32(RMSNorm32(q|k))) into the joint [B, S, H, D]",
    summary="the same kernel with the rounding switch off: no rounding between norm and RoPE",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_rope_fp32"),),
    lossless=QK_RMSNORM_ROPE,
)

QK_FP32_RMSNORM_ROPE = OpDescriptor(
    op="rope.qk_fp32_rmsnorm_rope",
    contract=Contract.BIT_EXACT,
    replaces="r(rope32(RMSNorm32(x32))), x32 = q.float() | k.float(): norm (fp32 weight) and RoPE in fp32, "
             "one rounding",
    summary="FLUX.3's QK chain: torch.nn.RMSNorm on the fp32 copy + interleaved fp32 RoPE, rounded "
            "once to q's dtype (the qk_rmsnorm_rope kernel without its mid rounding; no fp32 copies)",
    reference=f"{_REF}:qk_fp32_rmsnorm_rope",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_fp32_rmsnorm_rope"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("cos"), K("sin"), K("eps", value=True),
         K("q_txt"), K("k_txt"), K("q_txt_weight"), K("k_txt_weight")),
    key_note="head_dim fixes the RMS reduction; heads and sequence lengths only change the grid",
)

_WAN = "rope.qk_rmsnorm_across_heads_rope_triton"

QK_RMSNORM_ACROSS_HEADS_ROPE = OpDescriptor(
    op="rope.qk_rmsnorm_across_heads_rope",
    contract=Contract.BIT_EXACT,
    replaces="r(rope_pairs(r(RMSNorm(q|k)) over all H*Dh, then split into heads))",
    summary="RMSNorm over all heads (torch's vectorized order, several vectors per thread) + Wan's "
            "pair RoPE (fp32 or bf16 freqs) in one pass per tensor",
    reference=f"{_REF}:qk_rmsnorm_across_heads_rope",
    exact=f"{_EXACT}:qk_rmsnorm_across_heads_rope_fp64",
    impls=(triton_impl(_WAN, "qk_rmsnorm_across_heads_rope"),),
    key=(K("q", dims=(-1,)), K("k", dims=(-1,)), K("q_weight"), K("k_weight"), K("cos", dims=(-1,)),
         K("sin"), K("heads", value=True), K("eps", value=True)),
    key_note="the row width H*Dh fixes the reduction tree and head_dim the RoPE pairing; batch and "
             "sequence length only change the grid",
)

QK_RMSNORM_ACROSS_HEADS_ROPE_FP32 = OpDescriptor(
    op="rope.qk_rmsnorm_across_heads_rope_fp32",
    contract=Contract.CLOSE,
    replaces="r(rope_pairs(r(RMSNorm(q|k)))) -> r(rope32(RMSNorm32(q|k)))",
    summary="the same kernel with the rounding switch off: no rounding between norm and RoPE",
    impls=(triton_impl(_WAN, "qk_rmsnorm_across_heads_rope_fp32"),),
    lossless=QK_RMSNORM_ACROSS_HEADS_ROPE,
)

QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX = OpDescriptor(
    op="rope.qk_rmsnorm_diffusers_rope_complex",
    contract=Contract.BIT_EXACT,
    replaces="r(rope_c(RMS_d(q|k))) per stream (own complex freqs), written into the joint "
             "[B, S_txt+S_img, H, D]",
    summary="diffusers RMSNorm (two roundings, torch's mean order and factor) + complex64 RoPE "
            "with per-stream tables (Qwen-Image; Z-Image's single stream with per-sample [B, S, D/2] "
            "tables), writes the concatenated q/k",
    reference=f"{_REF}:qk_rmsnorm_diffusers_rope_complex",
    exact=f"{_EXACT}:qk_rmsnorm_diffusers_rope_complex_fp64",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_diffusers_rope_complex"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("freqs"), K("eps", value=True),
         K("q_txt"), K("k_txt"), K("q_txt_weight"), K("k_txt_weight"), K("txt_freqs")),
    key_note="head_dim fixes the mean's reduction and the RoPE pairing. Each stream's row count "
             "B*S*H also enters torch's mean: its fp32 factor rows/numel (r32(1/D) unless rows "
             "times D's odd part reaches 2^24; never for D = 128) and, below 16 rows, more lanes "
             "per row. The kernel derives both from each call's shapes as torch's launch does "
             "(CPU: against the simulation; GPU: against eager down to 1-row streams), so they stay "
             "out of the key: sequence lengths change with every prompt",
)

QK_RMSNORM_DIFFUSERS_CAT = OpDescriptor(
    op="rope.qk_rmsnorm_diffusers_cat",
    contract=Contract.BIT_EXACT,
    replaces="cat([RMS_d(q), RMS_d(q_txt)], dim=2) (and k) of SD3.5's [B, H, S, D] transposed views",
    summary="diffusers RMSNorm (two roundings, torch's mean order and factor per stream) on q, k "
            "and the text q/k, written heads-first and image-first into the joint [B, H, S, D] "
            "(SD3.5; without text: attn2)",
    reference=f"{_REF}:qk_rmsnorm_diffusers_cat",
    exact=f"{_EXACT}:qk_rmsnorm_diffusers_cat_fp64",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_diffusers_cat"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("eps", value=True),
         K("q_txt"), K("k_txt"), K("q_txt_weight"), K("k_txt_weight")),
    key_note="head_dim fixes the mean's reduction; each stream's row count B*H*S sets torch's "
             "factor and, below 16 rows, the lane count, which the kernel derives from each "
             "call's shapes as torch's launch does (as for rope.qk_rmsnorm_diffusers_rope_complex)",
)

QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST = OpDescriptor(
    op="rope.qk_rmsnorm_diffusers_rope_img_first",
    contract=Contract.BIT_EXACT,
    replaces="cat([r(rope(RMS_d(q))), RMS_d(q_txt)], dim=1) (and k): RoPE on the image stream only, "
             "image first, [B, S, H, D]",
    summary="diffusers RMSNorm (two roundings, torch's mean order and factor per stream) + FLUX's real "
            "interleaved RoPE on the image stream only, written image-first into the joint [B, S, H, D] "
            "(HunyuanVideo 1.5)",
    reference=f"{_REF}:qk_rmsnorm_diffusers_rope_img_first",
    exact=f"{_EXACT}:qk_rmsnorm_diffusers_rope_img_first_fp64",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_diffusers_rope_img_first"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("cos"), K("sin"), K("eps", value=True),
         K("q_txt"), K("k_txt"), K("q_txt_weight"), K("k_txt_weight")),
    key_note="as rope.qk_rmsnorm_diffusers_rope_complex: head_dim fixes the mean's reduction and the "
             "RoPE pairing; each stream's row count (its mean factor and, below 16 rows, lane count) "
             "is derived from each call's shapes as torch's launch does",
)

QK_RMSNORM_DIFFUSERS_ROPE_JOINT = OpDescriptor(
    op="rope.qk_rmsnorm_diffusers_rope_joint",
    contract=Contract.BIT_EXACT,
    replaces="n = RMS_d(q); cat([r(rope(n[:, :-n_txt])), n[:, -n_txt:]], dim=1) (and k): one joint tensor "
             "normalised as a whole, RoPE on its leading (video) rows, [B, S, H, D]",
    summary="diffusers RMSNorm (two roundings, torch's mean order and factor of the joint tensor) + FLUX's "
            "real interleaved RoPE on the leading video rows, text rows copied after them (HunyuanVideo "
            "single blocks)",
    reference=f"{_REF}:qk_rmsnorm_diffusers_rope_joint",
    exact=f"{_EXACT}:qk_rmsnorm_diffusers_rope_joint_fp64",
    impls=(triton_impl("rope.qk_rmsnorm_rope_triton", "qk_rmsnorm_diffusers_rope_joint"),),
    key=(K("q", dims=(-1,)), K("k"), K("q_weight"), K("k_weight"), K("cos"), K("sin"), K("eps", value=True),
         K("n_txt", value=True)),
    key_note="head_dim fixes the mean's reduction and the RoPE pairing; the joint row count B*S*H "
             "(torch's factor and, below 16 rows, lane count) and n_txt (where the rotation stops) "
             "are derived per call as torch's launch and the processor's slices do",
)

DESCRIPTORS = (QK_RMSNORM_ROPE, QK_RMSNORM_ROPE_FP32, QK_FP32_RMSNORM_ROPE, QK_RMSNORM_ACROSS_HEADS_ROPE,
               QK_RMSNORM_ACROSS_HEADS_ROPE_FP32, QK_RMSNORM_DIFFUSERS_ROPE_COMPLEX,
               QK_RMSNORM_DIFFUSERS_CAT, QK_RMSNORM_DIFFUSERS_ROPE_IMG_FIRST, QK_RMSNORM_DIFFUSERS_ROPE_JOINT)
