"""Compile the row-norm kernels (LayerNorm+modulate, Wan's RMSNorm+RoPE) for sm_90 without a GPU
and report code facts.

``python -m tests.support.layernorm_codegen [VARIANT ...]`` (TRITON_INTERPRET must be unset: the
kernels pick their GPU code paths at import) prints one JSON line per variant: TTGIR layout
conversions, the layout of the ``tt.reduce`` operand (the fold whose bitwise argument needs one
element per thread), the sequence of shuffle offsets, shared-memory traffic and barriers, global
vector loads/stores, FMAs and ``div.rn`` in the PTX, and registers / local memory (spills) from
the cubin (cuobjdump shipped with Triton). Used by tests/cpu/test_layernorm_codegen.py and for
notes/layernorm.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

_LN_STRIDES = ["xsb", "xss", "xsd", "gsb", "gss", "gsd", "usb", "uss", "usd", "wsd", "bsd",
               "scsb", "scss", "scsd", "shsb", "shss", "shsd"]
_LN_PTRS = ["x_ptr", "g_ptr", "u_ptr", "w_ptr", "bias_ptr", "sc_ptr", "sh_ptr", "h_ptr", "out_ptr"]
_RMS_STRIDES = ["xsb", "xss", "xsd", "wsd", "css", "csd", "sss", "ssd"]
_RMS_PTRS = ["x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "out_ptr"]


def _compile(kernel, scalars, constexprs, ptrs, strides, fp32_ptrs=(), num_warps=4):
    import triton
    import triton.language as tl  # noqa: F401
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: ("*fp32" if n in fp32_ptrs else "*bf16") for n in ptrs}
    sig.update({n: "i32" for n in scalars})
    sig["eps"] = "fp32"
    sig.update({n: "i32" for n in strides})
    for n in constexprs:
        sig[n] = "constexpr"
    names = kernel.arg_names
    # What a launch with contiguous bf16 [B, S, D] tensors (D % 16 == 0) and per-sample
    # scale/shift specialises: unit inner strides, zero token strides, 16-divisible pointers
    # and outer strides.
    div16 = [n for n in ptrs + strides if n not in constexprs]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=False))


def cubin_facts(k) -> tuple[int | None, int | None, list[str]]:
    """(registers, local memory bytes, SASS instruction lines) of a compiled kernel, read with
    the cuobjdump / nvdisasm shipped with Triton."""
    import triton

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
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    return (int(r.group(1)) if r else None), (int(r.group(2)) if r else None), lines


def facts(kind: str, R: int, gated: bool, js: int = 0) -> dict:
    """kind ``ln``: the LayerNorm kernel in FLUX's all-bf16 configuration (gated: the residual
    variant, per-sample gate/scale/shift); ``lnwarp``: the warp-per-row LayerNorm kernel in the same
    configuration, R warps = R rows per program (the GPU launches R = 1), ``js`` steps;
    ``lnpf``: ``ln`` with the runtime loop's prefetch (``PREFETCH``);
    ``wanropewarp``: the warp-per-row RMSNorm + RoPE kernel likewise; ``wanrope``: Wan's RMSNorm + RoPE kernel with fp32
    freqs (fp32 operands in the ``ln`` case too for ``js`` = 3 would change nothing the checks
    look at). ``js`` > 0: the held-row kernel for rows of ``js`` vectors per thread (FLUX's width
    3072: 6, Wan-1.3B's 1536: 3), loads unpredicated; 0: the runtime loop."""
    import triton.language as tl

    scalars = ["M", "S", "N", "NVEC", "J"]
    if kind in ("lnwarp", "lnwarpwan"):
        from ditfuse.kernels.norm import layernorm_modulate_triton as lnm

        bf, f32 = tl.bfloat16, tl.float32
        # lnwarpwan: Wan's chain (FP32LayerNorm of x.float(), fp32 [B, 1, D] scale / shift, fp32
        # products and sums, one rounding to bf16)
        m = f32 if kind == "lnwarpwan" else bf
        ce = {"RES": 2 if gated else 0, "HAS_W": False, "HAS_B": False, "MODULATE": True, "EXACT": True,
              "P_DT": m, "H_DT": bf, "LN_DT": m, "SC_DT": m, "M_DT": m, "S_DT": m, "OUT_DT": bf, "R": R,
              "AFFINE_FMA": True, "JS": js, "xsd": 1, "gsd": 1, "usd": 1, "scsd": 1, "shsd": 1, "scss": 0,
              "shss": 0, "gss": 0, "wsd": 0, "bsd": 0}
        k = _compile(lnm._ln_warp_kernel, ["M", "S", "N"], ce, _LN_PTRS, _LN_STRIDES, num_warps=R,
                     fp32_ptrs=("sc_ptr", "sh_ptr") if kind == "lnwarpwan" else ())
    elif kind in ("ln", "lnpf"):
        from ditfuse.kernels.norm import layernorm_modulate_triton as lnm

        bf = tl.bfloat16
        ce = {"RES": 2 if gated else 0, "HAS_W": False, "HAS_B": False, "MODULATE": True, "EXACT": True,
              "P_DT": bf, "H_DT": bf, "LN_DT": bf, "SC_DT": bf, "M_DT": bf, "S_DT": bf, "OUT_DT": bf, "R": R,
              "AFFINE_FMA": True, "JS": js, "FULL": js > 0, "xsd": 1, "gsd": 1, "usd": 1, "scsd": 1, "shsd": 1, "scss": 0, "shss": 0,
              "gss": 0, "wsd": 0, "bsd": 0, "PREFETCH": kind == "lnpf"}
        k = _compile(lnm._ln_kernel, scalars, ce, _LN_PTRS, _LN_STRIDES)
    elif kind in ("wanropewarp", "wanropepair"):
        from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

        ce = {"DH": 128, "HAS_W": True, "HAS_ROPE": True, "EXACT": True, "DTYPE": tl.bfloat16,
              "P_DT": tl.float32, "R": R, "JS": js, "xsd": 1, "wsd": 1, "csd": 1, "ssd": 1}
        ptrs, strides = _RMS_PTRS, _RMS_STRIDES
        if kind == "wanropepair":  # q and k in one launch
            ce.update({"PAIR": True, "HAS_W2": True, "x2sd": 1, "w2sd": 1})
            ptrs, strides = ptrs + ["x2_ptr", "w2_ptr", "out2_ptr"], strides + ["x2sb", "x2ss"]
        k = _compile(wr._rms_rope_warp_kernel, ["M", "S", "N"], ce, ptrs, strides,
                     fp32_ptrs=("cos_ptr", "sin_ptr"), num_warps=R)
    else:
        from ditfuse.kernels.rope import qk_rmsnorm_across_heads_rope_triton as wr

        ce = {"DH": 128, "HAS_W": True, "HAS_ROPE": True, "EXACT": True, "DTYPE": tl.bfloat16,
              "P_DT": tl.float32, "R": R, "JS": js, "FULL": js > 0, "xsd": 1, "wsd": 1, "csd": 1, "ssd": 1}
        k = _compile(wr._rms_rope_kernel, scalars, ce, _RMS_PTRS, _RMS_STRIDES, fp32_ptrs=("cos_ptr", "sin_ptr"))
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    out = dict(kind=kind, R=R, gated=gated, js=js)
    if kind.endswith("warp") or kind in ("wanropepair", "lnwarpwan"):
        from ditfuse.kernels.common.warp import warp_layout_reason

        out["warp_layout_reason"] = warp_layout_reason(ttgir)
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
    out["regs"], out["local_bytes"], lines = cubin_facts(k)
    out["sass_instructions"] = len(lines)
    # Where the first pass's loads sit: how many global loads are issued before the first FP
    # arithmetic that consumes data (FFMA in the Welford / sum-of-squares chain).
    first = next((i for i, ln in enumerate(lines) if "FFMA" in ln), len(lines))
    out["ldg_before_first_ffma"] = sum(1 for ln in lines[:first] if "LDG" in ln)
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the GPU code paths are chosen at import")
    variants = ([(kind, R, g, 0) for kind in ("ln", "lnpf") for R in (1, 2, 4) for g in (False, True)]
                + [("ln", R, g, js) for js in (3, 6) for R in (1, 2) for g in (False, True)]
                + [("wanrope", R, False, js) for R in (1, 2, 4) for js in (0, 3)]
                + [("lnwarp", R, g, js) for js in (3, 6) for R in (1, 4) for g in (False, True)]
                + [("lnwarp", 1, False, 10), ("lnwarpwan", 1, False, 10)]  # LN_WARP_MAX_STEPS (D = 5120)
                + [("wanropewarp", R, False, 3) for R in (1, 4)]
                + [("wanropepair", 1, False, 3)])
    # (lnwarp / wanropewarp with R > 1 are what the launchers refuse: kept for the guard's test)

    def name(v):
        return f"{v[0]}-R{v[1]}-{'gated' if v[2] else 'plain'}" + (f"-held{v[3]}" if v[3] else "")
    if len(sys.argv) > 1:
        variants = [v for v in variants if name(v) in sys.argv[1:]]
    for kind, R, gated, js in variants:
        print(json.dumps(facts(kind, R, gated, js)), flush=True)


if __name__ == "__main__":
    main()
