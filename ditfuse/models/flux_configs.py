"""FLUX.1 fixtures: transformer configs and an input maker (see ditfuse/models/families.py)."""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size
from .image_family_configs import unpack_2x2

# FLUX.1-dev: 19 dual + 38 single blocks, width 3072 (24 heads x 128), T5 width 4096.
DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# The tiny-flux preset's transformer (ditfuse/runtime/presets.py): head dim 16, RoPE axes 4+6+6.
TINY = dict(
    patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512, timestep: float = 0.5, guidance: float = 3.5) -> dict[str, Any]:
    """One forward's kwargs: a WxH image is (H/16)x(W/16) packed latent tokens (VAE /8, 2x2
    patches), plus ``txt_tokens`` random prompt embeddings (FLUX.1-dev's T5 length is 512)."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H = parse_size(size, 2)
    h, w = H // 16, W // 16
    cfg = model.config
    g = torch.Generator("cpu").manual_seed(seed)
    ids = torch.zeros(h * w, 3)
    ids[:, 1] = torch.arange(h * w) // w
    ids[:, 2] = torch.arange(h * w) % w
    kw = dict(
        hidden_states=torch.randn(batch, h * w, cfg.in_channels, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.joint_attention_dim, generator=g).to(device, dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device, dtype=dtype),
        img_ids=ids.to(device),
        txt_ids=torch.zeros(txt_tokens, 3, device=device),
        return_dict=False,
    )
    if cfg.guidance_embeds:
        kw["guidance"] = torch.full((batch,), guidance, device=device, dtype=torch.float32)
    return kw


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma, device=device, dtype=dtype)  # the pipeline passes t / 1000


_to_images = unpack_2x2  # FLUX's _unpack_latents for a square token grid


FAMILY = Family(
    name="flux",
    model_class="diffusers:FluxTransformer2DModel",
    configs={"tiny": TINY, "dev": DEV},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "FLUX.1-dev size (19 dual + 38 single blocks, width 3072), random bf16 weights"},
)
