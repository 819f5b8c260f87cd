"""SD3 / SD3.5 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

Configs are image_family_configs': ``dev`` = SD3.5 large (38 blocks, width 2432, QK RMSNorm),
``medium`` = SD3.5 medium (24 blocks, width 1536, dual attention in blocks 0-12), ``sd3-medium`` =
SD3 medium (no QK norm), and the tiny ones. Inputs are one step at WxH: 16-channel latents at
H/8 x W/8 (patchified 2x2 inside the model: (H/16)(W/16) tokens), ``txt_tokens`` random joint
CLIP+T5 embeddings (the pipeline always sends 77 + 256 = 333), pooled CLIP projections.
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family

_IFC_NAME = {"tiny": "sd35", "tiny-sd3": "sd3", "dev": "sd35_large", "medium": "sd35_medium",
             "sd3-medium": "sd3_medium"}


make_inputs = ifc.input_maker("sd3", 333)


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device, dtype=dtype)  # the pipeline passes t in [0, 1000]


def _to_images(latent: Any) -> Any:
    return latent  # the transformer unpatchifies: [N, 16, H/8, W/8] already


def _config(key: str) -> dict[str, Any]:
    name = _IFC_NAME[key]
    return ifc.config(name, "tiny" if key.startswith("tiny") else "real")


FAMILY = Family(
    name="sd3",
    model_class="diffusers:SD3Transformer2DModel",
    configs={k: _config(k) for k in _IFC_NAME},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "SD3.5-large size (38 joint blocks, width 2432, QK RMSNorm), random bf16 weights",
           "medium": "SD3.5-medium size (24 blocks, width 1536, dual attention in blocks 0-12)",
           "sd3-medium": "SD3-medium size (24 blocks, width 1536, no QK norm)"},
)
