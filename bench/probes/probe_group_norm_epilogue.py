"""GPU probe: which GroupNorm epilogue arithmetic torch's CUDA ``F.group_norm`` uses (HxW > 1,
with weight and bias), found by emulating candidate formulas in fp64 on torch's own statistics.

The H200 run of commit 1915d8a showed bf16 bitwise but fp32 (9 % of elements) and fp16 (~4e-5)
off by one ulp with equal per-group statistics: for bf16 every product in the epilogue is exact,
so only the contraction (FMA or not) of ``a = rstd*gamma``, ``b = -a*mean + beta``, ``y = a*x + b``
(or another association) can explain it. Each candidate is computed with explicit roundings
(fp64 products of fp32 operands are exact; r32 rounds once) and compared bit for bit; the
ditfuse kernel's B_FMA / Y_FMA variant switches are timed against the same reference.

    PYTHONPATH=. python3 bench/probes/probe_group_norm_epilogue.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ditfuse.kernels.norm import group_norm_silu_triton as gn  # noqa: E402

EPS = 1e-6


def r32(t: torch.Tensor) -> torch.Tensor:
    return t.float().double()


def fma(a, b, c):
    """fp32 fma emulated in fp64: a*b exact in fp64 for fp32 a, b; one rounding of the sum to
    fp64 then fp32 (a double rounding only when the fp64 sum lands on an fp32 tie: negligible)."""
    return r32(a * b + c)


def candidates(x, mean, rstd, w, b):
    """x [N, G, D, HW] fp64 holding T values; mean/rstd [N, G, 1, 1]; w/b [1, G, D, 1]."""
    a = r32(rstd * w)
    out = {}
    b_fma = fma(-a, mean, b)
    b_two = r32(r32(-a * mean) + b)
    out["y=fma(a,x,b) b=fma"] = fma(a, x, b_fma)
    out["y=fma(a,x,b) b=2r"] = fma(a, x, b_two)
    out["y=r(r(a*x)+b) b=fma"] = r32(r32(a * x) + b_fma)
    out["y=r(r(a*x)+b) b=2r"] = r32(r32(a * x) + b_two)
    d = r32(x - mean)
    out["fma(d,a,beta)"] = fma(d, a, b)
    out["r(r(d*a)+beta)"] = r32(r32(d * a) + b)
    t = r32(d * rstd)
    out["fma(r(d*rstd),w,beta)"] = fma(t, w, b)
    out["r(r(r(d*rstd)*w)+beta)"] = r32(r32(t * w) + b)
    return out


def neq(got: torch.Tensor, exp: torch.Tensor) -> int:
    g = got.to(exp.dtype)
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[exp.dtype]
    return int(((g.contiguous().view(ity) != exp.contiguous().view(ity)) & ~(torch.isnan(g) & torch.isnan(exp))).sum())


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(3)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    G = 32
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape in ((1, 512, 128, 128), (2, 256, 48, 40)):
            N, C = shape[:2]
            x = (torch.randn(shape, generator=gen, device="cuda") * 3 + 1).to(dtype)
            w = (torch.randn(C, generator=gen, device="cuda") * 0.5 + 1).to(dtype)
            bb = (torch.randn(C, generator=gen, device="cuda") * 0.5).to(dtype)
            y, mean, rstd = torch.native_group_norm(x, w, bb, N, C, shape[2] * shape[3], G, EPS)
            exp = F.group_norm(x, G, w, bb, EPS)
            assert neq(y, exp) == 0
            xs = x.double().reshape(N, G, C // G, -1)
            cand = candidates(xs, mean.double().reshape(N, G, 1, 1), rstd.double().reshape(N, G, 1, 1),
                              w.double().reshape(1, G, C // G, 1), bb.double().reshape(1, G, C // G, 1))
            res = {k: neq(v.reshape(shape).to(dtype), exp) for k, v in cand.items()}
            for name, var in (("ours default", {}), ("ours Y_FMA=0", dict(Y_FMA=False)),
                              ("ours B_FMA=0", dict(B_FMA=False)), ("ours both=0", dict(B_FMA=False, Y_FMA=False))):
                res[name] = neq(gn._launch(x, G, w, bb, EPS, False, variant=var), exp)
            rows.append((f"{str(dtype)[6:]} {list(shape)}", res))
            print(f"{rows[-1][0]:28s} " + "  ".join(f"{k}: {v}" for k, v in res.items()), flush=True)
    names = list(rows[0][1])
    ok = [n for n in names if all(r[n] == 0 for _, r in rows)]
    print("formulas matching every case:", ok or "NONE")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
