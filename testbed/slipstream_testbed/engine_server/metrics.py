"""vLLM's Prometheus metrics for the engine model, on a private registry.

Names, types, label names (``model_name``, ``engine``; ``finished_reason``
on ``vllm:request_success``) and histogram buckets follow vLLM v1's
``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``), so dashboards,
the sidecar and the operator can read the engine model exactly as they read
vLLM. ``prometheus_client`` appends ``_total`` to counters
(``vllm:prompt_tokens_total``), as it does for vLLM.

What is counted when (as vLLM does it): ``prompt_tokens`` gains a request's
whole prompt when its first token is produced; ``generation_tokens`` gains
each output token; ``iteration_tokens_total`` observes the tokens of each
engine step; the per-request histograms observe at finish;
``request_success`` counts finished requests by reason (``stop``,
``length``, ``abort``).

Deliberately left out: vLLM's deprecated aliases (``vllm:gpu_cache_usage_perc``,
``vllm:time_per_output_token_seconds``), LoRA, speculative decoding and
cache-config info metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "EngineMetrics", "FinishedRequestStats"]

_LABELS = ("model_name", "engine")
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")


def _one_two_five(max_value: int) -> list[float]:
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    """One finished request's timings (seconds) and token counts."""

    finish_reason: str
    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int


class EngineMetrics:
    """The engine server's ``/metrics``: update methods plus the exposition text."""

    def __init__(self, model_name: str, max_model_len: int, engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = (model_name, engine)
        self._running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", _LABELS, registry=r
        ).labels(*labels)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            _LABELS,
            registry=r,
        ).labels(*labels)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABELS, "finished_reason"),
            registry=r,
        )
        self._success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}
        token_buckets = _one_two_five(max_model_len)
        self._req_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            _LABELS,
            buckets=token_buckets,
            registry=r,
        ).labels(*labels)
        self._req_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            _LABELS,
            buckets=token_buckets,
            registry=r,
        ).labels(*labels)
        self._req_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            _LABELS,
            buckets=token_buckets,
            registry=r,
        ).labels(*labels)
        self._iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            _LABELS,
            buckets=_ITERATION_TOKEN_BUCKETS,
            registry=r,
        ).labels(*labels)
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        ).labels(*labels)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _LABELS,
            buckets=_ITL_BUCKETS,
            registry=r,
        ).labels(*labels)

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, _LABELS, buckets=_REQUEST_LATENCY_BUCKETS, registry=r
            ).labels(*labels)

        self._e2e = latency(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self._queue = latency(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self._prefill = latency(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self._decode = latency(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self._inference = latency(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )

    # -- per step ---------------------------------------------------------------------------

    def record_step(
        self,
        *,
        running: int,
        waiting: int,
        kv_usage: float,
        prefix_queries: int,
        prefix_hits: int,
        preemptions: int,
        step_tokens: int,
    ) -> None:
        """Gauges after a step, and the step's increments of the counters."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_usage.set(kv_usage)
        if prefix_queries:
            self._prefix_queries.inc(prefix_queries)
        if prefix_hits:
            self._prefix_hits.inc(prefix_hits)
        if preemptions:
            self._preemptions.inc(preemptions)
        if step_tokens:
            self._iteration_tokens.observe(step_tokens)

    def record_queue_sizes(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)

    # -- per token / request ----------------------------------------------------------------

    def first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt_tokens.inc(prompt_tokens)

    def inter_token(self, itl_s: float) -> None:
        self._itl.observe(itl_s)

    def generated(self, n: int) -> None:
        self._generation_tokens.inc(n)

    def finished(self, stats: FinishedRequestStats) -> None:
        self._success[stats.finish_reason].inc()
        self._e2e.observe(stats.e2e_s)
        self._queue.observe(stats.queue_s)
        self._prefill.observe(stats.prefill_s)
        self._decode.observe(stats.decode_s)
        self._inference.observe(stats.prefill_s + stats.decode_s)
        self._req_prompt_tokens.observe(stats.prompt_tokens)
        self._req_generation_tokens.observe(stats.generation_tokens)
        self._req_max_tokens.observe(stats.max_tokens)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
