"""Compile the GEMM-GELU kernel (kernels/linear/linear_gelu_triton.py) for sm_90 without a GPU
and report code facts: the MMA instruction it lowers to, the load path, registers, spills,
shared memory.

``python -m tests.support.linear_gelu_codegen`` (TRITON_INTERPRET must be unset: the kernel picks
its GPU code paths at import) prints one JSON line per variant. Used by
tests/cpu/test_linear_gelu.py: the kernel compiles for the GPU at its production tile (the
interpreter accepts code the GPU compiler rejects, e.g. a non-constexpr global), and its K loop is
a chain of ``wgmma ... k16`` MMAs into one fp32 accumulator, the structure its equality with
cuBLAS rests on.
"""

from __future__ import annotations

import json
import re

from tests.support.layernorm_codegen import cubin_facts


def facts(gelu: bool = True, bias: bool = True, i64: bool = False) -> dict:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ditfuse.kernels.linear import linear_gelu_triton as lg

    k = lg._linear_gelu_kernel
    names = k.arg_names
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "sxm": "i32", "swn": "i32", "som": "i32"}
    cons = dict(K=3072, HAS_BIAS=bias, GELU=gelu, EXACT=True, DTYPE=tl.bfloat16, BM=lg._BM, BN=lg._BN, BK=lg._BK,
                GROUP_M=lg._GROUP_M, I64=i64)
    for n in cons:
        sig[n] = "constexpr"
    # what a launch on contiguous FLUX.1 tensors specialises: 16-divisible pointers and strides
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "sxm", "swn", "som", "N")}
    src = ASTSource(fn=k, signature=sig, attrs=attrs, constexprs={(names.index(a),): v for a, v in cons.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=lg._WARPS, num_stages=lg._STAGES, enable_fp_fusion=False,
                                    enable_reflect_ftz=False))
    ptx = c.asm["ptx"]
    regs, lmem, _ = cubin_facts(c)
    return dict(
        gelu=gelu, bias=bias, i64=i64,
        mma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)) |
                   set(re.findall(r"\bmma\.sync\.aligned\.(\S+)", ptx))),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)", ptx)),
        fma_rn=len(re.findall(r"fma\.rn\.f32", ptx)),
        registers=regs, local_bytes=lmem, shared=c.metadata.shared,
    )


def tma_facts(exact: bool = True, gelu: bool = True) -> dict:
    """The persistent TMA kernel at its production tile (``exact=False``: the close epilogue)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ditfuse.kernels.activation.gelu_tanh_triton import TANH_APPROX, TANH_PTX
    from ditfuse.kernels.linear import linear_gelu_triton as lg

    k = lg._linear_gelu_tma_kernel
    names = k.arg_names
    bm, bn, bk, group_m, stages, warps = lg._TMA_TILE
    sig = {"a_desc": f"tensordesc<bf16[{bm}, {bk}]>", "b_desc": f"tensordesc<bf16[{bn}, {bk}]>", "b_ptr": "*bf16",
           "c_desc": f"tensordesc<bf16[{bm}, {bn}]>", "M": "i32", "N": "i32"}
    cons = dict(K=3072, HAS_BIAS=True, GELU=gelu, EXACT=exact, DTYPE=tl.bfloat16,
                TANH=TANH_PTX if exact else TANH_APPROX, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, PROGRAMS=132)
    for n in cons:
        sig[n] = "constexpr"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("b_ptr", "N")}
    src = ASTSource(fn=k, signature=sig, attrs=attrs, constexprs={(names.index(a),): v for a, v in cons.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False,
                                    enable_reflect_ftz=False))
    ptx = c.asm["ptx"]
    regs, lmem, _ = cubin_facts(c)
    return dict(
        kernel="tma", exact=exact, gelu=gelu, bias=True, i64=False,
        mma=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        tanh_approx=len(re.findall(r"tanh\.approx\.f32", ptx)),
        fma_rn=len(re.findall(r"fma\.rn\.f32", ptx)),
        registers=regs, local_bytes=lmem, shared=c.metadata.shared,
    )


def main() -> None:
    for kw in (dict(), dict(gelu=False), dict(bias=False), dict(i64=True)):
        print(json.dumps(dict(kernel="plain", **facts(**kw))), flush=True)
    for kw in (dict(), dict(exact=False)):
        print(json.dumps(tma_facts(**kw)), flush=True)


if __name__ == "__main__":
    main()
