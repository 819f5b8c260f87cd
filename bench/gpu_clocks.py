"""What the GPU's clocks and power did while a benchmark ran: ``nvidia-smi`` polled in the background.

Round 27's question: in the fused FLUX.1 step the same cuBLAS GEMM and cuDNN attention kernels run
7-12 % slower than in eager's step (H200: GEMM 82.9 vs 77.1 ms, attention 25.7 vs 23.0 ms). One
explanation is the power limiter: the fused step leaves the GPU fewer idle gaps, so its average
power is higher and the boost clock lower. :class:`ClockSampler` records the SM clock, the power
draw and the active clock-event ("throttle") reasons during a timed region so a benchmark row can
say which clock it ran at instead of leaving that to inference.

Nothing here needs a GPU to import; where ``nvidia-smi`` is missing or cannot be queried the
sampler says so once and its summary is empty (a benchmark never fails for want of clocks).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

# nvidia-smi's clock-event reason bits (nvml's nvmlClocksEventReasons)
REASONS = {
    0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
    0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
}

# (our name, nvidia-smi query fields tried in order: newer drivers renamed some)
FIELDS = (
    ("sm_mhz", ("clocks.sm",)),
    ("mem_mhz", ("clocks.mem",)),
    ("power_w", ("power.draw.instant", "power.draw")),
    ("power_limit_w", ("enforced.power.limit", "power.limit")),
    ("temp_c", ("temperature.gpu",)),
    ("reasons", ("clocks_event_reasons.active", "clocks_throttle_reasons.active")),
)

_field_cache: dict[str, list[tuple[str, str]]] = {}


def _valid_fields(gpu: str, smi: str) -> list[tuple[str, str]]:
    """The first field of each FIELDS entry that this driver's nvidia-smi answers (probed once)."""
    if gpu in _field_cache:
        return _field_cache[gpu]
    chosen: list[tuple[str, str]] = []
    for name, candidates in FIELDS:
        for f in candidates:
            r = subprocess.run([smi, f"--query-gpu={f}", "--format=csv,noheader,nounits", "-i", gpu],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 and r.stdout.strip() and "not a valid" not in r.stdout.lower():
                chosen.append((name, f))
                break
    _field_cache[gpu] = chosen
    return chosen


def parse_value(name: str, text: str) -> float | None:
    """One nvidia-smi value as a number (``reasons``: the hex bit mask); None for "[N/A]" and the like."""
    text = text.strip()
    try:
        return float(int(text, 16)) if name == "reasons" else float(text)
    except ValueError:
        return None


def summarize(samples: list[dict[str, float | None]]) -> dict[str, float]:
    """Mean / min / max SM clock, mean / max power, the power limit, max temperature, and the share
    (%) of samples in which the SW power cap, a thermal or HW slowdown held the clock down."""
    out: dict[str, float] = {}
    if not samples:
        return out

    def col(k: str) -> list[float]:
        return [s[k] for s in samples if s.get(k) is not None]  # type: ignore[misc]

    sm, pw, temp, lim, mem = col("sm_mhz"), col("power_w"), col("temp_c"), col("power_limit_w"), col("mem_mhz")
    if sm:
        out.update(sm_mhz=statistics.fmean(sm), sm_mhz_min=min(sm), sm_mhz_max=max(sm))
    if mem:
        out["mem_mhz"] = statistics.fmean(mem)
    if pw:
        out.update(power_w=statistics.fmean(pw), power_w_max=max(pw))
    if lim:
        out["power_limit_w"] = max(lim)
    if temp:
        out["temp_c_max"] = max(temp)
    reasons = [int(r) for r in col("reasons")]
    if reasons:
        out["power_capped_pct"] = 100.0 * sum(1 for r in reasons if r & 0x4) / len(reasons)
        out["slowdown_pct"] = 100.0 * sum(1 for r in reasons if r & (0x8 | 0x20 | 0x40 | 0x80)) / len(reasons)
    out["samples"] = float(len(samples))
    return out


def describe(s: dict[str, float]) -> str:
    """One line for a log: ``SM 1755 MHz (1650-1980), 640 W of 700, power-capped 85 %``."""
    if not s:
        return "clocks n/a"
    parts = []
    if "sm_mhz" in s:
        parts.append(f"SM {s['sm_mhz']:.0f} MHz ({s['sm_mhz_min']:.0f}-{s['sm_mhz_max']:.0f})")
    if "power_w" in s:
        parts.append(f"{s['power_w']:.0f} W" + (f" of {s['power_limit_w']:.0f}" if "power_limit_w" in s else ""))
    if "power_capped_pct" in s:
        parts.append(f"power-capped {s['power_capped_pct']:.0f} %")
    if s.get("slowdown_pct"):
        parts.append(f"thermal/HW slowdown {s['slowdown_pct']:.0f} %")
    if "temp_c_max" in s:
        parts.append(f"<= {s['temp_c_max']:.0f} C")
    return ", ".join(parts) + f" [{int(s.get('samples', 0))} samples]"


def _gpu_id(device: int) -> str:
    """nvidia-smi's id for torch's CUDA device ``device``: its PCI bus id where torch reports one
    (CUDA_VISIBLE_DEVICES renumbers devices, nvidia-smi does not), else the index."""
    try:
        import torch

        p = torch.cuda.get_device_properties(device)
        return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
    except Exception:
        return str(device)


class ClockSampler:
    """Context manager: polls nvidia-smi every ``interval_ms`` while the block runs; ``summary``
    afterwards (see :func:`summarize`), empty when nvidia-smi is unavailable (``error`` says why)."""

    def __init__(self, device: int = 0, interval_ms: int = 50) -> None:
        self.device, self.interval_ms = device, interval_ms
        self.samples: list[dict[str, float | None]] = []
        self.summary: dict[str, float] = {}
        self.error: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._fields: list[tuple[str, str]] = []

    def __enter__(self) -> "ClockSampler":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.error = "nvidia-smi not found"
            return self
        try:
            gpu = _gpu_id(self.device)
            self._fields = _valid_fields(gpu, smi)
            if not self._fields:
                self.error = "nvidia-smi answered none of the clock/power fields"
                return self
            self._proc = subprocess.Popen(
                [smi, "--query-gpu=" + ",".join(f for _, f in self._fields), "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms), "-i", gpu],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except Exception as e:  # a benchmark runs on without clocks
            self.error = f"{type(e).__name__}: {e}"
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        time.sleep(0.05)  # nvidia-smi's first sample lands before the measured work starts
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            vals = line.strip().split(",")
            if len(vals) != len(self._fields):
                continue
            self.samples.append({name: parse_value(name, v) for (name, _), v in zip(self._fields, vals)})

    def __exit__(self, *exc: Any) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            if self._thread is not None:
                self._thread.join(timeout=5)
        self.summary = summarize(self.samples)
        if self._proc is not None and not self.samples and self.error is None:
            self.error = "nvidia-smi returned no samples"
