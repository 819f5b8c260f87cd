"""Probe (issue 9: "never slower than torch.compile's version of the same chain"): the Wan FF
gated residual ``(x.float() + ff.float() * gate).type_as(x)`` measured 98.6 % of copy bandwidth
against torch.compile's 101.7 % (round 9, kernels_round9_h200.csv). Inductor writes this chain
as one flat 1-D kernel (``xindex`` over all elements, the gate at ``xindex % D``, no mask when the
size divides the block, the broadcast gate loaded ``evict_last``); ours tiles [rows, cols] with a
row division and a mask per element. This probe times both shapes of kernel, same arithmetic
(the product rounded to promote(gate, update), the sum in fp32, one store), every variant checked
bitwise against eager first. ms: do_bench_cudagraph median.

    PYTHONPATH=. python3 bench/probes/probe_gate_residual_flat.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing

from ditfuse.kernels import reference as ref
from ditfuse.kernels.common import elementwise as ew
from ditfuse.kernels.common.elementwise import load_f32
from ditfuse.kernels.common.host import promote, tl_dtype
from ditfuse.kernels.common.rounding import round_to, rround
from ditfuse.kernels.compare import compare_outputs
from ditfuse.kernels.modulate import gate_residual_triton as grt


@triton.jit
def _flat_kernel(res_ptr, gate_ptr, upd_ptr, out_ptr, N, D, SD, sgb, sgd,
                 DTYPE: tl.constexpr, P_DT: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                 EVICT: tl.constexpr):
    # contiguous residual / update / out; gate [B, D] (strides sgb, sgd) broadcast over tokens;
    # D and SD runtime integers: a division per element
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _flat_body(res_ptr, gate_ptr, upd_ptr, out_ptr, offs, N, (offs // SD) * sgb + (offs % D) * sgd,
               DTYPE, P_DT, EVEN, EVICT)


@triton.jit
def _flat_const_kernel(res_ptr, gate_ptr, upd_ptr, out_ptr, N, sgb, sgd, D: tl.constexpr, SD: tl.constexpr,
                       DTYPE: tl.constexpr, P_DT: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                       EVICT: tl.constexpr):
    # as _flat_kernel with D and S * D compile-time constants (what inductor does for static
    # shapes): the divisions become multiply-shifts; one compile per (D, S)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _flat_body(res_ptr, gate_ptr, upd_ptr, out_ptr, offs, N, (offs // SD) * sgb + (offs % D) * sgd,
               DTYPE, P_DT, EVEN, EVICT)


@triton.jit
def _flat_sample_kernel(res_ptr, gate_ptr, upd_ptr, out_ptr, SD, sgb, sgd, D: tl.constexpr,
                        DTYPE: tl.constexpr, P_DT: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr,
                        EVICT: tl.constexpr):
    # grid (blocks per sample, B): the sample is the program's, so only D is a constant (one
    # compile per model width, not per token count) and the gate offset is (offs % D) * sgd
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    base = b * SD
    _flat_body(res_ptr + base, gate_ptr + b * sgb, upd_ptr + base, out_ptr + base, offs, SD, (offs % D) * sgd,
               DTYPE, P_DT, EVEN, EVICT)


@triton.jit
def _flat_body(res_ptr, gate_ptr, upd_ptr, out_ptr, offs, N, gate_off, DTYPE: tl.constexpr, P_DT: tl.constexpr,
               EVEN: tl.constexpr, EVICT: tl.constexpr):
    if EVEN:
        mask = None
    else:
        mask = offs < N
    if EVICT:
        if EVEN:
            res = tl.load(res_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            u = tl.load(upd_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(gate_ptr + gate_off, eviction_policy="evict_last").to(tl.float32)
        else:
            res = tl.load(res_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            u = tl.load(upd_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            g = tl.load(gate_ptr + gate_off, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        res = load_f32(res_ptr + offs, mask)
        u = load_f32(upd_ptr + offs, mask)
        g = load_f32(gate_ptr + gate_off, mask)
    out = round_to(res + rround(g * u, P_DT), DTYPE)
    if EVEN:
        tl.store(out_ptr + offs, out)
    else:
        tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _tiled_colfirst_kernel(res_ptr, gate_ptr, upd_ptr, out_ptr, R, S, D, srb, srs, srd, sgb, sgs, sgd,
                           sub, sus, sud, sob, sos, DTYPE: tl.constexpr, P_DT: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # today's tiled kernel with the grid's axes swapped: neighbouring programs take neighbouring
    # column blocks of the same rows, so the grid sweeps memory in address order
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    b = (rows // S)[:, None]
    s = (rows % S)[:, None]
    c = cols[None, :]
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    res = load_f32(res_ptr + (b * srb + s * srs) + c * srd, mask)
    g = load_f32(gate_ptr + (b * sgb + s * sgs) + c * sgd, mask)
    u = load_f32(upd_ptr + (b * sub + s * sus) + c * sud, mask)
    out = round_to(res + rround(g * u, P_DT), DTYPE)
    tl.store(out_ptr + (b * sob + s * sos) + c, out, mask=mask)


def main() -> None:
    n = 1 << 29
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    copy_gbs = 4 * n / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3) / 1e9
    src = dst = None
    print(f"copy {copy_gbs:.1f} GB/s on {torch.cuda.get_device_name()}")
    cases = [((1, 32760, 1536), (1, 1, 1536), torch.float32), ((2, 32760, 1536), (2, 1, 1536), torch.float32),
             ((1, 4608, 3072), (1, 3072), torch.bfloat16), ((2, 32760, 5120), (2, 5120), torch.bfloat16)]
    table = []
    for shape, gshape, gdt in cases:
        x = torch.randn(shape, device="cuda").to(torch.bfloat16)
        u = torch.randn(shape, device="cuda").to(torch.bfloat16)
        g = torch.randn(gshape, device="cuda").to(gdt)
        expected = ref.gate_residual(x, g, u)
        nbytes = 3 * x.numel() * x.element_size()
        label = "x".join(map(str, shape))
        B, S, D = shape
        N = B * S * D
        sg = ew.broadcast_3d(g, shape)
        consts = dict(DTYPE=tl_dtype(x.dtype), P_DT=tl_dtype(promote(g.dtype, u.dtype)), enable_fp_fusion=False)
        variants = {}

        def tiled(per_program=2048):
            out = torch.empty_like(x)
            br, bd, w = ew.tile(D, per_program=per_program)
            grt._gate_residual_kernel[(triton.cdiv(B * S, br), triton.cdiv(D, bd))](
                x, g, u, out, out, B * S, S, D, *x.stride(), *sg, *u.stride(), out.stride(0), out.stride(1), 0,
                BLOCK_R=br, BLOCK_D=bd, num_warps=w, I64=False, **consts)
            return out
        variants["tiled 2048 (today)"] = tiled

        def colfirst(per_program=2048):
            out = torch.empty_like(x)
            br, bd, w = ew.tile(D, per_program=per_program)
            _tiled_colfirst_kernel[(triton.cdiv(D, bd), triton.cdiv(B * S, br))](
                x, g, u, out, B * S, S, D, *x.stride(), *sg, *u.stride(), out.stride(0), out.stride(1),
                BLOCK_R=br, BLOCK_D=bd, num_warps=w, **consts)
            return out
        variants["tiled 2048 col-first grid"] = colfirst
        for block, warps in ((1024, 4), (2048, 8)):
            for evict in (False, True):
                def per_sample(block=block, warps=warps, evict=evict):
                    out = torch.empty_like(x)
                    _flat_sample_kernel[(triton.cdiv(S * D, block), B)](
                        x, g, u, out, S * D, sg[0], sg[2], D=D, BLOCK=block, EVEN=(S * D) % block == 0,
                        EVICT=evict, num_warps=warps, **consts)
                    return out
                variants[f"flat per-sample {block} {warps}w{' evict' if evict else ''}"] = per_sample
        for const in (False, True):
            for block, warps in ((512, 8), (1024, 4), (1024, 8), (2048, 8)):
                for evict in (False, True):
                    if evict and (block, warps) != (1024, 4):
                        continue
                    def flat(block=block, warps=warps, evict=evict, const=const):
                        out = torch.empty_like(x)
                        kw = dict(BLOCK=block, EVEN=N % block == 0, EVICT=evict, num_warps=warps, **consts)
                        if const:
                            _flat_const_kernel[(triton.cdiv(N, block),)](x, g, u, out, N, sg[0], sg[2], D=D,
                                                                         SD=S * D, **kw)
                        else:
                            _flat_kernel[(triton.cdiv(N, block),)](x, g, u, out, N, D, S * D, sg[0], sg[2], **kw)
                        return out
                    variants[f"flat{' const' if const else ''} {block} {warps}w{' evict' if evict else ''}"] = flat
        variants["compile"] = torch.compile(ref.gate_residual, dynamic=False)
        for name, fn in variants.items():
            fn_args = (x, g, u) if name == "compile" else ()
            got = fn(*fn_args)
            bad = compare_outputs(got, expected)
            ms = triton.testing.do_bench_cudagraph(lambda: fn(*fn_args), rep=60)
            pct = 100 * nbytes / (ms * 1e-3) / 1e9 / copy_gbs
            table.append((label, name, ms, pct, bad is None))
            print(f"{label:<16} {name:<24} {ms:8.4f} ms {pct:6.1f} % bitwise={bad is None}", flush=True)
    print("\nshape            best ours (flat/tiled)          ms      %   compile ms      %")
    for label in dict.fromkeys(r[0] for r in table):
        rows = [r for r in table if r[0] == label]
        comp = [r for r in rows if r[1] == "compile"][0]
        best = min((r for r in rows if r[1] != "compile" and r[4]), key=lambda r: r[2])
        print(f"{label:<16} {best[1]:<28} {best[2]:8.4f} {best[3]:6.1f} {comp[2]:8.4f} {comp[3]:6.1f}")


if __name__ == "__main__":
    main()
