"""Models built from a family's blocks: the ControlNets of FLUX.1, SD3 and Qwen-Image (a copy of
the transformer's first blocks, run every step beside it) and Wan VACE. The family's adapter
mounts its block sites on them; their outputs (every control residual) stay bitwise diffusers'.

Reference chains (``DITFUSE_DISABLE=all``) test which code runs, bitwise. The "kernels" cases run
the interpreted kernels through the gate: they follow CUDA's reduction order, which CPU eager
does not, so there the output is only close (bitwise is the GPU tests' job).
"""

from __future__ import annotations

import inspect

import pytest
import torch

import ditfuse
from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.models import families

from .tiny import flux_inputs


def _kwargs_for(cls, cfg: dict) -> dict:
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in cfg.items() if k in params}


def _randomize_zeros(m: torch.nn.Module) -> None:
    """ControlNets zero-initialise their output projections (zero_module): random values there,
    or every residual is 0 and a wrong fast path could not show."""
    torch.manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            if not p.any():
                p.normal_(0, 0.05)


def _flux(cls_name):
    import diffusers

    from .tiny import tiny_flux

    t = tiny_flux(dtype=torch.float32, layers=(2, 2), guidance=True)
    cfg = dict(t.config)
    multi = cls_name == "FluxMultiControlNetModel"
    if multi:  # a ControlNet-Union with two conditions (the pipelines' Union path)
        cfg["num_mode"] = 3
    torch.manual_seed(0)
    cn = diffusers.FluxControlNetModel(**_kwargs_for(diffusers.FluxControlNetModel, cfg))
    inp = flux_inputs(t, img=24, txt=7)
    cond = torch.randn_like(inp["hidden_states"])
    if not multi:
        return cn, dict(inp, controlnet_cond=cond, conditioning_scale=0.7)
    return diffusers.FluxMultiControlNetModel([cn]), dict(
        inp, controlnet_cond=[cond, cond.flip(1)], conditioning_scale=[0.7, 0.4],
        controlnet_mode=[torch.tensor([1]), torch.tensor([2])])


def _image_controlnet(family: str, cls: str, **extra):
    """A ``cls`` ControlNet of ``family``'s tiny config (its own blocks, random weights)."""
    import diffusers

    fam = families.get(family)
    cfg = fam.config("tiny")
    torch.manual_seed(0)
    t = fam.load_class()(**cfg)
    cn_cls = getattr(diffusers, cls)
    cn = cn_cls(**_kwargs_for(cn_cls, dict(cfg, **extra)))
    inp = fam.make_inputs(t, 1, "64x48", device="cpu", dtype=torch.float32, txt_tokens=7)
    inp = {k: v for k, v in inp.items() if k in inspect.signature(cn.forward).parameters}
    return cn, dict(inp, controlnet_cond=torch.randn_like(inp["hidden_states"]), conditioning_scale=0.7)


def _sd3(cls_name):
    return _image_controlnet("sd3", cls_name, extra_conditioning_channels=0)


def _qwen(cls_name):
    return _image_controlnet("qwenimage", cls_name)


def _vace(cls_name):
    import diffusers

    fam = families.get("wan")
    cfg = dict(fam.config("tiny"), num_layers=3, vace_layers=[0, 2], vace_in_channels=6)
    torch.manual_seed(0)
    m = diffusers.WanVACETransformer3DModel(**_kwargs_for(diffusers.WanVACETransformer3DModel, cfg))
    inp = fam.make_inputs(m, 1, "32x16x5", device="cpu", dtype=torch.float32, txt_tokens=7)
    x = inp["hidden_states"]
    inp["control_hidden_states"] = torch.randn(x.shape[0], 6, *x.shape[2:])
    inp["control_hidden_states_scale"] = torch.tensor([0.5, 1.5])
    return m, inp


# class -> (builder, the family whose adapter takes it, sites it must get)
CASES = {
    "FluxControlNetModel": (_flux, "flux", {"flux.dual_block", "flux.single_block", "flux.attention"}),
    "FluxMultiControlNetModel": (_flux, "flux", {"flux.dual_block", "flux.single_block", "flux.attention"}),
    "SD3ControlNetModel": (_sd3, "sd3", {"sd3.joint_block", "sd3.attention"}),
    "QwenImageControlNetModel": (_qwen, "qwenimage", {"qwenimage.block", "qwenimage.attention"}),
    "WanVACETransformer3DModel": (_vace, "wan", {"wan.block", "wan.attention"}),
}


def _tensors(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, dict) or hasattr(o, "to_tuple"):
        o = o.values() if isinstance(o, dict) else o.to_tuple()
    if isinstance(o, (tuple, list)) or type(o).__name__ == "dict_values":
        return [t for x in o for t in _tensors(x)]
    return []


def _run(m, inp):
    with torch.no_grad():
        out = _tensors(m(**inp))
    assert out, "the model returned no tensors"
    return out


@pytest.mark.slow  # tiny models: a few seconds each on 2 cores
@pytest.mark.parametrize("mode", ["reference", "kernels"])
@pytest.mark.parametrize("cls_name", list(CASES))
def test_variant_mounts_and_stays_bitwise(cls_name, mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if mode == "reference":
        monkeypatch.setenv("DITFUSE_DISABLE", "all")
    build, family, want = CASES[cls_name]
    m, inp = build(cls_name)
    _randomize_zeros(m)
    m = m.to(torch.bfloat16).eval().requires_grad_(False)
    inp = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for k, v in inp.items()}
    if isinstance(inp.get("controlnet_cond"), list):
        inp["controlnet_cond"] = [c.to(torch.bfloat16) for c in inp["controlnet_cond"]]
    assert type(m).__name__ == cls_name
    base = _run(m, inp)
    assert any(t.any() for t in base), "every output is 0: the test could not fail"
    h = ditfuse.accelerate(m)
    try:
        c = h.report().components[0]
        assert (c.status, c.adapter) == ("mounted", family), c
        got = {s for _, s in c.sites}
        assert want <= got, f"{cls_name}: sites {sorted(got)}, expected at least {sorted(want)}"
        for i in range(2):
            out = _run(m, inp)
            assert len(out) == len(base)
            for j, (o, b) in enumerate(zip(out, base)):
                if mode == "reference":
                    assert_bitwise_equal(o, b, f"{cls_name}, call {i}, output {j}")
                else:  # interpreted kernels keep CUDA's reduction order, CPU eager its own: close
                    torch.testing.assert_close(o, b, rtol=0.05, atol=0.05, msg=f"{cls_name}, call {i}, output {j}")
        if mode == "kernels":
            calls = ditfuse.gate.report().calls
            ran = {op for op, c in calls.items() if c.get("kernel", 0)}
            assert ran, f"no kernel ran: {calls}"
    finally:
        h.unmount()
    for o, b in zip(_run(m, inp), base):
        assert_bitwise_equal(o, b, f"{cls_name}: after unmount")


def test_sites_match_by_class_not_name():
    """transformer_wan_animate has its own class named WanTransformerBlock (a copy): the Wan
    adapter's site (written against transformer_wan's) must not take it; the wan_animate adapter
    (models/wan_variants.py, whose drift guard pins the copy's source to Wan's) does."""
    from diffusers.models.transformers import transformer_wan, transformer_wan_animate

    from ditfuse.models.wan import ADAPTER
    from ditfuse.models.wan_variants import WAN_ANIMATE_ADAPTER

    assert transformer_wan_animate.WanTransformerBlock is not transformer_wan.WanTransformerBlock
    fam = families.get("wan")
    cfg = fam.config("tiny")
    copy = transformer_wan_animate.WanTransformerBlock(
        cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["ffn_dim"], cfg["num_attention_heads"],
        cfg["qk_norm"], cfg["cross_attn_norm"], cfg["eps"])
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([copy])
    mounted = ADAPTER.mount(holder)
    try:
        assert not mounted.mounted, mounted.mounted
    finally:
        ADAPTER.unmount(holder)
    mounted = WAN_ANIMATE_ADAPTER.mount(holder)
    try:
        assert sorted(s.site for s in mounted.mounted) == ["wan_animate.attention", "wan_animate.block"]
    finally:
        WAN_ANIMATE_ADAPTER.unmount(holder)


def test_what_the_wan_copies_get():
    """Which Wan-derived classes of diffusers 0.42.1 an adapter takes (models/wan_variants.py),
    and what stays diffusers': the Wan-Animate and SkyReels-V2 model forwards (their own code),
    Wan-Animate's face adapter, and all of Wan-Animate 2 (no class there is a copy)."""
    from ditfuse.models import adapters

    taken = {s.cls for a in adapters() for s in a.sites}
    D = "diffusers.models.transformers."
    for cls in ("transformer_chronoedit:ChronoEditTransformer3DModel", "transformer_chronoedit:WanTransformerBlock",
                "transformer_chronoedit:WanAttention", "transformer_wan_animate:WanTransformerBlock",
                "transformer_wan_animate:WanAttention", "transformer_skyreels_v2:SkyReelsV2TransformerBlock",
                "transformer_skyreels_v2:SkyReelsV2Attention"):
        assert D + cls in taken, cls
    for cls in ("transformer_wan_animate:WanAnimateTransformer3DModel",
                "transformer_wan_animate:WanAnimateFaceBlockCrossAttention",
                "transformer_skyreels_v2:SkyReelsV2Transformer3DModel"):
        assert D + cls not in taken, cls
    assert not [c for c in taken if c.startswith(D + "transformer_wan_animate_2:")]
    assert not [a for a in adapters() if "WanAnimate2Transformer3DModel" in a.model_classes]
