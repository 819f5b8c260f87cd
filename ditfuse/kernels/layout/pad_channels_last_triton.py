"""A zero-padded channels-last-3d buffer whose interior a producer fills: ``F.pad``'s output
without its copy (torch + one Triton launch; exact by construction, so no op of its own).

The Wan VAE's causal convolutions take ``F.pad(cat([cache, x], 2), causal padding)``: a new
tensor, zero around x, the cached frames of the previous chunk in front of it.
:func:`padded_channels_last` allocates that tensor channels-last and, in one launch, zeroes its
border (front frames, top/bottom rows, left/right columns) and copies the cached frames into
their place; the caller writes x's interior (the RMS_norm kernel straight from its registers, or
a copy of x). Used by norm/wan_rms_norm_silu_triton.py and models/autoencoder_kl_wan.py.

The cached frames are bit copies (loads and stores of the storage type, no arithmetic: NaN
payloads and signed zeros kept), and the border zeros are +0 as ``F.pad``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditfuse.kernels.reference import dense_channels_last
from ditfuse.kernels.common.launch import launch


@triton.jit
def _border_kernel(out_ptr, cache_ptr, Hp, ROW, front, tc, ht, hb, wl_c, wr_c, sB, cB, cT, cH,
                   HAS_CACHE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, j, b): elements ``j*BLOCK ..`` of one row (``ROW = Wp*C`` elements) of a
    padded channels-last-3d buffer. Front frames ``t < front - tc`` and the top/bottom border
    rows: all zero. Frames ``front - tc <= t < front`` (HAS_CACHE): the cached frame
    ``t - (front - tc)``'s row between zero border columns (the cache is dense channels-last:
    ``cB``, ``cT``, ``cH`` its sample, frame and row strides in elements). Other rows: only their
    first ``wl_c`` and last ``wr_c`` elements (the left/right border columns); their interior is
    the producer's, and the programs of a block that holds no border column return at once."""
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    b = tl.program_id(2).to(tl.int64)
    t = row // Hp
    h = row - t * Hp
    full = (t < front) | (h < ht) | (h >= Hp - hb)
    base = out_ptr + b * sB + row.to(tl.int64) * ROW
    i = start + tl.arange(0, BLOCK)
    inb = i < ROW
    border = (i < wl_c) | (i >= ROW - wr_c)
    if HAS_CACHE:
        crow = (t >= front - tc) & (t < front) & (h >= ht) & (h < Hp - hb)
        whole = full | crow
    else:
        whole = full
    if whole:
        if HAS_CACHE:
            cbase = cache_ptr + b * cB + (t - (front - tc)).to(tl.int64) * cT + (h - ht).to(tl.int64) * cH - wl_c
            v = tl.load(cbase + i, mask=inb & crow & ~border, other=0.0)
        else:
            v = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
        tl.store(base + i, v, mask=inb & (full | border))
    elif (start < wl_c) | (start + BLOCK > ROW - wr_c):
        tl.store(base + i, tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty), mask=inb & border)


BORDER_LAUNCH = (4096, 4)  # (elements of a row per program, warps)


def launch_border(out: torch.Tensor, cache: torch.Tensor | None, pad: tuple[int, ...],
                  launch_params: tuple[int, int] | None = None) -> None:
    """Zero ``out``'s border and copy ``cache`` (None: no cached frames) into its front frames:
    :func:`padded_channels_last`'s launch on an allocated buffer (``out`` channels-last-3d of the
    padded shape, ``pad`` F.pad's six ints)."""
    wl, wr, ht, hb, front, _ = pad
    B, C, Tp, Hp, Wp = out.shape
    Hh, Ww = Hp - ht - hb, Wp - wl - wr
    tc = 0 if cache is None else cache.shape[2]
    block, warps = launch_params or BORDER_LAUNCH
    ROW = Wp * C
    launch(_border_kernel, (Tp * Hp, -(-ROW // block), B),
           out, out if tc == 0 else cache, Hp, ROW, front, tc, ht, hb,
           wl * C, wr * C, out.stride(0), tc * Hh * Ww * C, Hh * Ww * C, Ww * C,
           HAS_CACHE=tc > 0, BLOCK=block, num_warps=warps)


def padded_channels_last(shape: tuple[int, ...] | torch.Size, pad: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device, cache: torch.Tensor | None = None) -> torch.Tensor:
    """A channels-last-3d buffer of ``F.pad(torch.empty(shape), pad)``'s shape (``pad`` is F.pad's
    ``(w_left, w_right, h_top, h_bottom, t_front, t_back)`` for a ``[B, C, T, H, W]`` shape), zero
    outside the ``shape``-sized interior, which is left for the caller to write.

    ``cache`` (``[B, C, tc, H, W]``, ``tc <= t_front``, dense channels-last, x's dtype and device):
    frames copied into the last ``tc`` front frames' interior, as ``F.pad(cat([cache, x], 2),
    pad with t_front - tc)`` places them."""
    wl, wr, ht, hb, front, back = pad
    B, C, T, Hh, Ww = shape
    Tp, Hp, Wp = front + T + back, ht + Hh + hb, wl + Ww + wr
    out = torch.empty((B, C, Tp, Hp, Wp), dtype=dtype, device=device, memory_format=torch.channels_last_3d)
    if back:
        out[:, :, front + T:].zero_()
    tc = 0 if cache is None else cache.shape[2]
    if cache is not None:
        if (cache.dim() != 5 or cache.shape[:2] != (B, C) or cache.shape[3:] != (Hh, Ww) or tc > front
                or cache.dtype != dtype or cache.device != out.device or not dense_channels_last(cache)):
            raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} strides {cache.stride()} does not fit "
                             f"the front of {tuple(out.shape)} {dtype} (dense channels-last, <= {front} frames)")
    if out.numel() and (front or ht or hb or wl or wr):
        launch_border(out, cache if tc else None, tuple(pad))
    return out


__all__ = ["padded_channels_last", "launch_border"]
