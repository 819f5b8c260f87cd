"""Z-Image on CUDA: the diffusers-RMSNorm kernels (norm.rms_norm_diffusers_scale,
gate_residual_rms_norm_diffusers(_scale)) bitwise vs eager at Z-Image shapes, the CUDA-order
simulation (tests/support/rms_diffusers_rows_sim.py) vs torch's own mean, and the adapter:
accelerated ZImageTransformer2DModel bitwise equal to plain diffusers with every op verified,
nothing fallen back and the kernels run.

Configs: the tiny one, and Z-Image width (3840 = 30 x 128, SwiGLU 10240, caption width 2560) with
2 main + 1 + 1 refiner blocks. 1024² (4096 image tokens) and an odd 336x208 (273); captions 512
and 77 tokens (padded by the model to multiples of 32, not of 64), a shorter second caption in
B = 2 (a padded batch with an attention mask); batch 1 and 2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.norm import rms_norm_diffusers_triton as rk
from tests.support import rms_diffusers_rows_sim as sim

DEV = "cuda"
EPS = 1e-5


def _rows(shape, dtype, g):
    s = torch.exp(torch.randn(*shape[:-1], 1, generator=g, device=DEV) * 1.5)
    return (torch.randn(*shape, generator=g, device=DEV) * s).to(dtype)


def _chunk(B, D, dtype, g):
    """A [B, 1, D] chunk of adaLN_modulation(c).unsqueeze(1).chunk(4, dim=2) (strided)."""
    return (torch.randn(B, 1, 4 * D, generator=g, device=DEV) * 0.3).to(dtype).chunk(4, dim=2)[1]


# (B, S, D): Z-Image main blocks at 1024² (4096 + 512 caption tokens = 4608; 4109 odd), the
# refiners (4096 image, 512 caption), tiny widths, head-dim-like widths and few-row calls.
SHAPES = [(1, 4109, 3840), (2, 4109, 3840), (1, 4608, 3840), (2, 512, 3840), (1, 96, 3840),
          (2, 300, 2560), (1, 7, 3840), (1, 1, 3840), (2, 3, 3840), (1, 37, 256), (2, 19, 128),
          (2, 64, 96), (1, 64, 64), (1, 5, 64), (2, 33, 16), (1, 2, 16), (1, 1, 96)]


@pytest.mark.parametrize("B,S,D", SHAPES, ids=[f"{b}x{s}x{d}" for b, s, d in SHAPES])
def test_kernels_vs_eager(B, S, D):
    g = torch.Generator(device=DEV).manual_seed(B * 7919 + S * 31 + D)
    failures = []
    cases = [(torch.bfloat16, "half"), (torch.bfloat16, None), (torch.float32, "fp32"), (torch.float16, "half")]
    for dtype, wkind in cases:
        x, r = _rows((B, S, D), dtype, g), _rows((B, S, D), dtype, g)
        wdt = torch.float32 if wkind == "fp32" else dtype
        w = None if wkind is None else (1 + 0.3 * torch.randn(D, generator=g, device=DEV)).to(wdt)
        w2 = None if wkind is None else (1 + 0.3 * torch.randn(D, generator=g, device=DEV)).to(wdt)
        tag = f"[{B},{S},{D}] {dtype} w={wkind}"
        for gate, scale in ((_chunk(B, D, dtype, g).tanh(), _chunk(B, D, dtype, g)), (None, None)):
            mod = "modulated" if gate is not None else "plain"
            assert rk.can_use_rms_norm_diffusers_scale(x, w, scale, EPS), tag
            for got, want, name in (
                (rk.rms_norm_diffusers_scale(x, w, scale, EPS), ref.rms_norm_diffusers_scale(x, w, scale, EPS), "Z1"),
                # LTX-Video's form, the gate's chunk serving as the shift
                (rk.rms_norm_diffusers_scale(x, w, scale, EPS, gate),
                 ref.rms_norm_diffusers_scale(x, w, scale, EPS, gate), "Z1+shift"),
                (rk.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS),
                 ref.gate_residual_rms_norm_diffusers(r, gate, x, w, EPS), "Z6"),
                (rk.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS),
                 ref.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w2, scale, EPS), "Z3+Z4"),
            ):
                mm = compare_outputs(got, want, f"{name} {tag} {mod} lanes={rk.reduce_launch(D, B * S)}")
                if mm:
                    failures.append(str(mm))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("B,S,D", SHAPES, ids=[f"{b}x{s}x{d}" for b, s, d in SHAPES])
def test_simulation_is_torchs_mean(B, S, D):
    """The reduce-order model itself: its RMSNorm (torch.rsqrt) equals diffusers' chain on CUDA."""
    g = torch.Generator(device=DEV).manual_seed(S + D)
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows((B, S, D), dtype, g)
        w = (1 + 0.3 * torch.randn(D, generator=g, device=DEV)).to(dtype)
        mm = compare_outputs(sim.rms_d(x, w, EPS), ref.rms_norm_diffusers(x, w, EPS), f"sim [{B},{S},{D}] {dtype}")
        assert mm is None, str(mm)


def test_per_token_and_strided_operands():
    g = torch.Generator(device=DEV).manual_seed(3)
    B, S, D = 2, 1031, 3840
    wide = _rows((B, S, 2 * D), torch.bfloat16, g)
    x = wide[..., :D]
    r = _rows((S, B, D), torch.bfloat16, g).transpose(0, 1)
    gate = (torch.randn(B, S, D, generator=g, device=DEV) * 0.3).bfloat16().tanh()
    scale = (torch.randn(B, D, generator=g, device=DEV) * 0.3).bfloat16()
    w = (1 + 0.3 * torch.randn(D, generator=g, device=DEV)).bfloat16()
    mm = compare_outputs(rk.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w, scale, EPS),
                         ref.gate_residual_rms_norm_diffusers_scale(r, gate, x, w, w, scale, EPS), "strided")
    assert mm is None, str(mm)


LTX_SHAPES = [(1, 7392, 2048), (2, 7392, 2048), (1, 4111, 4096), (2, 1, 2048), (1, 13, 4096)]


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("B,S,D", LTX_SHAPES, ids=[f"{b}x{s}x{d}" for b, s, d in LTX_SHAPES])
def test_ltx_scale_shift_vs_eager(B, S, D, per_token):
    """LTX-Video's ``norm1(h) * (1 + scale_msa) + shift_msa`` as its block spells it: weightless
    diffusers RMSNorm, ``ada = table[None, None] + temb.reshape(B, T, 6, -1)`` unbound on dim 2
    (strided views; T = S per token, as LTX's image-to-video, else 1), NaN / Inf in the rows and
    the shift, ``1 + scale = 0``; bf16 / fp16 / fp32 models."""
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(D, eps=1e-6, elementwise_affine=False).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(B * 131 + S + D + per_token)
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _rows((B, S, D), dtype, g)
        T = S if per_token else 1
        table = (torch.randn(6, D, generator=g, device=DEV) / D ** 0.5).to(dtype)
        temb = (torch.randn(B, T, 6 * D, generator=g, device=DEV) * 0.5).to(dtype)
        ada = table[None, None] + temb.reshape(B, T, 6, -1)
        shift, scale = ada.unbind(dim=2)[:2]
        x[0, 0, 1] = float("nan")
        x[-1, -1, 2] = float("inf")
        scale[0, 0, 3] = -1.0
        shift[0, 0, 4] = float("-inf")
        for sc in (scale, None):
            tag = f"LTX [{B},{S},{D}] {dtype} per_token={per_token} scale={'yes' if sc is not None else 'None'}"
            assert rk.can_use_rms_norm_diffusers_scale(x, None, sc, 1e-6, shift), tag
            eager = norm(x) * (1 + sc) + shift if sc is not None else norm(x) + shift
            mm = compare_outputs(rk.rms_norm_diffusers_scale(x, None, sc, 1e-6, shift), eager, tag)
            if mm:
                failures.append(str(mm))
    assert not failures, "\n".join(failures)


# -- the adapter ---------------------------------------------------------------------------------


def _family():
    from ditfuse.models import families

    fam = families.get("zimage")
    small = dict(fam.config("dev"), n_layers=2, n_refiner_layers=1)
    return dataclasses.replace(fam, configs={**fam.configs, "dev_small": small})


def _run(config, batch, size, txt):
    from ditfuse.models.zimage import ADAPTER
    from tests.support.engaged import compare_accelerated

    fam = _family()
    m = fam.build(config, device=DEV)
    inp = fam.make_inputs(m, batch, size, device=DEV, txt_tokens=txt)
    if batch > 1:  # a shorter second caption: a padded batch with an attention mask
        inp["cap_feats"][-1] = inp["cap_feats"][-1][: txt - 9]
    compare_accelerated(m, inp, ADAPTER.ops(), f"zimage {config} B={batch} {size} txt={txt}")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", ["64x48", "336x208"])
def test_tiny(batch, size):
    _run("tiny", batch, size, txt=29)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size,txt", [("1024x1024", 512), ("336x208", 77)], ids=["1024px", "odd"])
def test_z_image_width(batch, size, txt):
    _run("dev_small", batch, size, txt)


@pytest.mark.parametrize("batch", [1, 2])
def test_omni_mode_block_at_z_image_width(batch):
    """Omni mode's per-token noisy / clean modulation (noise_mask) on a Z-Image-width main block,
    4608 tokens: bitwise diffusers over two accelerated calls, the block's ops verified and run."""
    import ditfuse
    from ditfuse.kernels.compare import assert_bitwise_equal
    from ditfuse.models.zimage import SITES
    from tests.support.engaged import assert_engaged

    fam = _family()
    m = fam.build("dev_small", device=DEV)
    blk = m.layers[0]
    g = torch.Generator(device=DEV).manual_seed(7)
    B, S, D = batch, 4608, m.dim
    x = torch.randn(B, S, D, generator=g, device=DEV).to(torch.bfloat16)
    ang = torch.randn(B, S, D // m.n_heads // 2, generator=g, device=DEV)
    freqs = torch.polar(torch.ones_like(ang), ang)
    noise_mask = torch.zeros(B, S, dtype=torch.long, device=DEV)
    noise_mask[:, 512:4096] = 1  # the target image's tokens noisy, caption and reference clean
    a_noisy, a_clean = (torch.randn(B, 256, generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    args = (x, None, freqs, None, noise_mask, a_noisy, a_clean)
    ditfuse.gate.reset()
    with torch.no_grad():
        base = blk(*args)
        h = ditfuse.accelerate(m)
        try:
            outs = [blk(*args) for _ in range(2)]
        finally:
            h.unmount()
    for i, o in enumerate(outs):
        assert_bitwise_equal(o, base, f"omni block B={batch} call {i}")
    assert_engaged([d.op for d in next(s for s in SITES if s.name == "zimage.block").ops])
