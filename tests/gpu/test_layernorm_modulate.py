"""norm.layernorm_modulate / norm.gate_residual_layernorm_modulate vs the eager reference on CUDA,
bitwise (integer views): FLUX's all-bf16 chains over the issue-3 sweep, Wan's fp32 chains
(FP32LayerNorm, fp32 [B, 1, D] modulation chunks, affine norm2 with fp32 or bf16 weights, the
plain residual add, per-token TI2V modulation) at Wan widths and video token counts; the close
variant is checked to differ (it runs) and stay close.

Each test loops over its cases inside and reports every failing case at once, so one run shows
the whole picture.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.norm.layernorm_modulate_triton import (
    can_use_gate_residual_layernorm_modulate,
    can_use_layernorm_modulate,
    gate_residual_layernorm_modulate,
    gate_residual_layernorm_modulate_fp32,
    layernorm_modulate,
    layernorm_modulate_fp32,
)

WIDTHS = [3072, 1536, 2048, 2240, 4096, 5120]
# 2051 tokens -> 4 rows per program with a 3-row tail (B=1) / 2-row tail (B=2); 512 -> 2 rows per
# program; 1 and 17 -> one.
TOKENS = [1, 17, 512, 2051, 4096, 4608]
BATCHES = [1, 2]
F32 = torch.float32
EPS = 1e-6


def _rand(shape, dtype, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale + offset).to(dtype)


def _mods(B, S, D, dtype, gen, per_token):
    shape = (B, S, D) if per_token else (B, D)
    return _rand(shape, dtype, gen, 0.5), _rand(shape, dtype, gen, 0.5)


def _sweep(D, dtype, gated, tokens=TOKENS):
    gen = torch.Generator(device="cuda").manual_seed(D + 7 * int(gated))
    failures = []
    for S in tokens:
        for B in BATCHES:
            for per_token in (False, True):
                scale, shift = _mods(B, S, D, dtype, gen, per_token)
                label = f"D={D} S={S} B={B} {'per-token' if per_token else 'per-sample'} {dtype}"
                if gated:
                    res = _rand((B, S, D), dtype, gen, 4.0, 1.0)
                    upd = _rand((B, S, D), dtype, gen, 2.0)
                    gate = _rand((B, S, D) if per_token else (B, D), dtype, gen)
                    assert can_use_gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
                    got = gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
                    exp = ref.gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
                else:
                    x = _rand((B, S, D), dtype, gen, 3.0, 2.0)
                    assert can_use_layernorm_modulate(x, scale, shift, EPS)
                    got = layernorm_modulate(x, scale, shift, EPS)
                    exp = ref.layernorm_modulate(x, scale, shift, EPS)
                mm = compare_outputs(got, exp, label)
                if mm is not None:
                    failures.append(str(mm))
    assert not failures, "\n".join(failures)


@pytest.fixture(params=["block", "warp"])
def row_kernel(request, monkeypatch):
    """Both row-kernel families through the public API (DITFUSE_ROW_KERNEL): the warp-per-row
    kernel takes the whole-step widths (1536, 2048, 3072), the rest stay 128-thread either way."""
    monkeypatch.setenv("DITFUSE_ROW_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("gated", [False, True], ids=["ln_mod", "gate_res_ln_mod"])
@pytest.mark.parametrize("D", WIDTHS)
def test_sweep_bf16(D, gated, row_kernel):
    if row_kernel == "warp" and D % 512:
        pytest.skip("no whole-step rows: same kernel as block")
    _sweep(D, torch.bfloat16, gated)


@pytest.mark.parametrize("gated", [False, True], ids=["ln_mod", "gate_res_ln_mod"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("D", [3072, 2240])
def test_sweep_fp16_fp32(D, dtype, gated):
    _sweep(D, dtype, gated, tokens=[1, 17, 4096])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_inf(dtype, row_kernel):
    gen = torch.Generator(device="cuda").manual_seed(3)
    B, S, D = 2, 64, 3072
    x = _rand((B, S, D), dtype, gen, 3.0)
    x[0, 1, 5] = float("nan")
    x[0, 2, 7] = float("inf")
    x[1, 3, 100] = float("-inf")
    x[1, 4, :] = float("inf")
    x[1, 5, :] = 0.0  # zero variance row: rstd = rsqrt(eps)
    x[1, 6, :] = -0.0
    scale, shift = _mods(B, S, D, dtype, gen, True)
    scale[0, 10, 3] = float("nan")
    shift[1, 11, 4] = float("inf")
    scale[1, 12, 5] = -1.0  # 1 + scale = 0 -> signed zeros
    assert can_use_layernorm_modulate(x, scale, shift, EPS)
    mm = compare_outputs(layernorm_modulate(x, scale, shift, EPS), ref.layernorm_modulate(x, scale, shift, EPS))
    assert mm is None, str(mm)
    res = _rand((B, S, D), dtype, gen, 2.0)
    upd = _rand((B, S, D), dtype, gen)
    gate = _rand((B, D), dtype, gen)
    upd[0, 0, 0] = float("nan")
    res[1, 2, 9] = float("inf")
    gate[1, 17] = float("inf")
    got = gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
    exp = ref.gate_residual_layernorm_modulate(res, gate, upd, scale, shift, EPS)
    mm = compare_outputs(got, exp)
    assert mm is None, str(mm)


def test_odd_width_rejected():
    """3077 (and any D % 4 != 0): torch runs RowwiseMomentsCUDAKernel, not reproduced."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = _rand((1, 17, 3077), torch.bfloat16, gen)
    sc, sh = _mods(1, 17, 3077, torch.bfloat16, gen, False)
    assert not can_use_layernorm_modulate(x, sc, sh, EPS)
    with pytest.raises(UnsupportedInput):
        layernorm_modulate(x, sc, sh, EPS)
    assert not can_use_gate_residual_layernorm_modulate(x, sc, x, sc, sh, EPS)


def test_strided_inputs_handled():
    """Non-contiguous x (F.layer_norm copies it to an aligned buffer) and strided chunks of
    the modulation embedding, as diffusers' ``emb.chunk(6, dim=1)`` produces."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    B, S, D = 2, 33, 3072
    dtype = torch.bfloat16
    wide = _rand((B, S, D + 64), dtype, gen, 2.0, 1.0)
    x = wide[..., 32 : 32 + D]  # non-contiguous rows
    x_t = _rand((S, B, D), dtype, gen, 2.0).transpose(0, 1)  # batch/token transposed
    emb = _rand((B, 6 * D), dtype, gen, 0.5)
    shift, scale, gate = emb.chunk(6, dim=1)[:3]
    failures = []
    for name, xx in (("sliced", x), ("transposed", x_t)):
        assert not xx.is_contiguous()
        assert can_use_layernorm_modulate(xx, scale, shift, EPS)
        mm = compare_outputs(layernorm_modulate(xx, scale, shift, EPS), ref.layernorm_modulate(xx, scale, shift, EPS), name)
        if mm:
            failures.append(str(mm))
    got = gate_residual_layernorm_modulate(x_t, gate, x, scale, shift, EPS)
    mm = compare_outputs(got, ref.gate_residual_layernorm_modulate(x_t, gate, x, scale, shift, EPS), "gated strided")
    if mm:
        failures.append(str(mm))
    assert not failures, "\n".join(failures)


def test_misaligned_contiguous_rejected():
    """A contiguous view whose pointer is not 4-element aligned goes to RowwiseMoments in torch."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    D = 2048
    flat = _rand((2 * D + 2,), torch.bfloat16, gen)
    x = flat[2 : 2 + 2 * D].view(1, 2, D)
    assert x.is_contiguous() and x.data_ptr() % 8 != 0
    sc, sh = _mods(1, 2, D, torch.bfloat16, gen, False)
    assert not can_use_layernorm_modulate(x, sc, sh, EPS)
    with pytest.raises(UnsupportedInput):
        layernorm_modulate(x, sc, sh, EPS)
    # 4-element aligned offset is fine
    x2 = flat[4 : 4 + D].view(1, 1, D)
    sc1, sh1 = sc[:, :], sh[:, :]
    assert can_use_layernorm_modulate(x2, sc1, sh1, EPS)
    mm = compare_outputs(layernorm_modulate(x2, sc1, sh1, EPS), ref.layernorm_modulate(x2, sc1, sh1, EPS))
    assert mm is None, str(mm)


def test_ada_layernorm_continuous_order():
    """AdaLayerNormContinuous: ``scale, shift = emb.chunk(2, dim=1)`` (scale first)."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    B, S, D = 1, 512, 3072
    x = _rand((B, S, D), torch.bfloat16, gen, 2.0)
    emb = _rand((B, 2 * D), torch.bfloat16, gen, 0.5)
    scale, shift = emb.chunk(2, dim=1)
    exp = ref.layer_norm(x, EPS) * (1 + scale)[:, None, :] + shift[:, None, :]
    mm = compare_outputs(layernorm_modulate(x, scale=scale, shift=shift, eps=EPS), exp)
    assert mm is None, str(mm)


def test_compile_sees_one_op():
    gen = torch.Generator(device="cuda").manual_seed(19)
    B, S, D = 1, 17, 1536
    x = _rand((B, S, D), torch.bfloat16, gen)
    sc, sh = _mods(B, S, D, torch.bfloat16, gen, False)
    exp = ref.layernorm_modulate(x, sc, sh, EPS)
    fn = torch.compile(lambda a, b, c: layernorm_modulate(a, b, c, EPS), fullgraph=True, backend="aot_eager")
    mm = compare_outputs(fn(x, sc, sh), exp)
    assert mm is None, str(mm)


# -- Wan: FP32LayerNorm on x.float(), fp32 modulation, .type_as(x) ------------------------------

WAN_WIDTHS = [1536, 3072, 5120]
WAN_TOKENS = [1, 1560, 32760]  # 32760: Wan2.1-1.3B at 480x832 x 81 frames


def _wan_mods(B, S, D, gen, per_token, table_dtype=F32):
    """Chunks of ``scale_shift_table + temb.float()`` exactly as WanTransformerBlock makes them."""
    if per_token:
        temb = _rand((B, S, 6, D), torch.bfloat16, gen, 0.5)
        return [c.squeeze(2) for c in (_rand((1, 1, 6, D), table_dtype, gen, 0.5) + temb.float()).chunk(6, dim=2)]
    temb = _rand((B, 6, D), torch.bfloat16, gen, 0.5)
    return list((_rand((1, 6, D), table_dtype, gen, 0.5) + temb.float()).chunk(6, dim=1))


def test_wan_chains_sweep():
    from diffusers.models.normalization import FP32LayerNorm

    gen = torch.Generator(device="cuda").manual_seed(23)
    failures = []
    bf = torch.bfloat16
    for D in WAN_WIDTHS:
        norm = FP32LayerNorm(D, EPS, elementwise_affine=False).cuda()
        for S in WAN_TOKENS:
            for B in BATCHES:
                if S * B * D > 2 * 32760 * 1536 and D != 1536:
                    continue  # keep the sweep short: the widest shapes only at the 1.3B width
                for per_token in (False, True):
                    for wdt in (F32, bf):  # from_pretrained keeps norm2 fp32; a plain .to(bf16) does not
                        label = f"wan D={D} S={S} B={B} {'per-token' if per_token else '[B,1,D]'} norm2 {wdt}"
                        x = _rand((B, S, D), bf, gen, 3.0, 0.5)
                        attn = _rand((B, S, D), bf, gen, 2.0)
                        shift, scale, gate, c_shift, c_scale, c_gate = _wan_mods(B, S, D, gen, per_token)
                        w2, b2 = _rand((D,), wdt, gen, 0.2, 1.0), _rand((D,), wdt, gen, 0.2)
                        with torch.no_grad():
                            n1 = (norm(x.float()) * (1 + scale) + shift).type_as(x)
                            h = (x.float() + attn * gate).type_as(x)
                            n2 = torch.nn.functional.layer_norm(h.float(), (D,), w2.float(), b2.float(), EPS).type_as(h)
                            h2 = h + attn
                            n3 = (norm(h2.float()) * (1 + c_scale) + c_shift).type_as(h2)
                        cases = (
                            ("norm1", layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32), n1),
                            ("gate+norm2", gate_residual_layernorm_modulate(x, gate, attn, None, None, EPS, w2, b2, F32),
                             (h, n2)),
                            ("add+norm3", gate_residual_layernorm_modulate(h, None, attn, c_scale, c_shift, EPS,
                                                                          norm_dtype=F32), (h2, n3)),
                        )
                        for name, got, exp in cases:
                            mm = compare_outputs(got, exp, f"{label} {name}")
                            if mm is not None:
                                failures.append(str(mm))
                if S == WAN_TOKENS[-1]:
                    torch.cuda.empty_cache()
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failing cases)"


def test_wan_table_rows_sweep():
    """The ops fed Wan 2.2 TI2V's per-token modulation as (table row, embedding chunk) -- the
    ``*_table`` arguments models/wan.py passes, the fp32 sum formed in the kernel -- against
    diffusers' own spelling of each chain on ``scale_shift_table + temb.float()``: norm1 +
    modulate, gate + affine norm2, add + norm3 modulate, the FF gated residual alone and fused
    with the next block's norm1. TI2V's [B, S, 6, D] and SkyReels-V2 diffusion forcing's
    [B, 6, S, D] layouts (strided chunk views), fp32 and bf16 tables, specials in temb; the
    widths of the warp (1536, 3072) and runtime-loop (5120) kernels."""
    from diffusers.models.normalization import FP32LayerNorm

    from ditfuse.kernels.modulate.gate_residual_triton import gate_residual
    from tests.support.specials import with_specials

    gen = torch.Generator(device="cuda").manual_seed(37)
    bf = torch.bfloat16
    failures = []
    for D, S, B in ((3072, 27280, 1), (3072, 97, 2), (1536, 1560, 2), (5120, 13, 1)):
        norm = FP32LayerNorm(D, EPS, elementwise_affine=False).cuda()
        for layout in ("ti2v", "skyreels"):
            for tdt in (F32, bf):
                label = f"D={D} S={S} B={B} {layout} table {tdt}"
                table = _rand((1, 6, D), tdt, gen, 0.5)
                if layout == "ti2v":
                    temb = with_specials(_rand((B, S, 6, D), bf, gen, 0.5))
                    chunks = temb.unbind(2)
                    sums = [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
                else:
                    temb = with_specials(_rand((B, 6, S, D), bf, gen, 0.5))
                    chunks = temb.unbind(1)
                    sums = [c.squeeze(1) for c in (table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
                rows = table.reshape(6, D).unbind(0)
                shift, scale, gate, c_shift, c_scale, c_gate = sums
                x = _rand((B, S, D), bf, gen, 3.0, 0.5)
                attn = _rand((B, S, D), bf, gen, 2.0)
                w2, b2 = _rand((D,), F32, gen, 0.2, 1.0), _rand((D,), F32, gen, 0.2)
                with torch.no_grad():
                    n1 = (norm(x.float()) * (1 + scale) + shift).type_as(x)
                    h = (x.float() + attn * gate).type_as(x)
                    n2 = torch.nn.functional.layer_norm(h.float(), (D,), w2, b2, EPS).type_as(h)
                    h2 = h + attn
                    n3 = (norm(h2.float()) * (1 + c_scale) + c_shift).type_as(h2)
                    h3 = (h2.float() + attn.float() * c_gate).type_as(h2)
                    n4 = (norm(h3.float()) * (1 + scale) + shift).type_as(h3)
                cases = (
                    ("norm1", layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32, rows[1], rows[0]), n1),
                    ("gate+norm2", gate_residual_layernorm_modulate(x, chunks[2], attn, None, None, EPS, w2, b2, F32,
                                                                    rows[2]), (h, n2)),
                    ("add+norm3", gate_residual_layernorm_modulate(h, None, attn, chunks[4], chunks[3], EPS, None,
                                                                   None, F32, None, rows[4], rows[3]), (h2, n3)),
                    ("ff residual", gate_residual(h2, chunks[5], attn, rows[5]), h3),
                    ("ff residual + next norm1", gate_residual_layernorm_modulate(
                        h2, chunks[5], attn, chunks[1], chunks[0], EPS, None, None, F32, rows[5], rows[1], rows[0]),
                     (h3, n4)),
                )
                for name, got, exp in cases:
                    mm = compare_outputs(got, exp, f"{label} {name}")
                    if mm is not None:
                        failures.append(str(mm))
                del temb, chunks, sums
        torch.cuda.empty_cache()
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failing cases)"


def test_wan_tail_bf16_table():
    """norm_out with a bf16 [1, 2, D] table (plain .to(bf16)): r16(1 + scale), fp32 product/sum."""
    gen = torch.Generator(device="cuda").manual_seed(29)
    B, S, D = 2, 1560, 1536
    x = _rand((B, S, D), torch.bfloat16, gen, 2.0)
    temb = _rand((B, D), torch.bfloat16, gen, 0.5)
    for tdt in (F32, torch.bfloat16):
        shift, scale = (_rand((1, 2, D), tdt, gen, 0.5) + temb.unsqueeze(1)).chunk(2, dim=1)
        exp = (torch.nn.functional.layer_norm(x.float(), (D,), eps=EPS) * (1 + scale) + shift).type_as(x)
        mm = compare_outputs(layernorm_modulate(x, scale, shift, EPS, norm_dtype=F32), exp, f"tail {tdt}")
        assert mm is None, str(mm)


def test_close_variants_run_and_stay_close():
    gen = torch.Generator(device="cuda").manual_seed(31)
    B, S, D = 1, 4096, 3072
    x = _rand((B, S, D), torch.bfloat16, gen, 2.0)
    upd = _rand((B, S, D), torch.bfloat16, gen, 1.0)
    gate, scale, shift = _rand((B, D), torch.bfloat16, gen, 0.5), *_mods(B, S, D, torch.bfloat16, gen, False)
    exact = layernorm_modulate(x, scale, shift, EPS)
    close = layernorm_modulate_fp32(x, scale, shift, EPS)
    assert compare_outputs(close, exact) is not None
    torch.testing.assert_close(close.float(), exact.float(), rtol=2e-2, atol=2e-2)
    h, n = gate_residual_layernorm_modulate_fp32(x, gate, upd, scale, shift, EPS)
    he, ne = gate_residual_layernorm_modulate(x, gate, upd, scale, shift, EPS)
    torch.testing.assert_close(n.float(), ne.float(), rtol=2e-2, atol=2e-2)
    # h = r(res + gate*u) vs r(res + r(gate*u)): at most one bf16 ulp apart (|h| up to ~8 here)
    torch.testing.assert_close(h.float(), he.float(), rtol=1e-2, atol=6.25e-2)


def test_affine_contraction_probe():
    """torch's affine LayerNorm output is ``gamma * (rstd * (x - mean)) + beta``; nvcc contracts
    it into an FMA (the kernel's default). Both variants are run: the report names the one
    that matches, so a mismatch in test_wan_chains_sweep says what to change."""
    from ditfuse.kernels.norm import layernorm_modulate_triton as lnm

    gen = torch.Generator(device="cuda").manual_seed(37)
    B, S, D = 1, 4096, 1536
    x = _rand((B, S, D), torch.bfloat16, gen, 3.0, 0.5)
    w, b = _rand((D,), F32, gen, 0.3, 1.0), _rand((D,), F32, gen, 0.3)
    exp = torch.nn.functional.layer_norm(x.float(), (D,), w, b, EPS)
    fma = lnm._launch(x.float(), None, None, None, None, EPS, w, b, None, True, affine_fma=True)[1]
    plain = lnm._launch(x.float(), None, None, None, None, EPS, w, b, None, True, affine_fma=False)[1]
    res = {"fma": compare_outputs(fma, exp) is None, "mul+add": compare_outputs(plain, exp) is None}
    print("affine contraction probe:", res)
    assert res["fma"], f"the FMA contraction does not match torch: {res}"


@pytest.mark.parametrize("D", [1536, 2240, 3072, 4100, 5120, 6144])
def test_warp_held_rows_and_runtime_loop_agree_with_eager(D):
    """Every way over a row at every tiling, plain and gated, 2051 tokens (tail rows): bitwise equal
    to eager. The warp-per-row kernel (default for whole steps up to D = 3072, forced at 5120 with
    10 held steps), the 128-thread kernel with held tiles (default for partial steps such as 2240,
    whose last step has predicated loads) and its runtime loop (default beyond 3072), with and
    without the next step's prefetch (4100: a partial last step in the loop)."""
    from ditfuse.kernels.norm import layernorm_modulate_triton as lnm

    gen = torch.Generator(device="cuda").manual_seed(D)
    B, S = 2, 2051
    x, u = _rand((B, S, D), torch.bfloat16, gen, 3.0, 1.0), _rand((B, S, D), torch.bfloat16, gen, 2.0)
    sc, sh, g = (_rand((B, 1, D), F32, gen, 0.5) for _ in range(3))
    exp_plain = ref.layernorm_modulate(x, sc, sh, EPS, norm_dtype=F32)
    exp_gated = ref.gate_residual_layernorm_modulate(x, g, u, sc, sh, EPS, norm_dtype=F32)
    paths = {"loop": dict(unroll=False, prefetch=False), "loop_prefetch": dict(unroll=False, prefetch=True)}
    if D <= 3072:  # wider rows are never held (warp=False gives the loop)
        paths["held"] = dict(warp=False)
    if D % 512 == 0:
        paths["warp"] = dict(warp=True)
    failures = []
    for path, kw in paths.items():
        for R in (1, 2, 4, 8) if path == "warp" else (1, 4) if path.startswith("loop") else (1, 2, 4):
            label = f"D={D} {path} R={R}"
            got = lnm._launch(x, None, None, sc, sh, EPS, None, None, F32, True, rows_per_program=R, **kw)[1]
            mm = compare_outputs(got, exp_plain, label + " plain")
            if mm is not None:
                failures.append(str(mm))
            got = lnm._launch(x, g, u, sc, sh, EPS, None, None, F32, True, rows_per_program=R, **kw)
            mm = compare_outputs(got, exp_gated, label + " gated")
            if mm is not None:
                failures.append(str(mm))
    from ditfuse.kernels.common import warp as cw

    refused = {k: v for k, v in cw._VERDICTS.items() if v}
    assert not refused, f"the layout guard refused warp-per-row binaries: {refused}"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("gated", [False, True], ids=["ln_mod", "gate_res_ln_mod"])
@pytest.mark.parametrize("D", [4096, 3072, 2240, 5120])
def test_shift_free_modulate(D, gated, row_kernel):
    """Qwen-Image 2.1's ``norm(x) * (1 + scale)`` (no shift; after the tanh-gated residual for
    norm2), per-sample [B, 1, D] rows and per-token [B, S, D] rows as its causal_condition selects
    them, bf16 and fp16; at 4096 (its width) and the other widths, both row kernels."""
    if row_kernel == "warp" and D % 512:
        pytest.skip("no whole-step rows: same kernel as block")
    gen = torch.Generator(device="cuda").manual_seed(D + 11 * int(gated))
    failures = []
    for dtype in (torch.bfloat16, torch.float16):
        for S in (1, 17, 4096, 4608):
            for B in (1, 2):
                for per_token in (False, True):
                    scale = _rand((B, S, D) if per_token else (B, 1, D), dtype, gen, 0.5)
                    label = f"shift-free D={D} S={S} B={B} per_token={per_token} {dtype}"
                    if gated:
                        res = _rand((B, S, D), dtype, gen, 4.0, 1.0)
                        upd = _rand((B, S, D), dtype, gen, 2.0)
                        gate = _rand(scale.shape, dtype, gen).tanh()
                        got = gate_residual_layernorm_modulate(res, gate, upd, scale, None, EPS)
                        exp = ref.gate_residual_layernorm_modulate(res, gate, upd, scale, None, EPS)
                    else:
                        x = _rand((B, S, D), dtype, gen, 3.0, 2.0)
                        got = layernorm_modulate(x, scale, None, EPS)
                        exp = ref.layernorm_modulate(x, scale, None, EPS)
                    mm = compare_outputs(got, exp, label)
                    if mm is not None:
                        failures.append(str(mm))
    assert not failures, "\n".join(failures)
