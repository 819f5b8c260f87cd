"""SD3 / SD3.5 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

Configs are image_family_configs': ``dev`` = SD3.5 large (38 blocks, width 2432, QK RMSNorm),
``medium`` = SD3.5 medium (24 blocks, width 1536, dual attention in blocks 0-12), ``sd3-medium`` =
SD3 medium (no QK norm), and the tiny ones. Inputs are one step at WxH: 16-channel latents at
H/8 x W/8 (patchified 2x2 inside the model: (H/16)(W/16) tokens), ``txt_tokens`` random joint
CLIP+T5 embeddings (the pipeline always sends 77 + 256 = 333), pooled CLIP projections.
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family

_IFC_NAME = {"tiny": "sd35", "tiny-sd3": "sd3", "dev": "sd35_large", "medium": "sd35_medium",
             "sd3-medium": "sd3_medium"}


make_inputs = ifc.input_maker("sd3", 333)


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device, dtype=dtype)  # the pipeline passes t in [0, 1000]


def _to_images(latent: Any) -> Any:
    return latent  # the transformer unpatchifies: [N, 16, H/8, W/8] already


def _config(key: str) -> dict[str, Any]:
    name = _IFC_NAME[key]
    return ifc.config(name, "tiny" if key.startswith("tiny") else "real")


FAMILY = Family(
    name="sd3",
    model_class="diffusers:SD3Transformer2DModel",
    configs={k: _config(k) for k in _IFC_NAME},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "SD3.5-large size (38 joint blocks, width 2432, QK RMSNorm), random bf16 weights",
           "medium": "SD3.5-medium size (24 blocks, width 1536, dual attention in blocks 0-12)",
           "sd3-medium": "SD3-medium size (24 blocks, width 1536, no QK norm)"},
)


# ------------------------------------------------------------------------------ the tiny SD3.5 pipeline

TINY_SEED = 0
# Character-level tokenizers (models/tiny_parts.py): one token per character. CLIP keeps SD3's 77
# positions (the pipeline reads them from the tokenizer); T5 gets 64 instead of 256.
TINY_CLIP_LEN = 77
TINY_T5_LEN = 64
# What every call of the tiny pipeline passes: the pipeline's T5 length defaults to 256.
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": TINY_T5_LEN}


def build_tiny_pipeline() -> Any:
    """A complete ``StableDiffusion3Pipeline`` (SD3.5 layout) with **random weights** from seed
    ``TINY_SEED``: its images are noise; it exercises the pipeline's code path offline.

    Parts: the ``tiny`` SD3Transformer2DModel of :data:`FAMILY` (QK RMSNorm, block 0 with dual
    attention, the context_pre_only last block) with 16 latent channels; two 2-layer
    ``CLIPTextModelWithProjection`` (CLIP-L / CLIP-G stand-ins) and a 1-layer ``T5EncoderModel``
    with the character-level tokenizers of :mod:`ditfuse.models.tiny_parts`; a 4-level
    ``AutoencoderKL`` with 16 latent channels (vae_scale_factor 8: sizes are multiples of 16);
    SD3.5's ``FlowMatchEulerDiscreteScheduler`` (shift 3). Calls should pass
    :data:`TINY_CALL_KWARGS`.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from .tiny_parts import autoencoder_kl, clip_tokenizer, t5_encoder, t5_tokenizer

    cfg = dict(FAMILY.configs["tiny"])
    # The VAE's 16 latent channels (SD3's); sample_size 32 makes the pipeline's default size
    # 256x256; a 64-patch position table allows images up to 1024 px a side (16 px per patch).
    cfg.update(in_channels=16, out_channels=16, sample_size=32, pos_embed_max_size=64)
    joint, pooled = cfg["joint_attention_dim"], cfg["pooled_projection_dim"]  # 20, 12

    tokenizer, tokenizer_2 = clip_tokenizer(TINY_CLIP_LEN), clip_tokenizer(TINY_CLIP_LEN)
    tokenizer_3 = t5_tokenizer(TINY_T5_LEN)

    def clip(hidden: int, projection: int) -> Any:
        # 2 layers: the pipeline takes hidden_states[-2] (the penultimate layer) as SD3 does, so
        # with 1 layer the sequence embedding would skip every attention layer.
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=TINY_CLIP_LEN, projection_dim=projection,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).eval()

    torch.manual_seed(TINY_SEED)
    # The pipeline concatenates the two CLIPs' sequence states (8 + 8 = 16, zero-padded to T5's
    # width, the transformer's joint_attention_dim) and their pooled projections (4 + 8 =
    # pooled_projection_dim); SD3 pads 768 + 1280 to 4096 the same way.
    text_encoder = clip(8, 4)
    text_encoder_2 = clip(8, pooled - 4)
    text_encoder_3 = t5_encoder(tokenizer_3, joint)
    transformer = SD3Transformer2DModel(**cfg).eval()
    # SD3's VAE in miniature: 4 levels (8x downsampling), 16 latent channels, no quant convs,
    # SD3.5's scaling and shift factors.
    vae = autoencoder_kl(16, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
