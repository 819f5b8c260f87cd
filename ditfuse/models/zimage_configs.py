"""Z-Image fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = Tongyi-MAI/Z-Image size (30 main + 2 + 2 refiner blocks, width 3840, SwiGLU 10240,
caption width 2560), ``tiny`` for tests. Inputs are one step at WxH: per sample a latent
[16, 1, H/8, W/8] (patchified 2x2 inside the transformer: (H/16)(W/16) image tokens) and
``txt_tokens`` random Qwen3 caption features (the prompt's real length; 512 assumed), as the lists
the model takes. The model returns a list of per-sample latents; :func:`stack_output` stacks them.
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family
from .flux_configs import _timestep

_make = ifc.input_maker("zimage", 512)


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512) -> dict[str, Any]:
    """One step's forward kwargs; the per-sample lists (``x``, ``cap_feats``) moved to ``device``."""
    kw = _make(model, batch, size, seed, "cpu", dtype, txt_tokens)
    return {k: [t.to(device) for t in v] if isinstance(v, list) else (v.to(device) if hasattr(v, "to") else v)
            for k, v in kw.items()}


def stack_output(out: Any) -> Any:
    """The model's list of per-sample [C, 1, H, W] latents -> one [N, C, 1, H, W] tensor."""
    import torch

    return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out


def _to_images(latent: Any) -> Any:
    """[N, C, 1, H, W] (stacked output) -> [N, C, H, W]."""
    return latent[:, :, 0] if latent.dim() == 5 else latent


FAMILY = Family(
    name="zimage",
    model_class="diffusers:ZImageTransformer2DModel",
    configs={"tiny": ifc.config("zimage", "tiny"), "dev": ifc.config("zimage", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    latent="x",
    notes={"dev": "Z-Image size (30 main + 4 refiner blocks, width 3840), random bf16 weights; "
                  "drift's transformer-only loop is not wired for its list latents"},
)
