"""GPU probe (one run): GELU(tanh) contraction/tanh variants and the FLUX eager copy inventory.

1. GELU: every variant of ditfuse.kernels.activation.gelu_tanh_triton (fma or not in
   ``x + kKappa*x^3``, libdevice tanh FTZ/non-FTZ, tanhf written out in PTX, tanh.approx, Triton's
   own fp fusion) against torch's ``F.gelu(approximate="tanh")`` on all 65,536 bf16 and fp16 bit
   patterns and on random fp32 bit patterns + a dense [-12, 12] sweep.
2. Copies: a torch-only replica of diffusers 0.42.1 FluxAttnProcessor / FluxTransformerBlock /
   FluxSingleTransformerBlock / FluxPosEmbed (diffusers is not installed on the device), each step
   profiled on its own; counts ``direct_copy_kernel``, ``cat`` and cast kernels per step.

Usage: python bench/probe_elementwise.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gelu_variants() -> list[dict]:
    from ditfuse.kernels.activation import gelu_tanh_triton as g

    dev = "cuda"
    inputs = {}
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    inputs["bf16 all 65536"] = bits.view(torch.bfloat16).reshape(1, 256, 256).to(dev)
    inputs["fp16 all 65536"] = bits.view(torch.float16).reshape(1, 256, 256).to(dev)
    gen = torch.Generator().manual_seed(0)
    rnd = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), dtype=torch.int64, generator=gen).to(torch.int32)
    inputs["fp32 random bits 4M"] = rnd.view(torch.float32).reshape(1, 2048, 2048).to(dev)
    inputs["fp32 sweep [-12,12] 4M"] = torch.linspace(-12, 12, 1 << 22, dtype=torch.float32).reshape(1, 2048, 2048).to(dev)
    variants = {
        "fma+libdevice(nonftz)": dict(fma_inner=True, tanh_impl=g.TANH_LIBDEVICE, reflect_ftz=False),
        "fma+libdevice(ftz)": dict(fma_inner=True, tanh_impl=g.TANH_LIBDEVICE, reflect_ftz=True),
        "nofma+libdevice(nonftz)": dict(fma_inner=False, tanh_impl=g.TANH_LIBDEVICE, reflect_ftz=False),
        "fma+ptx-tanhf": dict(fma_inner=True, tanh_impl=g.TANH_PTX),
        "nofma+ptx-tanhf": dict(fma_inner=False, tanh_impl=g.TANH_PTX),
        "fma+tanh.approx": dict(fma_inner=True, tanh_impl=g.TANH_APPROX),
        "nofma+tritonfusion+libdevice": dict(fma_inner=False, tanh_impl=g.TANH_LIBDEVICE, fp_fusion=True),
    }
    rows = []
    for iname, x in inputs.items():
        ref = F.gelu(x, approximate="tanh")
        ity = torch.int16 if x.dtype != torch.float32 else torch.int32
        for vname, kw in variants.items():
            out = torch.empty_like(x)
            g._launch(x, out, **kw)
            diff = (out.view(ity) != ref.view(ity)) & ~(torch.isnan(out) & torch.isnan(ref))
            n = int(diff.sum())
            first = None
            if n:
                i = diff.flatten().nonzero()[0].item()
                first = [float(x.flatten()[i]), float(out.flatten()[i]), float(ref.flatten()[i])]
            rows.append(dict(input=iname, variant=vname, mismatches=n, first=first))
        # the public path (defaults) too
        pub = g.gelu_tanh(x)
        diff = (pub.view(ity) != ref.view(ity)) & ~(torch.isnan(pub) & torch.isnan(ref))
        rows.append(dict(input=iname, variant="public gelu_tanh()", mismatches=int(diff.sum()), first=None))
    return rows


# ---------------------------------------------------------------- FLUX copy inventory (replica)
def _apply_rotary_emb(x, freqs_cis):  # diffusers apply_rotary_emb, use_real, unbind -1, sequence_dim=1
    cos, sin = freqs_cis
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    cos, sin = cos.to(x.device), sin.to(x.device)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _native_attention(q, k, v):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.permute(0, 2, 1, 3)


def _rope_freqs(ids, axes=(16, 56, 56), theta=10000):
    pos = ids.float()
    cos_out, sin_out = [], []
    for i, dim in enumerate(axes):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim))
        freqs = torch.outer(pos[:, i], freqs)
        cos_out.append(freqs.cos().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float())
        sin_out.append(freqs.sin().repeat_interleave(2, dim=1, output_size=freqs.shape[1] * 2).float())
    return torch.cat(cos_out, dim=-1).to(ids.device), torch.cat(sin_out, dim=-1).to(ids.device)


def copy_inventory(B: int, S_txt=512, S_img=4096, D=3072, H=24) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    lin = lambda i, o: torch.nn.Linear(i, o, device=dev, dtype=dt)  # noqa: E731
    to_q, to_k, to_v, aq, ak, av = (lin(D, D) for _ in range(6))
    to_out, to_add_out = lin(D, D), lin(D, D)
    nq, nk, naq, nak = (torch.nn.RMSNorm(128, eps=1e-6, device=dev, dtype=dt) for _ in range(4))
    proj_mlp, proj_out = lin(D, 4 * D), lin(5 * D, D)
    ff1, ff2 = lin(D, 4 * D), lin(4 * D, D)
    emb6, emb3 = lin(D, 6 * D), lin(D, 3 * D)
    hs = torch.randn(B, S_img, D, device=dev, dtype=dt)
    ehs = torch.randn(B, S_txt, D, device=dev, dtype=dt)
    temb = torch.randn(B, D, device=dev, dtype=dt)
    ids = torch.cat([torch.zeros(S_txt, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(64.0), torch.arange(S_img // 64.0), indexing="ij"), -1).reshape(-1, 3)]).to(dev)
    st: dict = {}

    def steps_attn_dual():
        def proj():
            st["q"], st["k"], st["v"] = to_q(st["n"]), to_k(st["n"]), to_v(st["n"])
            st["eq"], st["ek"], st["ev"] = aq(st["en"]), ak(st["en"]), av(st["en"])
        def unflatten_norm():
            q, k, v = (st[n].unflatten(-1, (-1, 128)) for n in "qkv")
            st["q"], st["k"], st["v"] = nq(q), nk(k), v
            eq, ek, ev = (st[n].unflatten(-1, (-1, 128)) for n in ("eq", "ek", "ev"))
            st["eq"], st["ek"], st["ev"] = naq(eq), nak(ek), ev
        def cat_qkv():
            for n in "qkv":
                st[n] = torch.cat([st["e" + n], st[n]], dim=1)
        def rope():
            st["q"] = _apply_rotary_emb(st["q"], st["rope"])
            st["k"] = _apply_rotary_emb(st["k"], st["rope"])
        def attention():
            st["a"] = _native_attention(st["q"], st["k"], st["v"])
            st["a_contig_after_permute"] = st["a"].is_contiguous()
        def flatten_to():
            st["a"] = st["a"].flatten(2, 3).to(st["q"].dtype)
        def split_contig_out():
            e, h = st["a"].split_with_sizes([S_txt, st["a"].shape[1] - S_txt], dim=1)
            st["attn_img"] = to_out(h.contiguous())
            st["attn_txt"] = to_add_out(e.contiguous())
        return [("attn.proj", proj), ("attn.unflatten+rmsnorm", unflatten_norm), ("attn.cat_qkv", cat_qkv),
                ("attn.rope", rope), ("attn.sdpa", attention), ("attn.flatten+to", flatten_to),
                ("attn.split+contiguous+to_out", split_contig_out)]

    def dual_block():
        def adaln():
            emb = emb6(F.silu(temb))
            sh, sc, g, shm, scm, gm = emb.chunk(6, dim=1)
            st["g"], st["shm"], st["scm"], st["gm"] = g, shm, scm, gm
            st["n"] = F.layer_norm(hs, (D,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None]
            emb_c = emb6(F.silu(temb))
            csh, csc, *_ = emb_c.chunk(6, dim=1)
            st["en"] = F.layer_norm(ehs, (D,), eps=1e-6) * (1 + csc[:, None]) + csh[:, None]
        def post():
            h = hs + st["g"].unsqueeze(1) * st["attn_img"]
            n = F.layer_norm(h, (D,), eps=1e-6) * (1 + st["scm"][:, None]) + st["shm"][:, None]
            f = ff2(F.gelu(ff1(n), approximate="tanh"))
            st["h"] = h + st["gm"].unsqueeze(1) * f
        return [("dual.adaln_zero x2", adaln)] + steps_attn_dual() + [("dual.post (gated res, LN, FF)", post)]

    def single_block():
        def cat_in():
            st["x"] = torch.cat([ehs, hs], dim=1)
        def adaln():
            emb = emb3(F.silu(temb))
            sh, sc, g = emb.chunk(3, dim=1)
            st["g"] = g
            st["n"] = F.layer_norm(st["x"], (D,), eps=1e-6) * (1 + sc[:, None]) + sh[:, None]
        def mlp():
            st["mlp"] = F.gelu(proj_mlp(st["n"]), approximate="tanh")
        def attn_qkv():
            st["q"], st["k"], st["v"] = (m(st["n"]).unflatten(-1, (-1, 128)) for m in (to_q, to_k, to_v))
            st["q"], st["k"] = nq(st["q"]), nk(st["k"])
        def rope():
            st["q"] = _apply_rotary_emb(st["q"], st["rope"])
            st["k"] = _apply_rotary_emb(st["k"], st["rope"])
        def attention():
            st["a"] = _native_attention(st["q"], st["k"], st["v"]).flatten(2, 3).to(dt)
        def cat_out():
            st["c"] = torch.cat([st["a"], st["mlp"]], dim=2)
        def proj_gate_res():
            st["h"] = st["x"] + st["g"].unsqueeze(1) * proj_out(st["c"])
        def split_out():
            st["e2"], st["h2"] = st["h"][:, :S_txt], st["h"][:, S_txt:]
        return [("single.cat_in", cat_in), ("single.adaln_single", adaln), ("single.proj_mlp+gelu", mlp),
                ("single.attn_qkv+rmsnorm", attn_qkv), ("single.rope", rope), ("single.sdpa+flatten", attention),
                ("single.cat([attn, mlp])", cat_out), ("single.proj_out+gate+res", proj_gate_res),
                ("single.split_out (views)", split_out)]

    def pos():
        st["rope"] = _rope_freqs(ids)

    all_steps = [("posembed", pos)] + dual_block() + single_block()
    # warm-up once (cuBLAS / SDPA selection), then profile each step on its own
    for _, fn in all_steps:
        fn()
    torch.cuda.synchronize()
    rows = []
    for name, fn in all_steps:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        cnt = {"direct_copy": [0, 0.0], "cat": [0, 0.0], "to_bf16_cast": [0, 0.0], "other": [0, 0.0]}
        for e in prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CUDA and getattr(e, "self_device_time_total", 0) == 0:
                continue
            n = e.key
            us = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0))
            if "direct_copy" in n:
                k = "direct_copy"
            elif "CatArray" in n or "cat" in n.lower():
                k = "cat"
            elif "bfloat16_copy" in n:
                k = "to_bf16_cast"
            else:
                k = "other"
            cnt[k][0] += int(e.count)
            cnt[k][1] += us
        rows.append(dict(B=B, step=name, **{f"{k}_n": v[0] for k, v in cnt.items()},
                         **{f"{k}_us": round(v[1], 1) for k, v in cnt.items()}))
    rows.append(dict(B=B, step="sdpa output contiguous after permute back", value=bool(st.get("a_contig_after_permute"))))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.time()
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        res["gelu"] = gelu_variants()
    except Exception as e:  # keep the rest of the probe
        res["gelu_error"] = repr(e)
    t1 = time.time()
    res["copies"] = []
    for B in (1, 2):
        try:
            res["copies"] += copy_inventory(B)
        except Exception as e:
            res.setdefault("copies_error", []).append(f"B={B}: {e!r}")
    with open(os.path.join(args.out, "probe_elementwise.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"# torch {res['torch']} on {res['gpu']}; gelu {t1 - t0:.1f}s, copies {time.time() - t1:.1f}s")
    for r in res["copies"]:
        print("COPY", json.dumps(r))
    for k in ("gelu_error", "copies_error"):
        if k in res:
            print("ERROR", k, res[k])
    for r in res.get("gelu", []):
        print(f"GELU {r['input']:<24} {r['variant']:<30} mismatches={r['mismatches']:>8} first={r['first']}")


if __name__ == "__main__":
    main()
