"""Chroma fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (Chroma1-HD's size and a tiny one); the inputs are one step
at a WxH image: (H/16)x(W/16) FLUX.1-packed latent tokens (64 channels), ``txt_tokens`` random T5
states (the pipeline pads to 512) and the pipeline's attention mask (each prompt's real tokens,
its padding masked, every image token).
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("chroma", 512)
_to_images = ifc.unpack_2x2


FAMILY = Family(
    name="chroma",
    model_class="diffusers:ChromaTransformer2DModel",
    configs={"tiny": ifc.config("chroma", "tiny"), "dev": ifc.config("chroma", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Chroma1-HD size (19 dual + 38 single blocks, width 3072), random bf16 weights"},
)


# ------------------------------------------------------------------------------ the tiny Chroma pipeline

TINY_SEED = 0
# The T5 tokenizer is character-level (models/tiny_parts.py): one token per character; Chroma
# pads to 512, 64 is plenty here.
TINY_T5_LEN = 64
# What every call of the tiny pipeline passes: the pipeline's T5 length defaults to 512.
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": TINY_T5_LEN}


def build_tiny_pipeline() -> Any:
    """A complete ``ChromaPipeline`` with **random weights** from seed ``TINY_SEED``: its images
    are noise; it exercises the pipeline's code path offline.

    Parts: the ``tiny`` ChromaTransformer2DModel of :data:`FAMILY` (2 dual + 2 single blocks,
    a 1-layer approximator) taking FLUX.1's 2x2-packed 16-channel latents; a 1-layer
    ``T5EncoderModel`` with the character-level T5 tokenizer of :mod:`ditfuse.models.tiny_parts`;
    a 4-level ``AutoencoderKL`` with 16 latent channels and FLUX.1's scaling / shift
    (vae_scale_factor 8, 2x2 packing: sizes are multiples of 16); FLUX.1's dynamically shifted
    ``FlowMatchEulerDiscreteScheduler``. Calls should pass :data:`TINY_CALL_KWARGS`.
    """
    import torch
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from .tiny_parts import autoencoder_kl, t5_encoder, t5_tokenizer

    cfg = dict(FAMILY.configs["tiny"])
    # The pipeline packs 2x2 patches of the VAE's latents: 16 channels -> 64 (Chroma1-HD's).
    cfg.update(in_channels=64)
    tokenizer = t5_tokenizer(TINY_T5_LEN)

    torch.manual_seed(TINY_SEED)
    # T5's width is the transformer's joint_attention_dim (Chroma1-HD: T5-XXL's 4096).
    text_encoder = t5_encoder(tokenizer, cfg["joint_attention_dim"])
    transformer = ChromaTransformer2DModel(**cfg).eval()
    # FLUX.1's VAE in miniature: 4 levels (8x downsampling), 16 latent channels, no quant convs.
    vae = autoencoder_kl(16)
    # Chroma1-HD's scheduler (FLUX.1's): the pipeline computes mu from the image's token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
