"""No GPU needed: compile the diffusers-RMSNorm kernel (norm.rms_norm_diffusers_triton) ahead of
time for sm_90a with Triton's bundled ptxas and print, per launch, the registers, spills and the
global load/store widths in the PTX. The arguments are exactly those ``_launch`` would pass for
Z-Image's rows (bf16 [B, S, 3840], gate ``tanh`` of and scale a [B, 1, D] chunk of [B, 1, 4D]),
captured by standing in for the kernel; ``dspec`` is the same body with ``D`` specialized
(divisibility 16) instead of in ``do_not_specialize`` (see probe_rms_diffusers_tiling.py).

Usage: TRITON_INTERPRET=0 python bench/probes/aot_rms_diffusers_regs.py [MODE,BR,WARPS,READBACK ...]
       (default: the three modes' default launches; ``None`` keeps a default, e.g. ``2,None,None,True``)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

os.environ["TRITON_INTERPRET"] = "0"  # before triton / ditfuse are imported
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from ditfuse.kernels.norm import rms_norm_diffusers_triton as mod  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


class _Capture:
    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return record


def capture(mode: int, br, nw, rb, B: int = 1, S: int = 4608, D: int = 3840) -> _Capture:
    x, r = torch.randn(B, S, D).bfloat16(), torch.randn(B, S, D).bfloat16()
    _, _, scale, gate = torch.randn(B, 1, 4 * D).bfloat16().chunk(4, dim=2)
    gate = gate.tanh()
    w = w2 = torch.ones(D).bfloat16()
    call = {0: (0, x, None, None, scale, w, None, 1e-5), 1: (1, x, r, gate, None, w, None, 1e-5),
            2: (2, x, r, gate, scale, w, w2, 1e-5)}[mode]
    cap, real = _Capture(), mod._rms_d_kernel
    mod._rms_d_kernel = cap
    try:
        mod._launch(*call, br, nw, rb)
    finally:
        mod._rms_d_kernel = real
    return cap


def compile_stats(fn, cap: _Capture) -> tuple[int, int, dict[str, int]]:
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(cap.kwargs)
    bound, spec, opts = binder(*cap.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    k = triton_compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spills, dict(Counter(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", k.asm["ptx"])))


def main() -> None:
    real = mod._rms_d_kernel
    dspec = triton.jit(real.fn, do_not_specialize=[n for n in real.do_not_specialize if n != "D"])
    specs = sys.argv[1:] or ["0,None,None,None", "1,None,None,None", "2,None,None,None", "2,None,None,True"]
    for spec in specs:
        m, br, nw, rb = (None if v == "None" else v for v in spec.split(","))
        cap = capture(int(m), br and int(br), nw and int(nw), rb == "True" if rb else None)
        k = cap.kwargs
        for name, fn in (("asis", real), ("dspec", dspec)):
            regs, spills, access = compile_stats(fn, cap)
            print(f"mode {m} BR {k['BR']:2d} warps {k['num_warps']} readback {int(k['READBACK'])} {name:5s}: "
                  f"{regs:3d} regs, {spills:4d} B spilled, grid {cap.grid[0]}, {access}", flush=True)


if __name__ == "__main__":
    main()
