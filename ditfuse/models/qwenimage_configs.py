"""Qwen-Image fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = Qwen/Qwen-Image size (60 dual-stream blocks, width 3072, FF 12288, text width 3584),
``tiny`` for tests. Inputs are one step at WxH: (H/16)(W/16) 2x2-packed latent tokens (64
channels), ``txt_tokens`` random Qwen2.5-VL embeddings (the prompt's real length; 512 assumed),
no text mask, ``img_shapes`` for the RoPE tables. :func:`build_tiny_pipeline`: a complete
random-weight ``QwenImagePipeline`` around the ``tiny`` transformer (presets, tests).
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("qwenimage", 512)
_to_images = ifc.unpack_2x2


FAMILY = Family(
    name="qwenimage",
    model_class="diffusers:QwenImageTransformer2DModel",
    configs={"tiny": ifc.config("qwenimage", "tiny"), "dev": ifc.config("qwenimage", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Qwen-Image size (60 dual-stream blocks, width 3072), random bf16 weights"},
)


# -- the tiny QwenImagePipeline (``ditfuse generate`` / ``serve`` presets, tests) ------------------

TINY_SEED = 0

# The byte-level tokenizer spends one token per byte, so the pipeline's prompt template leaves 128
# template tokens after its 34-token drop (the real BPE leaves none): 256 text tokens keep a prompt
# of up to 128 bytes (the pipeline's default is 512, its limit 1024).
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": 256}

# Qwen/Qwen-Image's scheduler_config.json: the shift grows with the image's token count
# (exponential time shift, mu from 0.5 at 256 tokens to 0.9 at 8192), stretched to end at 0.02.
QWENIMAGE_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
)

# AutoencoderKLQwenImage's per-channel latent statistics (diffusers' defaults, Qwen-Image's values).
_QWENIMAGE_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                           0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_QWENIMAGE_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                          3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``QwenImagePipeline`` with **random weights** (seed :data:`TINY_SEED`):
    its images are noise; it exercises the pipeline's code path (prompt template, text masks,
    true CFG, 2x2 packing, the 3D-causal VAE decode), not image quality. Built offline, no download.

    Parts: ``QwenImageTransformer2DModel`` from :data:`FAMILY`'s ``tiny`` config (2 dual-stream
    blocks, 16 packed channels = 4 latent channels x 2x2, text width 24); a 2-layer
    ``Qwen2_5_VLForConditionalGeneration`` (text width 24 with Qwen2.5-VL's multimodal RoPE, and a
    1-block vision tower the text-to-image path never calls); the byte-level Qwen2 tokenizer
    (:func:`ditfuse.models.tiny_parts.qwen2_tokenizer`); ``AutoencoderKLQwenImage`` with 4 latent
    channels and Qwen-Image's 8x spatial compression at 4-16 channels; Qwen-Image's
    ``FlowMatchEulerDiscreteScheduler`` (exponential dynamic shift). Every call should pass
    :data:`TINY_CALL_KWARGS`. Sizes are multiples of 16 (VAE 8x, then 2x2 packing).
    """
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .tiny_parts import qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    tid = tokenizer.convert_tokens_to_ids
    cfg = FAMILY.config("tiny")
    text_width = cfg["joint_attention_dim"]
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=text_width,
                intermediate_size=2 * text_width,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,  # grouped-query attention, as Qwen2.5-VL-7B (28 / 4)
                max_position_embeddings=2048,
                # head dim 12: the multimodal RoPE's (t, h, w) sections must cover its 6 pairs
                rope_parameters=dict(rope_type="default", mrope_section=[2, 2, 2], rope_theta=1000000.0),
                bos_token_id=tid("<|endoftext|>"),
                eos_token_id=tid("<|im_end|>"),
                pad_token_id=tokenizer.pad_token_id,
            ),
            # Never run for text-to-image, but the class builds it (and Qwen-Image-Edit calls it);
            # its output width is the text width, as the real tower's 3584.
            vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_width,
                patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                fullatt_block_indexes=[0],
            ),
            image_token_id=tid("<|image_pad|>"),
            video_token_id=tid("<|video_pad|>"),
            vision_start_token_id=tid("<|vision_start|>"),
            vision_end_token_id=tid("<|vision_end|>"),
        )
    ).eval()
    transformer = QwenImageTransformer2DModel(**cfg).eval()
    z_dim = cfg["in_channels"] // 4  # the pipeline packs 2x2 latent patches into the channels
    # Wan-2.1-style VAE at 4 base channels: three downsamples (vae_scale_factor 8, as the real one)
    # and Qwen-Image's per-channel latent statistics (its first z_dim channels), so the pipeline's
    # de-normalisation is not an identity.
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=z_dim,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
        latents_mean=_QWENIMAGE_LATENTS_MEAN[:z_dim],
        latents_std=_QWENIMAGE_LATENTS_STD[:z_dim],
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER)
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
