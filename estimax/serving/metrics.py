"""Counting requests once, for Prometheus (TF Serving's metric names) and Triton's statistics.

``ServingCore.finish`` hands every closed ``RequestRecord`` (REST, v2, gRPC, Vertex) to
``ServingMetrics.request``; the model runs and the batching queue report through ``execution``
and ``dequeued``; the model manager reports loads through ``loaded``. Both views are made from
these calls: the Prometheus text of ``--monitoring_config_file``/``--metrics_path`` (written by
``prometheus_client``) and the per-version statistics of Triton's statistics extension.

Prometheus metrics (TF Serving's names and units, ``/`` shown as ``:`` as TF Serving's exporter
does; latencies in microseconds with TF Serving's buckets):

* ``:tensorflow:serving:request_count{model_name, version, API, entrypoint, status}``: every
  request; ``status`` is the canonical code (``OK``, ``INVALID_ARGUMENT``, ``NOT_FOUND``...).
* ``:tensorflow:serving:request_latency{model_name, API, entrypoint, status}``: every request's
  wall time (TF Serving counts OK ones only; filter ``status="OK"`` for its view).
* ``:tensorflow:serving:runtime_latency{model_name, API, runtime}``: the model's run, for the
  requests that reached it (``runtime="JAX"``).
* ``:tensorflow:serving:request_example_counts{model}`` and ``..._count_total{model}``: the
  instances of each successful inference request.
* ``:tensorflow:serving:batching_session:`` ``queuing_latency{thread_pool_name}``,
  ``input_batch_size``, ``processed_batch_size``, ``padding_size{execution_batch_size}``,
  ``wrapped_run_count``: the batching queue (``--enable_batching``).
* ``:tensorflow:serving:model_warmup_latency{model_path, status}``: loading and compiling a
  version.
* ``estimax_serving_request_failures_total{model_name, version, reason}``: failed requests by
  reason: ``rejected`` (429, the batching queue is full), ``timeout`` (504), ``bad_request``
  (400, 413), ``not_found`` (404), ``unavailable`` (503), ``internal`` (500),
  ``client_timeout`` (408: the body did not all arrive in time), ``cancelled`` (499: the
  client left), ``other``.
* ``estimax_serving_connections_closed_total{reason}``: HTTP connections the server closed on a
  limit (``estimax.serving.transport``): ``header_timeout``, ``body_timeout``,
  ``keep_alive_timeout``, ``header_too_large``, ``max_connections``.
* ``estimax_serving_model_control_total{action, model_name, outcome}``: model control calls
  (``estimax.serving.control``): ``load``, ``reload``, ``unload``, ``reload_config``; ``OK`` or
  ``failed``.
* ``estimax_serving_model_version_state{model_name, version, state}``: 1 for each version's
  current state (``LOADING``, ``AVAILABLE``, ``UNLOADING``, ``END``).
* ``estimax_serving_batch_queue_instances{model_name}``: instances waiting to be batched.
* ``estimax_serving_deadline_exceeded_total{model_name, stage}``: requests answered with the
  deadline error (``queued``: the model never ran for them), and
  ``estimax_serving_response_cache_total{model_name, result}``,
  ``..._response_cache_evictions_total{model_name}``, ``..._response_cache_bytes``: registered
  here by ``estimax.serving.core`` (``estimax.serving.admission``, ``.response_cache``).
* ``process_*``, ``python_*``: the process (CPU, memory, file descriptors, GC), from
  ``prometheus_client``'s own collectors.

TF Serving's two counters (``request_count``, ``wrapped_run_count``) keep their exact names and
are typed ``untyped``: ``prometheus_client`` writes a ``counter`` only as ``NAME_total``, and
dashboards written for TF Serving query the bare name. A request naming a model or version that
is not served is counted under ``model_name``/``version`` ``"_unknown"`` (the access log has the
name asked for).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf import text_format
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from estimax.serving.tracking import RequestRecord

# TF Serving's exporter path when a monitoring config names none (PrometheusExporter).
PROMETHEUS_PATH = "/monitoring/prometheus/metrics"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def _exponential(scale: float, growth: float, count: int) -> list[float]:
    """TF's ``monitoring::Buckets::Exponential`` bounds (the last, DBL_MAX, is Prometheus' +Inf)."""
    return [scale * growth**i for i in range(count)]


_LATENCY_US = _exponential(10, 1.8, 33)  # ~20 minutes; request, runtime, warm-up latency
_QUEUE_US = _exponential(100, 1.2, 52)  # ~1 second; batching queue
_SIZES = _exponential(1, 2, 14)  # batch sizes, padding
_EXAMPLES = _exponential(1, 2, 15)
_TF = ":tensorflow:serving:"
UNKNOWN = "_unknown"  # the label value of a model name or version that is not served
_BATCHING = _TF + "batching_session:"

FAILURE_REASONS = {
    400: "bad_request",
    404: "not_found",
    408: "client_timeout",
    413: "bad_request",
    429: "rejected",
    500: "internal",
    499: "cancelled",
    503: "unavailable",
    504: "timeout",
}


def parse_monitoring_config(path: str) -> str | None:
    """TF Serving's ``--monitoring_config_file`` (text ``MonitoringConfig``) -> the metrics path.

    Returns:
      The path to serve Prometheus text at (TF Serving's default when the file names none), or
      None when ``prometheus_config.enable`` is false.

    Raises:
      OSError: the file cannot be read. ValueError: it is not a ``MonitoringConfig``.
    """
    from estimax.serving.protos.tensorflow_serving.config import monitoring_config_pb2

    with open(path) as f:
        text = f.read()
    try:
        config = text_format.Parse(text, monitoring_config_pb2.MonitoringConfig())
    except text_format.ParseError as e:
        raise ValueError(
            f"--monitoring_config_file={path}: not a MonitoringConfig ({e}); expected e.g. "
            'prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }'
        ) from None
    prometheus = config.prometheus_config
    if not prometheus.enable:
        return None
    if prometheus.path and not prometheus.path.startswith("/"):
        raise ValueError(f"--monitoring_config_file={path}: path {prometheus.path!r} must start /")
    return prometheus.path or PROMETHEUS_PATH


@dataclasses.dataclass
class _Duration:
    """Triton's ``StatisticDuration``: how many times, and their total nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclasses.dataclass
class _VersionStats:
    """Triton's ``ModelStatistics`` of one version, accumulated."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference: int = 0  # ms since the epoch
    durations: dict[str, _Duration] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(_Duration)
    )
    batches: dict[int, _Duration] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(_Duration)
    )

    def json(self, name: str, version: str) -> dict[str, Any]:
        stats = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        empty = {"count": 0, "ns": 0}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                **{k: self.durations[k].json() for k in stats},
                "cache_hit": empty,
                "cache_miss": empty,
            },
            "batch_stats": [
                # Inputs are prepared per request and outputs encoded per request (their times
                # are in inference_stats): per batch size only the run is measured.
                {
                    "batch_size": size,
                    "compute_input": {"count": d.count, "ns": 0},
                    "compute_infer": d.json(),
                    "compute_output": {"count": d.count, "ns": 0},
                }
                for size, d in sorted(self.batches.items())
            ],
        }


class _Collector:
    """What is read at scrape time: exact-name counters, version states, the queue's depth."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        with m.lock:
            counts = dict(m.request_counts)
            runs = m.wrapped_runs
        count = Metric(_TF + "request_count", "The total number of requests.", "untyped")
        for labels, value in counts.items():
            count.add_sample(count.name, dict(labels), value)
        yield count
        wrapped = Metric(
            _BATCHING + "wrapped_run_count",
            "Total count of run calls on the wrapped session",
            "untyped",
        )
        wrapped.add_sample(wrapped.name, {}, runs)
        yield wrapped
        states = GaugeMetricFamily(
            "estimax_serving_model_version_state",
            "1 for the current state of each version seen (TF Serving's ModelVersionStatus).",
            labels=["model_name", "version", "state"],
        )
        for model, version, state in m.version_states():
            states.add_metric([model, version, state], 1)
        yield states
        queue = GaugeMetricFamily(
            "estimax_serving_batch_queue_instances",
            "Instances waiting in the batching queue.",
            labels=["model_name"],
        )
        for model, waiting in m.queued():
            queue.add_metric([model], waiting)
        yield queue


class ServingMetrics:
    """The counters behind Prometheus and Triton's statistics (module docstring)."""

    def __init__(
        self,
        served: Callable[[str, str], tuple[bool, bool]],
        version_states: Callable[[], Sequence[tuple[str, str, str]]] = tuple,
        queued: Callable[[], Sequence[tuple[str, int]]] = tuple,
        clock: Callable[[], float] = time.time,
    ):
        """``served(model, version)``: whether the model is served and whether that version of
        it was seen (called on every request: it must not scale with the number of models);
        ``version_states()``: ``[(model, version, state)]``; ``queued()``: ``[(model,
        instances waiting)]``."""
        disable_created_metrics()  # the *_created series TF Serving does not have
        self.served = served
        self.version_states = version_states
        self.queued = queued
        self._clock = clock
        self.lock = threading.Lock()
        self.request_counts: collections.Counter[tuple[tuple[str, str], ...]] = (
            collections.Counter()
        )
        self.wrapped_runs = 0
        self._stats: dict[tuple[str, str], _VersionStats] = collections.defaultdict(_VersionStats)
        self.registry = CollectorRegistry(auto_describe=True)
        self._define(self.registry)
        self._define_counters(self.registry)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def _define(self, r: CollectorRegistry) -> None:
        """The histograms and counters, with TF Serving's names, help texts and buckets."""

        def histogram(name: str, doc: str, labels: Sequence[str], buckets: list) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        wall = "Distribution of wall time (in microseconds) for "
        self.request_latency = histogram(
            _TF + "request_latency",
            wall + "Tensorflow Serving request.",
            ["model_name", "API", "entrypoint", "status"],
            _LATENCY_US,
        )
        self.runtime_latency = histogram(
            _TF + "runtime_latency",
            wall + "Tensorflow runtime.",
            ["model_name", "API", "runtime"],
            _LATENCY_US,
        )
        self.warmup_latency = histogram(
            _TF + "model_warmup_latency",
            wall + "warming up the model.",
            ["model_path", "status"],
            _LATENCY_US,
        )
        self.example_counts = histogram(
            _TF + "request_example_counts",
            "The number of tensorflow.Examples per request.",
            ["model"],
            _EXAMPLES,
        )
        self.queuing_latency = histogram(
            _BATCHING + "queuing_latency",
            "Distribution of wall time spent (in microseconds) in queuing",
            ["thread_pool_name"],
            _QUEUE_US,
        )
        sizes = "Tracks the batch size distribution on "
        self.input_batch_size = histogram(
            _BATCHING + "input_batch_size", sizes + "the inputs.", [], _SIZES
        )
        self.processed_batch_size = histogram(
            _BATCHING + "processed_batch_size", sizes + "processing.", [], _SIZES
        )
        self.padding_size = histogram(
            _BATCHING + "padding_size",
            "Tracks the padding size distribution on batches.",
            ["execution_batch_size"],
            _SIZES,
        )

    def _define_counters(self, r: CollectorRegistry) -> None:
        self.example_total = Counter(  # written as ..._count_total, TF Serving's name
            _TF + "request_example_count",
            "The total number of tensorflow.Examples.",
            ["model"],
            registry=r,
        )
        self.failures = Counter(
            "estimax_serving_request_failures",
            "Failed requests by reason (rejected: the batching queue was full).",
            ["model_name", "version", "reason"],
            registry=r,
        )
        self.model_control = Counter(
            "estimax_serving_model_control",
            "Model control actions (load, reload, unload, reload_config) by outcome.",
            ["action", "model_name", "outcome"],
            registry=r,
        )
        self.connections_closed = Counter(
            "estimax_serving_connections_closed",
            "HTTP connections closed by a limit (a timeout, the header size, the cap).",
            ["reason"],
            registry=r,
        )

    # ------------------------------------------------------------------ counting
    def request(self, record: RequestRecord) -> None:
        """Counts one finished request (every protocol calls this once per request)."""
        entrypoint = "GRPC" if record.transport == "grpc" else "REST"
        # Names and versions that are not served are one label value: a client asking for
        # random ones must not grow the server's memory (one series per label set).
        model_known, version_known = self.served(record.model, record.version)
        model = record.model if model_known or not record.model else UNKNOWN
        version = record.version if version_known or not record.version else UNKNOWN
        labels = (
            ("model_name", model),
            ("version", version),
            ("API", record.api),
            ("entrypoint", entrypoint),
            ("status", record.code),
        )
        with self.lock:
            self.request_counts[labels] += 1
        self.request_latency.labels(model, record.api, entrypoint, record.code).observe(
            record.latency_s * 1e6
        )
        if record.ran:
            self.runtime_latency.labels(model, record.api, "JAX").observe(record.run_s * 1e6)
        ok = record.code == "OK"
        if not ok:
            reason = FAILURE_REASONS.get(record.status, "other")
            self.failures.labels(model, version, reason).inc()
        if record.inference and ok:
            self.example_counts.labels(model).observe(record.instances)
            self.example_total.labels(model).inc(record.instances)
        if record.inference and version_known and model_known:
            self._count_stats(record, ok)

    def _count_stats(self, record: RequestRecord, ok: bool) -> None:
        with self.lock:
            stats = self._stats[record.model, record.version]
            stats.durations["success" if ok else "fail"].add(record.latency_s)
            if record.ran:
                stats.durations["compute_input"].add(record.prepare_s)
                stats.durations["queue"].add(record.queue_s)
                stats.durations["compute_infer"].add(record.run_s)
                stats.durations["compute_output"].add(max(0.0, record.end - record.run_end))
            if ok:
                stats.inference_count += record.instances
                stats.last_inference = int(self._clock() * 1000)

    def execution(
        self,
        model: str,
        version: Any,
        executions: Sequence[tuple[int, int]],
        seconds: float,
        batched: bool,
    ) -> None:
        """One model run of ``executions`` (``(compiled size, instances)`` per call)."""
        instances = sum(m for _, m in executions)
        with self.lock:
            stats = self._stats[model, str(version)]
            stats.execution_count += 1
            stats.batches[instances].add(seconds)
            if batched:
                self.wrapped_runs += 1
        if batched:
            self.processed_batch_size.observe(sum(size for size, _ in executions))
            for size, m in executions:
                self.padding_size.labels(str(size)).observe(size - m)

    def dequeued(self, wait_s: float, instances: int) -> None:
        """A request left the batching queue after ``wait_s`` seconds."""
        self.queuing_latency.labels("batch_threads").observe(wait_s * 1e6)
        self.input_batch_size.observe(instances)

    def connection_closed(self, reason: str) -> None:
        """The HTTP port closed a connection on a limit (``estimax.serving.transport``)."""
        self.connections_closed.labels(reason).inc()

    def control(self, action: str, model: str, ok: bool) -> None:
        """A model control action (``estimax.serving.control``) ended; ``model`` is one the
        server knows (its repository), so the label values stay bounded."""
        self.model_control.labels(action, model, "OK" if ok else "failed").inc()

    def loaded(self, path: str, seconds: float, ok: bool) -> None:
        """A version was loaded and compiled (or failed to) in ``seconds``."""
        self.warmup_latency.labels(path, "OK" if ok else "UNKNOWN").observe(seconds * 1e6)

    # ------------------------------------------------------------------ reading
    def exposition(self) -> bytes:
        """The Prometheus text of every metric."""
        return generate_latest(self.registry)

    def statistics(self, versions: Iterable[tuple[str, str]]) -> list[dict[str, Any]]:
        """Triton's ``model_stats`` entries of ``(model, version)`` pairs (zeros for one never
        asked)."""
        with self.lock:
            return [self._stats.get(mv, _VersionStats()).json(*mv) for mv in versions]

    def forget(self, model: str) -> None:
        """Drops the statistics of a model no longer served."""
        with self.lock:
            for key in [k for k in self._stats if k[0] == model]:
                del self._stats[key]
