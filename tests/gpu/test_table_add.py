"""modulate.table_add on CUDA, bitwise against eager's ``table + temb.float()``: Wan 2.2 TI2V-5B's
per-token layout ([1, 1, 6, D] fp32 + [B, S, 6, D]) at small and odd shapes and the real
1280x704x121 one ([1 | 2, 27280, 6, 3072] bf16), SkyReels-V2's diffusion forcing ([1, 6, 1, D] +
[B, 6, S, D]) and the per-sample [1, 6, D] + [B, 6, D]; bf16 / fp16 / fp32 temb with NaN / ±Inf /
-0 / subnormals, an fp32 table (``from_pretrained``) and a bf16 / fp16 one (a plain
``.to(dtype)``); each shape twice (the second launch takes the cached fast launch)."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels import reference as ref
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import table_add_triton as ta
from tests.support.specials import with_specials

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _inputs(tshape, eshape, dtype, seed, table_dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    table = (torch.randn(tshape, generator=gen, device=DEV) * 0.05).to(table_dtype)
    temb = with_specials((torch.randn(eshape, generator=gen, device=DEV) * 3).to(dtype))
    # subnormals (fp32's and bf16's; fp16's own at 6e-8) in both operands, a -0 in the table
    temb.view(-1)[1:4] = torch.tensor([1e-40, -1e-40, 6e-8], device=DEV).to(dtype)
    table.view(-1)[:2] = torch.tensor([-1e-40, -0.0], device=DEV).to(table_dtype)
    return table, temb


def _check(tshape, eshape, dtype, seed, label, table_dtype=torch.float32):
    table, temb = _inputs(tshape, eshape, dtype, seed, table_dtype)
    assert ta.can_use_table_add(table, temb), label
    want = ref.table_add(table, temb)
    failures = []
    for call in range(2):
        got = ta.table_add(table, temb)
        assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == torch.float32, label
        mm = compare_outputs(got, want, f"{label} call {call}")
        if mm is not None:
            failures.append(str(mm))
        del got
    return failures


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_small_shapes_match_eager(dtype):
    failures = []
    for b in (1, 2):
        for s in (1, 13, 97, 1024):
            for d in (1, 7, 48, 130, 1536, 3072):
                failures += _check((1, 1, 6, d), (b, s, 6, d), dtype, b * s + d, f"wan B={b} S={s} D={d}")
                failures += _check((1, 6, 1, d), (b, 6, s, d), dtype, b * s + d + 1, f"skyreels B={b} S={s} D={d}")
            failures += _check((1, 6, 3072), (b, 6, 3072), dtype, b, f"per-sample B={b}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16], ids=["bf16-table", "fp16-table"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_low_precision_table_matches_eager(dtype, table_dtype):
    failures = []
    for b, s, d in ((1, 1, 1), (2, 13, 130), (2, 1024, 3072)):
        failures += _check((1, 1, 6, d), (b, s, 6, d), dtype, s + d, f"wan B={b} S={s} D={d}", table_dtype)
        failures += _check((1, 6, 1, d), (b, 6, s, d), dtype, s + d, f"skyreels B={b} S={s} D={d}", table_dtype)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("batch", [1, 2])
def test_ti2v_5b_real_shape(batch):
    """Wan 2.2 TI2V-5B at 1280x704x121 (31 x 22 x 40 = 27280 tokens, width 3072), bf16 temb."""
    failures = _check((1, 1, 6, 3072), (batch, 27280, 6, 3072), torch.bfloat16, 7, f"ti2v-5b B={batch}")
    torch.cuda.empty_cache()
    assert not failures, "\n".join(failures)


def test_skyreels_df_width():
    """SkyReels-V2 1.3B's diffusion forcing: [1, 6, 1, 1536] + [2, 6, 8190, 1536] bf16."""
    failures = _check((1, 6, 1, 1536), (2, 6, 8190, 1536), torch.bfloat16, 9, "skyreels-df 1.3B")
    assert not failures, "\n".join(failures)
