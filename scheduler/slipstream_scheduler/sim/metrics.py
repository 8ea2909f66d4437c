"""Per-class serving metrics of a simulation, measured as a client would see them.

A :class:`Recorder` is fed token emissions (request, time) and request
lifecycle events during a replay; :meth:`Recorder.summary` turns them into a
:class:`SimMetrics` with, per class: TTFT, TBT and TTLT (mean, p50, p99),
tokens/s, SLO attainment; and for the run: preemptions, prefix-cache hit
rate, fraction of time the GPU is busy, and a throughput timeline.

Definitions (documented in ``docs/concepts/simulator.md``):

* TTFT: first output token time minus arrival. TBT: every gap between two
  consecutive output tokens of a request (so a preemption pause shows up as
  one long gap). TTLT: last token minus arrival, finished requests only.
* tokens/s: output tokens emitted by the class during the measured window
  divided by the window (tokens of a preempted request count once: a
  continuation does not re-emit them).
* SLO attainment: fraction of finished requests whose TTFT and whose largest
  TBT gap are within the absolute per-request targets, when targets are set.

Deliberately left out: anything about *how* the tokens were scheduled (the
simulator and engine report that), and wall-clock timing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.types import RequestClass

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Dist:
    """Mean, median, 99th percentile and maximum of a sample (NaN when empty), in seconds."""

    mean: float
    p50: float
    p99: float
    count: int
    max: float = math.nan

    @staticmethod
    def of(values: FloatArray | list[float]) -> Dist:
        a = np.asarray(values, dtype=np.float64)
        if a.size == 0:
            return Dist(math.nan, math.nan, math.nan, 0)
        p50, p99 = np.percentile(a, [50.0, 99.0])
        return Dist(float(a.mean()), float(p50), float(p99), int(a.size), float(a.max()))


@dataclass(frozen=True, slots=True)
class ClassMetrics:
    """What one request class experienced."""

    requests: int  # requests that arrived
    finished: int
    ttft: Dist
    tbt: Dist
    ttlt: Dist
    output_tokens: int  # emitted during the window
    tokens_per_s: float
    prompt_tokens_done: int  # prompt tokens of finished requests
    preemptions: int  # dispatcher aborts + engine KV preemptions of this class
    slo_attainment: float | None  # None when no per-request target was given


@dataclass(frozen=True, slots=True)
class Timeline:
    """Throughput over time: one bin per ``bin_s`` seconds from 0."""

    bin_s: float
    online_tokens_per_s: tuple[float, ...]
    offline_tokens_per_s: tuple[float, ...]
    online_arrivals_per_s: tuple[float, ...]
    busy_fraction: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SimMetrics:
    """Everything a replay measured. Field names are the JSON keys (see the docs)."""

    duration_s: float
    online: ClassMetrics
    offline: ClassMetrics
    busy_fraction: float
    prefix_hit_rate: float
    engine_preemptions: int
    dispatcher_preemptions: int
    steps: int
    timeline: Timeline
    samples: dict[str, FloatArray] = field(default_factory=dict, compare=False, repr=False)
    discarded_kv_tokens: int = 0  # KV tokens (computed + generated) dropped by dispatcher aborts
    max_request_preemptions: int = 0  # most dispatcher aborts of any one request
    prefill_tokens_computed: int = 0  # engine prefill tokens computed, recompute included

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (raw samples left out)."""
        d = asdict(self)
        d.pop("samples", None)
        out: dict[str, Any] = _clean(d)
        return out


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


class Recorder:
    """Collects token times per request during one replay. Not thread-safe; hot path."""

    def __init__(self) -> None:
        self.cls: dict[str, RequestClass] = {}
        self.alias: dict[str, str] = {}  # engine id of a resumed submission -> request id
        self.arrival: dict[str, float] = {}
        self.prompt: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.max_gap: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.tbt: dict[RequestClass, list[float]] = {c: [] for c in RequestClass}
        self.tokens: dict[RequestClass, int] = {c: 0 for c in RequestClass}
        self.preemptions: dict[RequestClass, int] = {c: 0 for c in RequestClass}
        self.aborts: dict[str, int] = {}  # dispatcher aborts per request
        self.discarded_kv_tokens = 0
        # per-step timeline: end time, duration, online tokens, offline tokens
        self.step_end: list[float] = []
        self.step_dur: list[float] = []
        self.step_on: list[int] = []
        self.step_off: list[int] = []

    def arrived(self, request_id: str, cls: RequestClass, arrival_s: float, prompt: int) -> None:
        self.cls[request_id] = cls
        self.arrival[request_id] = arrival_s
        self.prompt[request_id] = prompt

    def step(self, end_s: float, duration_s: float, emitted: Sequence[tuple[str, int]]) -> None:
        """Record one engine iteration ending at ``end_s`` that emitted ``emitted`` tokens."""
        on = off = 0
        first, last, max_gap, cls = self.first, self.last, self.max_gap, self.cls
        tbt_on, tbt_off = self.tbt[RequestClass.ONLINE], self.tbt[RequestClass.OFFLINE]
        alias = self.alias
        for eid, n in emitted:
            rid = alias.get(eid, eid)
            online = cls[rid] is RequestClass.ONLINE
            if online:
                on += n
            else:
                off += n
            prev = last.get(rid)
            if prev is None:
                first[rid] = end_s
            else:
                gap = end_s - prev
                (tbt_on if online else tbt_off).append(gap)
                if gap > max_gap.get(rid, 0.0):
                    max_gap[rid] = gap
            if n > 1:  # several tokens in one step arrive together
                (tbt_on if online else tbt_off).extend([0.0] * (n - 1))
            last[rid] = end_s
        self.tokens[RequestClass.ONLINE] += on
        self.tokens[RequestClass.OFFLINE] += off
        self.step_end.append(end_s)
        self.step_dur.append(duration_s)
        self.step_on.append(on)
        self.step_off.append(off)

    def finished(self, request_id: str, now_s: float) -> None:
        self.done[request_id] = now_s

    def preempted(self, request_id: str) -> None:
        self.preemptions[self.cls[request_id]] += 1

    def aborted(self, request_id: str, kv_tokens: int) -> None:
        """A dispatcher abort that dropped ``kv_tokens`` tokens of KV (computed + generated)."""
        self.preempted(request_id)
        self.aborts[request_id] = self.aborts.get(request_id, 0) + 1
        self.discarded_kv_tokens += kv_tokens

    def summary(
        self,
        duration_s: float,
        *,
        prefix_hit_rate: float,
        engine_preemptions: int,
        dispatcher_preemptions: int,
        prefill_tokens_computed: int = 0,
        ttft_target_s: float | None = None,
        tbt_target_s: float | None = None,
        bin_s: float | None = None,
    ) -> SimMetrics:
        """Summarise the window ``[0, duration_s]``."""
        samples: dict[str, FloatArray] = {}
        per: dict[RequestClass, ClassMetrics] = {}
        for c in RequestClass:
            ids = [r for r, k in self.cls.items() if k is c]
            ttft = np.array(
                [self.first[r] - self.arrival[r] for r in ids if r in self.first], dtype=np.float64
            )
            done = [r for r in ids if r in self.done and r in self.last]
            ttlt = np.array([self.last[r] - self.arrival[r] for r in done], dtype=np.float64)
            tbt = np.asarray(self.tbt[c], dtype=np.float64)
            attain: float | None = None
            if (ttft_target_s is not None or tbt_target_s is not None) and done:
                ok = 0
                ttft_max = math.inf if ttft_target_s is None else ttft_target_s
                tbt_max = math.inf if tbt_target_s is None else tbt_target_s
                for r in done:
                    ok += (
                        self.first[r] - self.arrival[r] <= ttft_max
                        and self.max_gap.get(r, 0.0) <= tbt_max
                    )
                attain = ok / len(done)
            name = c.name.lower()
            samples[f"{name}_ttft"] = ttft
            samples[f"{name}_tbt"] = tbt
            samples[f"{name}_ttlt"] = ttlt
            per[c] = ClassMetrics(
                requests=len(ids),
                finished=len(done),
                ttft=Dist.of(ttft),
                tbt=Dist.of(tbt),
                ttlt=Dist.of(ttlt),
                output_tokens=self.tokens[c],
                tokens_per_s=self.tokens[c] / duration_s if duration_s > 0 else 0.0,
                prompt_tokens_done=sum(self.prompt[r] for r in done),
                preemptions=self.preemptions[c],
                slo_attainment=attain,
            )
        dur = np.asarray(self.step_dur, dtype=np.float64)
        busy = float(dur.sum() / duration_s) if duration_s > 0 else 0.0
        return SimMetrics(
            duration_s=duration_s,
            online=per[RequestClass.ONLINE],
            offline=per[RequestClass.OFFLINE],
            busy_fraction=min(busy, 1.0),
            prefix_hit_rate=prefix_hit_rate,
            engine_preemptions=engine_preemptions,
            dispatcher_preemptions=dispatcher_preemptions,
            steps=len(self.step_dur),
            timeline=self._timeline(duration_s, bin_s),
            samples=samples,
            discarded_kv_tokens=self.discarded_kv_tokens,
            max_request_preemptions=max(self.aborts.values(), default=0),
            prefill_tokens_computed=prefill_tokens_computed,
        )

    def _timeline(self, duration_s: float, bin_s: float | None) -> Timeline:
        if bin_s is None:
            bin_s = max(1.0, duration_s / 200.0)
        n = max(1, math.ceil(duration_s / bin_s))
        end = np.asarray(self.step_end, dtype=np.float64)
        idx = np.minimum((end / bin_s).astype(np.int64), n - 1) if end.size else end.astype(int)
        on = np.bincount(idx, weights=np.asarray(self.step_on, float), minlength=n)[:n]
        off = np.bincount(idx, weights=np.asarray(self.step_off, float), minlength=n)[:n]
        busy = np.bincount(idx, weights=np.asarray(self.step_dur, float), minlength=n)[:n]
        arr = np.array(
            [a for r, a in self.arrival.items() if self.cls[r] is RequestClass.ONLINE], float
        )
        aidx = np.minimum((arr / bin_s).astype(np.int64), n - 1)
        arrivals = np.bincount(aidx, minlength=n)[:n].astype(float)
        return Timeline(
            bin_s=bin_s,
            online_tokens_per_s=tuple((on / bin_s).tolist()),
            offline_tokens_per_s=tuple((off / bin_s).tolist()),
            online_arrivals_per_s=tuple((arrivals / bin_s).tolist()),
            busy_fraction=tuple(np.minimum(busy / bin_s, 1.0).tolist()),
        )
