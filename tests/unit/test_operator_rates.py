"""Status rates from token counters over a window, and ETAs a person reads at a glance."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from slipstream_operator.api import InferenceServiceSpec, OfflineJobSpec, parse_duration
from slipstream_operator.budgets import AnalyticSearch, BudgetParams, BudgetSearch
from slipstream_operator.rates import TokenMeter, format_eta
from slipstream_operator.reconcile_job import (
    CandidatePod,
    JobMemory,
    JobObserved,
    JobOutcome,
    JobSettings,
    reconcile_job,
)
from slipstream_operator.reconcile_service import (
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    reconcile_service,
)
from slipstream_operator.searchpool import SearchSubject
from slipstream_operator.shards import Plan, ShardPlan
from slipstream_operator.sidecar_client import ShardReport, SidecarStatus

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PREFIX = "ns.job"


# -- format_eta -------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (8.273, "8s"), (3.107, "3s"), (0.3, "1s"), (0.0, "0s"), (-4.0, "0s"), (59.4, "59s"),
    (60.0, "1m0s"), (185.0, "3m5s"), (3599.0, "59m59s"), (3600.0, "1h0m"), (3720.0, "1h2m"),
    (90061.0, "25h1m"),
])
def test_eta_reads_in_whole_units(seconds: float, text: str) -> None:
    assert format_eta(seconds) == text


@pytest.mark.parametrize("seconds", [8.273, 185.0, 3720.0])
def test_eta_is_a_duration_the_api_parses(seconds: float) -> None:
    assert abs(parse_duration(format_eta(seconds)) - seconds) < 60.0


# -- TokenMeter -------------------------------------------------------------------------------


def test_first_sample_only_records_where_counters_stand() -> None:
    meter = TokenMeter().advance({("a", "s0"): 5000}, 0.0, 60.0)
    assert meter.total == 0 and meter.rate() is None
    meter = meter.advance({("a", "s0"): 5600}, 10.0, 60.0)
    assert meter.total == 600 and meter.rate() == pytest.approx(60.0)


def test_a_shard_that_ends_keeps_its_tokens_in_the_window() -> None:
    meter = TokenMeter().advance({}, 0.0, 60.0)
    meter = meter.advance({("a", "s0"): 1000}, 10.0, 60.0)
    # s0 is no longer reported; s1 has only just started on the pod.
    meter = meter.advance({("a", "s1"): 0}, 20.0, 60.0)
    assert meter.total == 1000
    assert meter.rate() == pytest.approx(50.0)


def test_a_restarted_counter_counts_from_zero_and_a_silent_key_is_not_counted_twice() -> None:
    meter = TokenMeter().advance({}, 0.0, 60.0)
    meter = meter.advance({("a", "s0"): 800, ("b", "s1"): 300}, 10.0, 60.0)
    meter = meter.advance({("a", "s0"): 100}, 20.0, 60.0)  # reassigned on a; b silent
    assert meter.total == 1200
    meter = meter.advance({("a", "s0"): 100, ("b", "s1"): 350}, 30.0, 60.0)
    assert meter.total == 1250


def test_forgotten_keys_leave_the_meter_only_when_not_reported() -> None:
    meter = TokenMeter().advance({}, 0.0, 60.0)
    meter = meter.advance({("a", "s0"): 10, ("a", "s1"): 20}, 1.0, 60.0)
    meter = meter.advance({("a", "s1"): 25}, 2.0, 60.0,
                          forget=frozenset({("a", "s0"), ("a", "s1")}))
    assert set(meter.seen) == {("a", "s1")}


def test_the_window_keeps_one_sample_before_it() -> None:
    meter = TokenMeter()
    for i in range(20):
        meter = meter.advance({("a", "s0"): 100 * i}, 10.0 * i, 60.0)
    times = [t for t, _ in meter.history]
    assert times[0] == 120.0 and times[-1] == 190.0  # 60 s window plus its start
    assert meter.rate() == pytest.approx(10.0)


# -- OfflineJob status ------------------------------------------------------------------------


def _plan(n: int) -> Plan:
    shards = tuple(ShardPlan(f"{PREFIX}-{i:05d}", 10 * i, 10 * (i + 1), f"g{i}")
                   for i in range(n))
    return Plan(staged_uri="file:///w/in.psm.jsonl", work_dir="/w", total=10 * n, valid=10 * n,
                bad=0, shards=shards, input_fingerprint="f")


def _job_tick(p: Plan, shards: tuple[ShardReport, ...], memory: JobMemory,
              previous: dict[str, Any], at_s: float,
              done: dict[str, tuple[int, int]] | None = None) -> JobOutcome:
    spec = OfflineJobSpec.model_validate({"model": "m", "input": {"uri": "file:///d/in.jsonl"},
                                          "output": {"uri": "file:///d/out.jsonl"}})
    pod = CandidatePod("a", "chat", True, 0.5, shards)
    observed = JobObserved(plan=p, pods=(pod,), done=done or {}, services_selected=1)
    return reconcile_job("ns", "job", 1, spec, observed=observed, memory=memory,
                         previous_status=previous, now=T0 + timedelta(seconds=at_s),
                         now_s=at_s, settings=JobSettings(max_shards_per_pod=2))


def test_job_rate_holds_while_shards_hand_over() -> None:
    """Shards finish and new ones start between ticks: the rate stays what flowed."""
    p = _plan(4)
    out = _job_tick(p, (), JobMemory(), {}, 0.0)
    assert [s.shard_id[-1] for _, s in out.assign] == ["0", "1"]
    running = tuple(ShardReport(f"{PREFIX}-0000{i}", "running", total=10, completed=5,
                                output_tokens=400, tokens_per_second=40.0) for i in (0, 1))
    out = _job_tick(p, running, out.memory, out.status, 10.0)
    assert out.status["tokensPerSecond"] == 80.0
    # Both finish; shards 2 and 3 are placed and have not reported tokens yet.
    ended = tuple(r._replace(state="succeeded", completed=10, output_tokens=800,
                             tokens_per_second=0.0) for r in running)
    done = {r.shard_id: (10, 0) for r in ended}
    out = _job_tick(p, ended, out.memory, out.status, 20.0, done)
    assert [s.shard_id[-1] for _, s in out.assign] == ["2", "3"]
    assert out.status["tokensPerSecond"] == 80.0  # 1,600 tokens in 20 s, not 0
    fresh = tuple(ShardReport(f"{PREFIX}-0000{i}", "running", total=10, completed=1,
                              output_tokens=40, tokens_per_second=0.0) for i in (2, 3))
    out = _job_tick(p, fresh, out.memory, out.status, 30.0, done)
    assert out.status["tokensPerSecond"] == pytest.approx(1680 / 30, abs=0.01)
    assert out.status["progress"] == "22/40"
    assert out.status["eta"] == "25s"  # 18 left at 22 requests in 30 s (24.5 s)


def test_job_eta_reads_in_minutes() -> None:
    p = _plan(40)
    out = _job_tick(p, (), JobMemory(), {}, 0.0)
    reports = tuple(ShardReport(s.shard_id, "running", total=10, completed=1, output_tokens=9)
                    for _, s in out.assign)
    out = _job_tick(p, reports, out.memory, out.status, 10.0)
    assert out.status["progress"] == "2/400"
    assert out.status["eta"] == "33m10s"  # 398 left at 0.2 requests/s


# -- InferenceService status ------------------------------------------------------------------


def _service_tick(shards: tuple[ShardReport, ...], memory: ServiceMemory,
                  at_s: float) -> Any:
    spec_doc = {"model": "meta-llama/Llama-2-7b-hf", "engine": {"image": "vllm/vllm:v1"},
                "replicas": 1, "slo": {"tbt": {"p99": "100ms"}}}
    sidecar = SidecarStatus(generation=0, engine_ready=True, draining=False, spare_capacity=0.5,
                            budget_s=None, shards=shards)
    observed = ServiceObserved(pods=(PodView("a", "127.1.0.1", True, sidecar),), token="tok",
                               window=None, latency_model=None, profile="")

    def search_for(subject: SearchSubject) -> BudgetSearch:
        return AnalyticSearch(subject.calibrated)

    return reconcile_service(ObjectRef("chat", "ns", "uid", 1),
                             InferenceServiceSpec.model_validate(spec_doc), observed, memory,
                             previous_status={}, now=T0 + timedelta(seconds=at_s), now_s=at_s,
                             params=BudgetParams(), search_for=search_for)


def test_service_offline_rate_from_counters_not_the_instant() -> None:
    out = _service_tick((), ServiceMemory(), 0.0)
    a = ShardReport("ns.job-00000", "running", output_tokens=1000, tokens_per_second=100.0)
    out = _service_tick((a,), out.memory, 10.0)
    assert out.status["offline"] == {"tokensPerSecond": 100.0, "activeShards": 1}
    # a ended and left the pod's report; b has just started (its own rate reads 0).
    b = ShardReport("ns.job-00001", "running", output_tokens=0, tokens_per_second=0.0)
    out = _service_tick((b,), out.memory, 20.0)
    assert out.status["offline"] == {"tokensPerSecond": 50.0, "activeShards": 1}
    assert set(out.memory.offline_tokens.seen) == {("a", "ns.job-00001")}
