"""Compile the LayerNorm+modulate kernels for sm_90 without a GPU and report code facts.

``python -m tests.layernorm_codegen`` (TRITON_INTERPRET must be unset: the kernels pick their
GPU code paths at import) prints one JSON line per variant: TTGIR layout conversions, the
layout of the ``tt.reduce`` operand (v2's fold), the sequence of shuffle offsets, shared-memory
traffic and barriers, global vector loads/stores, FMAs and ``div.rn`` in the PTX, and registers /
local memory (spills) from the cubin (cuobjdump shipped with Triton). Used by
tests/cpu/test_layernorm_v2_codegen.py and for notes/layernorm.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

_STRIDES = ["xsb", "xss", "xsd", "gsb", "gss", "gsd", "usb", "uss", "usd",
            "scsb", "scss", "scsd", "shsb", "shss", "shsd"]
_PTRS = ["x_ptr", "g_ptr", "u_ptr", "sc_ptr", "sh_ptr", "h_ptr", "out_ptr"]


def _compile(kernel, scalars, constexprs):
    import triton
    import triton.language as tl  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "*bf16" for n in _PTRS}
    sig.update({n: "i32" for n in scalars})
    sig["eps"] = "fp32"
    sig.update({n: "i32" for n in _STRIDES})
    for n in constexprs:
        sig[n] = "constexpr"
    names = kernel.arg_names
    # What a launch with contiguous bf16 [B, S, D] tensors (D % 16 == 0) and per-sample
    # scale/shift specialises: unit inner strides, zero token strides, 16-divisible pointers
    # and outer strides.
    div16 = [n for n in _PTRS + _STRIDES if n not in constexprs]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, enable_fp_fusion=False))


def facts(impl: str, R: int, gated: bool) -> dict:
    import triton
    import triton.language as tl

    from ditfuse.kernels.norm import layernorm_modulate_triton as lnm

    ce = {"DTYPE": tl.bfloat16, "GATED": gated, "xsd": 1, "gsd": 1, "usd": 1, "scsd": 1, "shsd": 1,
          "scss": 0, "shss": 0, "gss": 0}
    if impl == "v1":
        ce.update(MEAN_MODE=0, M2_FMA=True)
        k = _compile(lnm._ln_modulate_kernel, ["S", "N", "NVEC", "J"], ce)
    else:
        ce["R"] = R
        k = _compile(lnm._ln_modulate_kernel_v2, ["M", "S", "N", "NVEC", "J"], ce)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    out = dict(impl=impl, R=R, gated=gated)
    out["convert_layout"] = ttgir.count("ttg.convert_layout")
    m = re.search(r'"tt\.reduce".*?\}\) : \(tensor<[^,]*, #(\w+)>', ttgir, re.S)
    red = None
    if m:
        lay = re.search(r"^#%s = (.*)$" % re.escape(m.group(1)), ttgir, re.M)
        red = lay.group(1) if lay else m.group(1)
    out["reduce_operand_layout"] = red
    out["shfl_offsets"] = [int(o) for o in re.findall(r"shfl\.sync\.\w+\.b32\s+%r\d+, %r\d+, (\d+),", ptx)]
    out["shfl_kinds"] = sorted(set(re.findall(r"shfl\.sync\.(\w+)\.b32", ptx)))
    out["bar_sync"] = len(re.findall(r"\bbar\.sync\b", ptx))
    out["st_shared"] = len(re.findall(r"st\.shared", ptx))
    out["ld_shared"] = len(re.findall(r"ld\.shared", ptx))
    out["ld_global"] = re.findall(r"ld\.global(?:\.\w+)*", ptx)
    out["st_global"] = re.findall(r"st\.global(?:\.\w+)*", ptx)
    out["fma_rn_f32"] = len(re.findall(r"\bfma\.rn\.f32", ptx))
    out["div_rn_f32"] = len(re.findall(r"\bdiv\.rn\.f32", ptx))
    out["rsqrt_approx"] = len(re.findall(r"rsqrt\.approx\.f32", ptx))
    out["shared_bytes"] = k.metadata.shared
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", f.name],
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    r = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res)
    out["regs"] = int(r.group(1)) if r else None
    out["local_bytes"] = int(r.group(2)) if r else None
    out["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M))
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the GPU code paths are chosen at import")
    variants = [("v1", 1, False), ("v1", 1, True)] + [("v2", R, g) for R in (1, 2, 4) for g in (False, True)]
    if len(sys.argv) > 1:
        variants = [v for v in variants if f"{v[0]}-R{v[1]}-{'gated' if v[2] else 'plain'}" in sys.argv[1:]]
    for impl, R, gated in variants:
        print(json.dumps(facts(impl, R, gated)), flush=True)


if __name__ == "__main__":
    main()
