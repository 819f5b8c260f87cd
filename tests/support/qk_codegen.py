"""Compile the QK ops' vector-per-lane kernel for sm_90 without a GPU and report code facts.

``python -m tests.support.qk_codegen [VARIANT ...]`` (TRITON_INTERPRET must be unset) prints one
JSON line per variant: the layout guard's verdict (common/warp.py ``lane_layout_reason``), TTGIR
layout conversions, shared-memory stores and barriers, shuffle offsets, global load/store widths
and registers / local memory. A variant is ``T, R, warps`` plus the op's switches, compiled with
the arguments a launch on contiguous tensors specialises (unit inner strides, 16-divisible
pointers and outer strides). Used by tests/cpu/test_qk_lanes_codegen.py and notes/rope.md.
"""

from __future__ import annotations

import json
import os
import re
import sys

# name: (T, R, warps, switches incl. V); R / warps None: the launcher's tiling (_lane_tiling).
VARIANTS = {
    "flux": (32, None, None, dict()),
    "flux-single": (32, None, None, dict(HAS_TXT=False)),
    "flux-norope": (32, None, None, dict(ROPE=0)),
    "flux-d64": (16, None, None, dict()),
    "flux-d32": (8, None, None, dict()),
    "qwen": (32, None, None, dict(NORM=1, ROPE=2, PACKED=True)),
    "zimage": (32, None, None, dict(NORM=1, ROPE=2, PACKED=True, HAS_TXT=False)),
    "qwen-strided": (32, None, None, dict(NORM=1, ROPE=2)),
    "sd3-d128": (32, None, None, dict(NORM=1, ROPE=0, LAYOUT=1)),
    "hunyuanvideo15": (32, None, None, dict(NORM=1, ROPE=3, LAYOUT=2)),
    "flux-R16-w4": (32, 16, 4, dict(V=2)),
    "flux-R32-w8": (32, 32, 8, dict(V=2)),
    "flux-V1": (32, 8, 4, dict(V=1)),
    "flux-V4": (32, 8, 2, dict(V=4)),
    "qwen-V1": (32, 8, 4, dict(NORM=1, ROPE=2, PACKED=True, V=1)),
    # What the launcher never builds, and the guard must refuse: more warps than rows, which
    # Triton spreads over the lanes of a row (its fold then crosses warps through shared memory).
    "refused-R1-w4": (32, 1, 4, dict(V=1)),
    "refused-R2-w8": (32, 2, 8, dict(V=1)),
    # Heads not a multiple of the program's 8 (Z-Image's 30): masked rows.
    "zimage-oddheads": (32, None, None, dict(NORM=1, ROPE=2, PACKED=True, HAS_TXT=False, EVEN_H=False)),
    "flux-oddheads": (32, None, None, dict(EVEN_H=False)),
}


def compile_variant(T: int, R: int | None, nw: int | None, switches: dict):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as mod

    V = switches.pop("V", None)
    if R is None:
        R, nw, V0 = mod._lane_tiling(T, 24)
        V = V if V is not None else V0
    V = V or 1
    k = mod._qk_lanes_kernel
    names = k.arg_names
    rope = switches.get("ROPE", 1)
    ptrs = ["q_img", "k_img", "q_txt", "k_txt", "wq_img", "wk_img", "wq_txt", "wk_txt", "cos_ptr", "sin_ptr",
            "q_out", "k_out"]
    sig = {n: ("*fp32" if n in ("cos_ptr", "sin_ptr") and rope else "*bf16") for n in ptrs}
    strides = [n for n in names if re.fullmatch(r"(qi|ki|qt|kt)_s[bshd]|[cs]_s[sdb]", n)]
    sig.update({n: "i32" for n in strides + ["n_rows", "S_TXT", "S_TOT", "H"]})
    sig.update({n: "fp32" for n in ("eps", "fac_img", "fac_txt")})
    ce = dict(D=4 * T, T=T, R=R, HAS_TXT=True, ROPE=rope, HAS_WQI=True, HAS_WKI=True, HAS_WQT=True,
              HAS_WKT=True, DTYPE=tl.bfloat16, EXACT=True, NORM=0, CMUL=1 if rope == 2 else 0, LAYOUT=0,
              PACKED=False, V=V)
    ce.update(switches)
    # Unit strides are specialised by the launch; complex tables have a pair stride of 2.
    for n in strides:
        if n.endswith("_sd") and not (n in ("c_sd", "s_sd") and rope == 2):
            ce[n] = 1
    for n in ce:
        sig[n] = "constexpr"
    div16 = [n for n in ptrs + strides if n not in ce and n not in ("c_sd", "s_sd")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=k, signature=sig, attrs=attrs, constexprs={(names.index(a),): v for a, v in ce.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=nw, enable_fp_fusion=False)), R, nw, V


def facts(name: str) -> dict:
    from tests.support.layernorm_codegen import cubin_facts

    from ditfuse.kernels.common.warp import lane_layout_reason

    T, R, nw, switches = VARIANTS[name]
    k, R, nw, V = compile_variant(T, R, nw, dict(switches))
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    out = dict(name=name, T=T, R=R, warps=nw, **{k_: (v if not hasattr(v, "name") else str(v))
                                                   for k_, v in switches.items()})
    out["V"] = V
    out["guard"] = lane_layout_reason(ttgir, T // V)
    out["convert_layout"] = ttgir.count("ttg.convert_layout")
    out["shfl_offsets"] = [int(o) for o in re.findall(r"shfl\.sync\.\w+\.b32\s+%r\d+, %r\d+, (\d+),", ptx)]
    out["shfl_kinds"] = sorted(set(re.findall(r"shfl\.sync\.(\w+)\.b32", ptx)))
    out["st_shared"] = len(re.findall(r"st\.shared", ptx))
    out["bar_sync"] = len(re.findall(r"\bbar\.sync\b", ptx))
    out["ld_global"] = sorted(set(re.findall(r"ld\.global(?:\.\w+)*", ptx)))
    out["st_global"] = sorted(set(re.findall(r"st\.global(?:\.\w+)*", ptx)))
    out["rsqrt_approx"] = len(re.findall(r"rsqrt\.approx\.f32", ptx))
    out["shared_bytes"] = k.metadata.shared
    out["regs"], out["local_bytes"], lines = cubin_facts(k)
    out["sass_instructions"] = len(lines)
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the GPU code paths are chosen at import")
    for name in (sys.argv[1:] or list(VARIANTS)):
        print(json.dumps(facts(name)), flush=True)


if __name__ == "__main__":
    main()
