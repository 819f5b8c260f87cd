"""ditfuse under diffusers' context parallelism (Ulysses) on CPU: 2 ranks, gloo, the kernels under
the Triton interpreter. Each rank runs tests/support/context_parallel.py (the same harness the
multi-GPU run uses with NCCL and ``--strict``) and writes what it saw; this test asserts on it.

What the CPU can prove: both mount orders (ditfuse before / after ``enable_parallelism``) give
output bitwise equal to diffusers' own context-parallel run on every rank, every op of the adapter
reached the gate on every rank (each rank verifies its own signatures), and the attention
modules saw the rank-local sequence. What it cannot: that the kernels stay verified (on CPU they
replicate CUDA's reduction orders, not the CPU's, so the gate falls back for the norms — as it
does on every CPU run), and ring attention (needs a flash / cuDNN backend). Both are in the GPU
commands of docs/parallel.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ditfuse.models import families

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "support" / "context_parallel.py"




def _run_ranks(tmp_path: Path, *args: str, world: int = 2) -> list[dict]:
    out = tmp_path / "ranks"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
           "--standalone", str(HARNESS), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"ranks failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    assert [r["rank"] for r in ranks] == list(range(world))
    return ranks


def _adapter_ops(family: str) -> tuple[str, ...]:
    from ditfuse.models import adapters

    return next(a for a in adapters() if a.family == family).ops()


@pytest.mark.slow  # 2 torchrun ranks, the kernels under the interpreter: ~12 s each
@pytest.mark.parametrize(
    "family,config,batch,extra",
    # Qwen-Image in bf16: on this CPU an fp32 complex multiply rounds unlike CUDA's, so in fp32
    # its QK op (correctly) falls back at the gate; in bf16 the kernel verifies and runs.
    [("flux", "tiny", 2, ()), ("wan", "tiny", 1, ()), ("wan", "tiny-i2v", 1, ()),
     ("qwenimage", "tiny", 2, ("--dtype", "bfloat16"))],
    ids=["flux-b2", "wan-t2v", "wan-i2v", "qwenimage-b2"],
)
def test_ulysses_bitwise_equal_to_diffusers_context_parallel(tmp_path, family, config, batch, extra):
    ranks = _run_ranks(tmp_path, "--family", family, "--config", config, "--batch", str(batch), "--mode", "ulysses",
                       *extra)
    ops = _adapter_ops(family)
    for r in ranks:
        assert set(r["checks"]) == {"after", "before"}
        world = r["world"]
        for order, c in r["checks"].items():
            where = f"rank {r['rank']}, accelerate {order} enable_parallelism"
            assert c["status"] == "mounted", where
            assert c["equal"] == [True, True], f"{where}: {c['mismatch']}"
            for op in ops:
                seen = c["calls"].get(op, {})
                assert seen.get("verify", 0) >= 1, f"{where}: {op} never reached the gate on this rank: {seen}"
            if extra:  # bf16: every op verified bitwise on the rank's shard and none fell back
                assert not c["fallbacks"] and not c["disabled"], f"{where}: {c['fallbacks']} {c['disabled']}"
            # the fast forwards ran on the rank's shard, as diffusers' forward does
            assert c["attention_lengths"] == r["attention_lengths_ref"], where
            assert max(c["attention_lengths"]) * world == max(r["attention_lengths_single"]), where
        assert r["checks"]["after"]["equal_after_unmount"], f"rank {r['rank']}: unmount changed the output"


def test_harness_sizes_split_evenly():
    """The harness' default sizes give token counts every rank gets an equal share of (2 and 4
    ranks), which diffusers' equipartition sharding needs."""
    import torch

    from tests.support.context_parallel import SIZES

    for (family, config), (size, txt) in SIZES.items():
        fam = families.get(family)
        dims = [int(v) for v in size.split("x")]
        if family in ("flux", "qwenimage"):  # 2x2-packed latents of a /8 VAE
            tokens = (dims[0] // 16) * (dims[1] // 16)
        else:
            s = 16 if fam.configs[config].get("in_channels") == 48 else 8
            tokens = ((dims[2] - 1) // 4 + 1) * (dims[1] // s // 2) * (dims[0] // s // 2)
        for world in (2, 4):
            assert tokens % world == 0 and txt % world == 0, (family, config, tokens, txt, world)
    assert torch  # imported for the family fixtures' lazy torch use


@pytest.mark.parametrize("provider", ["eager", "lossless"])
def test_bench_parallel_scaling_efficiency(tmp_path, provider):
    """bench/bench_parallel.py --summarize: speed-up t1/tN and efficiency t1/(N tN) against the
    1-GPU row of the same family, size, batch and provider (other rows are left without)."""
    import csv
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_parallel", ROOT / "bench" / "bench_parallel.py")
    bp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp)
    path = tmp_path / "p.csv"
    rows = [
        dict(family="flux", config="dev", size="1024x1024", batch=1, world=1, mode="none", provider=provider, median_ms=130.0),
        dict(family="flux", config="dev", size="1024x1024", batch=1, world=2, mode="ulysses", provider=provider, median_ms=80.0),
        dict(family="flux", config="dev", size="1024x1024", batch=2, world=2, mode="ring", provider=provider, median_ms=150.0),
    ]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bp.FIELDS, restval="")
        w.writeheader()
        w.writerows(rows)
    out = bp.summarize(path)
    assert (out[0]["speedup"], out[0]["efficiency"]) == (1.0, 1.0)
    assert (out[1]["speedup"], out[1]["efficiency"]) == (1.625, 0.812)
    assert (out[2]["speedup"], out[2]["efficiency"]) == ("", "")  # no 1-GPU row at batch 2
