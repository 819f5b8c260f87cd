"""A modulation table plus an upcast embedding: ``out = f32(table) + f32(temb)``, bit-exact vs
torch 2.11 CUDA eager ``table + temb.float()``.

Wan's per-token modulation (2.2 TI2V-5B: ``scale_shift_table.unsqueeze(0)``, fp32 [1, 1, 6, D],
plus a bf16 temb [B, S, 6, D]) and SkyReels-V2's diffusion forcing (``scale_shift_table.unsqueeze(2)``,
[1, 6, 1, D], plus [B, 6, S, D]). Eager converts temb to fp32 in a pass of its own, then runs a
broadcast fp32 add; torch's promoted ``table + temb`` skips the copy but its broadcast
mixed-dtype add reaches only ~61 % of copy bandwidth on the H100 (bench/probes/probe_table_sum.py).
Here one pass reads temb in its own dtype and writes the fp32 sum. With the table and temb each
bf16, fp16 or fp32, eager's add has the common dtype fp32 (``temb.float()`` is fp32): both
operands are converted to fp32 exactly (the table is fp32 where the model keeps it so, as
``from_pretrained`` does; bf16 after a plain ``.to(bf16)``), and the sum is one fp32 add rounded to
nearest-even (aten's ``CUDAFunctor_add<float>``: ``a + alpha * b`` with alpha = 1, the same single
rounding whether or not nvcc contracts it), so the result is eager's bit for bit, NaN / Inf / -0
/ subnormals included.

Layout: temb contiguous, seen as ``[P, M1, Q, M2]``; the table contiguous, seen as ``[M1, M2]``
and broadcast over P and Q: ``out[p, m, q, c] = f32(table[m, c]) + f32(temb[p, m, q, c])``. Wan's
layout is ``M1 = Q = 1``, ``M2 = 6 * D`` (a trailing contiguous block over B * S rows); SkyReels'
is ``P = B, M1 = 6, Q = S, M2 = D``. The kernel walks ``[G, Q, M2]`` planes (G = P * M1, each
plane adding table row ``g % M1``; with M1 = 1 the planes merge into one of P * Q rows) in 2-D
tiles of rows x columns, each program loading its table tile once. See :func:`can_use_table_add`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.elementwise import fits_int32, load_f32, tile
from ..common.host import SUPPORTED_DTYPES, cdiv, device_reason, grad_reason, next_pow2, use_custom_op
from ..common.launch import launch
from ..common.plans import Recipes, call_key
from ..errors import UnsupportedInput

# Elements per program (rows x columns; columns a power-of-two divisor of M2 >= 256 where one
# exists, at most 1024): gate_residual's tile size (97.7 % of copy bandwidth there, H200 sweep).
# Round 33 (H100, bench/results/probe_table_sum_round33_d_h100.csv): 1.016 ms at TI2V-5B's
# [1, 27280, 6, 3072] (torch.compile's kernel 1.016, the promoted add 2.033, eager 3.149).
_PER_PROGRAM = 2048


@triton.jit
def _table_add_kernel(
    table_ptr, temb_ptr, out_ptr,
    Q, M1, M2, N_Q, N_C,
    BLOCK_Q: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EVEN: tl.constexpr,
    I64: tl.constexpr = True,
):
    # one flat grid, column block fastest, then row block, then plane: the programs in flight
    # read and write a few long contiguous runs, as a flat elementwise kernel does
    pid = tl.program_id(0)
    gq = pid // N_C
    cb = pid - gq * N_C
    g = gq // N_Q
    qb = gq - g * N_Q
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = qb * BLOCK_Q + tl.arange(0, BLOCK_Q)
    if I64:
        t_ptrs = table_ptr + (g % M1).to(tl.int64) * M2 + cols
        offs = (g.to(tl.int64) * Q + rows.to(tl.int64))[:, None] * M2 + cols[None, :]
    else:
        t_ptrs = table_ptr + (g % M1) * M2 + cols
        offs = (g * Q + rows)[:, None] * M2 + cols[None, :]
    if EVEN:
        t = load_f32(t_ptrs, None)
        tl.store(out_ptr + offs, t[None, :] + load_f32(temb_ptr + offs, None))
    else:
        c_ok = cols < M2
        mask = (rows < Q)[:, None] & c_ok[None, :]
        t = load_f32(t_ptrs, c_ok)
        tl.store(out_ptr + offs, t[None, :] + load_f32(temb_ptr + offs, mask), mask=mask)


def _pattern(table: torch.Tensor, temb: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(P, M1, Q, M2) of the module docstring's layout from the two shapes, or None when the
    table's broadcast against temb is not of that form (or would enlarge temb's shape). Integer
    arithmetic only."""
    nd = temb.dim()
    if table.dim() > nd:
        return None
    tshape = (1,) * (nd - table.dim()) + tuple(table.shape)
    runs: list[list] = []  # [table spans these dims, their product], adjacent kinds merged
    for t, n in zip(tshape, temb.shape):
        if n == 1 and t == 1:
            continue
        if t == n:
            spans = True
        elif t == 1:
            spans = False
        else:
            return None
        if runs and runs[-1][0] is spans:
            runs[-1][1] *= n
        else:
            runs.append([spans, n])
    p = runs.pop(0)[1] if runs and not runs[0][0] else 1
    sizes = [n for _, n in runs]  # alternating, starting with a table run
    if len(sizes) > 3:
        return None
    m1, q, m2 = {0: (1, 1, 1), 1: (1, 1, *sizes), 2: (*sizes, 1), 3: tuple(sizes)}[len(sizes)]
    return p, m1, q, m2


def _unsupported_reason(table: torch.Tensor, temb: torch.Tensor) -> str | None:
    if not (isinstance(table, torch.Tensor) and isinstance(temb, torch.Tensor)):
        return "table and temb must be tensors"
    if table.dtype not in SUPPORTED_DTYPES or temb.dtype not in SUPPORTED_DTYPES:
        return f"dtypes (table {table.dtype}, temb {temb.dtype}) not both bf16, fp16 or fp32"
    reason = device_reason(table, temb) or grad_reason(table, temb)
    if reason:
        return reason
    if not temb.is_contiguous():
        return "temb is not contiguous"
    if not table.is_contiguous():
        return "table is not contiguous"
    if _pattern(table, temb) is None:
        return (f"table of shape {tuple(table.shape)} does not broadcast to temb's {tuple(temb.shape)} as "
                "[M1, M2] over [P, M1, Q, M2]")
    return None


def can_use_table_add(table: torch.Tensor, temb: torch.Tensor) -> bool:
    """True when :func:`table_add` reproduces eager for these inputs. Rejected (False):
    non-tensors; a table or temb not bf16 / fp16 / fp32 (fp64 would make eager's sum fp64);
    different devices, or the CPU without TRITON_INTERPRET=1; an input requiring grad with grad
    mode on (no backward); a non-contiguous temb or table; a table whose broadcast against temb
    does not leave temb's shape, or covers temb's dims in more than two groups with broadcast
    dims between (the ``[P, M1, Q, M2]`` layout of the module docstring: Wan's [1, 1, 6, D] over
    [B, S, 6, D] and SkyReels' [1, 6, 1, D] over [B, 6, S, D] are of it)."""
    return _unsupported_reason(table, temb) is None


def _recipe(table: torch.Tensor, temb: torch.Tensor) -> tuple | None:
    """(grid, scalar arguments, constexprs, rows of slack for the int32 check) from the inputs'
    geometry, or None for an empty output (cached per geometry by :func:`table_add`)."""
    if temb.numel() == 0:
        return None
    pattern = _pattern(table, temb)
    assert pattern is not None
    p, m1, q, m2 = pattern
    g, q = (1, p * q) if m1 == 1 else (p * m1, q)
    block_q, block_c, _ = tile(m2, per_program=_PER_PROGRAM)
    block_q = min(block_q, next_pow2(q))  # few rows: no tile rows past the last
    warps = 8 if block_q * block_c >= 2048 else 4
    n_q, n_c = cdiv(q, block_q), cdiv(m2, block_c)
    even = q % block_q == 0 and m2 % block_c == 0
    consts = dict(BLOCK_Q=block_q, BLOCK_C=block_c, EVEN=even, num_warps=warps)
    return (g * n_q * n_c,), (q, m1, m2, n_q, n_c), consts, block_q * m2 + block_c


def _fire(r: tuple | None, table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    out = torch.empty(temb.shape, dtype=torch.float32, device=temb.device)
    if r is None:
        return out
    grid, scalars, consts, pad = r
    # int32 addressing depends on the storages' sizes, which the geometry key does not hold
    i64 = not fits_int32(table, temb, out, rows_pad=pad)
    launch(_table_add_kernel, grid, table, temb, out, *scalars, I64=i64, **consts)
    return out


def _launch(table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    return _fire(_recipe(table, temb), table, temb)


@torch.library.custom_op("ditfuse::table_add", mutates_args=())
def _table_add_op(table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    return _launch(table, temb)


@_table_add_op.register_fake
def _(table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    return temb.new_empty(temb.shape, dtype=torch.float32)


def table_add(table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """``out = f32(table) + f32(temb)``: one fp32 add of exactly converted values, bitwise equal to
    torch 2.11 CUDA eager ``table + temb.float()``.

    table: bf16, fp16 or fp32 (Wan keeps it fp32), contiguous, broadcast over temb as
    ``[M1, M2]`` over ``[P, M1, Q, M2]`` (module docstring); temb: bf16, fp16 or fp32, contiguous. Returns a new contiguous fp32 tensor of
    temb's shape (eager's broadcast shape and layout). Raises :class:`UnsupportedInput` exactly
    where :func:`can_use_table_add` is False. Runs as the custom op ``ditfuse::table_add`` under
    torch.compile.
    """
    return _keyed(None, table, temb)


_RECIPES = Recipes()


def _keyed(key: tuple | None, table: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    if use_custom_op():
        reason = _unsupported_reason(table, temb)
        if reason is not None:
            raise UnsupportedInput(reason)
        return torch.ops.ditfuse.table_add(table, temb)
    if key is None:
        key = call_key((table, temb))
    r = _RECIPES.checked(key, lambda: _unsupported_reason(table, temb), lambda: _recipe(table, temb))
    return _fire(r, table, temb)


# The gate computes the call key once and hands it down (contracts/ops.py GatedOp).
table_add.keyed = _keyed


__all__ = ["table_add", "can_use_table_add"]
