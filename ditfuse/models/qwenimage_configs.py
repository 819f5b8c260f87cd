"""Qwen-Image fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = Qwen/Qwen-Image size (60 dual-stream blocks, width 3072, FF 12288, text width 3584),
``tiny`` for tests. Inputs are one step at WxH: (H/16)(W/16) 2x2-packed latent tokens (64
channels), ``txt_tokens`` random Qwen2.5-VL embeddings (the prompt's real length; 512 assumed),
no text mask, ``img_shapes`` for the RoPE tables.
"""

from __future__ import annotations

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("qwenimage", 512)
_to_images = ifc.unpack_2x2


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
