"""Pipelines the runtime can load: the built-in ``tiny-flux`` preset, or a local diffusers directory.

``tiny-flux`` is a complete diffusers ``FluxPipeline`` (FluxTransformer2DModel, AutoencoderKL,
FlowMatchEulerDiscreteScheduler, CLIP and T5 text encoders, tokenizers) shrunk to a few thousand
parameters with **random weights** from a fixed seed. It exists so that every command, test and
server runs on a fresh machine with no download. Its images are noise: it exercises the code path
(shapes, batching, schedulers, VAE decode, kernel mounting), not image quality.

The preset is built offline from configs (tokenizers included), saved once with
``save_pretrained`` into ``$DITFUSE_CACHE/presets/tiny-flux-v<N>`` (default cache:
``~/.cache/ditfuse``) and loaded from there afterwards, so every process sees the same weights.

Anything else passed as a model is treated as a path to a diffusers-format directory and loaded
with ``DiffusionPipeline.from_pretrained(path, dtype=...)``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY_FLUX = "tiny-flux"
# Bump when the preset's architecture or build recipe changes, so stale caches are not reused.
_TINY_FLUX_VERSION = 2
_TINY_SEED = 0

PRESETS = (TINY_FLUX,)
# (default size, size multiple) per preset, known without loading it.
PRESET_GEOMETRY = {TINY_FLUX: ((256, 256), 16)}

NOISE_NOTE = "tiny-flux has random weights: its images are noise (it exercises the pipeline, not image quality)"


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


def _clip_tokenizer(max_length: int):
    """A CLIP BPE tokenizer over single byte-level characters (no merges): every word becomes
    its characters, the last one carrying CLIP's ``</w>`` suffix."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab: dict[str, int] = {}
    for tok in ("<|startoftext|>", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _t5_tokenizer(max_length: int):
    """A T5 Unigram tokenizer over lowercase letters, digits and punctuation (no extra ids)."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()/"
    pieces += [("▁" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_tiny_flux():
    """Build the tiny FluxPipeline in memory (random weights, seed ``_TINY_SEED``)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    # Both tokenizers are character-level, so a prompt costs about one token per character:
    # CLIP keeps its usual 77 positions and T5 gets 128 (FLUX.1 uses 512; not needed here).
    clip_len, t5_len = 77, 128
    tokenizer = _clip_tokenizer(clip_len)
    tokenizer_2 = _t5_tokenizer(t5_len)

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
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=1,
            num_heads=4,
            relative_attention_num_buckets=8,
            dense_act_fn="gelu_new",
            feed_forward_proj="gated-gelu",
            is_gated_act=True,
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
        )
    ).eval()
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
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()
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


def tiny_flux_path() -> Path:
    return cache_dir() / "presets" / f"{TINY_FLUX}-v{_TINY_FLUX_VERSION}"


def ensure_tiny_flux() -> Path:
    """Build and save the preset once; return its directory. Safe against concurrent builders:
    each builds into a private temporary directory and renames it into place atomically."""
    path = tiny_flux_path()
    if (path / "model_index.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build_tiny_flux().save_pretrained(tmp, safe_serialization=True)
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


def load_model(model: str, device: str | None = None, dtype: str | Any | None = None) -> LoadedModel:
    """Load ``tiny-flux`` (built and cached on first use) or a local diffusers directory."""
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    if model == TINY_FLUX:
        path = ensure_tiny_flux()
        pipe = _from_pretrained(path, torch_dtype)
        return LoadedModel(
            name=TINY_FLUX,
            pipe=pipe.to(device),
            device=device,
            dtype=torch_dtype,
            is_preset=True,
            call_kwargs={"max_sequence_length": 128},
            default_size=PRESET_GEOMETRY[TINY_FLUX][0],
            size_multiple=PRESET_GEOMETRY[TINY_FLUX][1],
            note=NOISE_NOTE,
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown model {model!r}: not a built-in preset ({', '.join(PRESETS)}) and not a directory"
        )
    if not (path / "model_index.json").is_file():
        raise ValueError(f"{path} is not a diffusers pipeline directory (no model_index.json)")
    pipe = _from_pretrained(path, torch_dtype).to(device)
    vsf = int(getattr(pipe, "vae_scale_factor", 8))
    # Flux-style pipelines pack 2x2 latent patches, so sizes must be multiples of 2 * vae_scale_factor.
    multiple = vsf * 2
    sample = getattr(pipe, "default_sample_size", 128) * vsf
    return LoadedModel(
        name=path.name,
        pipe=pipe,
        device=device,
        dtype=torch_dtype,
        is_preset=False,
        default_size=(sample, sample),
        size_multiple=multiple,
    )
