"""The operator's own Prometheus metrics: what every InferenceService and OfflineJob reports.

The sidecars export what happens on one pod; only the operator sees whole objects: a
service's SLO verdict, the budget it decided, an OfflineJob's totals and ETA. This module
keeps a snapshot of each object's ``.status`` (and the few spec fields the status is
compared against) from kopf watch events, and renders it at scrape time through a custom
collector in a private registry, the way kube-state-metrics does for built-in kinds.

* :func:`service_sample` / :func:`job_sample`: an object body -> a frozen
  :class:`ObjectSample` of gauges (pure, tolerant of missing or malformed fields: a field
  that does not parse is left out, never guessed).
* :class:`OperatorMetrics`: the snapshot store (thread-safe: kopf writes from the event
  loop, the HTTP server reads from its own thread) and the registry to serve.
* :func:`register`: read-only ``@kopf.on.event`` handlers for both kinds on a given kopf
  registry. They never patch anything; a DELETED event drops the object's series.
* :func:`serve`: prometheus-client's HTTP server on ``address:port``.

Names: ``slipstream_operator_*`` for the process, ``slipstream_inferenceservice_*`` and
``slipstream_offlinejob_*`` per object, base units (seconds, tokens per second). Object
series carry exactly ``namespace`` and ``name`` plus at most one bounded label
(``metric``/``stat``, ``phase``, ``outcome``, ``state``, ``condition``/``status``); scrape
with ``honorLabels: true`` so that ``namespace`` stays the object's.

Known gap: an object deleted while the operator's watch was disconnected long enough to
relist (HTTP 410) gets no DELETED event from kopf, so its series stay until the operator
restarts; its ``status_change_timestamp_seconds`` then stops moving.

Deliberately left out: anything the sidecars already export (latency histograms, tokens,
preemptions: aggregate those in PromQL), per-pod or per-shard series (unbounded), and
reading the API server itself (the watch the operator already holds is the only source).
"""

from __future__ import annotations

import json
import logging
import math
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from slipstream_operator.api import GROUP, VERSION, Phase, parse_duration
from slipstream_operator.gctimes import GcGeneration
from slipstream_operator.looplag import BUCKETS as LAG_BUCKETS
from slipstream_operator.looplag import LagHistogram

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8080
"""Port of the operator's ``/metrics`` when neither the flag nor the environment sets one."""

SERVICE = "InferenceService"
JOB = "OfflineJob"
KINDS = (SERVICE, JOB)
PHASES = tuple(p.value for p in Phase)
CONDITION_STATUSES = ("True", "False", "Unknown")

Key = tuple[str, str, str]
"""(kind, namespace, name)."""

Labels = tuple[tuple[str, str], ...]
"""Extra labels of one gauge value besides namespace and name, in a fixed order."""


@dataclass(frozen=True, slots=True)
class ObjectSample:
    """The gauges of one object: metric name suffix -> extra labels -> value."""

    kind: str
    namespace: str
    name: str
    values: Mapping[str, Mapping[Labels, float]]
    status_hash: int = 0
    status_time: float | None = None
    """Last status write according to the API server (managedFields), in Unix seconds."""


# --------------------------------------------------------------------------- pure extraction


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _seconds(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return parse_duration(value)
    except ValueError:
        return None


def _timestamp(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def status_write_time(body: Mapping[str, Any]) -> float | None:
    """When the status subresource was last changed, from ``metadata.managedFields``.

    The API server stamps a manager's entry only when that manager's operation changed the
    object, so an operator that rewrites an identical status does not move it. None when no
    entry names the status subresource.
    """
    fields = _get(body, "metadata", "managedFields")
    if not isinstance(fields, list):
        return None
    times = [
        t
        for entry in fields
        if isinstance(entry, Mapping) and entry.get("subresource") == "status"
        for t in [_timestamp(entry.get("time"))]
        if t is not None
    ]
    return max(times) if times else None


def _put(
    values: dict[str, dict[Labels, float]], metric: str, value: float | None, labels: Labels = ()
) -> None:
    if value is not None:
        values.setdefault(metric, {})[labels] = value


def _conditions(values: dict[str, dict[Labels, float]], status: Mapping[str, Any]) -> None:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return
    for cond in conditions[:8]:  # the CRD bounds the list to eight
        if not isinstance(cond, Mapping) or not isinstance(cond.get("type"), str):
            continue
        current = cond.get("status")
        for state in CONDITION_STATUSES:
            _put(
                values,
                "condition",
                1.0 if current == state else 0.0,
                (("condition", cond["type"]), ("status", state)),
            )


def _common(
    values: dict[str, dict[Labels, float]], body: Mapping[str, Any], status: Mapping[str, Any]
) -> None:
    _put(values, "metadata_generation", _number(_get(body, "metadata", "generation")))
    _put(values, "observed_generation", _number(status.get("observedGeneration")))
    _conditions(values, status)


def _status(body: Mapping[str, Any]) -> Mapping[str, Any]:
    status = body.get("status")
    return status if isinstance(status, Mapping) else {}


def _hash(status: Mapping[str, Any]) -> int:
    return hash(json.dumps(status, sort_keys=True, default=str))


def service_sample(body: Mapping[str, Any]) -> ObjectSample:
    """The gauges of one InferenceService body (spec targets, status observations)."""
    status = _status(body)
    spec = body.get("spec") if isinstance(body.get("spec"), Mapping) else {}
    values: dict[str, dict[Labels, float]] = {}
    _common(values, body, status)
    _put(values, "spec_replicas", _number(_get(spec, "replicas")))
    _put(values, "replicas", _number(status.get("replicas")))
    _put(values, "ready_replicas", _number(status.get("readyReplicas")))
    for metric in ("ttft", "tbt"):
        for stat, key in (("p99", "P99"), ("mean", "Mean")):
            labels = (("metric", metric), ("stat", stat))
            _put(values, "slo_target_seconds", _seconds(_get(spec, "slo", metric, stat)), labels)
            _put(
                values,
                "observed_latency_seconds",
                _seconds(_get(status, "observed", f"{metric}{key}")),
                labels,
            )
    _put(values, "observed_samples", _number(_get(status, "observed", "samples")))
    _put(values, "observed_window_seconds", _seconds(_get(status, "observed", "window")))
    conditions = status.get("conditions")
    slo = (
        next((c for c in conditions if isinstance(c, Mapping) and c.get("type") == "SLOMet"), None)
        if isinstance(conditions, list)
        else None
    )
    if slo is not None and slo.get("status") in ("True", "False"):
        _put(values, "slo_met", 1.0 if slo["status"] == "True" else 0.0)
    _put(values, "budget_seconds", _seconds(_get(status, "budget", "iteration")))
    _put(
        values, "budget_change_timestamp_seconds", _timestamp(_get(status, "budget", "computedAt"))
    )
    _put(values, "offline_tokens_per_second", _number(_get(status, "offline", "tokensPerSecond")))
    _put(values, "offline_active_shards", _number(_get(status, "offline", "activeShards")))
    return _sample(SERVICE, body, status, values)


def job_sample(body: Mapping[str, Any]) -> ObjectSample:
    """The gauges of one OfflineJob body (phase, request and shard counts, rate, ETA)."""
    status = _status(body)
    values: dict[str, dict[Labels, float]] = {}
    _common(values, body, status)
    phase = status.get("phase")
    if isinstance(phase, str):
        for known in PHASES:
            _put(values, "phase", 1.0 if phase == known else 0.0, (("phase", known),))
    _put(values, "input_requests", _number(_get(status, "requests", "total")))
    for outcome in ("completed", "failed"):
        _put(
            values,
            "finished_requests",
            _number(_get(status, "requests", outcome)),
            (("outcome", outcome),),
        )
    for state, key in (("planned", "total"), ("assigned", "assigned"), ("done", "done")):
        _put(values, "shards", _number(_get(status, "shards", key)), (("state", state),))
    _put(values, "shard_reassignments", _number(_get(status, "shards", "reassigned")))
    _put(values, "tokens_per_second", _number(status.get("tokensPerSecond")))
    _put(values, "eta_seconds", _seconds(status.get("eta")))
    _put(values, "start_timestamp_seconds", _timestamp(status.get("startTime")))
    _put(values, "completion_timestamp_seconds", _timestamp(status.get("completionTime")))
    return _sample(JOB, body, status, values)


def _sample(
    kind: str,
    body: Mapping[str, Any],
    status: Mapping[str, Any],
    values: dict[str, dict[Labels, float]],
) -> ObjectSample:
    meta = body.get("metadata") if isinstance(body.get("metadata"), Mapping) else {}
    return ObjectSample(
        kind=kind,
        namespace=str(_get(meta, "namespace") or "default"),
        name=str(_get(meta, "name") or ""),
        values=values,
        status_hash=_hash(status),
        status_time=status_write_time(body),
    )


# --------------------------------------------------------------------------- documentation

_CHANGED = "When the status last changed (API server time, else when first seen changed)."

FAMILIES: dict[str, dict[str, str]] = {
    SERVICE: {
        "metadata_generation": "metadata.generation of the InferenceService.",
        "observed_generation": "status.observedGeneration: the generation the operator acted on.",
        "condition": "1 for the status the condition has (labels condition, status).",
        "spec_replicas": "Pods asked for (spec.replicas).",
        "replicas": "Pods that exist (status.replicas).",
        "ready_replicas": "Pods whose sidecar reports ready (status.readyReplicas).",
        "slo_target_seconds": "SLO target from spec.slo (labels metric=ttft|tbt, stat=p99|mean).",
        "observed_latency_seconds": "Online latency over the status window (labels metric, stat).",
        "observed_samples": "Online requests in the status window.",
        "observed_window_seconds": "Window the observed latency covers.",
        "slo_met": "1 when the SLOMet condition is True, 0 when False; absent while Unknown.",
        "budget_seconds": "Per-iteration latency budget in force (status.budget.iteration).",
        "budget_change_timestamp_seconds": "When the budget last changed (Unix seconds).",
        "offline_tokens_per_second": "Offline output tokens/s on this service's pods.",
        "offline_active_shards": "Offline shards assigned to this service's pods now.",
        "status_change_timestamp_seconds": _CHANGED,
    },
    JOB: {
        "metadata_generation": "metadata.generation of the OfflineJob.",
        "observed_generation": "status.observedGeneration: the generation the operator acted on.",
        "condition": "1 for the status the condition has (labels condition, status).",
        "phase": "1 for the job's current phase (label phase), 0 for the others.",
        "input_requests": "Lines in the job's input (status.requests.total).",
        "finished_requests": "Requests with a record, by outcome (completed, failed).",
        "shards": "Shards by state (planned, assigned, done).",
        "shard_reassignments": "Times a shard moved to another pod.",
        "tokens_per_second": "Offline output tokens/s of this job.",
        "eta_seconds": "Estimated seconds to completion at the current rate.",
        "start_timestamp_seconds": "When the first shard was assigned (Unix seconds).",
        "completion_timestamp_seconds": "When the job finished (Unix seconds).",
        "status_change_timestamp_seconds": _CHANGED,
    },
}
"""Every per-object family (without its ``slipstream_<kind>_`` prefix) and its help text."""

PREFIX = {SERVICE: "slipstream_inferenceservice_", JOB: "slipstream_offlinejob_"}


def build_labels() -> dict[str, str]:
    """Labels of ``slipstream_operator_build_info``: versions of this build."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "unknown"

    return {
        "version": version("slipstream"),
        "kopf": version("kopf"),
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------- store + collector


@dataclass(slots=True)
class _Entry:
    sample: ObjectSample
    changed_at: float


@dataclass(eq=False)  # hashed by identity: the registry keys collectors by object
class OperatorMetrics(Collector):
    """Snapshots of the watched objects and the registry that renders them.

    ``clock`` gives Unix seconds (injected for tests); it stamps the operator's start and,
    for objects whose body has no status entry in ``managedFields``, the moment a status
    change was first seen.
    """

    clock: Callable[[], float] = time.time
    build: Mapping[str, str] = field(default_factory=build_labels)
    status_stats: Callable[[], Mapping[str, float]] | None = None
    """The handlers' Status-path counters (:meth:`Handlers.status_stats`); None: not shown."""
    status_writes: Callable[[], tuple[Mapping[str, int], Mapping[tuple[str, str], int]]] | None \
        = None
    """The ticks' status PATCHes per kind and per (kind, field) (``StatusWrites.snapshot``)."""
    gc_times: Callable[[], Mapping[int, GcGeneration]] | None = None
    """The garbage collector's totals per generation (``GcTimes.snapshot``); None: not shown."""
    loop_lag: Callable[[], LagHistogram] | None = None
    """The event loop's wake-up delays (``LoopLag.snapshot``); None: not shown."""
    registry: CollectorRegistry = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _objects: dict[Key, _Entry] = field(init=False, default_factory=dict)
    _events: dict[tuple[str, str], int] = field(init=False, default_factory=dict)
    _started: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self._started = self.clock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Apply one watch event of an InferenceService or OfflineJob (kind from the body)."""
        kind = body.get("kind")
        if kind not in KINDS:
            return
        sample = service_sample(body) if kind == SERVICE else job_sample(body)
        key = (sample.kind, sample.namespace, sample.name)
        with self._lock:
            counted = (sample.kind, event_type or "LISTED")
            self._events[counted] = self._events.get(counted, 0) + 1
            if event_type == "DELETED":
                self._objects.pop(key, None)
                return
            previous = self._objects.get(key)
            if sample.status_time is not None:
                changed_at = sample.status_time
            elif previous is None or previous.sample.status_hash != sample.status_hash:
                changed_at = self.clock()
            else:
                changed_at = previous.changed_at
            self._objects[key] = _Entry(sample, changed_at)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """Drop one object's series (what a DELETED event does)."""
        with self._lock:
            self._objects.pop((kind, namespace, name), None)

    def render(self) -> bytes:
        """The exposition text, as a scrape would get it."""
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            entries = list(self._objects.values())
            events = dict(self._events)
        yield from self._operator_families(entries, events)
        for kind in KINDS:
            yield from self._object_families(kind, [e for e in entries if e.sample.kind == kind])

    def _operator_families(
        self, entries: list[_Entry], events: dict[tuple[str, str], int]
    ) -> Iterator[Any]:
        info = GaugeMetricFamily(
            "slipstream_operator_build_info",
            "Versions of the running operator (value 1).",
            labels=sorted(self.build),
        )
        info.add_metric([self.build[k] for k in sorted(self.build)], 1.0)
        yield info
        yield GaugeMetricFamily(
            "slipstream_operator_start_time_seconds",
            "When the operator process started (Unix seconds).",
            value=self._started,
        )
        watched = GaugeMetricFamily(
            "slipstream_operator_watched_objects",
            "Objects the operator holds a status snapshot of, per kind.",
            labels=["kind"],
        )
        for kind in KINDS:
            watched.add_metric([kind], float(sum(e.sample.kind == kind for e in entries)))
        yield watched
        counter = CounterMetricFamily(
            "slipstream_operator_watch_events",
            "Watch events seen, by kind and type (LISTED: the initial listing).",
            labels=["kind", "type"],
        )
        for (kind, type_), n in sorted(events.items()):
            counter.add_metric([kind, type_], float(n))
        yield counter
        if self.status_stats is not None:
            yield from _status_families(self.status_stats())
        if self.status_writes is not None:
            yield from _write_families(*self.status_writes())
        if self.gc_times is not None:
            yield from _gc_families(self.gc_times())
        if self.loop_lag is not None:
            yield _loop_lag_family(self.loop_lag())

    def _object_families(self, kind: str, entries: list[_Entry]) -> Iterator[Any]:
        entries.sort(key=lambda e: (e.sample.namespace, e.sample.name))
        for suffix, help_text in FAMILIES[kind].items():
            extra = _EXTRA_LABELS.get(suffix, ())
            family = GaugeMetricFamily(
                PREFIX[kind] + suffix, help_text, labels=["namespace", "name", *extra]
            )
            for entry in entries:
                s = entry.sample
                if suffix == "status_change_timestamp_seconds":
                    family.add_metric([s.namespace, s.name], entry.changed_at)
                    continue
                for labels, value in s.values.get(suffix, {}).items():
                    family.add_metric([s.namespace, s.name, *(v for _, v in labels)], value)
            yield family


STATUS_FAMILIES: dict[str, tuple[str, str]] = {
    # stats key: (family, help); "streams" is a gauge, the rest counters
    "streams": ("slipstream_operator_status_streams",
                "WatchStatus streams to pods that are up now."),
    "opened": ("slipstream_operator_status_stream_opens",
               "WatchStatus streams opened (first opens and re-opens after a failure)."),
    "snapshots": ("slipstream_operator_status_snapshots",
                  "Status snapshots received on WatchStatus streams."),
    "changes": ("slipstream_operator_status_changes",
                "Snapshots whose change signature moved (each wakes its service's tick)."),
    "woken_ticks": ("slipstream_operator_woken_ticks",
                    "InferenceService ticks started by a change rather than by the interval."),
    "status_calls": ("slipstream_operator_status_calls",
                     "Unary Status calls made to sidecars (the rest read a cached or "
                     "streamed reply)."),
    "status_call_failures": ("slipstream_operator_status_call_failures",
                             "Unary Status calls that failed (time-out, refused, refused "
                             "token): the pod is scraped or skipped that tick."),
}


def _status_families(stats: Mapping[str, float]) -> Iterator[Any]:
    for key, (name, help_text) in STATUS_FAMILIES.items():
        if key not in stats:
            continue
        if key == "streams":
            yield GaugeMetricFamily(name, help_text, value=stats[key])
        else:
            yield CounterMetricFamily(name, help_text, value=stats[key])


def _write_families(patches: Mapping[str, int],
                    fields: Mapping[tuple[str, str], int]) -> Iterator[Any]:
    writes = CounterMetricFamily(
        "slipstream_operator_status_writes",
        "Status PATCHes the operator's ticks sent, per kind (a tick whose status did not "
        "change sends none).", labels=["kind"])
    for kind in KINDS:
        writes.add_metric([kind], float(patches.get(kind, 0)))
    yield writes
    by_field = CounterMetricFamily(
        "slipstream_operator_status_field_writes",
        "Status PATCHes that carried each top-level status field, per kind (what makes the "
        "operator write).", labels=["kind", "field"])
    for (kind, name), n in sorted(fields.items()):
        by_field.add_metric([kind, name], float(n))
    yield by_field


def _loop_lag_family(histogram: LagHistogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "slipstream_operator_event_loop_lag_seconds",
        "How late the operator's event loop woke a probe that slept a fixed period: the wait "
        "of anything due on the loop (ticks, sidecar replies, watch events).")
    cumulative, buckets = 0, []
    for bound, n in zip((*LAG_BUCKETS, math.inf), histogram.counts, strict=True):
        cumulative += n
        buckets.append(("+Inf" if bound == math.inf else repr(bound), float(cumulative)))
    family.add_metric([], buckets, histogram.sum_s)
    return family


def _gc_families(generations: Mapping[int, GcGeneration]) -> Iterator[Any]:
    collections = CounterMetricFamily(
        "slipstream_operator_gc_collections",
        "Collections of Python's cyclic garbage collector, per generation.",
        labels=["generation"])
    seconds = CounterMetricFamily(
        "slipstream_operator_gc_seconds",
        "Seconds spent in those collections, per generation (no tick runs meanwhile).",
        labels=["generation"])
    longest = GaugeMetricFamily(
        "slipstream_operator_gc_longest_pause_seconds",
        "The longest single collection since the operator started, per generation.",
        labels=["generation"])
    for generation, totals in sorted(generations.items()):
        label = [str(generation)]
        collections.add_metric(label, float(totals.collections))
        seconds.add_metric(label, totals.seconds)
        longest.add_metric(label, totals.longest_s)
    yield collections
    yield seconds
    yield longest


_EXTRA_LABELS: dict[str, tuple[str, ...]] = {
    "condition": ("condition", "status"),
    "slo_target_seconds": ("metric", "stat"),
    "observed_latency_seconds": ("metric", "stat"),
    "phase": ("phase",),
    "finished_requests": ("outcome",),
    "shards": ("state",),
}


# --------------------------------------------------------------------------- kopf + HTTP


def register(registry: Any, metrics: OperatorMetrics) -> None:
    """Add read-only watch-event handlers for both kinds to a kopf ``OperatorRegistry``."""
    import kopf

    async def on_event(*, type: str | None, body: kopf.Body, **_: Any) -> None:
        try:
            metrics.observe(type, body)
        except Exception:  # a metrics bug must never break the operator's watch
            logger.exception("metrics: could not record a %s event", type)

    for plural in ("inferenceservices", "offlinejobs"):
        kopf.on.event(GROUP, VERSION, plural, registry=registry, id="metrics")(on_event)


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """A running ``/metrics`` HTTP server; :meth:`close` stops it."""

    address: str
    port: int
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(metrics: OperatorMetrics, address: str, port: int) -> MetricsServer | None:
    """Serve ``metrics`` on ``address:port`` (port 0: any free one) from a daemon thread.

    A port already taken is logged at ERROR and yields None: the operator keeps
    reconciling without metrics (Prometheus then shows the target down) rather than
    crash-looping over an observability port.
    """
    try:
        server, _thread = start_http_server(port, addr=address, registry=metrics.registry)
    except OSError as exc:
        logger.error(
            "operator metrics not served: cannot listen on %s:%s (%s); set --metrics-port",
            address,
            port,
            exc,
        )
        return None
    bound = int(server.server_address[1])
    logger.info("operator metrics on http://%s:%s/metrics", address, bound)
    return MetricsServer(address, bound, server)
