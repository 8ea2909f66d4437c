"""One fleet-scale run of the real operator on the local cluster, measured.

Steps (:class:`FleetRun`):

1. On a running :class:`~slipstream_testbed.cluster.LocalCluster`: apply the CRDs, a
   ServiceAccount for the operator (bound to ``cluster-admin``: this is a bench,
   the chart's Role is narrower) and an API Priority and Fairness FlowSchema that
   matches only that account, so the API server's
   ``apiserver_flowcontrol_dispatched_requests_total{flow_schema=...}`` counts
   exactly the operator's requests.
2. Start the stand-in (:mod:`slipstream_testbed.fleet.server`, admin identity) and
   ``slipstream operator`` (the operator's own kubeconfig) as processes. With
   ``operator_shards`` above 1 the fleet's namespaces are split round-robin over that
   many operators, each started with ``-n`` for its own group (sharding by namespace:
   each process has its own event loop; they share nothing but the API server).
3. Apply namespaces, InferenceServices and OfflineJobs (:mod:`.workload`) and
   time: all pods Running, all services ``Ready=True``, all jobs' shards placed
   (``status.shards.assigned == total``).
4. Status freshness: bump every fake pod's online counters at a known time and
   watch each service's ``status.observed.samples`` reach the new count; the
   lag is the time from the bump to the bench seeing it. The default probe
   (``lag_probe="watch"``, :mod:`.statuswatch`) stamps each status change as its
   watch event arrives; ``"list"`` polls LIST, which adds up
   to one LIST period (seconds at 500 services) to every lag. The lags are kept
   per bump (:class:`BumpLags`): the first bump changes every service's budget at
   once, and its cost would otherwise hide in one p99 with the steady-state bumps.
5. The operator's CPU (``/proc/<pid>/stat`` utime+stime), RSS (``VmRSS``,
   ``VmHWM``) and API requests per second, over the ramp (apply to ready) and
   over the steady state (the bumps); summed over the shards when there are several
   (they share one ServiceAccount, so the FlowSchema counts all of them).

Deliberately left out: starting the cluster (the caller chooses its size) and
any assertion (the e2e test and the bench judge the result).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from slipstream_testbed.cluster import LOOPBACK, ApiError, ClusterError, LocalCluster
from slipstream_testbed.fleet.statuswatch import StatusWatch, etcd_statuses, status_written
from slipstream_testbed.fleet.workload import (
    FleetPlan,
    batch_lines,
    job_manifests,
    namespace_names,
    service_manifests,
    shards_per_pod_needed,
)
from slipstream_testbed.prometheus import free_port

logger = logging.getLogger(__name__)

OPERATOR_NAMESPACE = "slipstream-system"
OPERATOR_ACCOUNT = "slipstream-operator"
FLOW_SCHEMA = "slipstream-operator"
PRIORITY_LEVEL = "slipstream-bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[3]


class FleetRunError(RuntimeError):
    """A fleet run could not set up or did not reach the state it waits for."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.partial: dict[str, Any] = {}  # what was measured before the failure


@dataclass(frozen=True, slots=True)
class ProcSample:
    at_s: float
    cpu_s: float
    rss_mb: float
    hwm_mb: float


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (``/proc/<pid>/task/*/children``; empty when gone)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def proc_sample(pid: int, children: bool = True) -> ProcSample:
    """CPU seconds (user+system, threads included) and memory of one process, with its
    descendants (``children``): the operator's budget-search worker is its own process, and
    the operator's cost includes it. Finished children count through cutime and cstime."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = [int(f) for f in fields[11:15]]  # utime, stime, cutime, cstime (proc(5) 14-17)
    cpu = sum(ticks if children else ticks[:2]) / CLK_TCK
    rss = hwm = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    if children:
        for child in child_pids(pid):
            try:
                sub = proc_sample(child)
            except OSError:  # it ended meanwhile
                continue
            cpu, rss, hwm = cpu + sub.cpu_s, rss + sub.rss_mb, hwm + sub.hwm_mb
    return ProcSample(time.monotonic(), cpu, rss, hwm)


def procs_sample(pids: Sequence[int]) -> ProcSample:
    """:func:`proc_sample` summed over processes (the shards of a namespace-sharded operator)."""
    samples = [proc_sample(pid) for pid in pids]
    return ProcSample(max(s.at_s for s in samples), sum(s.cpu_s for s in samples),
                      sum(s.rss_mb for s in samples), sum(s.hwm_mb for s in samples))


def shard_namespaces(namespaces: Sequence[str], shards: int) -> list[list[str]]:
    """Split ``namespaces`` into ``shards`` groups, round-robin (each group one operator)."""
    if not 1 <= shards <= len(namespaces):
        raise ValueError(f"operator shards must be between 1 and the {len(namespaces)} "
                         f"namespaces of the run, not {shards}")
    return [list(namespaces[i::shards]) for i in range(shards)]


def dispatched(metrics_text: str, flow_schema: str) -> tuple[float, float]:
    """(requests dispatched for ``flow_schema``, all requests counted by the API server)."""
    ours = total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "apiserver_flowcontrol_dispatched_requests_total":
                if s.labels.get("flow_schema") == flow_schema:
                    ours += s.value
            elif s.name == "apiserver_request_total":
                total += s.value
    return ours, total


ETCD_WRITES = "etcd update "
"""Prefix of the :func:`request_mix` keys that count the API server's writes to etcd."""


def request_mix(metrics_text: str) -> dict[str, float]:
    """The API server's requests so far by ``VERB resource[/subresource]`` (every client), and
    its updates of objects in etcd by ``etcd update <resource>``: a PATCH that changes
    nothing is answered without one, so the two together count the no-op writes."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "etcd_requests_total" and s.labels.get("operation") == "update":
                key = ETCD_WRITES + (s.labels.get("resource") or s.labels.get("type") or "-")
                out[key] = out.get(key, 0.0) + s.value
                continue
            if s.name != "apiserver_request_total":
                continue
            resource = s.labels.get("resource") or s.labels.get("group") or "-"
            if s.labels.get("subresource"):
                resource += "/" + s.labels["subresource"]
            key = f"{s.labels.get('verb', '?')} {resource}"
            out[key] = out.get(key, 0.0) + s.value
    return out


# Latency histograms the bench reads over the steady phase: the operator's status writes as
# the API server timed them, and how long the operator's requests waited in its APF queues.
LATENCIES = {
    "PATCH inferenceservices/status": ("apiserver_request_duration_seconds_bucket",
                                       {"verb": "PATCH", "resource": "inferenceservices",
                                        "subresource": "status"}),
    "PATCH offlinejobs/status": ("apiserver_request_duration_seconds_bucket",
                                 {"verb": "PATCH", "resource": "offlinejobs",
                                  "subresource": "status"}),
    "APF queue wait (operator)": ("apiserver_flowcontrol_request_wait_duration_seconds_bucket",
                                  {"priority_level": PRIORITY_LEVEL, "execute": "true"}),
}


def latency_buckets(metrics_text: str) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts (``le`` -> count, summed over other labels) of each of
    :data:`LATENCIES` in one reading of the API server's ``/metrics``."""
    out: dict[str, dict[float, float]] = {key: {} for key in LATENCIES}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            for key, (name, labels) in LATENCIES.items():
                if s.name != name or any(s.labels.get(k) != v for k, v in labels.items()):
                    continue
                le = float(s.labels["le"])
                out[key][le] = out[key].get(le, 0.0) + s.value
    return out


def bucket_quantiles(before: dict[float, float], after: dict[float, float]
                     ) -> dict[str, float | None]:
    """Count, p50 and p99 (seconds; linear within a bucket, as PromQL's
    ``histogram_quantile``) of what was observed between two cumulative readings."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0

    def quantile(q: float) -> float | None:
        if total <= 0:
            return None
        rank, low, below = q * total, 0.0, 0.0
        for bound, cumulative in zip(bounds, counts, strict=True):
            if cumulative >= rank:
                if bound == float("inf"):
                    return low  # past the last finite bucket: its bound is all that is known
                inside = cumulative - below
                return low + (bound - low) * ((rank - below) / inside if inside else 1.0)
            low, below = bound, cumulative
        return low

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {"count": total, "p50_s": rounded(quantile(0.5)), "p99_s": rounded(quantile(0.99))}


def _requests(before: dict[str, float], after: dict[str, float], *,
              etcd: bool = False) -> tuple[dict[str, float], dict[str, float]]:
    """The two readings with only the API requests, or (``etcd``) only the etcd writes."""
    def keep(mix: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in mix.items() if k.startswith(ETCD_WRITES) == etcd}

    return keep(before), keep(after)


def top_rates(before: dict[str, float], after: dict[str, float], seconds: float,
              limit: int = 12, digits: int = 1) -> dict[str, float]:
    """The ``limit`` largest per-second rates between two :func:`request_mix` readings."""
    rates = {k: (v - before.get(k, 0.0)) / max(seconds, 1e-9) for k, v in after.items()}
    ranked = sorted(((r, k) for k, r in rates.items() if r > 0), reverse=True)[:limit]
    return {k: round(r, digits) for r, k in ranked}


WRITES = "slipstream_operator_status_writes"
FIELD_WRITES = "slipstream_operator_status_field_writes"
LOOP_LAG = "slipstream_operator_event_loop_lag_seconds"
GC_FAMILIES = {"slipstream_operator_gc_seconds": "GC",
               "slipstream_operator_gc_collections": "GCn",
               "slipstream_operator_gc_longest_pause_seconds": "GCmax"}
STATUS_CALLS = {"slipstream_operator_status_calls": "calls",
                "slipstream_operator_status_call_failures": "failures"}


def status_writes(metrics_text: str) -> dict[str, float]:
    """The operator's status PATCH counters from its ``/metrics``: ``Kind`` (PATCHes) and
    ``Kind/field`` (PATCHes that carried that top-level status field); its unary ``Status``
    calls to sidecars as ``Status/calls`` and ``Status/failures``; and its garbage collector's
    seconds, collections and longest pause as ``GC/<generation>``, ``GCn/<generation>`` and
    ``GCmax/<generation>``; and its event loop's lag histogram as ``Lag/<bucket bound>``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        name = family.name.removesuffix("_total")  # the parser keeps it on some formats
        if name == LOOP_LAG:
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[f"Lag/{float(sample.labels['le'])}"] = sample.value
            continue
        if name in GC_FAMILIES:
            for sample in family.samples:
                if sample.name.endswith(("_total", "_seconds")):
                    key = f"{GC_FAMILIES[name]}/{sample.labels['generation']}"
                    out[key] = out.get(key, 0.0) + sample.value
            continue
        if name in STATUS_CALLS:
            out[f"Status/{STATUS_CALLS[name]}"] = sum(
                x.value for x in family.samples if x.name.endswith("_total"))
            continue
        if name not in (WRITES, FIELD_WRITES):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            key = sample.labels["kind"]
            if name == FIELD_WRITES:
                key += "/" + sample.labels["field"]
            out[key] = out.get(key, 0.0) + sample.value
    return out


def write_rates(before: dict[str, float], after: dict[str, float],
                seconds: float) -> dict[str, float]:
    """Per-second rates between two :func:`status_writes` readings, largest first."""
    return top_rates(before, after, seconds, limit=len(after), digits=2)


def rates_of(before: dict[str, float] | None, after: dict[str, float] | None,
             seconds: float) -> dict[str, float]:
    """:func:`write_rates` of two readings that may have failed (None: no rates), without the
    longest-pause gauges (``GCmax/``), which are no counters, and the lag buckets."""
    if before is None or after is None:
        return {}
    return {k: v for k, v in write_rates(before, after, seconds).items()
            if not k.startswith(("GCmax/", "Lag/"))}


def loop_lag(before: dict[str, float] | None,
             after: dict[str, float] | None) -> dict[str, float | None]:
    """Count, p50 and p99 of the operators' event-loop lag between two readings (empty when
    one failed or the operator serves no histogram)."""
    if before is None or after is None:
        return {}

    def buckets(reading: dict[str, float]) -> dict[float, float]:
        return {float(k.removeprefix("Lag/")): v for k, v in reading.items()
                if k.startswith("Lag/")}

    now = buckets(after)
    return bucket_quantiles(buckets(before), now) if now else {}


def gc_summary(before: dict[str, float], after: dict[str, float],
               seconds: float) -> dict[str, dict[str, float]]:
    """Per generation, from two :func:`status_writes` readings: ``cores`` and ``per_s`` (rates
    of GC seconds and collections) and ``longest_s`` (the longest pause at the second)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in after.items():
        prefix, _, generation = key.partition("/")
        if prefix not in ("GC", "GCn", "GCmax"):
            continue
        entry = out.setdefault(generation, {})
        if prefix == "GCmax":
            entry["longest_s"] = round(value, 3)
        else:
            rate = (value - before.get(key, 0.0)) / max(seconds, 1e-9)
            entry["cores" if prefix == "GC" else "per_s"] = round(rate, 3)
    return dict(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class Phase:
    """Operator cost over one interval."""

    seconds: float
    cpu_cores: float
    api_rps: float
    apiserver_rps: float

    @staticmethod
    def between(a: ProcSample, b: ProcSample, api_a: tuple[float, float],
                api_b: tuple[float, float]) -> Phase:
        span = max(b.at_s - a.at_s, 1e-9)
        return Phase(round(span, 2), round((b.cpu_s - a.cpu_s) / span, 3),
                     round((api_b[0] - api_a[0]) / span, 1), round((api_b[1] - api_a[1]) / span, 1))


def _p99(values: Sequence[float]) -> float | None:
    """The bench's p99: the value at index int(0.99 n) of the sorted values (None if none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


@dataclass(frozen=True, slots=True)
class BumpLags:
    """The status lags of one bump (seconds, one per service), in bump order."""

    bump: int  # 1-based
    lags_s: tuple[float, ...]
    timeouts: int = 0
    # Times the probe's watch was re-opened (LIST again) while this bump was timed: services
    # first seen by that LIST arrived when it returned, not when their status changed.
    probe_reopened: int = 0
    # Times the bench read the watch cache with a LIST because its watch had gone quiet while
    # services were waiting (statuswatch.py): those services were stamped by the server's
    # write time all the same, so this counts probe trouble, not operator lag.
    probe_relisted: int = 0
    # The same lags by the time the bench read each change (the watch probe's arrival), where
    # lags_s uses the API server's time of the status write (statuswatch.py); empty for the
    # LIST probe, whose lags are arrivals.
    arrival_lags_s: tuple[float, ...] = ()
    # The samples count the probe last saw on each service still waiting at the time-out
    # (count -> services; -1: never seen): short by a bump or more points at the operator's
    # window, unchanged since an earlier bump at its ticks or the API server's cache.
    waiting_samples: dict[int, int] = field(default_factory=dict)
    # The same services as etcd held them at the time-out (read past the API server:
    # statuswatch.etcd_statuses), and how long before that read each one's status was last
    # written (median, s). etcd at the wanted count means the API server's cache or watch
    # trailed; etcd short by a bump while the writes stay recent means the operator kept
    # writing an old window; old writes mean its ticks stopped writing.
    etcd_samples: dict[int, int] = field(default_factory=dict)
    etcd_write_age_p50_s: float | None = None
    # The operators' own counters from the bump until its last service caught up, per
    # second (status_writes keys: PATCHes per kind and field, Status calls, GC seconds):
    # what one bump cost the operator, where the steady phase's rates average the bumps.
    operator: dict[str, float] = field(default_factory=dict)
    # The operators' event-loop lag over the same span (count, p50_s, p99_s: loop_lag).
    loop_lag: dict[str, float | None] = field(default_factory=dict)

    def largest_burst(self, within_s: float = 0.05) -> int:
        """Most services stamped within ``within_s`` of each other. Ticks spread over an
        interval PATCH statuses apart, so a burst of most of a bump's services points at the
        probe (a watch that held events back, or a re-LIST), not at the operator."""
        lags = sorted(self.lags_s)
        most, start = 0, 0
        for end, lag in enumerate(lags):
            while lag - lags[start] > within_s:
                start += 1
            most = max(most, end - start + 1)
        return most

    def to_dict(self) -> dict[str, Any]:
        lags = sorted(self.lags_s)
        p99 = _p99(lags)
        return {
            "bump": self.bump,
            "samples": len(lags),
            "timeouts": self.timeouts,
            "p50_s": round(lags[len(lags) // 2], 2) if lags else None,
            "p99_s": round(p99, 2) if p99 is not None else None,
            "max_s": round(lags[-1], 2) if lags else None,
            "largest_burst": self.largest_burst(),
            "operator": self.operator,
            "loop_lag": self.loop_lag,
            "probe_reopened": self.probe_reopened,
            "probe_relisted": self.probe_relisted,
            "waiting_samples": {str(k): v for k, v in sorted(self.waiting_samples.items())},
            "etcd_samples": {str(k): v for k, v in sorted(self.etcd_samples.items())},
            "etcd_write_age_p50_s": _round(self.etcd_write_age_p50_s),
            "p99_arrival_s": _round(_p99(self.arrival_lags_s)),
            "max_arrival_s": _round(max(self.arrival_lags_s, default=None)),
        }


@dataclass(frozen=True, slots=True)
class FleetResult:
    """Everything one run measured (``to_dict`` gives the bench's JSON keys)."""

    plan: FleetPlan
    interval_s: float
    pods_running_s: float
    services_ready_s: float
    shards_placed_s: float
    ready_s: float
    status_lags_s: tuple[float, ...]
    lag_timeouts: int
    ramp: Phase
    steady: Phase
    operator_rss_mb: float
    operator_hwm_mb: float
    standin: dict[str, int] = field(default_factory=dict)
    standin_cpu_cores: float = 0.0  # the stand-in's own CPU over the steady phase
    checks: dict[str, Any] = field(default_factory=dict)
    # The same lags split by bump (status_lags_s is their concatenation), and each bump's
    # count of services that never caught up (counted in the lags at lag_timeout_s).
    bumps: tuple[BumpLags, ...] = ()
    # Operator processes, each watching its own group of namespaces; CPU, RSS and API
    # requests above are their sums, and shard_cpu_cores each one's steady-state CPU.
    operator_shards: int = 1
    shard_cpu_cores: tuple[float, ...] = ()
    # The control plane's own CPU over the steady phase (cores per component: etcd,
    # kube-apiserver, ..., kwok), and the API server's busiest request kinds then (every
    # client, requests/s): where the host's time goes besides the operator.
    control_plane_cpu_cores: dict[str, float] = field(default_factory=dict)
    apiserver_top_rps: dict[str, float] = field(default_factory=dict)
    # Over the steady phase, as the API server timed them: the operator's status writes, and
    # the wait of the operator's requests in their APF queue (count, p50_s, p99_s each).
    apiserver_latency: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # The operator's own status PATCHes over the steady phase, per second (its /metrics,
    # summed over the shards): per kind, and per kind/field they carried. Against the
    # objects' count this says how often a status is rewritten, and what for.
    status_writes_rps: dict[str, float] = field(default_factory=dict)
    # Its unary Status calls to the sidecars over the steady phase, per second: calls, and
    # failures (time-outs on a loaded host: that pod is skipped for the tick).
    sidecar_status_rps: dict[str, float] = field(default_factory=dict)
    # The operators' garbage collectors over the steady phase, per generation: ``cores``
    # (seconds of collection per second), ``per_s`` (collections per second), both summed
    # over the operators, and ``longest_s`` (the longest pause since start, the largest).
    operator_gc: dict[str, dict[str, float]] = field(default_factory=dict)
    # The operators' event-loop lag over the steady phase (count, p50_s, p99_s).
    operator_loop_lag: dict[str, float | None] = field(default_factory=dict)
    # The API server's writes to etcd over the steady phase, per resource (requests/s): next
    # to the PATCHes in apiserver_top_rps, the difference is writes that changed nothing.
    etcd_writes_rps: dict[str, float] = field(default_factory=dict)

    @property
    def status_lag_p99_s(self) -> float | None:
        return _p99(self.status_lags_s)

    def to_dict(self) -> dict[str, Any]:
        lags = sorted(self.status_lags_s)
        return {
            **self.plan.to_dict(),
            "interval_s": self.interval_s,
            "ready_s": round(self.ready_s, 1),
            "pods_running_s": round(self.pods_running_s, 1),
            "services_ready_s": round(self.services_ready_s, 1),
            "shards_placed_s": round(self.shards_placed_s, 1),
            "status_lag_p50_s": round(lags[len(lags) // 2], 2) if lags else None,
            "status_lag_p99_s": (round(self.status_lag_p99_s, 2)
                                 if self.status_lag_p99_s is not None else None),
            "status_lag_max_s": round(lags[-1], 2) if lags else None,
            "status_lag_samples": len(lags),
            "status_lag_timeouts": self.lag_timeouts,
            "operator_cpu_cores": self.steady.cpu_cores,
            "operator_rss_mb": round(self.operator_rss_mb, 1),
            "operator_peak_rss_mb": round(self.operator_hwm_mb, 1),
            "api_rps": self.steady.api_rps,
            "ramp": asdict(self.ramp),
            "steady": asdict(self.steady),
            "standin": self.standin,
            "standin_cpu_cores": self.standin_cpu_cores,
            "status_lag_bumps": [b.to_dict() for b in self.bumps],
            "status_lag_p99_arrival_s": _round(_p99(
                [lag for b in self.bumps for lag in b.arrival_lags_s])),
            "operator_shards": self.operator_shards,
            "operator_shard_cpu_cores": list(self.shard_cpu_cores),
            "control_plane_cpu_cores": self.control_plane_cpu_cores,
            "apiserver_top_rps": self.apiserver_top_rps,
            "apiserver_latency": self.apiserver_latency,
            "status_writes_rps": self.status_writes_rps,
            "sidecar_status_rps": self.sidecar_status_rps,
            "operator_gc": self.operator_gc,
            "operator_loop_lag": self.operator_loop_lag,
            "etcd_writes_rps": self.etcd_writes_rps,
            "final_checks": self.checks,
        }


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


def mmlu_questions(data_dir: Path, limit: int = 2000) -> list[str]:
    """Real MMLU test questions (the first ``limit``, subjects in name order)."""
    out: list[str] = []
    for path in sorted((data_dir / "mmlu" / "test").glob("*.csv")):
        with path.open(encoding="utf-8") as f:
            for row in csv.reader(f):
                out.append(row[0])
                if len(out) >= limit:
                    return out
    if not out:
        raise FleetRunError(f"no MMLU questions under {data_dir}", "input")
    return out


class FleetRun:
    """One measured run on ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: LocalCluster, plan: FleetPlan, workdir: Path, *,
                 data_dir: Path, prefix: str = "fleet", interval_s: float = 5.0,
                 bumps: int = 3, bump_gap_s: float | None = None, clusterwide: bool = True,
                 timeout_s: float = 1800.0, lag_timeout_s: float = 120.0,
                 operator_threads: int = 0, lag_probe: str = "watch",
                 status_counters: bool = True, operator_shards: int = 1) -> None:
        if lag_probe not in ("watch", "list"):
            raise ValueError(f"lag_probe must be 'watch' or 'list', not {lag_probe!r}")
        self.cluster = cluster
        self.plan = plan
        self.workdir = workdir
        self.data_dir = data_dir
        self.prefix = prefix
        self.interval_s = interval_s
        self.bumps = bumps
        self.bump_gap_s = bump_gap_s if bump_gap_s is not None else 2 * interval_s
        self.clusterwide = clusterwide
        self.timeout_s = timeout_s
        self.lag_timeout_s = lag_timeout_s
        self.operator_threads = operator_threads  # >0: default executor size (opwrap)
        self.lag_probe = lag_probe
        # The watch probe reads the cache with a LIST when no status event came for this
        # long while services wait (every service's tick PATCHes within an interval).
        self.quiet_relist_s = 3 * interval_s
        self.status_counters = status_counters  # False: the stand-in plays older sidecars
        self._watch: StatusWatch | None = None  # opened at apply time (lag_probe "watch")
        self.rest = cluster.admin_rest()
        self.namespaces = namespace_names(plan, prefix)
        # One operator per group; more than one group means namespaced operators (sharding).
        self.shard_groups = shard_namespaces(self.namespaces, operator_shards)
        self._procs: list[subprocess.Popen[bytes]] = []
        self.standin_port = 0
        self._standin_proc: subprocess.Popen[bytes] | None = None
        self._metrics_ports: list[int] = []  # each operator's /metrics, on loopback

    # ------------------------------------------------------------------ plumbing

    def _get_text(self, path: str) -> str:
        request = urllib.request.Request(self.rest.server + path)
        with urllib.request.urlopen(request, context=self.rest.context, timeout=30) as resp:
            return str(resp.read().decode())

    def _api_counts(self) -> tuple[float, float]:
        return dispatched(self._get_text("/metrics"), FLOW_SCHEMA)

    def _control_plane(self) -> dict[str, ProcSample]:
        """A sample of every control-plane process of the cluster that is running."""
        out: dict[str, ProcSample] = {}
        for component in self.cluster.status():
            if component.running and component.pid is not None:
                with contextlib.suppress(OSError):
                    out[component.name] = proc_sample(component.pid)
        return out

    def _request_mix(self) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
        """The API server's request counts and latency buckets (one ``/metrics`` read)."""
        try:
            text = self._get_text("/metrics")
        except OSError as exc:  # a diagnostic only: never the run's end
            logger.warning("API server request mix not read: %s", exc)
            return {}, {}
        return request_mix(text), latency_buckets(text)

    def _apply(self, path: str, body: dict[str, Any]) -> None:
        self.rest.create(path, body)

    def _parallel(self, fn: Callable[[dict[str, Any]], None], items: list[dict[str, Any]]) -> None:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for _ in pool.map(fn, items):
                pass

    def _read(self, path: str, attempts: int = 4) -> Any:
        """GET ``path``; a time-out or refused read is retried (a loaded API server can take
        longer than one read's 30 s), the last failure raised."""
        for attempt in range(attempts):
            try:
                return self.rest.request("GET", path, timeout=60.0)
            except ApiError:
                raise
            except (ClusterError, OSError) as exc:  # time-outs and refused connections
                if attempt == attempts - 1:
                    raise
                logger.warning("GET %s failed (%s); retrying", path, exc)
                time.sleep(2.0)
        raise AssertionError("unreachable")

    def _list(self, plural: str, *, cached: bool = False) -> list[dict[str, Any]]:
        """Every object of ``plural`` in the run's namespaces. ``cached`` reads the API server's
        watch cache (``resourceVersion=0``: no etcd read, at most a moment behind), for the
        polls that repeat every second; at 1,000 nodes a consistent LIST of 500 services took
        over 60 s on the loaded host, four times in a row, and ended a run."""
        items: list[dict[str, Any]] = []
        spaces = [None] if self.clusterwide else self.namespaces
        query = "?resourceVersion=0" if cached else ""
        for ns in spaces:
            where = f"/namespaces/{ns}" if ns else ""
            answer = self._read(f"/apis/slipstream.dev/v1alpha1{where}/{plural}{query}")
            items.extend(answer.get("items", []))
        return [i for i in items if i["metadata"]["namespace"] in self.namespaces]

    def _running_pods(self) -> int:
        count = 0
        for ns in self.namespaces:
            answer = self._read(
                f"/api/v1/namespaces/{ns}/pods?labelSelector=slipstream.dev%2Fservice"
                "&resourceVersion=0")  # the watch cache, as _list(cached=True)
            count += sum(1 for p in answer["items"]
                         if (p.get("status") or {}).get("phase") == "Running")
        return count

    # ------------------------------------------------------------------ set-up

    def _identity(self) -> Path:
        path = self.workdir / "operator.kubeconfig"
        self.cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_ACCOUNT, path)
        self._apply("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{OPERATOR_ACCOUNT}-bench"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_ACCOUNT,
                          "namespace": OPERATOR_NAMESPACE}],
        })
        fc = "/apis/flowcontrol.apiserver.k8s.io/v1"
        self._apply(f"{fc}/prioritylevelconfigurations", {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration", "metadata": {"name": PRIORITY_LEVEL},
            "spec": {"type": "Limited", "limited": {
                "nominalConcurrencyShares": 100, "lendablePercent": 0,
                "limitResponse": {"type": "Queue", "queuing": {
                    "queues": 64, "handSize": 6, "queueLengthLimit": 100}}}},
        })
        everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                      "clusterScope": True, "namespaces": ["*"]}
        self._apply(f"{fc}/flowschemas", {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
            "metadata": {"name": FLOW_SCHEMA},
            "spec": {
                "priorityLevelConfiguration": {"name": PRIORITY_LEVEL},
                "matchingPrecedence": 500,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [{
                    "subjects": [{"kind": "ServiceAccount", "serviceAccount": {
                        "name": OPERATOR_ACCOUNT, "namespace": OPERATOR_NAMESPACE}}],
                    "resourceRules": [everything],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }],
            },
        })
        return path

    def _crds(self) -> None:
        env = dict(os.environ, KUBECONFIG=str(self.cluster.admin_kubeconfig))
        subprocess.run([str(self.cluster.kubectl), "apply", "--server-side", "--force-conflicts",
                        "-f", str(REPO / "crds")], env=env, check=True, capture_output=True,
                       timeout=120)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        proc = subprocess.Popen(argv, stdout=log if name != "standin" else subprocess.PIPE,
                                stderr=log, cwd=REPO, start_new_session=True)
        log.close()
        self._procs.append(proc)
        return proc

    def _start_standin(self) -> None:
        argv = [sys.executable, "-m", "slipstream_testbed.fleet.server",
                "--kubeconfig", str(self.cluster.admin_kubeconfig), "--lines-per-second", "0.001"]
        if not self.status_counters:
            argv.append("--no-status-counters")
        if not self.clusterwide:
            for ns in self.namespaces:
                argv += ["-n", ns]
        proc = self._spawn("standin", argv)
        self._standin_proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line.startswith("READY "):
            raise FleetRunError(f"stand-in did not start: {line!r}", "standin")
        self.standin_port = int(line.split()[1])

    def _start_operators(self, kubeconfig: Path) -> list[subprocess.Popen[bytes]]:
        """One operator per namespace group; a single one is cluster-wide if the run is."""
        launcher = [str(Path(sys.executable).parent / "slipstream")]
        if self.operator_threads > 0:
            launcher = [sys.executable, "-m", "slipstream_testbed.fleet.opwrap", "--threads",
                        str(self.operator_threads)]
        argv = [*launcher, "operator", "--kubeconfig", str(kubeconfig), "--loopback-only",
                "--interval", str(self.interval_s), "--window", "3600",
                "--stall-timeout", "3600", "--max-shards-per-pod",
                str(shards_per_pod_needed(self.plan, self.prefix) + 1)]
        self._metrics_ports = [free_port(LOOPBACK) for _ in self.shard_groups]

        def args(i: int, spaces: Sequence[str]) -> list[str]:
            return [*argv, "--metrics-port", str(self._metrics_ports[i]), "--metrics-address",
                    LOOPBACK, *(a for ns in spaces for a in ("-n", ns))]

        if len(self.shard_groups) == 1:
            return [self._spawn("operator",
                                args(0, [] if self.clusterwide else self.shard_groups[0]))]
        return [self._spawn(f"operator-{i}", args(i, group))
                for i, group in enumerate(self.shard_groups)]

    def _standin(self, method: str, path: str) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.standin_port}{path}",
                                         method=method, data=b"" if method == "POST" else None)
        with urllib.request.urlopen(request, timeout=30) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def _apply_workload(self) -> None:
        inputs = self.workdir / "input.jsonl"
        lines = batch_lines(mmlu_questions(self.data_dir), self.plan.lines_per_job)
        inputs.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        (self.workdir / "out").mkdir(exist_ok=True)
        for ns in self.namespaces:
            self._apply("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": ns}})
        base = "/apis/slipstream.dev/v1alpha1/namespaces"

        def create(plural: str) -> Callable[[dict[str, Any]], None]:
            def go(obj: dict[str, Any]) -> None:
                ns = obj["metadata"]["namespace"]
                for attempt in range(30):
                    try:
                        self._apply(f"{base}/{ns}/{plural}", obj)
                        return
                    except ApiError as exc:  # namespace not initialised yet
                        if exc.status != 403 or attempt == 29:
                            raise
                        time.sleep(0.5)

            return go

        self._parallel(create("inferenceservices"), service_manifests(self.plan, self.prefix))
        self._parallel(create("offlinejobs"), job_manifests(
            self.plan, self.prefix, f"file://{inputs}", str(self.workdir / "out")))

    # ------------------------------------------------------------------ waits

    def _wait(self, what: str, check: Callable[[], bool], started: float) -> float:
        deadline = started + self.timeout_s
        while not check():
            self._check_alive()
            if time.monotonic() > deadline:
                raise FleetRunError(f"not reached after {self.timeout_s:.0f}s", what)
            time.sleep(1.0)
        return time.monotonic() - started

    def _operator_writes(self) -> dict[str, float] | None:
        """The operators' status PATCH counters, summed (None: one could not be read)."""
        total: dict[str, float] = {}
        for port in self._metrics_ports:
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics",
                                            timeout=30) as resp:
                    text = resp.read().decode()
            except OSError as exc:
                logger.warning("the operator's metrics on port %d could not be read: %s",
                               port, exc)
                return None
            for key, value in status_writes(text).items():
                total[key] = total.get(key, 0.0) + value
        return total

    def _check_alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                raise FleetRunError(f"{proc.args!r} exited with {proc.returncode}", "processes")

    def _services_ready(self) -> bool:
        items = self._list("inferenceservices", cached=True)
        return len(items) == self.plan.services and all(
            _condition(i, "Ready") == "True" for i in items)

    def _shards_placed(self) -> bool:
        items = self._list("offlinejobs", cached=True)
        if len(items) != self.plan.jobs:
            return False
        for job in items:
            shards = (job.get("status") or {}).get("shards") or {}
            if not shards or shards.get("assigned") != shards.get("total"):
                return False
        return True

    def _lags(self) -> list[BumpLags]:
        """Bump the fake pods and time each service's status catching up, per bump."""
        if self.lag_probe == "watch":
            return self._watched_lags()
        out: list[BumpLags] = []
        for bump in range(1, self.bumps + 1):
            lags: list[float] = []
            time.sleep(self.bump_gap_s)
            answer = self._standin("POST", "/bump")
            bumped_at, number = float(answer["at"]), int(answer["bump"])
            want = number * self.plan.replicas
            waiting = {f"{s['metadata']['namespace']}/{s['metadata']['name']}"
                       for s in service_manifests(self.plan, self.prefix)}
            deadline = time.time() + self.lag_timeout_s
            while waiting and time.time() < deadline:
                seen_at = time.time()
                for svc in self._list("inferenceservices"):
                    key = f"{svc['metadata']['namespace']}/{svc['metadata']['name']}"
                    samples = ((svc.get("status") or {}).get("observed") or {}).get("samples", 0)
                    if key in waiting and int(samples) >= want:
                        waiting.discard(key)
                        lags.append(seen_at - bumped_at)
                time.sleep(0.25)
            lags.extend(self.lag_timeout_s for _ in waiting)
            out.append(BumpLags(bump, tuple(lags), len(waiting)))
        return out

    def _watched_lags(self) -> list[BumpLags]:
        """The same bumps, with each service's catch-up stamped by a status watch."""
        watch = self._watch
        if watch is None:
            watch = StatusWatch(self.rest, None if self.clusterwide else self.namespaces)
            watch.start()
        if not watch.wait_open(self.lag_timeout_s):
            raise FleetRunError("the status watch did not open", "status lag")
        keys = [f"{s['metadata']['namespace']}/{s['metadata']['name']}"
                for s in service_manifests(self.plan, self.prefix)]
        out: list[BumpLags] = []
        try:
            for bump in range(1, self.bumps + 1):
                lags: list[float] = []
                arrivals: list[float] = []
                time.sleep(self.bump_gap_s)
                counters = self._operator_writes()
                answer = self._standin("POST", "/bump")
                bumped_at, number = float(answer["at"]), int(answer["bump"])
                want = number * self.plan.replicas
                waiting = set(keys)
                reopened, refreshed = watch.reopened, watch.refreshed
                deadline = time.time() + self.lag_timeout_s
                quiet_since = bumped_at  # a quiet spell counts from the bump or last LIST
                while waiting and time.time() < deadline:
                    now = time.time()
                    if now - max(watch.last_event_at, quiet_since) > self.quiet_relist_s:
                        self._refresh(watch)
                        quiet_since = time.time()
                    for key in list(waiting):
                        at = watch.reached(key, want, bumped_at)
                        if at is not None:
                            waiting.discard(key)
                            lags.append(at - bumped_at)
                            arrived = watch.reached(key, want, bumped_at, arrival=True)
                            arrivals.append((arrived or at) - bumped_at)
                    time.sleep(0.1)
                lags.extend(self.lag_timeout_s for _ in waiting)
                arrivals.extend(self.lag_timeout_s for _ in waiting)
                after = self._operator_writes()
                spent = rates_of(counters, after, time.time() - bumped_at)
                short = Counter(-1 if (n := watch.latest(key)) is None else n for key in waiting)
                etcd, age = self._etcd_view(waiting) if waiting else ({}, None)
                out.append(BumpLags(bump, tuple(lags), len(waiting),
                                    probe_reopened=watch.reopened - reopened,
                                    probe_relisted=watch.refreshed - refreshed,
                                    arrival_lags_s=tuple(arrivals),
                                    waiting_samples=dict(short),
                                    etcd_samples=etcd, etcd_write_age_p50_s=age,
                                    operator=spent, loop_lag=loop_lag(counters, after)))
        finally:
            watch.stop()
        logger.info("status watch: %d events, reopened %d times", watch.events, watch.reopened)
        return out

    def _etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.cluster.config.ports.etcd_client}"

    def _etcd_view(self, keys: set[str]) -> tuple[dict[int, int], float | None]:
        """The samples counts of ``keys`` in etcd (-1: not there, -2: etcd not read), and
        the median age of their last status write."""
        try:
            held = etcd_statuses(self._etcd_url())
        except (OSError, ValueError) as exc:
            logger.warning("status lag: etcd could not be read: %s", exc)
            return {-2: len(keys)}, None
        now = time.time()
        counts = Counter(held[k][0] if k in held else -1 for k in keys)
        ages = sorted(now - at for k in keys if k in held and (at := held[k][1]) is not None)
        return dict(counts), (ages[len(ages) // 2] if ages else None)

    def _refresh(self, watch: StatusWatch) -> None:
        """Read the services from the watch cache into ``watch`` (it has gone quiet)."""
        try:
            items = self._list("inferenceservices", cached=True)
        except (ApiError, ClusterError, OSError) as exc:
            logger.warning("status lag: LIST while the watch was quiet failed: %s", exc)
            return
        logger.info("status lag: the watch was quiet; read %d services from the cache",
                    len(items))
        watch.refresh(items, time.time())

    # ------------------------------------------------------------------ the run

    def run(self) -> FleetResult:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self._processes():
            self._crds()
            kubeconfig = self._identity()
            self._start_standin()
            operators = self._start_operators(kubeconfig)
            pids = [p.pid for p in operators]
            time.sleep(2.0)
            self._check_alive()
            p0, a0 = procs_sample(pids), self._api_counts()
            started = time.monotonic()
            self._apply_workload()
            if self.lag_probe == "watch":  # open long before the bumps (see wait_open)
                self._watch = StatusWatch(self.rest,
                                          None if self.clusterwide else self.namespaces)
                self._watch.start()
            try:
                running_s = self._wait("pods running",
                                       lambda: self._running_pods() >= self.plan.pods, started)
                services_s = self._wait("services ready", self._services_ready, started)
                shards_s = self._wait("shards placed", self._shards_placed, started)
            except FleetRunError as exc:
                now, api = procs_sample(pids), self._api_counts()
                exc.partial = {"elapsed_s": round(now.at_s - p0.at_s, 1),
                               "ramp": asdict(Phase.between(p0, now, a0, api)),
                               "operator_rss_mb": round(now.rss_mb, 1),
                               "checks": self._checks(),
                               "standin": self._standin("GET", "/totals")}
                raise
            ready_s = max(services_s, shards_s)
            p1, a1 = procs_sample(pids), self._api_counts()
            shard_starts = [proc_sample(pid) for pid in pids]
            c1, (m1, h1) = self._control_plane(), self._request_mix()
            assert self._standin_proc is not None
            s1 = proc_sample(self._standin_proc.pid)
            w1 = self._operator_writes()
            bumps = self._lags()
            p2, a2 = procs_sample(pids), self._api_counts()
            per_shard = [proc_sample(pid) for pid in pids]
            c2, (m2, h2) = self._control_plane(), self._request_mix()
            s2 = proc_sample(self._standin_proc.pid)
            w2 = self._operator_writes()
            checks = self._checks()
            standin = {k: int(v) for k, v in self._standin("GET", "/totals").items()}
        rates = rates_of(w1, w2 or None, p2.at_s - p1.at_s)
        return FleetResult(
            plan=self.plan, interval_s=self.interval_s, pods_running_s=running_s,
            services_ready_s=services_s, shards_placed_s=shards_s, ready_s=ready_s,
            status_lags_s=tuple(lag for b in bumps for lag in b.lags_s),
            lag_timeouts=sum(b.timeouts for b in bumps), bumps=tuple(bumps),
            ramp=Phase.between(p0, p1, a0, a1), steady=Phase.between(p1, p2, a1, a2),
            operator_rss_mb=p2.rss_mb, operator_hwm_mb=p2.hwm_mb, standin=standin,
            standin_cpu_cores=round((s2.cpu_s - s1.cpu_s) / max(s2.at_s - s1.at_s, 1e-9), 3),
            checks=checks, operator_shards=len(pids),
            shard_cpu_cores=tuple(
                round((b.cpu_s - a.cpu_s) / max(b.at_s - a.at_s, 1e-9), 3)
                for a, b in zip(shard_starts, per_shard, strict=True)),
            control_plane_cpu_cores={
                name: round((c2[name].cpu_s - a.cpu_s) / max(c2[name].at_s - a.at_s, 1e-9), 3)
                for name, a in c1.items() if name in c2},
            apiserver_top_rps=top_rates(*_requests(m1, m2), p2.at_s - p1.at_s)
            if m1 and m2 else {},
            etcd_writes_rps={k.removeprefix(ETCD_WRITES): v for k, v in top_rates(
                *_requests(m1, m2, etcd=True), p2.at_s - p1.at_s, limit=6).items()}
            if m1 and m2 else {},
            apiserver_latency={key: bucket_quantiles(h1.get(key, {}), after)
                               for key, after in h2.items() if after},
            status_writes_rps={k: v for k, v in rates.items()
                               if not k.startswith(("Status/", "GC"))},
            operator_loop_lag=loop_lag(w1, w2),
            operator_gc=gc_summary(w1, w2, p2.at_s - p1.at_s) if w1 is not None and w2 else {},
            sidecar_status_rps={k.removeprefix("Status/"): v for k, v in rates.items()
                                if k.startswith("Status/")},
        )

    def _checks(self) -> dict[str, Any]:
        """What the statuses say, for the test to compare with the stand-in's own counts.

        Read from the watch cache: the bumps' status changes already reached the probe's
        watch, which the same cache serves, so it holds them. Consistent LISTs of 500
        services timed out four times in a row (60 s each) at the end of a 1,000-node run and
        took the whole run's measurements with them; a read that still fails is reported in
        the checks (``error``) instead of failing the run.
        """
        try:
            services = self._list("inferenceservices", cached=True)
            jobs = self._list("offlinejobs", cached=True)
        except (ClusterError, OSError) as exc:
            logger.warning("the final status checks could not be read: %s", exc)
            return {"error": str(exc)[:300]}
        return {
            "services_ready": sum(1 for s in services if _condition(s, "Ready") == "True"),
            "ready_replicas": sum(int((s.get("status") or {}).get("readyReplicas", 0))
                                  for s in services),
            "samples": sorted({int(((s.get("status") or {}).get("observed") or {})
                                   .get("samples", 0)) for s in services}),
            "active_shards": sum(int(((s.get("status") or {}).get("offline") or {})
                                     .get("activeShards", 0)) for s in services),
            "shards_total": sum(int(((j.get("status") or {}).get("shards") or {})
                                    .get("total", 0)) for j in jobs),
            "shards_assigned": sum(int(((j.get("status") or {}).get("shards") or {})
                                       .get("assigned", 0)) for j in jobs),
            "job_phases": sorted({str((j.get("status") or {}).get("phase")) for j in jobs}),
            # Services whose status write time the lag probe can read (statuswatch.py).
            "status_write_times": sum(1 for s in services if status_written(s) is not None),
            # The same samples as etcd holds them (read past the API server): a cache that
            # trails etcd shows as a difference between the two.
            "samples_etcd": self._etcd_samples(),
        }

    def _etcd_samples(self) -> dict[str, int] | str:
        try:
            held = etcd_statuses(self._etcd_url())
        except (OSError, ValueError) as exc:
            return f"not read: {str(exc)[:120]}"
        spaces = set(self.namespaces)
        counts = Counter(n for key, (n, _) in held.items() if key.split("/", 1)[0] in spaces)
        return {str(k): v for k, v in sorted(counts.items())}

    @contextlib.contextmanager
    def _processes(self) -> Iterator[None]:
        try:
            yield
        finally:
            # Newest first, each waited for: the operator stops before the fake pods vanish.
            for proc in reversed(self._procs):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                if proc.stdout is not None:
                    proc.stdout.close()
            self._procs.clear()

    def cleanup(self) -> None:
        """Delete the run's namespaces (the cluster stays up)."""
        for ns in self.namespaces:
            with contextlib.suppress(ApiError):
                self.rest.request("DELETE", f"/api/v1/namespaces/{ns}")
