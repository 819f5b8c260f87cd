"""The Z-Image adapter on a tiny random-weight ZImageTransformer2DModel (CPU, Triton interpreter).

On CPU the gate compares each kernel with the eager chain at first sight; the CPU's mean sums in
another order than CUDA's reduce kernel (which the kernels reproduce), so the norm ops may be
disabled here and run eager: the output must be bitwise unchanged whatever the gate decided, and
every op must reach the gate. The fast forward with the eager reference table must equal
diffusers' block forward bitwise (fp32, bf16, fp16; modulated and unmodulated blocks; padded
batches). Kernels are proved on the GPU (tests/gpu/test_zimage_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import image_family_configs as ifc
from ditfuse.models import zimage as zimage_adapter
from ditfuse.models.zimage_configs import stack_output


def _randomize_norms(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_((1 + 0.3 * torch.randn(p.shape, generator=g)).to(p.dtype))


def _model(dtype=torch.bfloat16, **over):
    import diffusers

    torch.manual_seed(0)
    cfg = dict(ifc.config("zimage", "tiny"), **over)
    m = diffusers.ZImageTransformer2DModel(**cfg).to(dtype).eval()
    _randomize_norms(m)
    return m


def _inputs(m, batch=1, txt=7, hw=(64, 48), dtype=torch.bfloat16, seed=1):
    inp = ifc.step_inputs("zimage", m, batch=batch, height=hw[0], width=hw[1], text_tokens=txt, dtype=dtype, seed=seed)
    if batch > 1:  # samples of different caption lengths: a padded batch with an attention mask
        inp["cap_feats"][-1] = inp["cap_feats"][-1][: max(1, txt - 9)]
    return inp


def _run(m, inp):
    with torch.no_grad():
        return stack_output(m(**inp)[0])


def _n_blocks(m):
    return len(m.noise_refiner) + len(m.context_refiner) + len(m.layers)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("verify_every_call")
def test_mount_unmount_outputs_bitwise_unchanged(batch):
    m = _model()
    inp = _inputs(m, batch=batch, txt=29)
    base = _run(m, inp)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    assert rep.adapter == "zimage" and rep.status == "mounted"
    blocks = ([f"noise_refiner.{i}" for i in range(len(m.noise_refiner))]
              + [f"context_refiner.{i}" for i in range(len(m.context_refiner))]
              + [f"layers.{i}" for i in range(len(m.layers))])
    assert sorted(p for p, s in rep.sites) == sorted(blocks + [f"{b}.attention" for b in blocks])
    assert sorted(s for _, s in rep.sites) == ["zimage.attention"] * len(blocks) + ["zimage.block"] * len(blocks)
    assert not rep.skipped_sites
    assert_bitwise_equal(_run(m, inp), base, "accelerated")
    inp2 = _inputs(m, batch=batch, txt=13, hw=(32, 80), seed=5)
    h.unmount()
    base2 = _run(m, inp2)
    assert_bitwise_equal(_run(m, inp), base, "after unmount")
    h = ditfuse.accelerate(m)
    assert_bitwise_equal(_run(m, inp2), base2, "accelerated, second shape")
    h.unmount()


def test_every_op_reaches_the_gate():
    m = _model()
    inp = _inputs(m, txt=29)
    base = _run(m, inp)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    out = _run(m, inp)
    rep = ditfuse.gate.report()
    h.unmount()
    assert_bitwise_equal(out, base, "accelerated")
    calls = rep.calls
    n = _n_blocks(m)
    for op in zimage_adapter.ADAPTER.ops():
        c = calls.get(op, {})
        assert c.get("kernel", 0) + c.get("reference", 0) == n, f"{op}: {dict(c)}"
        # the kernel ran (verify) or raised UnsupportedInput; a mismatch on CPU disables it honestly
        if op in rep.disabled:
            assert "mismatch" in rep.disabled[op], rep.disabled[op]


class _Ref:
    """An op table whose every op is its eager reference chain."""

    def __init__(self):
        from ditfuse.contracts.ops import LOSSLESS

        self.quality = LOSSLESS.quality
        self.used: set[str] = set()

    def __getattr__(self, attr):
        from ditfuse.kernels import DESCRIPTORS

        for d in DESCRIPTORS:
            if d.name == attr:
                self.used.add(attr)
                return d.load_reference()
        raise AttributeError(attr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_fast_forward_matches_diffusers(dtype):
    """The fast forward with the reference table equals the block's own forward bitwise, in every
    block type, batch 2 with a padded caption."""
    m = _model(dtype)
    inp = _inputs(m, batch=2, txt=29, dtype=dtype)
    base = _run(m, inp)
    ref = _Ref()
    saved = []
    for site in zimage_adapter.SITES:
        n = 0
        for mod in m.modules():
            if type(mod).__name__ != site.cls_name or site.applies(mod) is not None:
                continue
            n += 1
            orig = mod.forward
            saved.append((mod, orig))
            mod.forward = (lambda mod, orig, site: lambda *a, **k: site.forward(mod, orig, *a, _ops=ref, **k))(
                mod, orig, site)
        assert n == _n_blocks(m), site.name
    try:
        assert_bitwise_equal(_run(m, inp), base, f"reference fast forward {dtype}")
    finally:
        for mod, orig in saved:
            mod.forward = orig
    assert ref.used == {d.name for site in zimage_adapter.SITES for d in site.ops}


def _omni_inputs(m, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(4)
    B, S, D = 2, 32, m.dim
    x = torch.randn(B, S, D, generator=g).to(dtype)
    ang = torch.randn(B, S, D // m.n_heads // 2, generator=g)
    freqs = torch.polar(torch.ones_like(ang), ang)
    noise_mask = torch.zeros(B, S, dtype=torch.long)
    noise_mask[:, :20] = 1
    noise_mask[1, 25:] = 1
    a_noisy, a_clean = torch.randn(B, 32, generator=g).to(dtype), torch.randn(B, 32, generator=g).to(dtype)
    return x, None, freqs, None, noise_mask, a_noisy, a_clean


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_omni_mode_on_reference_chains(dtype):
    """noise_mask (omni mode): each token's noisy or clean modulation, selected as diffusers does;
    the block's fast forward on the reference chains equals diffusers' bitwise, for a modulated
    main block and an unmodulated context-refiner block (which ignores the mask)."""
    from tests.support.reference_forwards import ReferenceOps

    m = _model(dtype)
    args = _omni_inputs(m, dtype)
    for blk in (m.layers[0], m.context_refiner[0]):
        with torch.no_grad():
            base = blk(*args)
            out = zimage_adapter.block_forward(blk, blk.forward, *args, _ops=ReferenceOps())
        assert_bitwise_equal(out, base, f"omni block (modulation={blk.modulation}) {dtype}")


@pytest.mark.slow
def test_omni_mode_runs_the_block_ops():
    """Accelerated, the omni block runs its fused ops (through the gate, interpreter kernels) and
    stays bitwise diffusers."""
    m = _model()
    blk = m.layers[0]
    args = _omni_inputs(m)
    with torch.no_grad():
        base = blk(*args)
    ditfuse.gate.reset()
    h = ditfuse.accelerate(m)
    try:
        with torch.no_grad():
            out = blk(*args)
        calls = ditfuse.gate.report().calls
    finally:
        h.unmount()
    assert_bitwise_equal(out, base, "omni block")
    block_ops = {d.op for d in next(s for s in zimage_adapter.SITES if s.name == "zimage.block").ops}
    assert all(sum(calls.get(op, {}).values()) > 0 for op in block_ops), calls


def test_guards_name_what_they_refuse():
    from diffusers.models.normalization import RMSNorm

    m = _model()
    blk = m.layers[0]
    assert zimage_adapter.SITES[0].applies(blk) is None
    assert zimage_adapter.SITES[0].applies(m.context_refiner[0]) is None
    saved = blk.ffn_norm2
    blk.ffn_norm2 = torch.nn.RMSNorm(m.dim, eps=1e-5)
    assert "ffn_norm2" in zimage_adapter.SITES[0].applies(blk)
    blk.ffn_norm2 = RMSNorm(m.dim, eps=1e-6)
    assert "eps" in zimage_adapter.SITES[0].applies(blk)
    blk.ffn_norm2 = saved
    blk.attention_norm2.bias = torch.nn.Parameter(torch.zeros(m.dim))
    assert "bias" in zimage_adapter.SITES[0].applies(blk)
    del blk.attention_norm2.bias
    blk.attention_norm2.bias = None
    assert zimage_adapter.SITES[0].applies(blk) is None
    saved_ff = blk.feed_forward
    blk.feed_forward = torch.nn.Identity()
    assert "feed_forward" in zimage_adapter.SITES[0].applies(blk)
    blk.feed_forward = saved_ff
    blk.adaLN_modulation = torch.nn.Sequential(torch.nn.SiLU(), blk.adaLN_modulation[0])
    assert "adaLN_modulation" in zimage_adapter.SITES[0].applies(blk)


def test_attention_guards_name_what_they_refuse():
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.normalization import RMSNorm

    m = _model()
    site = next(s for s in zimage_adapter.SITES if s.name == "zimage.attention")
    attn = m.layers[0].attention
    assert site.applies(attn) is None
    head_dim = m.dim // m.n_heads
    saved = attn.norm_k
    attn.norm_k = torch.nn.RMSNorm(head_dim, eps=1e-5)
    assert "norm_k" in site.applies(attn) and "not diffusers' RMSNorm" in site.applies(attn)
    attn.norm_k = None
    assert "norm_k is None" in site.applies(attn)
    attn.norm_k = RMSNorm(head_dim, eps=1e-6)
    assert "eps" in site.applies(attn)
    attn.norm_k = saved
    proc = attn.processor
    attn.processor = AttnProcessor2_0()
    assert "ZSingleStreamAttnProcessor" in site.applies(attn)
    attn.processor = proc


def test_swapped_processor_and_no_freqs_stay_bitwise():
    """A processor swapped after mounting runs diffusers' forward; freqs_cis=None is a norm-only
    call of the op; both equal diffusers bitwise."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    m = _model()
    attn = m.layers[0].attention
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 11, m.dim, generator=g).bfloat16()
    with torch.no_grad():
        base_nofreq = attn(x, freqs_cis=None)
    h = ditfuse.accelerate(m)
    with torch.no_grad():
        assert_bitwise_equal(attn(x, freqs_cis=None), base_nofreq, "freqs None")
        proc = attn.processor
        attn.processor = AttnProcessor2_0()
        try:
            swapped = attn(x)
        finally:
            attn.processor = proc
    h.unmount()
    with torch.no_grad():
        attn.processor = AttnProcessor2_0()
        try:
            assert_bitwise_equal(swapped, attn(x), "swapped processor")
        finally:
            attn.processor = proc


def test_refused_block_keeps_its_forward_and_is_reported():
    m = _model()
    m.layers[1].ffn_norm1 = torch.nn.RMSNorm(m.dim, eps=1e-5)
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    h.unmount()
    skipped = dict(rep.skipped_sites)
    assert "ffn_norm1" in skipped["layers.1"], skipped
    assert "layers.0" in {p for p, _ in rep.sites}


def test_refuses_wrong_diffusers_version(monkeypatch):
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.30.0")
    m = _model()
    h = ditfuse.accelerate(m)
    rep = h.report().components[0]
    h.unmount()
    assert rep.status == "refused" and "0.30.0" in rep.reason, rep


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_z_image as tz

    def forward(self, x, attn_mask, freqs_cis, adaln_input=None, extra=None):
        pass

    monkeypatch.setattr(tz.ZImageTransformerBlock, "forward", forward)
    assert "ZImageTransformerBlock.forward" in zimage_adapter.ADAPTER.version_problem()


def test_no_high_tier_claimed():
    assert all(not s.close_ops() for s in zimage_adapter.SITES)


def test_family_fixture_and_pipeline_mount():
    from diffusers import ZImagePipeline

    from ditfuse.models import families

    fam = families.get("zimage")
    m = fam.build("tiny", device="cpu")
    inp = fam.make_inputs(m, batch=2, size="64x48", device="cpu", txt_tokens=9)
    assert [t.shape for t in inp["x"]] == [(4, 1, 6, 8)] * 2 and inp["cap_feats"][0].shape == (9, 24)
    assert _run(m, inp).shape == (2, 4, 1, 6, 8)
    assert fam.to_images(_run(m, inp)).shape == (2, 4, 6, 8)
    pipe = ZImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=m)
    h = ditfuse.accelerate(pipe)
    rep = {c.component: (c.adapter, c.status, len(c.sites)) for c in h.report().components}
    h.unmount()
    assert rep["transformer"] == ("zimage", "mounted", 2 * _n_blocks(m)), rep
