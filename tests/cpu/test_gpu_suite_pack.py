"""scripts/gpu_suite.sh's packing: the device tool returns at most 8 files from $OUT, so past that
every result file but suite.log goes into results.tar.gz (PACK=auto), always with PACK=1, never
with PACK=0. Runs the script with a phase name that matches nothing (no GPU, no Python phase)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def _run(out: Path, n: int, pack: str | None) -> set[str]:
    out.mkdir()
    for i in range(n):
        (out / f"r{i}.csv").write_text(f"row {i}\n")
    env = dict(os.environ, OUT=str(out), CARD="cpu")
    if pack is not None:
        env["PACK"] = pack
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), "no-such-phase"], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=120)
    return {p.name for p in out.iterdir()}


@pytest.mark.parametrize("n,pack,packed", [(7, None, False), (8, None, True), (2, "1", True), (12, "0", False)])
def test_results_packed_past_the_device_limit(tmp_path, n, pack, packed):
    names = _run(tmp_path / "out", n, pack)
    assert "suite.log" in names
    if packed:
        assert names == {"suite.log", "results.tar.gz"}, names
        with tarfile.open(tmp_path / "out" / "results.tar.gz") as tf:
            assert sorted(tf.getnames()) == sorted(f"r{i}.csv" for i in range(n))
        assert "packed" in (tmp_path / "out" / "suite.log").read_text()
    else:
        assert names == {"suite.log", *(f"r{i}.csv" for i in range(n))}, names
