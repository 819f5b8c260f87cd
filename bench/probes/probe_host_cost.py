"""GPU probe: the host (CPU) cost of one fused call, layer by layer, at FLUX's image shape.

Each row is the mean wall time per call of N back-to-back calls with no synchronisation inside
the loop (the GPU queue absorbs the kernels; for a kernel shorter than its launch cost this is
the time the host needs per call): the eager chain, the GatedOp (gate + key + predicate + launch),
the public kernel function (predicate + launch), the module's ``_launch`` (argument preparation +
Triton launch), and the Triton launch alone with prepared arguments.

    PYTHONPATH=. python3 bench/probes/probe_host_cost.py
"""

from __future__ import annotations

import time

import torch

from ditfuse.contracts import ops
from ditfuse.contracts.bitexact import gate
from ditfuse.kernels import reference as ref
from ditfuse.kernels.modulate import gate_residual_triton as gr
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm


def per_call_us(fn, n=400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> int:
    x = torch.randn(1, 4608, 3072, device="cuda").bfloat16()
    emb = torch.randn(1, 6 * 3072, device="cuda").bfloat16()
    shift, scale, g = emb.chunk(6, dim=1)[:3]
    gated = ops.LOSSLESS.gate_residual_layernorm_modulate
    ln = ops.LOSSLESS.layernorm_modulate
    grop = ops.LOSSLESS.gate_residual
    gated(x, g, x, scale, shift, 1e-6)  # verify first sight
    ln(x, scale, shift, 1e-6)
    grop(x, g, x)
    rows = [
        ("LN+mod eager chain (4 kernels)", lambda: ref.layernorm_modulate(x, scale, shift, 1e-6)),
        ("LN+mod GatedOp", lambda: ln(x, scale, shift, 1e-6)),
        ("LN+mod public kernel fn", lambda: lnm.layernorm_modulate(x, scale, shift, 1e-6)),
        ("LN+mod _launch", lambda: lnm._launch(x, None, None, scale, shift, 1e-6, None, None, None, True)),
        ("LN+mod predicate only", lambda: lnm._unsupported_reason(x, scale, shift, 1e-6)),
        ("gated LN GatedOp", lambda: gated(x, g, x, scale, shift, 1e-6)),
        ("gated LN _launch", lambda: lnm._launch(x, g, x, scale, shift, 1e-6, None, None, None, True)),
        ("gate_residual eager chain (2 kernels)", lambda: ref.gate_residual(x, g, x)),
        ("gate_residual GatedOp", lambda: grop(x, g, x)),
        ("gate_residual _launch", lambda: gr._launch(x, g, x)),
        ("GatedOp key only", lambda: gated.signature(x, g, x, scale, shift, 1e-6)),
        ("torch.empty_like", lambda: torch.empty_like(x)),
    ]
    print(f"{'call':<40} {'us per call':>12}")
    for name, fn in rows:
        print(f"{name:<40} {per_call_us(fn):>12.1f}")
    print("gate:", gate.report().summary().replace("\n", " | "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
