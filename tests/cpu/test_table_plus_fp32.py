"""models.adaln.table_plus_fp32: Wan's / SkyReels-V2's ``table + temb.float()`` as one promoted
add — bit for bit eager's sum, without the fp32 copy of ``temb`` (round 32: the per-token
TI2V-5B modulation spent two passes per block on it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ditfuse.models.adaln import table_plus_fp32
from ditfuse.kernels.compare import assert_bitwise_equal
from tests.support.specials import with_specials


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _specials(t: torch.Tensor) -> torch.Tensor:
    """NaN, ±Inf, -0.0 (tests.support.specials) plus +0.0, values near fp32's overflow (Inf in
    fp16 / bf16 as the cast makes them) and an fp32 subnormal, next to the first."""
    with_specials(t)
    t.view(-1)[1:5] = torch.tensor([0.0, 3.0e38, -3.0e38, 1e-40]).to(t.dtype)
    return t


# (table shape, temb shape): Wan 2.2 TI2V per-token [1, 1, 6, D] + [B, S, 6, D]; SkyReels-V2
# diffusion forcing [1, 6, 1, D] + [B, 6, S, D]
LAYOUTS = {
    "wan_ti2v": ((1, 1, 6, 48), lambda b, s: (b, s, 6, 48)),
    "skyreels_df": ((1, 6, 1, 40), lambda b, s: (b, 6, s, 40)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("temb_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 13), (1, 97)])
def test_equals_eager_bit_for_bit(layout, temb_dtype, batch, seq):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    table_shape, temb_shape = LAYOUTS[layout]
    table = torch.randn(table_shape, generator=g) * 0.05
    temb = _specials((torch.randn(temb_shape(batch, seq), generator=g) * 3).to(temb_dtype))
    out = table_plus_fp32(table, temb)
    ref = table + temb.float()
    assert out.dtype == ref.dtype == torch.float32 and out.shape == ref.shape and out.stride() == ref.stride()
    assert_bitwise_equal(out, ref)


def test_strided_temb():
    """A non-contiguous temb (a slice of a wider buffer) gives eager's sum too."""
    g = torch.Generator().manual_seed(7)
    table = torch.randn(1, 1, 6, 32, generator=g)
    wide = torch.randn(2, 11, 6, 64, generator=g).to(torch.bfloat16)
    temb = wide[..., 16:48]
    assert not temb.is_contiguous()
    assert_bitwise_equal(table_plus_fp32(table, temb), table + temb.float())


def test_no_upcast_copy_of_temb():
    """The point of the helper: one add, no ``_to_copy`` of the [B, S, 6, D] temb."""
    table = torch.randn(1, 1, 6, 16)
    temb = torch.randn(2, 5, 6, 16).to(torch.bfloat16)
    with _Ops() as eager_ops:
        table + temb.float()
    with _Ops() as ours:
        table_plus_fp32(table, temb)
    assert "aten._to_copy" in eager_ops.seen, eager_ops.seen  # what eager pays
    assert ours.seen == ["aten.add"], ours.seen


@pytest.mark.parametrize("table_dtype, temb_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)])
def test_other_dtype_pairs_take_eager_expression(table_dtype, temb_dtype):
    """A bf16 table (a model cast with a plain ``.to(bf16)``) would promote to bf16, an fp64 temb
    to fp64: both keep eager's ``temb.float()`` and its result dtype."""
    g = torch.Generator().manual_seed(3)
    table = torch.randn(1, 1, 6, 24, generator=g).to(table_dtype)
    temb = torch.randn(1, 9, 6, 24, generator=g).to(temb_dtype)
    out = table_plus_fp32(table, temb)
    ref = table + temb.float()
    assert out.dtype == ref.dtype
    assert_bitwise_equal(out, ref)
