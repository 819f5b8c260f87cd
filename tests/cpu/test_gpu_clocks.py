"""bench/gpu_clocks.py: nvidia-smi's answers parsed and summarised; a fake nvidia-smi on PATH
stands in for the driver (this machine has none)."""

import importlib.util
import os
import stat
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_clocks", Path(__file__).resolve().parents[2] / "bench" / "gpu_clocks.py")
gpu_clocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_clocks)


def test_parse_values():
    assert gpu_clocks.parse_value("sm_mhz", " 1980 ") == 1980.0
    assert gpu_clocks.parse_value("power_w", "[N/A]") is None
    assert gpu_clocks.parse_value("reasons", "0x0000000000000004") == 4.0
    assert gpu_clocks.parse_value("reasons", "0x0000000000000001") == 1.0


def test_summarize_shares_and_extremes():
    s = gpu_clocks.summarize([
        dict(sm_mhz=1980.0, power_w=500.0, power_limit_w=700.0, temp_c=50.0, reasons=0.0),
        dict(sm_mhz=1600.0, power_w=690.0, power_limit_w=700.0, temp_c=60.0, reasons=4.0),
        dict(sm_mhz=1700.0, power_w=None, power_limit_w=700.0, temp_c=55.0, reasons=float(0x4 | 0x20)),
        dict(sm_mhz=1720.0, power_w=700.0, power_limit_w=700.0, temp_c=58.0, reasons=None),
    ])
    assert s["sm_mhz"] == pytest.approx((1980 + 1600 + 1700 + 1720) / 4)
    assert (s["sm_mhz_min"], s["sm_mhz_max"]) == (1600.0, 1980.0)
    assert s["power_w"] == pytest.approx((500 + 690 + 700) / 3) and s["power_w_max"] == 700.0
    # reasons: three samples answered; two had the SW power cap bit, one a thermal bit
    assert s["power_capped_pct"] == pytest.approx(200 / 3)
    assert s["slowdown_pct"] == pytest.approx(100 / 3)
    assert s["temp_c_max"] == 60.0 and s["samples"] == 4.0
    line = gpu_clocks.describe(s)
    assert "SM 1750 MHz (1600-1980)" in line and "power-capped 67 %" in line and "of 700" in line
    assert gpu_clocks.summarize([]) == {} and gpu_clocks.describe({}) == "clocks n/a"


FAKE = r"""#!/bin/sh
# a stand-in for nvidia-smi: answers single queries, loops when asked to (-lms)
q=""; loop=""
for a in "$@"; do
  case "$a" in --query-gpu=*) q="${a#--query-gpu=}";; -lms) loop=1;; esac
done
case "$q" in *throttle*|*power.draw.instant*) echo "Field is not a valid field to query."; exit 2;; esac
line=""
IFS=,; for f in $q; do
  case "$f" in
    clocks.sm) v=1755;; clocks.mem) v=3201;; power.draw) v=688.5;; enforced.power.limit) v=700.00;;
    temperature.gpu) v=61;; clocks_event_reasons.active) v=0x0000000000000004;; *) v=0;;
  esac
  line="${line:+$line, }$v"
done
if [ -z "$loop" ]; then echo "$line"; exit 0; fi
while true; do echo "$line"; sleep 0.02; done
"""


def test_sampler_reads_a_looping_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(FAKE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpu_clocks._field_cache.clear()
    with gpu_clocks.ClockSampler(0, interval_ms=20) as cs:
        time.sleep(0.4)
    assert cs.error is None, cs.error
    # the renamed fields fall back: power.draw.instant -> power.draw, throttle -> event reasons
    assert [f for _, f in cs._fields] == ["clocks.sm", "clocks.mem", "power.draw", "enforced.power.limit",
                                          "temperature.gpu", "clocks_event_reasons.active"]
    s = cs.summary
    assert s["samples"] >= 3
    assert s["sm_mhz"] == 1755.0 and s["power_w"] == 688.5 and s["power_capped_pct"] == 100.0
    assert s["power_limit_w"] == 700.0 and s["mem_mhz"] == 3201.0


def test_sampler_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_clocks.ClockSampler(0) as cs:
        pass
    assert cs.summary == {} and cs.error == "nvidia-smi not found"
