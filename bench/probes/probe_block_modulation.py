"""Probe (round 34): one Wan 2.2 TI2V-5B block's modulation traffic, round 33's way against round 34's.

Every WanTransformerBlock with a per-token ``temb`` ([B, S, 6, D] bf16) reads the six chunks of
``scale_shift_table + temb.float()`` in four fused ops: norm1 + modulate (shift, scale), the
self-attention gated residual + affine norm2 (gate), the cross-attention residual + norm3 +
modulate (c_shift, c_scale), the FF gated residual fused with the next block's norm1 (c_gate, and
the next block's shift / scale). Round 33 materialized the sum first (``modulate.table_add``: 2 GB
of fp32 written a block at 1280x704x121) and the ops read its fp32 chunks; round 34 hands the ops
temb's own bf16 chunks and the table's [D] rows (``*_table`` arguments), the sum formed in
registers. This times both sequences (the same four ops plus, for round 33, the sum) on random
activations at TI2V-5B's shapes, after checking that every output of the two is bitwise equal.

ms: ``do_bench_cudagraph`` median (GPU time). The model-level number is ``ditfuse bench wan
--config ti2v-5b``; this isolates the ops the change touches.

    PYTHONPATH=. python3 bench/probes/probe_block_modulation.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ditfuse.kernels.modulate.table_add_triton import table_add
from ditfuse.kernels.norm.layernorm_modulate_triton import gate_residual_layernorm_modulate, layernorm_modulate

F32 = torch.float32
EPS = 1e-6
# (name, B, S, D): TI2V-5B at its 1280x704x121 default (31 x 22 x 40 tokens), at 832x480x81,
# and B = 2 (CFG)
SHAPES = [("5b 1280x704x121", 1, 27280, 3072), ("5b 832x480x81", 1, 8190, 3072), ("5b 832x480x81 B=2", 2, 8190, 3072)]


def inputs(B: int, S: int, D: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)

    def r(shape, dtype, scale=1.0):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    return dict(x=r((B, S, D), torch.bfloat16, 3.0), attn=r((B, S, D), torch.bfloat16, 2.0),
                cross=r((B, S, D), torch.bfloat16, 2.0), ff=r((B, S, D), torch.bfloat16, 2.0),
                temb=r((B, S, 6, D), torch.bfloat16, 0.5), table=r((1, 6, D), F32, 0.1),
                table_next=r((1, 6, D), F32, 0.1), w2=r((D,), F32, 0.2) + 1.0, b2=r((D,), F32, 0.2))


def _block(t: dict[str, torch.Tensor], rows: bool) -> tuple[torch.Tensor, ...]:
    """The block's four modulation consumers (and round 33's sum) as models/wan.py calls them."""
    x, temb = t["x"], t["temb"]
    if rows:
        mod, row = temb.unbind(2), t["table"].reshape(6, -1).unbind(0)
        nmod, nrow = mod, t["table_next"].reshape(6, -1).unbind(0)
        n1 = layernorm_modulate(x, mod[1], mod[0], EPS, None, None, F32, row[1], row[0])
        h1, n2 = gate_residual_layernorm_modulate(x, mod[2], t["attn"], None, None, EPS, t["w2"], t["b2"], F32, row[2])
        h2, n3 = gate_residual_layernorm_modulate(h1, None, t["cross"], mod[4], mod[3], EPS, None, None, F32,
                                                  None, row[4], row[3])
        h3, n4 = gate_residual_layernorm_modulate(h2, mod[5], t["ff"], nmod[1], nmod[0], EPS, None, None, F32,
                                                  row[5], nrow[1], nrow[0])
    else:
        mod = [c.squeeze(2) for c in table_add(t["table"].unsqueeze(0), temb).chunk(6, dim=2)]
        nmod = [c.squeeze(2) for c in table_add(t["table_next"].unsqueeze(0), temb).chunk(6, dim=2)]
        n1 = layernorm_modulate(x, mod[1], mod[0], EPS, None, None, F32)
        h1, n2 = gate_residual_layernorm_modulate(x, mod[2], t["attn"], None, None, EPS, t["w2"], t["b2"], F32)
        h2, n3 = gate_residual_layernorm_modulate(h1, None, t["cross"], mod[4], mod[3], EPS, None, None, F32)
        h3, n4 = gate_residual_layernorm_modulate(h2, mod[5], t["ff"], nmod[1], nmod[0], EPS, None, None, F32)
    return n1, h1, n2, h2, n3, h3, n4


def paths() -> dict[str, Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]]:
    """Round 33's sequence (the sum materialized, two table_adds: this block's and the next's)
    and round 34's (table rows)."""
    return {"round33 table_add + fp32 chunks": lambda t: _block(t, False),
            "round34 table rows + bf16 chunks": lambda t: _block(t, True)}


def main() -> None:
    import triton.testing

    from bench.probes.common import write_csv
    from ditfuse.kernels.compare import first_mismatch

    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="out")
    args = ap.parse_args()
    rows = []
    for name, B, S, D in SHAPES:
        t = inputs(B, S, D, "cuda")
        outs = {k: fn(t) for k, fn in paths().items()}
        (ka, a), (kb, b) = outs.items()
        mm = next((m for m in (first_mismatch(p, q) for p, q in zip(a, b)) if m is not None), None)
        del outs, a, b
        for variant, fn in paths().items():
            ms = triton.testing.do_bench_cudagraph(lambda fn=fn, t=t: fn(t), return_mode="median")
            rows.append(dict(shape=name, variant=variant, ms_graph=round(ms, 4), bitwise_equal=mm is None,
                             gpu=torch.cuda.get_device_name()))
        del t
        torch.cuda.empty_cache()
    path = write_csv(args.out_dir, "probe_block_modulation.csv", rows)
    print(path)
    print(f"{'shape':<20} {'variant':<34} {'graph ms':>9} bitwise")
    for r in rows:
        print(f"{r['shape']:<20} {r['variant']:<34} {r['ms_graph']:>9.4f} {r['bitwise_equal']}")


if __name__ == "__main__":
    main()
