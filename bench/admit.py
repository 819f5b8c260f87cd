"""Admission test of every close kernel on activations captured from a FLUX.1-dev-size forward.

Builds the random-weight FLUX.1-dev-shaped transformer of ``ditfuse bench flux`` (``--layers 2 2``
by default: the per-site inputs have the real widths and token counts; deeper models only add
more batches of the same kind), captures the inputs every close op would see at every site during
one forward at 1024x1024 (4096 image + 512 text tokens), runs
``ditfuse.contracts.admission.admit_op`` for each op, prints the table and writes the record
(default: ditfuse/contracts/admission_results.json, plus a copy under $OUT when set).

    PYTHONPATH=. python3 bench/admit.py [--layers 2 2] [--out PATH] [--timesteps 0.9 0.5 0.1]

Several timesteps give activations of several noise levels (each one more forward).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs=2, default=[2, 2], metavar=("DUAL", "SINGLE"))
    p.add_argument("--img-tokens", type=int, default=4096)
    p.add_argument("--txt-tokens", type=int, default=512)
    p.add_argument("--timesteps", type=float, nargs="+", default=[0.9, 0.5, 0.1])
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: the committed record)")
    args = p.parse_args(argv)

    import torch
    import triton

    from ditfuse.contracts import admission
    from ditfuse.models.flux_high import HIGH_OPS, capture_admission_batches
    from ditfuse.runtime.bench_flux import build_model, make_inputs

    if not torch.cuda.is_available():
        raise SystemExit("bench/admit.py needs a CUDA GPU (admission is measured where the kernels run)")
    t0 = time.time()
    model = build_model(tuple(args.layers))
    batches: dict[str, list] = {op: [] for op in HIGH_OPS}
    for ts in args.timesteps:
        inp = make_inputs(1, args.img_tokens, args.txt_tokens)
        inp["timestep"] = torch.full((1,), ts, device="cuda", dtype=torch.bfloat16)
        for op, b in capture_admission_batches(model, inp).items():
            batches[op].extend(b)
    print(f"[admit] captured {', '.join(f'{op}: {len(b)}' for op, b in batches.items())} batches "
          f"in {time.time() - t0:.1f}s", flush=True)
    measured_on = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    results = []
    for op in HIGH_OPS:
        t1 = time.time()
        r = admission.admit_op(op, batches[op], "cuda", measured_on=measured_on)
        results.append(r)
        print(f"[admit] {op}: admitted={r.admitted} rms {r.rms_ratio:.3f} max {r.max_ratio:.3f} "
              f"bias {r.bias_ratio:.3f} (kernel rms {r.kernel_rms:.3e} vs eager {r.eager_rms:.3e}; "
              f"{r.elements} elements, {time.time() - t1:.1f}s)", flush=True)
    meta = dict(layers=list(args.layers), img_tokens=args.img_tokens, txt_tokens=args.txt_tokens,
                timesteps=list(args.timesteps), model="FLUX.1-dev-size random weights (bench_flux.build_model)")
    path = admission.write_records(results, args.out, meta)
    print(f"[admit] wrote {path}")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / "admission_results.json")
    print()
    print(admission.format_table(results))
    return 0 if all(r.admitted for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
