"""The LTX-Video adapter on a tiny random-weight LTXVideoTransformer3DModel (CPU, Triton interpreter).

LTX runs its chains in the model dtype: diffusers RMSNorm (no affine) + modulate, QK RMSNorm over
all heads + an all-heads interleaved RoPE, gated residuals, a LayerNorm + modulate tail. The fast
forwards on the eager reference chains must equal diffusers bitwise (fp32 and bf16, batch 1 and
the CFG batch 2, an odd 3x5x7 latent grid, a 9-token padded text mask, every RoPE padding width);
mounted, the model's output stays bitwise whatever the gate decided, and every op reaches the gate.
Bitwise kernels are to be proved on the GPU (tests/gpu/test_ltx_gpu.py; not run yet).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels import reference as R
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families
from ditfuse.models import ltx as ltx_adapter
from ditfuse.models import ltx_configs
from tests.support.reference_forwards import reference_forwards

LTX = families.get("ltx")
# 17 frames x 160 x 224 px -> a 3 x 5 x 7 latent grid (105 tokens): every extent odd
SIZE = "224x160x17"
TXT = 9  # not a multiple of 8; the mask pads each prompt differently


def _model(dtype=torch.bfloat16, **overrides):
    if not overrides:
        return LTX.build("tiny", device="cpu", dtype=dtype)
    cfg = dict(LTX.config("tiny"), **overrides)
    torch.manual_seed(0)
    m = LTX.load_class()(**cfg)
    return m.to(dtype).eval().requires_grad_(False)


def _inputs(m, batch=1, dtype=torch.bfloat16, **kw):
    return LTX.make_inputs(m, batch=batch, size=SIZE, device="cpu", dtype=dtype, txt_tokens=TXT, **kw)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


EXPECTED_SITES = sorted(["ltx.model"] + ["ltx.block"] * 2 + ["ltx.attention"] * 4)


def test_inputs_are_the_pipelines():
    m = _model()
    inp = _inputs(m, batch=2)
    assert inp["hidden_states"].shape == (2, 3 * 5 * 7, 8)
    assert (inp["num_frames"], inp["height"], inp["width"]) == (3, 5, 7)
    assert inp["encoder_attention_mask"].dtype == torch.bool
    assert inp["encoder_attention_mask"].sum(1).tolist() == [7, 6]  # padded, each prompt its own length
    assert inp["rope_interpolation_scale"] == (8 / 25, 32, 32)
    assert inp["timestep"].dtype == torch.float32
    assert _run(m, inp).shape == (2, 105, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fast_forwards_match_diffusers_call_for_call(dtype, batch):
    m = _model(dtype)
    inp = _inputs(m, batch=batch, dtype=dtype)
    base = _run(m, inp)
    with reference_forwards(m, ltx_adapter.SITES, require_applies=True) as patched:
        assert sorted(type(p).__name__ for p in patched) == sorted(
            ["LTXVideoTransformer3DModel"] + ["LTXVideoTransformerBlock"] * 2 + ["LTXAttention"] * 4)
        assert_bitwise_equal(_run(m, inp), base, f"reference fast forwards {dtype} B={batch}")


@pytest.mark.parametrize("heads,head_dim", [(3, 16), (2, 20), (4, 8)], ids=["pad0", "pad4", "pad2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_rope_padding_widths(heads, head_dim, batch):
    """Widths 48, 40, 32: the table's cos=1 / sin=0 padding of width D % 6 = 0, 4, 2."""
    m = _model(torch.bfloat16, num_attention_heads=heads, attention_head_dim=head_dim,
               cross_attention_dim=heads * head_dim)
    inp = _inputs(m, batch=batch)
    base = _run(m, inp)
    with reference_forwards(m, ltx_adapter.SITES, require_applies=True):
        assert_bitwise_equal(_run(m, inp), base, f"D={heads * head_dim} B={batch}")


@pytest.mark.parametrize("batch", [1, 2])
def test_rope_goes_through_the_qk_op(monkeypatch, batch):
    """The fp32 tables take the fused RoPE (one all-heads "head", one call per sample), and the
    comparison above can fail: a wrong sin table in that op changes the output."""
    real = R.qk_rmsnorm_across_heads_rope
    seen = []

    def spy(q, k, wq, wk, cos, sin, heads, eps=1e-6):
        seen.append((None if cos is None else tuple(cos.shape), heads))
        return real(q, k, wq, wk, cos, sin, heads, eps)

    m = _model()
    inp = _inputs(m, batch=batch)
    base = _run(m, inp)
    monkeypatch.setattr(R, "qk_rmsnorm_across_heads_rope", spy)
    with reference_forwards(m, ltx_adapter.SITES):
        assert_bitwise_equal(_run(m, inp), base, "spied")
    assert seen == [((1, 105, 1, 32), 1)] * (2 * batch), seen

    def wrong(q, k, wq, wk, cos, sin, heads, eps=1e-6):
        return real(q, k, wq, wk, cos, sin.roll(2, -1), heads, eps)

    monkeypatch.setattr(R, "qk_rmsnorm_across_heads_rope", wrong)
    with reference_forwards(m, ltx_adapter.SITES):
        assert not torch.equal(_run(m, inp), base)


def test_non_fp32_rope_table_takes_the_norm_only_path(monkeypatch):
    """A bf16 table (LTX's formula is fp32 whatever the table's dtype; Wan's op would round its
    products in bf16): the op does the norms only, diffusers' apply_rotary_emb the rotation."""
    from diffusers.models.transformers import transformer_ltx as tl

    m = _model()
    inp = _inputs(m, batch=2)
    real_rope = tl.LTXVideoRotaryPosEmbed.forward

    def bf16_rope(self, *a, **k):
        return tuple(t.to(torch.bfloat16) for t in real_rope(self, *a, **k))

    monkeypatch.setattr(tl.LTXVideoRotaryPosEmbed, "forward", bf16_rope)
    base = _run(m, inp)
    real = R.qk_rmsnorm_across_heads_rope
    seen = []

    def spy(q, k, wq, wk, cos, sin, heads, eps=1e-6):
        seen.append((cos, heads))
        return real(q, k, wq, wk, cos, sin, heads, eps)

    monkeypatch.setattr(R, "qk_rmsnorm_across_heads_rope", spy)
    with reference_forwards(m, ltx_adapter.SITES):
        assert_bitwise_equal(_run(m, inp), base, "bf16 table")
    assert seen == [(None, 2)] * 2


def test_video_coords_path_bitwise():
    """LTXConditionPipeline passes video_coords (per-sample coordinates) instead of the grid."""
    m = _model(torch.float32)
    inp = _inputs(m, batch=2, dtype=torch.float32)
    f, h, w = inp["num_frames"], inp["height"], inp["width"]
    grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"))
    coords = grid.flatten(1).float()[None].repeat(2, 1, 1)
    coords[1, 0] += 3.0  # the second sample starts later: per-sample tables differ
    inp["video_coords"] = coords
    base = _run(m, inp)
    with reference_forwards(m, ltx_adapter.SITES):
        assert_bitwise_equal(_run(m, inp), base, "video_coords")


@pytest.mark.slow
@pytest.mark.parametrize("per_token", [False, True], ids=["t", "per-token-t"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch, per_token):
    m = _model()
    inp = _inputs(m, batch=batch)
    if per_token:
        inp["timestep"] = torch.full((batch, 105), 500.0).index_fill_(1, torch.arange(35), 0.0)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert rep.status == "mounted" and rep.adapter == "ltx"
        assert sorted(s for _, s in rep.sites) == EXPECTED_SITES
        assert not rep.skipped_sites
        assert_bitwise_equal(_run(m, inp), base, "accelerated")
        assert_bitwise_equal(_run(m, inp), base, "accelerated, second call")
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    for op in ltx_adapter.ADAPTER.ops():
        assert sum(calls.get(op, {}).values()) > 0, f"{op} never reached the gate"


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_ltx as tl

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                encoder_attention_mask=None, extra=None):
        pass

    monkeypatch.setattr(tl.LTXVideoTransformerBlock, "forward", forward)
    assert "LTXVideoTransformerBlock.forward" in ltx_adapter.ADAPTER.version_problem()


def test_refuses_other_diffusers_version(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    assert "0.43.0" in ltx_adapter.ADAPTER.version_problem()


def test_sites_and_ops():
    assert [s.name for s in ltx_adapter.SITES] == ["ltx.model", "ltx.block", "ltx.attention"]
    assert ltx_adapter.ADAPTER.ops() == ("norm.layernorm_modulate", "norm.rms_norm_diffusers_scale",
                                         "modulate.gate_residual", "rope.qk_rmsnorm_across_heads_rope")
    assert all(not s.close_ops() for s in ltx_adapter.SITES)  # no quality="high" tier claimed
    assert "ltx" in families.names()
    from ditfuse.models import adapters

    assert ltx_adapter.ADAPTER in adapters()


def test_unsupported_structure_is_skipped():
    """A block whose norms are not diffusers' RMSNorm keeps its forward (and says why)."""
    m = _model()
    m.transformer_blocks[0].norm1 = torch.nn.LayerNorm(32, elementwise_affine=False)
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert [p for p, _ in rep.skipped_sites] == ["transformer_blocks.0"]
        assert "diffusers' RMSNorm" in rep.skipped_sites[0][1]
    finally:
        h.unmount()


def test_family_configs():
    for name, width, layers in (("dev", 2048, 28), ("13b", 4096, 48)):
        cfg = LTX.config(name)
        assert cfg["num_attention_heads"] * cfg["attention_head_dim"] == width
        assert cfg["cross_attention_dim"] == width  # caption_projection outputs the width
        assert cfg["num_layers"] == layers and cfg["caption_channels"] == 4096 and cfg["in_channels"] == 128
    assert ltx_configs.latent_grid(LTX.default_size) == (21, 16, 22)
    with pytest.raises(ValueError):
        ltx_configs.latent_grid("224x160x16")
    img = LTX.to_images(torch.zeros(2, 105, 8))
    assert img.shape == (2, 8, 15, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_token_timestep_bitwise(dtype):
    """LTXConditionPipeline's per-token timesteps ([B, S]: conditioning tokens at t = 0): the
    modulation chunks and the tail's scale / shift become [B, S, D]."""
    m = _model(dtype)
    inp = _inputs(m, batch=2, dtype=dtype)
    t = torch.full((2, 105), 500.0)
    t[:, :35] = 0.0  # the first latent frame is the conditioning frame
    t[1] = t[1] * 0.5
    inp["timestep"] = t
    base = _run(m, inp)
    with reference_forwards(m, ltx_adapter.SITES, require_applies=True):
        assert_bitwise_equal(_run(m, inp), base, f"per-token timestep {dtype}")


def test_image_conditioned_inputs_are_the_i2v_pipelines():
    """make_inputs(image_conditioned=True) is LTXImageToVideoPipeline's timestep: min(t, (1 - mask)
    * 1000) over the packed tokens, the first latent frame's tokens (the image's) at 0."""
    m = _model()
    inp = _inputs(m, batch=2, image_conditioned=True)
    f, h, w = ltx_configs.latent_grid(SIZE)
    t = inp["timestep"]
    assert t.shape == (2, f * h * w) and t.dtype == torch.float32
    assert (t[:, : h * w] == 0).all() and (t[:, h * w:] == 500.0).all()
