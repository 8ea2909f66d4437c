"""The demo's two runs, side by side: the online window's shape, per-run verdicts, the plot.

Pure except :func:`plot_timelines` (writes a PNG). :mod:`slipstream_cli.demo` replays the
same shaped trace twice on the same service: once with naive co-location (the offline job
simply submitted; the sidecars fill every free slot with offline work, no budget) and once
with Slipstream (the operator's latency model and budget), and hands each run's client
results and Prometheus series to this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream_cli.loadgen import RequestResult, TraceRequest

RUNS = ("naive", "slipstream")


@dataclass(frozen=True, slots=True)
class Slo:
    """The demo's targets (seconds): p99 of TTFT and of the gaps between tokens."""

    ttft_p99_s: float
    tbt_p99_s: float

    def spec(self) -> dict[str, Any]:
        """The InferenceService's ``spec.slo``."""
        return {"ttft": {"p99": f"{round(self.ttft_p99_s * 1000)}ms"},
                "tbt": {"p99": f"{round(self.tbt_p99_s * 1000)}ms"}}


def shape(requests: Sequence[TraceRequest], *, period_s: float, valley_keep: float
          ) -> list[TraceRequest]:
    """The trace with visible peaks and valleys: every ``period_s`` the first half keeps all
    arrivals (a peak), the second half only every ``1/valley_keep``-th (a valley).

    Deterministic (it keeps by index, not at random), so both runs replay the same requests.
    """
    if period_s <= 0 or not 0 < valley_keep <= 1:
        raise ValueError("period_s must be > 0 and valley_keep in (0, 1]")
    step = max(1, round(1 / valley_keep))
    out: list[TraceRequest] = []
    in_valley = 0
    for request in requests:
        if (request.arrival_s % period_s) < period_s / 2:
            out.append(request)
            continue
        if in_valley % step == 0:
            out.append(request)
        in_valley += 1
    return out


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile (nearest rank), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run as the summary reads it."""

    name: str
    sent: int
    ok: int
    ttft_p99_s: float | None
    tbt_p99_s: float | None
    ttft_attainment: float | None  # share of requests with TTFT within the target
    tbt_attainment: float | None  # share of token gaps within the target
    offline_tokens_per_s: float | None
    offline_requests_done: int
    preemptions: float | None
    kubectl_lines: tuple[str, ...] = ()
    budget: str = ""
    latency_model: str = ""

    def met(self, slo: Slo) -> dict[str, bool]:
        """Per metric: is the p99 within its target (no measurement: not met)."""
        return {"ttft_p99": self.ttft_p99_s is not None and self.ttft_p99_s <= slo.ttft_p99_s,
                "tbt_p99": self.tbt_p99_s is not None and self.tbt_p99_s <= slo.tbt_p99_s}

    def as_json(self, slo: Slo) -> dict[str, Any]:
        return {"sent": self.sent, "ok": self.ok, "ttft_p99_s": self.ttft_p99_s,
                "tbt_p99_s": self.tbt_p99_s, "ttft_attainment": self.ttft_attainment,
                "tbt_attainment": self.tbt_attainment,
                "offline_tokens_per_s": self.offline_tokens_per_s,
                "offline_requests_done": self.offline_requests_done,
                "preemptions": self.preemptions, "budget": self.budget,
                "latency_model": self.latency_model,
                "slo_met": self.met(slo), "kubectl_get": list(self.kubectl_lines)}


def run_result(name: str, results: Sequence[RequestResult], slo: Slo, *,
               offline_tokens_per_s: float | None, offline_requests_done: int,
               preemptions: float | None, kubectl_lines: Sequence[str] = (),
               budget: str = "", latency_model: str = "") -> RunResult:
    """A run's online latencies and attainment from what the client saw."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    return RunResult(
        name=name, sent=len(results), ok=len(ok), ttft_p99_s=p99(ttfts), tbt_p99_s=p99(gaps),
        ttft_attainment=sum(t <= slo.ttft_p99_s for t in ttfts) / len(ttfts) if ttfts else None,
        tbt_attainment=sum(g <= slo.tbt_p99_s for g in gaps) / len(gaps) if gaps else None,
        offline_tokens_per_s=offline_tokens_per_s, offline_requests_done=offline_requests_done,
        preemptions=preemptions, kubectl_lines=tuple(kubectl_lines), budget=budget,
        latency_model=latency_model)


def side_by_side(runs: Mapping[str, RunResult], slo: Slo) -> list[tuple[str, ...]]:
    """The summary's rows: a label, then one cell per run in :data:`RUNS` order."""
    order = [runs[n] for n in RUNS if n in runs]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    def verdict(run: RunResult, metric: str) -> str:
        return "met" if run.met(slo)[metric] else "BROKEN"

    ttft_t, tbt_t = ms(slo.ttft_p99_s), ms(slo.tbt_p99_s)
    return [
        ("online requests ok / sent", *(f"{r.ok} / {r.sent}" for r in order)),
        (f"TTFT p99 (SLO {ttft_t})", *(f"{ms(r.ttft_p99_s)} {verdict(r, 'ttft_p99')}"
                                       for r in order)),
        (f"TBT p99 (SLO {tbt_t})", *(f"{ms(r.tbt_p99_s)} {verdict(r, 'tbt_p99')}"
                                     for r in order)),
        (f"requests with TTFT <= {ttft_t}", *(pct(r.ttft_attainment) for r in order)),
        (f"token gaps <= {tbt_t}", *(pct(r.tbt_attainment) for r in order)),
        ("offline tokens/s", *("-" if r.offline_tokens_per_s is None
                               else f"{r.offline_tokens_per_s:.1f}" for r in order)),
        ("offline requests done", *(str(r.offline_requests_done) for r in order)),
        ("offline preemptions", *("-" if r.preemptions is None else f"{r.preemptions:.0f}"
                                  for r in order)),
        ("latency model in force", *(r.latency_model or "none" for r in order)),
        ("iteration budget", *(r.budget or "none" for r in order)),
    ]


@dataclass(frozen=True, slots=True)
class Timeline:
    """One run's series against seconds since its replay started."""

    t_s: tuple[float, ...] = ()
    online_rps: tuple[float, ...] = ()
    ttft_p99_s: tuple[float | None, ...] = ()
    tbt_p99_s: tuple[float | None, ...] = ()
    offline: tuple[tuple[float, float], ...] = field(default=())  # (t_s, tokens/s)


def timeline(results: Sequence[RequestResult], *, duration_s: float, bucket_s: float,
             offline: Sequence[tuple[float, float]] = ()) -> Timeline:
    """Online arrivals per second and the p99s of the requests sent in each bucket."""
    buckets = max(1, math.ceil(duration_s / bucket_s))
    sent: list[list[RequestResult]] = [[] for _ in range(buckets)]
    for r in results:
        i = int(r.scheduled_s // bucket_s)
        if 0 <= i < buckets:
            sent[i].append(r)
    ttft: list[float | None] = []
    tbt: list[float | None] = []
    for group in sent:
        ok = [r for r in group if r.ok]
        ttft.append(p99([r.ttft_s for r in ok if r.ttft_s is not None]))
        tbt.append(p99([g for r in ok for g in r.gaps_s]))
    return Timeline(tuple((i + 0.5) * bucket_s for i in range(buckets)),
                    tuple(len(g) / bucket_s for g in sent), tuple(ttft), tuple(tbt),
                    tuple(offline))


def plot_timelines(path: Path, timelines: Mapping[str, Timeline], slo: Slo) -> None:
    """Rows: online load, offline tokens/s, TTFT p99, TBT p99; a column per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in RUNS if n in timelines]
    fig, axes = plt.subplots(4, len(names), figsize=(6 * len(names), 10), sharex=True,
                             squeeze=False)
    for col, name in enumerate(names):
        tl = timelines[name]
        ax = axes[0][col]
        ax.bar(tl.t_s, tl.online_rps, width=(tl.t_s[1] - tl.t_s[0]) * 0.9
               if len(tl.t_s) > 1 else 1.0, color="tab:blue")
        ax.set_title({"naive": "naive co-location (no budget)",
                      "slipstream": "Slipstream"}.get(name, name))
        ax.set_ylabel("online requests/s")
        ax = axes[1][col]
        ax.plot([t for t, _ in tl.offline], [v for _, v in tl.offline], color="tab:green")
        ax.set_ylabel("offline tokens/s")
        for row, (values, target, label) in enumerate(
            ((tl.ttft_p99_s, slo.ttft_p99_s, "TTFT p99 (s)"),
             (tl.tbt_p99_s, slo.tbt_p99_s, "TBT p99 (s)")), start=2):
            ax = axes[row][col]
            points = [(t, v) for t, v in zip(tl.t_s, values, strict=True) if v is not None]
            ax.plot([t for t, _ in points], [v for _, v in points], marker=".",
                    color="tab:orange", label="observed")
            ax.axhline(target, color="red", linestyle=":", label="SLO")
            ax.set_ylabel(label)
            ax.legend(loc="upper right")
        axes[3][col].set_xlabel("seconds since the replay started")
        for row in axes:
            row[col].grid(alpha=0.3)
    # The same y scale in both columns, so the runs compare at a glance.
    for row in axes:
        top = max(ax.get_ylim()[1] for ax in row)
        for ax in row:
            ax.set_ylim(0, top)
    fig.suptitle("The same online trace and offline backlog on the same pods")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
