"""CPU probe: the host (Python) cost of a family's transformer step and of each fused op's call,
with Triton launches stubbed out. Needs no GPU.

The model is the family's real depth (its ``dev`` layer counts) at a narrow width with the real
head size, on the CPU in bf16, at a tiny resolution, so each aten op costs about what a CUDA
launch costs the host. ``TRITON_INTERPRET=1`` makes the kernels' host paths run on the CPU (the
predicates accept it), ``DITFUSE_VERIFY=off`` skips the gate's first-sight comparison, and
Triton's interpreted launch is replaced by a no-op: the outputs are garbage, only the time means
anything. What is measured is everything ditfuse's Python does per call (gate, key, predicate,
recipe, output allocation) plus diffusers' own module code; Triton's launcher (``JITFunction.run``)
and CUDA's launch latency are not in it.

Per step: the median host time of a step, the time spent inside gated ops (and per call, per op)
and inside ``F.linear`` (diffusers' GEMM calls, for scale). ``--micro``: warm per-call times of each
op with the arguments one step passed it (GatedOp, the kernel function, the gate's signature, the
geometry key).

    PYTHONPATH=. python3 bench/probes/probe_host_cpu.py --family qwenimage [--steps 10] [--micro]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
os.environ["DITFUSE_VERIFY"] = "off"

# family -> (config overrides: narrow width, real head size; size)
NARROW = {
    "flux": (dict(num_attention_heads=1, joint_attention_dim=64, pooled_projection_dim=32), "32x32"),
    "flux2": (dict(num_attention_heads=1, joint_attention_dim=64), "32x32"),
    "qwenimage": (dict(num_attention_heads=1, joint_attention_dim=64), "32x32"),
    "sd3": (dict(num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=128,
                 pooled_projection_dim=32), "32x32"),
    "zimage": (dict(dim=256, n_heads=2, n_kv_heads=2, cap_feat_dim=64), "32x32"),
}


def main(argv: list[str] | None = None) -> int:
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import ditfuse
    from ditfuse.contracts import ops
    from ditfuse.models import families

    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwenimage", choices=sorted(NARROW))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro", action="store_true", help="also time each op's call warm, with one step's arguments")
    args = ap.parse_args(argv)

    InterpretedFunction.run = lambda self, *a, **k: None  # the launch itself: a no-op
    torch.set_num_threads(1)
    fam = families.get(args.family)
    over, size = NARROW[args.family]
    cfg = fam.config("dev")
    cfg.update({k: v for k, v in over.items() if k in cfg})
    torch.manual_seed(0)
    model = fam.load_class()(**cfg).to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(model, 1, size, device="cpu", txt_tokens=8)

    per_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    first_args: dict[str, tuple] = {}
    linear = [0.0, 0]
    gated_call = ops.GatedOp.__call__
    f_linear = torch.nn.functional.linear

    def timed_op(self, *a, **k):
        t0 = time.perf_counter()
        out = gated_call(self, *a, **k)
        acc = per_op[self.op]
        acc[0] += time.perf_counter() - t0
        acc[1] += 1
        first_args.setdefault(self.op, (self, a, k))
        return out

    def timed_linear(*a, **k):
        t0 = time.perf_counter()
        out = f_linear(*a, **k)
        linear[0] += time.perf_counter() - t0
        linear[1] += 1
        return out

    with torch.no_grad():
        model(**inp)
        eager = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            model(**inp)
            eager.append(time.perf_counter() - t0)
        handle = ditfuse.accelerate(model)
        model(**inp)
        ops.GatedOp.__call__ = timed_op
        torch.nn.functional.linear = timed_linear
        try:
            steps = []
            for _ in range(args.steps):
                per_op.clear()
                linear[:] = [0.0, 0]
                t0 = time.perf_counter()
                model(**inp)
                steps.append((time.perf_counter() - t0, {k: tuple(v) for k, v in per_op.items()}, tuple(linear)))
        finally:
            ops.GatedOp.__call__ = gated_call
            torch.nn.functional.linear = f_linear
        step_s, ops_t, lin = sorted(steps, key=lambda s: s[0])[len(steps) // 2]
        micro = []
        if args.micro:
            from ditfuse.kernels.common.plans import call_key

            def us(fn, n=2000):
                for _ in range(20):
                    fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                return (time.perf_counter() - t0) / n * 1e6

            for op, (g, a, k) in first_args.items():
                kern = g._load(a[0].device)
                micro.append((op, us(lambda: g(*a, **k)), us(lambda: kern(*a, **k)),
                              us(lambda: g.signature(*a, **k)), us(lambda: call_key(a, k))))
        handle.unmount()

    total_ops = sum(t for t, _ in ops_t.values())
    n_ops = sum(n for _, n in ops_t.values())
    print(f"{args.family}: {fam.load_class().__name__} at real depth, narrow width, {size}, CPU bf16, 1 thread, "
          f"launches stubbed")
    print(f"{'eager step (host, aten on CPU)':<44} {statistics.median(eager) * 1e3:9.2f} ms")
    print(f"{'lossless step (host)':<44} {step_s * 1e3:9.2f} ms")
    print(f"{'  inside gated ops':<44} {total_ops * 1e3:9.2f} ms  ({n_ops} calls, {total_ops / max(n_ops, 1) * 1e6:.1f} us each)")
    print(f"{'  inside F.linear':<44} {lin[0] * 1e3:9.2f} ms  ({lin[1]} calls)")
    for op, (t, n) in sorted(ops_t.items(), key=lambda kv: -kv[1][0]):
        print(f"    {op:<40} {t / n * 1e6:7.1f} us/call x {n}")
    if micro:
        print(f"\n{'warm, us per call':<44} {'GatedOp':>8} {'kernel':>8} {'sig':>6} {'key':>6}")
        for op, *vals in micro:
            print(f"  {op:<42} " + " ".join(f"{v:8.1f}" if i < 2 else f"{v:6.1f}" for i, v in enumerate(vals)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
