"""FLUX.2 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (FLUX.2-dev size and a tiny one); the inputs are one step
at a WxH image: (H/16)x(W/16) packed latent tokens (the VAE's 32 channels, 2x2-packed to 128),
``txt_tokens`` random Mistral embeddings (the pipeline pads to 512), 4-axis position ids.
"""

from __future__ import annotations

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("flux2", 512)
_to_images = ifc.unpack_2x2


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
