"""The ``*_table`` arguments of the LayerNorm and gated-residual ops under TRITON_INTERPRET=1 (CPU).

Wan 2.2 TI2V-5B (and SkyReels-V2's diffusion forcing) modulate per token: every block forms
``scale_shift_table + temb.float()`` over [B, S, 6, D] and reads six [B, S, D] chunks of it. With a
chunk's [D] table row passed beside the embedding's own chunk, the ops form that one fp32 add in
registers (models/wan.py ``_modulation``). The claim tested here: for every op, every way over a row
(warp-per-row, held tiles, runtime loop with and without prefetch), both contracts, both layouts
(TI2V's [B, S, 6, D], SkyReels' [B, 6, S, D]: strided chunk views), bf16 / fp16 / fp32 embeddings,
fp32 / bf16 tables and NaN / ±Inf / -0 / subnormal values, the op with the table row gives the bits
of the same op fed the materialized sum (``table + chunk.float()``, as eager makes it), whose own
bits are held to eager elsewhere (tests/cpu/test_layernorm_modulate_interpret.py against the CUDA
order simulation, tests/gpu/test_layernorm_modulate.py against CUDA eager); and the references
agree the same way. The GPU twin: tests/gpu/test_layernorm_modulate.py
``test_wan_table_rows_sweep``.
"""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import exact as ex
from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.errors import UnsupportedInput
from ditfuse.kernels.modulate import gate_residual_triton as grt
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from tests.support.specials import with_specials

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

EPS = 1e-6
F32, BF16 = torch.float32, torch.bfloat16
PATHS = {"warp": dict(warp=True), "held": dict(warp=False), "loop": dict(unroll=False, prefetch=False),
         "loop_prefetch": dict(unroll=False, prefetch=True)}


def _r(shape, dtype, seed, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(dtype)


def _mods(layout: str, B: int, S: int, D: int, temb_dtype, table_dtype, seed: int, specials: bool):
    """(chunks, rows, sums): temb's six [B, S, D] chunk views, the table's six [D] rows, and the
    six chunks of eager's ``table + temb.float()``."""
    if layout == "ti2v":
        temb = _r((B, S, 6, D), temb_dtype, seed, 0.5)
        table = _r((1, 6, D), table_dtype, seed + 1, 0.5)
        if specials:
            with_specials(temb)
            temb.view(-1)[1:3] = torch.tensor([1e-40, -3.0e38]).to(temb_dtype)
        chunks = temb.unbind(2)
        sums = [c.squeeze(2) for c in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    else:  # skyreels diffusion forcing: temb [B, 6, S, D], table [1, 6, D] -> [1, 6, 1, D]
        temb = _r((B, 6, S, D), temb_dtype, seed, 0.5)
        table = _r((1, 6, D), table_dtype, seed + 1, 0.5)
        if specials:
            with_specials(temb)
        chunks = temb.unbind(1)
        sums = [c.squeeze(1) for c in (table.unsqueeze(2) + temb.float()).chunk(6, dim=1)]
    rows = table.reshape(6, D).unbind(0)
    return chunks, rows, sums


def _eq(actual, expected, label):
    mm = compare_outputs(actual, expected, label)
    assert mm is None, str(mm)


CASES = [  # (layout, B, S, D, temb dtype, table dtype, specials)
    ("ti2v", 1, 7, 512, BF16, F32, True),     # the warp path's width
    ("ti2v", 2, 5, 136, BF16, F32, False),    # idle threads, B = 2 (CFG)
    ("ti2v", 1, 3, 520, torch.float16, BF16, True),  # a second-vector tail; a plain .to(bf16) table
    ("skyreels", 2, 3, 64, BF16, F32, True),
    ("skyreels", 1, 11, 48, F32, F32, False),
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "close"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}-S{c[2]}-D{c[3]}-{str(c[4])[6:]}-{str(c[5])[6:]}")
def test_table_rows_equal_materialized_sum(case, exact, path):
    layout, B, S, D, tdt, tabdt, specials = case
    if path == "warp" and D % 512:
        pytest.skip("the warp-per-row kernel needs whole 128-thread steps")
    chunks, rows, sums = _mods(layout, B, S, D, tdt, tabdt, 100 + D, specials)
    x = _r((B, S, D), BF16, 1, 3.0, 0.5)
    upd = _r((B, S, D), BF16, 2, 2.0)
    kw = PATHS[path]
    label = f"{case} {'exact' if exact else 'close'} {path}"

    # norm1 + modulate: scale = chunk 1, shift = chunk 0
    got = lnm._launch(x, None, None, chunks[1], chunks[0], EPS, None, None, F32, exact, **kw,
                      tables=(None, rows[1], rows[0]))[1]
    want = lnm._launch(x, None, None, sums[1], sums[0], EPS, None, None, F32, exact, **kw)[1]
    _eq(got, want, f"{label} norm1")
    # self-attention gated residual + affine norm2: gate = chunk 2
    w, b = _r((D,), F32, 3, 0.3, 1.0), _r((D,), F32, 4, 0.3)
    got = lnm._launch(x, chunks[2], upd, None, None, EPS, w, b, F32, exact, **kw, tables=(rows[2], None, None))
    want = lnm._launch(x, sums[2], upd, None, None, EPS, w, b, F32, exact, **kw)
    _eq(got[0], want[0], f"{label} gate+norm2 h")
    _eq(got[1], want[1], f"{label} gate+norm2 n")
    # cross-attention residual + norm3 modulate: scale = chunk 4, shift = chunk 3
    got = lnm._launch(x, None, upd, chunks[4], chunks[3], EPS, None, None, F32, exact, **kw,
                      tables=(None, rows[4], rows[3]))
    want = lnm._launch(x, None, upd, sums[4], sums[3], EPS, None, None, F32, exact, **kw)
    _eq(got[0], want[0], f"{label} add+norm3 h")
    _eq(got[1], want[1], f"{label} add+norm3 n")
    # the closing FF residual (gate = chunk 5) fused with the next block's norm1 (chunks 1 / 0)
    got = lnm._launch(x, chunks[5], upd, chunks[1], chunks[0], EPS, None, None, F32, exact, **kw,
                      tables=(rows[5], rows[1], rows[0]))
    want = lnm._launch(x, sums[5], upd, sums[1], sums[0], EPS, None, None, F32, exact, **kw)
    _eq(got[0], want[0], f"{label} close h")
    _eq(got[1], want[1], f"{label} close n")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-B{c[1]}-S{c[2]}-D{c[3]}-{str(c[4])[6:]}-{str(c[5])[6:]}")
def test_gate_residual_table_row(case):
    """The FF residual alone (the last block, or no hand-off): gate = chunk 5, its row added in the
    tile kernel; also equal to eager's spelling ``(x.float() + ff.float() * gate).type_as(x)``."""
    layout, B, S, D, tdt, tabdt, specials = case
    chunks, rows, sums = _mods(layout, B, S, D, tdt, tabdt, 200 + D, specials)
    x = _r((B, S, D), BF16, 5, 3.0)
    ff = _r((B, S, D), BF16, 6, 2.0)
    got = grt.gate_residual(x, chunks[5], ff, rows[5])
    _eq(got, grt.gate_residual(x, sums[5], ff), f"{case} gate_residual vs sum")
    _eq(got, (x.float() + ff.float() * sums[5]).type_as(x), f"{case} gate_residual vs eager spelling")
    assert grt._RECIPES.get(next(k for k in grt._RECIPES._d if k is not None))  # a recipe was cached


def test_references_agree_with_the_materialized_sum():
    """The eager references (the gate's fallback) form ``table + chunk.float()`` themselves: the
    same bits as the chain on the sum (CPU torch: the chain itself, not the CUDA order)."""
    chunks, rows, sums = _mods("ti2v", 2, 5, 40, BF16, F32, 7, True)
    x, upd = _r((2, 5, 40), BF16, 8, 3.0), _r((2, 5, 40), BF16, 9)
    _eq(ref.layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32, rows[1], rows[0]),
        ref.layernorm_modulate(x, sums[1], sums[0], EPS, None, None, F32), "layernorm_modulate")
    for got, want in zip(
            ref.gate_residual_layernorm_modulate(x, chunks[5], upd, chunks[4], chunks[3], EPS, None, None, F32,
                                                 rows[5], rows[4], rows[3]),
            ref.gate_residual_layernorm_modulate(x, sums[5], upd, sums[4], sums[3], EPS, None, None, F32)):
        _eq(got, want, "gate_residual_layernorm_modulate")
    _eq(ref.gate_residual(x, chunks[2], upd, rows[2]), ref.gate_residual(x, sums[2], upd), "gate_residual")
    # the fp64 exact chains (close kernels' admission) take the rows the same way
    torch.testing.assert_close(ex.layernorm_modulate_fp64(x, chunks[1], chunks[0], EPS, None, None, F32,
                                                          rows[1], rows[0]),
                               ex.layernorm_modulate_fp64(x, sums[1], sums[0], EPS), equal_nan=True)


def test_rejections():
    """A row that is not [D], of fp64, or without its operand is refused with the reason (the
    gate then runs the reference)."""
    chunks, rows, _ = _mods("ti2v", 1, 3, 64, BF16, F32, 11, False)
    x, upd = _r((1, 3, 64), BF16, 12), _r((1, 3, 64), BF16, 13)
    assert lnm.can_use_layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32, rows[1], rows[0])
    assert not lnm.can_use_layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32, rows[1][:32], rows[0])
    assert not lnm.can_use_layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32,
                                              rows[1].double(), rows[0])
    assert not lnm.can_use_layernorm_modulate(x, None, None, EPS, None, None, F32, rows[1], None)
    # a gate row without a gated residual
    assert not lnm.can_use_gate_residual_layernorm_modulate(x, None, upd, None, None, EPS, None, None, F32, rows[2])
    with pytest.raises(UnsupportedInput, match="scale_table"):
        lnm.layernorm_modulate(x, chunks[1], chunks[0], EPS, None, None, F32, rows[1].reshape(1, 64), rows[0])
    assert not grt.can_use_gate_residual(x, chunks[2], upd, rows[2][:10])
    with pytest.raises(UnsupportedInput, match="gate_table"):
        grt.gate_residual(x, chunks[2], upd, rows[2].double())


def test_probe_block_paths_agree():
    """bench/probes/probe_block_modulation.py's two sequences (round 33: table_add then the ops on
    fp32 chunks; round 34: the ops on bf16 chunks + table rows) give the same bits for a whole
    block's modulation consumers, next block's opening included (a tiny shape here; the GPU run
    checks the real ones before timing)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "probes" / "probe_block_modulation.py"
    spec = importlib.util.spec_from_file_location("probe_block_modulation", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    t = probe.inputs(2, 5, 64, "cpu", seed=3)
    (_, a), (_, b) = [(k, fn(t)) for k, fn in probe.paths().items()]
    assert len(a) == len(b) == 7
    for i, (p, q) in enumerate(zip(a, b)):
        _eq(q, p, f"output {i}")
