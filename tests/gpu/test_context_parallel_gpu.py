"""ditfuse under diffusers' context parallelism on 2 GPUs (NCCL): each case runs
tests/support/context_parallel.py under ``torchrun --nproc-per-node 2 --strict``; every rank's
output, with ditfuse mounted before or after ``enable_parallelism``, must be bitwise equal to
diffusers' own context-parallel output, with every op verified on that rank and nothing fallen
back. Skipped with fewer than 2 GPUs (run it on the device tool's nvidia-h200-x2 kind; the
commands are in docs/parallel.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "context_parallel.py"

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

CASES = [
    # family, config, layers, size, txt, batch, mode, backend
    ("flux", "tiny", "", "64x64", "8", 2, "ulysses", "native"),
    ("flux", "dev", "2,2", "1024x1024", "512", 1, "ulysses", "_native_cudnn"),
    ("flux", "dev", "2,2", "1024x1024", "512", 2, "ring", "_native_cudnn"),
    ("flux", "dev", "2,2", "512x768", "64", 1, "ring", "_native_cudnn"),
    ("wan", "tiny", "", "64x64x5", "8", 2, "ulysses", "native"),
    ("wan", "dev", "2", "832x480x81", "512", 1, "ulysses", "_native_cudnn"),
    ("wan", "dev", "2", "832x480x81", "512", 1, "ring", "_native_cudnn"),
    ("wan", "tiny-i2v", "", "64x64x5", "8", 1, "ring", "_native_cudnn"),
]


@pytest.mark.parametrize("family,config,layers,size,txt,batch,mode,backend", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}-b{c[5]}-{c[6]}" for c in CASES])
def test_context_parallel_bitwise_and_verified(tmp_path, family, config, layers, size, txt, batch, mode, backend):
    out = tmp_path / "ranks"
    args = ["--family", family, "--config", config, "--size", size, "--txt", txt, "--batch", str(batch),
            "--mode", mode, "--backend", backend, "--dtype", "bfloat16", "--strict", "--out", str(out)]
    if layers:
        args += ["--layers", layers]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HARNESS), *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    for r in range(2):
        rank = json.loads((out / f"rank{r}.json").read_text())
        for order, c in rank["checks"].items():
            where = f"rank {r}, accelerate {order} enable_parallelism"
            assert c["equal"] == [True, True], f"{where}: {c['mismatch']}"
            assert not c["disabled"] and not c["fallbacks"], f"{where}: {c['disabled']} {c['fallbacks']}"
            assert c["verified"] and all(n >= 1 for n in c["verified"].values()), where
            assert all(calls.get("kernel", 0) > 0 for calls in c["calls"].values()), f"{where}: {c['calls']}"
        assert rank["checks"]["after"]["equal_after_unmount"]
