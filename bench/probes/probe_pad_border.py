"""GPU probe (one run): the padded channels-last buffer's border launch (zero border, cached
frames copied into the front) at the Wan 2.1 decoder's later-chunk shapes (480x832, 240x416,
120x208; 2 cached frames, causal padding (1, 1, 1, 1, 2, 0)), over launch parameters (elements of
a row per program, warps), each result checked against F.pad(cat([cache, 0], 2)); with a torch
copy of the cached frames as the bandwidth yardstick.

    PYTHONPATH=. python bench/probes/probe_pad_border.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.probes.common import write_csv  # noqa: E402
from ditfuse.kernels.layout import pad_channels_last_triton as pc  # noqa: E402

SHAPES = [(1, 96, 4, 480, 832), (1, 192, 4, 240, 416), (1, 384, 2, 120, 208)]
PAD = (1, 1, 1, 1, 2, 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    import triton.testing

    rows = []
    for shape in SHAPES:
        B, C, T, H, W = shape
        g = torch.Generator(device="cuda").manual_seed(0)
        cache = torch.randn((B, C, 2, H, W), device="cuda", generator=g).to(torch.bfloat16)
        cache = cache.contiguous(memory_format=torch.channels_last_3d)
        exp = F.pad(torch.cat([cache, torch.zeros(shape, dtype=torch.bfloat16, device="cuda")], 2), [1, 1, 1, 1, 0, 0])
        # bytes the launch must move: the cache read, the front frames written, the border columns
        mb = (cache.numel() + exp.numel() - T * H * W * C) * 2 / 1e6
        copy_ms = triton.testing.do_bench_cudagraph(lambda: cache.clone(memory_format=torch.channels_last_3d), rep=50)
        rows.append(dict(shape="x".join(map(str, shape)), launch="cache clone (yardstick)", ms=round(copy_ms, 4),
                         gbps=round(2 * cache.numel() * 2 / 1e6 / copy_ms, 1), ok=True))
        print(f"{rows[-1]['shape']:>18} {rows[-1]['launch']:<26} {copy_ms:8.4f} ms", flush=True)
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8):
                fn = lambda: pc.launch_border(out, cache, PAD, (block, warps))  # noqa: E731
                out = torch.empty(exp.shape, dtype=torch.bfloat16, device="cuda", memory_format=torch.channels_last_3d)
                out[:, :, 2:, 1:-1, 1:-1] = 0  # the producer's interior
                fn()
                ok = torch.equal(out.contiguous().view(torch.int16), exp.view(torch.int16))
                ms = triton.testing.do_bench_cudagraph(fn, rep=50)
                rows.append(dict(shape=rows[-1]["shape"], launch=f"block={block} warps={warps}", ms=round(ms, 4),
                                 gbps=round(mb / ms, 1), ok=ok))
                print(f"{rows[-1]['shape']:>18} {rows[-1]['launch']:<26} {ms:8.4f} ms {mb / ms:8.1f} GB/s "
                      f"{'' if ok else 'WRONG'}", flush=True)
        out = exp = cache = None
    write_csv(args.out, "probe_pad_border.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
