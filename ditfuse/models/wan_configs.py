"""Wan 2.1 / 2.2 fixtures: transformer configs and an input maker (see ditfuse/models/families.py)."""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size

_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan2.1-T2V-1.3B: 30 blocks, width 1536 (12 heads x 128), ffn 8960.
DEV = dict(_COMMON, num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960, num_layers=30)
# Wan2.2-TI2V-5B: 30 blocks, width 3072 (24 heads), ffn 14336, 48 latent channels (VAE 4x16x16).
TI2V_5B = dict(_COMMON, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30)
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
                per_token_timestep: bool = False, image_tokens: int = 257) -> dict[str, Any]:
    """One forward's kwargs for a WxHxFRAMES video: latents [B, C, (F-1)/4+1, H/s, W/s] (s = 8,
    or 16 for the 48-channel Wan 2.2 VAE), ``txt_tokens`` random UMT5 embeddings (Wan's 512),
    image embeddings for I2V configs, and a per-token timestep for TI2V when asked."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    cfg = model.config
    s = spatial or (16 if cfg.in_channels == 48 else 8)
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
    configs={"tiny": TINY, "tiny-i2v": TINY_I2V, "dev": DEV, "ti2v-5b": TI2V_5B, "i2v-14b": I2V_14B},
    default_size="832x480x81",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Wan2.1-T2V-1.3B size (30 blocks, width 1536, ffn 8960), random bf16 weights",
           "ti2v-5b": "Wan2.2-TI2V-5B size (30 blocks, width 3072, 48 latent channels)"},
)
