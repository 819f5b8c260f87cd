"""Wan 2.1 text-to-video fixtures: the tiny ``WanPipeline`` behind the ``tiny-wan`` preset.

``build_tiny_wan()`` builds a complete diffusers ``WanPipeline`` (WanTransformer3DModel,
AutoencoderKLWan, UMT5 text encoder, T5 tokenizer, UniPC flow-matching scheduler: the component
classes of ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``) in memory from small configs with **random
weights** from a fixed seed. Its videos are noise: it exercises the code path (shapes, the 4k+1
frame rule, CFG, batching, the causal 3D VAE decode, MP4 encoding), not video quality.

Sized so that one 8-step, 17-frame, 832x480 job (with CFG: two transformer passes per step) takes
a few seconds on one CPU core; the VAE decode of 17 full-resolution frames dominates.

Importing this module imports neither torch nor diffusers: they are imported inside the builder.
"""

from __future__ import annotations

from typing import Any

TINY_WAN_SEED = 0
# The tokenizer is character-level, so a prompt costs about one token per character; Wan 2.1
# uses 512 positions, 128 is plenty here.
TINY_WAN_TEXT_LEN = 128
# Wan 2.1's frame rate: its clips are 81 frames = 5 s at 16 fps.
WAN_FPS = 16


def _t5_tokenizer(max_length: int) -> Any:
    """A T5 Unigram tokenizer over lowercase letters, digits and punctuation (no extra ids).

    Same recipe as the tiny-flux preset's T5 tokenizer (UMT5 uses T5's tokenizer class)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()/"
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_tiny_wan() -> Any:
    """Build the tiny WanPipeline in memory (random weights, seed ``TINY_WAN_SEED``)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = _t5_tokenizer(TINY_WAN_TEXT_LEN)
    torch.manual_seed(TINY_WAN_SEED)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            dense_act_fn="gelu_new",
            feed_forward_proj="gated-gelu",
            is_gated_act=True,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    # Wan 2.1 layout in miniature: 16 latent channels, 1x2x2 patches, head dim 12 (RoPE axes
    # t/h/w = 4/4/4), QK RMSNorm across heads, cross-attention norm; 1 block.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        # RoPE table length: covers 2048 px / 8 / 2 = 128 patches per side and 241 frames
        # (61 latent frames).
        rope_max_seq_len=256,
    ).eval()
    # The Wan 2.1 VAE's structure (causal 3D convs, 8x spatial and 4x temporal compression, so
    # num_frames = 4k + 1 and sizes are multiples of 16 with the 2x2 patches) at 2 base channels
    # and one residual block per stage.
    vae = AutoencoderKLWan(
        base_dim=2,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=0,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ).eval()
    # Wan 2.1 T2V's scheduler: UniPC with flow-matching sigmas, flow_shift 3.0 (the 480p setting).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=3.0,
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )
