"""Warp shuffles for the warp-per-row norm kernels, on the GPU and under the interpreter.

A warp-per-row kernel lays a row's state out as [R, 32] tensors: row r in warp r, one element per
lane (the layout Triton's coalescing pass gives [R, 32, 4] tiles when a program has R warps).
:func:`shfl_bfly` and :func:`lane0_broadcast` are CUDA's ``__shfl_xor_sync`` and
``__shfl_sync(.., 0)`` on that layout, as inline PTX (``shfl.sync.*.b32`` on each element, which
is one register per thread). Under ``TRITON_INTERPRET=1`` inline PTX does not run; the same data
movement is spelled with reshapes, so the CPU tests check the kernels' arithmetic and order.
tests/cpu/test_layernorm_codegen.py checks on the sm_90 code that the shuffles are what reach
the GPU (offsets, no shared memory).
"""

import logging
import re

import triton
import triton.language as tl

from .rounding import INTERPRET

log = logging.getLogger("ditfuse.kernels")


@triton.jit
def _swap_halves(x, O: tl.constexpr, R: tl.constexpr):
    """Interpreter: [R, 32] -> lane ``i`` gets lane ``i ^ O``'s value."""
    y = tl.reshape(x, [R, 32 // (2 * O), 2, O])
    y = tl.permute(y, (0, 1, 3, 2))
    lo, hi = tl.split(y)
    y = tl.join(hi, lo)
    y = tl.permute(y, (0, 1, 3, 2))
    return tl.reshape(y, [R, 32])


@triton.jit
def shfl_bfly(x, O: tl.constexpr, R: tl.constexpr):
    """``__shfl_xor_sync(~0, x, O)`` on a [R, 32] fp32 tensor laid out one element per lane (row r
    in warp r): lane ``i`` receives lane ``i ^ O``'s value of the same row."""
    if INTERPRET:
        return _swap_halves(x, O, R)
    else:
        if O == 16:
            return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 16, 0x1f, -1;", "=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=1)
        elif O == 8:
            return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 8, 0x1f, -1;", "=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=1)
        elif O == 4:
            return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 4, 0x1f, -1;", "=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=1)
        elif O == 2:
            return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 2, 0x1f, -1;", "=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("shfl.sync.bfly.b32 $0, $1, 1, 0x1f, -1;", "=r,r", [x],
                                             dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def lane0_broadcast(x, R: tl.constexpr):
    """``__shfl_sync(~0, x, 0)`` on a [R, 32] tensor: every lane gets lane 0's value of its row."""
    if INTERPRET:
        y = x
        for _ in tl.static_range(5):  # keep even lanes five times: lane 0 is what is left
            y, _odd = tl.split(tl.reshape(y, [R, y.shape[1] // 2, 2]))
        return tl.broadcast_to(y, [R, 32])
    else:
        return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, -1;", "=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)




@triton.jit
def warp_rows(M, S, N, R: tl.constexpr):
    """A warp-per-row program's rows: (row_ok, b, s, out_row) as [R] tensors. Rows past M are
    clamped to row 0 (they read valid memory; their stores are masked with row_ok); b and s are
    the row's sample and token of a [B, S, *] input; out_row = row * N is the start of its row in
    a contiguous output (N % 4 == 0: vector stores)."""
    rows = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R).to(tl.int64)
    row_ok = rows < M
    rows = tl.where(row_ok, rows, 0)
    b = rows // S
    s = rows % S
    return row_ok, b, s, tl.multiple_of(rows * N, 4)


# ----------------------------------------------------------------------------- host-side guard
#
# The shuffles above are only what CUDA's are if Triton laid the [R, 32] operand out as assumed:
# lane i holds element [r, i], one element per thread, nothing across warps. Triton picks layouts
# itself (with R > 1 rows per program it split the lanes over rows: threadsPerWarp [4, 8]), so
# the warp-per-row kernels run one row per one-warp program, and every compiled binary is checked
# once, on its TTGIR, before its result is used (:func:`warp_layout_ok`).


def _parse_list(body: str, key: str) -> list[int] | None:
    m = re.search(key + r" = \[([^\]]*)\]", body)
    return [int(v) for v in m.group(1).split(",")] if m else None


def _unwrap_slices(layout: str, aliases: dict[str, str]) -> tuple[str, list[int]]:
    """(the layout under any ``ttg.slice`` wrappers, aliases resolved; the sliced dims, outermost
    first)."""
    sliced: list[int] = []
    while True:
        m = re.fullmatch(r"#?ttg\.slice<\{dim = (\d+), parent = (.+)\}>", layout)
        if m:
            sliced.append(int(m.group(1)))
            layout = m.group(2)
            continue
        if layout.startswith("#") and layout[1:] in aliases:
            layout = aliases[layout[1:]]
            continue
        return layout, sliced


def _layout_reason(layout: str, aliases: dict[str, str]) -> str | None:
    """Why ``layout`` (of a [1, 32] tensor) is not lane i -> element [0, i], one per thread."""
    layout, sliced = _unwrap_slices(layout, aliases)
    if layout.startswith("#ttg.blocked"):
        spt, tpw, wpc = (_parse_list(layout, k) for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
        if spt is None or tpw is None or wpc is None or len(tpw) < 2:
            return f"unparsed blocked layout {layout}"
        if any(w != 1 for w in wpc):
            return f"warps split the row: {layout}"
        if tpw[1] != 32 or spt[0] != 1 or spt[1] != 1:
            return f"lanes not along the lane axis: {layout}"
        return None
    if layout.startswith("#ttg.linear") and not sliced:
        lane = re.search(r"lane = \[(.*?)\], warp", layout)
        warp = re.search(r"warp = \[(.*?)\], block", layout)
        reg = re.search(r"register = \[(.*?)\], lane", layout)
        want = ", ".join(f"[0, {1 << i}]" for i in range(5))
        if lane is None or lane.group(1) != want:
            return f"lanes not along the lane axis: {layout}"
        if (warp and warp.group(1).strip()) or (reg and reg.group(1).strip()):
            return f"more than one element per thread or several warps: {layout}"
        return None
    return f"unrecognised layout {layout}"


def warp_layout_reason(ttgir: str) -> str | None:
    """Why a compiled warp-per-row kernel's shuffles would not be CUDA's (None when they are):
    every ``shfl.sync`` inline-asm operand must be a [1, 32] tensor with lane i holding element
    [0, i], one element per thread, a single warp."""
    aliases = dict(re.findall(r"^#(\w+) = (#ttg\.\w+<\{.*\}>)\s*$", ttgir, re.M))
    ops = re.findall(r'elementwise_inline_asm "shfl\.sync[^"]*".*? : tensor<(\d+)x32xf32, (.+?)> -> tensor<', ttgir)
    if not ops:
        return "no shuffles found in the TTGIR"
    for rows, layout in ops:
        reason = _layout_reason(layout, aliases)
        if reason:
            return reason
        if rows != "1":
            return f"a shuffle operand holds {rows} rows"
    return None


_VERDICTS: dict[str, str | None] = {}


def warp_layout_ok(compiled: object, what: str) -> bool:
    """Whether the compiled warp-per-row kernel ``compiled`` (what a launch returns) may be used;
    checked once per binary, a refusal logged once. No binary (the interpreter): True."""
    if compiled is None:
        return True
    key = getattr(compiled, "hash", None) or str(id(compiled))
    verdict = _VERDICTS.get(key, False)  # per launch: one dict lookup once the binary is judged
    if verdict is False:
        asm = getattr(compiled, "asm", None)
        if not asm or "ttgir" not in asm:
            return True
        verdict = _VERDICTS[key] = warp_layout_reason(asm["ttgir"])
        if verdict:
            log.warning("%s: warp-per-row kernel refused (%s); the 128-thread kernel runs instead", what, verdict)
    return verdict is None


# ----------------------------------------------------------------- the vector-per-lane kernels
#
# rope.qk_rmsnorm_rope's lane kernel folds a row's per-lane sums with ``tl.sum`` over the lane
# axis of a [T, R] operand (common/rms.py ``rms_fold_lanes``). That is torch's tree only if the
# operand has T lanes along that axis, one element per lane, no warp split and no replication.


def _balanced(text: str, start: int) -> str:
    """``text[start:]`` up to the ``>`` closing the first ``<`` (layouts nest: slices of slices)."""
    depth = 0
    for k in range(start, len(text)):
        if text[k] == "<":
            depth += 1
        elif text[k] == ">":
            depth -= 1
            if depth == 0:
                return text[start:k + 1]
    return text[start:]


def _reduce_operands(ttgir: str) -> list[tuple[str, int, str]]:
    """(shape, axis, layout) of every ``tt.reduce``'s operand in a TTGIR dump (layout as written:
    an alias such as ``#blocked2`` or an inline attribute)."""
    out = []
    for m in re.finditer(r'"tt\.reduce"\(.*?\) <\{axis = (\d+) : i32\}>.*?\}\) : \(tensor<', ttgir, re.S):
        ty = _balanced(ttgir, m.end() - len("tensor<"))  # tensor<8x32xf32, #layout>
        mm = re.fullmatch(r"tensor<([0-9x]+)x\w+, (.*)>", ty, re.S)
        if mm:
            out.append((mm.group(1), int(m.group(1)), mm.group(2).strip()))
    return out


def _lane_axis_reason(layout: str, aliases: dict[str, str], P: int) -> str | None:
    """Why axis 0 of a [P, R] operand laid out as ``layout`` is not P lanes of one warp with one
    element per thread (None when it is). Blocked layouts, slices of blocked layouts (the
    operand's axes are the parent's minus the sliced ones) and linear layouts are understood."""
    layout, sliced = _unwrap_slices(layout, aliases)
    if layout.startswith("#ttg.blocked"):
        spt, tpw, wpc = (_parse_list(layout, k) for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
        if spt is None or tpw is None or wpc is None:
            return f"unparsed blocked layout {layout}"
        # Slices are listed outermost first; undo them innermost first to find the parent axes.
        axes = list(range(len(tpw)))
        for d in reversed(sliced):
            del axes[d]
        if len(axes) != 2:
            return f"the fold's operand is not 2-D in {layout}"
        a = axes[0]
        if tpw[a] != P or spt[a] != 1 or wpc[a] != 1:
            return f"the lane axis is not {P} lanes, one element each, in one warp: {layout}"
        return None
    if layout.startswith("#ttg.linear") and not sliced:
        bases = {}
        for key in ("register", "lane", "warp", "block"):
            m = re.search(key + r" = \[(.*?)\](?:, \w+ = |\}>)", layout)
            if m is None:
                return f"unparsed linear layout {layout}"
            bases[key] = [tuple(int(x) for x in b.split(",")) for b in re.findall(r"\[(-?\d+, -?\d+)\]", m.group(1))]
        k = P.bit_length() - 1
        want = [(1 << i, 0) for i in range(k)]
        if bases["lane"][:k] != want:
            return f"lanes 0..{P - 1} are not axis 0 in order: {layout}"
        rest = bases["lane"][k:] + bases["warp"] + bases["register"] + bases["block"]
        if any(b[0] != 0 for b in rest):
            return f"axis 0 spans more than {P} lanes (registers, warps or more lanes): {layout}"
        return None
    return f"unrecognised layout {layout}"


def lane_layout_reason(ttgir: str, T: int) -> str | None:
    """Why a lane kernel's fold would not be torch's lane tree (None when it is): every
    ``tt.reduce`` must reduce axis 0 of a 2-D [T, R] operand laid out as T lanes of one warp
    along that axis, one element per thread (``T``: threads per row, torch's lanes over the
    virtual lanes each thread holds)."""
    aliases = dict(re.findall(r"^#(\w+) = (#ttg\.\w+<\{.*\}>)\s*$", ttgir, re.M))
    ops = _reduce_operands(ttgir)
    if not ops:
        return "no tt.reduce found in the TTGIR"
    for shape, axis, lay in ops:
        dims = [int(d) for d in shape.split("x")]
        if len(dims) != 2 or axis != 0 or dims[0] != T:
            return f"unexpected reduction: tensor<{shape}> over axis {axis}"
        reason = _lane_axis_reason(lay, aliases, T)
        if reason:
            return reason
    return None


_LANE_VERDICTS: dict[str, str | None] = {}


def lane_layout_ok(compiled: object, T: int, what: str = "rope.qk_rmsnorm_rope") -> bool:
    """Whether the compiled lane kernel ``compiled`` (what a launch returns) may be used; judged
    once per binary, a refusal logged once. No binary (the interpreter): True."""
    if compiled is None:
        return True
    key = getattr(compiled, "hash", None) or str(id(compiled))
    verdict = _LANE_VERDICTS.get(key, False)
    if verdict is False:
        asm = getattr(compiled, "asm", None)
        if not asm or "ttgir" not in asm:
            return True
        verdict = _LANE_VERDICTS[key] = lane_layout_reason(asm["ttgir"], T)
        if verdict:
            log.warning("%s: vector-per-lane kernel refused (%s); the tile kernel runs instead", what, verdict)
    return verdict is None
