"""Special values written into a test tensor: NaN, +Inf, -Inf and -0.0 at fixed places (first,
a third, half way, last), for the elementwise kernels' GPU tests."""

from __future__ import annotations

import torch


def with_specials(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) with NaN, +Inf, -Inf, -0.0 at flat positions 0, n/3, n/2, n-1; in place."""
    flat = t.view(-1)
    n = flat.numel()
    for i, v in zip((0, n // 3, n // 2, n - 1), (float("nan"), float("inf"), float("-inf"), -0.0)):
        flat[i] = v
    return t
