"""HunyuanVideo 1.5 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's HunyuanVideo15Transformer3DModel defaults (54 dual-stream blocks,
width 16 x 128 = 2048, FF 4x, 65 input channels = 32 latent + 32 condition + 1 mask, Qwen2.5-VL
text width 3584, ByT5 width 1472, SigLIP image width 1152), ``tiny`` for tests. A step at
WxHxFRAMES: latents [B, 65, (F - 1) / 4 + 1, H / 16, W / 16] (the 1.5 VAE compresses 16x16
spatially, 4x in time), ``txt_tokens`` random Qwen2.5-VL states with the prompt's tokens valid
and the rest padding, 64 ByT5 tokens likewise, zero image embeddings (text-to-video).
"""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size

DEV: dict[str, Any] = dict(
    in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
    num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=3584,
    text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
)
# 3 dual-stream blocks (two hand-offs), head_dim 16 = RoPE axes 4 + 6 + 6, a 1-layer token refiner.
TINY: dict[str, Any] = dict(
    in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
    num_refiner_layers=1, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=24,
    text_embed_2_dim=20, image_embed_dim=12, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
)


def make_inputs(model: Any, batch: int = 1, size: str = "848x480x121", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 256, byt5_tokens: int = 64, image_tokens: int = 729,
                timestep: float = 500.0) -> dict[str, Any]:
    """One step's forward kwargs (module docstring); the text masks leave each sample's last few
    tokens as padding (a different count per sample)."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    if (F - 1) % 4:
        raise ValueError(f"HunyuanVideo 1.5 frame counts are 4k+1, got {F}")
    cfg = model.config
    f, h, w = (F - 1) // 4 + 1, H // 16, W // 16
    g = torch.Generator("cpu").manual_seed(seed)

    def mask(n: int) -> torch.Tensor:
        m = torch.ones(batch, n, dtype=torch.long)
        for i in range(batch):
            m[i, max(1, n - 3 - 5 * i):] = 0
        return m.to(device)

    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=g).to(device, dtype),
        encoder_attention_mask=mask(txt_tokens),
        encoder_hidden_states_2=torch.randn(batch, byt5_tokens, cfg.text_embed_2_dim, generator=g).to(device, dtype),
        encoder_attention_mask_2=mask(byt5_tokens),
        image_embeds=torch.zeros(batch, image_tokens, cfg.image_embed_dim, device=device, dtype=dtype),
        return_dict=False,
    )


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device, dtype=dtype)


def _to_images(latent: Any) -> Any:
    """[N, C, F, h, w] -> the frames as [N * F, C, h, w]."""
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


FAMILY = Family(
    name="hunyuanvideo15",
    model_class="diffusers:HunyuanVideo15Transformer3DModel",
    configs={"tiny": TINY, "dev": DEV},
    default_size="848x480x121",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "HunyuanVideo 1.5 size (54 dual-stream blocks, width 2048), random bf16 weights"},
)
