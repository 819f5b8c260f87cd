"""Configs for the issue-12 families (Qwen-Image, SD3/3.5, FLUX.2, Z-Image), FLUX.3 and Chroma: constructor
kwargs of diffusers 0.42.1's transformer classes, tiny (every block type, for CPU tests) and real
size (random-weight step benchmarks), plus the 1024x1024 step-input shapes.

Data only; diffusers is imported inside functions (notes/families.md explains each choice).
Real-size kwargs are the published ``config.json`` values of the checkpoints named in the keys
(architecture fields only; the weights are random).
"""

from __future__ import annotations

from typing import Any

# -- tiny configs: every block type, awkward sizes, fast on CPU ---------------------------------

TINY: dict[str, dict[str, Any]] = {
    # 2 dual-stream blocks; head_dim 16 = axes 4 + 6 + 6 (QwenEmbedRope splits head_dim/2 complex
    # pairs as 2 + 3 + 3).
    "qwenimage": dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    ),
    # SD3.5-medium-like: block 0 dual attention (SD35AdaLayerNormZeroX + attn2), block 1 plain
    # joint block, block 2 the context_pre_only last block; QK RMSNorm (diffusers RMSNorm).
    "sd35": dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=20, caption_projection_dim=16,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(0,), qk_norm="rms_norm",
    ),
    # SD3-medium-like: no QK norm, no dual attention.
    "sd3": dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=20, caption_projection_dim=16,
        pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16,
        dual_attention_layers=(), qk_norm=None,
    ),
    # 2 double + 2 single blocks; 4 RoPE axes of 4 (head_dim 16).
    "flux2": dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=16,
        mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=True,
    ),
    # 2 per-mode blocks per mode (text, image, reference image) + 2 joint single blocks; 4 RoPE
    # axes of 4 (head_dim 16); 8 image / 12 reference channels (the two embedders differ).
    "flux3": dict(
        in_channels=8, cond_in_channels=12, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, timestep_channels=16, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), rope_theta=10000, eps=1e-6,
    ),
    # Chroma: 2 dual + 2 single blocks, head_dim 16 = RoPE axes 4 + 6 + 6, a 1-layer approximator.
    "chroma": dict(
        patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
        approximator_hidden_dim=32, approximator_layers=1,
    ),
    # Qwen-Image 2.1: 3 single-stream blocks (two hand-offs), head_dim 16 = RoPE axes 4 + 6 + 6,
    # SwiGLU 3x, 16 packed latent channels, VLM text states of width 24.
    "qwenimage21": dict(
        patch_size=1, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=16,
        num_attention_heads=2, context_in_dim=24, mlp_ratio=3, axes_dims_rope=(4, 6, 6),
        causal_condition=True,
    ),
    # 1 noise refiner (modulated), 1 context refiner (unmodulated), 2 main blocks; dim 32 ->
    # FFN hidden int(32 / 3 * 8) = 85 (odd); head_dim 16 = 4 + 6 + 6.
    "zimage": dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=24,
        rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32],
    ),
}

# -- real-size configs (random weights) ---------------------------------------------------------

REAL: dict[str, dict[str, Any]] = {
    # Qwen/Qwen-Image: 60 dual-stream blocks, width 24 x 128 = 3072, FF 4x (12288).
    "qwenimage": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
        axes_dims_rope=(16, 56, 56),
    ),
    # stabilityai/stable-diffusion-3.5-large: 38 joint blocks, width 38 x 64 = 2432, QK RMSNorm.
    "sd35_large": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
        dual_attention_layers=(), qk_norm="rms_norm",
    ),
    # stabilityai/stable-diffusion-3.5-medium: 24 blocks, width 1536, blocks 0-12 dual attention.
    "sd35_medium": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
        dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    ),
    # stabilityai/stable-diffusion-3-medium-diffusers: 24 blocks, width 1536, no QK norm.
    "sd3_medium": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192,
        dual_attention_layers=(), qk_norm=None,
    ),
    # black-forest-labs/FLUX.2-dev: 8 double + 48 single blocks, width 48 x 128 = 6144, SwiGLU 3x.
    "flux2": dict(
        patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
        mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
        guidance_embeds=True,
    ),
    # lodestones/Chroma1-HD (FLUX.1-schnell's blocks, pruned modulation): 19 dual + 38 single
    # blocks, width 24 x 128 = 3072, T5 text states of width 4096, a 5-layer approximator.
    "chroma": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
        approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5,
    ),
    # FLUX.3 as diffusers 0.42.1's Flux3Transformer2DModel defaults declare it: 5 per-mode blocks
    # per token mode + 28 joint single blocks, width 24 x 128 = 3072, SwiGLU 3x, 128 latent
    # channels, stacked Qwen3-VL text states of width 20480.
    "flux3": dict(
        in_channels=128, cond_in_channels=128, num_layers=5, num_single_layers=28, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=20480, timestep_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=10000, eps=1e-6,
    ),
    # Qwen-Image 2.1 as diffusers 0.42.1's QwenImage21Transformer2DModel defaults declare it: 32
    # single-stream blocks, width 32 x 128 = 4096, SwiGLU 3x (12288), 64 packed latent channels,
    # VLM text states of width 4096, causal_condition (t = 0 modulation for the prefix, KV cache).
    "qwenimage21": dict(
        patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
        num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
        causal_condition=True,
    ),
    # Tongyi-MAI/Z-Image(-Turbo), 6B: 30 main + 2 noise-refiner + 2 context-refiner blocks,
    # width 30 x 128 = 3840, SwiGLU FFN 10240.
    "zimage": dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
        n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
        axes_lens=[1536, 512, 512],
    ),
}

# Text tokens assumed for a 1024x1024 step. Qwen-Image and Z-Image use the prompt's real length
# (Z-Image pads it to a multiple of 32); 512 is the pipelines' max_sequence_length. SD3 is always
# 77 (CLIP) + 256 (T5) = 333. FLUX.2 pads to max_sequence_length = 512.
TEXT_TOKENS = {"qwenimage": 512, "sd35_large": 333, "sd35_medium": 333, "sd3_medium": 333,
               "flux2": 512, "flux3": 512, "chroma": 512, "zimage": 512, "qwenimage21": 512}

CLASS_NAMES = {
    "qwenimage": "QwenImageTransformer2DModel",
    "sd35": "SD3Transformer2DModel", "sd3": "SD3Transformer2DModel",
    "sd35_large": "SD3Transformer2DModel", "sd35_medium": "SD3Transformer2DModel",
    "sd3_medium": "SD3Transformer2DModel",
    "flux2": "Flux2Transformer2DModel",
    "flux3": "Flux3Transformer2DModel",
    "chroma": "ChromaTransformer2DModel",
    "zimage": "ZImageTransformer2DModel",
    "qwenimage21": "QwenImage21Transformer2DModel",
}


def config(name: str, size: str = "tiny") -> dict[str, Any]:
    """Constructor kwargs (a fresh dict) for ``name`` in ``TINY`` or ``REAL``."""
    table = {"tiny": TINY, "real": REAL}[size]
    return dict(table[name])


def build(name: str, size: str = "tiny", dtype=None, device=None, seed: int = 0):
    """A random-weight transformer for ``name``; ``device="meta"`` builds it without memory."""
    import diffusers
    import torch

    cls = getattr(diffusers, CLASS_NAMES[name])
    torch.manual_seed(seed)
    if device is not None and str(device) == "meta":
        with torch.device("meta"):
            model = cls(**config(name, size))
    else:
        model = cls(**config(name, size))
        if device is not None:
            model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def step_inputs(name: str, model, batch: int = 1, height: int = 1024, width: int = 1024,
                text_tokens: int | None = None, dtype=None, device="cpu", seed: int = 1,
                cond_tokens: int = 0) -> dict[str, Any]:
    """Keyword inputs of one denoising step at ``height`` x ``width`` pixels (random values).

    Latent geometry per family: Qwen-Image / SD3 / Z-Image VAEs downsample 8x (16 latent
    channels); Qwen-Image packs 2x2 patches (64 channels), SD3 / Z-Image patchify 2x2 inside the
    transformer; FLUX.2's VAE downsamples 8x to 32 channels and the pipeline packs 2x2 (128), as
    FLUX.3's inputs here do. All give (height/16) x (width/16) image tokens (4096 at 1024x1024).
    ``cond_tokens``: FLUX.3's reference-image tokens (image-to-image), none by default; for
    Qwen-Image 2.1 the side of a square condition image in latent tokens (an edit step: its tokens
    first in ``hidden_states``, its VLM slots inside the text, as the pipeline lays them out).
    """
    import torch

    cfg = model.config
    dtype = dtype or next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    family = name.split("_")[0] if name.startswith("sd3") else name
    key = name if name in TEXT_TOKENS else {"sd35": "sd35_large", "sd3": "sd3_medium"}.get(name, name)
    txt = text_tokens if text_tokens is not None else TEXT_TOKENS[key]
    h, w = height // 16, width // 16

    def rnd(*shape):
        t = torch.randn(*shape, generator=g) if str(device) != "meta" else torch.empty(*shape)
        return t.to(device=device, dtype=dtype)

    if family == "qwenimage":
        return dict(
            hidden_states=rnd(batch, h * w, cfg.in_channels),
            encoder_hidden_states=rnd(batch, txt, cfg.joint_attention_dim),
            encoder_hidden_states_mask=None,
            timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
            img_shapes=[[(1, h, w)]] * batch,
            return_dict=False,
        )
    if family.startswith("sd3"):
        return dict(
            hidden_states=rnd(batch, cfg.in_channels, 2 * h, 2 * w),
            encoder_hidden_states=rnd(batch, txt, cfg.joint_attention_dim),
            pooled_projections=rnd(batch, cfg.pooled_projection_dim),
            timestep=torch.full((batch,), 700.0, device=device, dtype=dtype),
            return_dict=False,
        )
    if family == "flux2":
        img_ids = torch.zeros(h * w, 4, device=device)
        if str(device) != "meta":
            img_ids[:, 1] = torch.arange(h * w) // w
            img_ids[:, 2] = torch.arange(h * w) % w
            txt_ids = torch.zeros(txt, 4)
            txt_ids[:, 3] = torch.arange(txt)
        else:
            txt_ids = torch.zeros(txt, 4, device=device)
        return dict(
            hidden_states=rnd(batch, h * w, cfg.in_channels),
            encoder_hidden_states=rnd(batch, txt, cfg.joint_attention_dim),
            timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
            img_ids=img_ids.to(device),
            txt_ids=txt_ids.to(device),
            guidance=torch.full((batch,), 4.0, device=device, dtype=dtype) if cfg.guidance_embeds else None,
            return_dict=False,
        )
    if family == "flux3":
        # (t, h, w, l) position ids; text tokens along l (the FLUX.2 layout). A reference image
        # (``cond_tokens``) sits at t = 1 on its own grid.
        img_ids = torch.zeros(h * w, 4)
        img_ids[:, 1] = torch.arange(h * w) // w
        img_ids[:, 2] = torch.arange(h * w) % w
        txt_ids = torch.zeros(txt, 4)
        txt_ids[:, 3] = torch.arange(txt)
        out = dict(
            hidden_states=rnd(batch, h * w, cfg.in_channels),
            encoder_hidden_states=rnd(batch, txt, cfg.joint_attention_dim),
            timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
            img_ids=img_ids.to(device),
            txt_ids=txt_ids.to(device),
            return_dict=False,
        )
        if cond_tokens:
            cond_ids = img_ids[:cond_tokens].clone()
            cond_ids[:, 0] = 1
            out.update(image_cond_hidden_states=rnd(batch, cond_tokens, cfg.cond_in_channels),
                       image_cond_ids=cond_ids.to(device))
        return out
    if family == "chroma":
        # FLUX.1's packing (2x2 patches of the 16-channel latent: 64 channels), 3-axis ids, and the
        # pipeline's attention mask: the prompt's real tokens, then padding, then every image token.
        img_ids = torch.zeros(h * w, 3)
        img_ids[:, 1] = torch.arange(h * w) // w
        img_ids[:, 2] = torch.arange(h * w) % w
        mask = torch.ones(batch, txt + h * w, dtype=torch.bool)
        for i in range(batch):
            mask[i, max(1, txt - 3 - 5 * i):txt] = False  # each prompt shorter than the padding
        return dict(
            hidden_states=rnd(batch, h * w, cfg.in_channels),
            encoder_hidden_states=rnd(batch, txt, cfg.joint_attention_dim),
            timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
            img_ids=img_ids.to(device),
            txt_ids=torch.zeros(txt, 3, device=device),
            # in the pipeline's dtype: ChromaPipeline casts the prompt mask to the text encoder's
            # dtype and cats bool ones for the image tokens (promoted), so the blocks multiply and
            # SDPA adds a float 1 / 0 mask, not a bool one
            attention_mask=mask.to(device=device, dtype=dtype),
            return_dict=False,
        )
    if family == "qwenimage21":
        # The pipeline's layout: the VLM sequence (text slots False, image slots True, one slot per
        # 2x2 latent tokens) with the target image's slots appended; ``encoder_hidden_states``
        # holds the VLM states of every slot but the target's.
        c = cond_tokens
        t1 = max(1, txt // 3) if c else txt
        slots = [False] * t1 + [True] * (c * c // 4) + [False] * (txt - t1 if c else 0) + [True] * (h * w // 4)
        shapes = ([(1, c, c)] if c else []) + [(1, h, w)]
        return dict(
            hidden_states=rnd(batch, c * c + h * w, cfg.in_channels),
            encoder_hidden_states=rnd(batch, len(slots) - h * w // 4, cfg.context_in_dim),
            timestep=torch.full((batch,), 0.7, device=device, dtype=dtype),
            img_shapes=[shapes] * batch,
            img_mask=torch.tensor([slots] * batch, device=device),
            return_dict=False,
        )
    if family == "zimage":
        return dict(
            x=[rnd(cfg.in_channels, 1, 2 * h, 2 * w) for _ in range(batch)],
            t=torch.full((batch,), 0.7, device=device, dtype=dtype),
            cap_feats=[rnd(txt, cfg.cap_feat_dim) for _ in range(batch)],
            return_dict=False,
        )
    raise KeyError(name)


def input_maker(name: str, default_txt_tokens: int):
    """A :class:`~ditfuse.models.families.Family` ``make_inputs`` for family ``name``: one step's
    :func:`step_inputs` at a ``WxH`` size, built on the CPU (same values on every device) and moved
    to ``device``."""

    def make_inputs(model: Any, batch: int = 1, size: str = "1024x1024", seed: int = 0, device: str = "cuda",
                    dtype: Any = None, txt_tokens: int = default_txt_tokens) -> dict[str, Any]:
        import torch

        from .families import parse_size

        W, H = parse_size(size, 2)
        kw = step_inputs(name, model, batch=batch, height=H, width=W, text_tokens=txt_tokens,
                         dtype=dtype or torch.bfloat16, device="cpu", seed=seed + 1)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

    return make_inputs


def unpack_2x2(latent: Any) -> Any:
    """[N, h*w, 4C] packed 2x2 patches on a square grid -> [N, C, 2h, 2w] (the pipelines'
    unpacking; FLUX.1, FLUX.2, Qwen-Image)."""
    n, tokens, c4 = latent.shape
    side = int(round(tokens ** 0.5))
    return latent.view(n, side, side, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c4 // 4, side * 2, side * 2)

