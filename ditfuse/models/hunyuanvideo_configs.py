"""HunyuanVideo (1.0) fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's ``HunyuanVideoTransformer3DModel`` constructor defaults, which are the
HunyuanVideo 13B text-to-video transformer (the class docstring's "defaults to" values, read from
``inspect.signature`` in tests/cpu/test_hunyuanvideo_adapter.py): 20 dual-stream + 40
single-stream blocks, width 24 heads x 128 = 3072, FF 4x, 2 token-refiner layers, 16 latent
channels in and out, patch 2 (spatial) x 1 (temporal), ``qk_norm="rms_norm"``, guidance
embedding on (the distilled guidance of the released checkpoint), LLaVA-Llama-3 text width 4096,
CLIP-L pooled width 768, RoPE theta 256 with axes (16, 56, 56) (16 + 56 + 56 = 128 = head dim).
``tiny`` for tests.

A step at WxHxFRAMES as ``HunyuanVideoPipeline.__call__`` calls the transformer: latents
``[B, 16, (F - 1) / 4 + 1, H / 8, W / 8]`` (the VAE compresses 8x8 spatially, 4x in time) in the
transformer's dtype; ``timestep`` the scheduler's ``t`` broadcast to the batch in the latents'
fp32 (``t.expand(B).to(latents.dtype)``: fp32, not the transformer's dtype); Llama states
``[B, txt_tokens, 4096]`` (the pipeline's ``max_sequence_length`` 256 after the template crop)
with an integer attention mask, right-padded (the tokenizer's ``padding="max_length"``): each
sample's last few tokens padding; CLIP pooled ``[B, 768]``; ``guidance`` = scale x 1000 in the
transformer's dtype (default scale 6.0).
"""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size

DEV: dict[str, Any] = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
)
# 2 dual + 3 single blocks (a hand-off in each chain and the dual -> single boundary), head_dim 16
# = RoPE axes 4 + 6 + 6, a 1-layer token refiner, patch 2 as the real model.
TINY: dict[str, Any] = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
    num_single_layers=3, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=12, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
)

# HunyuanVideoPipeline's defaults: the prompt's Llama positions after the template crop, the
# embedded guidance scale.
TXT_TOKENS = 256
GUIDANCE_SCALE = 6.0


def make_inputs(model: Any, batch: int = 1, size: str = "848x480x61", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = TXT_TOKENS, timestep: float = 500.0,
                guidance_scale: float = GUIDANCE_SCALE) -> dict[str, Any]:
    """One step's forward kwargs (module docstring). The text masks leave each sample's last
    ``3 + 5 * i`` tokens as padding (at least one token valid): a different count per sample."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    if (F - 1) % 4:
        raise ValueError(f"HunyuanVideo frame counts are 4k+1, got {F}")
    cfg = model.config
    f, h, w = (F - 1) // 4 + 1, H // 8, W // 8
    g = torch.Generator("cpu").manual_seed(seed)
    mask = torch.ones(batch, txt_tokens, dtype=torch.long)
    for i in range(batch):
        mask[i, max(1, txt_tokens - 3 - 5 * i):] = 0
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device, dtype=torch.float32),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=g).to(device, dtype),
        encoder_attention_mask=mask.to(device),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        guidance=torch.full((batch,), guidance_scale, device=device, dtype=dtype) * 1000.0,
        return_dict=False,
    )


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    # the pipeline's t = sigma * 1000, in the latents' fp32 whatever the transformer's dtype
    return torch.full((batch,), sigma * 1000.0, device=device, dtype=torch.float32)


def _to_images(latent: Any) -> Any:
    """[N, C, F, h, w] -> the frames as [N * F, C, h, w]."""
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


FAMILY = Family(
    name="hunyuanvideo",
    model_class="diffusers:HunyuanVideoTransformer3DModel",
    configs={"tiny": TINY, "dev": DEV},
    default_size="848x480x61",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "HunyuanVideo size (20 dual + 40 single blocks, width 3072), random bf16 weights"},
)
