"""Chroma fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (Chroma1-HD's size and a tiny one); the inputs are one step
at a WxH image: (H/16)x(W/16) FLUX.1-packed latent tokens (64 channels), ``txt_tokens`` random T5
states (the pipeline pads to 512) and the pipeline's attention mask (each prompt's real tokens,
its padding masked, every image token).
"""

from __future__ import annotations

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("chroma", 512)
_to_images = ifc.unpack_2x2


FAMILY = Family(
    name="chroma",
    model_class="diffusers:ChromaTransformer2DModel",
    configs={"tiny": ifc.config("chroma", "tiny"), "dev": ifc.config("chroma", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Chroma1-HD size (19 dual + 38 single blocks, width 3072), random bf16 weights"},
)
