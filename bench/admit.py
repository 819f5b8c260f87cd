"""Admission test of every close kernel on activations captured from real-size forwards.

For each family (``--families``, default all): builds the random-weight real-size transformer of
``ditfuse bench <family>`` with few blocks (``--layers``; the per-site inputs have the real
widths and token counts, deeper models only add more batches of the same kind), mounts ditfuse,
captures the arguments every close op's lossless sibling gets at every site during one forward per
timestep (``ditfuse.models.capture_admission_batches``), and runs
``ditfuse.contracts.admission.admit_op`` on each close op over all captured batches. Prints the
table and writes the record (default: ditfuse/contracts/admission_results.json, plus a copy under
$OUT when set).

    PYTHONPATH=. python3 bench/admit.py [--families flux wan] [--out PATH] [--timesteps 0.9 0.5 0.1]

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


_DEFAULTS = {"flux": dict(layers=(2, 2), size="1024x1024"), "wan": dict(layers=(2,), size="832x480x81")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(_DEFAULTS), choices=list(_DEFAULTS))
    p.add_argument("--timesteps", type=float, nargs="+", default=[0.9, 0.5, 0.1], help="sigmas in (0, 1]")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: the committed record)")
    args = p.parse_args(argv)

    import torch
    import triton

    import ditfuse
    from ditfuse.contracts import admission
    from ditfuse.models import capture_admission_batches, families

    if not torch.cuda.is_available():
        raise SystemExit("bench/admit.py needs a CUDA GPU (admission is measured where the kernels run)")
    batches: dict[str, list] = {}
    meta: dict = {"timesteps": list(args.timesteps), "families": {}}
    for name in args.families:
        t0 = time.time()
        fam = families.get(name)
        d = _DEFAULTS[name]
        model = fam.build("dev", d["layers"], load="pretrained")
        handle = ditfuse.accelerate(model)
        for sigma in args.timesteps:
            inp = fam.make_inputs(model, 1, d["size"])
            inp["timestep"] = fam.timestep(sigma, 1, "cuda", torch.bfloat16)
            for op, b in capture_admission_batches(model, inp).items():
                batches.setdefault(op, []).extend(b)
        handle.unmount()
        meta["families"][name] = dict(config="dev", layers=list(d["layers"]), size=d["size"],
                                      note=fam.notes.get("dev", ""))
        print(f"[admit] {name}: captured in {time.time() - t0:.1f}s", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"[admit] batches: {', '.join(f'{op}: {len(b)}' for op, b in batches.items())}", flush=True)
    measured_on = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    results = []
    for op in admission.candidates():
        if not batches.get(op):
            print(f"[admit] {op}: no site of {', '.join(args.families)} runs it: not measured", flush=True)
            continue
        t1 = time.time()
        r = admission.admit_op(op, batches[op], "cuda", measured_on=measured_on)
        results.append(r)
        print(f"[admit] {op}: admitted={r.admitted} rms {r.rms_ratio:.3f} max {r.max_ratio:.3f} "
              f"bias {r.bias_ratio:.3f} (kernel rms {r.kernel_rms:.3e} vs eager {r.eager_rms:.3e}; "
              f"{r.elements} elements, {time.time() - t1:.1f}s)", flush=True)
    path = admission.write_records(results, args.out, meta)
    print(f"[admit] wrote {path}")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / "admission_results.json")
    print()
    print(admission.format_table(results))
    return 0 if all(r.admitted for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
