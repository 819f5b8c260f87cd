"""Prometheus metrics of one engine and the server in front of it (``GET /metrics``).

Built on ``prometheus_client`` with a registry per engine (not the process-global ``REGISTRY``), so
that several engines in one process -- tests, or an embedding application -- never share or
collide on counters, and ``/metrics`` shows exactly this server's numbers.

What is counted where, and why:

- ``ditfuse_requests_total{outcome,status}``: every ``/v1/images/generations`` request, counted once
  by the HTTP layer after its response was sent -- rejected ones too (400, 401, 413, 415, 429, 499,
  503, 504, 500). ``outcome`` is ``ok`` or the error ``code`` of the OpenAI-style error body (e.g.
  ``unknown_parameter``, ``queue_full``, ``timeout``), so a dashboard can tell a client bug from an
  overload without parsing logs. The engine does not count requests itself: it never sees the ones
  that are refused before they reach it.
- ``ditfuse_queue_wait_seconds``: arrival in the engine until the request's first batch starts.
- ``ditfuse_generation_seconds{quality}``: one pipeline call (a batch), by tier.
- ``ditfuse_request_latency_seconds``: arrival in the engine until all its images are ready.
- ``ditfuse_batch_size_total{size}``: batches by the number of real (not padding) images.
- ``ditfuse_quality_mounts_total`` / ``_unmounts_total``: transitions that really mounted or
  unmounted request-gated kernels (the handle's ``MountResult.mounted`` / ``.unmounted`` lists are
  non-empty). A tier switch on a machine where nothing can mount (no CUDA) changes nothing and is
  not counted.
- ``ditfuse_queue_depth``, ``ditfuse_images_in_flight``, ``ditfuse_quality_current``: read live
  from the engine at scrape time. With a worker pool (``ditfuse serve --gpus N``),
  ``ditfuse_quality_current{quality}`` is the number of live workers with that tier mounted (1 or 0
  for one process, as before), and ``ditfuse_worker_up{worker,device}`` is 1 per live worker
  process, 0 once it died (absent without a pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds. Queue waits on a loaded server range from milliseconds to minutes; a FLUX.1-dev batch on
# one GPU takes seconds to tens of seconds, the tiny CPU preset tens of milliseconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Our metric and label names are plain [a-z_], for which generate_latest's text is the classic
# 0.0.4 format; declaring 0.0.4 keeps every Prometheus version (2.x included) parsing it.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


@dataclass(frozen=True)
class WorkerState:
    """One worker process of an engine's pool, as seen at scrape time."""

    worker: int
    device: str
    up: bool
    quality: str | None  # the tier it has mounted; None without acceleration
    busy: bool = False


@dataclass(frozen=True)
class LiveState:
    """What the engine reports at scrape time (gauges that are read, not counted)."""

    queue_depth: int
    images_in_flight: int
    quality: str | None  # the tier mounted now; None without an acceleration handle
    qualities: tuple[str, ...]
    workers: tuple[WorkerState, ...] = ()  # the pool's workers; empty when batches run in-process


class _LiveCollector(Collector):
    def __init__(self, read: Callable[[], LiveState]) -> None:
        self._read = read

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Names only, for the registry's duplicate check at registration (before the engine that
        # ``read`` looks at is fully built).
        yield GaugeMetricFamily("ditfuse_queue_depth", "")
        yield GaugeMetricFamily("ditfuse_images_in_flight", "")
        yield GaugeMetricFamily("ditfuse_quality_current", "", labels=["quality"])
        yield GaugeMetricFamily("ditfuse_worker_up", "", labels=["worker", "device"])

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self._read()
        yield GaugeMetricFamily("ditfuse_queue_depth", "Requests waiting to be batched.", value=s.queue_depth)
        yield GaugeMetricFamily("ditfuse_images_in_flight", "Images in the running batch(es).", value=s.images_in_flight)
        if not s.workers:
            g = GaugeMetricFamily("ditfuse_quality_current", "1 for the quality tier currently mounted.", labels=["quality"])
            for q in s.qualities:
                g.add_metric([q], 1.0 if q == s.quality else 0.0)
            yield g
            return
        g = GaugeMetricFamily(
            "ditfuse_quality_current", "Live worker processes with this quality tier mounted.", labels=["quality"]
        )
        for q in s.qualities:
            g.add_metric([q], float(sum(1 for w in s.workers if w.up and w.quality == q)))
        yield g
        up = GaugeMetricFamily("ditfuse_worker_up", "1 while the worker process is alive, 0 once it died.", labels=["worker", "device"])
        for w in s.workers:
            up.add_metric([str(w.worker), w.device], 1.0 if w.up else 0.0)
        yield up


class EngineMetrics:
    """The counters and histograms of one engine (and its server), in their own registry."""

    def __init__(self, live: Callable[[], LiveState] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "ditfuse_requests",
            "Image generation requests by outcome ('ok' or the error code) and HTTP status, rejected ones included.",
            ["outcome", "status"],
            registry=r,
        )
        self.images_total = Counter("ditfuse_images", "Images generated (padding slots not counted).", registry=r)
        self.videos_total = Counter("ditfuse_videos", "Videos generated (padding slots not counted).", registry=r)
        self.batches_total = Counter("ditfuse_batches", "Pipeline calls (batches) that completed.", registry=r)
        self.batch_errors = Counter("ditfuse_batch_errors", "Pipeline calls that raised (every request in them failed).", registry=r)
        self.batch_size = Counter("ditfuse_batch_size", "Completed batches by number of real images in them.", ["size"], registry=r)
        self.queue_dropped = Counter(
            "ditfuse_queue_dropped",
            "Requests dropped before or while they ran, by reason (timeout, disconnected, cancelled, "
            "stopped_abandoned: a running video batch stopped because all its jobs were cancelled).",
            ["reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "ditfuse_queue_wait_seconds",
            "Time from a request's arrival in the engine until its first batch starts.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.generation = Histogram(
            "ditfuse_generation_seconds",
            "Duration of one pipeline call (one batch), by quality tier.",
            ["quality"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "ditfuse_request_latency_seconds",
            "Time from a request's arrival in the engine until all its images are ready.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.mounts = Counter(
            "ditfuse_quality_mounts",
            "Transitions to quality=high that mounted request-gated kernels.",
            registry=r,
        )
        self.unmounts = Counter(
            "ditfuse_quality_unmounts",
            "Transitions back to quality=lossless that unmounted request-gated kernels.",
            registry=r,
        )
        if live is not None:
            r.register(_LiveCollector(live))

    # -- recording ---------------------------------------------------------------------------

    def observe_request(self, outcome: str, status: int) -> None:
        """One HTTP request to the generation route, after its response (see the module docstring)."""
        self.requests.labels(outcome=outcome, status=str(status)).inc()

    def observe_batch(self, size: int, quality: str, seconds: float, video: bool = False) -> None:
        self.batches_total.inc()
        (self.videos_total if video else self.images_total).inc(size)
        self.batch_size.labels(size=str(size)).inc()
        self.generation.labels(quality=quality).observe(seconds)

    def observe_transition(self, results: Mapping[str, object] | None) -> tuple[bool, bool]:
        """Count a quality transition from ``handle.set_quality``'s results (one ``MountResult``
        per model). Returns (mounted anything, unmounted anything)."""
        mounted = any(getattr(v, "mounted", None) for v in (results or {}).values())
        unmounted = any(getattr(v, "unmounted", None) for v in (results or {}).values())
        if mounted:
            self.mounts.inc()
        if unmounted:
            self.unmounts.inc()
        return mounted, unmounted

    # -- reading -----------------------------------------------------------------------------

    @property
    def batches(self) -> int:
        """Completed batches so far (bench/bench_serve_cpu.py reads throughput from these two)."""
        return int(self.value("ditfuse_batches_total"))

    @property
    def images(self) -> int:
        """Images generated so far."""
        return int(self.value("ditfuse_images_total"))

    @property
    def videos(self) -> int:
        """Videos generated so far."""
        return int(self.value("ditfuse_videos_total"))

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (0 when it was never recorded); for tests and logs."""
        v = self.registry.get_sample_value(name, {k: str(x) for k, x in labels.items()})
        return 0.0 if v is None else v

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
