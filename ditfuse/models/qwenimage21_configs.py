"""Qwen-Image 2.1 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's QwenImage21Transformer2DModel defaults (32 single-stream blocks,
width 4096, SwiGLU 12288, VLM text width 4096), ``tiny`` for tests. A step is what the pipeline
runs after its first: the KV-cached decode (``kv_cache_mode="cached"``), in which only the target
image's (H/16)(W/16) tokens go through the blocks and attend to the cached text keys. The input
maker therefore runs the model once in ``extract`` mode to fill a ``QwenImage21KVCache`` from
``txt_tokens`` random VLM states (512 assumed), and returns the cached step's inputs;
``mode="prefill"`` returns the uncached step (``use_kv_cache=False``: text and image tokens
through every block, the block-causal prefill). :func:`build_tiny_pipeline`: a complete
random-weight ``QwenImage21Pipeline`` around the ``tiny`` transformer (presets, tests).
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family, parse_size
from .flux_configs import _timestep


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512, mode: str = "cached", cond: int = 0) -> dict[str, Any]:
    """One step's forward kwargs (module docstring). ``cond``: a square condition image of that
    side in latent tokens (an edit step), none by default."""
    import torch
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    if mode not in ("cached", "prefill"):
        raise ValueError(f"mode must be 'cached' or 'prefill', got {mode!r}")
    W, H = parse_size(size, 2)
    kw = ifc.step_inputs("qwenimage21", model, batch=batch, height=H, width=W, text_tokens=txt_tokens,
                         dtype=dtype or torch.bfloat16, device="cpu", seed=seed + 1, cond_tokens=cond)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    if mode == "prefill":
        return kw
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    with torch.no_grad():
        model(**kw, kv_cache=cache, kv_cache_mode="extract")
    return dict(kw, kv_cache=cache, kv_cache_mode="cached")


def _to_images(latent: Any) -> Any:
    """[N, h*w, 64] packed 2x2 patches -> [N, 16, 2h, 2w]."""
    return ifc.unpack_2x2(latent)


FAMILY = Family(
    name="qwenimage21",
    model_class="diffusers:QwenImage21Transformer2DModel",
    configs={"tiny": ifc.config("qwenimage21", "tiny"), "dev": ifc.config("qwenimage21", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Qwen-Image 2.1 size as diffusers 0.42.1 declares it (32 single-stream blocks, width 4096), "
                  "random bf16 weights; the KV-cached decode step"},
)


# -- the tiny QwenImage21Pipeline (``ditfuse generate`` / ``serve`` presets, tests) ----------------

TINY_SEED = 0

# ``output_resolution`` is the side of the square the pipeline makes when the call gives no
# height / width (explicit ones win), and the side of the area every condition image is resized
# to (height / width do not change that): 256 keeps an edit's condition tokens tiny (the default
# 1024 makes 4096 of them). ``use_kv_cache`` is the default, pinned: caching the text and condition
# keys after the first step changes the rounding, so a sample is reproducible only at a fixed value.
TINY_CALL_KWARGS: dict[str, Any] = {"output_resolution": 256, "use_kv_cache": True}

# Qwen/Qwen-Image's scheduler_config.json (2.1's own is not available offline): the shift grows
# with the image's token count (exponential time shift, mu from 0.5 at 256 tokens to 0.9 at 8192),
# stretched to end at 0.02. The pipeline passes ``mu``, so the dynamic shift is required.
_SCHEDULER: dict[str, Any] = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
)


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``QwenImage21Pipeline`` with **random weights** (seed
    :data:`TINY_SEED`): its images are noise; it exercises the pipeline's code path (the raw
    prompt template and its system-token drop, the Qwen3-VL pre-norm hidden states, the
    block-causal prefill and KV-cached decode, true CFG, condition images through the vision
    tower and the VAE), not image quality. Built offline, no download.

    Parts: ``QwenImage21Transformer2DModel`` from :data:`FAMILY`'s ``tiny`` config (3
    single-stream blocks, 16 latent channels, VLM width 24); a ``Qwen3VLForConditionalGeneration``
    with a 2-layer text model of width 24 (Qwen3-VL's interleaved multimodal RoPE) and a 1-block
    vision tower (run only for condition images); a ``Qwen3VLProcessor`` of the byte-level Qwen2
    tokenizer (:func:`ditfuse.models.tiny_parts.qwen2_tokenizer`, its chat template), a Qwen2-VL
    image processor with Qwen3-VL's 16-pixel patches and Qwen3-VL's video processor (defaults);
    ``AutoencoderKLQwenImage21`` (RGBA in and out, 16x spatial compression) with 16 latent
    channels at 8 base channels and identity latent statistics; Qwen-Image's dynamic-shift
    ``FlowMatchEulerDiscreteScheduler``; no ``sample_sigmas``, so ``num_inference_steps`` counts.

    Every call should pass :data:`TINY_CALL_KWARGS`. Sizes are floored to multiples of 32
    (16x VAE, then 2x2 latent groups per VLM slot). Outputs are RGBA: PIL images of mode
    ``RGBA``, ``np`` arrays [B, H, W, 4]. Needs torchvision: transformers builds no
    ``Qwen3VLProcessor`` without a video processor, and its video processors need torchvision.
    """
    import torch
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    from .tiny_parts import QWEN2_CHAT_TEMPLATE, qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    tid = tokenizer.convert_tokens_to_ids
    # Qwen3-VL's patch geometry (the Qwen2-VL processor's default patch is 14): 16-pixel
    # patches merged 2x2, 2 frames per temporal patch, as the vision tower below
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=QWEN2_CHAT_TEMPLATE,
    )
    cfg = FAMILY.config("tiny")
    width = cfg["context_in_dim"]
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=width,
                intermediate_size=2 * width,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,  # grouped-query attention, as the real Qwen3-VL
                head_dim=width // 2,
                max_position_embeddings=4096,
                # head dim 12: the multimodal RoPE's (t, h, w) sections must cover its 6 pairs
                rope_parameters=dict(rope_type="default", rope_theta=5000000.0, mrope_section=[2, 2, 2],
                                     mrope_interleaved=True),
                pad_token_id=tokenizer.pad_token_id,
            ),
            # its output width is the text width; its one layer's deepstack features are added
            # after the first text layer; 64 learned positions (an 8x8 grid, interpolated to any
            # image's patch grid)
            vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                temporal_patch_size=2, out_hidden_size=width, num_position_embeddings=64,
                deepstack_visual_indexes=[0],
            ),
            image_token_id=tid("<|image_pad|>"),
            video_token_id=tid("<|video_pad|>"),
            vision_start_token_id=tid("<|vision_start|>"),
            vision_end_token_id=tid("<|vision_end|>"),
        )
    ).eval()
    transformer = QwenImage21Transformer2DModel(**cfg).eval()
    # 5 stages (4 spatial downsamples: 16x, as the real VAE) at 8 channels; the latent width is
    # the transformer's input width (the pipeline un-packs with it)
    z_dim = cfg["in_channels"]
    vae = AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    ).eval()
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
    )
