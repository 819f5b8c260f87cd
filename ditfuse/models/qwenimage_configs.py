"""Qwen-Image fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = Qwen/Qwen-Image size (60 dual-stream blocks, width 3072, FF 12288, text width 3584),
``tiny`` for tests. Inputs are one step at WxH: (H/16)(W/16) 2x2-packed latent tokens (64
channels), ``txt_tokens`` random Qwen2.5-VL embeddings (the prompt's real length; 512 assumed),
no text mask, ``img_shapes`` for the RoPE tables.
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family, parse_size
from .flux_configs import _timestep


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512) -> dict[str, Any]:
    import torch

    W, H = parse_size(size, 2)
    kw = ifc.step_inputs("qwenimage", model, batch=batch, height=H, width=W, text_tokens=txt_tokens,
                         dtype=dtype or torch.bfloat16, device="cpu", seed=seed + 1)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _to_images(latent: Any) -> Any:
    """[N, h*w, 64] -> [N, 16, 2h, 2w] (the pipeline's unpacking of 2x2 patches, square grids)."""
    n, tokens, c4 = latent.shape
    side = int(round(tokens ** 0.5))
    return latent.view(n, side, side, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c4 // 4, side * 2, side * 2)


FAMILY = Family(
    name="qwenimage",
    model_class="diffusers:QwenImageTransformer2DModel",
    configs={"tiny": ifc.config("qwenimage", "tiny"), "dev": ifc.config("qwenimage", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Qwen-Image size (60 dual-stream blocks, width 3072), random bf16 weights"},
)
