"""FLUX.3 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

The configs are image_family_configs' (the size diffusers 0.42.1's Flux3Transformer2DModel
defaults declare, and a tiny one); the inputs are one text-to-image step at a WxH image:
(H/16)x(W/16) packed latent tokens of 128 channels, ``txt_tokens`` random stacked Qwen3-VL
states, 4-axis position ids. ``load="pretrained"`` (what bench_step builds) keeps the QK norms in
fp32 as ``from_pretrained`` does; a plain ``.to(bf16)`` model would leave the attention sites
unmounted (models/flux3.py says why).
"""

from __future__ import annotations

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

make_inputs = ifc.input_maker("flux3", 512)
_to_images = ifc.unpack_2x2


FAMILY = Family(
    name="flux3",
    model_class="diffusers:Flux3Transformer2DModel",
    configs={"tiny": ifc.config("flux3", "tiny"), "dev": ifc.config("flux3", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "FLUX.3 size as diffusers 0.42.1 declares it (5 per-mode blocks per mode + 28 joint blocks, "
                  "width 3072, SwiGLU 3x), random bf16 weights, QK norms fp32"},
)
