"""Admission test of every close kernel on activations captured from real-size forwards.

For each family (``--families``, default all): builds the random-weight real-size transformer of
``ditfuse bench <family>`` with few blocks (``--layers``; the per-site inputs have the real
widths and token counts, deeper models only add more batches of the same kind), mounts ditfuse,
captures the arguments every close op's lossless sibling gets at every site during one forward per
timestep (``ditfuse.models.capture_admission_batches`` with ``scope="all"``: also at sites whose
high tier does not run the op, so the table shows whether a family's chains would admit it), and runs
``ditfuse.contracts.admission.admit_op`` on each close op over all captured batches. The VAEs
(``vae_kl``: the FLUX/SD3 AutoencoderKL at 1024x1024; ``vae_wan``: the Wan 2.1 VAE at 480x832 x 17
frames; random bf16 weights, the configs of bench/bench_vae.py) are captured in one decode per
latent draw. Prints the table and writes the record (default:
ditfuse/contracts/admission_results.json, plus a copy under $OUT when set); ops not measured in
this run keep their existing records.

    PYTHONPATH=. python3 bench/admit.py [--families flux wan chroma qwenimage hunyuanvideo vae_kl vae_wan]
        [--out PATH] [--timesteps 0.9 0.5 0.1]

Several timesteps give activations of several noise levels (each one more forward); a VAE decodes
one latent draw (its inputs have no noise level), at most 40 captured calls per close op.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


_DEFAULTS = {"flux": dict(layers=(2, 2), size="1024x1024"), "wan": dict(layers=(2,), size="832x480x81"),
             # round 28: families whose only close op is the GEMM-GELU their blocks declare
             "chroma": dict(layers=(2, 2), size="1024x1024"), "qwenimage": dict(layers=(2,), size="1024x1024"),
             "hunyuanvideo": dict(layers=(1, 2), size="848x480x61"),
             "vae_kl": dict(size="1024x1024"), "vae_wan": dict(size="480x832x17")}
# Captured calls per close op and VAE decode: the Wan decoder's full-resolution norms are ~300 MB
# each, and the first decode runs dozens of them (its recording chunks run NCDHW).
_VAE_MAX_PER_OP = 40


def _capture_vae(name: str, seed: int) -> tuple[dict, dict]:
    """One decode of a random-weight VAE at its bench size, mounted lossless: the close ops'
    captured batches and the meta entry."""
    import torch
    from diffusers import AutoencoderKL, AutoencoderKLWan

    import ditfuse
    from ditfuse.models import capture_admission_batches
    from tests.gpu.test_vae_gpu import FLUX_VAE, WAN_VAE

    torch.manual_seed(0)  # the same weights for every latent draw
    if name == "vae_kl":
        vae = AutoencoderKL(**FLUX_VAE).to("cuda", torch.bfloat16).eval()
        lat = (1, 16, 128, 128)
        note = "AutoencoderKL (FLUX.1 / SD3 config), decode at 1024x1024, random bf16 weights"
    else:
        vae = AutoencoderKLWan(**WAN_VAE).to("cuda", torch.bfloat16).eval()
        lat = (1, 16, 5, 60, 104)
        note = "AutoencoderKLWan (Wan 2.1 config), decode at 480x832 x 17 frames, random bf16 weights"
    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.randn(lat, device="cuda", generator=g).to(torch.bfloat16)
    handle = ditfuse.accelerate(vae)
    try:
        got = capture_admission_batches(vae, run=lambda: vae.decode(z, return_dict=False), max_per_op=_VAE_MAX_PER_OP,
                                       scope="all")
    finally:
        handle.unmount()
    if name == "vae_kl":
        # quality="high" decodes AutoencoderKL channels-last (models/autoencoder_kl.py), where the
        # close GroupNorm reads [N, S, C] rows in place (another kernel than its NCHW one): every
        # captured input is admitted in both layouts
        cl = lambda t: (t.contiguous(memory_format=torch.channels_last) if t.dim() == 4  # noqa: E731
                        else t.transpose(1, 2).contiguous().transpose(1, 2))
        for op, batches in got.items():
            batches.extend([((cl(a[0]), *a[1:]), kw) for a, kw in list(batches) if a[0].dim() >= 3])
        note += "; GroupNorm inputs admitted NCHW and channels-last (the high decode's layout)"
    return got, dict(config="bench_vae", size=_DEFAULTS[name]["size"], note=note)


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
        if name.startswith("vae_"):
            got, meta["families"][name] = _capture_vae(name, seed=0)
            for op, b in got.items():
                batches.setdefault(op, []).extend(b)
            print(f"[admit] {name}: captured in {time.time() - t0:.1f}s", flush=True)
            torch.cuda.empty_cache()
            continue
        fam = families.get(name)
        d = _DEFAULTS[name]
        model = fam.build("dev", d["layers"], load="pretrained")
        handle = ditfuse.accelerate(model)
        for sigma in args.timesteps:
            inp = fam.make_inputs(model, 1, d["size"])
            inp["timestep"] = fam.timestep(sigma, 1, "cuda", torch.bfloat16)
            for op, b in capture_admission_batches(model, inp, scope="all").items():
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
    # Ops this run did not measure keep their records (and their families' meta).
    path = args.out if args.out is not None else admission.results_path()
    records, meta, kept = admission.merge_with_record(results, path, meta)
    if kept:
        print(f"[admit] kept from {path}: {', '.join(kept)}", flush=True)
    path = admission.write_records(records, args.out, meta)
    print(f"[admit] wrote {path}")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / "admission_results.json")
    print()
    print(admission.format_table(results))
    return 0 if all(r.admitted for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
