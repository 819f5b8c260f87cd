"""HunyuanVideo 1.5 fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's HunyuanVideo15Transformer3DModel defaults (54 dual-stream blocks,
width 16 x 128 = 2048, FF 4x, 65 input channels = 32 latent + 32 condition + 1 mask, Qwen2.5-VL
text width 3584, ByT5 width 1472, SigLIP image width 1152), ``tiny`` for tests. A step at
WxHxFRAMES: latents [B, 65, (F - 1) / 4 + 1, H / 16, W / 16] (the 1.5 VAE compresses 16x16
spatially, 4x in time), ``txt_tokens`` random Qwen2.5-VL states with the prompt's tokens valid
and the rest padding, 64 ByT5 tokens likewise, zero image embeddings (text-to-video).
:func:`build_tiny_pipeline`: a complete random-weight ``HunyuanVideo15Pipeline`` around the
``tiny`` transformer (presets, tests), with :func:`guidance_scale` (the guidance scale per call)
and :func:`set_text_lengths` (the pipeline's fixed text lengths); :func:`build_tiny_i2v_pipeline`:
the same parts plus a tiny SigLIP image encoder as a ``HunyuanVideo15ImageToVideoPipeline``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .families import Family, parse_size

DEV: dict[str, Any] = dict(
    in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
    num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=3584,
    text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0, rope_axes_dim=(16, 56, 56),
)
# 3 dual-stream blocks (two hand-offs), head_dim 16 = RoPE axes 4 + 6 + 6, a 1-layer token refiner.
TINY: dict[str, Any] = dict(
    in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=3,
    num_refiner_layers=1, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=24,
    text_embed_2_dim=20, image_embed_dim=12, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
)


def make_inputs(model: Any, batch: int = 1, size: str = "848x480x121", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = 256, byt5_tokens: int = 64, image_tokens: int = 729,
                timestep: float = 500.0) -> dict[str, Any]:
    """One step's forward kwargs (module docstring); the text masks leave each sample's last few
    tokens as padding (a different count per sample)."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    if (F - 1) % 4:
        raise ValueError(f"HunyuanVideo 1.5 frame counts are 4k+1, got {F}")
    cfg = model.config
    f, h, w = (F - 1) // 4 + 1, H // 16, W // 16
    g = torch.Generator("cpu").manual_seed(seed)

    def mask(n: int) -> torch.Tensor:
        m = torch.ones(batch, n, dtype=torch.long)
        for i in range(batch):
            m[i, max(1, n - 3 - 5 * i):] = 0
        return m.to(device)

    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=g).to(device, dtype),
        encoder_attention_mask=mask(txt_tokens),
        encoder_hidden_states_2=torch.randn(batch, byt5_tokens, cfg.text_embed_2_dim, generator=g).to(device, dtype),
        encoder_attention_mask_2=mask(byt5_tokens),
        image_embeds=torch.zeros(batch, image_tokens, cfg.image_embed_dim, device=device, dtype=dtype),
        return_dict=False,
    )


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    return torch.full((batch,), sigma * 1000.0, device=device, dtype=dtype)


def _to_images(latent: Any) -> Any:
    """[N, C, F, h, w] -> the frames as [N * F, C, h, w]."""
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


FAMILY = Family(
    name="hunyuanvideo15",
    model_class="diffusers:HunyuanVideo15Transformer3DModel",
    configs={"tiny": TINY, "dev": DEV},
    default_size="848x480x121",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "HunyuanVideo 1.5 size (54 dual-stream blocks, width 2048), random bf16 weights"},
)


# -- the tiny HunyuanVideo15Pipeline (``ditfuse generate`` / ``serve`` presets, tests) -------------

TINY_SEED = 0

# HunyuanVideo15Pipeline.__call__ has no text-length argument (its lengths are instance attributes:
# :func:`set_text_lengths`), and its defaults are valid for the tiny pipeline: nothing to add.
TINY_CALL_KWARGS: dict[str, Any] = {}

# Short text for the Triton-interpreter tests: the transformer's joint text sequence is
# mllm + byt5 + image slots long whatever the prompt (1000 + 256 + 729 by default), and the
# interpreter's cost grows with it (minutes per 2-step call at the default, about 15 s at these on
# 2 cores, for 64x48, 5 frames).
TINY_TEXT_LENGTHS: dict[str, int] = {"mllm_tokens": 48, "byt5_tokens": 8, "image_slots": 8}

# Diffusers' 480p text-to-video settings: the flow shift of the 480p checkpoints and their
# classifier-free guidance scale.
_SHIFT_480P = 5.0
_GUIDANCE_SCALE = 6.0


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``HunyuanVideo15Pipeline`` (text-to-video) with **random weights**
    (seed :data:`TINY_SEED`): its videos are noise; it exercises the pipeline's code path (the
    Qwen chat template and its crop, the quoted-text ByT5 glyph branch, the guider's CFG batches,
    the zero image embeddings of text-to-video, the causal 3D VAE decode), not video quality.
    Built offline, no download.

    Parts: ``HunyuanVideo15Transformer3DModel`` from :data:`FAMILY`'s ``tiny`` config (3
    dual-stream blocks, width 32, 4 latent channels + 4 condition + 1 mask in); a 3-layer
    ``Qwen2_5_VLTextModel`` of width 24 (``text_embed_dim``) with the byte-level Qwen2 tokenizer
    (:func:`ditfuse.models.tiny_parts.qwen2_tokenizer`); a 1-layer ``T5EncoderModel`` of width 20
    (``text_embed_2_dim``) with transformers' ``ByT5Tokenizer``; ``AutoencoderKLHunyuanVideo15``
    with the real 16x spatial / 4x temporal compression at 8 channels; the 480p
    ``FlowMatchEulerDiscreteScheduler`` (shift 5) and ``ClassifierFreeGuidance`` (scale 6).

    Calls take sizes in multiples of 16 and ``num_frames = 4k + 1``; without a size the pipeline
    makes 848x480 (the transformer's ``target_size`` 640 at 16:9), 121 frames. The transformer's
    ByT5 projection has a fixed hidden width of 2048 (4.2M of its 4.4M parameters): diffusers
    hard-codes it. The guidance scale lives on the guider, not in the call: see
    :func:`guidance_scale`. Text lengths: see :func:`set_text_lengths`.

    Batches (diffusers 0.42.1, any HunyuanVideo 1.5 pipeline): the VAE's decode fails for more
    than one video (its mid-block attention mask is [B, S, S] against [B, 1, S, S] queries) unless
    ``pipe.vae.enable_slicing()`` decodes them one by one (an attribute: not saved, set it after
    every load); ``num_videos_per_prompt`` > 1 fails in the transformer (the zero image
    embeddings are sized by the prompt count): repeat the prompt in the list instead.
    """
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from .tiny_parts import byt5_tokenizer, qwen2_tokenizer, t5_encoder

    tokenizer = qwen2_tokenizer()
    tokenizer_2 = byt5_tokenizer()
    cfg = FAMILY.config("tiny")
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=cfg["text_embed_dim"],
            intermediate_size=2 * cfg["text_embed_dim"],
            # the pipeline reads hidden_states[-3] (skips the last 2 layers): with 3 layers that is
            # the first layer's output, with 2 it would be the bare token embeddings
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            # the pipeline pads every prompt to 108 + 1000 tokens
            max_position_embeddings=2048,
            # head dim 12: the multimodal RoPE's (t, h, w) sections must cover its 6 pairs
            rope_parameters=dict(rope_type="default", mrope_section=[2, 2, 2], rope_theta=1000000.0),
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    text_encoder_2 = t5_encoder(tokenizer_2, cfg["text_embed_2_dim"], d_ff=2 * cfg["text_embed_2_dim"],
                                decoder_start_token_id=tokenizer_2.pad_token_id)
    # task_type is not read by the model; the real text-to-video checkpoints declare it
    transformer = HunyuanVideo15Transformer3DModel(**cfg, task_type="t2v").eval()
    # 5 stages as the real VAE (4 spatial downsamples, the last 2 also temporal) at 8 channels;
    # the latent width is the transformer's output width
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=cfg["out_channels"], block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
    ).eval()
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=_SHIFT_480P),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=_GUIDANCE_SCALE),
    )


def prompt_template_start(pipe: Any) -> int:
    """How many tokens of ``pipe``'s chat template precede the user's prompt: the crop the
    pipeline should apply (it hard-codes 108, the real Qwen2.5-VL tokenizer's count; the tiny
    byte-level tokenizer spells the same system message in about 490)."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    marker = "\x00"
    text = pipe.tokenizer.apply_chat_template(format_text_input([marker], pipe.system_message), tokenize=False,
                                              add_generation_prompt=True)[0]
    head = text[: text.index(marker)]
    return len(pipe.tokenizer(head, add_special_tokens=False).input_ids)


def set_text_lengths(pipe: Any, mllm_tokens: int | None = None, byt5_tokens: int | None = None,
                     image_slots: int | None = None) -> None:
    """Set a HunyuanVideo15Pipeline's text lengths (None: keep): ``mllm_tokens`` Qwen positions
    after the template crop (default 1000), ``byt5_tokens`` ByT5 positions (256),
    ``image_slots`` image-embedding slots (729, all padding in text-to-video); and the crop to
    :func:`prompt_template_start`, so the kept positions start at the prompt.

    These are attributes ``HunyuanVideo15Pipeline.__init__`` sets, not config: they are not
    saved, and ``from_pretrained`` restores the defaults (with the 108-token crop, which leaves
    the tiny tokenizer's system-message tail in the embeddings and truncates prompts past about
    590 bytes). Call it again after every load.
    """
    pipe.prompt_template_encode_start_idx = prompt_template_start(pipe)
    if mllm_tokens is not None:
        pipe.tokenizer_max_length = mllm_tokens
    if byt5_tokens is not None:
        pipe.tokenizer_2_max_length = byt5_tokens
    if image_slots is not None:
        pipe.vision_num_semantic_tokens = image_slots


@contextmanager
def guidance_scale(pipe: Any, scale: float | None) -> Iterator[None]:
    """Run the ``pipe(...)`` calls inside with classifier-free guidance at ``scale`` (None: the
    pipeline's own). ``HunyuanVideo15Pipeline.__call__`` takes no guidance argument: it reads
    ``pipe.guider``. This swaps in a fresh copy of the guider with that scale (fresh step state
    too) and puts the original back on exit, so nothing persists; the pipeline is not safe for
    concurrent calls at different scales while it is swapped. ``scale`` 1.0 turns CFG off: the
    negative prompt is not encoded and each step runs the transformer once instead of twice.
    """
    if scale is None:
        yield
        return
    saved = pipe.guider
    pipe.guider = saved.new(guidance_scale=float(scale))
    try:
        yield
    finally:
        pipe.guider = saved


# -- the tiny HunyuanVideo15ImageToVideoPipeline (``tiny-hunyuanvideo15-i2v``, tests) --------------

# The I2V transformer's target_size: the pixel side whose square area every clip's aspect bucket
# has (diffusers' 480p checkpoints: 640, 720p: 960). 192 makes the 16:9 bucket 256x144, the
# text-to-video preset's default size, instead of 480p's 848x480.
TINY_I2V_TARGET_SIZE = 192
# The SigLIP vision encoder: width = the transformer's image_embed_dim; 32-px inputs in 8-px
# patches give 16 image tokens (the real SigLIP: 384 px in 14-px patches, 729 tokens).
TINY_SIGLIP = dict(num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)


def build_tiny_i2v_pipeline() -> Any:
    """The tiny pipeline of :func:`build_tiny_pipeline` (the same parts and weights) as a
    diffusers ``HunyuanVideo15ImageToVideoPipeline``, plus what image-to-video adds: a SigLIP
    vision encoder (``SiglipVisionModel``, :data:`TINY_SIGLIP`, width ``image_embed_dim``) whose
    last hidden states are the transformer's image tokens, and its image processor (SigLIP's
    defaults at the encoder's 32 px: bicubic resize, [-1, 1] normalisation). Random weights (the
    encoder's drawn after the text-to-video parts, from its own seed): its videos are noise.

    The transformer is the same module with its config's ``target_size`` set to
    :data:`TINY_I2V_TARGET_SIZE` and ``task_type`` to ``"i2v"`` (neither is a weight; task_type is
    not read by the model, the released I2V checkpoints declare it). The I2V call takes no
    height / width: it crops the image to the aspect bucket nearest its own at ``target_size``
    (``video_processor.calculate_default_height_width``), and that is the clip's size. The
    transformer's input is the same 9 channels as text-to-video's: 4 noise, 4 of the image's
    latents on the first latent frame (zeros after), 1 first-frame mask.
    """
    import torch
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipVisionConfig, SiglipVisionModel
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    t2v = build_tiny_pipeline()
    width = t2v.transformer.config.image_embed_dim
    torch.manual_seed(TINY_SEED + 1)
    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=width, intermediate_size=2 * width, **TINY_SIGLIP)).eval()
    # transformers 5 without torchvision: SiglipImageProcessor is this PIL class (the same
    # preprocessing); naming it directly saves it under its own name
    side = TINY_SIGLIP["image_size"]
    feature_extractor = SiglipImageProcessorPil(size={"height": side, "width": side})
    t2v.transformer.register_to_config(target_size=TINY_I2V_TARGET_SIZE, task_type="i2v")
    return HunyuanVideo15ImageToVideoPipeline(
        **{name: getattr(t2v, name) for name in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler",
                                                   "text_encoder_2", "tokenizer_2", "guider")},
        image_encoder=image_encoder, feature_extractor=feature_extractor,
    )
