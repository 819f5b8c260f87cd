"""CPU probe: the host (Python) cost of a family's transformer step, eager vs ditfuse lossless,
with Triton launches stubbed out. Needs no GPU.

The model is the family's real depth (its ``dev`` layer counts) at a tiny width with the real head
size, on the CPU in bf16, at a tiny resolution, so the aten ops are a few microseconds each, like
a CUDA launch. Kernels run through Triton's interpreter for one step (the bit-exact gate verifies
every signature against eager, as on a GPU), then the interpreter's launch is replaced by a no-op
and steps are timed: what remains is everything ditfuse's Python does per call (gate, key,
predicates, output allocation, launch arithmetic) plus diffusers' own module code. Triton's own
launcher (``JITFunction.run``) is not in these numbers, and neither is CUDA's launch latency.

    PYTHONPATH=. python3 bench/probes/probe_host_cpu.py --family qwenimage [--steps 20] [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

# Per family: the real-size config with a tiny width (heads) and the real head size, and an input size.
_NARROW = {
    "flux": (dict(num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32), "64x64"),
    "flux2": (dict(num_attention_heads=2, joint_attention_dim=64), "64x64"),
    "qwenimage": (dict(num_attention_heads=2, joint_attention_dim=64), "64x64"),
    "sd3": (dict(num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=128,
                 pooled_projection_dim=32), "64x64"),
    "zimage": (dict(dim=256, n_heads=2, n_kv_heads=2, cap_feat_dim=64), "64x64"),
}


def _stub_launches() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *a, **k: None


def main(argv: list[str] | None = None) -> int:
    import torch

    import ditfuse
    from ditfuse.models import families

    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="qwenimage", choices=sorted(_NARROW))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions of a profiled lossless step")
    ap.add_argument("--txt", type=int, default=16, help="text tokens")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    fam = families.get(args.family)
    over, size = _NARROW[args.family]
    cfg = fam.config("dev")
    cfg.update({k: v for k, v in over.items() if k in cfg})
    cls = fam.load_class()
    torch.manual_seed(0)
    model = cls(**cfg).to(torch.bfloat16).eval().requires_grad_(False)
    inp = fam.make_inputs(model, 1, size, device="cpu", txt_tokens=args.txt)

    def step():
        return model(**inp)[0]

    def timed(n: int) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    with torch.no_grad():
        step()
        eager_ms = timed(args.steps)
        base = step()
        handle = ditfuse.accelerate(model, quality="lossless")
        out = step()  # first sight: every signature verified through the interpreter
        equal = torch.equal(out.view(torch.int16), base.view(torch.int16))
        _stub_launches()
        lossless_ms = timed(args.steps)
        calls = sum(c.get("kernel", 0) for c in ditfuse.gate.report().calls.values())
        prof_text = ""
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            step()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.profile)
            prof_text = s.getvalue()
        rep = handle.report() if hasattr(handle, "report") else None
        handle.unmount()
    print(prof_text)
    del rep
    print(f"family {args.family}: {cls.__name__} at real depth, width {cfg.get('num_attention_heads', cfg.get('n_heads'))} heads, "
          f"size {size}, {args.txt} text tokens, CPU bf16, 1 thread")
    print(f"first-sight step bitwise equal to eager: {equal}; gated kernel calls so far: {calls}")
    print(f"{'provider':<28} {'host ms per step':>18}")
    print(f"{'eager (aten on CPU)':<28} {eager_ms:>18.2f}")
    print(f"{'lossless, launches stubbed':<28} {lossless_ms:>18.2f}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
