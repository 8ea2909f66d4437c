"""What the plugin measures and reports: latency windows and histograms per class
(:class:`_Window`, :class:`_Cumulative`, :class:`_ClassStats`), each step's bookkeeping (its
preemptions, predicted and measured time, composition, the queue counts), each output's token
times and finishes (which also feed the length predictors), and the ``EngineReport``
(:meth:`StatsMixin.report`) that the channel thread writes to ``status.json``
(:mod:`~slipstream_vllm.channel`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

from slipstream_scheduler.enginecontrol import (
    TBT_BUCKETS_S,
    TTFT_BUCKETS_S,
    ClassCounts,
    ClassLatency,
    CumulativeHistogram,
    EngineReport,
)
from slipstream_scheduler.types import StepPlan
from slipstream_vllm.state import _OFFLINE, _ONLINE, _State
from slipstream_vllm.steps import Counts

LATENCY_WINDOW = 2048
"""Samples kept per class and metric for the report's mean and p99."""

_NO_COUNTS: Counts = (0, 0, 0, 0, 0, 0, 0)


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover - vllm always has it
        return ""



@dataclass(slots=True)
class _Window:
    """Recent samples of one latency metric (mean and p99 for the report)."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def add(self, v: float, count: int = 1) -> None:
        if count == 1:
            self.values.append(v)
        else:
            self.values.extend(itertools.repeat(v, count))

    # The channel thread reads while the scheduling thread appends: tuple() copies the deque
    # in one step under the GIL.
    def mean(self) -> float | None:
        values = tuple(self.values)
        return float(np.mean(values)) if values else None

    def p99(self) -> float | None:
        values = tuple(self.values)
        return float(np.quantile(np.asarray(values), 0.99)) if values else None


class _Cumulative:
    """A cumulative histogram over fixed bounds (the last bucket is +inf)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def add(self, v: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += count
        self.sum += v * count
        self.count += count

    def snapshot(self) -> CumulativeHistogram:
        return CumulativeHistogram(
            upper_bounds=self.bounds,
            cumulative_counts=tuple(float(c) for c in itertools.accumulate(self.counts)),
            sum=self.sum,
            count=float(self.count),
        )


class _ClassStats:
    def __init__(self) -> None:
        self.ttft = _Window()
        self.tbt = _Window()
        self.tokens = 0
        self.ttft_hist = _Cumulative(TTFT_BUCKETS_S)
        self.tbt_hist = _Cumulative(TBT_BUCKETS_S)
        self.admitted = 0
        self.finished_ok = 0

    def counts(self) -> ClassCounts:
        return ClassCounts(
            ttft=self.ttft_hist.snapshot(),
            tbt=self.tbt_hist.snapshot(),
            admitted=float(self.admitted),
            finished_ok=float(self.finished_ok),
            output_tokens=float(self.tokens),
        )

    def report(self) -> ClassLatency:
        return ClassLatency(
            ttft_mean_s=self.ttft.mean(),
            ttft_p99_s=self.ttft.p99(),
            tbt_mean_s=self.tbt.mean(),
            tbt_p99_s=self.tbt.p99(),
            samples=len(self.ttft.values),
        )


class StatsMixin(_State):
    """The step's and the outputs' bookkeeping, and the report (module note)."""

    def _count_queues(self) -> None:
        online_w = offline_w = online_r = offline_r = 0
        for r in self._waiting_requests():
            if self._class_of(r) is _OFFLINE:
                offline_w += 1
            else:
                online_w += 1
        for r in self.running:
            if self._class_of(r) is _OFFLINE:
                offline_r += 1
            else:
                online_r += 1
        self._queue_counts = (online_w, offline_w, online_r, offline_r)

    def _finish_schedule(self, out: SchedulerOutput, plan: StepPlan | None) -> SchedulerOutput:
        counts: Counts = _NO_COUNTS
        with self._guard.part("bookkeeping"):
            self._note_schedule(out, plan)
            counts = self.step_records.compose_step(
                out.num_scheduled_tokens, out.total_num_scheduled_tokens,
                bool(out.preempted_req_ids), self.requests,
            )
        self._inflight.append((id(out), time.monotonic(), self._last_predicted, counts))
        return out

    def _note_schedule(self, out: SchedulerOutput, plan: StepPlan | None) -> None:
        if len(self._psm):  # what vLLM scheduled leaves the PSM queue, whichever walk ran
            with self._guard.part("psm"):
                for rid in out.num_scheduled_tokens:
                    self._psm_taken(rid)
        for rid in out.preempted_req_ids or ():
            if plan is not None and rid in plan.preempted:
                continue
            meta = self._meta.get(rid)
            if meta is not None and meta.cls is _OFFLINE:
                self.offline_preemptions += 1
            else:
                self.online_preemptions += 1
        self._last_plan = plan
        model = self.planner.model
        self._last_predicted = None
        if plan is not None and model is not None and plan.predicted_step_s > 0:
            self._last_predicted = plan.predicted_step_s
            budget = self._budget_in_force
            if budget is not None and self._ran_offline(out):
                over = plan.predicted_step_s - budget
                cur = self.max_offline_over_budget_s
                self.max_offline_over_budget_s = over if cur is None else max(cur, over)

    def _ran_offline(self, out: SchedulerOutput) -> bool:
        for rid in out.num_scheduled_tokens:
            meta = self._meta.get(rid)
            if meta is not None and meta.cls is _OFFLINE:
                return True
        return False

    # ------------------------------------------------------------------ outputs

    def _time_step(self, out_id: int) -> None:
        """A step's measured time: from when it could start (its schedule() returned and the
        step before it finished; one step runs at a time) to its output."""
        now = time.monotonic()
        while self._inflight:
            oid, done_s, predicted, counts = self._inflight.popleft()
            if oid != out_id:
                continue  # an output vLLM never delivered (an empty step)
            took = now - max(done_s, self._last_output_s)
            self._measured.add(took)
            self.step_records.record(took, counts)
            if predicted is not None:
                self._predicted.add(predicted)
            break
        self._last_output_s = now

    def _note_outputs(self, outputs: dict[int, EngineCoreOutputs]) -> bool:
        """Token times and finishes of one step's outputs; True if a request finished."""
        now = time.time()
        outs = [o for eco in outputs.values() for o in eco.outputs]
        finished = [o.finish_reason for o in outs].count(None) != len(outs)
        self._note_tokens(outs, now)
        if finished:
            for o in outs:
                if o.finish_reason is not None:
                    ok = getattr(o.finish_reason, "name", "") in ("STOP", "LENGTH")
                    self._finished(o.request_id, ok=ok)
        if len(self._meta) > 2 * len(self.requests) + 256:
            self._meta = {k: v for k, v in self._meta.items() if k in self.requests}
        return finished

    def _note_tokens(self, outs: list[EngineCoreOutput], now: float) -> None:
        """Each output's new tokens: a request's first token's TTFT, or the gap since its last
        token, per new token (TBT).

        Without a per-request pass in the usual step: when every output carries one token,
        the requests that also had one in the last step's outputs (nearly all of a decoding
        batch, and often all of it, in the same order) share one gap, ``now`` minus that
        step's time, counted per class with set operations; only the others (a first token,
        a request back after missing steps) and the requests that missed this step (their
        last token's time is written down) are visited one by one."""
        # Comprehensions, not map(attrgetter): faster over vLLM's msgspec structs.
        ids = [o.request_id for o in outs]
        counts = [len(o.new_token_ids) for o in outs]
        prev, prev_s = self._prev_tokens, self._prev_tokens_s
        offline = self._offline_ids
        stats_on, stats_off = self._stats[_ONLINE], self._stats[_OFFLINE]
        others: Iterable[tuple[str, int]] = ()
        missed: Iterable[str] = ()
        if counts.count(1) == len(counts):  # one token each: the usual step
            if ids == self._prev_token_ids:  # the last step's batch, in its order
                got = common = prev
            else:
                got = frozenset(ids)
                common = got & prev
                others = ((rid, 1) for rid in got - common)
                missed = prev - got
            off = len(got & offline) if offline else 0
            stats_off.tokens += off
            stats_on.tokens += len(got) - off
            if common:
                tbt = now - prev_s
                if common is not got:  # else the same count as the tokens'
                    off = len(common & offline) if offline else 0
                for stats, count in ((stats_off, off), (stats_on, len(common) - off)):
                    if count:
                        stats.tbt.add(tbt, count)
                        stats.tbt_hist.add(tbt, count)
        else:
            got = frozenset(rid for rid, n in zip(ids, counts, strict=True) if n > 0)
            others = [(rid, n) for rid, n in zip(ids, counts, strict=True) if n > 0]
            missed = prev - got
            for rid, n in others:
                (stats_off if rid in offline else stats_on).tokens += n
        meta_get = self._meta.get
        for rid in missed:  # no token this step: its last came out at prev_s
            meta = meta_get(rid)
            if meta is not None:
                meta.last_token_s = prev_s
        for rid, n in others:
            meta = meta_get(rid)
            if meta is None:
                continue
            stats = self._stats[meta.cls]
            last = prev_s if rid in prev else meta.last_token_s
            if meta.first_token_s is None:
                meta.first_token_s = now
                req = meta.request
                if req is not None:  # (a record without vLLM's request has no arrival)
                    ttft = max(now - req.arrival_time, 0.0)
                    stats.ttft.add(ttft)
                    stats.ttft_hist.add(ttft)
            elif last is not None:
                tbt = (now - last) / n
                stats.tbt.add(tbt, n)
                stats.tbt_hist.add(tbt, n)
            meta.last_token_s = now
        self._prev_tokens, self._prev_tokens_s, self._prev_token_ids = got, now, ids

    def _finished(self, request_id: str, *, ok: bool) -> None:
        meta = self._meta.pop(request_id, None)
        self._offline_ids.discard(request_id)
        with self._guard.part("psm"):
            if request_id in self._psm:
                self._psm.remove(request_id)
        req = meta.request if meta is not None else None
        if meta is None or req is None or req.num_output_tokens <= 0:
            return
        if ok:
            self._stats[meta.cls].finished_ok += 1
        inp, out = req.num_prompt_tokens, req.num_output_tokens
        if meta.vector is not None:
            with self._guard.part("predictor"):
                self._predictor.observe(meta.vector, inp, out)
        self._global.observe(None, inp, out)
        self._fallback.observed()

    # ------------------------------------------------------------------ report

    def report(self) -> EngineReport:
        """The plugin's state; safe on any thread (it reads counters and copies of the
        windows, never vLLM's queues)."""
        online_w, offline_w, online_r, offline_r = self._queue_counts
        c = self.control
        return EngineReport(
            generation=c.generation if c is not None else -1,
            policy=self.planner.name,
            ordering=c.ordering if c is not None else "fcfs",
            budget_s=self._budget_in_force,
            written_at=time.time(),
            pid=os.getpid(),
            vllm_version=_vllm_version(),
            async_scheduling=self.async_scheduling,
            online_waiting=online_w,
            offline_waiting=offline_w,
            online_running=online_r,
            offline_running=offline_r,
            steps=self.steps,
            fallback_steps=self.fallback_steps,
            offline_deferred_chunks=self.offline_deferred_chunks,
            predicted_step_s=self._predicted.mean(),
            measured_step_s=self._measured.mean(),
            max_offline_over_budget_s=self.max_offline_over_budget_s,
            offline_preemptions=self.offline_preemptions,
            online_preemptions=self.online_preemptions,
            online_displacements=self.online_displacements,
            online_displaced_tokens=self.online_displaced_tokens,
            forged_offline_tags=self.forged_offline_tags,
            faults={k: v for k, v in self._guard.counts.items() if v},
            fault_steps=self.fault_steps,
            failsafe=self._guard.tripped_reason,
            online=self._stats[_ONLINE].report(),
            offline=self._stats[_OFFLINE].report(),
            online_tokens=self._stats[_ONLINE].tokens,
            offline_tokens=self._stats[_OFFLINE].tokens,
            online_counts=self._stats[_ONLINE].counts(),
            offline_counts=self._stats[_OFFLINE].counts(),
        )
