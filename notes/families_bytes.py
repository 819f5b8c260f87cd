"""Count the memory traffic of one real-size eager step, per op, on the meta device (no GPU, no
memory): every aten op's unique input bytes (broadcast dims counted once) + output bytes, grouped
by the block and module that ran it. GEMMs (F.linear) and attention (SDPA) are counted apart as
FLOPs; torch.nn.RMSNorm (F.rms_norm with weight dtype == input dtype) counts as the one fused
CUDA kernel it is there (on meta it decomposes). Copies CUDA kernels make internally
(``expect_contiguous`` in the LayerNorm / RMSNorm kernels, the reshape inside F.linear of a
non-viewable input) are counted as ``hidden_copy``.

    PYTHONPATH=. python notes/families_bytes.py [family ...] [--batch 1 2] [--top 40]

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
    from ditfuse.models import family_configs_draft as fc

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("families", nargs="*", default=["qwenimage", "sd35_large", "sd35_medium", "sd3_medium", "flux2", "zimage"])
    p.add_argument("--batch", type=int, nargs="*", default=[1, 2])
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--text-tokens", type=int, default=None)
    a = p.parse_args(argv)
    for name in a.families:
        for b in a.batch:
            report(name, b, a.top, a.text_tokens)
            sys.stdout.flush()


if __name__ == "__main__":
    main()
