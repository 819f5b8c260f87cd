"""GPU probe (one run): would cuDNN's autotuner (``torch.backends.cudnn.benchmark = True``) pick
faster convolutions than its heuristic at the VAE decoders' shapes? The lossless decode must use
the heuristic's algorithm (eager's bits); a quality="high" convolution could use the tuned one if
it is faster. Channels-last bf16 inputs as the channels-last decodes feed them: the Wan 2.1
decoder's causal 3x3x3 convolutions (already padded: padding 0) and its 2-D resample
convolutions, and AutoencoderKL's 3x3 convolutions at a 1024x1024 decode.

Prints, per shape: heuristic ms, tuned ms, speed-up, and the tuned result's max |difference| and
share of differing elements against the heuristic's (how "close" the other algorithm is).

    PYTHONPATH=. python bench/probes/probe_conv_benchmark.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from bench.probes.common import write_csv

# (name, input shape [B, C, (T,) H, W] already padded for the 3-D ones, out channels, kernel, padding)
SHAPES = [
    ("wan full-res causal 96->96", (1, 96, 6, 482, 834), 96, (3, 3, 3), 0),
    ("wan 240x416 causal 192->192", (1, 192, 6, 242, 418), 192, (3, 3, 3), 0),
    ("wan 120x208 causal 384->384", (1, 384, 6, 122, 210), 384, (3, 3, 3), 0),
    ("wan 60x104 causal 384->384", (1, 384, 3, 62, 106), 384, (3, 3, 3), 0),
    ("wan conv_out 96->3", (1, 96, 6, 482, 834), 3, (3, 3, 3), 0),
    ("wan resample 2d 192->96 @480x832 x4", (4, 192, 480, 832), 96, (3, 3), 1),
    ("wan resample 2d 384->192 @240x416 x4", (4, 384, 240, 416), 192, (3, 3), 1),
    ("kl 3x3 512->512 @128", (1, 512, 128, 128), 512, (3, 3), 1),
    ("kl 3x3 512->512 @256", (1, 512, 256, 256), 512, (3, 3), 1),
    ("kl 3x3 512->512 @512", (1, 512, 512, 512), 512, (3, 3), 1),
    ("kl 3x3 256->256 @512", (1, 256, 512, 512), 256, (3, 3), 1),
    ("kl 3x3 256->256 @1024", (1, 256, 1024, 1024), 256, (3, 3), 1),
    ("kl 3x3 128->128 @1024", (1, 128, 1024, 1024), 128, (3, 3), 1),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton.testing

    rows = []
    for name, shape, cout, k, pad in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        fmt = torch.channels_last_3d if len(shape) == 5 else torch.channels_last
        x = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16).contiguous(memory_format=fmt)
        w = (torch.randn((cout, shape[1], *k), device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        w = w.contiguous(memory_format=fmt)
        b = (torch.randn(cout, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
        conv = F.conv3d if len(shape) == 5 else F.conv2d
        fn = lambda: conv(x, w, b, 1, pad)  # noqa: E731
        res = {}
        for tuned in (False, True):
            with torch.backends.cudnn.flags(enabled=True, benchmark=tuned, deterministic=False, allow_tf32=True):
                out = fn()
                ms = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
            res[tuned] = (ms, out)
        (h_ms, h_out), (t_ms, t_out) = res[False], res[True]
        diff = (t_out.float() - h_out.float()).abs()
        row = dict(shape=name, heuristic_ms=round(h_ms, 4), tuned_ms=round(t_ms, 4), speedup=round(h_ms / t_ms, 3),
                   max_abs_diff=float(diff.max()), differing=round(float((diff > 0).float().mean()), 5),
                   out_rms=float(h_out.float().pow(2).mean().sqrt()))
        rows.append(row)
        print(f"{name:<38} heuristic {h_ms:8.3f} ms  tuned {t_ms:8.3f} ms  x{h_ms / t_ms:5.2f}  "
              f"max|d| {row['max_abs_diff']:.3g}  differing {row['differing']:.4f}", flush=True)
        res = h_out = t_out = out = diff = x = w = None  # free the large tensors before the next shape
        torch.cuda.empty_cache()
    write_csv(args.out, "probe_conv_benchmark.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
