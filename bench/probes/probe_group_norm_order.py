"""GPU probe (one run): which order / contraction / instruction choices of ditfuse's GroupNorm
kernels match torch's CUDA GroupNorm (+ SiLU) bit for bit, and what torch dispatches to.

Sections (each prints a compact table; everything is also written to OUT/probe_group_norm.json):

A. dispatch facts: the CUDA kernels F.group_norm and F.silu launch (profiler names), the output
   strides for a channels-last input, what a bf16 input with fp32 weight/bias does.
B. statistics: per-group mean and rstd (fp32 bits) of ``group_stats`` under every variant switch
   against ``torch.native_group_norm`` on fp32 inputs — group sizes L from 7 to 262144 (both
   the 32-thread and the 512-thread paths), several input distributions, 512 groups each.
   Switches: MEAN_MODE (0: mean + div.rn(delta, n) [default]; 1: fma(delta, rcp(n), mean);
   2: mean + delta*rcp(n)), M2_FMA (fma(delta, x - mean', m2) [default] or two roundings),
   CMB_MEAN_FMA (fma(delta, w, a.mean) [default]), CMB_M2_MODE (0: fma(d*d*a.nf, w, a.m2+b.m2)
   [default]; 1: no fma; 2: fma(d*d, a.nf*w, ...)), RSQ (0: rsqrt.approx [default]; 1: 1/sqrt_rn;
   2: libdevice rsqrt).
C. eps: eps rounded to the input dtype (default, GroupNormKernelImpl's static_cast<scalar_t>) vs
   eps in fp32, on bf16/fp16 groups whose variance is below eps (rstd depends on eps there).
D. epilogue: B_FMA (b = fma(-a, mean, beta) vs rounded product + beta [default]), Y_FMA
   (y = fma(a, x, b) [default] vs a*x + b), ONE_D_FMA (HxW == 1: fma((x-mean)*rstd, gamma, beta)
   [default]); GroupNorm output (no SiLU) vs F.group_norm, bf16/fp16/fp32.
E. SiLU: SILU_EXP (0: libdevice expf [default]; 1: ex2.approx, i.e. __expf) x SILU_DIV (0: div.rn
   [default]; 1: x * rcp(1 + e)) on all 65536 bf16 and fp16 patterns and 4M fp32 values.
F. the decoder shapes end to end (bitwise + eager/ours time, FAST_DIV off and on).
G. div.rn's fast path (FAST_DIV): ``div_fast(a, n, rcp_refined(n))`` vs ``div.rn(a, n)`` on 2^28
   random (a, n) pairs, a over all fp32 exponents, n integer in [1, 2^24]; mismatches among the
   pairs the kernel would accept (``div_fast_unsafe`` False, a != 0) must be 0 before FAST_DIV
   can become the default.

The last lines say, for each section, whether the defaults match and which switch to change if
not (DEFAULT_VARIANT in ditfuse/kernels/norm/group_norm_silu_triton.py, or _eps_for_kernel).

    PYTHONPATH=. python bench/probes/probe_group_norm_order.py [--out DIR] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ditfuse.kernels import reference as ref  # noqa: E402
from ditfuse.kernels.common.rounding import round_to  # noqa: E402
from ditfuse.kernels.common.welford_ops import div_fast, div_fast_unsafe, rcp_refined  # noqa: E402
from ditfuse.kernels.norm import group_norm_silu_triton as gn  # noqa: E402

EPS = 1e-6


def _neq(a: torch.Tensor, b: torch.Tensor) -> int:
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    d = (a.contiguous().view(ity) != b.contiguous().view(ity)) & ~(torch.isnan(a) & torch.isnan(b))
    return int(d.sum())


def _inputs(N: int, L: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    shape = (N, 32, L)
    r = torch.randn(shape, generator=gen, device="cuda")
    if kind == "offset":
        return r * 3 + 5
    if kind == "std":
        return r
    if kind == "wide":
        return r * torch.exp(torch.randn(N, 32, 1, generator=gen, device="cuda") * 4)
    if kind == "meanfar":  # mean much larger than the spread: combine's delta*w matters
        return r * 0.01 + 100.0
    if kind == "bf16grid":
        return (r * 2 + 1).bfloat16().float()
    x = r.clone()  # spiky
    x[..., :: max(L // 7, 1)] *= 300
    return x


def section_a() -> dict:
    out: dict = {}
    x = torch.randn(1, 512, 128, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("group_norm", lambda: F.group_norm(x, 32, w, w, EPS)), ("silu", lambda: F.silu(x)),
                     ("group_norm_channels_last", lambda: F.group_norm(x.to(memory_format=torch.channels_last), 32, w, w, EPS))):
        fn()
        torch.cuda.synchronize()
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            out[name + "_kernels"] = [e.key for e in prof.key_averages() if "CUDA" in str(getattr(e, "device_type", ""))]
        except Exception as e:  # noqa: BLE001
            out[name + "_kernels"] = f"profiler failed: {type(e).__name__}: {e}"
    cl = x.to(memory_format=torch.channels_last)
    y = F.group_norm(cl, 32, w, w, EPS)
    out["channels_last_output_strides"] = list(y.stride())
    out["channels_last_output_equals_contiguous"] = _neq(y, F.group_norm(x, 32, w, w, EPS)) == 0
    try:
        ym = F.group_norm(x, 32, w.float(), w.float(), EPS)
        out["mixed_bf16_input_fp32_weight"] = f"runs, output dtype {ym.dtype}"
        out["mixed_equals_bf16_weights"] = _neq(ym.to(x.dtype), F.group_norm(x, 32, w, w, EPS)) == 0 if ym.dtype == x.dtype else None
    except Exception as e:  # noqa: BLE001
        out["mixed_bf16_input_fp32_weight"] = f"raises {type(e).__name__}: {str(e)[:160]}"
    return out


# The update switches only act on the div.rn chain (FAST_DIV=False); FAST_DIV is the default.
STATS_VARIANTS = [
    ("default", {}),
    ("MEAN_MODE=1 fma(d,rcp,m)", dict(MEAN_MODE=1, FAST_DIV=False)),
    ("MEAN_MODE=2 m+d*rcp", dict(MEAN_MODE=2, FAST_DIV=False)),
    ("M2_FMA=False", dict(M2_FMA=False, FAST_DIV=False)),
    ("CMB_MEAN_FMA=False", dict(CMB_MEAN_FMA=False)),
    ("CMB_M2_MODE=1 nofma", dict(CMB_M2_MODE=1)),
    ("CMB_M2_MODE=2 fma(dd,na*w)", dict(CMB_M2_MODE=2)),
    ("RSQ=1 1/sqrt_rn", dict(RSQ=1)),
    ("RSQ=2 libdevice rsqrt", dict(RSQ=2)),
    ("FAST_DIV=False (div.rn chain)", dict(FAST_DIV=False)),
]


STATS_LS = [7, 31, 32, 100, 511, 512, 513, 1000, 4096, 16384, 65536, 262144]
STATS_KINDS = ["offset", "std", "wide", "meanfar", "bf16grid", "spiky"]
STATS_MAX_ELEMS = 1 << 24  # per case: N = max(1, min(16, this // (32 L)))


def section_b(quick: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    Ls = [L for L in STATS_LS if not (quick and L > 65536)]
    kinds = STATS_KINDS
    totals = {n: [0, 0, 0] for n, _ in STATS_VARIANTS}
    per_L: dict[int, list[int]] = {}
    for L in Ls:
        N = max(1, min(16, STATS_MAX_ELEMS // (32 * L)))
        for kind in kinds:
            x = _inputs(N, L, kind, gen)
            _, m_t, r_t = torch.native_group_norm(x, None, None, N, 32, L, 32, float(torch.tensor(EPS).float()))
            for name, v in STATS_VARIANTS:
                m_k, r_k = gn.group_stats(x, 32, EPS, variant=v)
                dm, dr = _neq(m_k, m_t), _neq(r_k, r_t)
                t = totals[name]
                t[0] += m_t.numel() - dm
                t[1] += r_t.numel() - dr
                t[2] += m_t.numel()
                if name == "default":
                    pl = per_L.setdefault(L, [0, 0, 0])
                    pl[0] += m_t.numel() - dm
                    pl[1] += r_t.numel() - dr
                    pl[2] += m_t.numel()
    print("B. statistics: groups with mean / rstd bits equal to native_group_norm (fp32 inputs)")
    print(f"   {'variant':30s} {'mean':>8s} {'rstd':>8s} {'groups':>8s}")
    for name, (m, r, n) in totals.items():
        print(f"   {name:30s} {m:8d} {r:8d} {n:8d}")
    print("   default per L: " + ", ".join(f"L={L}: {m}/{r}/{n}" for L, (m, r, n) in per_L.items()))
    return dict(totals=totals, per_L=per_L)


def section_c() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(1)
    res = {}
    for dtype in (torch.bfloat16, torch.float16):
        x = (1.0 + 1e-3 * torch.randn(4, 64, 16, 16, generator=gen, device="cuda")).to(dtype)
        w = torch.ones(64, device="cuda", dtype=dtype)
        b = torch.zeros(64, device="cuda", dtype=dtype)
        exp = F.group_norm(x, 32, w, b, EPS)
        row = {}
        for name, e in (("eps in dtype (default)", None), ("eps fp32", float(torch.tensor(EPS).float()))):
            got = gn._launch(x, 32, w, b, EPS, False, eps_override=e)
            row[name] = _neq(got, exp)
        res[str(dtype)] = row
    print("C. eps (elements differing, groups with variance < eps):", res)
    return res


def section_d() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(2)
    variants = [("default", {}), ("B_FMA=False", dict(B_FMA=False)), ("Y_FMA=False", dict(Y_FMA=False)),
                ("B,Y no fma", dict(B_FMA=False, Y_FMA=False)), ("ONE_D_FMA=False", dict(ONE_D_FMA=False))]
    res = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape in ((2, 256, 48, 40), (4, 512, 1, 1)):
            x = (torch.randn(shape, generator=gen, device="cuda") * 3 + 1).to(dtype)
            w = (torch.randn(shape[1], generator=gen, device="cuda") * 0.5 + 1).to(dtype)
            b = (torch.randn(shape[1], generator=gen, device="cuda") * 0.5).to(dtype)
            exp = F.group_norm(x, 32, w, b, EPS)
            key = f"{dtype} {list(shape)}"
            res[key] = {name: _neq(gn._launch(x, 32, w, b, EPS, False, variant=v), exp) for name, v in variants}
    print("D. epilogue (elements differing from F.group_norm):")
    for k, row in res.items():
        print(f"   {k:34s} " + "  ".join(f"{n}: {c}" for n, c in row.items()))
    return res


_silu = gn._silu


@triton.jit
def _silu_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr, SE: tl.constexpr, SD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m).to(tl.float32)
    tl.store(o_ptr + offs, round_to(_silu(x, SE, SD), DTYPE), mask=m)


@triton.jit
def _div_kernel(a_ptr, n_ptr, fast_ptr, rn_ptr, unsafe_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    a = tl.load(a_ptr + offs, mask=m, other=1.0)
    n = tl.load(n_ptr + offs, mask=m, other=1.0)
    tl.store(fast_ptr + offs, div_fast(a, n, rcp_refined(n)), mask=m)
    tl.store(rn_ptr + offs, tl.math.div_rn(a, n), mask=m)
    tl.store(unsafe_ptr + offs, div_fast_unsafe(a).to(tl.int8), mask=m)


def section_g(quick: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(5)
    rounds = 4 if quick else 16
    n_per = 1 << 24
    res = dict(pairs=0, accepted=0, mismatched_accepted=0, mismatched_unsafe=0, first=None)
    for r in range(rounds):
        bits = torch.randint(-(2**31), 2**31 - 1, (n_per,), generator=gen, device="cuda", dtype=torch.int32)
        if r % 2:  # half the rounds: exponents inside the safe range only (dense there)
            e = torch.randint(127 - 60, 127 + 60, (n_per,), generator=gen, device="cuda", dtype=torch.int32)
            bits = (bits & ~(0xFF << 23)) | (e << 23)
        a = bits.view(torch.float32)
        n = torch.floor(torch.exp2(torch.rand(n_per, generator=gen, device="cuda") * 24)).clamp(1, 2**24)
        fast = torch.empty_like(a)
        rn = torch.empty_like(a)
        unsafe = torch.empty(n_per, dtype=torch.int8, device="cuda")
        _div_kernel[(triton.cdiv(n_per, 1024),)](a, n, fast, rn, unsafe, n_per, BLOCK=1024,
                                                 enable_fp_fusion=False)
        diff = (fast.view(torch.int32) != rn.view(torch.int32)) & ~(torch.isnan(fast) & torch.isnan(rn))
        acc = (unsafe == 0) & (a != 0)
        res["pairs"] += n_per
        res["accepted"] += int(acc.sum())
        bad = diff & acc
        res["mismatched_accepted"] += int(bad.sum())
        res["mismatched_unsafe"] += int((diff & ~acc).sum())
        if res["first"] is None and bool(bad.any()):
            i = int(bad.nonzero()[0])
            res["first"] = [float(a[i]), float(n[i]), float(fast[i]), float(rn[i])]
    print("G. div.rn fast path:", json.dumps(res))
    return res


def section_e() -> dict:
    k = _silu_kernel
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = {"bf16 all": bits.view(torch.bfloat16), "fp16 all": bits.view(torch.float16),
              "fp32 random bits": torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=gen, device="cuda",
                                                dtype=torch.int32).view(torch.float32),
              "fp32 [-30,30]": torch.linspace(-30, 30, 1 << 22, device="cuda")}
    res = {}
    for iname, x in inputs.items():
        exp = F.silu(x)
        row = {}
        for se in (0, 1):
            for sd in (0, 1):
                for ftz in (False, True):
                    out = torch.empty_like(x)
                    k[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, DTYPE=gn._DTYPES[x.dtype],
                                                       SE=se, SD=sd, enable_fp_fusion=False, enable_reflect_ftz=ftz)
                    row[f"exp={'libdevice' if se == 0 else 'ex2'} div={'rn' if sd == 0 else 'rcp'} ftz={ftz}"] = _neq(out, exp)
        res[iname] = row
    print("E. SiLU (elements differing from F.silu):")
    for iname, row in res.items():
        print(f"   {iname:18s} " + "  ".join(f"{n}: {c}" for n, c in row.items()))
    return res


def section_f(quick: bool) -> dict:
    import triton.testing

    gen = torch.Generator(device="cuda").manual_seed(4)
    shapes = [(1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512), (1, 128, 1024, 1024)]
    if not quick:
        shapes += [(2, 128, 1024, 1024)]
    res = {}
    for shape in shapes:
        x = (torch.randn(shape, generator=gen, device="cuda") * 2).bfloat16()
        w = (torch.randn(shape[1], generator=gen, device="cuda") * 0.3 + 1).bfloat16()
        b = (torch.randn(shape[1], generator=gen, device="cuda") * 0.2).bfloat16()
        exp = ref.group_norm_silu(x, 32, w, b, EPS)
        got = gn.group_norm_silu(x, 32, w, b, EPS)
        got_f = gn._launch(x, 32, w, b, EPS, True, variant=dict(FAST_DIV=True))
        t_e = triton.testing.do_bench(lambda: ref.group_norm_silu(x, 32, w, b, EPS), return_mode="median")
        t_o = triton.testing.do_bench(lambda: gn.group_norm_silu(x, 32, w, b, EPS), return_mode="median")
        t_f = triton.testing.do_bench(lambda: gn._launch(x, 32, w, b, EPS, True, variant=dict(FAST_DIV=True)),
                                      return_mode="median")
        res[str(list(shape))] = dict(differ=_neq(got, exp), differ_fast_div=_neq(got_f, exp), eager_ms=round(t_e, 4),
                                     ours_ms=round(t_o, 4), ours_fast_div_ms=round(t_f, 4))
        del x, exp, got, got_f
    print("F. decoder shapes, bf16 GN+SiLU:", json.dumps(res))
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="skip the largest shapes")
    args = ap.parse_args()

    t0 = time.time()
    report: dict = dict(torch=torch.__version__, triton=triton.__version__, gpu=torch.cuda.get_device_name())
    print(f"# {report['gpu']} torch {report['torch']} triton {report['triton']}")
    sections = dict(A=section_a, B=lambda: section_b(args.quick), C=section_c, D=section_d, E=section_e,
                    F=lambda: section_f(args.quick), G=lambda: section_g(args.quick))
    for key, fn in sections.items():  # one failing section must not cost the others (unattended run)
        try:
            report[key] = fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            report[key] = {"error": f"{type(e).__name__}: {e}"}
        if key == "A":
            print("A.", json.dumps(report["A"]))
    verdict = []
    ok = True

    def failed(key):
        return "error" in report[key]

    if failed("B"):
        verdict.append(f"B: ERROR {report['B']['error']}")
        ok = False
    else:
        tot = report["B"]["totals"]
        d = tot["default"]
        if d[0] == d[1] == d[2]:
            verdict.append("B: default statistics match")
        else:
            ok = False
            full = [n for n, (m, r, g) in tot.items() if m == r == g]
            verdict.append(f"B: default statistics DIFFER ({d}); variants matching everywhere: {full or 'none'}")
    if failed("C"):
        verdict.append(f"C: ERROR {report['C']['error']}")
        ok = False
    else:
        c_ok = all(row["eps in dtype (default)"] == 0 for row in report["C"].values())
        ok &= c_ok
        verdict.append("C: eps rounded to dtype matches" if c_ok else f"C: eps MISMATCH {report['C']}")
    if failed("D"):
        verdict.append(f"D: ERROR {report['D']['error']}")
        ok = False
    else:
        d_ok = all(row["default"] == 0 for row in report["D"].values())
        ok &= d_ok
        if d_ok:
            verdict.append("D: default epilogue matches")
        else:
            alts = [n for n in next(iter(report["D"].values())) if all(row[n] == 0 for row in report["D"].values())]
            verdict.append(f"D: epilogue DIFFERS; variants matching everywhere: {alts or 'none'}")
    if failed("E"):
        verdict.append(f"E: ERROR {report['E']['error']}")
        ok = False
    else:
        e_key = "exp=libdevice div=rn ftz=False"
        e_ok = all(row[e_key] == 0 for row in report["E"].values())
        ok &= e_ok
        verdict.append("E: SiLU default matches" if e_ok else
                       "E: SiLU DIFFERS; all-zero variants: " + str([n for n in next(iter(report["E"].values()))
                                                                     if all(row[n] == 0 for row in report["E"].values())]))
    if failed("F"):
        verdict.append(f"F: ERROR {report['F']['error']}")
        ok = False
    else:
        f_ok = all(v["differ"] == 0 for v in report["F"].values())
        ok &= f_ok
        verdict.append("F: decoder shapes bitwise equal" if f_ok else "F: decoder shapes DIFFER")
        ff_ok = all(v["differ_fast_div"] == 0 for v in report["F"].values())
        verdict.append("F: FAST_DIV decoder shapes bitwise equal" if ff_ok else "F: FAST_DIV decoder shapes DIFFER")
    if failed("G") or failed("B"):
        verdict.append("G/B: FAST_DIV not judged (error)")
    else:
        fd = report["B"]["totals"].get("FAST_DIV=True (same bits?)", [0, 0, 1])
        g_ok = report["G"]["mismatched_accepted"] == 0 and fd[0] == fd[1] == fd[2]
        verdict.append("FAST_DIV: exact on every probe (stats, division, decoder shapes): the default may be "
                       "switched on (DEFAULT_VARIANT['FAST_DIV'] = True) if bench shows the gain"
                       if g_ok else f"FAST_DIV: NOT exact (G {report['G']}, B {fd}): keep it off")
    report["verdict"] = verdict
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_group_norm.json"), "w") as fh:
        json.dump(report, fh, indent=1, default=str)
    print("VERDICT:")
    for v in verdict:
        print("  " + v)
    print(f"# {time.time() - t0:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
