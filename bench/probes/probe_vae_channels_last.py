"""GPU probe: AutoencoderKL (FLUX.1 VAE, random bf16 weights) decoded in channels-last memory.

Issue 10 asks quality="high" for >= 3x eager; the round-14 lossless breakdown (H100, 1024²) left
13.2 ms of convolutions and 9.0 ms of cuDNN's NCHW <-> NHWC transposes. This probe measures what
a channels-last decode would leave:

1. eager NCHW decode vs eager channels-last decode (weights and latent channels-last): median ms,
   the error of the channels-last output against NCHW eager (max abs, relative L2), and the
   profiler's top kernels of each;
2. per decoder Conv2d: its NCHW output vs the same convolution on a channels-last input, bitwise?
   (if cuDNN's NCHW path is transpose + the same NHWC kernel, they match and only GroupNorm's
   reduction order would stand between channels-last and a lossless decode).

    PYTHONPATH=. python3 bench/probes/probe_vae_channels_last.py [--size 1024] [--decodes 5]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--decodes", type=int, default=5)
    args, _ = p.parse_known_args()  # gpu_suite.sh hands every probe the same PROBE_ARGS

    import torch
    import torch.nn.functional as F
    from diffusers import AutoencoderKL

    from bench.bench_step import profile_breakdown
    from tests.gpu.test_vae_gpu import FLUX_VAE

    torch.manual_seed(0)
    vae = AutoencoderKL(**FLUX_VAE).to("cuda", torch.bfloat16).eval()
    vae_cl = copy.deepcopy(vae).to(memory_format=torch.channels_last)
    z = torch.randn(1, 16, args.size // 8, args.size // 8, device="cuda").to(torch.bfloat16)
    z_cl = z.contiguous(memory_format=torch.channels_last)

    def timed(fn):
        fn()
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(args.decodes):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts), out

    with torch.no_grad():
        nchw = lambda: vae.decode(z, return_dict=False)[0]  # noqa: E731
        cl = lambda: vae_cl.decode(z_cl, return_dict=False)[0]  # noqa: E731
        ms0, ref = timed(nchw)
        ms1, out = timed(cl)
        d = (out.float() - ref.float())
        rel = (d.norm() / ref.float().norm()).item()
        print(f"[cl] {args.size}² eager NCHW {ms0:.2f} ms, eager channels-last {ms1:.2f} ms; channels-last vs NCHW: "
              f"bitwise={torch.equal(out, ref)} max|d|={d.abs().max().item():.3e} rel_l2={rel:.3e}", flush=True)
        profile_breakdown(nchw, "eager NCHW")
        profile_breakdown(cl, "eager channels-last")

        # per-convolution bitwise check on the decoder's real inputs
        inputs: list[tuple[str, torch.nn.Conv2d, torch.Tensor]] = []
        hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: inputs.append((n, mod, a[0].detach())))
                 for n, m in vae.decoder.named_modules() if isinstance(m, torch.nn.Conv2d)]
        vae.decode(z, return_dict=False)
        for h in hooks:
            h.remove()
        same = diff = 0
        for n, m, x in inputs:
            a = F.conv2d(x.contiguous(), m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)
            b = F.conv2d(x.contiguous(memory_format=torch.channels_last),
                         m.weight.contiguous(memory_format=torch.channels_last), m.bias, m.stride, m.padding,
                         m.dilation, m.groups)
            eq = torch.equal(a, b)
            same += eq
            diff += not eq
            if not eq:
                dd = (a.float() - b.float()).abs()
                print(f"[cl] conv {n} {tuple(x.shape)} k={m.kernel_size}: NOT bitwise, {int((dd > 0).sum())} "
                      f"elements differ, max {dd.max().item():.3e}", flush=True)
        print(f"[cl] decoder convolutions NCHW vs channels-last: {same} bitwise, {diff} not", flush=True)
        inputs.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
