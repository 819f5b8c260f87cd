"""Layout helpers that let a fused FLUX path skip copies whose bits do not matter (torch only).

A copy is exact by construction: removing one changes no output bit, provided the consumer reads
the same values from a strided view (or a buffer it was written into directly). These helpers are
plain torch (views, one preallocated buffer, a cat that returns a view when the pieces already
lie back to back); no new kernel, so no KernelSpec. notes/layout.md lists every copy in diffusers
0.42.1's FLUX blocks and which of these helpers removes it.

What a consumer accepts decides whether a copy can go:

- ditfuse's elementwise kernels (scale_shift, gate_residual, gelu_tanh) take any strides.
- ``nn.Linear`` on a 3-D input folds the leading dims (``input.view(-1, K)``-like) and calls
  addmm; a view whose leading dims cannot fold (e.g. ``x[:, 512:]`` of a ``[2, S, D]`` tensor) is
  copied first, inside linear. Calling the GEMM per sample or as a strided batched GEMM would
  avoid that copy but changes the GEMM shape, which may change cuBLAS's algorithm and the bits:
  not lossless. For batch 1 the sequence split of a contiguous tensor is contiguous, so
  ``.contiguous()`` there is already free.
- SDPA accepts the permuted ``[B, H, S, D]`` views of ``[B, S, H, D]`` tensors as diffusers passes
  them; its flash/cuDNN output permuted back is already contiguous in ``[B, S, H, D]``, so
  ``flatten(2, 3)`` is a view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def is_back_to_back(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> bool:
    """True when ``torch.cat(tensors, dim)`` would produce exactly the memory these tensors already
    occupy: same storage, dtype, device and strides, sizes equal except along ``dim``, and each piece
    starting where the previous one ends along ``dim`` (so the concatenation is a view of it)."""
    if len(tensors) == 0:
        return False
    first = tensors[0]
    nd = first.dim()
    dim = dim % nd if nd else 0
    if nd == 0:
        return False
    try:
        storage_ptr = first.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    for t in tensors:
        if t.dim() != nd or t.dtype != first.dtype or t.device != first.device:
            return False
        if t.untyped_storage().data_ptr() != storage_ptr:
            return False
        if any(t.shape[i] != first.shape[i] for i in range(nd) if i != dim):
            return False
        if any(t.stride(i) != first.stride(i) for i in range(nd) if t.shape[i] != 1 or i == dim):
            return False
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return False
        offset += t.shape[dim] * first.stride(dim)
    return True


def cat_or_view(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)``, returned as a view without copying when the pieces already lie
    back to back in one buffer (:func:`is_back_to_back`), e.g. the ``[:, :S_txt]`` / ``[:, S_txt:]``
    views a previous FLUX single block returned. Same values either way.

    Aliasing: unlike ``torch.cat`` the result shares memory with the inputs. FLUX's blocks never
    write in place into their inputs, which is what makes this safe there; do not use it where a
    later in-place op writes into either side.
    """
    if len(tensors) > 0 and is_back_to_back(tensors, dim):
        first = tensors[0]
        size = list(first.shape)
        size[dim % first.dim()] = sum(t.shape[dim] for t in tensors)
        return first.as_strided(size, first.stride(), first.storage_offset())
    return torch.cat(list(tensors), dim=dim)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for same-dtype, same-shape tensors, moved as 8-byte words where both
    layouts allow it (last dim contiguous with a length and every other stride a multiple of
    8 bytes, 8-byte-aligned bases). A copy moves bits either way; the wide words matter when
    ``dst`` is a strided slice (the FLUX single block's attention columns of proj_out's input),
    where aten's copy is not vectorized: 2-byte elements run at a fraction of the bandwidth."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        return dst.copy_(src)
    size = dst.element_size()
    per = 8 // size if size in (1, 2, 4) else 0

    def wide(t: torch.Tensor) -> bool:
        return (t.dim() > 0 and t.stride(-1) == 1 and t.shape[-1] % per == 0 and t.data_ptr() % 8 == 0
                and all(st % per == 0 for d, st in enumerate(t.stride()[:-1]) if t.shape[d] != 1))

    if per and dst.numel() and wide(dst) and wide(src):
        dst.view(torch.int64).copy_(src.view(torch.int64))
        return dst
    return dst.copy_(src)


def split_seq(x: torch.Tensor, s_txt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(x[:, :s_txt], x[:, s_txt:])`` of a joint ``[B, S, ...]`` tensor (text first), as
    diffusers' ``split_with_sizes`` / slicing produces them; no copy."""
    return x[:, :s_txt], x[:, s_txt:]


def linear_copies_input(x: torch.Tensor) -> bool:
    """True when ``nn.Linear`` (``F.linear``) would copy ``x`` before its GEMM: the leading dims of
    ``x`` cannot be folded into one (``x.view(-1, K)`` fails) or the last dim is not unit-stride.
    Then the ``.contiguous()`` diffusers writes costs exactly the copy linear would make anyway."""
    if x.dim() < 2:
        return x.dim() == 1 and x.stride(0) != 1
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        return True
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return True
    return False


@dataclass
class JointSequence:
    """A joint ``[B, S_txt + S_img, D]`` hidden state carried across FLUX single blocks.

    diffusers' single block starts with ``cat([encoder_hidden_states, hidden_states], dim=1)`` and
    ends with ``h[:, :S_txt], h[:, S_txt:]``; between two single blocks that is a full copy of a
    tensor into itself. Keeping the joint tensor (and handing out views for the per-stream results)
    skips the cat for every single block after the first; :func:`cat_or_view` does the same when
    given the previous block's two views.
    """

    def __init__(self, joint: torch.Tensor, s_txt: int) -> None:
        if joint.dim() != 3 or not 0 <= s_txt <= joint.shape[1]:
            raise ValueError(f"expected [B, S, D] with 0 <= s_txt <= S, got {tuple(joint.shape)}, s_txt={s_txt}")
        self.joint = joint
        self.s_txt = s_txt

    @classmethod
    def from_streams(cls, txt: torch.Tensor, img: torch.Tensor) -> "JointSequence":
        return cls(cat_or_view((txt, img), dim=1), txt.shape[1])

    @property
    def txt(self) -> torch.Tensor:
        return self.joint[:, : self.s_txt]

    @property
    def img(self) -> torch.Tensor:
        return self.joint[:, self.s_txt :]


__all__ = [
    "is_back_to_back",
    "cat_or_view",
    "split_seq",
    "linear_copies_input",
    "JointSequence",
]
