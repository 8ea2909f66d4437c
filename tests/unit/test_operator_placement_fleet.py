"""Placement stability over a synthetic fleet: jobs of different priorities share a pool.

A small in-memory fleet stands in for the sidecars and the handler: pods hold shards,
every tick each job (one at a time, as the per-namespace lock does) sees the pods'
reports and calls ``reconcile_job``; revokes and assigns are applied to the pods, and a
confirmed revoke of another job's shard releases it from that job's memory, as
``Handlers._release_preempted`` does. Faults the 1,000-node bench met are injected: a pod
whose sidecar does not answer for a tick, and an assign that the pod took but whose answer
was lost. The properties checked are the ones the fleet needs: every shard ends up placed
exactly once, no shard runs on two pods, nothing moves once the fleet is up, and a real
shortage preempts only after the hysteresis and only as much as it must.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from slipstream_operator.api import OfflineJobSpec
from slipstream_operator.reconcile_job import (
    JobMemory,
    JobObserved,
    JobSettings,
    candidate_pod,
    job_prefix,
    reconcile_job,
)
from slipstream_operator.shards import Plan, ShardPlan
from slipstream_operator.sidecar_client import ShardReport, group_by_job

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
INTERVAL_S = 5.0


def job_plan(name: str, shards: int) -> Plan:
    prefix = job_prefix("ns", name)
    cut = tuple(ShardPlan(f"{prefix}-{i:05d}", i, i + 1, f"{name}-{i}") for i in range(shards))
    return Plan(staged_uri=f"file:///w/{name}.jsonl", work_dir=f"/w/{name}", total=shards,
                valid=shards, bad=0, shards=cut, input_fingerprint=name)


def job_spec(priority: int) -> OfflineJobSpec:
    return OfflineJobSpec.model_validate({"model": "m", "input": {"uri": "file:///d/in.jsonl"},
                                          "output": {"uri": "file:///d/out.jsonl"},
                                          "priority": priority})


@dataclass
class Job:
    name: str
    priority: int
    plan: Plan
    memory: JobMemory = field(default_factory=JobMemory)
    status: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fleet:
    """Pods (name -> shard ids they run), when each comes up, and the jobs sharing them."""

    up_at: dict[str, float]
    jobs: list[Job]
    settings: JobSettings
    running: dict[str, set[str]] = field(default_factory=dict)
    revokes: list[tuple[float, str, str]] = field(default_factory=list)  # (t, by job, shard)
    silent_at: dict[float, str] = field(default_factory=dict)  # tick -> pod that won't answer
    lost_assign_at: float | None = None  # the first assign of this tick is taken but "fails"

    def owner(self, shard_id: str) -> Job:
        return next(j for j in self.jobs if shard_id.startswith(job_prefix("ns", j.name) + "-"))

    def tick(self, now_s: float) -> None:
        for pod, at in self.up_at.items():
            if at <= now_s:
                self.running.setdefault(pod, set())
        lost_pending = self.lost_assign_at == now_s
        for job in self.jobs:
            silent = self.silent_at.get(now_s)
            candidates = []
            for pod in sorted(self.running):
                if pod == silent:
                    continue
                shards = self.running[pod]
                reports = tuple(ShardReport(s, "running", total=1) for s in sorted(shards))
                candidates.append(candidate_pod(
                    pod, "svc", ready=True, spare_capacity=0.5, by_job=group_by_job(reports),
                    job=job_prefix("ns", job.name), priority=job.priority,
                    priorities={job_prefix("ns", j.name): j.priority for j in self.jobs
                                if j is not job},
                ))
            observed = JobObserved(plan=job.plan, pods=tuple(candidates), done={},
                                   services_selected=1,
                                   silent=frozenset({silent} if silent else ()))
            out = reconcile_job("ns", job.name, 1, job_spec(job.priority), observed=observed,
                                memory=job.memory, previous_status=job.status,
                                now=T0 + timedelta(seconds=now_s), now_s=now_s,
                                settings=self.settings)
            memory = out.memory
            for pod, shard_id in out.revoke:
                if pod == silent or shard_id not in self.running.get(pod, set()):
                    continue
                self.running[pod].discard(shard_id)
                self.revokes.append((now_s, job.name, shard_id))
                victim = self.owner(shard_id)
                if victim is not job and shard_id in victim.memory.placements:
                    kept = {k: v for k, v in victim.memory.placements.items() if k != shard_id}
                    victim.memory = replace(victim.memory, placements=kept)
            refused: set[str] = set()
            for pod, shard in out.assign:
                self.running[pod].add(shard.shard_id)
                if lost_pending:  # the pod took it, the operator saw an error
                    refused.add(shard.shard_id)
                    lost_pending = False
            if refused:
                memory = replace(memory, placements={k: v for k, v in memory.placements.items()
                                                     if k not in refused})
            job.memory = memory
            job.status = out.status

    def copies(self) -> dict[str, int]:
        count: dict[str, int] = {}
        for shards in self.running.values():
            for s in shards:
                count[s] = count.get(s, 0) + 1
        return count


def pool(pods: int, priorities: tuple[int, ...], shards_per_job: int, *, ramp_s: float,
         spare_slots: int = 1) -> Fleet:
    """Pods come up evenly over ``ramp_s``; slots per pod fit every shard plus ``spare_slots``."""
    cap = math.ceil(len(priorities) * shards_per_job / pods) + spare_slots
    up_at = {f"pod-{i:02d}": round(i * ramp_s / pods / INTERVAL_S) * INTERVAL_S
             for i in range(pods)}
    jobs = [Job(f"job{k}", prio, job_plan(f"job{k}", shards_per_job))
            for k, prio in enumerate(priorities)]
    return Fleet(up_at, jobs, JobSettings(max_shards_per_pod=cap, stall_timeout_s=3600.0,
                                          preempt_after_s=30.0))


def run(fleet: Fleet, until_s: float) -> None:
    t = 0.0
    while t <= until_s:
        fleet.tick(t)
        t += INTERVAL_S


def test_a_fleet_coming_up_places_every_shard_once_and_then_nothing_moves() -> None:
    fleet = pool(20, (0, 5, 10, 20), 100, ramp_s=150.0)
    ramp_end = max(fleet.up_at.values())
    # Faults met at 1,000 nodes: a pod's Status times out for a tick (its shards still run),
    # and an assign is taken by the pod while the operator sees an error.
    fleet.silent_at = {ramp_end + 10: "pod-03", ramp_end + 40: "pod-11"}
    fleet.lost_assign_at = 20.0
    run(fleet, ramp_end + 200)
    copies = fleet.copies()
    assert max(copies.values()) == 1, "a shard runs on two pods"
    assert len(copies) == 400
    for job in fleet.jobs:
        assert job.status["shards"]["assigned"] == 100, (job.name, job.status["shards"])
        assert set(job.memory.placements) == {s.shard_id for s in job.plan.shards}
    late = [r for r in fleet.revokes if r[0] > ramp_end + 5]
    assert late == [], f"placement still churns after the ramp: {late[:5]}"
    # Capacity kept arriving (a pod every tick or two), so no job had to preempt another:
    # the only revokes are of the second copy the lost assign answer left behind.
    preempted = [r for r in fleet.revokes if fleet.owner(r[2]).name != r[1]]
    assert preempted == []
    assert len(fleet.revokes) <= 1


def test_a_real_shortage_preempts_after_the_hysteresis_and_then_holds() -> None:
    # 10 pods with room for 300 of 400 shards, all up at once: the top job is short.
    fleet = pool(10, (0, 20), 200, ramp_s=0.0, spare_slots=0)
    fleet.settings = replace(fleet.settings, max_shards_per_pod=30)
    fleet.tick(0.0)
    low, high = fleet.jobs
    # Both place what fits; the low-priority job came first and took 200 slots.
    assert high.status["shards"]["assigned"] == 100
    run_from = INTERVAL_S
    t = run_from
    while t < 30.0:
        fleet.tick(t)
        t += INTERVAL_S
    assert fleet.revokes == [], "preempted before the shortage lasted preempt_after_s"
    while t <= 120.0:
        fleet.tick(t)
        t += INTERVAL_S
    assert high.status["shards"]["assigned"] == 200
    assert low.status["shards"]["assigned"] == 100
    assert max(fleet.copies().values()) == 1
    # Exactly the 100 slots the top job lacked, each taken once, all from the lower job.
    assert len(fleet.revokes) == 100
    assert {r[1] for r in fleet.revokes} == {high.name}
    assert len({r[2] for r in fleet.revokes}) == 100
    assert all(r[0] == 30.0 for r in fleet.revokes)
