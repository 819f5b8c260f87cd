"""GPU probe: the host (CPU) cost of one fused call, layer by layer, at FLUX's image shape.

Each row is the mean wall time per call of N back-to-back calls with no synchronisation inside
the loop (the GPU queue absorbs the kernels; for a kernel shorter than its launch cost this is
the time the host needs per call): the eager chain, the GatedOp (gate + key + predicate + launch),
the public kernel function (predicate + launch), the module's ``_launch`` (argument preparation +
Triton launch), and the Triton launch alone with prepared arguments. Every row twice: with Triton's ``JITFunction.run``
and with the cached launcher of kernels/common/launch.py. Since round 11 the GatedOp
and public-function rows take the cached path (one geometry key, the cached recipe:
kernels/common/plans.py); ``_launch`` is the uncached path, ``_fire`` a cached recipe's launch.

    PYTHONPATH=. python3 bench/probes/probe_host_cost.py
"""

from __future__ import annotations

import time

import torch

from ditfuse.contracts import ops
from ditfuse.contracts.bitexact import gate
from ditfuse.kernels import reference as ref
from ditfuse.kernels.modulate import gate_residual_triton as gr
from ditfuse.kernels.common.plans import call_key
from ditfuse.kernels.norm import layernorm_modulate_triton as lnm
from ditfuse.kernels.rope import qk_rmsnorm_rope_triton as qk


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
    recipe = lnm._recipe(x, g, x, scale, shift, 1e-6, None, None, None, True)
    H, D = 24, 128
    q, k = (torch.randn(1, 4096, H, D, device="cuda").bfloat16() for _ in range(2))
    qt, kt = (torch.randn(1, 512, H, D, device="cuda").bfloat16() for _ in range(2))
    w = torch.rand(D, device="cuda").bfloat16()
    cos, sin = torch.rand(4608, D, device="cuda"), torch.rand(4608, D, device="cuda")
    qkop = ops.LOSSLESS.qk_rmsnorm_rope
    qkop(q, k, w, w, cos, sin, 1e-6, qt, kt, w, w)
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
        ("geometry key (6 args)", lambda: call_key((x, g, x, scale, shift, 1e-6))),
        ("gated LN cached recipe: _fire", lambda: lnm._fire(recipe, x, g, x, scale, shift, None, None)),
        ("QK FLUX GatedOp", lambda: qkop(q, k, w, w, cos, sin, 1e-6, qt, kt, w, w)),
        ("QK FLUX public kernel fn", lambda: qk.qk_rmsnorm_rope(q, k, w, w, cos, sin, 1e-6, qt, kt, w, w)),
        ("QK FLUX _launch (uncached)", lambda: qk._launch(q, k, w, w, cos, sin, 1e-6, qt, kt, w, w, True)),
        ("torch.empty_like", lambda: torch.empty_like(x)),
    ]
    # Each row with Triton's own launch (DITFUSE_FAST_LAUNCH=0: JITFunction.run) and with
    # kernels/common/launch.py's cached launcher (the default since round 16).
    import os

    from ditfuse.kernels.common import launch as fast

    print(f"{'call':<40} {'us, triton run':>15} {'us, fast launch':>16}")
    for name, fn in rows:
        os.environ["DITFUSE_FAST_LAUNCH"] = "0"
        slow = per_call_us(fn)
        os.environ["DITFUSE_FAST_LAUNCH"] = "1"
        print(f"{name:<40} {slow:>15.1f} {per_call_us(fn):>16.1f}")
    print("fast launches:", fast.stats())
    print("gate:", gate.report().summary().replace("\n", " | "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
