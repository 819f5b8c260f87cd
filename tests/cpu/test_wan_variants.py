"""Wan's "Copied from" transformers (ditfuse/models/wan_variants.py): ChronoEdit, SkyReels-V2,
Wan-Animate, on tiny random-weight models (CPU).

- The drift guard: each copied class / function the variants' sites rely on is pinned to its
  normalised source diff against transformer_wan (empty for exact copies, the known lines for the
  others), so a diffusers change that makes a copy diverge fails here.
- Wan's fast forwards on the eager reference chains equal diffusers bitwise, call for call (fp32
  and bf16, batch 1 and 2, an odd 3 x 3 x 5 token grid; SkyReels also with diffusion forcing:
  per-frame timesteps, [B, 6, S, D] modulation, a causal block mask), every declared op runs, and
  the parameters the variants pass matter (Wan's own chunking on SkyReels' layout is wrong).
- Mounted through ``ditfuse.accelerate`` with the interpreted kernels: the model's output stays
  bitwise whatever the gate decided, every declared op reaches the gate, unmount restores.
Bitwise kernels on a GPU: tests/gpu/test_wan_variants_gpu.py (not run yet).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import adapters, families
from ditfuse.models import wan as wan_adapter
from ditfuse.models import wan_variants as V
from ditfuse.models.base import site_hooks
from ditfuse.models.handoff import NO_LINK
from tests.support.reference_forwards import ReferenceOps, reference_forwards

_D = "diffusers.models.transformers."
_TW = _D + "transformer_wan"

# -- the drift guard ------------------------------------------------------------------------------


def _normalised(obj) -> list[str]:
    """Source lines with the variant prefixes renamed to Wan, comments and blank lines dropped."""
    src = inspect.getsource(obj)
    for prefix in ("SkyReelsV2", "ChronoEdit", "WanAnimate"):
        src = src.replace(prefix, "Wan")
    out = []
    for line in src.splitlines():
        code = line.rstrip()
        if code.lstrip().startswith("#"):
            continue
        if " # " in code and '"' not in code and "'" not in code:  # a trailing comment
            code = code.split(" # ")[0].rstrip()
        if code.strip():
            out.append(code)
    return out


def _diff(variant, wan) -> list[str]:
    return [ln for ln in difflib.unified_diff(_normalised(wan), _normalised(variant), lineterm="", n=0)
            if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]


def _get(path: str):
    mod, _, attr = path.partition(":")
    obj = importlib.import_module(_D + mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# (variant "module:qualname", transformer_wan qualname, the normalised diff it must have)
PINNED = [
    # ChronoEdit: exact copies, and the model forward without the .contiguous()
    ("transformer_chronoedit:WanTransformerBlock", "WanTransformerBlock", []),
    ("transformer_chronoedit:WanAttention", "WanAttention", []),
    ("transformer_chronoedit:WanAttnProcessor", "WanAttnProcessor", []),
    ("transformer_chronoedit:_get_qkv_projections", "_get_qkv_projections", []),
    ("transformer_chronoedit:ChronoEditTransformer3DModel.forward", "WanTransformer3DModel.forward",
     ["-        hidden_states = hidden_states.contiguous()"]),
    # Wan-Animate: copies (the block without dynamo's allow-in-graph marker)
    ("transformer_wan_animate:WanTransformerBlock", "WanTransformerBlock", ["-@maybe_allow_in_graph"]),
    ("transformer_wan_animate:WanAttention", "WanAttention", []),
    ("transformer_wan_animate:WanAttnProcessor", "WanAttnProcessor", []),
    ("transformer_wan_animate:_get_qkv_projections", "_get_qkv_projections", []),
    # SkyReels-V2: the processor differs only on the image / cross-attention paths' parallel_config
    ("transformer_skyreels_v2:SkyReelsV2AttnProcessor.__call__", "WanAttnProcessor.__call__", [
        "-                parallel_config=None,",
        "+                parallel_config=self._parallel_config,",
        "-            parallel_config=(self._parallel_config if encoder_hidden_states is None else None),",
        "+            parallel_config=self._parallel_config,",
    ]),
    ("transformer_skyreels_v2:SkyReelsV2Attention.forward", "WanAttention.forward", []),
    ("transformer_skyreels_v2:_get_qkv_projections", "_get_qkv_projections", [
        '-def _get_qkv_projections(attn: "WanAttention", hidden_states: torch.Tensor, '
        "encoder_hidden_states: torch.Tensor):",
        "+def _get_qkv_projections(",
        '+    attn: "WanAttention", hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor',
        "+):",
        "-        if not attn.is_cross_attention:",
        "+        if attn.cross_attention_dim_head is None:",
    ]),
    ("transformer_skyreels_v2:SkyReelsV2TransformerBlock.__init__", "WanTransformerBlock.__init__", []),
    ("transformer_skyreels_v2:SkyReelsV2TransformerBlock.forward", "WanTransformerBlock.forward", [
        "+        attention_mask: torch.Tensor,",
        "-        if temb.ndim == 4:",
        "-            shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (",
        "-                self.scale_shift_table.unsqueeze(0) + temb.float()",
        "-            ).chunk(6, dim=2)",
        "-            shift_msa = shift_msa.squeeze(2)",
        "-            scale_msa = scale_msa.squeeze(2)",
        "-            gate_msa = gate_msa.squeeze(2)",
        "-            c_shift_msa = c_shift_msa.squeeze(2)",
        "-            c_scale_msa = c_scale_msa.squeeze(2)",
        "-            c_gate_msa = c_gate_msa.squeeze(2)",
        "-        else:",
        "+        if temb.dim() == 3:",
        "+        elif temb.dim() == 4:",
        "+            e = (self.scale_shift_table.unsqueeze(2) + temb.float()).chunk(6, dim=1)",
        "+            shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = [ei.squeeze(1) for ei in e]",
        "-        attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)",
        "+        attn_output = self.attn1(norm_hidden_states, None, attention_mask, rotary_emb)",
    ]),
]


@pytest.mark.parametrize("variant,wan,expected", PINNED, ids=[p[0] for p in PINNED])
def test_copies_still_match_wan(variant, wan, expected):
    """A diffusers change to either side (the copy or transformer_wan) shows up as a new diff."""
    got = _diff(_get(variant), _get("transformer_wan:" + wan))
    assert got == expected, "\n".join(got)


def test_drift_guard_sees_a_change():
    """The normalisation does not hide a real difference."""
    from diffusers.models.transformers import transformer_wan_animate_2 as wa2

    assert _diff(wa2.WanAnimate2TransformerBlock.forward, _get("transformer_wan:WanTransformerBlock.forward"))

    def one():
        def forward(self, x):
            return x * 2  # a comment
        return forward

    def two():
        def forward(self, x):
            # only a comment differs here
            return x * 2
        return forward

    def three():
        def forward(self, x):
            return x * 3
        return forward

    assert _diff(one(), two()) == []
    assert _diff(one(), three()) == ["-            return x * 3", "+            return x * 2"]


def test_every_variant_site_is_pinned():
    """Every class a variant site mounts on, and the processor class its attention site requires,
    is pinned above; none of them is transformer_wan's own class."""
    pinned = {p[0].split(".")[0] for p in PINNED}
    wan = importlib.import_module(_TW)
    for s in (*V.CHRONOEDIT_SITES, *V.WAN_ANIMATE_SITES, *V.SKYREELS_V2_SITES):
        mod, _, cls = s.cls.partition(":")
        short = mod.rpartition(".")[2]
        assert f"{short}:{cls}" in pinned, s.cls
        assert s.load_cls() is not getattr(wan, cls, None)
        if s.name.endswith(".attention"):
            assert f"{short}:{s.forward.keywords['_processor']}" in pinned
            assert f"{short}:_get_qkv_projections" in pinned


# -- fixtures -------------------------------------------------------------------------------------

# 80x48 px -> 10 x 6 latents -> a 5 x 3 patch grid; 9 frames -> 3 latent frames (Animate: 3 + the
# reference frame); SkyReels' diffusion forcing needs whole causal blocks of 2: 13 frames -> 4.
CASES = {
    "chronoedit": ("tiny", "80x48x9", V.CHRONOEDIT_SITES),
    "skyreels_v2": ("tiny", "80x48x9", V.SKYREELS_V2_SITES),
    "skyreels_v2-df": ("tiny-df", "80x48x13", V.SKYREELS_V2_SITES),
    "wan_animate": ("tiny", "80x48x9", V.WAN_ANIMATE_SITES),
}
# module class names each case's reference run must patch (2 blocks of self + cross attention;
# Wan-Animate 4 blocks)
PATCHED = {
    "chronoedit": ["ChronoEditTransformer3DModel"] + ["WanTransformerBlock"] * 2 + ["WanAttention"] * 4,
    "skyreels_v2": ["SkyReelsV2TransformerBlock"] * 2 + ["SkyReelsV2Attention"] * 4,
    "skyreels_v2-df": ["SkyReelsV2TransformerBlock"] * 2 + ["SkyReelsV2Attention"] * 4,
    "wan_animate": ["WanTransformerBlock"] * 4 + ["WanAttention"] * 8,
}


def _family(case: str):
    return families.get(case.split("-")[0])


def _model(case: str, dtype=torch.bfloat16):
    return _family(case).build(CASES[case][0], device="cpu", dtype=dtype)


def _inputs(case: str, m, batch: int, dtype=torch.bfloat16):
    return _family(case).make_inputs(m, batch, CASES[case][1], device="cpu", dtype=dtype, txt_tokens=7)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


class _CountingOps(ReferenceOps):
    def __init__(self):
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        fn = super().__getattr__(name)

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)

        return counted


def _with_ops(sites, ops):
    """reference_forwards' patching with our own op table."""
    import contextlib

    @contextlib.contextmanager
    def cm(m):
        by_cls = {s.load_cls(): s for s in sites}
        saved = []
        try:
            for mod in m.modules():
                site = by_cls.get(type(mod))
                if site is None or site.applies(mod) is not None:
                    continue
                orig = mod.forward
                saved.append((mod, orig))
                mod.forward = (lambda s, md, o: lambda *a, **k: s.forward(md, o, *a, _ops=ops, **k))(site, mod, orig)
            yield [md for md, _ in saved]
        finally:
            for md, o in saved:
                md.forward = o

    return cm


# -- the fast forwards on the reference chains ----------------------------------------------------


def test_inputs_shapes():
    m = _model("skyreels_v2-df")
    inp = _inputs("skyreels_v2-df", m, 2)
    assert inp["hidden_states"].shape == (2, 4, 4, 6, 10)
    assert inp["timestep"].shape == (2, 4) and inp["enable_diffusion_forcing"] is True
    assert _run(m, inp).shape == (2, 4, 4, 6, 10)
    m = _model("wan_animate")
    inp = _inputs("wan_animate", m, 1)
    assert inp["hidden_states"].shape == (1, 12, 4, 6, 10)
    assert inp["pose_hidden_states"].shape == (1, 4, 3, 6, 10)
    assert inp["face_pixel_values"].shape == (1, 3, 9, 4, 4)
    assert _run(m, inp).shape == (1, 4, 4, 6, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_forwards_match_diffusers_call_for_call(case, batch, dtype):
    m = _model(case, dtype)
    inp = _inputs(case, m, batch, dtype)
    base = _run(m, inp)
    sites = CASES[case][2]
    with reference_forwards(m, sites) as patched:
        assert sorted(type(p).__name__ for p in patched) == sorted(PATCHED[case])
    ops = _CountingOps()
    with _with_ops(sites, ops)(m):
        assert_bitwise_equal(_run(m, inp), base, f"{case} {dtype} B={batch}")
    want = {d.name for s in sites for d in s.ops} - _NOT_CALLED.get(case, set())
    assert set(ops.calls) == want, (ops.calls, want)


# Diffusion forcing's per-token [B, 6, S, D] modulation is summed inside the ops that read it
# (their *_table arguments, wan._modulation): no separate table_add runs.
_NOT_CALLED = {"skyreels_v2-df": {"table_add"}}


def _mutated_skyreels_block(mask: bool, chunks):
    def forward(block, original, hs, ehs, temb, rot, attention_mask, *, _ops, _link=NO_LINK):
        return wan_adapter.block_forward(block, original, hs, ehs, temb, rot, _ops=_ops, _link=_link,
                                         _attention_mask=attention_mask if mask else None, _chunks=chunks)

    site = V.SKYREELS_V2_SITES[0]
    return dataclasses.replace(site, forward=forward)


def _swapped(block, temb, _ops):
    (shift, scale, *rest), rows = V._skyreels_modulation(block, temb, _ops)
    rows = None if rows is None else (rows[1], rows[0], *rows[2:])
    return (scale, shift, *rest), rows


@pytest.mark.parametrize("mutation", ["no causal mask", "shift/scale swapped"])
def test_skyreels_parameters_matter(mutation):
    """What the SkyReels block passes to Wan's block forward is what makes it bitwise: dropping
    the causal mask (Wan's None) or mis-chunking the [B, 6, S, D] modulation changes the output
    (so the comparison above can fail); the unmutated forward, built the same way, is bitwise."""
    m = _model("skyreels_v2-df", torch.float32)
    inp = _inputs("skyreels_v2-df", m, 2, torch.float32)
    base = _run(m, inp)
    attn = V.SKYREELS_V2_SITES[1]
    with reference_forwards(m, (_mutated_skyreels_block(True, V._skyreels_modulation), attn)):
        assert_bitwise_equal(_run(m, inp), base, "unmutated")
    bad = (_mutated_skyreels_block(False, V._skyreels_modulation) if mutation == "no causal mask"
           else _mutated_skyreels_block(True, _swapped))
    with reference_forwards(m, (bad, attn)):
        assert not torch.equal(_run(m, inp), base)


def test_chronoedit_keeps_the_stream_transposed(monkeypatch):
    """ChronoEdit's model forward hands block 0 the transposed patch-embedding view (no
    .contiguous()), as diffusers' does; Wan's forward (``_contiguous=True``) would not."""
    m = _model("chronoedit")
    inp = _inputs("chronoedit", m, 2)
    seen = []
    real = wan_adapter.block_forward

    def spy(block, original, hs, *a, **k):
        seen.append(hs.is_contiguous())
        return real(block, original, hs, *a, **k)

    eager = []
    hook = m.blocks[0].register_forward_pre_hook(lambda mod, args: eager.append(args[0].is_contiguous()))
    try:
        _run(m, inp)
    finally:
        hook.remove()
    assert eager == [False]  # diffusers' own ChronoEdit forward
    blocks = [dataclasses.replace(V.CHRONOEDIT_SITES[1], forward=spy)]
    for contiguous in (False, True):
        seen.clear()
        model_site = dataclasses.replace(
            V.CHRONOEDIT_SITES[0], forward=functools.partial(wan_adapter.model_forward, _contiguous=contiguous))
        with reference_forwards(m, (model_site, *blocks)):
            _run(m, inp)
        assert seen[0] is contiguous, seen
    assert V.CHRONOEDIT_SITES[0].forward.keywords == {"_contiguous": False}


# -- mounted (interpreted kernels through the gate) -----------------------------------------------

ADAPTERS = {"chronoedit": V.CHRONOEDIT_ADAPTER, "skyreels_v2": V.SKYREELS_V2_ADAPTER,
            "skyreels_v2-df": V.SKYREELS_V2_ADAPTER, "wan_animate": V.WAN_ANIMATE_ADAPTER}
MOUNTED = {
    "chronoedit": ["chronoedit.model"] + ["chronoedit.block"] * 2 + ["chronoedit.attention"] * 2,
    "skyreels_v2": ["skyreels_v2.block"] * 2 + ["skyreels_v2.attention"] * 2,
    "wan_animate": ["wan_animate.block"] * 4 + ["wan_animate.attention"] * 4,
}


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_mount_unmount_outputs_bitwise_unchanged(case, batch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m = _model(case)
    inp = _inputs(case, m, batch)
    base = _run(m, inp)
    adapter = ADAPTERS[case]
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        assert (rep.status, rep.adapter) == ("mounted", adapter.family), rep
        assert sorted(s for _, s in rep.sites) == sorted(MOUNTED[case.split("-")[0]])
        # the skipped ones are the cross-attentions (nothing to fuse), and only those
        assert rep.skipped_sites and all(p.endswith(".attn2") and "cross-attention" in r for p, r in rep.skipped_sites)
        for i in range(2):
            assert_bitwise_equal(_run(m, inp), base, f"{case} B={batch}, call {i}")
        calls = ditfuse.gate.report().calls
        ho = h.report().components[0].handoffs
    finally:
        h.unmount()
    assert not list(site_hooks(m))
    assert_bitwise_equal(_run(m, inp), base, f"{case}: after unmount")
    for op in adapter.ops():
        if op.rsplit(".", 1)[-1] in _NOT_CALLED.get(case, ()):
            continue
        assert sum(calls.get(op, {}).values()) > 0, f"{op} never reached the gate"
    assert ho["links"] == len(m.blocks) - 1 and ho["used"] > 0
    if case == "wan_animate":  # the face adapter's residual after blocks 0 and 2: those hand-offs are dropped
        assert ho["discarded"] > 0


def test_registered():
    table = adapters()
    for a in (V.CHRONOEDIT_ADAPTER, V.WAN_ANIMATE_ADAPTER, V.SKYREELS_V2_ADAPTER):
        assert a in table and a.version_problem() is None
    for name in ("chronoedit", "skyreels_v2", "wan_animate"):
        assert name in families.names()
    # Wan's own adapter still takes only transformer_wan's classes
    assert {s.load_cls().__module__ for s in wan_adapter.SITES} == {_TW}
    assert [s.name for s in V.CHRONOEDIT_SITES] == ["chronoedit.model", "chronoedit.block", "chronoedit.attention"]
    assert [s.name for s in V.WAN_ANIMATE_SITES] == ["wan_animate.block", "wan_animate.attention"]
    assert [s.name for s in V.SKYREELS_V2_SITES] == ["skyreels_v2.block", "skyreels_v2.attention"]
    # the same ops as Wan's sites (no new kernels)
    wan_ops = {s.name.split(".")[1]: s.ops for s in wan_adapter.SITES}
    for s in (*V.CHRONOEDIT_SITES, *V.WAN_ANIMATE_SITES, *V.SKYREELS_V2_SITES):
        assert s.ops == wan_ops[s.name.split(".")[1]]


def test_refuses_changed_forward_signature(monkeypatch):
    from diffusers.models.transformers import transformer_skyreels_v2 as sk

    def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        pass

    monkeypatch.setattr(sk.SkyReelsV2TransformerBlock, "forward", forward)
    assert "SkyReelsV2TransformerBlock.forward" in V.SKYREELS_V2_ADAPTER.version_problem()


def test_other_processor_keeps_diffusers_forward():
    """A copy's attention running Wan's processor class (not its own module's) is not taken."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    m = _model("chronoedit")
    m.blocks[0].attn1.set_processor(WanAttnProcessor())
    h = ditfuse.accelerate(m)
    try:
        rep = h.report().components[0]
        why = dict(rep.skipped_sites).get("blocks.0.attn1", "")
        assert "not diffusers.models.transformers.transformer_chronoedit.WanAttnProcessor" in why, rep.skipped_sites
    finally:
        h.unmount()


def test_family_configs():
    for fam, name, width, layers, ffn in (("chronoedit", "dev", 5120, 40, 13824), ("skyreels_v2", "dev", 1536, 30, 8960),
                                           ("skyreels_v2", "14b", 5120, 40, 13824), ("wan_animate", "dev", 5120, 40, 13824)):
        cfg = families.get(fam).config(name)
        assert cfg["num_attention_heads"] * cfg["attention_head_dim"] == width
        assert (cfg["num_layers"], cfg["ffn_dim"]) == (layers, ffn)
        assert cfg["qk_norm"] == "rms_norm_across_heads" and cfg["cross_attn_norm"] is True
    assert families.get("chronoedit").config("dev")["in_channels"] == 36
    assert families.get("wan_animate").config("dev")["in_channels"] == 2 * 16 + 4
