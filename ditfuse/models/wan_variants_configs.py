"""Fixtures for Wan's "Copied from" transformers (models/wan_variants.py): ChronoEdit, SkyReels-V2,
Wan-Animate. Configs and one denoising step's inputs, as wan_configs.py does for Wan; and the
tiny random-weight ``SkyReelsV2Pipeline`` and ``SkyReelsV2ImageToVideoPipeline`` behind the
runtime's ``tiny-skyreels-v2`` and ``tiny-skyreels-v2-i2v`` presets (:func:`build_tiny_pipeline`,
:func:`build_tiny_i2v_pipeline`).

Where the numbers come from:

- ChronoEdit ``dev``: ChronoEdit-14B, Wan2.1-I2V-14B's geometry (40 blocks, 40 heads x 128 = 5120,
  ffn 13824, 36 input channels, CLIP image embeddings 1280 through added k/v 5120), as in a
  published copy of its transformer config (huggingface.co/NopenAI/nv-chronoedit,
  transformer/config.json, saved as WanTransformer3DModel); ``rope_temporal_skip_len`` is
  ChronoEditTransformer3DModel's default (8). Not checked against nvidia/ChronoEdit-14B-Diffusers'
  own config.json (not reachable from here).
- SkyReels-V2 ``dev``: the 1.3B models (e.g. SkyReels-V2-DF-1.3B-540P) are Wan2.1-T2V-1.3B-sized
  (30 blocks, 12 heads x 128 = 1536, ffn 8960) per the SkyReels-V2 release; ``14b``: Wan 14B
  geometry (40 blocks, 5120, ffn 13824). Both assumed from the Wan base models, not read from the
  published config.json files (not reachable from here). diffusers' own defaults (16 heads, ffn
  8192, 32 blocks) match no published checkpoint we know of, so they are not used.
- Wan-Animate ``dev``: WanAnimateTransformer3DModel's defaults in diffusers 0.42.1 (its docstring
  describes Wan2.2-Animate-14B: 40 blocks, 5120, ffn 13824, 36 = 2 x 16 + 4 input channels, CLIP
  1280, a 512 px face motion encoder, a face adapter every 5 blocks). Not checked against
  Wan-AI/Wan2.2-Animate-14B-Diffusers' config.json.

Importing this module imports neither torch nor diffusers: they are imported inside functions.
"""

from __future__ import annotations

from typing import Any

from . import wan_configs
from .families import Family, parse_size

_WAN = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
_WAN_14B = dict(_WAN, num_attention_heads=40, ffn_dim=13824, num_layers=40)
_TINY = dict(wan_configs.TINY)  # 2 heads x 16, 2 blocks, cross_attn_norm

# -- ChronoEdit --------------------------------------------------------------------------------

CHRONOEDIT_DEV = dict(_WAN_14B, in_channels=36, out_channels=16, image_dim=1280, added_kv_proj_dim=5120,
                      rope_temporal_skip_len=8)
CHRONOEDIT_TINY = dict(_TINY, in_channels=8, out_channels=4, image_dim=24, added_kv_proj_dim=32,
                       rope_temporal_skip_len=8)

# -- SkyReels-V2 -------------------------------------------------------------------------------

SKYREELS_DEV = dict(_WAN, num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960, num_layers=30)
SKYREELS_14B = dict(_WAN_14B, in_channels=16, out_channels=16)
SKYREELS_TINY = dict(_TINY)
# diffusion forcing with a causal mask over blocks of 2 latent frames (the pipelines'
# causal_block_size, set through _set_ar_attention -> num_frame_per_block)
SKYREELS_TINY_DF = dict(_TINY, num_frame_per_block=2)

# -- Wan-Animate -------------------------------------------------------------------------------

ANIMATE_DEV = dict(_WAN_14B, in_channels=36, latent_channels=16, out_channels=16, image_dim=1280,
                   motion_encoder_size=512, motion_style_dim=512, motion_dim=20, motion_encoder_dim=512,
                   face_encoder_hidden_dim=1024, face_encoder_num_heads=4, inject_face_latents_blocks=5)
# 4 blocks, a face adapter after blocks 0 and 2; a 4 px face encoder (conv_in + conv_out, no res
# blocks) with 8 channels.
ANIMATE_TINY = dict(_TINY, num_layers=4, in_channels=12, latent_channels=4, out_channels=4, image_dim=24,
                    motion_encoder_size=4, motion_encoder_channel_sizes={"4": 8}, motion_style_dim=16, motion_dim=4,
                    motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=2,
                    inject_face_latents_blocks=2, motion_encoder_batch_size=4)


def chronoedit_inputs(model: Any, batch: int = 1, size: str = "832x480x5", seed: int = 0, device: str = "cuda",
                      dtype: Any = None, txt_tokens: int = 512, timestep: float = 500.0, **kw: Any) -> dict[str, Any]:
    """Wan's inputs (wan_configs.make_inputs) at ChronoEdit's default of 5 frames (2 latent
    frames: the input image and the edit)."""
    return wan_configs.make_inputs(model, batch, size, seed, device, dtype, txt_tokens, timestep, **kw)


def skyreels_inputs(model: Any, batch: int = 1, size: str = "960x544x97", seed: int = 0, device: str = "cuda",
                    dtype: Any = None, txt_tokens: int = 512, timestep: float = 500.0,
                    diffusion_forcing: bool | None = None) -> dict[str, Any]:
    """Wan's inputs at SkyReels-V2's 540p x 97 frames; with diffusion forcing (the default when
    the config has ``num_frame_per_block > 1``) a per-latent-frame timestep [B, f] (the frames of
    later causal blocks noisier) and ``enable_diffusion_forcing=True``."""
    import torch

    kw = wan_configs.make_inputs(model, batch, size, seed, device, dtype, txt_tokens, timestep)
    if diffusion_forcing is None:
        diffusion_forcing = model.config.num_frame_per_block > 1
    if diffusion_forcing:
        f = kw["hidden_states"].shape[2] // model.config.patch_size[0]
        ramp = torch.linspace(0.25, 1.0, f, device=device)
        kw["timestep"] = (timestep * ramp).expand(batch, f).contiguous()
        kw["enable_diffusion_forcing"] = True
    return kw


def animate_inputs(model: Any, batch: int = 1, size: str = "832x480x77", seed: int = 0, device: str = "cuda",
                   dtype: Any = None, txt_tokens: int = 512, timestep: float = 500.0,
                   image_tokens: int = 257) -> dict[str, Any]:
    """One Wan-Animate step for a FRAMES-frame segment (the pipeline's 77): latents with the
    reference frame in front ([B, 2C + 4, T + 1, h, w], T = (FRAMES - 1) / 4 + 1), pose latents
    [B, C, T, h, w], the face video [B, 3, FRAMES, s, s] at the motion encoder's size s, CLIP
    image embeddings and UMT5 text embeddings."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    if (F - 1) % 4:
        raise ValueError(f"Wan frame counts are 4k+1, got {F}")
    cfg = model.config
    t, h, w = (F - 1) // 4 + 1, H // 8, W // 8
    g = torch.Generator("cpu").manual_seed(seed)
    s = cfg.motion_encoder_size
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, t + 1, h, w, generator=g).to(device, dtype),
        pose_hidden_states=torch.randn(batch, cfg.latent_channels, t, h, w, generator=g).to(device, dtype),
        face_pixel_values=torch.randn(batch, 3, F, s, s, generator=g).clamp(-1, 1).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_dim, generator=g).to(device, dtype),
        encoder_hidden_states_image=torch.randn(batch, image_tokens, cfg.image_dim, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device),
        return_dict=False,
    )


def _to_images(latent: Any) -> Any:
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


CHRONOEDIT = Family(
    name="chronoedit",
    model_class="diffusers:ChronoEditTransformer3DModel",
    configs={"tiny": CHRONOEDIT_TINY, "dev": CHRONOEDIT_DEV},
    default_size="832x480x5",
    make_inputs=chronoedit_inputs,
    timestep=wan_configs._timestep,
    to_images=_to_images,
    notes={"dev": "ChronoEdit-14B size (Wan2.1-I2V-14B geometry: 40 blocks, width 5120), random bf16 weights"},
)

SKYREELS_V2 = Family(
    name="skyreels_v2",
    model_class="diffusers:SkyReelsV2Transformer3DModel",
    configs={"tiny": SKYREELS_TINY, "tiny-df": SKYREELS_TINY_DF, "dev": SKYREELS_DEV, "14b": SKYREELS_14B},
    default_size="960x544x97",
    make_inputs=skyreels_inputs,
    timestep=wan_configs._timestep,
    to_images=_to_images,
    notes={"dev": "SkyReels-V2 1.3B size (Wan2.1-1.3B geometry: 30 blocks, width 1536, ffn 8960), random bf16 weights",
           "14b": "SkyReels-V2 14B size (40 blocks, width 5120, ffn 13824)"},
)

WAN_ANIMATE = Family(
    name="wan_animate",
    model_class="diffusers:WanAnimateTransformer3DModel",
    configs={"tiny": ANIMATE_TINY, "dev": ANIMATE_DEV},
    default_size="832x480x77",
    make_inputs=animate_inputs,
    timestep=wan_configs._timestep,
    to_images=_to_images,
    notes={"dev": "Wan2.2-Animate-14B size (diffusers' defaults: 40 blocks, width 5120, face adapter every 5), "
                  "random bf16 weights"},
)


# -- the tiny SkyReels-V2 text-to-video pipeline (the runtime's ``tiny-skyreels-v2`` preset) ------

# What every call of the tiny pipeline gets (runtime/presets.py reads this module's
# TINY_CALL_KWARGS; SkyReels-V2's is the only tiny pipeline built here): tiny-wan's short text
# length instead of the pipeline's 512 (the tokenizer is character-level, 128 is plenty).
TINY_CALL_KWARGS: dict[str, Any] = {"max_sequence_length": wan_configs.TINY_WAN_TEXT_LEN}
# The flow shift diffusers' SkyReelsV2Pipeline docstring example sets for the T2V models (5.0 is
# its I2V value); the published scheduler config is not reachable from here.
SKYREELS_T2V_FLOW_SHIFT = 8.0
# SKYREELS_TINY at the tiny Wan VAE's 16 latent channels, with tiny-wan's RoPE table length
# (256 positions: sides up to 4096 px, up to 1021 frames) so every size the runtime accepts runs;
# the family's tiny config (64 positions) is sized for one step's inputs only.
SKYREELS_TINY_PIPELINE = dict(SKYREELS_TINY, in_channels=16, out_channels=16, rope_max_seq_len=256)


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``SkyReelsV2Pipeline`` (text-to-video) with **random weights**: its
    videos are noise; it exercises the pipeline's code path (UMT5 prompt embeddings, CFG batches,
    the UniPC flow-matching steps, the causal 3D VAE decode), not video quality. Built offline,
    no download.

    Parts: tiny-wan's (``wan_configs.build_tiny_wan_like``: the character-level T5 tokenizer,
    a 1-layer UMT5 encoder of width 32, the tiny ``AutoencoderKLWan`` with Wan 2.1's 8x spatial
    and 4x temporal compression, UniPC with flow sigmas) around a ``SkyReelsV2Transformer3DModel``
    of :data:`SKYREELS_TINY_PIPELINE` (the ``skyreels_v2`` family's tiny config: 2 blocks, 2 heads
    x 16, no diffusion forcing, no fps embedding), scheduler shift :data:`SKYREELS_T2V_FLOW_SHIFT`.

    Calls take sides in multiples of 16 and ``num_frames = 4k + 1``, as the real model's.
    """
    from diffusers import SkyReelsV2Pipeline

    cls = SKYREELS_V2.load_class()
    return wan_configs.build_tiny_wan_like(SkyReelsV2Pipeline, lambda: cls(**SKYREELS_TINY_PIPELINE),
                                           flow_shift=SKYREELS_T2V_FLOW_SHIFT)


# -- the tiny SkyReels-V2 image-to-video pipeline (the runtime's ``tiny-skyreels-v2-i2v`` preset) --

# The flow shift diffusers' SkyReelsV2ImageToVideoPipeline docstring example sets for the I2V
# models ("8.0 for T2V, 5.0 for I2V"); the published scheduler configs are not reachable from here.
SKYREELS_I2V_FLOW_SHIFT = 5.0
# The I2V layout (diffusers' conversion script's SkyReels-V2-I2V config: Wan2.1-I2V-14B's, 36 input
# channels, CLIP image_dim with added k/v as wide as the model, no fps embedding, no diffusion
# forcing) on the text-to-video pipeline's tiny transformer.
SKYREELS_TINY_I2V_PIPELINE = wan_configs.tiny_i2v_transformer_config(SKYREELS_TINY_PIPELINE)


def build_tiny_i2v_pipeline(flf2v: bool = False) -> Any:
    """A complete diffusers ``SkyReelsV2ImageToVideoPipeline`` with **random weights** (its videos
    are noise), built offline: :func:`build_tiny_pipeline`'s tokenizer, text encoder and VAE (the
    same weights), a UniPC scheduler of the same config at :data:`SKYREELS_I2V_FLOW_SHIFT` (the
    recipe of diffusers' I2V example), tiny-wan-i2v's CLIP vision encoder and image processor
    (``wan_configs.tiny_clip_image_parts``) and a ``SkyReelsV2Transformer3DModel`` of
    :data:`SKYREELS_TINY_I2V_PIPELINE`.

    The transformer carries the text-to-video transformer's weights wherever the layouts agree
    (every block's self- and cross-attention, feed-forward and modulation, the time and text
    embedders, the output head); what image-to-video adds (the 36-channel patch embedding, the
    image embedder, the cross-attentions' added k/v and their norm) is drawn from its own seed,
    as are the CLIP encoder's weights, after the text-to-video parts, which they leave as they are.

    ``flf2v``: the transformer also has the first-last-frame image position embedding
    (``pos_embed_seq_len``: two images' CLIP tokens), drawn from its own seed after the build
    (``wan_configs.draw_flf2v_pos_embed``); every other weight is the same. Such a checkpoint takes
    the call's ``last_image``, and needs it (:func:`build_tiny_flf2v_pipeline`).
    """
    import torch
    from diffusers import SkyReelsV2ImageToVideoPipeline, UniPCMultistepScheduler

    t2v = build_tiny_pipeline()
    torch.manual_seed(wan_configs.TINY_WAN_SEED + 1)
    cfg = dict(SKYREELS_TINY_I2V_PIPELINE)
    if flf2v:  # a zero-initialised parameter: the random draws below are the I2V build's
        cfg["pos_embed_seq_len"] = 2 * wan_configs.TINY_CLIP_TOKENS
    transformer = SKYREELS_V2.load_class()(**cfg).eval()
    own = transformer.state_dict()
    shared = {k: v for k, v in t2v.transformer.state_dict().items() if k in own and own[k].shape == v.shape}
    transformer.load_state_dict(shared, strict=False)
    image_parts = wan_configs.tiny_clip_image_parts()
    scheduler = UniPCMultistepScheduler.from_config(t2v.scheduler.config, flow_shift=SKYREELS_I2V_FLOW_SHIFT)
    if flf2v:
        wan_configs.draw_flf2v_pos_embed(transformer)
    return SkyReelsV2ImageToVideoPipeline(tokenizer=t2v.tokenizer, text_encoder=t2v.text_encoder, vae=t2v.vae,
                                          scheduler=scheduler, transformer=transformer, **image_parts)


def build_tiny_flf2v_pipeline() -> Any:
    """:func:`build_tiny_i2v_pipeline` with the first-last-frame image position embedding: a
    ``SkyReelsV2ImageToVideoPipeline`` whose every call takes a first and a last image. Random
    weights: its videos are noise."""
    return build_tiny_i2v_pipeline(flf2v=True)
