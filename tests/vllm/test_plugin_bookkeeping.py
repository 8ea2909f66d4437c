"""The plugin's per-step bookkeeping against a request-by-request account of the same steps.

Two pieces of the plugin's work on vLLM's scheduling thread skip the per-request pass in a
steady decoding batch: a step's composition for learning (``StepRecorder.compose_step``:
counted from the last step's counts when the batch is the same) and the outputs' token times
(``StatsMixin._note_tokens``: the requests that had a token in the last step share one gap).
Each must give what a pass over every request gives, through everything that breaks the steady
state: arrivals, chunked prompts, KV pressure and preemption, offline work, finishes and
aborts, with vLLM's async scheduling on and off. The reference here is the plain per-request
computation, run on the very outputs and times the plugin saw.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, EngineControl
from slipstream_scheduler.latency import LinearLatencyModel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
SYNC_PLUGIN = "slipstream_vllm.scheduler.SlipstreamSyncScheduler"
# 160 blocks of 16 tokens for up to 24 requests: long answers outgrow it, and vLLM preempts.
CFG = EngineConfig(max_num_seqs=24, max_num_batched_tokens=512, num_gpu_blocks=160,
                   noise_cv=0.0)


class _Reference:
    """TTFT and TBT samples, tokens per class, counted request by request."""

    def __init__(self, arrival: dict[str, float]) -> None:
        self.arrival = arrival
        self.last: dict[str, float] = {}
        self.ttft: dict[bool, list[float]] = {False: [], True: []}
        self.tbt: dict[bool, list[float]] = {False: [], True: []}
        self.tokens = {False: 0, True: 0}

    def outputs(self, outs: list[Any], now: float) -> None:
        for o in outs:
            n = len(o.new_token_ids)
            if n == 0:
                continue
            off = o.request_id.startswith("off")
            self.tokens[off] += n
            if o.request_id not in self.last:
                self.ttft[off].append(max(now - self.arrival[o.request_id], 0.0))
            else:
                self.tbt[off] += [(now - self.last[o.request_id]) / n] * n
            self.last[o.request_id] = now


def _buckets(samples: list[float], bounds: tuple[float, ...]) -> list[int]:
    counts = [0] * len(bounds)
    for v in samples:
        counts[bisect.bisect_left(bounds, v)] += 1
    return counts


@pytest.fixture(params=["async", "sync"])
def engine(
    request: pytest.FixtureRequest, channel: Path, model: LinearLatencyModel
) -> Iterator[Any]:
    from slipstream_testbed.vllm.inprocess import VllmEngine
    from slipstream_vllm.scheduler import write_control

    write_control(channel, EngineControl(
        generation=1, policy="budget", ordering="gittins", budget_s=1.0,
        latency_model=model.to_dict(),
    ))
    asynchronous = request.param == "async"
    eng = VllmEngine(CFG, scheduler_cls=PLUGIN if asynchronous else SYNC_PLUGIN,
                     async_scheduling=asynchronous)
    yield eng
    eng.scheduler.shutdown()


def test_step_counts_and_token_times_match_a_pass_over_every_request(
    engine: Any, channel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_FILE
    from slipstream_vllm import stats as stats_mod
    from slipstream_vllm.steps import StepRecorder

    sched = engine.scheduler
    token = (channel / OFFLINE_TOKEN_FILE).read_text().strip()
    arrival: dict[str, float] = {}
    ref = _Reference(arrival)
    mismatches: list[tuple[int, Any, Any]] = []
    steps = {"composed": 0, "carried": 0}
    full_pass, compose_step_of = StepRecorder.compose, StepRecorder.compose_step

    def compose_step(self: StepRecorder, scheduled: Any, total: int, preempted: bool,
                     requests: Any) -> Any:
        calls_before = steps["composed"]
        got = compose_step_of(self, scheduled, total, preempted, requests)
        if steps["composed"] == calls_before:
            steps["carried"] += 1
        want = full_pass(scheduled, requests)
        if got != want:
            mismatches.append((sched.steps, got, want))
        return got

    def compose(scheduled: Any, requests: Any) -> Any:
        steps["composed"] += 1
        return full_pass(scheduled, requests)

    monkeypatch.setattr(StepRecorder, "compose_step", compose_step)
    monkeypatch.setattr(StepRecorder, "compose", staticmethod(compose))
    note_tokens = stats_mod.StatsMixin._note_tokens

    def traced(self: Any, outs: list[Any], now: float) -> None:
        ref.outputs(outs, now)
        note_tokens(self, outs, now)

    monkeypatch.setattr(stats_mod.StatsMixin, "_note_tokens", traced)

    def add(rid: str, prompt: int, out: int, offline: bool = False) -> None:
        extra = {OFFLINE_TOKEN_ARG: token} if offline else None
        engine.add_tokens(rid, engine.synth.prompt(rid, prompt, ()), out, extra_args=extra)
        arrival[rid] = sched.requests[rid].arrival_time

    for i in range(8):
        add(f"on{i}", 80 + 40 * i, 120 + 15 * i)
    step = 0
    while engine.has_work():
        if step % 30 == 10 and step < 300:  # arrivals, one a long prompt in chunks
            k = step // 30
            add(f"late{k}", 900 if k % 3 == 0 else 100 + 30 * k, 60 + 7 * k)
        if step == 40:
            for j in range(6):
                add(f"off{j}", 250, 90, offline=True)
        if step == 120:  # long answers while nothing waits: the cache runs short
            for j in range(6):
                add(f"long{j}", 150, 380)
        if step == 200 and "long1" in sched.requests:
            engine.abort("long1")
        engine.step()
        step += 1
        assert step < 6_000

    assert not mismatches, mismatches[:5]
    assert steps["carried"] >= 100, steps  # the steady state was taken from the last step
    assert steps["composed"] >= 20, steps  # and every other step counted request by request
    assert sched.online_preemptions + sched.offline_preemptions > 0 or any(
        r.preempted for r in engine.records
    ), "no KV pressure"
    for off, cls in ((False, stats_mod._ONLINE), (True, stats_mod._OFFLINE)):
        st = sched._stats[cls]
        assert st.tokens == ref.tokens[off] > 0
        assert st.ttft_hist.count == len(ref.ttft[off])
        assert st.ttft_hist.counts == _buckets(ref.ttft[off], st.ttft_hist.bounds)
        assert st.tbt_hist.count == len(ref.tbt[off]) > 0
        assert st.tbt_hist.counts == _buckets(ref.tbt[off], st.tbt_hist.bounds)
        assert st.tbt_hist.sum == pytest.approx(sum(ref.tbt[off]), rel=1e-9)
