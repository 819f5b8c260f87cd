"""Pipelines the runtime can load: a built-in preset (``tiny-flux``, ``tiny-wan``, ... :
:data:`PRESET_TABLE`), or a local diffusers directory.

``tiny-flux`` is a complete diffusers ``FluxPipeline`` (FluxTransformer2DModel, AutoencoderKL,
FlowMatchEulerDiscreteScheduler, CLIP and T5 text encoders, tokenizers) shrunk to a few thousand
parameters with **random weights** from a fixed seed. ``tiny-wan`` is the same for video: a complete
``WanPipeline`` (WanTransformer3DModel, AutoencoderKLWan, UMT5 text encoder, T5 tokenizer, UniPC
scheduler; built by ``ditfuse.models.wan_configs.build_tiny_wan``). They exist so that every
command, test and server runs on a fresh machine with no download. Their images and videos are
noise: they exercise the code path (shapes, batching, schedulers, VAE decode, kernel mounting), not
output quality.

A preset is built offline from configs (tokenizers included), saved once with ``save_pretrained``
into ``$DITFUSE_CACHE/presets/<name>-v<N>`` (default cache: ``~/.cache/ditfuse``) and loaded from
there afterwards, so every process sees the same weights. :data:`PRESET_TABLE` lists them.

Anything else passed as a model is treated as a path to a diffusers-format directory and loaded
with ``DiffusionPipeline.from_pretrained(path, dtype=...)``; the pipeline class named in its
``model_index.json`` says how to call it and whether it makes images or videos
(:data:`ditfuse.runtime.pipelines.PIPELINE_SPECS`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .pipelines import Capabilities, PipelineSpec, spec_for, unknown_pipeline_note

log = logging.getLogger("ditfuse.runtime")

TINY_FLUX = "tiny-flux"
TINY_WAN = "tiny-wan"
# Bump when the preset's architecture or build recipe changes, so stale caches are not reused.
_TINY_FLUX_VERSION = 2
_TINY_SEED = 0

NOISE_NOTE = "tiny-flux has random weights: its images are noise (it exercises the pipeline, not image quality)"
WAN_NOISE_NOTE = "tiny-wan has random weights: its videos are noise (it exercises the pipeline, not video quality)"


@dataclass(frozen=True)
class Preset:
    """A built-in pipeline: how to build it and what the runtime needs to know without loading it."""

    name: str
    builder: str  # "module:function" returning the diffusers pipeline (imported when building)
    version: int  # part of the cache directory name: bump when the recipe changes
    default_size: tuple[int, int]  # (width, height)
    size_multiple: int
    # what every call gets (a short text length, ...); None: the builder module's TINY_CALL_KWARGS
    call_kwargs: dict[str, Any] | None
    note: str
    kind: str = "image"  # "image" | "video"
    fps: int | None = None  # video: frames per second of the clips
    frame_multiple: int = 1  # video: num_frames = frame_multiple * k + 1
    default_frames: int | None = None
    default_steps: int | None = None  # None: SamplingParams' default
    default_guidance: float | None = None
    pipeline: str = "FluxPipeline"  # the diffusers pipeline class it builds (runtime/pipelines.py)
    # "module:function" applied to the pipeline after every load: settings diffusers does not
    # save (HunyuanVideo 1.5's text lengths are instance attributes)
    prepare: str | None = None

    @property
    def spec(self) -> PipelineSpec:
        return spec_for(self.pipeline)

    def resolved_call_kwargs(self) -> dict[str, Any]:
        if self.call_kwargs is not None:
            return dict(self.call_kwargs)
        module = importlib.import_module(self.builder.partition(":")[0])
        return dict(getattr(module, "TINY_CALL_KWARGS", {}))


PRESET_TABLE: dict[str, Preset] = {
    TINY_FLUX: Preset(
        name=TINY_FLUX,
        builder="ditfuse.runtime.presets:build_tiny_flux",
        version=_TINY_FLUX_VERSION,
        default_size=(256, 256),
        size_multiple=16,
        call_kwargs={"max_sequence_length": 128},
        note=NOISE_NOTE,
    ),
    TINY_WAN: Preset(
        name=TINY_WAN,
        builder="ditfuse.models.wan_configs:build_tiny_wan",
        version=1,
        default_size=(832, 480),
        size_multiple=16,
        call_kwargs={"max_sequence_length": 128},
        note=WAN_NOISE_NOTE,
        kind="video",
        fps=16,
        frame_multiple=4,
        default_frames=17,
        default_steps=8,
        default_guidance=5.0,
        pipeline="WanPipeline",
    ),
}


def _tiny_image_preset(name: str, family: str, pipeline: str, label: str) -> Preset:
    """A tiny image pipeline of one family (``ditfuse.models.<family>_configs.build_tiny_pipeline``,
    whose module's ``TINY_CALL_KWARGS`` every call gets): 256x256 by default, sizes in steps of
    16, the pipeline's own steps and guidance."""
    return Preset(
        name=name,
        builder=f"ditfuse.models.{family}_configs:build_tiny_pipeline",
        version=1,
        default_size=(256, 256),
        size_multiple=16,
        call_kwargs=None,
        note=f"{name} has random weights: its images are noise (it exercises the {label} pipeline, not image quality)",
        pipeline=pipeline,
    )


def _tiny_video_preset(name: str, family: str, pipeline: str, label: str, default_size: tuple[int, int],
                       size_multiple: int, fps: int, frame_multiple: int, prepare: str | None = None) -> Preset:
    """A tiny video pipeline of one family (``ditfuse.models.<family>_configs.build_tiny_pipeline``,
    whose module's ``TINY_CALL_KWARGS`` every call gets, if it has them): 17 frames and 8 steps by
    default, the pipeline's own guidance; geometry, frame rate and frame rule as the real
    pipeline's (``default_size`` a fraction of its own)."""
    return Preset(
        name=name,
        builder=f"ditfuse.models.{family}_configs:build_tiny_pipeline",
        version=1,
        default_size=default_size,
        size_multiple=size_multiple,
        call_kwargs=None,
        note=f"{name} has random weights: its videos are noise (it exercises the {label} pipeline, not video quality)",
        kind="video",
        fps=fps,
        frame_multiple=frame_multiple,
        default_frames=17,
        default_steps=8,
        pipeline=pipeline,
        prepare=prepare,
    )


PRESET_TABLE.update({p.name: p for p in (
    # Wan 2.1 image-to-video (WanImageToVideoPipeline): tiny-wan's geometry, frame rule and call
    # kwargs, plus a CLIP vision encoder; every request brings the image its clip starts from.
    replace(
        PRESET_TABLE[TINY_WAN],
        name="tiny-wan-i2v",
        builder="ditfuse.models.wan_configs:build_tiny_wan_i2v",
        note="tiny-wan-i2v has random weights: its videos are noise (it exercises the Wan image-to-video "
             "pipeline, not video quality)",
        pipeline="WanImageToVideoPipeline",
    ),
    _tiny_video_preset("tiny-hunyuanvideo15", "hunyuanvideo15", "HunyuanVideo15Pipeline", "HunyuanVideo 1.5",
                       (256, 144), 16, fps=24, frame_multiple=4,
                       prepare="ditfuse.models.hunyuanvideo15_configs:set_text_lengths"),
    # half LTXPipeline's 704x512 in each side; sides step by 32 (its check_inputs), 8k + 1 frames
    _tiny_video_preset("tiny-ltx", "ltx", "LTXPipeline", "LTX-Video", (352, 256), 32, fps=25, frame_multiple=8),
    # a fifth of HunyuanVideoPipeline's 1280x720 in each side; its call kwargs
    # (hunyuanvideo_configs.TINY_CALL_KWARGS): a short text length, the tiny tokenizer's template crop
    _tiny_video_preset("tiny-hunyuanvideo", "hunyuanvideo", "HunyuanVideoPipeline", "HunyuanVideo", (256, 144), 16,
                       fps=24, frame_multiple=4),
    # half SkyReelsV2Pipeline's 960x544 in each side (a third or a fifth is not a multiple of 16);
    # the builder is wan_variants_configs.build_tiny_pipeline (tiny-wan's parts around a tiny
    # SkyReelsV2Transformer3DModel); its call kwargs: tiny-wan's short text length
    _tiny_video_preset("tiny-skyreels-v2", "wan_variants", "SkyReelsV2Pipeline", "SkyReels-V2", (480, 272), 16,
                       fps=24, frame_multiple=4),
    _tiny_image_preset("tiny-sd3", "sd3", "StableDiffusion3Pipeline", "SD3.5"),
    _tiny_image_preset("tiny-chroma", "chroma", "ChromaPipeline", "Chroma"),
    _tiny_image_preset("tiny-flux2-klein", "flux2", "Flux2KleinPipeline", "FLUX.2 Klein"),
    _tiny_image_preset("tiny-qwenimage", "qwenimage", "QwenImagePipeline", "Qwen-Image"),
    _tiny_image_preset("tiny-zimage", "zimage", "ZImagePipeline", "Z-Image"),
)})
# FLUX.1 Kontext (image editing): tiny-flux's parts and geometry as a FluxKontextPipeline
PRESET_TABLE["tiny-flux-kontext"] = replace(
    PRESET_TABLE[TINY_FLUX],
    name="tiny-flux-kontext",
    builder="ditfuse.runtime.presets:build_tiny_flux_kontext",
    note="tiny-flux-kontext has random weights: its images are noise (it exercises the FLUX.1 Kontext "
         "editing pipeline, not image quality)",
    pipeline="FluxKontextPipeline",
)
# FLUX.1 Fill (inpainting): tiny-flux's text encoders, VAE, scheduler and geometry around a
# transformer that reads the masked image and the mask too (build_tiny_flux_fill); 50 steps and
# guidance 30 by default, as FluxFillPipeline's own call
PRESET_TABLE["tiny-flux-fill"] = replace(
    PRESET_TABLE[TINY_FLUX],
    name="tiny-flux-fill",
    builder="ditfuse.runtime.presets:build_tiny_flux_fill",
    version=1,
    note="tiny-flux-fill has random weights: its images are noise (it exercises the FLUX.1 Fill inpainting "
         "pipeline, not image quality)",
    pipeline="FluxFillPipeline",
)
# LTX-Video image-to-video: tiny-ltx's parts and geometry as an LTXImageToVideoPipeline
PRESET_TABLE["tiny-ltx-i2v"] = replace(
    PRESET_TABLE["tiny-ltx"],
    name="tiny-ltx-i2v",
    builder="ditfuse.models.ltx_configs:build_tiny_i2v_pipeline",
    note="tiny-ltx-i2v has random weights: its videos are noise (it exercises the LTX-Video image-to-video "
         "pipeline, not video quality)",
    pipeline="LTXImageToVideoPipeline",
)
# LTX-Video 0.9.5+'s condition pipeline: tiny-ltx's parts, weights and geometry as an
# LTXConditionPipeline (ltx_configs.build_tiny_condition_pipeline: the 0.9.5+ scheduler, without
# dynamic shifting), text-only or on an image at frame 0; prompts padded to the tiny tokenizer's
# 128 positions (the call's own default is 256)
PRESET_TABLE["tiny-ltx-condition"] = replace(
    PRESET_TABLE["tiny-ltx"],
    name="tiny-ltx-condition",
    builder="ditfuse.models.ltx_configs:build_tiny_condition_pipeline",
    call_kwargs={"max_sequence_length": 128},
    note="tiny-ltx-condition has random weights: its videos are noise (it exercises the LTX-Video condition "
         "pipeline, not video quality)",
    pipeline="LTXConditionPipeline",
)
# HunyuanVideo 1.5 image-to-video: tiny-hunyuanvideo15's parts, geometry and text lengths plus a
# SigLIP image encoder, as a HunyuanVideo15ImageToVideoPipeline. Its transformer's target_size (192)
# makes the 16:9 bucket 256x144, tiny-hunyuanvideo15's default size; a clip's size is its image's
# aspect bucket (or a named bucket the image is cropped to).
PRESET_TABLE["tiny-hunyuanvideo15-i2v"] = replace(
    PRESET_TABLE["tiny-hunyuanvideo15"],
    name="tiny-hunyuanvideo15-i2v",
    builder="ditfuse.models.hunyuanvideo15_configs:build_tiny_i2v_pipeline",
    note="tiny-hunyuanvideo15-i2v has random weights: its videos are noise (it exercises the HunyuanVideo 1.5 "
         "image-to-video pipeline, not video quality)",
    pipeline="HunyuanVideo15ImageToVideoPipeline",
)
# SkyReels-V2 image-to-video: tiny-skyreels-v2's geometry, frame rule, 24 fps and call kwargs (the
# builder's module's TINY_CALL_KWARGS), its parts and weights plus tiny-wan-i2v's CLIP vision
# encoder, as a SkyReelsV2ImageToVideoPipeline (wan_variants_configs.build_tiny_i2v_pipeline);
# guidance from the pipeline's row (5.0, the I2V call's default)
PRESET_TABLE["tiny-skyreels-v2-i2v"] = replace(
    PRESET_TABLE["tiny-skyreels-v2"],
    name="tiny-skyreels-v2-i2v",
    builder="ditfuse.models.wan_variants_configs:build_tiny_i2v_pipeline",
    note="tiny-skyreels-v2-i2v has random weights: its videos are noise (it exercises the SkyReels-V2 "
         "image-to-video pipeline, not video quality)",
    pipeline="SkyReelsV2ImageToVideoPipeline",
)
# Wan 2.2 in miniature (ditfuse.models.wan_configs): tiny-wan's geometry, frame rule, steps,
# guidance and call kwargs, each in a real checkpoint's layout. One preset per pipeline class (a
# preset's directory names one): TI2V-5B's text mode (WanPipeline with expand_timesteps) and its
# image mode (WanImageToVideoPipeline without an image encoder) on the same weights, whose
# 48-channel Wan 2.2 VAE makes sides multiples of 32 (16x VAE x 2x2 patches) and whose clips are
# 24 fps; A14B's text and image modes, two experts each (transformer_2 below boundary_ratio) on
# the Wan 2.1 VAE (sides in 16s, 16 fps).
def _tiny_wan22_preset(name: str, builder: str, pipeline: str, label: str, size_multiple: int, fps: int) -> Preset:
    """tiny-wan's preset with another builder (``wan_configs.<builder>``), pipeline class, side
    multiple and frame rate."""
    return replace(
        PRESET_TABLE[TINY_WAN],
        name=name,
        builder=f"ditfuse.models.wan_configs:{builder}",
        note=f"{name} has random weights: its videos are noise (it exercises the {label} pipeline, not video quality)",
        pipeline=pipeline,
        size_multiple=size_multiple,
        fps=fps,
    )


PRESET_TABLE.update({p.name: p for p in (
    _tiny_wan22_preset("tiny-wan22-5b", "build_tiny_wan22_ti2v", "WanPipeline", "Wan 2.2 TI2V-5B text-to-video",
                       32, 24),
    _tiny_wan22_preset("tiny-wan22-5b-i2v", "build_tiny_wan22_ti2v_i2v", "WanImageToVideoPipeline",
                       "Wan 2.2 TI2V-5B image-to-video", 32, 24),
    _tiny_wan22_preset("tiny-wan22-a14b", "build_tiny_wan22_a14b", "WanPipeline", "Wan 2.2 T2V-A14B two-expert",
                       16, 16),
    _tiny_wan22_preset("tiny-wan22-a14b-i2v", "build_tiny_wan22_a14b_i2v", "WanImageToVideoPipeline",
                       "Wan 2.2 I2V-A14B two-expert image-to-video", 16, 16),
)})
# First-last-frame-to-video: tiny-wan-i2v's and tiny-skyreels-v2-i2v's pipelines and weights whose
# transformers also have the image position embedding of two images' CLIP tokens
# (Wan2.1-FLF2V-14B-720P's layout): every request brings a first and a last image (the call
# encodes both with CLIP; an I2V transformer without that embedding cannot take a last image).
PRESET_TABLE.update({p.name: p for p in (
    replace(PRESET_TABLE["tiny-wan-i2v"], name="tiny-wan-flf2v",
            builder="ditfuse.models.wan_configs:build_tiny_wan_flf2v",
            note="tiny-wan-flf2v has random weights: its videos are noise (it exercises the Wan first-last-frame "
                 "image-to-video pipeline, not video quality)"),
    replace(PRESET_TABLE["tiny-skyreels-v2-i2v"], name="tiny-skyreels-v2-flf2v",
            builder="ditfuse.models.wan_variants_configs:build_tiny_flf2v_pipeline",
            note="tiny-skyreels-v2-flf2v has random weights: its videos are noise (it exercises the SkyReels-V2 "
                 "first-last-frame image-to-video pipeline, not video quality)"),
)})
PRESETS = tuple(PRESET_TABLE)
# (default size, size multiple) per preset, known without loading it.
PRESET_GEOMETRY = {name: (p.default_size, p.size_multiple) for name, p in PRESET_TABLE.items()}

@dataclass
class LoadedModel:
    """A pipeline plus what the runtime needs to know to call it."""

    name: str
    pipe: Any
    device: str
    dtype: Any
    is_preset: bool
    # Extra keyword arguments every call to ``pipe`` gets (e.g. a short T5 length for the preset).
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    default_size: tuple[int, int] = (1024, 1024)
    # Height and width must be multiples of this (VAE downsampling x latent patch size).
    size_multiple: int = 16
    note: str | None = None
    kind: str = "image"  # "image" | "video"
    fps: int | None = None
    frame_multiple: int = 1
    default_frames: int | None = None
    default_steps: int | None = None
    default_guidance: float | None = None
    loras: tuple[str, ...] = ()  # what --lora loaded, for the startup lines ("path (scale 0.8)")
    # How the runtime calls this pipeline class (guidance, negative prompts; runtime/pipelines.py).
    spec: PipelineSpec = field(default_factory=lambda: spec_for("FluxPipeline"))
    # A pipeline that derives its output size from its input image (spec.size_from_image): what
    # the spec's size functions read of it (spec.sizing(pipe)), kept where the pipeline is not (the
    # server process of serve --gpus N); None: they read ``pipe``.
    sizing: Any = None
    # What this checkpoint accepts where the row leaves it to the checkpoint (a second guidance
    # scale, a last image): spec.capabilities(pipe), kept where the pipeline is not (serve --gpus N).
    capabilities: Capabilities = field(default_factory=Capabilities)

    @property
    def is_video(self) -> bool:
        return self.kind == "video"

    def lora_lines(self) -> str:
        """One ``LoRA: ...`` line per loaded LoRA (startup summaries)."""
        return "".join(f"LoRA: {lora}\n" for lora in self.loras)


@dataclass(frozen=True)
class LoraSpec:
    """One ``--lora PATH[:SCALE]``: a LoRA in diffusers/PEFT format (a directory with
    ``pytorch_lora_weights.safetensors``, or the .safetensors file itself) and its weight."""

    path: str
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "LoraSpec":
        """``PATH`` or ``PATH:SCALE`` (the part after the last colon is a scale only if it is a
        number, so a path with colons still works)."""
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                return cls(head, float(tail))
            except ValueError:
                pass
        return cls(text, 1.0)

    def describe(self) -> str:
        return f"{self.path} (scale {self.scale:g})"


def lora_specs(args: Any) -> list[LoraSpec]:
    """The ``--lora`` options of parsed ``args`` (none when the command has no such option)."""
    return [LoraSpec.parse(t) for t in getattr(args, "lora", None) or ()]


def apply_loras(pipe: Any, loras: "list[LoraSpec] | tuple[LoraSpec, ...]", fuse: bool = False) -> tuple[str, ...]:
    """Load ``loras`` into ``pipe`` as diffusers does (``load_lora_weights`` per LoRA, then
    ``set_adapters`` with their scales); ``fuse``: merge them into the weights and drop the
    adapter layers (``fuse_lora`` + ``unload_lora_weights``): no per-step LoRA cost, one fixed mix.
    Returns their descriptions. ValueError for a missing file, a pipeline without LoRA support,
    or no ``peft`` (diffusers' LoRA backend)."""
    if not loras:
        return ()
    if not hasattr(pipe, "load_lora_weights"):
        raise ValueError(f"{type(pipe).__name__} does not load LoRA weights (no load_lora_weights)")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ValueError("--lora needs peft (diffusers' LoRA backend): pip install 'ditfuse[lora]'")
    names = []
    for i, lora in enumerate(loras):
        path = Path(lora.path).expanduser()
        if not path.exists():
            raise ValueError(f"LoRA {lora.path!r} does not exist")
        name = f"ditfuse_lora_{i}"
        if path.is_file():
            pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        else:
            pipe.load_lora_weights(str(path), adapter_name=name)
        names.append(name)
    pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])
    if fuse:
        pipe.fuse_lora(adapter_names=names)
        pipe.unload_lora_weights()
    return tuple(lora.describe() + (", fused" if fuse else "") for lora in loras)


def cache_dir() -> Path:
    """``$DITFUSE_CACHE`` or ``~/.cache/ditfuse``."""
    env = os.environ.get("DITFUSE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ditfuse"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | Any | None, device: str) -> Any:
    """``None``/``"auto"`` -> bf16 on CUDA, fp32 on CPU; else ``"bf16"|"fp16"|"fp32"`` or a torch dtype."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    try:
        return names[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; allowed: auto, bf16, fp16, fp32") from None


def build_tiny_flux():
    """Build the tiny FluxPipeline in memory (random weights, seed ``_TINY_SEED``)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..models.tiny_parts import autoencoder_kl, clip_tokenizer, t5_encoder, t5_tokenizer

    # Both tokenizers are character-level, so a prompt costs about one token per character:
    # CLIP keeps its usual 77 positions and T5 gets 128 (FLUX.1 uses 512; not needed here).
    clip_len, t5_len = 77, 128
    tokenizer = clip_tokenizer(clip_len)
    tokenizer_2 = t5_tokenizer(t5_len)

    torch.manual_seed(_TINY_SEED)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=clip_len,
            projection_dim=32,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    text_encoder_2 = t5_encoder(tokenizer_2, 32, heads=4, d_ff=64)
    # FLUX.1 layout in miniature: 16 latent channels packed 2x2 -> in_channels 64; the RoPE axes
    # (4, 6, 6) sum to the head dim 16; 1 dual-stream + 1 single-stream block.
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    # Four resolution levels -> vae_scale_factor 8, as in FLUX.1, so sizes are multiples of 16.
    vae = autoencoder_kl(16)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_tiny_flux_kontext():
    """tiny-flux's parts and weights as a diffusers ``FluxKontextPipeline`` (FLUX.1 Kontext edits:
    the input image's latents join the sequence, with their own position ids). Random weights:
    its images are noise."""
    from diffusers import FluxKontextPipeline

    t2i = build_tiny_flux()
    return FluxKontextPipeline(**{name: getattr(t2i, name) for name in (
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")})


def build_tiny_flux_fill():
    """tiny-flux's parts and weights as a diffusers ``FluxFillPipeline`` (FLUX.1 Fill: inpainting and
    outpainting), with its own transformer: tiny-flux's layout, but each token also carries the
    packed latents of the masked image and the packed mask, as FLUX.1 Fill's (in_channels 384 =
    64 + 64 + 256), and the output stays the noise latents' 64. With tiny-flux's VAE (16 latent
    channels, vae_scale_factor 8) and 2x2 packing the sizes are the real model's: latents 16 x 4
    = 64, masked-image latents 64, the mask's 8 x 8 pixels per latent pixel x 4 = 256 (the call's
    prepare_mask_latents). Random weights from seed ``_TINY_SEED``: its images are noise."""
    import torch
    from diffusers import FluxFillPipeline, FluxTransformer2DModel

    t2i = build_tiny_flux()
    latent = t2i.vae.config.latent_channels * 4  # 2x2 packed
    mask = t2i.vae_scale_factor ** 2 * 4  # a latent pixel's 8x8 mask pixels, 2x2 packed
    torch.manual_seed(_TINY_SEED)
    config = {k: v for k, v in t2i.transformer.config.items() if not k.startswith("_")}
    transformer = FluxTransformer2DModel(**{**config, "in_channels": 2 * latent + mask, "out_channels": latent}).eval()
    return FluxFillPipeline(transformer=transformer, **{name: getattr(t2i, name) for name in (
        "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")})


def preset_path(name: str) -> Path:
    p = PRESET_TABLE[name]
    return cache_dir() / "presets" / f"{p.name}-v{p.version}"


def build_preset(name: str) -> Any:
    """Build preset ``name``'s pipeline in memory (its builder, imported now)."""
    module, _, attr = PRESET_TABLE[name].builder.partition(":")
    return getattr(importlib.import_module(module), attr)()


def tiny_flux_path() -> Path:
    return preset_path(TINY_FLUX)


def ensure_tiny_flux() -> Path:
    return ensure_preset(TINY_FLUX)


def ensure_preset(name: str) -> Path:
    """Build and save a preset once; return its directory. Safe against concurrent builders:
    each builds into a private temporary directory and renames it into place atomically."""
    path = preset_path(name)
    if (path / "model_index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build_preset(name).save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, path)
        except OSError:
            # Another process won the race; its copy is identical (same seed, same recipe).
            if not (path / "model_index.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _from_pretrained(path: Path, torch_dtype: Any) -> Any:
    """``DiffusionPipeline.from_pretrained`` without the per-component progress bars and info
    chatter (warnings and errors still show)."""
    import diffusers
    import transformers
    from diffusers import DiffusionPipeline

    d_level = diffusers.utils.logging.get_verbosity()
    t_level = transformers.utils.logging.get_verbosity()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    try:
        pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch_dtype)
    finally:
        diffusers.utils.logging.set_verbosity(d_level)
        transformers.utils.logging.set_verbosity(t_level)
        diffusers.utils.logging.enable_progress_bar()
        transformers.utils.logging.enable_progress_bar()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_model(model: str, device: str | None = None, dtype: str | Any | None = None,
               loras: "list[LoraSpec] | tuple[LoraSpec, ...]" = (), fuse_lora: bool = False) -> LoadedModel:
    """Load a preset (built and cached on first use) or a local diffusers directory, with
    ``loras`` loaded into it (:func:`apply_loras`)."""
    loaded = _load_model(model, device, dtype)
    if loras:
        loaded.loras = apply_loras(loaded.pipe, loras, fuse=fuse_lora)
    return loaded


def _load_model(model: str, device: str | None, dtype: str | Any | None) -> LoadedModel:
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    if model in PRESET_TABLE:
        p = PRESET_TABLE[model]
        pipe = _from_pretrained(ensure_preset(model), torch_dtype)
        spec = spec_for(type(pipe).__name__)
        if spec.prepare is not None:
            spec.prepare(pipe)
        if p.prepare is not None:
            module, _, attr = p.prepare.partition(":")
            getattr(importlib.import_module(module), attr)(pipe)
        return LoadedModel(
            name=p.name,
            pipe=pipe.to(device),
            device=device,
            dtype=torch_dtype,
            is_preset=True,
            call_kwargs=p.resolved_call_kwargs(),
            default_size=p.default_size,
            size_multiple=p.size_multiple,
            note=p.note,
            kind=p.kind,
            fps=p.fps,
            frame_multiple=p.frame_multiple,
            default_frames=p.default_frames,
            default_steps=p.default_steps if p.default_steps is not None else spec.default_steps,
            default_guidance=p.default_guidance if p.default_guidance is not None else spec.guidance_for(pipe),
            spec=spec,
            sizing=spec.sizing(pipe) if spec.sizing is not None else None,
            capabilities=spec.capabilities(pipe),
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown model {model!r}: not a built-in preset ({', '.join(PRESETS)}) and not a directory"
        )
    if not (path / "model_index.json").is_file():
        if (path / "modular_model_index.json").is_file():
            # FLUX.3 ships as modular pipelines only (diffusers 0.42.1)
            raise ValueError(
                f"{path} is a diffusers modular pipeline (modular_model_index.json, e.g. FLUX.3): "
                "`ditfuse generate` / `serve` load DiffusionPipeline directories only; in Python, "
                "`ditfuse.accelerate(pipe)` mounts on a loaded ModularPipeline's components")
        raise ValueError(f"{path} is not a diffusers pipeline directory (no model_index.json)")
    spec = spec_for(pipeline_class(path))
    note = unknown_pipeline_note(spec)
    if note:
        log.warning(note)
    pipe = _from_pretrained(path, torch_dtype).to(device)
    if spec.prepare is not None:
        spec.prepare(pipe)
    loaded = LoadedModel(
        name=path.name,
        pipe=pipe,
        device=device,
        dtype=torch_dtype,
        is_preset=False,
        default_size=spec.size_for(pipe),
        size_multiple=spec.size_multiple(pipe),
        kind=spec.kind,
        default_steps=spec.default_steps,
        default_guidance=spec.guidance_for(pipe),
        spec=spec,
        sizing=spec.sizing(pipe) if spec.sizing is not None else None,
        capabilities=spec.capabilities(pipe),
    )
    if spec.is_video:
        loaded.fps = spec.fps_for(pipe)
        loaded.frame_multiple = spec.frame_multiple(pipe)
        loaded.default_frames = spec.default_frames
    return loaded


def pipeline_class(path: Path) -> str | None:
    """The pipeline class named in a diffusers directory's model_index.json (``_class_name``)."""
    try:
        index = json.loads((Path(path) / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}/model_index.json is not readable JSON: {e}") from None
    name = index.get("_class_name") if isinstance(index, dict) else None
    return name if isinstance(name, str) else None


def is_video_model(model: str) -> bool:
    """Whether ``model`` (a preset name or a diffusers directory) makes videos, without loading it."""
    if model in PRESET_TABLE:
        return PRESET_TABLE[model].kind == "video"
    path = Path(model).expanduser()
    if not (path / "model_index.json").is_file():
        return False
    return spec_for(pipeline_class(path)).is_video


def model_help() -> str:
    """The ``--model`` help: every preset by what it makes (read from the table, so a new preset
    shows up by itself), then the directory alternative."""
    groups: dict[str, list[str]] = {}
    for name, p in PRESET_TABLE.items():
        spec = p.spec
        if spec.image_kwarg is None:
            what = "videos" if p.kind == "video" else "images"
        elif p.kind == "video":
            what = "videos, or videos from an image" if spec.image_optional else "videos from an image"
        elif spec.takes_mask:
            what = "inpainted images (an image and a mask)"
        else:
            what = "images or edits" if spec.image_optional else "edited images"
        groups.setdefault(what, []).append(name)
    listed = "; ".join(f"{what}: {', '.join(names)}" for what, names in groups.items())
    return (f"a built-in preset with random weights, whose images and videos are noise ({listed}); "
            "or a diffusers directory (docs/serving.md lists the pipeline classes)")


def video_models_hint() -> str:
    """What can make videos, for messages: the video presets, then the video pipeline classes a
    directory may hold (both read from the tables, so a new family shows up by itself)."""
    from .pipelines import PIPELINE_SPECS

    presets = [name for name, p in PRESET_TABLE.items() if p.kind == "video"]
    classes = [name for name, spec in PIPELINE_SPECS.items() if spec.is_video]
    return f"{', '.join(presets)}, or a {', '.join(classes[:-1])} or {classes[-1]} directory"


CUDA_GRAPH_SETTINGS = ("auto", "on", "off")


def cuda_graphs_for(setting: "bool | str", loaded: LoadedModel) -> bool:
    """Whether to capture lossless CUDA graphs of ``loaded``'s transformer steps.

    ``True`` / ``"on"`` and ``False`` / ``"off"`` say so; ``"auto"`` is on for image models and
    off for video models and for pipelines whose forward syncs with the host
    (``PipelineSpec.cuda_graphs``: Qwen-Image 2.1, Chroma). Measured on the H200 (round 9, bench/results/*_round9_h200.csv):
    graphs cut an image step's host time to ~1 ms. That made the step 1.5-3 % faster: FLUX.1
    128.22 -> 125.45 ms, SD3.5-large 70.96 -> 69.75. A Wan-1.3B 480p step (507.7 ms) already
    hides its host time, and its graph ran slower: 510.2 ms at B=1, 1016.2 against 1010.8 ms at
    B=2. Each graph would also keep a video step's activations alive.
    """
    if isinstance(setting, bool):
        return setting
    if setting not in CUDA_GRAPH_SETTINGS:
        raise ValueError(f"cuda_graph must be one of {', '.join(CUDA_GRAPH_SETTINGS)} (or a bool), got {setting!r}")
    if setting == "auto":
        spec = getattr(loaded, "spec", None)
        return not loaded.is_video and (spec is None or spec.cuda_graphs)
    return setting == "on"
