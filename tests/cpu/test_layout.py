"""Layout helpers (ditfuse.kernels.layout.joint_buffers_torch): copies skipped, values unchanged."""

from __future__ import annotations

import pytest
import torch

from ditfuse.kernels.compare import assert_bitwise_equal
from ditfuse.kernels.layout.joint_buffers_torch import (
    JointSequence,
    cat_or_view,
    is_back_to_back,
    linear_copies_input,
    split_seq,
)


def test_cat_or_view_returns_view_for_adjacent_pieces():
    h = torch.randn(2, 9, 16)
    txt, img = split_seq(h, 4)
    joined = cat_or_view((txt, img), dim=1)
    assert joined.data_ptr() == h.data_ptr() and joined.shape == h.shape
    assert_bitwise_equal(joined, torch.cat([txt, img], dim=1))


def test_cat_or_view_copies_otherwise():
    a, b = torch.randn(2, 4, 16), torch.randn(2, 5, 16)
    assert not is_back_to_back((a, b), 1)
    assert_bitwise_equal(cat_or_view((a, b), 1), torch.cat([a, b], 1))
    h = torch.randn(2, 9, 16)
    assert not is_back_to_back((h[:, 4:], h[:, :4]), 1)  # wrong order
    assert not is_back_to_back((h[:, :3], h[:, 4:]), 1)  # gap
    # strided pieces that are adjacent along dim: the view has the same values as the cat
    out = cat_or_view((h[:, :4, :8], h[:, 4:, :8]), 1)
    assert out.data_ptr() == h.data_ptr()
    assert_bitwise_equal(out, torch.cat([h[:, :4, :8], h[:, 4:, :8]], 1))
    w = torch.randn(3, 32)
    assert is_back_to_back((w[:, :8], w[:, 8:16]), 1)
    assert_bitwise_equal(cat_or_view((w[:, :8], w[:, 8:16]), 1), w[:, :16])
    assert not is_back_to_back((w[:, :8], w[:, 8:16].to(torch.float64)), 1)  # dtype differs


def test_joint_sequence_across_single_blocks():
    txt, img = torch.randn(1, 5, 8), torch.randn(1, 7, 8)
    js = JointSequence.from_streams(txt, img)
    assert_bitwise_equal(js.joint, torch.cat([txt, img], 1))
    js2 = JointSequence.from_streams(js.txt, js.img)  # second block: no copy
    assert js2.joint.data_ptr() == js.joint.data_ptr()


def test_linear_copies_input():
    x = torch.randn(2, 9, 16)
    txt, img = split_seq(x, 4)
    assert linear_copies_input(img) and linear_copies_input(txt)  # B=2: rows of two samples not foldable
    x1 = torch.randn(1, 9, 16)
    assert not any(linear_copies_input(t) for t in split_seq(x1, 4))  # B=1: already contiguous
    assert linear_copies_input(torch.randn(2, 9, 32)[:, :, ::2])
    assert not linear_copies_input(torch.randn(2, 9, 16))




# -- copy_bits: the single block's attention columns under the GEMM-GELU path ---------------------


@pytest.mark.parametrize("case", ["wide B2", "wide B1", "odd width", "misaligned column", "fp32", "int64 view of fp16"])
def test_copy_bits_moves_every_bit_and_nothing_else(case):
    from ditfuse.kernels.layout.joint_buffers_torch import copy_bits

    dtype = {"fp32": torch.float32, "int64 view of fp16": torch.float16}.get(case, torch.bfloat16)
    B, S, W, extra, at = (1 if case == "wide B1" else 2), 9, 24, 40, 0
    if case == "odd width":
        W = 6
    if case == "misaligned column":
        at = 2  # 4 bytes into the row: the 8-byte view cannot be taken
    buf = torch.full((B, S, at + W + extra), 3.0, dtype=dtype)
    src = torch.randn(B, S, W).to(dtype)
    bits = src.view(torch.int16 if src.element_size() == 2 else torch.int32)
    bits[0, 0, 0] = 0x7FC1 if src.element_size() == 2 else 0x7FC00001  # a NaN with a payload
    bits[-1, -1, -1] = -0x8000 if src.element_size() == 2 else -0x80000000  # -0.0
    dst = buf[:, :, at:at + W]
    assert copy_bits(dst, src).data_ptr() == dst.data_ptr()
    view = torch.int16 if src.element_size() == 2 else torch.int32
    assert torch.equal(dst.view(view), src.view(view)), case
    assert (buf[:, :, :at] == 3.0).all() and (buf[:, :, at + W:] == 3.0).all(), "wrote outside the slice"


def test_copy_bits_casts_like_copy_across_dtypes():
    from ditfuse.kernels.layout.joint_buffers_torch import copy_bits

    src = torch.randn(2, 5, 16)
    dst = torch.empty(2, 5, 16, dtype=torch.bfloat16)
    assert torch.equal(copy_bits(dst, src), src.to(torch.bfloat16))
