"""Model families as the runtime, benchmarks, drift and admission see them.

A family is its adapter (ditfuse/models/<family>.py) plus, beside it (<family>_configs.py), the
fixtures everything model-agnostic needs: named transformer configs (a tiny one for tests and a
real-size one for benchmarks, drift and admission, with random weights: timings and rounding
behaviour do not depend on the weights' values), an input maker for one forward at a given size,
and how to run a flow-matching step on its latents (drift's transformer-only loop). Nothing in
runtime/ or bench/ names a family's diffusers classes: it asks :func:`get` for one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """name: as users type it (``ditfuse bench flux``). model_class: the diffusers transformer
    class (``"diffusers:FluxTransformer2DModel"``). configs: named constructor kwargs (``tiny``,
    ``dev`` at least). default_size: the size string of the real-size benchmark. make_inputs:
    ``(model, batch, size, seed, device, dtype) -> forward kwargs`` (size as the family parses
    it, e.g. ``1024x1024`` or ``832x480x81``). latent / timestep / to_images: drift's
    transformer-only Euler loop (the forward's latent argument name, ``sigma -> timestep``
    tensor, final latent -> [N, C, H, W] for PSNR/SSIM)."""

    name: str
    model_class: str
    configs: dict[str, dict[str, Any]]
    default_size: str
    make_inputs: Callable[..., dict[str, Any]]
    timestep: Callable[[float, int, Any, Any], Any]
    to_images: Callable[[Any], Any]
    latent: str = "hidden_states"
    notes: dict[str, str] = field(default_factory=dict)

    def load_class(self) -> type:
        mod, _, name = self.model_class.partition(":")
        return getattr(importlib.import_module(mod), name)

    def config(self, name: str, layers: tuple[int, ...] | None = None) -> dict[str, Any]:
        try:
            cfg = dict(self.configs[name])
        except KeyError:
            raise ValueError(f"{self.name} has no config {name!r} (configs: {', '.join(self.configs)})") from None
        if layers is not None:
            keys = [k for k in ("num_layers", "num_single_layers", "n_layers", "n_refiner_layers") if k in cfg]
            if len(layers) != len(keys):
                raise ValueError(f"{self.name} takes {len(keys)} layer count(s) ({', '.join(keys)}), got {list(layers)}")
            cfg.update(dict(zip(keys, layers)))
        return cfg

    def build(self, config: str = "dev", layers: tuple[int, ...] | None = None, device: str = "cuda",
              dtype: Any = None, seed: int = 0, load: str = "plain") -> Any:
        """A random-weight transformer of config ``config`` on ``device``.

        ``load="plain"``: everything in ``dtype``, initialised directly in it (a 12B-parameter
        model never exists in fp32), as ``model.to(dtype)`` leaves it. ``load="pretrained"``: the
        dtypes ``from_pretrained(torch_dtype=dtype)`` gives: parameters and buffers under a module
        named in the class's ``_keep_in_fp32_modules`` stay fp32 (diffusers matches the names
        against the components of each parameter's dotted name), the rest is cast."""
        import torch

        dtype = dtype or torch.bfloat16
        if load not in ("plain", "pretrained"):
            raise ValueError(f"load must be 'plain' or 'pretrained', got {load!r}")
        cls = self.load_class()
        keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ()) if load == "pretrained" else set()
        torch.manual_seed(seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32 if keep else dtype)
        try:
            with torch.device(device):
                model = cls(**self.config(config, layers))
        finally:
            torch.set_default_dtype(prev)
        if not keep:
            return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and not keep.intersection(name.split(".")):
                t.data = t.data.to(dtype)
        return model.eval().requires_grad_(False)


_FAMILIES = {
    "flux": "ditfuse.models.flux_configs:FAMILY", "wan": "ditfuse.models.wan_configs:FAMILY",
    "flux2": "ditfuse.models.flux2_configs:FAMILY", "sd3": "ditfuse.models.sd3_configs:FAMILY",
    "qwenimage": "ditfuse.models.qwenimage_configs:FAMILY", "zimage": "ditfuse.models.zimage_configs:FAMILY",
    "flux3": "ditfuse.models.flux3_configs:FAMILY", "chroma": "ditfuse.models.chroma_configs:FAMILY",
    "qwenimage21": "ditfuse.models.qwenimage21_configs:FAMILY",
    "hunyuanvideo15": "ditfuse.models.hunyuanvideo15_configs:FAMILY",
    "hunyuanvideo": "ditfuse.models.hunyuanvideo_configs:FAMILY",
    "ltx": "ditfuse.models.ltx_configs:FAMILY",
    "chronoedit": "ditfuse.models.wan_variants_configs:CHRONOEDIT",
    "skyreels_v2": "ditfuse.models.wan_variants_configs:SKYREELS_V2",
    "wan_animate": "ditfuse.models.wan_variants_configs:WAN_ANIMATE",
}


def names() -> list[str]:
    return list(_FAMILIES)


def get(name: str) -> Family:
    target = _FAMILIES.get(name)
    if target is None:
        raise ValueError(f"unknown model family {name!r}; families: {', '.join(_FAMILIES)}")
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def parse_size(size: str, dims: int, multiple: int = 16) -> tuple[int, ...]:
    """``"1024x1024"`` -> (1024, 1024); ``"832x480x81"`` -> (832, 480, 81) (width x height [x frames])."""
    parts = [p for p in size.lower().split("x") if p]
    if len(parts) != dims or not all(p.isdigit() for p in parts):
        raise ValueError(f"size {size!r}: expected {'x'.join(['W', 'H', 'FRAMES'][:dims])}")
    vals = tuple(int(p) for p in parts)
    if any(v <= 0 for v in vals) or vals[0] % multiple or vals[1] % multiple:
        raise ValueError(f"size {size!r}: width and height must be positive multiples of {multiple}")
    return vals
