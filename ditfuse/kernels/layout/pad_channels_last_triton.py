"""A zero-padded channels-last-3d buffer whose interior a producer fills: ``F.pad``'s output
without its copy (torch + one Triton launch; exact by construction, so no op of its own).

The Wan VAE's causal convolutions take ``F.pad(cat([cache, x], 2), causal padding)``: a new
tensor, zero around x. :func:`padded_channels_last` allocates that tensor channels-last and zeroes
only its border (front frames, top/bottom rows, left/right columns) in one launch; the caller
writes the interior (the RMS_norm kernel straight from its registers, or a copy of x and the cached
frames). Used by norm/wan_rms_norm_silu_triton.py and models/autoencoder_kl_wan.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _zero_border_kernel(out_ptr, Hp, ROW, front, ht, hb, wl_c, wr_c, sB, BLOCK: tl.constexpr):
    """Program (row, b): one row (``ROW = Wp*C`` elements) of a padded channels-last-3d buffer:
    all of it zero in the front frames and the top/bottom border rows, else its first ``wl_c``
    and last ``wr_c`` elements (the left/right border columns)."""
    row = tl.program_id(0)
    t = row // Hp
    h = row - t * Hp
    full = (t < front) | (h < ht) | (h >= Hp - hb)
    base = out_ptr + tl.program_id(1).to(tl.int64) * sB + row.to(tl.int64) * ROW
    zero = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    start = 0
    while start < ROW:
        i = start + tl.arange(0, BLOCK)
        tl.store(base + i, zero, mask=(i < ROW) & (full | (i < wl_c) | (i >= ROW - wr_c)))
        start += BLOCK


def padded_channels_last(shape: tuple[int, ...] | torch.Size, pad: tuple[int, ...], dtype: torch.dtype,
                         device: torch.device) -> torch.Tensor:
    """A channels-last-3d buffer of ``F.pad(torch.empty(shape), pad)``'s shape (``pad`` is F.pad's
    ``(w_left, w_right, h_top, h_bottom, t_front, t_back)`` for a ``[B, C, T, H, W]`` shape), zero
    outside the ``shape``-sized interior, which is left for the caller to write."""
    wl, wr, ht, hb, front, back = pad
    B, C, T, Hh, Ww = shape
    Tp, Hp, Wp = front + T + back, ht + Hh + hb, wl + Ww + wr
    out = torch.empty((B, C, Tp, Hp, Wp), dtype=dtype, device=device, memory_format=torch.channels_last_3d)
    if back:
        out[:, :, front + T:].zero_()
    if out.numel() and (front or ht or hb or wl or wr):
        _zero_border_kernel[(Tp * Hp, B)](out, Hp, Wp * C, front, ht, hb, wl * C, wr * C, out.stride(0),
                                          BLOCK=1024, num_warps=4)
    return out


__all__ = ["padded_channels_last"]
