"""RoPE tables kept across steps (ditfuse/models/pos_cache.py): FLUX.1's and FLUX.2's position
embedders return the tables of an earlier call only when the ids are provably the same.

Every model-level test runs with DITFUSE_DISABLE=all (each fused op is its eager reference chain),
so the comparison with plain diffusers isolates the cache: on CPU the interpreted LayerNorm kernels
follow CUDA's reduction order, not CPU eager's (tests/cpu/test_handoff.py explains). Each test
states what the cache must do: reuse (counted hits and the very same tensors), or recompute (an
in-place edit, another view of the same storage, a new tensor, grad mode, the kill switch), and
the output is compared bit for bit with diffusers given the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families, pos_cache
from ditfuse.models.base import site_hooks


@pytest.fixture(autouse=True)
def reference_chains(monkeypatch):
    monkeypatch.setenv("DITFUSE_DISABLE", "all")


def _model(family: str):
    return families.get(family).build("tiny", device="cpu")


def _inputs(family: str, m, batch: int = 1, txt: int = 5):
    return families.get(family).make_inputs(m, batch, "32x48", device="cpu", txt_tokens=txt)


def _run(m, inp):
    with torch.no_grad():
        return m(**inp)[0]


def _counts(handle):
    return handle.report().components[0].pos_tables


# family -> embedder calls per forward (FLUX.2 embeds image and text ids separately)
CALLS = {"flux": 1, "flux2": 2}


@pytest.mark.parametrize("family", list(CALLS))
@pytest.mark.parametrize("batch", [1, 2])
def test_steps_reuse_the_tables_and_match_diffusers(family, batch):
    m = _model(family)
    inp = _inputs(family, m, batch)
    want = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        assert any(hk.site.name == f"{family}.pos_embed" for _, _, hk in site_hooks(m))
        for step in range(4):
            assert_bitwise_equal(_run(m, inp), want, name=f"{family} step {step}")
        n = CALLS[family]
        assert _counts(h) == {"hits": 3 * n, "misses": n, "uncached": 0}
        assert "RoPE tables: %d reused" % (3 * n) in h.report().summary()
    finally:
        h.unmount()


def _embedder_calls(m):
    """Wrap diffusers' own embedder forward (below the site) to record what it computed."""
    seen = []
    pe = m.pos_embed
    reg = pe._diffusers_hook
    fn_ref = reg._fn_refs[0]
    inner = fn_ref.original_forward

    def recording(ids):
        out = inner(ids)
        seen.append(out)
        return out

    fn_ref.original_forward = recording
    return seen


@pytest.mark.parametrize("family", list(CALLS))
def test_a_hit_returns_the_tables_computed_before(family):
    m = _model(family)
    h = ditfuse.accelerate(m)
    try:
        seen = _embedder_calls(m)
        ids = torch.rand(11, len(m.pos_embed.axes_dim)) * 8
        with torch.no_grad():
            a, b = m.pos_embed(ids), m.pos_embed(ids)
        assert len(seen) == 1, "the second call recomputed the table"
        assert a[0] is b[0] and a[1] is b[1]
        assert_bitwise_equal(a, type(m.pos_embed).forward(m.pos_embed, ids), name="table")
    finally:
        h.unmount()


@pytest.mark.parametrize("family", list(CALLS))
@pytest.mark.parametrize("edit", ["in_place", "view_in_place", "new_tensor_same_values", "new_tensor_new_values"])
def test_changed_ids_are_recomputed(family, edit):
    m = _model(family)
    inp = _inputs(family, m)
    h = ditfuse.accelerate(m)
    try:
        _run(m, inp)
        ids = inp["img_ids"]
        if edit == "in_place":
            ids.add_(1.0)
        elif edit == "view_in_place":
            ids[..., 1:2].mul_(2.0)  # a write through a view bumps the base's version
        elif edit == "new_tensor_same_values":
            inp["img_ids"] = ids.clone()
        else:
            inp["img_ids"] = ids.flip(-2).contiguous()
        got = _run(m, inp)
        c = _counts(h)
        assert c["hits"] == CALLS[family] - 1 and c["misses"] == CALLS[family] + 1, c
    finally:
        h.unmount()
    assert_bitwise_equal(got, _run(m, inp), name=f"{family} after {edit}")


@pytest.mark.parametrize("family", list(CALLS))
def test_3d_ids_are_keyed_and_correct(family):
    """diffusers takes ``ids[0]`` of deprecated 3-D ids: FLUX.2 embeds that fresh view on every
    forward, so its key must be the view's base, not the view object."""
    m = _model(family)
    inp = _inputs(family, m)
    inp["img_ids"] = inp["img_ids"][None]
    inp["txt_ids"] = inp["txt_ids"][None]
    want = _run(m, inp)
    h = ditfuse.accelerate(m)
    try:
        n = CALLS[family]
        for _ in range(3):
            assert_bitwise_equal(_run(m, inp), want, name="3-D ids")
        assert _counts(h) == {"hits": 2 * n, "misses": n, "uncached": 0}
        inp["txt_ids"][0, 0, 0] = 3.0  # indexing assignment on the 3-D tensor: version bump
        got = _run(m, inp)
        assert _counts(h)["misses"] == n + 1
    finally:
        h.unmount()
    assert_bitwise_equal(got, _run(m, inp), name="3-D ids after an edit")


def test_true_cfg_alternating_text_ids_hit_after_the_first_pair():
    m = _model("flux")
    cond = _inputs("flux", m)
    uncond = dict(cond, txt_ids=cond["txt_ids"].clone())
    want = (_run(m, cond), _run(m, uncond))
    h = ditfuse.accelerate(m)
    try:
        for _ in range(3):
            assert_bitwise_equal(_run(m, cond), want[0], name="cond")
            assert_bitwise_equal(_run(m, uncond), want[1], name="uncond")
        assert _counts(h) == {"hits": 4, "misses": 2, "uncached": 0}
    finally:
        h.unmount()


def test_entries_are_bounded(monkeypatch):
    m = _model("flux2")
    h = ditfuse.accelerate(m)
    try:
        pe = m.pos_embed
        base = torch.arange(48, dtype=torch.float32).view(12, 4)
        views = [base[i:i + 3] for i in range(0, 12, 3)] + [base[1:4]]
        with torch.no_grad():
            outs = [pe(v) for v in views]
            for v, o in zip(views, outs):  # another offset of the same storage: another table
                want = type(pe).forward(pe, v)
                assert_bitwise_equal(o, want, name="view table")
        assert len(pos_cache._tables[pe].items) == pos_cache.MAX_ENTRIES
        assert pos_cache.counts(m)["misses"] == len(views)
    finally:
        h.unmount()
    assert pe not in pos_cache._tables, "unmount keeps the tables alive"


def test_grad_mode_and_kill_switch_do_not_cache(monkeypatch):
    m = _model("flux")
    inp = _inputs("flux", m)
    h = ditfuse.accelerate(m)
    try:
        m(**inp)  # grad mode on (a training step): no cache
        m(**inp)
        assert _counts(h) == {"hits": 0, "misses": 0, "uncached": 2}
        monkeypatch.setenv("DITFUSE_POS_CACHE", "0")
        _run(m, inp)
        _run(m, inp)
        assert _counts(h)["uncached"] == 4 and _counts(h)["hits"] == 0
    finally:
        h.unmount()


def test_scope_is_only_for_its_own_embedder():
    """Another FluxPosEmbed called inside FLUX.1's forward (a user hook, a sub-model) keys on its own
    ids, not on the transformer's sources."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    m = _model("flux")
    other = FluxPosEmbed(theta=10000, axes_dim=list(m.pos_embed.axes_dim))
    inp = _inputs("flux", m)
    h = ditfuse.accelerate(m)
    rows = inp["txt_ids"].shape[0] + inp["img_ids"].shape[0]  # the scope's shape: only the module tells them apart
    other_ids = [torch.rand(rows, 3) * 10 for _ in range(2)]
    outs = []

    def pre_hook(module, args, kwargs):
        outs.append(pos_cache.embedder_forward(other, other.forward, other_ids[len(outs)]))
        return None

    hd = m.transformer_blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        _run(m, inp)
        _run(m, inp)
    finally:
        hd.remove()
        h.unmount()
    for ids, out in zip(other_ids, outs):
        assert_bitwise_equal(out, other(ids), name="other embedder")


def test_mismatched_ids_shape_falls_back_to_the_ids_own_key():
    m = _model("flux")
    h = ditfuse.accelerate(m)
    try:
        pe = m.pos_embed
        txt, img = torch.zeros(4, 3), torch.rand(6, 3)
        with torch.no_grad(), pos_cache.transformer_scope(pe, txt, img):
            wrong = torch.rand(9, 3)  # not 4 + 6 rows: not the scope's cat
            got = pe(wrong)
        assert_bitwise_equal(got, type(pe).forward(pe, wrong), name="fallback")
    finally:
        h.unmount()


def test_unmount_restores_the_embedders():
    m = _model("flux2")
    inp = _inputs("flux2", m)
    h = ditfuse.accelerate(m)
    _run(m, inp)
    assert m.pos_embed in pos_cache._tables
    h.unmount()
    assert m.pos_embed not in pos_cache._tables
    assert not any(True for _ in site_hooks(m))


@pytest.mark.parametrize("family", list(CALLS))
def test_inference_mode_ids_are_not_cached(family):
    """Inference tensors have no version counter: an in-place write would be invisible, so ids
    made under torch.inference_mode run diffusers' forward every time (counted as uncached)."""
    m = _model(family)
    with torch.inference_mode():
        inp = _inputs(family, m)
        want = m(**inp)[0]
    h = ditfuse.accelerate(m)
    try:
        with torch.inference_mode():
            for _ in range(2):
                assert_bitwise_equal(m(**inp)[0], want, name="inference mode")
            inp["img_ids"].add_(1.0)  # allowed in inference mode, and not tracked
            got = m(**inp)[0]
        c = _counts(h)
        assert c["hits"] == 0 and c["uncached"] == 3 * CALLS[family], c
    finally:
        h.unmount()
    with torch.inference_mode():
        assert_bitwise_equal(got, m(**inp)[0], name="after an untracked edit")
