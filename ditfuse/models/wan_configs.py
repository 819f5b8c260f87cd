"""Wan 2.1 / 2.2 fixtures: transformer configs and an input maker for benchmarks, drift and
admission (see ditfuse/models/families.py), the tiny ``WanPipeline`` behind the ``tiny-wan``
preset, and the tiny Wan 2.1 I2V and Wan 2.2 (TI2V-5B, A14B) pipelines behind ``tiny-wan-i2v``
and ``tiny-wan22-*``.

``build_tiny_wan()`` builds a complete diffusers ``WanPipeline`` (WanTransformer3DModel,
AutoencoderKLWan, UMT5 text encoder, T5 tokenizer, UniPC flow-matching scheduler: the component
classes of ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``) in memory from small configs with **random
weights** from a fixed seed. Its videos are noise: it exercises the code path (shapes, the 4k+1
frame rule, CFG, batching, the causal 3D VAE decode, MP4 encoding), not video quality.

Importing this module imports neither torch nor diffusers: they are imported inside functions.
"""

from __future__ import annotations

from typing import Any, Callable

from .families import Family, parse_size

_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan2.1-T2V-1.3B: 30 blocks, width 1536 (12 heads x 128), ffn 8960.
DEV = dict(_COMMON, num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960, num_layers=30)
# Wan2.2-TI2V-5B: 30 blocks, width 3072 (24 heads), ffn 14336, 48 latent channels (VAE 4x16x16).
TI2V_5B = dict(_COMMON, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30)
# Wan2.1-T2V-14B, and each expert of Wan2.2-T2V-A14B: 40 blocks, width 5120 (40 heads), ffn 13824.
T2V_14B = dict(_COMMON, num_attention_heads=40, in_channels=16, out_channels=16, ffn_dim=13824, num_layers=40)
# Wan2.1-I2V-14B-480P: 40 blocks, width 5120, image embeddings (CLIP 1280) through added k/v.
I2V_14B = dict(_COMMON, num_attention_heads=40, in_channels=36, out_channels=16, ffn_dim=13824, num_layers=40,
               image_dim=1280, added_kv_proj_dim=5120)
# Tiny: 2 heads x 16, 2 blocks, every block type (cross_attn_norm True).
TINY = dict(_COMMON, attention_head_dim=16, num_attention_heads=2, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=16, ffn_dim=64, num_layers=2, rope_max_seq_len=64)
TINY_I2V = dict(TINY, in_channels=8, image_dim=24, added_kv_proj_dim=32)

# Spatial compression of the VAE each config expects (Wan 2.1 VAE 8x8, Wan 2.2 VAE 16x16), and
# the temporal one (4 frames per latent frame, plus the first).
_SPATIAL = {"ti2v-5b": 16}


def make_inputs(model: Any, batch: int = 1, size: str = "832x480x81", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512, timestep: float = 500.0, spatial: int | None = None,
                per_token_timestep: bool | None = None, image_tokens: int = 257) -> dict[str, Any]:
    """One forward's kwargs for a WxHxFRAMES video: latents [B, C, (F-1)/4+1, H/s, W/s] (s = 8,
    or 16 for the 48-channel Wan 2.2 VAE), ``txt_tokens`` random UMT5 embeddings (Wan's 512),
    image embeddings for I2V configs, and a per-token timestep [B, seq] when
    ``per_token_timestep`` (default: for the 48-channel TI2V-5B layout, whose pipeline runs
    with ``expand_timesteps=True``; one timestep per sample otherwise)."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    cfg = model.config
    s = spatial or (16 if cfg.in_channels == 48 else 8)
    if per_token_timestep is None:
        per_token_timestep = cfg.in_channels == 48
    if (F - 1) % 4:
        raise ValueError(f"Wan frame counts are 4k+1, got {F}")
    f, h, w = (F - 1) // 4 + 1, H // s, W // s
    g = torch.Generator("cpu").manual_seed(seed)
    kw = dict(
        hidden_states=torch.randn(batch, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_dim, generator=g).to(device, dtype),
        return_dict=False,
    )
    if per_token_timestep:
        p = cfg.patch_size
        seq = (f // p[0]) * (h // p[1]) * (w // p[2])
        kw["timestep"] = torch.full((batch, seq), timestep, device=device)
    else:
        kw["timestep"] = torch.full((batch,), timestep, device=device)
    if cfg.image_dim is not None:
        kw["encoder_hidden_states_image"] = torch.randn(batch, image_tokens, cfg.image_dim, generator=g).to(device, dtype)
    return kw


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device)  # WanPipeline passes t in [0, 1000]


def _to_images(latent: Any) -> Any:
    """[N, C, F, h, w] -> the frames as [N * F, C, h, w]."""
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


FAMILY = Family(
    name="wan",
    model_class="diffusers:WanTransformer3DModel",
    configs={"tiny": TINY, "tiny-i2v": TINY_I2V, "dev": DEV, "ti2v-5b": TI2V_5B, "t2v-14b": T2V_14B,
             "i2v-14b": I2V_14B},
    default_size="832x480x81",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Wan2.1-T2V-1.3B size (30 blocks, width 1536, ffn 8960), random bf16 weights",
           "ti2v-5b": "Wan2.2-TI2V-5B size (30 blocks, width 3072, 48 latent channels; per-token timesteps)",
           "t2v-14b": "Wan2.1-T2V-14B / one Wan2.2-T2V-A14B expert size (40 blocks, width 5120, ffn 13824)",
           "i2v-14b": "Wan2.1-I2V-14B-480P size (40 blocks, width 5120, CLIP image tokens)"},
)


# ------------------------------------------------------------------------------ the tiny-wan preset

TINY_WAN_SEED = 0
# The tokenizer is character-level, so a prompt costs about one token per character; Wan 2.1
# uses 512 positions, 128 is plenty here.
TINY_WAN_TEXT_LEN = 128
# Wan 2.1's frame rate: its clips are 81 frames = 5 s at 16 fps.
WAN_FPS = 16


# tiny-wan's transformer: Wan 2.1's layout in miniature (16 latent channels, 1x2x2 patches, head
# dim 12 so RoPE axes t/h/w = 4/4/4, QK RMSNorm across heads, cross-attention norm), 1 block. Its
# RoPE table covers 2048 px / 8 / 2 = 128 patches per side and 241 frames (61 latent frames).
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
    text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=256,
)


def build_tiny_wan() -> Any:
    """Build the tiny WanPipeline in memory (random weights, seed ``TINY_WAN_SEED``)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    return build_tiny_wan_like(WanPipeline, lambda: WanTransformer3DModel(**TINY_WAN_TRANSFORMER))


def build_tiny_wan_i2v() -> Any:
    """Build the tiny WanImageToVideoPipeline in memory (random weights, seed ``TINY_WAN_SEED``):
    Wan 2.1 image-to-video in miniature. tiny-wan's parts plus a CLIP vision encoder
    (:func:`tiny_clip_image_parts`, drawn after the VAE) whose second-to-last hidden states are the
    image tokens, and a transformer (:func:`tiny_i2v_transformer_config` of tiny-wan's) that reads
    them through the I2V image embedder and the added k/v of its cross-attention. Its input is
    Wan 2.1 I2V's: 16 noise channels, the 4-channel first-frame mask and the image's 16 latent
    channels (36)."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    i2v = tiny_i2v_transformer_config(TINY_WAN_TRANSFORMER)
    return build_tiny_wan_like(WanImageToVideoPipeline, lambda: WanTransformer3DModel(**i2v),
                               extra=tiny_clip_image_parts)


def build_tiny_wan_flf2v() -> Any:
    """Wan 2.1 first-last-frame-to-video in miniature (Wan2.1-FLF2V-14B-720P's layout, served by
    ``WanImageToVideoPipeline`` with ``last_image``): :func:`build_tiny_wan_i2v`'s pipeline and
    weights, whose transformer also has the FLF2V image position embedding
    (``pos_embed_seq_len`` = two images' CLIP tokens: the call encodes the first and the last image
    and the image embedder folds their tokens into one sequence per video). The embedding is
    drawn from its own seed after the build (diffusers initialises it to zeros, which would leave
    the two images' tokens unmarked). Such a checkpoint needs a last image on every call. Random
    weights: its videos are noise."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    flf2v = dict(tiny_i2v_transformer_config(TINY_WAN_TRANSFORMER), pos_embed_seq_len=2 * TINY_CLIP_TOKENS)
    pipe = build_tiny_wan_like(WanImageToVideoPipeline, lambda: WanTransformer3DModel(**flf2v),
                               extra=tiny_clip_image_parts)
    draw_flf2v_pos_embed(pipe.transformer)
    return pipe


def draw_flf2v_pos_embed(transformer: Any) -> None:
    """Give a tiny first-last-frame transformer's image position embedding (zeros as diffusers
    builds it) random values from its own seed (``TINY_WAN_SEED + 2``), leaving every other weight."""
    import torch

    pos = transformer.condition_embedder.image_embedder.pos_embed
    gen = torch.Generator().manual_seed(TINY_WAN_SEED + 2)
    with torch.no_grad():
        pos.copy_(torch.randn(pos.shape, generator=gen, dtype=pos.dtype))


# The tiny I2V pipelines' CLIP width (their transformers' image_dim).
TINY_CLIP_WIDTH = 16
# The image tokens its encoder gives per image: a 32-px crop in 8-px patches (16) and the class
# token (tiny_clip_image_parts).
TINY_CLIP_TOKENS = (32 // 8) ** 2 + 1
# Wan 2.1 I2V's (and Wan 2.2 I2V-A14B's) transformer input on the Wan 2.1 VAE: 16 noise channels,
# the 4-channel first-frame mask and the image's 16 latent channels.
WAN21_I2V_IN_CHANNELS = 16 + 4 + 16


def tiny_i2v_transformer_config(t2v: dict[str, Any]) -> dict[str, Any]:
    """Wan 2.1 I2V's transformer layout on a tiny text-to-video config (a WanTransformer3DModel's
    or one of its copies', e.g. SkyReels-V2's): 16 noise + 4 first-frame-mask + 16 image-latent
    input channels (36, for the tiny Wan VAE's 16 latent channels), the CLIP image tokens of
    :func:`tiny_clip_image_parts` (``image_dim``) read through added k/v as wide as the model, as
    Wan2.1-I2V-14B's 1280 -> 5120."""
    return dict(t2v, in_channels=WAN21_I2V_IN_CHANNELS, image_dim=TINY_CLIP_WIDTH,
                added_kv_proj_dim=t2v["num_attention_heads"] * t2v["attention_head_dim"])


def tiny_clip_image_parts() -> dict[str, Any]:
    """The tiny I2V pipelines' image components (draws from torch's global generator): a CLIP
    vision encoder (2 layers, width :data:`TINY_CLIP_WIDTH`, 32-px crops in 8-px patches: 16 patch
    tokens and the class token) whose second-to-last hidden states the pipelines take as image
    tokens (``encode_image``), and its image processor (resize to 32, centre-crop 32x32)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=TINY_CLIP_WIDTH, intermediate_size=2 * TINY_CLIP_WIDTH, num_hidden_layers=2,
        num_attention_heads=2, image_size=32, patch_size=8,
    )).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return {"image_encoder": encoder, "image_processor": processor}


def build_tiny_wan_like(pipeline_class: type, make_transformer: Callable[[], Any], flow_shift: float = 3.0,
                        extra: "Callable[[], dict[str, Any]] | None" = None,
                        make_vae: "Callable[[], Any] | None" = None) -> Any:
    """A ``pipeline_class`` built from the tiny Wan parts around ``make_transformer()``: the
    character-level T5 tokenizer (:data:`TINY_WAN_TEXT_LEN` positions), a 1-layer UMT5 encoder of
    width 32, the transformer, the tiny ``AutoencoderKLWan`` (16 latent channels, 8x spatial and
    4x temporal compression) and UniPC with flow-matching sigmas at ``flow_shift``. For the
    pipelines diffusers builds on Wan's components (``WanPipeline``, ``SkyReelsV2Pipeline``):
    their ``__init__`` takes exactly these five. The transformer must read 32-wide text states and
    16 latent channels. ``extra()`` builds further components the class takes (drawn after the
    VAE, so they leave the five parts' weights as they are), and may name pipeline config
    arguments too (``boundary_ratio``, ``expand_timesteps``). ``make_vae()`` replaces the tiny Wan
    2.1 VAE (Wan 2.2 TI2V-5B's 48-channel VAE: :func:`tiny_wan22_vae`); the transformer must then
    read that VAE's latent channels.

    Random weights from ``torch.manual_seed(TINY_WAN_SEED)``, drawn in a fixed order (text
    encoder, transformer, VAE): the same ``make_transformer`` gives the same pipeline, and
    ``tiny-wan``'s weights are what they were before this helper existed."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from .tiny_parts import t5_tokenizer

    tokenizer = t5_tokenizer(TINY_WAN_TEXT_LEN)
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
    transformer = make_transformer().eval()
    # The Wan 2.1 VAE's structure (causal 3D convs, 8x spatial and 4x temporal compression, so
    # num_frames = 4k + 1 and sizes are multiples of 16 with the 2x2 patches) at 2 base channels
    # and one residual block per stage.
    vae = make_vae().eval() if make_vae is not None else AutoencoderKLWan(
        base_dim=2,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=0,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ).eval()
    # Wan 2.1 T2V's scheduler: UniPC with flow-matching sigmas (flow_shift 3.0 is Wan's 480p setting).
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=flow_shift,
    )
    return pipeline_class(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        **(extra() if extra is not None else {}),
    )


# ------------------------------------------------------------------------ the tiny Wan 2.2 presets
#
# Wan 2.2 ships two layouts, both served by diffusers' WanPipeline / WanImageToVideoPipeline:
#
# - TI2V-5B (Wan2.2-TI2V-5B-Diffusers: model_index.json names WanPipeline with
#   expand_timesteps=True; its image mode is the same components as a WanImageToVideoPipeline
#   without an image encoder). One transformer on the Wan 2.2 VAE's 48 latent channels (16x
#   spatial: a 2x2 patchify of the pixels, then 3 downsamples; 4x temporal), so with its 1x2x2
#   patches sides are multiples of 32. expand_timesteps gives every token its own timestep (the
#   conditioning first frame's tokens get 0 in image mode): per-token adaLN modulation.
# - A14B (Wan2.2-T2V-A14B / I2V-A14B): two experts, ``transformer`` for the high-noise steps
#   (t >= boundary_ratio * 1000) and ``transformer_2`` for the rest, on the Wan 2.1 VAE. I2V
#   A14B's transformers take Wan 2.1 I2V's 36 input channels but no CLIP image tokens (no image
#   encoder).
#
# The tiny versions keep those layouts at tiny-wan's widths: the same tokenizer, text encoder and
# (for A14B) VAE, drawn in the same order from the same seed.

# Wan 2.2's boundaries (the original repo's configs): the step where transformer_2 takes over.
WAN22_T2V_BOUNDARY = 0.875
WAN22_I2V_BOUNDARY = 0.9
# The VAE's latent channels (Wan 2.2's VAE: 48, against Wan 2.1's 16).
WAN22_Z_DIM = 48


def tiny_wan22_vae() -> Any:
    """The Wan 2.2 (TI2V-5B) VAE's layout in miniature: 48 latent channels, 12-channel inputs (RGB
    patchified 2x2), residual down / up blocks (AvgDown3D / DupUp3D shortcuts), a decoder wider
    than the encoder, 3 spatial downsamples after the patchify (16x) and 2 temporal ones (4x),
    as Wan2.2-TI2V-5B-Diffusers' config (base 160 / decoder 256, 2 residual blocks per stage)
    at base 4 / decoder 8 and one residual block per stage. Its latents' mean / std are fixed
    non-trivial values (the real ones are per-channel statistics; any values exercise the
    pipeline's normalisation)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=4, decoder_base_dim=8, z_dim=WAN22_Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=0, attn_scales=[],
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=[round(-0.2 + 0.4 * i / (WAN22_Z_DIM - 1), 4) for i in range(WAN22_Z_DIM)],
        latents_std=[round(0.5 + i / (WAN22_Z_DIM - 1), 4) for i in range(WAN22_Z_DIM)],
    )


# TI2V-5B's transformer in miniature: tiny-wan's widths on the Wan 2.2 VAE's 48 channels (in and
# out: its image mode replaces the first latent frame instead of adding channels).
TINY_WAN22_TI2V_TRANSFORMER = dict(TINY_WAN_TRANSFORMER, in_channels=WAN22_Z_DIM, out_channels=WAN22_Z_DIM)
# Wan 2.2 TI2V-5B's scheduler shift (its sampler's 5.0).
WAN22_TI2V_FLOW_SHIFT = 5.0


def _build_tiny_wan22_ti2v(pipeline_class: type) -> Any:
    from diffusers import WanTransformer3DModel

    return build_tiny_wan_like(pipeline_class, lambda: WanTransformer3DModel(**TINY_WAN22_TI2V_TRANSFORMER),
                               flow_shift=WAN22_TI2V_FLOW_SHIFT, make_vae=tiny_wan22_vae,
                               extra=lambda: {"expand_timesteps": True})


def build_tiny_wan22_ti2v() -> Any:
    """Wan 2.2 TI2V-5B's text-to-video mode in miniature (the ``tiny-wan22-5b`` preset): a
    ``WanPipeline`` with ``expand_timesteps=True`` around a 48-channel transformer on the tiny Wan
    2.2 VAE (:func:`tiny_wan22_vae`); tiny-wan's tokenizer and text encoder. Random weights (seed
    ``TINY_WAN_SEED``): its videos are noise."""
    from diffusers import WanPipeline

    return _build_tiny_wan22_ti2v(WanPipeline)


def build_tiny_wan22_ti2v_i2v() -> Any:
    """Wan 2.2 TI2V-5B's image mode in miniature (the ``tiny-wan22-5b-i2v`` preset): the same
    components and weights as :func:`build_tiny_wan22_ti2v` as a ``WanImageToVideoPipeline`` with
    no image encoder. The image's latents replace the first latent frame, whose tokens get
    timestep 0 (expand_timesteps)."""
    from diffusers import WanImageToVideoPipeline

    return _build_tiny_wan22_ti2v(WanImageToVideoPipeline)


def build_tiny_wan22_a14b() -> Any:
    """Wan 2.2 T2V-A14B in miniature (the ``tiny-wan22-a14b`` preset): tiny-wan's parts and
    weights (its transformer is the high-noise expert) plus a second expert of the same layout,
    drawn after the VAE, as ``transformer_2`` for the steps below ``boundary_ratio``
    (:data:`WAN22_T2V_BOUNDARY`). Random weights: its videos are noise."""
    from diffusers import WanPipeline, WanTransformer3DModel

    return build_tiny_wan_like(
        WanPipeline, lambda: WanTransformer3DModel(**TINY_WAN_TRANSFORMER),
        extra=lambda: {"transformer_2": WanTransformer3DModel(**TINY_WAN_TRANSFORMER).eval(),
                       "boundary_ratio": WAN22_T2V_BOUNDARY})


def build_tiny_wan22_a14b_i2v() -> Any:
    """Wan 2.2 I2V-A14B in miniature (the ``tiny-wan22-a14b-i2v`` preset): a
    ``WanImageToVideoPipeline`` with two experts (``boundary_ratio``
    :data:`WAN22_I2V_BOUNDARY`) of Wan 2.1 I2V's input layout (16 noise + 4 mask + 16 image-latent
    channels) and no image encoder: A14B conditions on the image's latents only, so its
    transformers have no image embedder or added k/v. tiny-wan's tokenizer and text encoder
    (tiny-wan's weights: drawn first) and VAE layout. Random weights: its videos are noise."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel

    cfg = dict(TINY_WAN_TRANSFORMER, in_channels=WAN21_I2V_IN_CHANNELS)
    return build_tiny_wan_like(
        WanImageToVideoPipeline, lambda: WanTransformer3DModel(**cfg),
        extra=lambda: {"transformer_2": WanTransformer3DModel(**cfg).eval(), "boundary_ratio": WAN22_I2V_BOUNDARY})
