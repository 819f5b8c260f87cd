"""Launch recipes cached per call geometry (ditfuse/kernels/common/plans.py) and the gate's key
hand-off (contracts/ops.py GatedOp).

What must hold: the key changes with everything a predicate or a launch recipe reads (shape,
strides, dtype, alignment, grad state, conj bit, argument types, the kernel switches), so a cached
recipe is only reused where recomputing it would give the same one; the cached path's outputs are
bitwise those of the uncached launch for a shuffled sweep of geometries that differ one property
at a time; a geometry the predicate rejects is rejected even after a similar one was cached; and
a gated call computes its key once and reuses the recipe (the recipe function runs once per
geometry).
"""

from __future__ import annotations

import random

import pytest
import torch

import ditfuse
from ditfuse.contracts import ops
from ditfuse.kernels.common import plans
from ditfuse.kernels.common.plans import call_key, geometry_key
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.modulate import gate_residual_triton as gr
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk

BF = torch.bfloat16


def _t(*shape, dtype=BF, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# -- the key -----------------------------------------------------------------------------------


def test_key_sees_every_property_a_recipe_reads(monkeypatch):
    x = _t(2, 6, 16)
    base = geometry_key((x, 1e-6))
    assert geometry_key((x.clone(), 1e-6)) == base, "same geometry, other tensor: same key"
    variants = {
        "shape": (_t(2, 7, 16), 1e-6),
        "strides": (_t(2, 16, 6).transpose(1, 2), 1e-6),
        "dtype": (x.float(), 1e-6),
        "alignment": (_t(2 * 6 * 16 + 1)[1:].view(2, 6, 16), 1e-6),
        "scalar value": (x, 1e-5),
        "scalar type": (x, 1),
        "None": (None, 1e-6),
    }
    for what, args in variants.items():
        assert geometry_key(args) != base, what
    assert geometry_key((x, True)) != geometry_key((x, 1)), "bool and int are different keys"
    monkeypatch.setenv("DITFUSE_QK_KERNEL", "tile")
    assert geometry_key((x, 1e-6)) != base, "a kernel switch"


def test_key_sees_grad_state_and_complex_bits():
    w = _t(16).requires_grad_(True)
    with torch.no_grad():
        off = geometry_key((w,))
        assert off == geometry_key((w.detach(),)), "requires_grad does not matter without grad mode"
    with torch.enable_grad():
        assert geometry_key((w,)) != geometry_key((w.detach(),))
        assert geometry_key((w.detach(),)) != off, "grad mode itself is in the key"
    f = torch.polar(torch.ones(4, 8), torch.rand(4, 8))
    assert geometry_key((f,)) != geometry_key((f.conj(),))


def test_unkeyable_calls_have_no_key():
    x = _t(2, 3, 8)
    assert geometry_key((x, object())) is None
    assert geometry_key((x.to_sparse(),)) is None

    class Sub(torch.Tensor):
        pass

    assert geometry_key((x.as_subclass(Sub),)) is None, "tensor subclasses take the uncached path"
    assert geometry_key((torch.nn.Parameter(x),)) is not None, "parameters (weights) are keyed"
    assert call_key((x,), {"eps": 1e-6}) != call_key((x, 1e-6)), "keyword calls are keyed apart"


def test_recipes_are_bounded(monkeypatch):
    monkeypatch.setattr(plans, "MAX_ENTRIES", 3)
    r = plans.Recipes()
    for i in range(5):
        r.put((i,), i)
    assert len(r) <= 3 and r.get((4,)) == 4
    assert r.get(None) is None and r.put(None, 1) == 1 and len(r) <= 3


def test_checked_runs_the_predicate_once_and_caches_no_rejection():
    r = plans.Recipes()
    calls = []

    def reason(why):
        calls.append(why)
        return why

    assert r.checked(("a",), lambda: reason(None), lambda: None) is None  # an empty launch is a recipe
    assert r.checked(("a",), lambda: reason("never asked"), lambda: 1 / 0) is None
    assert calls == [None]
    for _ in range(2):
        with pytest.raises(UnsupportedInput):
            r.checked(("b",), lambda: reason("rejected"), lambda: 1 / 0)
    assert calls == [None, "rejected", "rejected"], "a rejection is not cached"
    assert r.checked(None, lambda: reason(None), lambda: 7) == 7 and len(r) == 1, "no key: nothing stored"


# -- cached path == uncached launch over a sweep of geometries -----------------------------------


def _ln_cases():
    D = 64
    cases = []
    for B, S in ((1, 5), (2, 3)):
        x = _t(B, S, D, seed=B * 10 + S)
        mod2 = _t(B, 2 * D, seed=1)
        sc, sh = mod2.chunk(2, dim=1)  # strided [B, D] chunks, as adaLN makes them
        cases.append(("2-D chunks", (x, sc, sh, 1e-6)))
        cases.append(("3-D [B,1,D]", (x, sc[:, None].contiguous(), sh[:, None].contiguous(), 1e-6)))
        cases.append(("per token", (x, _t(B, S, D, seed=3), _t(B, S, D, seed=4), 1e-6)))
        cases.append(("strided x", (_t(B, D, S, seed=5).transpose(1, 2), sc, sh, 1e-6)))
        cases.append(("other eps", (x, sc, sh, 1e-5)))
        cases.append(("fp32 mods", (x, sc.float(), sh.float(), 1e-6)))
    return cases


def test_layernorm_modulate_cached_equals_uncached():
    cases = _ln_cases() * 2
    random.Random(0).shuffle(cases)
    for name, (x, sc, sh, eps) in cases:
        got = lnm.layernorm_modulate(x, sc, sh, eps)
        want = lnm._launch(x, None, None, sc, sh, eps, None, None, None, True)[1]
        assert_bitwise_equal(got, want, name=name)


def test_gate_residual_layernorm_modulate_cached_equals_uncached():
    cases = []
    for name, (x, sc, sh, eps) in _ln_cases():
        g = sc * 0.5
        cases.append((name, (x, g, _t(*x.shape, seed=9), sc, sh, eps)))
        cases.append((name + ", no gate", (x, None, _t(*x.shape, seed=9), sc, sh, eps)))
    cases *= 2
    random.Random(1).shuffle(cases)
    for name, (res, g, upd, sc, sh, eps) in cases:
        got = lnm.gate_residual_layernorm_modulate(res, g, upd, sc, sh, eps)
        want = lnm._launch(res, g, upd, sc, sh, eps, None, None, None, True)
        assert_bitwise_equal(got, want, name=name)


def test_gate_residual_cached_equals_uncached():
    cases = []
    for B, S, D in ((1, 5, 48), (2, 3, 64), (2, 1, 40)):
        res, upd = _t(B, S, D, seed=1), _t(B, S, D, seed=2)
        cases += [("[B,D]", (res, _t(B, D, seed=3), upd)), ("[B,1,D]", (res, _t(B, 1, D, seed=3), upd)),
                  ("per token", (res, _t(B, S, D, seed=3), upd)),
                  ("strided update", (res, _t(B, 1, D, seed=3), _t(B, D, S, seed=4).transpose(1, 2))),
                  ("empty", (res[:, :0], _t(B, D, seed=3), upd[:, :0]))]
    cases *= 2
    random.Random(2).shuffle(cases)
    for name, args in cases:
        assert_bitwise_equal(gr.gate_residual(*args), gr._launch(*args), name=name)


def _qk_case(B, S_img, S_txt, H, D, seed):
    q, k = _t(B, S_img, H, D, seed=seed), _t(B, S_img, H, D, seed=seed + 1)
    qt, kt = _t(B, S_txt, H, D, seed=seed + 2), _t(B, S_txt, H, D, seed=seed + 3)
    w = [_t(D, seed=seed + 4 + i) for i in range(4)]
    return q, k, qt, kt, w


def test_qk_rmsnorm_rope_cached_equals_uncached():
    cases = []
    for B, S_img, S_txt, H, D in ((1, 5, 3, 2, 32), (2, 4, 2, 3, 64), (1, 6, 0, 2, 32)):
        q, k, qt, kt, w = _qk_case(B, S_img, S_txt, H, D, seed=B + S_img)
        S = S_img + S_txt
        cos, sin = torch.rand(S, D), torch.rand(S, D)
        txt = (qt, kt, w[2], w[3]) if S_txt else (None, None, None, None)
        cases.append(("joint", (q, k, w[0], w[1], cos, sin, 1e-6, *txt)))
        cases.append(("no rope", (q, k, w[0], w[1], None, None, 1e-6, *txt)))
        cases.append(("no weights", (q, k, None, None, cos, sin, 1e-6, *txt)))
        qs = _t(B, S_img, 3 * H * D, seed=7)[..., : H * D].unflatten(-1, (H, D))  # a strided column view
        cases.append(("strided q", (qs, k, w[0], w[1], cos, sin, 1e-6, *txt)))
    cases *= 2
    random.Random(3).shuffle(cases)
    for name, args in cases:
        assert_bitwise_equal(qk.qk_rmsnorm_rope(*args), qk._launch(*args, True), name=name)


def test_qk_diffusers_complex_cached_equals_uncached():
    cases = []
    for B, S_img, S_txt, H, D in ((1, 5, 3, 2, 128), (2, 4, 2, 1, 64)):
        q, k, qt, kt, w = _qk_case(B, S_img, S_txt, H, D, seed=B + D)
        fi = torch.polar(torch.ones(S_img, D // 2), torch.rand(S_img, D // 2))
        ft = torch.polar(torch.ones(S_txt, D // 2), torch.rand(S_txt, D // 2))
        cases.append(("joint", (q, k, w[0], w[1], fi, 1e-6, qt, kt, w[2], w[3], ft)))
        cases.append(("image only", (q, k, w[0], w[1], fi, 1e-6, None, None, None, None, None)))
        cases.append(("no rope", (q, k, w[0], w[1], None, 1e-6, qt, kt, w[2], w[3], None)))
    cases *= 2
    random.Random(4).shuffle(cases)
    for name, args in cases:
        got = qk.qk_rmsnorm_diffusers_rope_complex(*args)
        assert_bitwise_equal(got, qk._launch_diffusers(*args), name=name)


def test_qk_diffusers_cat_cached_equals_uncached():
    cases = []
    for B, S_img, S_txt, H, D in ((1, 5, 3, 2, 64), (2, 4, 0, 3, 32)):
        q, k, qt, kt, w = _qk_case(B, S_img, S_txt, H, D, seed=B + S_txt)
        tr = (lambda t: t.transpose(1, 2))
        txt = (tr(qt), tr(kt), w[2], w[3]) if S_txt else (None, None, None, None)
        cases.append(("heads-first views", (tr(q), tr(k), w[0], w[1], 1e-6, *txt)))
    cases *= 2
    random.Random(5).shuffle(cases)
    for name, args in cases:
        assert_bitwise_equal(qk.qk_rmsnorm_diffusers_cat(*args), qk._launch_cat(*args), name=name)


def test_rms_norm_diffusers_cached_equals_uncached():
    from ditfuse.kernels.norm import rms_norm_diffusers_triton as rd

    cases = []
    for B, S, D in ((1, 5, 64), (2, 3, 128), (2, 4, 96)):
        x, res, upd = _t(B, S, D, seed=1), _t(B, S, D, seed=2), _t(B, S, D, seed=3)
        w, w2 = _t(D, seed=4), _t(D, seed=5)
        g = torch.tanh(_t(B, D, seed=6))
        sc = _t(B, 1, D, seed=7)
        cases += [("scale", 0, (x, w, sc, 1e-5), lambda a: rd._launch(0, a[0], None, None, a[2], a[1], None, a[3])[0]),
                  ("no weight", 0, (x, None, sc, 1e-5), lambda a: rd._launch(0, a[0], None, None, a[2], a[1], None, a[3])[0]),
                  ("gated", 1, (res, g, upd, w, 1e-5), lambda a: rd._launch(1, a[2], a[0], a[1], None, a[3], None, a[4])[1]),
                  ("gated + scale", 2, (res, g, upd, w, w2, sc, 1e-5),
                   lambda a: tuple(reversed(rd._launch(2, a[2], a[0], a[1], a[5], a[3], a[4], a[6]))))]
    fns = {0: rd.rms_norm_diffusers_scale, 1: rd.gate_residual_rms_norm_diffusers,
           2: rd.gate_residual_rms_norm_diffusers_scale}
    cases *= 2
    random.Random(6).shuffle(cases)
    for name, mode, args, uncached in cases:
        assert_bitwise_equal(fns[mode](*args), uncached(args), name=name)


def test_activation_cats_and_swiglu_cached_equal_uncached():
    from ditfuse.kernels.activation import gelu_tanh_triton as gt
    from ditfuse.kernels.activation import swiglu_triton as sw
    from ditfuse.kernels.common.elementwise import launch_act_cat
    from ditfuse.kernels.common.host import tl_dtype

    cases = []
    for B, S, DA, DM in ((1, 5, 64, 96), (2, 3, 32, 48), (1, 0, 16, 16)):
        attn = _t(B, S, DA, seed=1)
        fused = _t(B, S, 2 * DM, seed=2)
        g, u = fused[..., :DM], fused[..., DM:]  # the column halves of one projection
        cases += [("gelu cat", lambda a=attn, m=g: (gt.gelu_tanh_cat(a, m), gt._launch_cat(a, m))),
                  ("gelu cat, strided attn", lambda a=_t(B, DA, S, seed=3).transpose(1, 2), m=g: (
                      gt.gelu_tanh_cat(a, m), gt._launch_cat(a, m))),
                  ("swiglu cat", lambda a=attn, g=g, u=u: (
                      sw.swiglu_cat(a, g, u), launch_act_cat(sw._swiglu_tile, 0, a, g, u, tl_dtype(g.dtype)))),
                  ("swiglu", lambda g=g, u=u: (sw.swiglu(g, u), _swiglu_uncached(sw, g, u)))]
    cases *= 2
    random.Random(7).shuffle(cases)
    for name, run in cases:
        got, want = run()
        assert_bitwise_equal(got, want, name=name)


def _swiglu_uncached(sw, g, u):
    out = torch.empty(g.shape, dtype=g.dtype)
    sw._launch(g, u, out)
    return out


# -- the predicate still guards new geometries --------------------------------------------------


def test_a_rejected_geometry_is_rejected_after_a_cached_one():
    x = _t(1, 4, 64)
    sc, sh = _t(1, 64, seed=1), _t(1, 64, seed=2)
    lnm.layernorm_modulate(x, sc, sh, 1e-6)
    with pytest.raises(UnsupportedInput):
        lnm.layernorm_modulate(_t(1, 4, 66), _t(1, 66), _t(1, 66), 1e-6)  # D % 4 != 0
    unaligned = _t(4 * 64 + 1)[1:].view(1, 4, 64)  # contiguous, 2 bytes off: torch's other kernel
    with pytest.raises(UnsupportedInput):
        lnm.layernorm_modulate(unaligned, sc, sh, 1e-6)
    with pytest.raises(UnsupportedInput):
        lnm.layernorm_modulate(x, _t(1, 32), _t(1, 32), 1e-6)  # mods of another width
    with torch.enable_grad():
        with pytest.raises(UnsupportedInput):
            lnm.layernorm_modulate(x.requires_grad_(True), sc, sh, 1e-6)
    x.requires_grad_(False)
    res, upd = _t(1, 4, 64), _t(1, 4, 64)
    gr.gate_residual(res, _t(1, 64), upd)
    with pytest.raises(UnsupportedInput):
        gr.gate_residual(res, _t(1, 64), _t(1, 4, 32))
    from ditfuse.kernels.activation import swiglu_triton as sw

    g = _t(1, 4, 32)
    sw.swiglu(g, _t(1, 4, 32))
    with pytest.raises(UnsupportedInput):
        sw.swiglu(g, _t(1, 4, 32).float())  # mixed dtypes: eager would promote


# -- the gated call hands its key down -----------------------------------------------------------


def test_gated_call_builds_one_recipe_per_geometry(monkeypatch):
    made = []
    real = gr._recipe
    monkeypatch.setattr(gr, "_recipe", lambda *a: made.append(a) or real(*a))
    gr._RECIPES.clear()
    ditfuse.gate.reset()
    op = ops.LOSSLESS.gate_residual
    op._sigs.clear()  # a cache: other tests in this process may have filled it
    res, g, upd = _t(2, 3, 48), _t(2, 48, seed=1), _t(2, 3, 48, seed=2)
    for _ in range(4):
        op(res, g, upd)
    assert len(made) == 1, "the recipe was rebuilt for one geometry"
    op(_t(2, 5, 48), g, _t(2, 5, 48))
    assert len(made) == 2
    assert ditfuse.gate.report().kernel_calls("modulate.gate_residual") >= 4
    assert len(op._sigs) == 2, "the gate's signature is kept per key"
