"""Prometheus metrics of one sidecar, class-separated, in a private registry.

Every name starts with ``slipstream_``, uses base units (seconds, tokens) and
ends in ``_total`` for counters. Labels are low-cardinality: ``class``
(online/offline), ``outcome``, ``state``, ``source``. vLLM's own ``vllm:*``
metrics stay on the engine; these are what only the sidecar can see, because
it tells the two classes apart.

The endpoint picker's view (:class:`EngineView`): a Gateway API Inference
Extension picker (llm-d's EPP) scrapes the pool's target port, which is the
sidecar's, for the ``vllm:`` series it scores pods by. ``/metrics`` therefore
also carries those series (:data:`EPP_FAMILIES`), copied from the engine's own
``/metrics`` with vLLM's names, help, types and labels, with one change:
``vllm:num_requests_waiting`` adds the online requests the sidecar holds (the
engine cannot see them). Offline work is not added: the picker compares pods
for online traffic, and the sidecar yields offline work to online work.

Deliberately left out: per-request, per-shard or per-model labels (unbounded
cardinality) and anything derived over time windows (that is PromQL's job).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import utils as _prom_utils

CLASSES = ("online", "offline")

_TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_TBT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)
_OVERHEAD_BUCKETS = (
    50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 10e-3,
    25e-3, 50e-3, 100e-3, 250e-3, 1.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """One class's cumulative histogram: (upper bound, count at or below it), sum, count."""

    buckets: tuple[tuple[float, float], ...]
    total: float
    count: float


@dataclass(frozen=True, slots=True)
class ClassCounters:
    """One class's latency histograms and counters, as ``/metrics`` exports them now."""

    ttft: HistogramSnapshot
    tbt: HistogramSnapshot
    admitted: float
    finished_ok: float
    output_tokens: float


def _histogram(family: Histogram, cls: str) -> HistogramSnapshot:
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for metric in family.collect():
        for sample in metric.samples:
            if sample.labels.get("class") != cls:
                continue
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return HistogramSnapshot(tuple(sorted(buckets)), total, count)


def _counter(family: Counter, **labels: str) -> float:
    return sum(sample.value for metric in family.collect() for sample in metric.samples
               if sample.name.endswith("_total")
               and all(sample.labels.get(k) == v for k, v in labels.items()))


class SidecarMetrics:
    """The sidecar's metric families; one instance per process (or per test)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "slipstream_ttft_seconds",
            "Time from arrival at the sidecar to the first output token, per class.",
            ["class"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tbt = Histogram(
            "slipstream_tbt_seconds",
            "Gap between consecutive output tokens of one stream, per class.",
            ["class"], buckets=_TBT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "slipstream_request_duration_seconds",
            "Time from arrival at the sidecar to the last byte, per class.",
            ["class"], buckets=_E2E_BUCKETS, registry=r,
        )
        self.proxy_overhead = Histogram(
            "slipstream_proxy_overhead_seconds",
            "Time an online request spends in the sidecar on its way to its first token, by "
            "stage: to_engine (handler start to sending it to the engine, including any time held "
            "for admission) and relay (the engine's first chunk in, to written to the client).",
            ["stage"], buckets=_OVERHEAD_BUCKETS, registry=r,
        )
        self.admitted = Counter(
            "slipstream_requests_admitted_total",
            "Requests the dispatcher sent to the engine (a resumption counts again).",
            ["class"], registry=r,
        )
        self.grants_at_arrival = Counter(
            "slipstream_online_grants_at_arrival_total",
            "Online requests decided and granted inside their own handler on arrival (sent to "
            "the engine without waiting for the rest of a burst to be parsed).",
            registry=r,
        )
        self.sent_on_arrival = Counter(
            "slipstream_online_sent_on_arrival_total",
            "Online requests the compiled front sent to the engine on arrival, inside the "
            "allowance the dispatcher gave it (no decision each; counted in "
            "slipstream_online_grants_at_arrival_total too).",
            registry=r,
        )
        self.finished = Counter(
            "slipstream_requests_finished_total",
            "Requests that left the sidecar, by outcome (ok, client_error, engine_error, "
            "cancelled, rejected).",
            ["class", "outcome"], registry=r,
        )
        self.preemptions = Counter(
            "slipstream_preemptions_total",
            "Requests aborted by the dispatcher to make room (offline) or to reorder.",
            ["class"], registry=r,
        )
        self.resumed_tokens = Counter(
            "slipstream_offline_resumed_tokens_total",
            "Output tokens offline requests had produced when they were resumed as "
            "continuations (after a preemption or an engine restart): kept, not generated "
            "again.",
            registry=r,
        )
        self.output_tokens = Counter(
            "slipstream_output_tokens_total",
            "Output tokens streamed from the engine, per class (offline rate = offline tok/s).",
            ["class"], registry=r,
        )
        self.queued = Gauge(
            "slipstream_queued_requests",
            "Requests held in the sidecar waiting for admission, per class.",
            ["class"], registry=r,
        )
        self.in_flight = Gauge(
            "slipstream_in_flight_requests",
            "Requests submitted to the engine and not finished, per class.",
            ["class"], registry=r,
        )
        self.budget = Gauge(
            "slipstream_budget_seconds",
            "Per-iteration latency budget in force (0: no budget).", registry=r,
        )
        self.generation = Gauge(
            "slipstream_config_generation",
            "Generation of the configuration in force.", registry=r,
        )
        self.step = Gauge(
            "slipstream_step_seconds",
            "Engine iteration time: predicted by the latency model, or observed from token gaps.",
            ["source"], registry=r,
        )
        self.engine_ready = Gauge(
            "slipstream_engine_ready",
            "1 when the engine's /health answered 200 at the last check.", registry=r,
        )
        self.batch_lines = Counter(
            "slipstream_batch_lines_total",
            "Offline input lines written to a shard's output, by outcome (completed, failed).",
            ["outcome"], registry=r,
        )
        self.shards = Gauge(
            "slipstream_shards",
            "Shards known to this sidecar, by state.", ["state"], registry=r,
        )
        self.length_predictions = Counter(
            "slipstream_length_predictions_total",
            "Online output-length predictions, by source: text (similar past prompts) or "
            "input (past requests of similar input length; no embedding was needed).",
            ["source"], registry=r,
        )
        self.length_history = Gauge(
            "slipstream_length_history_records",
            "Finished online requests in the length predictor's history, by history.",
            ["history"], registry=r,
        )
        self.length_dropped = Counter(
            "slipstream_length_learn_dropped_total",
            "Finished requests the text history skipped because its worker was behind.",
            registry=r,
        )
        for stage in ("to_engine", "relay"):
            self.proxy_overhead.labels(stage)
        for src in ("text", "input"):
            self.length_predictions.labels(src)
            self.length_history.labels(src)
        for c in CLASSES:
            for fam in (self.ttft, self.tbt, self.e2e, self.admitted, self.preemptions,
                        self.output_tokens, self.queued, self.in_flight):
                fam.labels(c)
        for src in ("predicted", "observed"):
            self.step.labels(src)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def counters(self, cls: str) -> ClassCounters:
        """The class's TTFT and TBT histograms and request and token counters, read from
        the same families ``/metrics`` renders (so the two always agree)."""
        return ClassCounters(
            ttft=_histogram(self.ttft, cls),
            tbt=_histogram(self.tbt, cls),
            admitted=_counter(self.admitted, **{"class": cls}),
            finished_ok=_counter(self.finished, **{"class": cls, "outcome": "ok"}),
            output_tokens=_counter(self.output_tokens, **{"class": cls}),
        )


# ------------------------------------------------------------------ the endpoint picker's view

WAITING = "vllm:num_requests_waiting"
LORA_INFO = "vllm:lora_requests_info"
EPP_FAMILIES = (
    WAITING,
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    LORA_INFO,
)
"""The vLLM families an endpoint picker reads, in the order ``/metrics`` writes them."""

_NO_LORA = (
    f"# HELP {LORA_INFO} Running stats on lora requests.\n"
    f"# TYPE {LORA_INFO} gauge\n"
)


def _number(value: float) -> str:
    """A value as the text format writes it (prometheus_client's own formatting)."""
    return str(_prom_utils.floatToGoString(value))  # type: ignore[no-untyped-call]


def _family_of(line: str) -> str:
    """The metric name a line of the text format is about (its sample or comment)."""
    if line.startswith("#"):
        parts = line.split(" ", 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def _add_to_sample(line: str, extra: float) -> str:
    """A sample line with ``extra`` added to its value (labels and timestamp kept)."""
    close = line.rfind("}")
    split_at = close + 1 if close >= 0 else line.find(" ")
    if split_at <= 0:
        return line
    head, parts = line[:split_at], line[split_at:].split()
    try:
        value = float(parts[0]) if parts else math.nan
    except ValueError:
        return line
    if math.isnan(value):
        return line
    parts[0] = _number(value + extra)
    return f"{head} {' '.join(parts)}"


def epp_series(engine_text: str, held_online: int, *, now: float | None = None) -> str:
    """The :data:`EPP_FAMILIES` lines of the engine's ``/metrics`` text, with
    ``vllm:num_requests_waiting`` raised by ``held_online`` in each engine's series.

    An engine without LoRA (vLLM serves ``vllm:lora_requests_info`` only with
    ``--enable-lora``) gets the series vLLM would serve for no adapters at all:
    ``max_lora="0"``, no running or waiting adapters, the value the time now, as
    vLLM's ``set_to_current_time``. A family the engine does not serve is left out.
    """
    wanted = set(EPP_FAMILIES)
    kept: dict[str, list[str]] = {name: [] for name in EPP_FAMILIES}
    for line in engine_text.splitlines():
        name = _family_of(line)
        if name not in wanted:
            continue
        if name == WAITING and not line.startswith("#") and held_online:
            kept[name].append(_add_to_sample(line, float(held_online)))
        else:
            kept[name].append(line)
    if not kept[LORA_INFO]:
        stamp = time.time() if now is None else now
        kept[LORA_INFO] = [
            *_NO_LORA.splitlines(),
            f'{LORA_INFO}{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} '
            f"{_number(stamp)}",
        ]
    out = [line for name in EPP_FAMILIES for line in kept[name]
           if any(not x.startswith("#") for x in kept[name])]
    return "\n".join(out) + "\n" if out else ""


class EngineView:
    """The engine's ``/metrics`` as the endpoint picker must see the pod (:func:`epp_series`).

    ``fetch`` reads the engine's ``/metrics`` (None when it did not answer). Scrapes that
    arrive together share one fetch, and one fetched text serves for ``max_age_s`` (a picker
    scrapes every pod every 50 ms or so); the held count is always the one now. When the
    engine does not answer, none of these series are served (the pod is not ready then).
    """

    def __init__(self, fetch: Callable[[], Awaitable[bytes | None]],
                 max_age_s: float = 0.025) -> None:
        self._fetch = fetch
        self.max_age_s = max_age_s
        self._text = ""
        self._at = -math.inf
        self._inflight: asyncio.Future[str] | None = None

    async def engine_text(self) -> str:
        if time.monotonic() - self._at < self.max_age_s:
            return self._text
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._read())
        inflight = self._inflight
        try:
            return await asyncio.shield(inflight)
        finally:
            if inflight.done() and self._inflight is inflight:
                self._inflight = None

    async def _read(self) -> str:
        body = await self._fetch()
        self._text = body.decode("utf-8", "replace") if body is not None else ""
        self._at = time.monotonic()
        return self._text

    async def render(self, held_online: int) -> bytes:
        text = await self.engine_text()
        return epp_series(text, held_online).encode() if text else b""
