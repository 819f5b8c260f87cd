"""LTX-Video fixtures: transformer configs and an input maker for benchmarks, drift and admission
(see ditfuse/models/families.py).

The inputs are one denoising step of diffusers 0.42.1's ``LTXPipeline`` at a WxHxFRAMES video:
the VAE compresses 32x32 pixels and 8 frames (plus the first) into one latent token of 128
channels (patch size 1), so the transformer sees ``[B, f*h*w, 128]`` packed latents with
``f = (FRAMES - 1) / 8 + 1``, ``h = H / 32``, ``w = W / 32``; ``txt_tokens`` random T5 states (the
pipeline pads to 128) with the pipeline's boolean attention mask (each prompt's real tokens, its
padding masked); a float32 timestep per sample; the latent grid as ``num_frames``/``height``/
``width``; and ``rope_interpolation_scale = (8 / frame_rate, 32, 32)`` as the pipeline computes it.

Importing this module imports neither torch nor diffusers: they are imported inside functions.
"""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size

_COMMON = dict(patch_size=1, patch_size_t=1, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
               norm_elementwise_affine=False, norm_eps=1e-6, attention_bias=True, attention_out_bias=True)
# LTX-Video 0.9.x (2B): 28 blocks, 32 heads x 64 = width 2048, T5-XXL captions (4096) projected
# to the width, so the cross-attention keys/values come in at 2048 (cross_attention_dim must equal
# the width: caption_projection outputs it); 128 latent channels in and out.
DEV = dict(_COMMON, in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=64,
           cross_attention_dim=2048, num_layers=28, caption_channels=4096)
# LTX-Video 0.9.7 / 0.9.8 13B: 48 blocks, 32 heads x 128 = width 4096, cross_attention_dim 4096.
XL_13B = dict(DEV, attention_head_dim=128, cross_attention_dim=4096, num_layers=48)
# Tiny: 2 heads x 16 = width 32 (32 % 6 = 2: the RoPE table's cos=1 / sin=0 padding is exercised),
# 2 blocks, 8 latent channels, 24-wide captions.
TINY = dict(_COMMON, in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
            cross_attention_dim=32, num_layers=2, caption_channels=24)

VAE_SPATIAL = 32
VAE_TEMPORAL = 8
FRAME_RATE = 25


def latent_grid(size: str) -> tuple[int, int, int]:
    """``"WxHxFRAMES"`` -> the latent grid ``(f, h, w)`` the pipeline's VAE gives (FRAMES = 8k+1,
    W and H multiples of 32)."""
    W, H, F = parse_size(size, 3, multiple=VAE_SPATIAL)
    if (F - 1) % VAE_TEMPORAL:
        raise ValueError(f"LTX-Video frame counts are 8k+1, got {F}")
    return (F - 1) // VAE_TEMPORAL + 1, H // VAE_SPATIAL, W // VAE_SPATIAL


def make_inputs(model: Any, batch: int = 1, size: str = "704x512x161", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 128, timestep: float = 500.0, real_tokens: int | None = None,
                frame_rate: int = FRAME_RATE, image_conditioned: bool = False) -> dict[str, Any]:
    """One forward's kwargs for a WxHxFRAMES video as ``LTXPipeline`` passes them (module
    docstring). ``real_tokens``: the unpadded length of the first prompt (default: about two
    thirds of ``txt_tokens``); each further sample has one token fewer, so CFG batches carry two
    different masks. ``image_conditioned``: as ``LTXImageToVideoPipeline`` passes them, one
    timestep per token, 0 on the first latent frame's (the image's) tokens, so the adaLN
    modulation is per token."""
    import torch

    dtype = dtype or torch.bfloat16
    f, h, w = latent_grid(size)
    cfg = model.config
    g = torch.Generator("cpu").manual_seed(seed)
    real = max(1, min(txt_tokens, real_tokens if real_tokens is not None else (2 * txt_tokens) // 3 + 1))
    mask = torch.zeros(batch, txt_tokens, dtype=torch.bool)
    for b in range(batch):
        mask[b, : max(1, real - b)] = True
    return dict(
        hidden_states=torch.randn(batch, f * h * w, cfg.in_channels, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.caption_channels, generator=g).to(device, dtype),
        timestep=(_per_token_timestep(batch, f, h * w, timestep, device) if image_conditioned
                  else torch.full((batch,), timestep, dtype=torch.float32, device=device)),
        encoder_attention_mask=mask.to(device),
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=(VAE_TEMPORAL / frame_rate, VAE_SPATIAL, VAE_SPATIAL),
        return_dict=False,
    )


def _per_token_timestep(batch: int, frames: int, tokens_per_frame: int, t: float, device: Any) -> Any:
    """[batch, frames * tokens_per_frame]: ``min(t, (1 - mask) * 1000)`` with the first frame's
    tokens conditioned (mask 1), LTXImageToVideoPipeline's timestep."""
    import torch

    mask = torch.zeros(batch, frames * tokens_per_frame)
    mask[:, :tokens_per_frame] = 1.0
    return torch.min(torch.full((batch, 1), t), (1 - mask) * 1000.0).to(device=device, dtype=torch.float32)


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device)  # LTXPipeline passes t in [0, 1000]


def _to_images(latent: Any) -> Any:
    """Packed latents [N, S, C] -> [N, C, S / d, d], d the largest divisor of S not above sqrt(S):
    a 2-D arrangement of the tokens for drift's PSNR/SSIM (the grid is not in the latent; both
    runs compared are arranged alike)."""
    n, s, c = latent.shape
    d = max(k for k in range(1, int(s ** 0.5) + 1) if s % k == 0)
    return latent.transpose(1, 2).reshape(n, c, s // d, d)


FAMILY = Family(
    name="ltx",
    model_class="diffusers:LTXVideoTransformer3DModel",
    configs={"tiny": TINY, "dev": DEV, "13b": XL_13B},
    default_size="704x512x161",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "LTX-Video 0.9.x size (28 blocks, width 2048, 128 latent channels), random bf16 weights",
           "13b": "LTX-Video 0.9.7/0.9.8 13B size (48 blocks, width 4096), random bf16 weights"},
)


# -- the tiny random-weight pipeline (the runtime's ``tiny-ltx`` preset) ------------------------------

TINY_SEED = 0
# The text length every call of the tiny pipeline pads to: LTXPipeline's own max_sequence_length
# (128). The tiny tokenizer is character-level, so a prompt costs about one token per character.
TINY_TEXT_LEN = 128
# What every call of the tiny pipeline should get (none: the pipeline's defaults fit it).
TINY_CALL_KWARGS: dict[str, Any] = {}
# The scheduler diffusers' LTX-Video checkpoints ship (scripts/convert_ltx_to_diffusers.py in
# diffusers): resolution-dependent shift between 0.95 (1024 latent tokens) and 2.05 (4096), the
# last sigma stretched to 0.1.
SCHEDULER: dict[str, Any] = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                 base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``LTXPipeline`` (text-to-video) with **random weights** (seed
    :data:`TINY_SEED`): its videos are noise; it exercises the pipeline's code path (T5 prompt
    embeddings with their padding mask, CFG batches, the packed latents, the frame-rate-scaled
    RoPE, the causal 3D VAE decode), not video quality. Built offline, no download.

    Parts: ``LTXVideoTransformer3DModel`` from :data:`FAMILY`'s ``tiny`` config (2 blocks, width
    32, 8 latent channels, 24-wide captions); a 1-layer ``T5EncoderModel`` of width 24 over the
    character-level T5 tokenizer of :mod:`ditfuse.models.tiny_parts` (128 positions);
    ``AutoencoderKLLTXVideo`` with the real layout's compression (4x4 patches and three
    spatio-temporal downsamples: 32x spatial, 8x temporal) at 8 channels, one layer per block;
    the checkpoints' ``FlowMatchEulerDiscreteScheduler`` (:data:`SCHEDULER`).

    Calls take sides in multiples of 32 and ``num_frames = 8k + 1``, as the real model's; without
    them the pipeline makes 704x512, 161 frames.
    """
    import torch
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline

    from .tiny_parts import t5_encoder, t5_tokenizer

    cfg = FAMILY.config("tiny")
    tokenizer = t5_tokenizer(TINY_TEXT_LEN)
    torch.manual_seed(TINY_SEED)
    text_encoder = t5_encoder(tokenizer, cfg["caption_channels"], d_ff=2 * cfg["caption_channels"])
    transformer = FAMILY.load_class()(**cfg).eval()
    # the real VAE's down/up layout (four levels, the first three downsampling space and time,
    # 4x4 pixel patches) at 8 channels; its latent width is the transformer's input width
    vae = AutoencoderKLLTXVideo(
        latent_channels=cfg["in_channels"], block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
    ).eval()
    # LTXPipeline reads these two for the latent grid, and the runtime for its 8k + 1 frame rule
    if (vae.spatial_compression_ratio, vae.temporal_compression_ratio) != (VAE_SPATIAL, VAE_TEMPORAL):
        raise RuntimeError(f"tiny LTX VAE compresses {vae.spatial_compression_ratio}x / "
                           f"{vae.temporal_compression_ratio}x, not {VAE_SPATIAL}x / {VAE_TEMPORAL}x")
    return LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_tiny_i2v_pipeline() -> Any:
    """The tiny LTX-Video pipeline of :func:`build_tiny_pipeline` (the same parts and weights) as
    a diffusers ``LTXImageToVideoPipeline``: every prompt's clip starts from its own image, whose
    VAE latents condition the first latent frame (per-token timesteps: the conditioned tokens stay
    at t = 0). Random weights: its videos are noise."""
    from diffusers import LTXImageToVideoPipeline

    t2v = build_tiny_pipeline()
    return LTXImageToVideoPipeline(**{name: getattr(t2v, name) for name in
                                      ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")})


# The scheduler LTX-Video 0.9.5 and later checkpoints ship (the ones LTXConditionPipeline is made
# for): SCHEDULER without dynamic shifting. LTXConditionPipeline's call passes its own
# linear-quadratic timesteps and no ``mu``, which a dynamically shifting scheduler refuses
# ("`mu` must be passed when `use_dynamic_shifting` is set to be `True`").
CONDITION_SCHEDULER: dict[str, Any] = dict(SCHEDULER, use_dynamic_shifting=False)


def build_tiny_condition_pipeline() -> Any:
    """The tiny LTX-Video pipeline of :func:`build_tiny_pipeline` (the same transformer, VAE, text
    encoder and tokenizer, the same weights) as a diffusers ``LTXConditionPipeline`` (LTX-Video
    0.9.5+'s pipeline: text-to-video, or conditioned on images / videos at frame indices), with
    :data:`CONDITION_SCHEDULER`. An image condition at frame 0 is VAE-encoded, its latents replace
    the first latent frame and its tokens keep timestep 0 (per-token timesteps), as for
    ``LTXImageToVideoPipeline``. The VAE is tiny-ltx's, without the timestep conditioning of the
    0.9.5+ VAEs (the call then decodes without a timestep). Random weights: its videos are noise."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXConditionPipeline

    t2v = build_tiny_pipeline()
    return LTXConditionPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**CONDITION_SCHEDULER),
                                **{name: getattr(t2v, name) for name in ("vae", "text_encoder", "tokenizer", "transformer")})
