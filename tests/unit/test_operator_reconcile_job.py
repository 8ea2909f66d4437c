"""OfflineJob reconciler: placement with affinity, moves, suspend/resume, priority, finish."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from slipstream_operator.api import OfflineJobSpec
from slipstream_operator.reconcile_job import (
    CandidatePod,
    JobMemory,
    JobObserved,
    JobOutcome,
    JobSettings,
    Placement,
    candidate_pod,
    reconcile_job,
    storage_scope_error,
)
from slipstream_operator.shards import MergeResult, Plan, ShardPlan
from slipstream_operator.sidecar_client import ShardReport, group_by_job

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SETTINGS = JobSettings(max_shards_per_pod=2, stall_timeout_s=60.0)
PREFIX = "ns.job"


def plan(sizes: list[int], affinities: list[str] | None = None, bad: int = 0) -> Plan:
    shards, start = [], 0
    for i, size in enumerate(sizes):
        aff = affinities[i] if affinities else f"g{i}"
        shards.append(ShardPlan(f"{PREFIX}-{i:05d}", start, start + size, aff))
        start += size
    return Plan(staged_uri="file:///w/in.psm.jsonl", work_dir="/w", total=start + bad,
                valid=start, bad=bad, shards=tuple(shards), input_fingerprint="f")


def spec(**overrides: Any) -> OfflineJobSpec:
    doc: dict[str, Any] = {"model": "m", "input": {"uri": "file:///d/in.jsonl"},
                           "output": {"uri": "file:///d/out.jsonl"}}
    doc.update(overrides)
    return OfflineJobSpec.model_validate(doc)


def pod(name: str, spare: float = 0.5, shards: tuple[ShardReport, ...] = (), ready: bool = True,
        others: tuple[tuple[str, int], ...] = ()) -> CandidatePod:
    """The pod as the handler builds it for this job: its own reports, the others counted."""
    by_job = group_by_job(shards)
    own = by_job.get(PREFIX)
    others_active = sum(j.active for k, j in by_job.items() if k != PREFIX)
    return CandidatePod(name, "chat", ready, spare, own.reports if own else (), others_active,
                        others)


def running(shard: str, completed: int = 0, tps: float = 0.0, tokens: int = 0) -> ShardReport:
    return ShardReport(shard, "running", total=10, completed=completed, output_tokens=tokens,
                       tokens_per_second=tps)


def tick(p: Plan | None, pods: tuple[CandidatePod, ...], memory: JobMemory | None = None,
         previous: dict[str, Any] | None = None, s: OfflineJobSpec | None = None,
         done: dict[str, tuple[int, int]] | None = None, merged: MergeResult | None = None,
         at_s: float = 0.0) -> JobOutcome:
    observed = JobObserved(plan=p, pods=pods, done=done or {}, merged=merged,
                           services_selected=1)
    return reconcile_job("ns", "job", 1, s or spec(), observed=observed,
                         memory=memory or JobMemory(),
                         previous_status=previous or {}, now=T0 + timedelta(seconds=at_s),
                         now_s=at_s, settings=SETTINGS)


def test_pending_while_planning() -> None:
    out = tick(None, ())
    assert out.status["phase"] == "Pending"
    assert out.status["conditions"][0]["reason"] == "Planning"


def test_places_shards_by_affinity_then_spare_capacity_within_slots() -> None:
    p = plan([10, 10, 10, 10, 10], affinities=["x", "x", "y", "z", "w"])
    out = tick(p, (pod("a", spare=0.9), pod("b", spare=0.2)))
    placed = [(pod_name, s.shard_id[-1]) for pod_name, s in out.assign]
    # slots: 2 per pod; group x stays together on the roomiest pod
    assert placed == [("a", "0"), ("a", "1"), ("b", "2"), ("b", "3")]
    assert out.status["phase"] == "Running"
    assert out.status["shards"] == {"total": 5, "assigned": 4, "done": 0, "reassigned": 0}
    assert out.status["progress"] == "0/50" and out.status["startTime"]
    assert ("Normal", "Running") in [e[:2] for e in out.events]


def test_progress_rate_and_eta_from_reports() -> None:
    p = plan([10, 10])
    first = tick(p, (pod("a"),))
    reports = (running(f"{PREFIX}-00000", 4, tps=30.0, tokens=300),
               running(f"{PREFIX}-00001", 2, tps=20.0, tokens=200))
    second = tick(p, (pod("a", shards=reports),), first.memory, first.status, at_s=10.0)
    assert second.status["requests"] == {"total": 20, "completed": 6, "failed": 0}
    assert second.status["progress"] == "6/20"
    assert second.status["tokensPerSecond"] == 50.0  # 500 tokens in 10 s
    assert second.status["eta"] == "23s"  # 14 left at 0.6 requests/s
    assert second.assign == ()


def test_dead_pod_shards_move_with_an_event() -> None:
    p = plan([10, 10])
    first = tick(p, (pod("a"), pod("b")))
    where = {s.shard_id: name for name, s in first.assign}
    assert sorted(where.values()) == ["a", "b"]  # equal pods: spread by load
    lost = next(sid for sid, name in where.items() if name == "a")
    kept = next(sid for sid, name in where.items() if name == "b")
    survivor = pod("b", shards=(running(kept, 1),))
    second = tick(p, (survivor,), first.memory, first.status, at_s=5.0)
    assert [(name, s.shard_id) for name, s in second.assign] == [("b", lost)]
    assert second.status["shards"]["reassigned"] == 1
    assert [e[1] for e in second.events].count("ShardMoved") == 1


def test_stalled_shard_is_revoked_and_moved() -> None:
    p = plan([10])
    first = tick(p, (pod("a"), pod("b", spare=0.1)))
    assert first.assign[0][0] == "a"
    stuck = (running(f"{PREFIX}-00000", 3),)
    t1 = tick(p, (pod("a", shards=stuck), pod("b", spare=0.1)), first.memory, first.status,
              at_s=10.0)
    assert t1.revoke == () and t1.assign == ()
    t2 = tick(p, (pod("a", shards=stuck), pod("b", spare=0.1)), t1.memory, t1.status,
              at_s=10.0 + SETTINGS.stall_timeout_s + 1)
    assert t2.revoke == (("a", f"{PREFIX}-00000"),)
    assert len(t2.assign) == 1  # placed again (the reconciler does not blacklist a pod)
    assert "ShardStalled" in [e[1] for e in t2.events]


def test_suspend_revokes_and_resume_places_again() -> None:
    p = plan([10, 10])
    first = tick(p, (pod("a"),))
    reports = (running(f"{PREFIX}-00000"), running(f"{PREFIX}-00001"))
    suspended = tick(p, (pod("a", shards=reports),), first.memory, first.status,
                     s=spec(suspend=True), at_s=5.0)
    assert suspended.status["phase"] == "Suspended"
    assert sorted(suspended.revoke) == [("a", f"{PREFIX}-00000"), ("a", f"{PREFIX}-00001")]
    assert suspended.assign == ()
    resumed = tick(p, (pod("a"),), suspended.memory, suspended.status, at_s=10.0)
    assert resumed.status["phase"] == "Running" and len(resumed.assign) == 2
    conds = {c["type"]: c for c in resumed.status["conditions"]}
    assert conds["Suspended"]["status"] == "False" and conds["Suspended"]["reason"] == "Resumed"


def test_higher_priority_job_takes_a_slot_from_a_lower_one() -> None:
    p = plan([10])
    full = pod("a", shards=(running("ns.other-00000"), running("ns.other-00001")),
               others=(("ns.other-00000", 0), ("ns.other-00001", -5)))
    low = tick(p, (full,), s=spec(priority=-10))
    assert low.assign == () and low.revoke == ()
    assert low.status["phase"] == "Pending"
    waiting = tick(p, (full,), s=spec(priority=10))
    assert waiting.revoke == () and waiting.assign == ()  # a shortage must last first
    assert waiting.memory.starved_since == 0.0
    still = tick(p, (full,), waiting.memory, waiting.status, s=spec(priority=10),
                 at_s=SETTINGS.preempt_after_s - 1)
    assert still.revoke == ()
    high = tick(p, (full,), still.memory, still.status, s=spec(priority=10),
                at_s=SETTINGS.preempt_after_s)
    assert high.revoke == (("a", "ns.other-00001"),)  # the lowest-priority victim
    assert [name for name, _ in high.assign] == ["a"]
    assert high.memory.starved_since is None


def test_a_new_ready_pod_restarts_the_wait_before_preempting() -> None:
    p = plan([10, 10, 10])
    mine = running(f"{PREFIX}-00000")
    full = pod("a", shards=(running("ns.other-00000"), running("ns.other-00001")),
               others=(("ns.other-00000", 0), ("ns.other-00001", 0)))
    first = tick(p, (full,), s=spec(priority=10))
    assert first.assign == () and first.memory.starved_since == 0.0
    # A pod comes up late: the job fills it, is short again, and waits afresh.
    b = pod("b", spare=0.1)
    grown = tick(p, (full, b), first.memory, first.status, s=spec(priority=10),
                 at_s=SETTINGS.preempt_after_s)
    assert grown.revoke == () and len(grown.assign) == 2
    assert grown.memory.starved_since == SETTINGS.preempt_after_s
    b_full = pod("b", spare=0.1, shards=(mine, running(f"{PREFIX}-00001")))
    later = tick(p, (full, b_full), grown.memory, grown.status, s=spec(priority=10),
                 at_s=SETTINGS.preempt_after_s + 5)
    assert later.revoke == ()


def test_an_unanswering_pod_keeps_its_shards_and_a_second_copy_is_revoked() -> None:
    p = plan([10, 10])
    first = tick(p, (pod("a"), pod("b")))
    where = {s.shard_id: name for name, s in first.assign}
    on_a = next(sid for sid, name in where.items() if name == "a")
    on_b = next(sid for sid, name in where.items() if name == "b")
    # a's sidecar does not answer this tick: its shard keeps its placement, nothing moves.
    quiet = reconcile_job("ns", "job", 1, spec(), observed=JobObserved(
        plan=p, pods=(pod("b", shards=(running(on_b, 1),)),), done={}, services_selected=1,
        silent=frozenset({"a"})), memory=first.memory, previous_status=first.status,
        now=T0, now_s=5.0, settings=SETTINGS)
    assert quiet.assign == () and quiet.revoke == ()
    assert quiet.status["shards"]["assigned"] == 2 and quiet.status["shards"]["reassigned"] == 0
    # The shard shows up on b as well (a lost assign answer): the copy off its placement goes.
    twice = tick(p, (pod("a", shards=(running(on_a, 1),)),
                     pod("b", shards=(running(on_b, 1), running(on_a, 1)))),
                 quiet.memory, quiet.status, at_s=10.0)
    assert twice.revoke == (("b", on_a),) and twice.assign == ()
    assert twice.memory.placements[on_a].pod == "a"
    assert "ShardDuplicate" in [e[1] for e in twice.events]


def test_all_shards_done_asks_for_a_merge_then_succeeds_with_exact_counts() -> None:
    p = plan([10, 10], bad=2)
    done = {f"{PREFIX}-00000": (9, 1), f"{PREFIX}-00001": (10, 0)}
    before = tick(p, (pod("a"),), done=done, previous={"phase": "Running",
                                                        "startTime": "2026-01-01T00:00:00Z"})
    assert before.merge and before.status["phase"] == "Running"
    assert before.status["requests"] == {"total": 22, "completed": 19, "failed": 3}
    after = tick(p, (pod("a"),), done=done, merged=MergeResult(19, 3, 22),
                 previous={"phase": "Running", "startTime": "2026-01-01T00:00:00Z"})
    assert after.status["phase"] == "Succeeded" and after.status["completionTime"]
    assert after.status["progress"] == "22/22"
    assert after.status["outputUri"] == "file:///d/out.jsonl"
    terminal = tick(p, (pod("a"),), previous=after.status, at_s=100.0)
    assert terminal.status["phase"] == "Succeeded" and terminal.assign == ()


def test_deadline_fails_the_job_and_revokes() -> None:
    p = plan([10])
    first = tick(p, (pod("a"),), s=spec(completionWindow="1m"))
    reports = (running(f"{PREFIX}-00000"),)
    late = tick(p, (pod("a", shards=reports),), first.memory, first.status,
                s=spec(completionWindow="1m"), at_s=61.0)
    assert late.status["phase"] == "Failed"
    assert late.revoke == (("a", f"{PREFIX}-00000"),)
    conds = {c["type"]: c for c in late.status["conditions"]}
    assert conds["Failed"]["reason"] == "DeadlineExceeded"


def test_unreadable_input_fails() -> None:
    observed = JobObserved(plan=None, pods=(), done={}, plan_error="file:///x: no such file")
    out = reconcile_job("ns", "job", 1, spec(), observed=observed, memory=JobMemory(),
                        previous_status={}, now=T0, now_s=0.0, settings=SETTINGS)
    assert out.status["phase"] == "Failed"


def test_no_service_means_waiting_with_a_reason() -> None:
    observed = JobObserved(plan=plan([5]), pods=(), done={}, services_selected=0)
    out = reconcile_job("ns", "job", 1, spec(), observed=observed, memory=JobMemory(),
                        previous_status={}, now=T0, now_s=0.0, settings=SETTINGS)
    conds = {c["type"]: c for c in out.status["conditions"]}
    assert out.status["phase"] == "Pending" and conds["Running"]["reason"] == "NoMatchingService"


ROOTS = ("file:///store", "s3://batch")


def scoped_tick(s: OfflineJobSpec, previous: dict[str, Any] | None = None,
                memory: JobMemory | None = None) -> JobOutcome:
    observed = JobObserved(plan=plan([10]), pods=(pod("p0"),), done={}, services_selected=1)
    return reconcile_job("ns", "job", 1, s, observed=observed, memory=memory or JobMemory(),
                         previous_status=previous or {}, now=T0, now_s=0.0,
                         settings=JobSettings(storage_roots=ROOTS))


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"input": {"uri": "file:///store/other/in.jsonl"},
          "output": {"uri": "file:///store/ns/out.jsonl"}}, "spec.input.uri"),
        ({"input": {"uri": "file:///store/ns/../other/in.jsonl"},
          "output": {"uri": "file:///store/ns/out.jsonl"}}, "spec.input.uri"),
        ({"input": {"uri": "s3://batch/ns/in.jsonl"},
          "output": {"uri": "file:///elsewhere/out.jsonl"}}, "spec.output.uri"),
        ({"input": {"uri": "s3://batch/ns/in.jsonl"},
          "output": {"uri": "file:///store/ns/out.jsonl",
                     "errorUri": "file:///store/other/err.jsonl"}}, "spec.output.errorUri"),
    ],
)
def test_a_uri_outside_the_namespace_root_is_not_admitted_and_nothing_is_placed(
    doc: dict[str, Any], field: str
) -> None:
    s = spec(**doc)
    assert field in storage_scope_error(s, "ns", ROOTS)
    out = scoped_tick(s)
    admitted = next(c for c in out.status["conditions"] if c["type"] == "Admitted")
    assert admitted["status"] == "False" and admitted["reason"] == "StorageOutOfScope"
    assert field in admitted["message"]
    assert out.status["phase"] == "Pending"
    assert out.assign == () and "requests" not in out.status
    assert [e[1] for e in out.events] == ["StorageOutOfScope"]
    assert out.events[0][0] == "Warning"
    # The next tick says the same thing without a second event.
    again = scoped_tick(s, previous=out.status)
    assert again.events == () and again.status["phase"] == "Pending"


def test_uris_inside_the_namespace_root_are_planned_and_no_roots_means_no_rule() -> None:
    inside = spec(input={"uri": "s3://batch/ns/in.jsonl"},
                  output={"uri": "file:///store/ns/sub/out.jsonl"})
    assert storage_scope_error(inside, "ns", ROOTS) == ""
    out = scoped_tick(inside)
    assert out.status["phase"] == "Running" and len(out.assign) == 1
    outside = spec(input={"uri": "file:///anywhere/in.jsonl"},
                   output={"uri": "file:///anywhere/out.jsonl"})
    assert storage_scope_error(outside, "ns", ()) == ""
    assert tick(plan([10]), (pod("p0"),), s=outside).status["phase"] == "Running"


def test_roots_configured_after_placement_take_the_shards_back() -> None:
    outside = spec(input={"uri": "file:///store/other/in.jsonl"},
                   output={"uri": "file:///store/ns/out.jsonl"})
    memory = JobMemory(placements={f"{PREFIX}-00000": Placement("p0", 0.0, 0.0, 0)})
    out = scoped_tick(outside, previous={"phase": "Running"}, memory=memory)
    assert out.revoke == (("p0", f"{PREFIX}-00000"),)
    assert out.memory.placements == {}


def test_candidate_pod_keeps_own_reports_counts_others_and_lists_only_lower_priorities() -> None:
    reports = (
        running(f"{PREFIX}-00000"), ShardReport(f"{PREFIX}-00001", "succeeded", total=10),
        running("ns.low-00000"), ShardReport("ns.low-00001", "revoked"),
        running("ns.high-00003"), running("ns.gone-00002"),
        running("ns.job-b-00000"),  # a job whose name extends this one's: not this job's
    )
    seen = candidate_pod("a", "chat", ready=True, spare_capacity=0.3,
                         by_job=group_by_job(reports), job=PREFIX, priority=5,
                         priorities={"ns.low": 0, "ns.high": 9, "ns.job-b": 5})
    assert [r.shard_id for r in seen.shards] == [f"{PREFIX}-00000", f"{PREFIX}-00001"]
    # Active shards of every other job count, known or not ("ns.gone" was deleted).
    assert seen.others_active == 4
    assert seen.other_priorities == (("ns.low-00000", 0),)  # not revoked, not >= 5
    # Equal priorities cannot preempt: nothing to list.
    level = candidate_pod("a", "chat", ready=True, spare_capacity=0.3,
                          by_job=group_by_job(reports), job=PREFIX, priority=0,
                          priorities={"ns.low": 0, "ns.high": 9})
    assert level.other_priorities == () and level.others_active == 4


def test_other_jobs_shards_fill_the_pods_slots() -> None:
    # Two slots per pod: one taken by another job, so this job places one shard on "a" and
    # the rest on the empty pod "b".
    p = plan([10, 10, 10])
    out = tick(p, (pod("a", spare=0.9, shards=(running("ns.other-00000"),)),
                   pod("b", spare=0.1)))
    assert sorted(name for name, _ in out.assign) == ["a", "b", "b"]
