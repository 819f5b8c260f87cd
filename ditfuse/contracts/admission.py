"""The admission test for close kernels, and the committed record of its results.

A close kernel differs from the eager chain it replaces at rounding-order level. It may be mounted
(quality="high") only if, on realistic inputs, it is at least about as accurate as eager against
an fp64 evaluation of the same math (:mod:`ditfuse.kernels.exact`):

- RMS error <= 1.5x eager's RMS error,
- max abs error <= 1.5x eager's max abs error,
- |mean error| (bias) <= 0.25x eager's RMS error,
- NaN / +Inf / -Inf in exactly the places eager has them.

Errors are taken over the elements where the fp64 value and both outputs are finite, accumulated
over every input batch; a chain with several outputs (``(h, n)``) must pass on each, and the
reported ratios are the worst over the outputs.

:func:`evaluate` runs the test. The results measured on the GPU (``bench/admit.py``, on activations
captured from a FLUX.1-dev-size forward) are committed as ``admission_results.json`` next to this
module (``DITFUSE_ADMISSION`` overrides the path). :func:`admission_problem` reads that record:
a close op with no record, or whose record says it failed, is not admitted and its sites' guards
fail with ``"not admitted: ..."``. Tests inject records with :func:`override_records`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kernels.errors import UnsupportedInput

RMS_LIMIT = 1.5
MAX_LIMIT = 1.5
BIAS_LIMIT = 0.25

RESULTS_PATH = Path(__file__).with_name("admission_results.json")

Batch = tuple[tuple[Any, ...], dict[str, Any]]


# ------------------------------------------------------------------------------ measuring


@dataclass
class _Acc:
    """Running error statistics of one output against fp64."""

    n: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    max: float = 0.0

    def add(self, err: torch.Tensor) -> None:
        if err.numel() == 0:
            return
        self.n += err.numel()
        self.sum += float(err.sum())
        self.sumsq += float(err.pow(2).sum())
        self.max = max(self.max, float(err.abs().max()))

    @property
    def rms(self) -> float:
        return math.sqrt(self.sumsq / self.n) if self.n else 0.0

    @property
    def mean(self) -> float:
        return self.sum / self.n if self.n else 0.0


def _ratio(a: float, b: float) -> float:
    """a / b; two zero errors are equal (1.0); any error where eager has none is infinitely worse."""
    if b > 0:
        return a / b
    return 1.0 if a == 0 else math.inf


def _bias_ratio(mean: float, eager_rms: float) -> float:
    if eager_rms > 0:
        return abs(mean) / eager_rms
    return 0.0 if mean == 0 else math.inf


@dataclass
class AdmissionResult:
    op: str
    rms_ratio: float
    max_ratio: float
    bias_ratio: float
    nonfinite_same: bool
    admitted: bool
    measured_on: str
    kernel_rms: float = 0.0
    eager_rms: float = 0.0
    kernel_max: float = 0.0
    eager_max: float = 0.0
    kernel_mean: float = 0.0
    eager_mean: float = 0.0
    elements: int = 0
    batches: int = 0
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():  # JSON has no inf
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = str(v)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AdmissionResult":
        known = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in known}
        for k in ("rms_ratio", "max_ratio", "bias_ratio", "kernel_rms", "eager_rms", "kernel_max",
                  "eager_max", "kernel_mean", "eager_mean"):
            if k in kw:
                kw[k] = float(kw[k])
        return cls(**kw)


def _as_list(x: Any) -> list[torch.Tensor]:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _nonfinite_class(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf."""
    c = torch.zeros(t.shape, dtype=torch.int8, device=t.device)
    c[torch.isnan(t)] = 1
    c[t == math.inf] = 2
    c[t == -math.inf] = 3
    return c


def evaluate(
    op: str,
    kernel: Callable[..., Any],
    eager: Callable[..., Any],
    exact: Callable[..., Any],
    batches: Iterable[Batch],
    measured_on: str | None = None,
) -> AdmissionResult:
    """Run the admission test of ``kernel`` against ``eager`` on ``batches`` of (args, kwargs).

    ``exact`` evaluates the same math in fp64 on the same arguments. Returns the ratios and the
    verdict; see the module docstring for the criteria. A batch the kernel declines
    (:class:`UnsupportedInput`: the op runs eager there) is skipped and counted in
    ``extra["declined_batches"]``.
    """
    k_acc: list[_Acc] = []
    e_acc: list[_Acc] = []
    nonfinite_same = True
    n_batches = 0
    device = None
    declined = 0
    with torch.no_grad():
        for args, kwargs in batches:
            try:
                # copied: an op writing into an ``out=`` argument returns it, and eager's chain
                # then writes the same buffer
                ko = [t.clone() for t in _as_list(kernel(*args, **kwargs))]
            except UnsupportedInput:
                declined += 1  # the kernel never runs on it (eager does): nothing to admit there
                continue
            n_batches += 1
            eo = [t.clone() for t in _as_list(eager(*args, **kwargs))]
            xo = _as_list(exact(*args, **kwargs))
            if not (len(ko) == len(eo) == len(xo)):
                raise ValueError(f"{op}: kernel/eager/exact return {len(ko)}/{len(eo)}/{len(xo)} outputs")
            while len(k_acc) < len(ko):
                k_acc.append(_Acc())
                e_acc.append(_Acc())
            for i, (k, e, x) in enumerate(zip(ko, eo, xo)):
                if k.shape != e.shape or x.shape != e.shape:
                    raise ValueError(f"{op}: output {i} shapes differ: kernel {tuple(k.shape)}, "
                                     f"eager {tuple(e.shape)}, exact {tuple(x.shape)}")
                device = e.device
                if not torch.equal(_nonfinite_class(k), _nonfinite_class(e)):
                    nonfinite_same = False
                x = x.to(torch.float64)
                finite = torch.isfinite(x) & torch.isfinite(k) & torch.isfinite(e)
                k_acc[i].add((k.to(torch.float64) - x)[finite])
                e_acc[i].add((e.to(torch.float64) - x)[finite])
    if n_batches == 0:
        raise ValueError(f"{op}: no input batches" + (f" ({declined} declined by the kernel)" if declined else ""))
    rms_r = max(_ratio(k.rms, e.rms) for k, e in zip(k_acc, e_acc))
    max_r = max(_ratio(k.max, e.max) for k, e in zip(k_acc, e_acc))
    bias_r = max(_bias_ratio(k.mean, e.rms) for k, e in zip(k_acc, e_acc))
    reasons = []
    if rms_r > RMS_LIMIT:
        reasons.append(f"RMS error {rms_r:.3f}x eager's > {RMS_LIMIT}x")
    if max_r > MAX_LIMIT:
        reasons.append(f"max error {max_r:.3f}x eager's > {MAX_LIMIT}x")
    if bias_r > BIAS_LIMIT:
        reasons.append(f"mean error (bias) {bias_r:.3f}x eager's RMS error > {BIAS_LIMIT}x")
    if not nonfinite_same:
        reasons.append("NaN/Inf placement differs from eager")
    worst = max(range(len(k_acc)), key=lambda i: _ratio(k_acc[i].rms, e_acc[i].rms))
    if measured_on is None:
        measured_on = _device_name(device)
    return AdmissionResult(
        op=op,
        rms_ratio=rms_r,
        max_ratio=max_r,
        bias_ratio=bias_r,
        nonfinite_same=nonfinite_same,
        admitted=not reasons,
        measured_on=measured_on,
        kernel_rms=k_acc[worst].rms,
        eager_rms=e_acc[worst].rms,
        kernel_max=k_acc[worst].max,
        eager_max=e_acc[worst].max,
        kernel_mean=k_acc[worst].mean,
        eager_mean=e_acc[worst].mean,
        elements=sum(a.n for a in k_acc),
        batches=n_batches,
        reason="; ".join(reasons),
        extra={"declined_batches": declined} if declined else {},
    )


def _device_name(device: torch.device | None) -> str:
    if device is not None and device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{device.type if device is not None else 'cpu'}, torch {torch.__version__}"


def candidates() -> dict[str, Any]:
    """Every registered close op, ``op id -> CloseOp`` (kernel, eager reference and fp64 exact
    math all come from its descriptor)."""
    from .ops import CLOSE

    return dict(CLOSE)


def admit_op(op: str, batches: Iterable[Batch], device: str | torch.device, measured_on: str | None = None) -> AdmissionResult:
    """Admission of registered close op ``op``: its kernel itself (no eager fallback), the eager
    chain and the fp64 math on ``batches``."""
    c = candidates()[op]
    return evaluate(op, c.kernel(device), c.reference, c.exact(), batches, measured_on)


# ------------------------------------------------------------------------------ the record

_lock = threading.Lock()
_cache: dict[str, AdmissionResult] | None = None
_override: dict[str, AdmissionResult] | None = None


def results_path() -> Path:
    env = os.environ.get("DITFUSE_ADMISSION")
    return Path(env).expanduser() if env else RESULTS_PATH


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _records_of(data: Mapping[str, Any]) -> dict[str, AdmissionResult]:
    return {r["op"]: AdmissionResult.from_dict(r) for r in data.get("records", [])}


def _read(path: Path) -> dict[str, AdmissionResult]:
    return _records_of(_load(path))


def merge_with_record(results: Iterable[AdmissionResult], path: Path, meta: Mapping[str, Any]
                      ) -> tuple[list[AdmissionResult], dict[str, Any], list[str]]:
    """``results`` of a run that measured some ops, plus the records of ``path`` for every op it
    did not measure; ``meta["families"]`` merged the same way. Returns (records, meta, the ops
    kept from the file)."""
    results = list(results)
    data = _load(Path(path))
    old_meta, old = data.get("meta", {}), _records_of(data)
    measured = {r.op for r in results}
    kept = [r for op, r in sorted(old.items()) if op not in measured]
    merged = dict(meta)
    merged["families"] = {**old_meta.get("families", {}), **dict(meta.get("families", {}))}
    return results + kept, merged, [r.op for r in kept]


def records() -> dict[str, AdmissionResult]:
    """The admission records in force: injected ones (tests) or the committed JSON."""
    global _cache
    if _override is not None:
        return dict(_override)
    with _lock:
        if _cache is None:
            _cache = _read(results_path())
        return dict(_cache)


def reload() -> None:
    global _cache
    with _lock:
        _cache = None


def write_records(results: Iterable[AdmissionResult], path: Path | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    path = Path(path) if path is not None else results_path()
    data = {
        "criteria": {"rms_ratio_max": RMS_LIMIT, "max_ratio_max": MAX_LIMIT, "bias_ratio_max": BIAS_LIMIT,
                     "nonfinite": "same placement as eager"},
        "meta": dict(meta or {}),
        "records": [r.to_dict() for r in sorted(results, key=lambda r: r.op)],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
    if path == results_path():
        reload()
    return path


@contextlib.contextmanager
def override_records(recs: "Iterable[AdmissionResult] | Mapping[str, AdmissionResult] | None") -> Iterator[None]:
    """Use ``recs`` instead of the committed record inside the block (tests)."""
    global _override
    prev = _override
    if recs is None:
        _override = None
    elif isinstance(recs, Mapping):
        _override = dict(recs)
    else:
        _override = {r.op: r for r in recs}
    try:
        yield
    finally:
        _override = prev


def admitted_record(op: str, measured_on: str = "injected") -> AdmissionResult:
    """A passing record for ``op`` (for tests that exercise mounting, not the measurement)."""
    return AdmissionResult(op, 1.0, 1.0, 0.0, True, True, measured_on)


def admission_problem(op: str) -> str | None:
    """None when ``op`` is admitted, else ``"not admitted: <why>"`` (the guard's reason)."""
    rec = records().get(op)
    if rec is None:
        return (f"not admitted: {op} has no admission record in {results_path().name} "
                f"(run bench/admit.py on a GPU and commit the JSON)")
    if not rec.admitted:
        return f"not admitted: {op} failed admission on {rec.measured_on}: {rec.reason or 'criteria not met'}"
    return None


def admission_table() -> list[dict[str, Any]]:
    """Rows for the docs page's "Admission" section, from the committed record."""
    rows = []
    for op, r in sorted(_read(results_path()).items()):
        rows.append({
            "op": op,
            "rms_ratio": r.rms_ratio,
            "max_ratio": r.max_ratio,
            "bias_ratio": r.bias_ratio,
            "nonfinite_same": "yes" if r.nonfinite_same else "no",
            "admitted": "yes" if r.admitted else "no",
            "measured_on": r.measured_on,
        })
    return rows


def format_table(results: Iterable[AdmissionResult]) -> str:
    lines = [f"{'op':<45} {'rms':>7} {'max':>7} {'bias':>7} {'nonfin':>6} {'admitted':>8}"]
    for r in results:
        lines.append(f"{r.op:<45} {r.rms_ratio:>7.3f} {r.max_ratio:>7.3f} {r.bias_ratio:>7.3f} "
                     f"{str(r.nonfinite_same):>6} {str(r.admitted):>8}  {r.reason}")
    return "\n".join(lines)


def high_guards(close_ops: Iterable[Any]) -> list[Any]:
    """For each close op a site would run: ``admitted:<op>`` (a passing record) and
    ``available:<op>`` (its kernel loads on the module's device and is not disabled)."""
    from .quality import Guard

    def device(module: Any) -> torch.device:
        for p in module.parameters():
            return p.device
        return torch.device("cpu")

    guards = []
    for c in close_ops:
        guards.append(Guard(f"admitted:{c.op}", lambda m, op=c.op: admission_problem(op)))
        guards.append(Guard(f"available:{c.op}", lambda m, c=c: c.problem(device(m))))
    return guards
