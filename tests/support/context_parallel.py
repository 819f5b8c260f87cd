"""ditfuse under diffusers' context parallelism: one rank's check, run under torchrun.

    torchrun --nproc-per-node 2 tests/support/context_parallel.py --family flux --mode ulysses --out DIR

Every rank builds the same random-weight transformer (a family fixture, same seed) and the same
inputs, then compares, bitwise:

- ``ref``: diffusers' own context-parallel forward (``enable_parallelism``; every rank gets the
  gathered output from the ``proj_out`` gather hook);
- ``after``: the same model with ``ditfuse.accelerate`` mounted after ``enable_parallelism``;
- ``before``: a fresh model accelerated first, then ``enable_parallelism`` (hook order reversed:
  ditfuse's hooks must stay at the bottom of each module's chain, see models/base.py).

Each rank writes ``rank<r>.json`` to ``--out``: the comparisons, the gate's per-op calls, verified
signatures and disabled ops on that rank, and the sequence lengths the attention modules saw
(rank-local: the total divided by the world size). The caller (tests/cpu/test_context_parallel.py on
CPU with gloo, tests/gpu/multi/ on GPUs with NCCL) asserts on them; ``--strict`` also makes the rank
fail on GPU when anything fell back.

On CPU, diffusers 0.42.1's ``_resolve_parallel_config`` computes ``rank % torch.accelerator.
device_count()``, which is 0 without an accelerator: the harness reports one device there (the
mesh is built on "cpu" and gloo does the collectives). Ring attention needs an attention backend
that returns the log-sum-exp (flash / cuDNN), none of which runs on CPU: ring is GPU-only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# NVLink multicast stays off on our GPU machines, in every process (set before torch/NCCL load).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels run under the Triton interpreter

# Sizes whose token counts split evenly over 2 and 4 ranks (text and image alike for FLUX).
SIZES = {
    ("flux", "tiny"): ("64x64", 8),  # 16 image + 8 text tokens
    ("flux", "dev"): ("1024x1024", 512),
    ("wan", "tiny"): ("64x64x5", 8),  # 2 latent frames x 4 x 4 = 32 tokens
    ("wan", "tiny-i2v"): ("64x64x5", 8),
    ("wan", "dev"): ("832x480x81", 512),
    ("qwenimage", "tiny"): ("64x64", 8),  # 16 image + 8 text tokens
    ("qwenimage", "dev"): ("1024x1024", 512),
}


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=["flux", "wan", "qwenimage"], default="flux")
    p.add_argument("--config", default="tiny", help="family config (tiny, tiny-i2v, dev)")
    p.add_argument("--layers", default=None, help="layer counts, e.g. 2,2 (flux) or 2 (wan)")
    p.add_argument("--mode", choices=["ulysses", "ring"], default="ulysses")
    p.add_argument("--backend", default=None, help="attention backend (default: native on CPU, _native_cudnn on GPU)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--size", default=None)
    p.add_argument("--txt", type=int, default=None)
    p.add_argument("--orders", default="after,before", help="which mount orders to check")
    p.add_argument("--strict", action="store_true", help="fail the rank if any op fell back or was disabled")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def _build(fam, args, device, dtype):
    layers = tuple(int(v) for v in args.layers.split(",")) if args.layers else None
    model = fam.build(args.config, layers=layers, device=device, dtype=dtype, seed=0)
    if args.backend:
        model.set_attention_backend(args.backend)
    return model


def _cp_config(args, world: int):
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=world) if args.mode == "ulysses" else ContextParallelConfig(ring_degree=world)


def _local_lengths(model) -> tuple[list[int], list]:
    """Record the sequence length every attention module sees (torch forward pre-hooks run
    before the module's diffusers hook chain, i.e. after the block-level splits)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention  # Qwen-Image's (not a mixin subclass)

    seen: list[int] = []
    handles = []
    for mod in model.modules():
        if isinstance(mod, (AttentionModuleMixin, Attention)):
            def pre(_m, args, kwargs):
                hs = kwargs.get("hidden_states", args[0] if args else None)
                if isinstance(hs, torch.Tensor):
                    seen.append(int(hs.shape[1]))
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
    return seen, handles


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import ditfuse
    from ditfuse.kernels.compare import compare_outputs
    from ditfuse.models import families

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        device = "cpu"
        torch.accelerator.device_count = lambda: 1  # see the module docstring
    args.backend = args.backend or ("_native_cudnn" if cuda else "native")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    fam = families.get(args.family)
    size, txt = SIZES.get((args.family, args.config), (None, None))
    size, txt = args.size or size, args.txt or txt
    model = _build(fam, args, device, dtype)
    inputs = fam.make_inputs(model, batch=args.batch, size=size, seed=1, device=device, dtype=dtype, txt_tokens=txt)

    def forward(model):
        with torch.no_grad():
            out = model(**inputs)[0]
        if cuda:
            torch.cuda.synchronize()
        return out

    result: dict = {"rank": rank, "world": world, "device": device, "mode": args.mode, "backend": args.backend,
                    "family": args.family, "config": args.config, "dtype": str(dtype), "size": size, "txt": txt,
                    "batch": args.batch, "checks": {}}
    seen_single, handles = _local_lengths(model)
    forward(model)  # without context parallelism: the whole sequence on every rank
    for h in handles:
        h.remove()
    result["attention_lengths_single"] = sorted(set(seen_single))
    model.enable_parallelism(config=_cp_config(args, world))
    seen_ref, handles = _local_lengths(model)
    ref = forward(model)
    for h in handles:
        h.remove()
    result["ref_shape"] = list(ref.shape)
    result["attention_lengths_ref"] = sorted(set(seen_ref))

    orders = [o for o in args.orders.split(",") if o]
    for order in orders:
        ditfuse.gate.reset()
        if order == "after":
            target = model
            handle = ditfuse.accelerate(target)
        else:
            target = _build(fam, args, device, dtype)
            handle = ditfuse.accelerate(target)
            target.enable_parallelism(config=_cp_config(args, world))
        seen, handles = _local_lengths(target)
        first = forward(target)
        second = forward(target)
        for h in handles:
            h.remove()
        rep = ditfuse.gate.report()
        comp = handle.report().components[0]
        mm = [compare_outputs(o, ref, f"{order} call {i + 1}") for i, o in enumerate((first, second))]
        result["checks"][order] = {
            "status": comp.status,
            "sites": len(comp.sites),
            "equal": [m is None for m in mm],
            "mismatch": [str(m) for m in mm if m is not None],
            "calls": {op: dict(c) for op, c in rep.calls.items()},
            "verified": {op: len(s) for op, s in rep.verified.items()},
            "disabled": dict(rep.disabled),
            "fallbacks": [f"{f.op}: {f.reason}" for f in rep.fallbacks],
            "attention_lengths": sorted(set(seen)),
        }
        handle.unmount()
        if order == "after":
            after_unmount = forward(model)
            m = compare_outputs(after_unmount, ref, "after unmount")
            result["checks"][order]["equal_after_unmount"] = m is None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    ok = all(all(c["equal"]) for c in result["checks"].values())
    if args.strict:
        ok = ok and all(not c["disabled"] and not c["fallbacks"] for c in result["checks"].values())
    print(f"[rank {rank}/{world}] {args.family}/{args.config} {args.mode} {args.backend} {dtype}: "
          + ", ".join(f"{o} equal={c['equal']} disabled={sorted(c['disabled'])}" for o, c in result["checks"].items()),
          flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `import tests...`
    code = main()
    # The rank's result is on disk and its process group destroyed. Skip the interpreter's teardown:
    # once in ~13 CPU CI runs a rank aborted (SIGABRT) there, in a C++ destructor after everything
    # this harness checks had finished, and torchrun then reports the run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
