"""Qwen-Image 2.1 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's QwenImage21Transformer2DModel defaults (32 single-stream blocks,
width 4096, SwiGLU 12288, VLM text width 4096), ``tiny`` for tests. A step is what the pipeline
runs after its first: the KV-cached decode (``kv_cache_mode="cached"``), in which only the target
image's (H/16)(W/16) tokens go through the blocks and attend to the cached text keys. The input
maker therefore runs the model once in ``extract`` mode to fill a ``QwenImage21KVCache`` from
``txt_tokens`` random VLM states (512 assumed), and returns the cached step's inputs;
``mode="prefill"`` returns the uncached step (``use_kv_cache=False``: text and image tokens
through every block, the block-causal prefill).
"""

from __future__ import annotations

from typing import Any

from . import image_family_configs as ifc
from .families import Family, parse_size
from .flux_configs import _timestep


def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 512, mode: str = "cached", cond: int = 0) -> dict[str, Any]:
    """One step's forward kwargs (module docstring). ``cond``: a square condition image of that
    side in latent tokens (an edit step), none by default."""
    import torch
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    if mode not in ("cached", "prefill"):
        raise ValueError(f"mode must be 'cached' or 'prefill', got {mode!r}")
    W, H = parse_size(size, 2)
    kw = ifc.step_inputs("qwenimage21", model, batch=batch, height=H, width=W, text_tokens=txt_tokens,
                         dtype=dtype or torch.bfloat16, device="cpu", seed=seed + 1, cond_tokens=cond)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    if mode == "prefill":
        return kw
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    with torch.no_grad():
        model(**kw, kv_cache=cache, kv_cache_mode="extract")
    return dict(kw, kv_cache=cache, kv_cache_mode="cached")


def _to_images(latent: Any) -> Any:
    """[N, h*w, 64] packed 2x2 patches -> [N, 16, 2h, 2w]."""
    return ifc.unpack_2x2(latent)


FAMILY = Family(
    name="qwenimage21",
    model_class="diffusers:QwenImage21Transformer2DModel",
    configs={"tiny": ifc.config("qwenimage21", "tiny"), "dev": ifc.config("qwenimage21", "real")},
    default_size="1024x1024",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "Qwen-Image 2.1 size as diffusers 0.42.1 declares it (32 single-stream blocks, width 4096), "
                  "random bf16 weights; the KV-cached decode step"},
)
