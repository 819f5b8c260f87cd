"""FLUX.2 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (FLUX.2-dev size and a tiny one); the inputs are one step
at a WxH image: (H/16)x(W/16) packed latent tokens (the VAE's 32 channels, 2x2-packed to 128),
``txt_tokens`` random Mistral embeddings (the pipeline pads to 512), 4-axis position ids.
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("flux2", 512)
_to_images = ifc.unpack_2x2


FAMILY = Family(
    name="flux2",
    model_class="diffusers:Flux2Transformer2DModel",
    configs={"tiny": ifc.config("flux2", "tiny"), "dev": ifc.config("flux2", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "FLUX.2-dev size (8 double + 48 single blocks, width 6144, SwiGLU 3x), random bf16 weights"},
)


# ------------------------------------------------------------------------------ the tiny FLUX.2 Klein pipeline

TINY_SEED = 0
# The Qwen2 tokenizer is byte-level (models/tiny_parts.py): one token per byte, and Klein's chat
# template adds about 20 around the prompt; the pipeline pads to 512, 64 is plenty here.
TINY_TEXT_LEN = 64
# What every call of the tiny pipeline passes: the pipeline's text length defaults to 512.
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": TINY_TEXT_LEN}
# Klein stacks the text encoder's hidden states of these layers (its default
# ``text_encoder_out_layers``) into one joint_attention_dim-wide token.
KLEIN_TEXT_LAYERS = (9, 18, 27)


def build_tiny_pipeline() -> Any:
    """A complete ``Flux2KleinPipeline`` with **random weights** from seed ``TINY_SEED``: its
    images are noise; it exercises the pipeline's code path offline.

    Parts: the ``tiny`` Flux2Transformer2DModel of :data:`FAMILY` (2 double + 2 single blocks)
    taking the 2x2-packed 32-channel latents (128 channels) without a guidance embedding, as
    Klein's; a 28-layer, 8-wide ``Qwen3ForCausalLM`` with the byte-level Qwen2 tokenizer and chat
    template of :mod:`ditfuse.models.tiny_parts`; a 4-level ``AutoencoderKLFlux2`` with 32 latent
    channels (vae_scale_factor 8, 2x2 packing: sizes are multiples of 16); Klein's dynamically
    shifted ``FlowMatchEulerDiscreteScheduler``. ``is_distilled=False`` (a Klein base model):
    ``guidance_scale > 1`` runs a second, unconditional forward per step. Calls should pass
    :data:`TINY_CALL_KWARGS`.
    """
    import torch
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .tiny_parts import qwen2_tokenizer

    cfg = dict(FAMILY.configs["tiny"])
    # FLUX.2's VAE has 32 latent channels, packed 2x2 by the pipeline: 128. Klein's transformer
    # has no guidance embedding (the pipeline passes guidance=None).
    cfg.update(in_channels=128, guidance_embeds=False)
    width = cfg["joint_attention_dim"] // len(KLEIN_TEXT_LAYERS)  # 24 / 3 = 8
    tokenizer = qwen2_tokenizer(TINY_TEXT_LEN)

    torch.manual_seed(TINY_SEED)
    # 28 layers so the pipeline's default layer indices (9, 18, 27) exist: a call needs no
    # text_encoder_out_layers, as with the real checkpoints (Qwen3-4B / 8B: 36 layers). At width
    # 8 the 28 layers are ~15K parameters. RoPE positions up to the pipeline's default 512, so a
    # call without TINY_CALL_KWARGS works too (slower).
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=max(KLEIN_TEXT_LAYERS) + 1, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )).eval()
    transformer = Flux2Transformer2DModel(**cfg).eval()
    # FLUX.2's VAE in miniature: 4 levels (8x downsampling), 32 latent channels.
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=32, norm_num_groups=4,
        sample_size=64,
    ).eval()
    # FLUX.2 Klein's scheduler: the pipeline passes its own sigmas and an empirical mu.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential",
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
