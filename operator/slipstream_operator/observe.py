"""Online latency and load over a window, from the sidecars' own counters.

On its reconcile timer the operator reads each ready pod's online histograms and
counters from the pod's ``Status`` reply (``online_counters``, the same numbers as
the sidecar's ``/metrics``; ``sidecar_client`` turns them into a :class:`Sample`),
or scrapes ``/metrics`` by pod IP from a sidecar whose ``Status`` lacks them, and
keeps a short history of cumulative samples per pod.
Subtracting the oldest sample inside the window from the newest gives the
window's histogram of TTFT and TBT (online class), from which the mean
(sum/count) and the P99 (linear interpolation inside the bucket, as PromQL's
``histogram_quantile``) follow; counters give the arrival rate and the mean
output length. Pods are summed bucket by bucket. A pod that restarted
(counter went down) contributes only its samples since the restart.

When a Prometheus URL is configured the handlers ask Prometheus instead
(:func:`promql_queries` lists the queries); the numbers mean the same.

Pure functions over text and numbers; the HTTP fetch lives in ``handlers``.
Deliberately left out: per-pod SLO attainment (the SLO is a service-level
promise) and any metric the sidecar does not export (prompt length: the
caller supplies a default).
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from slipstream_operator.budgets import LoadStats, ObservedSLO

ONLINE = "online"
TTFT = "slipstream_ttft_seconds"
TBT = "slipstream_tbt_seconds"
ADMITTED = "slipstream_requests_admitted_total"
FINISHED = "slipstream_requests_finished_total"
OUTPUT_TOKENS = "slipstream_output_tokens_total"


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative bucket counts (upper bound, count) ascending, plus sum and count."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    count: float

    def minus(self, older: Histogram) -> Histogram:
        if self.count < older.count or len(self.buckets) != len(older.buckets):
            return self  # a restart: everything since it
        return Histogram(
            buckets=tuple(
                (le, c - o) for (le, c), (_, o) in zip(self.buckets, older.buckets, strict=True)
            ),
            total=self.total - older.total,
            count=self.count - older.count,
        )

    def plus(self, other: Histogram) -> Histogram:
        if not self.buckets:
            return other
        if not other.buckets:
            return self
        return Histogram(
            buckets=tuple(
                (le, c + o) for (le, c), (_, o) in zip(self.buckets, other.buckets, strict=True)
            ),
            total=self.total + other.total,
            count=self.count + other.count,
        )

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """histogram_quantile semantics: linear inside the bucket holding rank q*count."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_le, lower_count = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower_le  # beyond the last finite bucket: its bound
                span = cum - lower_count
                frac = (rank - lower_count) / span if span > 0 else 1.0
                return lower_le + (le - lower_le) * frac
            lower_le, lower_count = le, cum
        return lower_le


EMPTY = Histogram(buckets=(), total=0.0, count=0.0)


@dataclass(frozen=True, slots=True)
class Sample:
    """One scrape of one pod's sidecar, reduced to what the operator uses."""

    at_s: float
    ttft: Histogram
    tbt: Histogram
    admitted: float
    finished: float
    output_tokens: float

    def minus(self, older: Sample) -> Sample:
        def counter(new: float, old: float) -> float:
            return new - old if new >= old else new

        return Sample(
            at_s=self.at_s,
            ttft=self.ttft.minus(older.ttft),
            tbt=self.tbt.minus(older.tbt),
            admitted=counter(self.admitted, older.admitted),
            finished=counter(self.finished, older.finished),
            output_tokens=counter(self.output_tokens, older.output_tokens),
        )


_WANTED = frozenset({
    f"{TTFT}_bucket", f"{TTFT}_sum", f"{TTFT}_count",
    f"{TBT}_bucket", f"{TBT}_sum", f"{TBT}_count",
    ADMITTED, FINISHED, OUTPUT_TOKENS,
})
_LINE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class _UnparsedError(ValueError):
    """A line the fast path does not read; the whole text goes to prometheus_client."""


def _labels(raw: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(raw):
        m = _LABEL.match(raw, pos)
        if m is None or m.end() == pos:
            if raw[pos:].strip():
                raise _UnparsedError(raw)
            break
        value = m.group(2)
        if "\\" in value:
            value = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)), value)
        labels[m.group(1)] = value
        pos = m.end()
    return labels


def _fast_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the wanted series, read line by line with two regexes.

    Only lines of the five sidecar families are parsed at all, so a sidecar's other series
    cost one ``startswith`` each. Anything unusual raises :class:`_UnparsedError`.
    """
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if not line.startswith("slipstream_"):
            continue
        cut = len(line)
        for stop in ("{", " ", "\t"):
            at = line.find(stop)
            if at != -1:
                cut = min(cut, at)
        if line[:cut] not in _WANTED:
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise _UnparsedError(line)
        out.append((m.group(1), _labels(m.group(2) or ""), float(m.group(3))))
    return out


def _client_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in _WANTED]


def parse_sample(text: str, at_s: float, cls: str = ONLINE) -> Sample:
    """Reduce a sidecar's Prometheus text exposition to a :class:`Sample` for one class.

    One scrape per pod per tick makes this the operator's hottest code at fleet size, so
    the wanted lines are read with regexes; a text it cannot read that way goes through
    prometheus_client's parser instead (same result, several times the CPU).
    """
    try:
        samples = _fast_samples(text)
    except (_UnparsedError, ValueError):
        samples = _client_samples(text)
    hist: dict[str, dict[str, float]] = {TTFT: {}, TBT: {}}
    sums: dict[str, float] = {TTFT: 0.0, TBT: 0.0}
    counts: dict[str, float] = {TTFT: 0.0, TBT: 0.0}
    admitted = finished = tokens = 0.0
    for name, labels, value in samples:
        if labels.get("class") != cls:
            continue
        family, _, suffix = name.rpartition("_")
        if family in hist:
            if suffix == "bucket":
                hist[family][labels["le"]] = value
            elif suffix == "sum":
                sums[family] = value
            elif suffix == "count":
                counts[family] = value
        elif name == ADMITTED:
            admitted += value
        elif name == FINISHED and labels.get("outcome") == "ok":
            finished += value
        elif name == OUTPUT_TOKENS:
            tokens += value

    def build(name: str) -> Histogram:
        buckets = tuple(sorted((float(le), c) for le, c in hist[name].items()))
        return Histogram(buckets=buckets, total=sums[name], count=counts[name])

    return Sample(at_s, build(TTFT), build(TBT), admitted, finished, tokens)


@dataclass
class PodHistory:
    """Recent samples of one pod (mutable, owned by the handler's memory)."""

    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=512))

    def add(self, sample: Sample, window_s: float) -> None:
        """Append ``sample`` unless it is not newer than the last one (a cached ``Status``
        reply seen by a second tick carries the time it arrived, not the tick's)."""
        if self.samples and sample.at_s <= self.samples[-1].at_s:
            return
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.at_s - self.samples[1].at_s >= window_s:
            self.samples.popleft()

    def window(self) -> Sample | None:
        if len(self.samples) < 2:
            return None
        return self.samples[-1].minus(self.samples[0])

    def span_s(self) -> float:
        return self.samples[-1].at_s - self.samples[0].at_s if len(self.samples) > 1 else 0.0


@dataclass(frozen=True, slots=True)
class WindowStats:
    observed: ObservedSLO
    load: LoadStats
    span_s: float


def combine(
    histories: Iterable[PodHistory], default_prompt_tokens: float, default_output_tokens: float
) -> WindowStats:
    """Service-wide statistics over the window from every pod's history."""
    ttft, tbt = EMPTY, EMPTY
    admitted = finished = tokens = 0.0
    span = 0.0
    for history in histories:
        win = history.window()
        if win is None:
            continue
        ttft, tbt = ttft.plus(win.ttft), tbt.plus(win.tbt)
        admitted += win.admitted
        finished += win.finished
        tokens += win.output_tokens
        span = max(span, history.span_s())
    observed = ObservedSLO(
        samples=int(ttft.count),
        ttft_mean_s=ttft.mean(),
        ttft_p99_s=ttft.quantile(0.99),
        tbt_mean_s=tbt.mean(),
        tbt_p99_s=tbt.quantile(0.99),
    )
    rate = admitted / span if span > 0 else 0.0
    out_mean = tokens / finished if finished > 0 else default_output_tokens
    load = LoadStats(
        arrival_rate_rps=rate,
        mean_prompt_tokens=default_prompt_tokens,
        mean_output_tokens=out_mean,
    )
    return WindowStats(observed=observed, load=load, span_s=span)


def promql_queries(namespace: str, service: str, window: str) -> dict[str, str]:
    """The PromQL that yields the same numbers from Prometheus (pods labelled by service)."""
    sel = f'namespace="{namespace}",slipstream_dev_service="{service}",class="online"'

    def quantile(metric: str) -> str:
        return (
            f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{{{sel}}}[{window}])))"
        )

    def mean(metric: str) -> str:
        return (
            f"sum(rate({metric}_sum{{{sel}}}[{window}])) / "
            f"sum(rate({metric}_count{{{sel}}}[{window}]))"
        )

    return {
        "ttft_p99_s": quantile(TTFT),
        "ttft_mean_s": mean(TTFT),
        "tbt_p99_s": quantile(TBT),
        "tbt_mean_s": mean(TBT),
        "samples": f"sum(increase({TTFT}_count{{{sel}}}[{window}]))",
        "arrival_rate_rps": f"sum(rate({ADMITTED}{{{sel}}}[{window}]))",
    }


def stats_from_prometheus(
    values: dict[str, float | None], window_s: float, default_prompt_tokens: float,
    default_output_tokens: float,
) -> WindowStats:
    """Window statistics from the scalar results of :func:`promql_queries` (None: no data)."""

    def get(key: str) -> float | None:
        value = values.get(key)
        return None if value is None or math.isnan(value) else float(value)

    samples = int(get("samples") or 0)
    observed = ObservedSLO(
        samples=samples,
        ttft_mean_s=get("ttft_mean_s"),
        ttft_p99_s=get("ttft_p99_s"),
        tbt_mean_s=get("tbt_mean_s"),
        tbt_p99_s=get("tbt_p99_s"),
    )
    load = LoadStats(
        arrival_rate_rps=get("arrival_rate_rps") or 0.0,
        mean_prompt_tokens=default_prompt_tokens,
        mean_output_tokens=default_output_tokens,
    )
    return WindowStats(observed=observed, load=load, span_s=window_s)
