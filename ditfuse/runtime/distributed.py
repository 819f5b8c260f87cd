"""One generation spread over several devices: diffusers' context parallelism under torchrun.

``ditfuse generate --gpus N`` (or ``--devices cuda:0,cuda:1`` / ``cpu,cpu``) re-runs the same
command under ``torch.distributed.run`` with N processes. Each process (rank) loads the pipeline
on its own device, enables diffusers' context parallelism on every transformer of the pipeline
(``ContextParallelConfig``: Ulysses all-to-all or ring attention over all ranks; Wan 2.2's two
experts both), mounts ditfuse as usual, and runs the whole pipeline with the same seed; the
transformer's sequence is split across the ranks and gathered at its output by diffusers' hooks,
so every rank ends with the same latents and decodes them (the VAE is not parallel). Rank 0 alone
prints and writes the output file. See docs/parallel.md.

NVLink multicast stays off in every process started here (:data:`MULTICAST_OFF`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# Set in every process ditfuse starts for several GPUs, before NCCL loads (our machines need it).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MODES = ("ulysses", "ring")


@dataclass(frozen=True)
class ParallelPlan:
    """What ``--gpus`` / ``--devices`` / ``--parallel-mode`` asked for: ``devices`` (one per rank)
    and the attention ``mode``."""

    devices: tuple[str, ...]
    mode: str = "ulysses"

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def cuda(self) -> bool:
        return self.devices[0].startswith("cuda")


def plan_from_args(gpus: int | None, devices: str | None, mode: str = "ulysses") -> ParallelPlan | None:
    """The plan for these arguments, or None for an ordinary single-process run. ValueError, with
    the reason, for anything that cannot run: too few GPUs, mixed device kinds, ring on CPU."""
    if mode not in MODES:
        raise ValueError(f"--parallel-mode must be one of {', '.join(MODES)}, got {mode!r}")
    if devices:
        devs = tuple(d.strip() for d in devices.split(",") if d.strip())
        kinds = {d.split(":")[0] for d in devs}
        if not devs or not kinds <= {"cpu", "cuda"} or len(kinds) > 1:
            raise ValueError(f"--devices takes a comma-separated list of one kind (cuda:0,cuda:1 or cpu,cpu), got {devices!r}")
        if gpus not in (None, 1, len(devs)):
            raise ValueError(f"--gpus {gpus} does not match --devices ({len(devs)} devices)")
        if "cuda" in kinds:
            devs = tuple(d if ":" in d else f"cuda:{i}" for i, d in enumerate(devs))
            if len(set(devs)) != len(devs):
                raise ValueError(f"--devices lists a GPU twice: {devices!r}")
            _check_cuda_count(max(int(d.split(":")[1]) for d in devs) + 1)
    else:
        n = 1 if gpus is None else int(gpus)
        if n < 1:
            raise ValueError(f"--gpus must be >= 1, got {n}")
        if n == 1:
            return None
        _check_cuda_count(n)
        devs = tuple(f"cuda:{i}" for i in range(n))
    if len(devs) == 1:
        return None
    if mode == "ring" and devs[0] == "cpu":
        raise ValueError("ring attention needs a GPU attention backend that returns the log-sum-exp "
                         "(cuDNN, flash); on CPU use --parallel-mode ulysses")
    return ParallelPlan(devs, mode)


def _check_cuda_count(n: int) -> None:
    import torch

    have = torch.cuda.device_count()
    if have < n:
        raise ValueError(f"asked for {n} GPUs, but {have} CUDA device{'s are' if have != 1 else ' is'} visible")


def in_launched_rank() -> bool:
    """True inside a process started by :func:`launch` (torchrun sets WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch(plan: ParallelPlan, argv: list[str]) -> int:
    """Run ``ditfuse <argv>`` again under torchrun with one process per device; returns its exit
    status (non-zero when any rank failed)."""
    env = dict(os.environ, **MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(plan.world),
           "-m", "ditfuse.runtime.cli", *argv]
    print(f"parallel: {plan.world} processes ({', '.join(plan.devices)}), context parallelism ({plan.mode})",
          flush=True)
    return subprocess.run(cmd, env=env).returncode


@dataclass
class Rank:
    """This process' place in a launched run (see :func:`init_rank`)."""

    rank: int
    world: int
    device: str
    plan: ParallelPlan

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_rank(plan: ParallelPlan) -> Rank:
    """Join the process group torchrun set up (NCCL on GPUs, gloo on CPU) and pick this rank's
    device."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != plan.world:
        raise RuntimeError(f"launched with {world} processes for {plan.world} devices")
    device = plan.devices[int(os.environ.get("LOCAL_RANK", rank))]
    join_group(rank, world, device)
    return Rank(rank, world, device, plan)


def join_group(rank: int, world: int, device: str, init_method: str | None = None) -> None:
    """Make ``device`` this process' device and join the default process group (NCCL for a GPU,
    gloo for the CPU); ``init_method`` None reads torchrun's environment."""
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        # diffusers 0.42.1's enable_parallelism computes rank % torch.accelerator.device_count(),
        # which is 0 without an accelerator; CPU ranks (tests, debugging) count as one device.
        torch.accelerator.device_count = lambda: 1
    if not dist.is_initialized():
        kw = {} if init_method is None else {"init_method": init_method, "rank": rank, "world_size": world}
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", **kw)


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any (a collective: every rank must call it at
    the same point, e.g. the per-step stop check of a context-parallel batch, so that all ranks
    stop at the same step instead of one waiting forever in the next all-to-all)."""
    import torch
    import torch.distributed as dist

    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def enable_context_parallel(pipe: Any, rank: Rank | None = None, *, mode: str | None = None,
                            world: int | None = None) -> list[str]:
    """diffusers' context parallelism on every component of ``pipe`` that has a context-parallel
    plan (its transformers); returns their names. Ring attention gets the cuDNN backend (native
    SDPA returns no log-sum-exp). ``rank`` gives the mode and world size, or pass them."""
    import torch
    from diffusers import ContextParallelConfig

    mode = mode or rank.plan.mode
    world = world or rank.world
    done = []
    for name, comp in (getattr(pipe, "components", None) or {}).items():
        if not isinstance(comp, torch.nn.Module) or getattr(comp, "_cp_plan", None) is None:
            continue
        if mode == "ring":
            comp.set_attention_backend("_native_cudnn")
        cfg = ContextParallelConfig(ulysses_degree=world) if mode == "ulysses" else ContextParallelConfig(ring_degree=world)
        comp.enable_parallelism(config=cfg)
        done.append(name)
    if not done:
        raise ValueError(f"{type(pipe).__name__} has no component with a diffusers context-parallel plan")
    return done


def finish(rank: Rank) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
