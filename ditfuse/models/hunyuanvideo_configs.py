"""HunyuanVideo (1.0) fixtures: transformer configs and an input maker (see ditfuse/models/families.py).

``dev`` = diffusers 0.42.1's ``HunyuanVideoTransformer3DModel`` constructor defaults, which are the
HunyuanVideo 13B text-to-video transformer (the class docstring's "defaults to" values, read from
``inspect.signature`` in tests/cpu/test_hunyuanvideo_adapter.py): 20 dual-stream + 40
single-stream blocks, width 24 heads x 128 = 3072, FF 4x, 2 token-refiner layers, 16 latent
channels in and out, patch 2 (spatial) x 1 (temporal), ``qk_norm="rms_norm"``, guidance
embedding on (the distilled guidance of the released checkpoint), LLaVA-Llama-3 text width 4096,
CLIP-L pooled width 768, RoPE theta 256 with axes (16, 56, 56) (16 + 56 + 56 = 128 = head dim).
``tiny`` for tests.

A step at WxHxFRAMES as ``HunyuanVideoPipeline.__call__`` calls the transformer: latents
``[B, 16, (F - 1) / 4 + 1, H / 8, W / 8]`` (the VAE compresses 8x8 spatially, 4x in time) in the
transformer's dtype; ``timestep`` the scheduler's ``t`` broadcast to the batch in the latents'
fp32 (``t.expand(B).to(latents.dtype)``: fp32, not the transformer's dtype); Llama states
``[B, txt_tokens, 4096]`` (the pipeline's ``max_sequence_length`` 256 after the template crop)
with an integer attention mask, right-padded (the tokenizer's ``padding="max_length"``): each
sample's last few tokens padding; CLIP pooled ``[B, 768]``; ``guidance`` = scale x 1000 in the
transformer's dtype (default scale 6.0).
"""

from __future__ import annotations

from typing import Any

from .families import Family, parse_size

DEV: dict[str, Any] = dict(
    in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
    num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
)
# 2 dual + 3 single blocks (a hand-off in each chain and the dual -> single boundary), head_dim 16
# = RoPE axes 4 + 6 + 6, a 1-layer token refiner, patch 2 as the real model.
TINY: dict[str, Any] = dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
    num_single_layers=3, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=12, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
)

# HunyuanVideoPipeline's defaults: the prompt's Llama positions after the template crop, the
# embedded guidance scale.
TXT_TOKENS = 256
GUIDANCE_SCALE = 6.0


def make_inputs(model: Any, batch: int = 1, size: str = "848x480x61", seed: int = 0, device: str = "cuda",
                dtype: Any = None, txt_tokens: int = TXT_TOKENS, timestep: float = 500.0,
                guidance_scale: float = GUIDANCE_SCALE) -> dict[str, Any]:
    """One step's forward kwargs (module docstring). The text masks leave each sample's last
    ``3 + 5 * i`` tokens as padding (at least one token valid): a different count per sample."""
    import torch

    dtype = dtype or torch.bfloat16
    W, H, F = parse_size(size, 3)
    if (F - 1) % 4:
        raise ValueError(f"HunyuanVideo frame counts are 4k+1, got {F}")
    cfg = model.config
    f, h, w = (F - 1) // 4 + 1, H // 8, W // 8
    g = torch.Generator("cpu").manual_seed(seed)
    mask = torch.ones(batch, txt_tokens, dtype=torch.long)
    for i in range(batch):
        mask[i, max(1, txt_tokens - 3 - 5 * i):] = 0
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, f, h, w, generator=g).to(device, dtype),
        timestep=torch.full((batch,), timestep, device=device, dtype=torch.float32),
        encoder_hidden_states=torch.randn(batch, txt_tokens, cfg.text_embed_dim, generator=g).to(device, dtype),
        encoder_attention_mask=mask.to(device),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        guidance=torch.full((batch,), guidance_scale, device=device, dtype=dtype) * 1000.0,
        return_dict=False,
    )


def _timestep(sigma: float, batch: int, device: Any, dtype: Any) -> Any:
    import torch

    # the pipeline's t = sigma * 1000, in the latents' fp32 whatever the transformer's dtype
    return torch.full((batch,), sigma * 1000.0, device=device, dtype=torch.float32)


def _to_images(latent: Any) -> Any:
    """[N, C, F, h, w] -> the frames as [N * F, C, h, w]."""
    n, c, f, h, w = latent.shape
    return latent.permute(0, 2, 1, 3, 4).reshape(n * f, c, h, w)


FAMILY = Family(
    name="hunyuanvideo",
    model_class="diffusers:HunyuanVideoTransformer3DModel",
    configs={"tiny": TINY, "dev": DEV},
    default_size="848x480x61",
    make_inputs=make_inputs,
    timestep=_timestep,
    to_images=_to_images,
    notes={"dev": "HunyuanVideo size (20 dual + 40 single blocks, width 3072), random bf16 weights"},
)


# -- the tiny random-weight pipeline (the runtime's ``tiny-hunyuanvideo`` preset) --------------------

TINY_SEED = 0
# Llama positions per prompt after the template crop (HunyuanVideoPipeline's max_sequence_length,
# 256 for the real model): the tiny tokenizer is character-level, so a prompt costs about one
# token per character and longer prompts are cut (the pipeline truncates silently).
TINY_TEXT_LEN = 64
# How many tokens of diffusers' DEFAULT_PROMPT_TEMPLATE precede the prompt with the tiny
# character-level tokenizer (<|begin_of_text|> included): the crop the pipeline must apply. The
# template's own crop_start (95) counts the real LLaVA-Llama-3 tokenizer's tokens; with it the tiny
# pipeline would feed most of the template's system message to the transformer as if it were the
# prompt. :func:`prompt_template_start` computes it; build_tiny_pipeline checks the two agree.
TINY_CROP_START = 424
# Sampling settings of the published HunyuanVideo checkpoint (diffusers'
# scripts/convert_hunyuan_video_to_diffusers.py): FlowMatchEulerDiscreteScheduler(shift=7.0).
FLOW_SHIFT = 7.0


def _tiny_prompt_template() -> dict[str, Any]:
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    return {"template": DEFAULT_PROMPT_TEMPLATE["template"], "crop_start": TINY_CROP_START}


def prompt_template_start(tokenizer: Any, template: str | None = None) -> int:
    """How many tokens ``tokenizer`` makes of ``template`` (default: diffusers' HunyuanVideo
    DEFAULT_PROMPT_TEMPLATE) before its ``{}`` prompt slot, the tokenizer's BOS included: the
    ``crop_start`` that makes the pipeline's kept Llama positions start at the prompt."""
    if template is None:
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        template = DEFAULT_PROMPT_TEMPLATE["template"]
    head = template[: template.index("{}")]
    return len(tokenizer(head).input_ids)


def __getattr__(name: str) -> Any:
    # TINY_CALL_KWARGS is built on first use: the template comes from diffusers, which this
    # module does not import at load time (families.py imports every *_configs module).
    if name == "TINY_CALL_KWARGS":
        return {"max_sequence_length": TINY_TEXT_LEN, "prompt_template": _tiny_prompt_template()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_tiny_pipeline() -> Any:
    """A complete diffusers ``HunyuanVideoPipeline`` (text-to-video) with **random weights** (seed
    :data:`TINY_SEED`): its videos are noise; it exercises the pipeline's code path (the Llama
    prompt template and its crop, the right-padded text mask, CLIP's pooled embedding, the
    embedded guidance, true CFG with a negative prompt, the causal 3D VAE's frame-wise decode),
    not video quality. Built offline, no download.

    Parts: ``HunyuanVideoTransformer3DModel`` from :data:`FAMILY`'s ``tiny`` config (2 dual + 3
    single blocks, width 32, 4 latent channels, patch 2, guidance embedding on); a 3-layer
    ``LlamaModel`` of width 24 (``text_embed_dim``; the pipeline reads ``hidden_states[-3]``) over
    :func:`ditfuse.models.tiny_parts.llama3_tokenizer`; a 1-layer ``CLIPTextModel`` of width 12
    (``pooled_projection_dim``: its pooled output) over the character-level CLIP tokenizer;
    ``AutoencoderKLHunyuanVideo`` with the real 8x spatial / 4x temporal compression at 8
    channels, one layer per block; ``FlowMatchEulerDiscreteScheduler(shift=7.0)`` (:data:`FLOW_SHIFT`).

    Calls must pass ``TINY_CALL_KWARGS`` (the runtime's preset does): ``max_sequence_length``
    :data:`TINY_TEXT_LEN` and the pipeline's own prompt template with the tiny tokenizer's crop
    (:data:`TINY_CROP_START`). Sizes are multiples of 16, ``num_frames = 4k + 1``; without them the
    pipeline makes 1280x720, 129 frames.
    """
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    from .tiny_parts import clip_tokenizer, llama3_tokenizer

    cfg = FAMILY.config("tiny")
    tokenizer = llama3_tokenizer()
    crop = prompt_template_start(tokenizer)
    if crop != TINY_CROP_START:
        raise RuntimeError(f"the tiny Llama tokenizer spells HunyuanVideo's template head in {crop} tokens, "
                           f"not TINY_CROP_START = {TINY_CROP_START}: update the constant")
    tokenizer_2 = clip_tokenizer(77)  # the pipeline always pads CLIP to 77
    torch.manual_seed(TINY_SEED)
    text_encoder = LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg["text_embed_dim"], intermediate_size=2 * cfg["text_embed_dim"],
        # the pipeline reads hidden_states[-3] (skips the last 2 layers): with 3 layers that is the
        # first layer's output, with 2 it would be the bare token embeddings
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        # the template head + TINY_TEXT_LEN, with room for a longer max_sequence_length
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).eval()
    text_encoder_2 = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer_2), hidden_size=cfg["pooled_projection_dim"],
        intermediate_size=2 * cfg["pooled_projection_dim"], num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=cfg["pooled_projection_dim"],
        bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id,
        pad_token_id=tokenizer_2.pad_token_id,
    )).eval()
    transformer = HunyuanVideoTransformer3DModel(**cfg).eval()
    # the real VAE's four levels (three spatial downsamples, two temporal) at 8 channels; its latent
    # width is the transformer's input width
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=cfg["in_channels"], block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
    ).eval()
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=FLOW_SHIFT),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
