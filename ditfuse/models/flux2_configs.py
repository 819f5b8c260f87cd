"""FLUX.2 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (FLUX.2-dev size and a tiny one); the inputs are one step
at a WxH image: (H/16)x(W/16) packed latent tokens (the VAE's 32 channels, 2x2-packed to 128),
``txt_tokens`` random Mistral embeddings (the pipeline pads to 512), 4-axis position ids.
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
    kw = ifc.step_inputs("flux2", model, batch=batch, height=H, width=W, text_tokens=txt_tokens,
                         dtype=dtype or torch.bfloat16, device="cpu", seed=seed + 1)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _to_images(latent: Any) -> Any:
    """[N, h*w, 128] -> [N, 32, 2h, 2w] (the pipeline's unpacking of 2x2 patches)."""
    n, tokens, c4 = latent.shape
    side = int(round(tokens ** 0.5))
    return latent.view(n, side, side, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c4 // 4, side * 2, side * 2)


FAMILY = Family(
    name="flux2",
    model_class="diffusers:Flux2Transformer2DModel",
    configs={"tiny": ifc.config("flux2", "tiny"), "dev": ifc.config("flux2", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "FLUX.2-dev size (8 double + 48 single blocks, width 6144, SwiGLU 3x), random bf16 weights"},
)
