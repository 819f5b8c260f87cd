"""Tiny random-weight diffusers models for CPU tests (their outputs are noise)."""

import torch


def tiny_flux(seed: int = 0, guidance: bool = False, dtype=torch.float32, layers=(1, 1), heads=2, head_dim=16):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    rope = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=layers[0], num_single_layers=layers[1],
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance, axes_dims_rope=rope,
    )
    return m.to(dtype).eval()


def flux_inputs(model, batch=1, img=16, txt=8, seed=1, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    ids = torch.zeros(img, 3)
    side = int(img ** 0.5)
    ids[:, 1] = torch.arange(img) // side
    ids[:, 2] = torch.arange(img) % side
    kw = dict(
        hidden_states=torch.randn(batch, img, cfg.in_channels, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, txt, cfg.joint_attention_dim, generator=g).to(dtype),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(dtype),
        timestep=torch.full((batch,), 0.7).to(dtype),
        img_ids=ids,
        txt_ids=torch.zeros(txt, 3),
        return_dict=False,
    )
    if cfg.guidance_embeds:
        kw["guidance"] = torch.full((batch,), 3.5)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
