"""Z-Image fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = Tongyi-MAI/Z-Image size (30 main + 2 + 2 refiner blocks, width 3840, SwiGLU 10240,
caption width 2560), ``tiny`` for tests. Inputs are one step at WxH: per sample a latent
[16, 1, H/8, W/8] (patchified 2x2 inside the transformer: (H/16)(W/16) image tokens) and
``txt_tokens`` random Qwen3 caption features (the prompt's real length; 512 assumed), as the lists
the model takes. The model returns a list of per-sample latents; :func:`stack_output` stacks them.
:func:`build_tiny_pipeline`: a complete random-weight ``ZImagePipeline`` around the ``tiny``
transformer (presets, tests).
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

_make = ifc.input_maker("zimage", 512)


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512) -> dict[str, Any]:
    """One step's forward kwargs; the per-sample lists (``x``, ``cap_feats``) moved to ``device``."""
    kw = _make(model, batch, size, seed, "cpu", dtype, txt_tokens)
    return {k: [t.to(device) for t in v] if isinstance(v, list) else (v.to(device) if hasattr(v, "to") else v)
            for k, v in kw.items()}


def stack_output(out: Any) -> Any:
    """The model's list of per-sample [C, 1, H, W] latents -> one [N, C, 1, H, W] tensor."""
    import torch

    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def _to_images(latent: Any) -> Any:
    """[N, C, 1, H, W] (stacked output) -> [N, C, H, W]."""
    return latent[:, :, 0] if latent.dim() == 5 else latent


FAMILY = Family(
    name="zimage",
    model_class="diffusers:ZImageTransformer2DModel",
    configs={"tiny": ifc.config("zimage", "tiny"), "dev": ifc.config("zimage", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    latent="x",
    notes={"dev": "Z-Image size (30 main + 4 refiner blocks, width 3840), random bf16 weights; "
                  "drift's transformer-only loop is not wired for its list latents"},
)


# -- the tiny ZImagePipeline (``ditfuse generate`` / ``serve`` presets, tests) ---------------------

TINY_SEED = 0

# The byte-level tokenizer spends one token per byte; the chat template adds 19, so 128 text
# tokens keep a prompt of up to 109 bytes (the pipeline's default is 512).
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": 128}

# Tongyi-MAI/Z-Image-Turbo's scheduler_config.json: a fixed shift of 3 (no dynamic shifting; the
# pipeline passes mu, which the scheduler then ignores).
ZIMAGE_SCHEDULER: dict[str, Any] = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``ZImagePipeline`` with **random weights** (seed :data:`TINY_SEED`): its
    images are noise; it exercises the pipeline's code path (chat template, per-sample caption
    lists, CFG as a doubled batch of unequal caption lengths, the VAE decode), not image quality.
    Built offline, no download.

    Parts: ``ZImageTransformer2DModel`` from :data:`FAMILY`'s ``tiny`` config (1 noise + 1 context
    refiner and 2 main blocks, 4 latent channels, caption width 24) with RoPE tables long enough
    for :data:`TINY_CALL_KWARGS` and 2048-px images; a 2-layer ``Qwen3Model`` of width 24 (the
    pipeline reads its second-to-last hidden state); the byte-level Qwen2 tokenizer
    (:func:`ditfuse.models.tiny_parts.qwen2_tokenizer`); an ``AutoencoderKL`` with 4 latent channels,
    FLUX.1's 8x compression and latent scale / shift, at 8-16 channels; Z-Image-Turbo's
    ``FlowMatchEulerDiscreteScheduler`` (shift 3). Every call should pass :data:`TINY_CALL_KWARGS`.
    Sizes are multiples of 16 (VAE 8x, then 2x2 patches).
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from .tiny_parts import autoencoder_kl, qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    # RoPE axis 0 numbers the caption tokens (padded to a multiple of 32) then puts the image one
    # past them; axes 1 / 2 number the image's patch rows / columns (128 -> 2048 px). The tables
    # are computed on first use, not parameters: their length costs nothing.
    cfg = dict(FAMILY.config("tiny"), axes_lens=[256, 128, 128])
    text_width = cfg["cap_feat_dim"]
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=text_width,
            intermediate_size=2 * text_width,
            # hidden_states[-2] (what the pipeline reads) is then the first layer's output
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,  # grouped-query attention, as Qwen3-4B (32 / 8)
            head_dim=16,
            max_position_embeddings=2048,
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    transformer = ZImageTransformer2DModel(**cfg).eval()
    # Four resolution levels -> vae_scale_factor 8 (FLUX.1's VAE, which Z-Image uses, with its
    # latent scale and shift) at the transformer's latent channel count.
    vae = autoencoder_kl(cfg["in_channels"])
    scheduler = FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
    )
