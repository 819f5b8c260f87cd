"""Count the memory traffic of one real-size eager step, per op, on the meta device (no GPU, no
memory): every aten op's unique input bytes (broadcast dims counted once) + output bytes, grouped
by the block and module that ran it. GEMMs (F.linear) and attention (SDPA) are counted apart as
FLOPs; torch.nn.RMSNorm (F.rms_norm with weight dtype == input dtype) counts as the one fused
CUDA kernel it is there (on meta it decomposes). Copies CUDA kernels make internally
(``expect_contiguous`` in the LayerNorm / RMSNorm kernels, the reshape inside F.linear of a
non-viewable input) are counted as ``hidden_copy``.

    PYTHONPATH=. python notes/families_bytes.py [family ...] [--batch 1 2] [--top 40]
    PYTHONPATH=. python notes/families_bytes.py --chains   # analytic per-chain eager vs fused

Numbers feed notes/families.md. This is a static count: it says nothing about achieved bandwidth
(the eager kernels on the H200 run well below copy bandwidth, so this is a lower bound on their
time at 4.18 TB/s).
"""

from __future__ import annotations

import argparse
import collections
import math
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_VIEW_LIKE = {"_unsafe_view", "empty", "empty_like", "new_empty", "lift_fresh", "detach", "alias"}
_GEMM = {"mm", "addmm", "bmm", "baddbmm", "convolution", "matmul"}


def _unique_bytes(t: torch.Tensor) -> int:
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class Counter:
    def __init__(self):
        self.stack: list[tuple[str, str]] = []  # (qualified name, class name)
        self.suppress = 0
        self.rows = collections.Counter()  # (block, module, op) -> bytes
        self.launches = collections.Counter()
        self.flops = collections.Counter()  # "gemm" / "attention" -> flops

    def where(self) -> tuple[str, str]:
        block = next((c for _, c in reversed(self.stack) if c.endswith("Block")), "model")
        module = self.stack[-1][1] if self.stack else "model"
        return block, module

    def add(self, op: str, nbytes: int):
        block, module = self.where()
        self.rows[(block, module, op)] += nbytes
        self.launches[(block, module, op)] += 1

    def hooks(self, model: torch.nn.Module):
        handles = []
        for name, mod in model.named_modules():
            cls = type(mod).__name__

            def pre(m, a, name=name, cls=cls):
                self.stack.append((name, cls))

            def post(m, a, o):
                self.stack.pop()

            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
        return handles


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.c.suppress:
            return out
        name = func.overloadpacket.__name__
        if getattr(func, "is_view", False) or name in _VIEW_LIKE:
            return out
        if name in _GEMM:
            return out  # counted as FLOPs by the function mode
        reads = sum(_unique_bytes(t) for t in _tensors(args)) + sum(_unique_bytes(t) for t in _tensors(kwargs or {}))
        writes = sum(t.numel() * t.element_size() for t in _tensors(out))
        if name.endswith("_") and not name.startswith("_"):
            writes = sum(t.numel() * t.element_size() for t in _tensors(args[:1]))
        self.c.add(name, reads + writes)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.c.suppress:
            return func(*args, **kwargs)
        if func is F.linear:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            self.c.flops["gemm"] += 2 * (x.numel() // x.shape[-1]) * w.shape[0] * w.shape[1]
            if not _viewable_2d(x):
                self.c.add("hidden_copy(linear input)", 2 * x.numel() * x.element_size())
            self.c.suppress += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.c.suppress -= 1
        if func is F.scaled_dot_product_attention:
            q = args[0] if len(args) > 0 else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            b, h, sq, d = q.shape
            sk = k.shape[-2]
            self.c.flops["attention"] += 4 * b * h * sq * sk * d
            self.c.suppress += 1
            try:
                out = func(*args, **kwargs)
                # CUDA's flash / memory-efficient / cuDNN kernels allocate the output as
                # [B, S, H, D] and return its [B, H, S, D] transpose; the math path (what meta
                # runs) does not. Mirror CUDA so a later permute + flatten is a view, not a copy.
                return out.transpose(1, 2).contiguous().transpose(1, 2)
            finally:
                self.c.suppress -= 1
        if func is F.rms_norm:
            x = args[0]
            w = args[2] if len(args) > 2 else kwargs.get("weight")
            if w is None or w.dtype == x.dtype:  # CUDA: one _fused_rms_norm kernel
                out_bytes = x.numel() * x.element_size()
                extra = 2 * out_bytes if not x.is_contiguous() else 0
                if extra:
                    self.c.add("hidden_copy(rms_norm input)", extra)
                self.c.add("_fused_rms_norm", x.numel() * x.element_size() + out_bytes
                           + (w.numel() * w.element_size() if w is not None else 0))
                self.c.suppress += 1
                try:
                    return func(*args, **kwargs)
                finally:
                    self.c.suppress -= 1
        if func is F.layer_norm and not args[0].is_contiguous():
            x = args[0]
            self.c.add("hidden_copy(layer_norm input)", 2 * x.numel() * x.element_size())
        return func(*args, **kwargs)


def _viewable_2d(x: torch.Tensor) -> bool:
    try:
        x.view(-1, x.shape[-1])
        return True
    except RuntimeError:
        return False


def count(name: str, batch: int, text_tokens: int | None = None):
    from ditfuse.models import image_family_configs as fc

    model = fc.build(name, "real", dtype=torch.bfloat16, device="meta")
    inputs = fc.step_inputs(name, model, batch=batch, text_tokens=text_tokens, device="meta")
    c = Counter()
    handles = c.hooks(model)
    try:
        with torch.no_grad(), _Function(c), _Dispatch(c):
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return c


def report(name: str, batch: int, top: int, text_tokens: int | None = None) -> None:
    c = count(name, batch, text_tokens)
    total = sum(c.rows.values())
    gb = 1e-9
    print(f"\n## {name}  B={batch}  eager non-GEMM traffic {total * gb:.2f} GB "
          f"({total / 4.18e12 * 1e3:.1f} ms at 4.18 TB/s), {sum(c.launches.values())} kernels; "
          f"GEMM {c.flops['gemm'] / 1e12:.1f} TFLOP, attention {c.flops['attention'] / 1e12:.1f} TFLOP")
    by_module = collections.Counter()
    for (block, module, op), b in c.rows.items():
        by_module[(block, module)] += b
    print("| block | module | GB | share |")
    print("|---|---|---|---|")
    for (block, module), b in by_module.most_common():
        if b * gb >= 0.005:
            print(f"| {block} | {module} | {b * gb:.2f} | {100 * b / total:.1f} % |")
    print(f"\ntop {top} (block, module, op):")
    print("| block | module | op | launches | GB |")
    print("|---|---|---|---|---|")
    for (key, b) in c.rows.most_common(top):
        print(f"| {key[0]} | {key[1]} | {key[2]} | {c.launches[key]} | {b * gb:.2f} |")


# -- the analytic per-chain model -------------------------------------------------------------
# Bytes per element of the [B, S, D] tensor a chain works on (bf16 activations), eager kernel by
# kernel (reads + writes) and for a fused kernel (inputs once + outputs once):
#   LayerNorm 2+2; x*(1+s) 2+2; +shift 2+2                                  -> LN_MOD 12 / 4
#   gate*y 2+2; res + . 4+2                                                  -> GATE_RES 10 / 6
#   diffusers RMSNorm: .float() 2+4, pow 4+4, mean 4, x*rstd 2+4, .to 4+2, *w 2+2 -> 34 / 4
#   torch.nn.RMSNorm (one kernel) 2+2                                        -> 4
#   FLUX RoPE: .float() 2+4, neg 1+1, stack 2+2, .float() 2+4, *cos 4+4, *sin 4+4, + 8+4, .to 4+2 -> 52
#   complex RoPE: .float() 2+4, complex mul 4+4, .type_as 4+2                -> 20
#   cat 2+2; GELU 2+2 per element of its input; SwiGLU per output element: silu 2+2, mul 4+2 -> 10 / 6
LN_MOD, GATE_RES, GR_LN_MOD, RMS_D, RMS_T, ROPE_R, ROPE_C, CAT, SWIGLU = 12, 10, 22, 34, 4, 52, 20, 4, 10


def analytic(name: str, batch: int, text_tokens: int | None = None) -> list[tuple[str, str, float, float]]:
    """Rows (chain, ditfuse op, eager bytes per step, fused bytes per step) for a 1024x1024 step."""
    from ditfuse.models import image_family_configs as fc

    cfg = fc.config(name, "real")
    s_img = 4096
    s_txt = text_tokens if text_tokens is not None else fc.TEXT_TOKENS[name]
    rows: dict[tuple[str, str], list[float]] = {}

    def add(chain, op, eager, fused, n):
        r = rows.setdefault((chain, op), [0.0, 0.0])
        r[0] += eager * n
        r[1] += fused * n

    B = batch
    if name == "qwenimage":
        D = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        N = B * (s_img + s_txt) * D
        L = cfg["num_layers"]
        add("norm1 LN + modulate (img, txt)", "layernorm_modulate", LN_MOD, 4, N * L)
        add("QK diffusers-RMSNorm + complex RoPE per stream + cat", "NEW qk_rmsnorm_diffusers_rope_complex", 2 * RMS_D + 2 * ROPE_C + 2 * CAT, 8, N * L)
        add("V cat", "(copy; keep)", CAT, CAT, N * L)
        if B > 1:
            add("attn-out .contiguous() of the split (B>1)", "(copy; keep)", 4, 4, N * L)
        add("gate residual + norm2 LN + modulate", "gate_residual_layernorm_modulate", GR_LN_MOD, 8, N * L)
        add("FF tanh-GELU (4D)", "(eager GELU; lossless as is)", 4 * 4, 4 * 4, N * L)
        add("FF gate residual", "gate_residual", GATE_RES, 6, N * L)
    elif name.startswith("sd3"):
        D = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        L = cfg["num_layers"]
        Ni, Nt = B * s_img * D, B * s_txt * D
        N = Ni + Nt
        qk = cfg["qk_norm"] is not None
        dual = len(cfg["dual_attention_layers"])
        add("norm1 / norm1_context LN + modulate", "layernorm_modulate", LN_MOD, 4, N * L)
        if qk:
            add("QK diffusers-RMSNorm ([B,H,S,D] views) + image-first cat", "NEW qk_rmsnorm_diffusers_cat", 2 * RMS_D + 2 * CAT, 8, N * L)
        else:
            add("Q, K cat (image first)", "(copy; keep)", 2 * CAT, 2 * CAT, N * L)
        add("V cat", "(copy; keep)", CAT, CAT, N * L)
        if B > 1:
            add("reshape copy of the split in to_out / to_add_out (B>1)", "(copy; keep)", 4, 4, N * L)
        # the last block (context_pre_only) has no text gate residuals / FF
        Nff = N * L - Nt
        add("gate residual + norm2 LN + modulate", "gate_residual_layernorm_modulate", GR_LN_MOD, 8, Nff)
        add("FF tanh-GELU (4D)", "(eager GELU; lossless as is)", 16, 16, Nff)
        add("FF gate residual", "gate_residual", GATE_RES, 6, Nff)
        if dual:
            add("dual: one LN, second modulate (SD35AdaLayerNormZeroX)", "NEW layernorm_dual_modulate", 8, 2, Ni * dual)
            add("dual: attn2 QK diffusers-RMSNorm (no cat)", "NEW qk_rmsnorm_diffusers_cat (no text)", 2 * RMS_D, 8, Ni * dual)
            add("dual: attn2 gate residual", "gate_residual", GATE_RES, 6, Ni * dual)
    elif name == "flux2":
        D = cfg["num_attention_heads"] * cfg["attention_head_dim"]
        N = B * (s_img + s_txt) * D
        Ld, Ls = cfg["num_layers"], cfg["num_single_layers"]
        r = cfg["mlp_ratio"]
        add("double: norm1 LN + modulate", "layernorm_modulate", LN_MOD, 4, N * Ld)
        add("double: QK RMSNorm + text-first cat + interleaved RoPE", "qk_rmsnorm_rope", 2 * RMS_T + 2 * CAT + 2 * ROPE_R, 8, N * Ld)
        add("double: V cat", "(copy; keep)", CAT, CAT, N * Ld)
        if B > 1:
            add("double: reshape copy of the split in to_out / to_add_out (B>1)", "(copy; keep)", 4, 4, N * Ld)
        add("double: gate residual + norm2 LN + modulate", "gate_residual_layernorm_modulate", GR_LN_MOD, 8, N * Ld)
        add("double: FF SwiGLU", "NEW swiglu", SWIGLU * r, 6 * r, N * Ld)
        add("double: FF gate residual", "gate_residual", GATE_RES, 6, N * Ld)
        add("single: LN + modulate", "layernorm_modulate", LN_MOD, 4, N * Ls)
        add("single: QK RMSNorm (strided views: hidden copies) + RoPE", "qk_rmsnorm_rope", 2 * (4 + RMS_T + ROPE_R), 8, N * Ls)
        add("single: SwiGLU of the MLP half", "NEW swiglu (into the cat buffer)", SWIGLU * r, 6 * r, N * Ls)
        add("single: cat([attn, mlp])", "joint buffer (FLUX.1 single-block mechanism)", CAT * (1 + r), CAT, N * Ls)
        add("single: gate residual", "gate_residual", GATE_RES, 6, N * Ls)
    elif name == "zimage":
        D = cfg["dim"]
        I = int(D / 3 * 8)
        L, R = cfg["n_layers"], cfg["n_refiner_layers"]
        Nu, Ni, Nt = B * (s_img + s_txt) * D, B * s_img * D, B * s_txt * D
        Nm = Nu * L + Ni * R  # modulated blocks (main + noise refiner)
        Nall = Nm + Nt * R
        f = I / D
        add("attention_norm1 RMSNorm * (1 + scale)", "NEW rms_norm_diffusers_scale", RMS_D + 4, 4, Nm)
        add("attention_norm1 RMSNorm (context refiner)", "NEW rms_norm_diffusers", RMS_D, 4, Nt * R)
        add("QK diffusers-RMSNorm + complex RoPE", "NEW qk_rmsnorm_diffusers_rope_complex", 2 * RMS_D + 2 * ROPE_C, 8, Nall)
        add("x + tanh(g) * RMSNorm(attn) ; ffn_norm1(x) * (1 + scale)", "NEW gate_residual_rms_norm_diffusers_scale", (RMS_D + GATE_RES) + (RMS_D + 4), 8, Nm)
        add("x + RMSNorm(attn) ; ffn_norm1(x) (context refiner)", "NEW gate_residual_rms_norm_diffusers_scale", (RMS_D + 6) + RMS_D, 8, Nt * R)
        add("SwiGLU silu(w1 x) * w3 x", "NEW swiglu", SWIGLU * f, 6 * f, Nall)
        add("x + tanh(g) * ffn_norm2(ffn)", "NEW gate_residual_rms_norm_diffusers", RMS_D + GATE_RES, 6, Nm)
        add("x + ffn_norm2(ffn) (context refiner)", "NEW gate_residual_rms_norm_diffusers", RMS_D + 6, 6, Nt * R)
    else:
        raise KeyError(name)
    return [(c, o, e, fu) for (c, o), (e, fu) in rows.items()]


def chains_report(name: str, batch: int) -> None:
    rows = analytic(name, batch)
    measured = sum(count(name, batch).rows.values())
    eager = sum(r[2] for r in rows)
    fused = sum(r[3] for r in rows)
    gb = 1e-9
    print(f"\n### {name}, B={batch}: eager {eager * gb:.1f} GB/step (meta count of the whole step: "
          f"{measured * gb:.1f} GB), fused {fused * gb:.1f} GB/step, saved {(eager - fused) * gb:.1f} GB "
          f"= {(eager - fused) / 4.18e12 * 1e3:.1f} ms at 4.18 TB/s")
    print("| chain | ditfuse op | eager GB | fused GB | saved ms @4.18 TB/s |")
    print("|---|---|---|---|---|")
    for c, o, e, fu in sorted(rows, key=lambda r: r[3] - r[2]):
        print(f"| {c} | {o} | {e * gb:.1f} | {fu * gb:.1f} | {(e - fu) / 4.18e12 * 1e3:.1f} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("families", nargs="*", default=["qwenimage", "sd35_large", "sd35_medium", "sd3_medium", "flux2", "zimage"])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 2])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--text-tokens", type=int, default=None)
    p.add_argument("--chains", action="store_true", help="the analytic per-chain table instead")
    a = p.parse_args(argv)
    for name in a.families:
        for b in a.batch:
            if a.chains:
                chains_report(name, b)
            else:
                report(name, b, a.top, a.text_tokens)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
