"""OfflineJob reconciler: ``(spec, observed, now) -> (actions, status)``.

Pure. The handler plans the input (``shards.plan_input``), asks every
candidate pod's sidecar for its status, verifies finished shards against their
output logs, and passes all of it in; this module decides

* **placement**: pending shards go to ready, non-draining pods of selected
  services with a free slot (at most ``max_shards_per_pod`` shards of any job
  per pod). A pod already holding the shard's prefix group (same
  ``affinity``) is preferred, so a group stays where the engine's prefix
  cache has it; then the pod with the most spare capacity. A job of higher
  priority may take a slot from a lower-priority job's shard (revoked; it
  resumes later from its log), but only after it has found no free slot for
  ``preempt_after_s`` in a row, and that wait starts again whenever another
  ready pod appears (capacity still arriving, as while a fleet comes up). A
  shard is only ever preempted by a job of strictly higher priority, so the
  moves are bounded (at most one per distinct higher priority) and cannot
  oscillate between two jobs;
* **stability**: a placed shard stays where it is unless its pod is gone or
  not ready, it stalls, or a preemption takes it. A pod that exists but did not
  answer this tick (``JobObserved.silent``) is not gone: its shards keep their
  placement (until ``stall_timeout_s`` without progress), and nothing new goes
  there. A second running copy of a shard (a revoke or an assign whose answer
  was lost) is revoked, so no shard runs twice and no slot is held by a stray;
* **moves**: a shard whose pod is gone or not ready, or that made no progress
  for ``stall_timeout_s``, is revoked (when the pod still answers) and
  placed again; its output URIs stay the same, so it continues where it stopped;
* **suspend / resume**: suspend revokes every placed shard; resume places again;
* **storage scope**: with storage roots configured, ``spec.input.uri``,
  ``spec.output.uri`` and ``spec.output.errorUri`` must lie under
  ``<root>/<namespace>/`` (:func:`storage_scope_error`); otherwise the job is
  not admitted (``Admitted=False``, reason ``StorageOutOfScope``, a Warning
  event once) and stays **Pending**, not Failed, so that correcting the spec
  admits it without recreating it. The handler asks the same function before
  planning, so nothing is staged for such a job. An output that is not
  ``file://`` needs a staging folder on the shared claim
  (:mod:`slipstream_operator.staging`): without one, or with one outside the
  namespace's roots, the job is not admitted either (reason
  ``NoStagingFolder``) (:func:`storage_error` asks both);
* **completion**: when every shard's log is complete the handler merges
  (``merge=True``); once the merge reports exact counts the job Succeeded. A
  job past its completion window Failed (``DeadlineExceeded``).

Memory (placements in flight, progress timestamps, the completion-rate
history) is kept by the handler between calls and rebuilt from the sidecars'
reports after an operator restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from slipstream_operator.api import OfflineJobSpec, Phase, parse_duration
from slipstream_operator.conditions import rfc3339, set_condition
from slipstream_operator.rates import TokenMeter, format_eta
from slipstream_operator.shards import MergeResult, Plan, ShardPlan
from slipstream_operator.sidecar_client import ACTIVE_STATES, JobShards, ShardReport
from slipstream_operator.staging import is_local, staging_problem, work_dir_for
from slipstream_scheduler.storage_scope import ScopeError, check_uri


@dataclass(frozen=True, slots=True)
class CandidatePod:
    """A pod that may host the job, as its sidecar reports it (built by :func:`candidate_pod`).

    Only this job's own shard reports are carried; other jobs' shards count towards the
    pod's load (``others_active``), and the ones this job may preempt are listed with their
    job's priority.
    """

    name: str
    service: str
    ready: bool
    spare_capacity: float
    shards: tuple[ShardReport, ...] = ()  # this job's shards on the pod, in any state
    others_active: int = 0  # pending or running shards of other jobs on the pod
    # (shard_id, job priority) of other jobs' pending or running shards whose job has a lower
    # priority than this one: the only ones a preemption may take.
    other_priorities: tuple[tuple[str, int], ...] = ()


def candidate_pod(
    name: str, service: str, *, ready: bool, spare_capacity: float,
    by_job: Mapping[str, JobShards], job: str, priority: int, priorities: Mapping[str, int],
) -> CandidatePod:
    """The pod as job ``job`` (its :func:`job_prefix`) of ``priority`` sees it.

    ``by_job`` is the pod's shards grouped by job (``SidecarStatus.by_job``, computed once per
    reply); ``priorities`` holds the other jobs of the namespace. The cost is one step per job
    on the pod plus the shards of lower-priority jobs, not one per shard: a namespace's job
    ticks all read the same replies.
    """
    own = by_job.get(job)
    others_active = 0
    lower: list[tuple[str, int]] = []
    for other, shards in by_job.items():
        if other == job:
            continue
        others_active += shards.active
        other_priority = priorities.get(other)
        if shards.active and other_priority is not None and other_priority < priority:
            lower.extend((r.shard_id, other_priority) for r in shards.reports
                         if r.state in ACTIVE_STATES)
    return CandidatePod(name, service, ready, spare_capacity, own.reports if own else (),
                        others_active, tuple(lower))


@dataclass(frozen=True, slots=True)
class Placement:
    pod: str
    since_s: float
    progress_s: float
    completed: int


@dataclass(frozen=True, slots=True)
class JobMemory:
    placements: dict[str, Placement] = field(default_factory=dict, hash=False)
    reassigned: int = 0
    history: tuple[tuple[float, int], ...] = ()  # (now_s, finished requests)
    affinity_pods: dict[str, str] = field(default_factory=dict, hash=False)
    starved_since: float | None = None  # first tick (now_s) of the current slot shortage
    ready_seen: int = 0  # ready pods at the previous tick (more now: capacity arrived)
    tokens: TokenMeter = field(default_factory=TokenMeter)  # output tokens over rate_window_s


@dataclass(frozen=True, slots=True)
class JobObserved:
    plan: Plan | None
    pods: tuple[CandidatePod, ...]
    done: dict[str, tuple[int, int]]  # verified shard -> (completed, failed)
    merged: MergeResult | None = None
    plan_error: str = ""
    services_selected: int = 0
    silent: frozenset[str] = frozenset()  # pods that exist but whose sidecar did not answer


@dataclass(frozen=True, slots=True)
class JobSettings:
    max_shards_per_pod: int = 2
    stall_timeout_s: float = 120.0
    rate_window_s: float = 60.0
    preempt_after_s: float = 30.0  # slot shortage (s) before preempting lower priorities
    storage_roots: tuple[str, ...] = ()  # empty: no namespace scoping of the URIs
    staging_root: str | None = None  # shared folder for object-store outputs' work folders


@dataclass(frozen=True, slots=True)
class JobOutcome:
    assign: tuple[tuple[str, ShardPlan], ...]
    revoke: tuple[tuple[str, str], ...]
    merge: bool
    status: dict[str, Any]
    memory: JobMemory
    events: tuple[tuple[str, str, str], ...] = ()


def job_prefix(namespace: str, name: str) -> str:
    """Shard ids of a job start with this (``<ns>.<name>``), so a pod's report maps back."""
    return f"{namespace}.{name}"


def storage_scope_error(
    spec: OfflineJobSpec, namespace: str, roots: tuple[str, ...]
) -> str:
    """Why the job's URIs are outside ``namespace``'s storage ("" when they are inside).

    Checks ``spec.input.uri``, ``spec.output.uri`` and the error file (``spec.output.errorUri``
    or its default) against ``roots``; the message names the first field out of scope.
    """
    fields = (("spec.input.uri", spec.input.uri), ("spec.output.uri", spec.output.uri),
              ("spec.output.errorUri", spec.output.errors))
    for field_name, uri in fields:
        try:
            check_uri(uri, namespace=namespace, roots=roots, field=field_name)
        except ScopeError as exc:
            return str(exc)
    return ""


def storage_error(
    spec: OfflineJobSpec, namespace: str, name: str, settings: JobSettings
) -> tuple[str, str]:
    """Why the job cannot be admitted for its storage, as (reason, message); ("", "") when it
    can: a URI out of the namespace's scope (``StorageOutOfScope``), or an object-store output
    with no staging folder, or one outside the namespace's roots (``NoStagingFolder``)."""
    scope = storage_scope_error(spec, namespace, settings.storage_roots)
    if scope:
        return "StorageOutOfScope", scope
    problem = staging_problem(spec.output.uri, settings.staging_root)
    if problem:
        return "NoStagingFolder", problem
    if settings.staging_root and settings.storage_roots and not is_local(spec.output.uri):
        work = work_dir_for(spec.output.uri, namespace=namespace, name=name,
                            staging_root=settings.staging_root)
        try:
            check_uri(f"file://{work}/plan.json", namespace=namespace,
                      roots=settings.storage_roots, field="jobStorage.pvc.mountPath")
        except ScopeError as exc:
            return "NoStagingFolder", (f"spec.output.uri: its staging folder is outside the "
                                       f"storage roots ({exc}); add file://<mount path> to "
                                       "the operator's storageRoots")
    return "", ""


def _parse_time(value: Any) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def reconcile_job(
    ref_namespace: str,
    ref_name: str,
    generation: int,
    spec: OfflineJobSpec,
    *,
    observed: JobObserved,
    memory: JobMemory,
    previous_status: dict[str, Any],
    now: datetime,
    now_s: float,
    settings: JobSettings,
) -> JobOutcome:
    """One reconcile of an OfflineJob (see the module docstring)."""
    conditions: list[dict[str, Any]] = [dict(c) for c in previous_status.get("conditions", [])]
    events: list[tuple[str, str, str]] = []
    status: dict[str, Any] = {"observedGeneration": generation}
    prev_phase = previous_status.get("phase", Phase.PENDING.value)
    start_time = previous_status.get("startTime")
    completion_time = previous_status.get("completionTime")

    def cond(type_: str, value: bool, reason: str, message: str = "") -> None:
        set_condition(conditions, type_, value, reason=reason, message=message, now=now,
                      observed_generation=generation)

    def finish(phase: Phase, assign: tuple[tuple[str, ShardPlan], ...] = (),
               revoke: tuple[tuple[str, str], ...] = (), merge: bool = False,
               mem: JobMemory = memory) -> JobOutcome:
        status["phase"] = phase.value
        status["conditions"] = conditions
        if start_time:
            status["startTime"] = start_time
        if completion_time:
            status["completionTime"] = completion_time
        if phase.value != prev_phase:
            events.append(("Normal" if phase is not Phase.FAILED else "Warning", phase.value,
                           f"phase {prev_phase} -> {phase.value}"))
        return JobOutcome(assign, revoke, merge, status, mem, tuple(events))

    # Terminal phases stay terminal.
    if prev_phase in (Phase.SUCCEEDED.value, Phase.FAILED.value):
        for key in ("requests", "shards", "progress", "eta", "tokensPerSecond", "outputUri"):
            if key in previous_status:
                status[key] = previous_status[key]
        return finish(Phase(prev_phase))

    reason, scope_error = storage_error(spec, ref_namespace, ref_name, settings)
    if scope_error:
        was = next((c for c in conditions if c.get("type") == "Admitted"), {})
        if was.get("reason") != reason or was.get("message") != scope_error:
            events.append(("Warning", reason, scope_error))
        cond("Admitted", False, reason, scope_error)
        # Roots configured after the job started: take back what it placed.
        held = tuple((p.pod, sid) for sid, p in memory.placements.items())
        return finish(Phase.PENDING, revoke=held, mem=replace(memory, placements={}))

    plan = observed.plan
    if plan is None:
        cond("Admitted", False, "InputUnreadable" if observed.plan_error else "Planning",
             observed.plan_error or "reading and ordering the input")
        if observed.plan_error:
            completion_time = rfc3339(now)
            cond("Failed", True, "InputUnreadable", observed.plan_error)
            return finish(Phase.FAILED)
        return finish(Phase.PENDING)

    by_id = {s.shard_id: s for s in plan.shards}

    # -- where the shards are -----------------------------------------------------------------
    # Every active copy of this job's shards, per pod: after a revoke or an assign whose answer
    # was lost, a shard can run on two pods.
    copies: dict[str, dict[str, ShardReport]] = {}
    ready_pods = {p.name: p for p in observed.pods if p.ready}
    for pod in observed.pods:
        for report in pod.shards:
            if report.shard_id in by_id and report.state in ACTIVE_STATES:
                copies.setdefault(report.shard_id, {})[pod.name] = report
    placements = dict(memory.placements)
    revoke: list[tuple[str, str]] = []
    reassigned = memory.reassigned
    for shard_id, placement in list(placements.items()):
        if shard_id in observed.done:
            del placements[shard_id]
            continue
        if placement.pod in observed.silent:
            # Not gone, just unanswered this tick: the shard most likely still runs there.
            if now_s - placement.progress_s > settings.stall_timeout_s:
                del placements[shard_id]
                reassigned += 1
                events.append(("Warning", "ShardMoved",
                               f"shard {shard_id} left pod {placement.pod} (no answer)"))
            continue
        if placement.pod not in ready_pods:
            del placements[shard_id]
            reassigned += 1
            events.append(("Warning", "ShardMoved",
                           f"shard {shard_id} left pod {placement.pod} (pod gone or not ready)"))
            continue
        on = copies.get(shard_id, {})
        reported = on.get(placement.pod)
        if reported is None:
            elsewhere = sorted(name for name in on if name in ready_pods)
            if elsewhere:  # it runs on another pod (an assign whose answer was lost): follow it
                report = on[elsewhere[0]]
                placements[shard_id] = Placement(elsewhere[0], now_s, now_s,
                                                 report.completed + report.failed)
            elif now_s - placement.since_s > settings.stall_timeout_s:
                del placements[shard_id]  # the pod never took it up
            continue
        done_now = reported.completed + reported.failed
        if done_now > placement.completed:
            placements[shard_id] = replace(placement, progress_s=now_s, completed=done_now)
        elif now_s - placement.progress_s > settings.stall_timeout_s:
            revoke.append((placement.pod, shard_id))
            del placements[shard_id]
            reassigned += 1
            events.append(("Warning", "ShardStalled",
                           f"shard {shard_id} made no progress on {placement.pod}; moving it"))
    for shard_id, on in copies.items():
        if shard_id in observed.done:
            continue
        if shard_id not in placements:  # running without a placement (operator restart): adopt
            found = sorted((-(r.completed + r.failed), name) for name, r in on.items()
                           if name in ready_pods and (name, shard_id) not in revoke)
            if found:
                name = found[0][1]
                placements[shard_id] = Placement(name, now_s, now_s,
                                                 on[name].completed + on[name].failed)
        holder = placements.get(shard_id)
        for name in sorted(on):
            if holder is not None and name != holder.pod and name not in observed.silent and (
                (name, shard_id) not in revoke
            ):
                revoke.append((name, shard_id))  # a second copy: it would run twice
                events.append(("Warning", "ShardDuplicate",
                               f"shard {shard_id} also ran on {name}; revoked there"))
    affinity_pods = dict(memory.affinity_pods)

    # -- counts --------------------------------------------------------------------------------
    completed = sum(c for c, _ in observed.done.values())
    failed = plan.bad + sum(f for _, f in observed.done.values())
    tps = 0.0
    for shard_id, placement in placements.items():
        report_or_none = copies.get(shard_id, {}).get(placement.pod)
        if report_or_none is not None:
            report = report_or_none
            completed += report.completed
            failed += report.failed
            tps += report.tokens_per_second
    finished_requests = completed + failed
    counters = {(pod.name, r.shard_id): r.output_tokens
                for pod in observed.pods if pod.name not in observed.silent
                for r in pod.shards if r.shard_id in by_id}
    tokens = memory.tokens.advance(counters, now_s, settings.rate_window_s,
                                   forget=frozenset(k for k in memory.tokens.seen
                                                    if k[1] in observed.done))
    token_rate = tokens.rate()
    if token_rate is not None:
        tps = token_rate
    kept = [(t, n) for t, n in memory.history if now_s - t <= settings.rate_window_s]
    history = (*kept, (now_s, finished_requests))
    rate = 0.0
    if len(history) >= 2 and history[-1][0] > history[0][0]:
        rate = max(0.0, (history[-1][1] - history[0][1]) / (history[-1][0] - history[0][0]))
    remaining = max(0, plan.total - finished_requests)
    status["requests"] = {"total": plan.total, "completed": completed, "failed": failed}
    status["progress"] = f"{finished_requests}/{plan.total}"
    status["tokensPerSecond"] = round(tps, 2)
    status["eta"] = format_eta(remaining / rate) if rate > 0 and remaining else ""
    status["shards"] = {
        "total": len(plan.shards),
        "assigned": len(placements),
        "done": len(observed.done),
        "reassigned": reassigned,
    }
    cond("Admitted", True, "Planned",
         f"{plan.total} requests ({plan.bad} unreadable) in {len(plan.shards)} shards")
    new_memory = JobMemory(placements=placements, reassigned=reassigned, history=history,
                           affinity_pods=affinity_pods, starved_since=memory.starved_since,
                           ready_seen=memory.ready_seen, tokens=tokens)

    # -- finished? -------------------------------------------------------------------------------
    if len(observed.done) == len(plan.shards):
        if observed.merged is not None:
            m = observed.merged
            status["requests"] = {"total": m.total, "completed": m.completed, "failed": m.failed}
            status["progress"] = f"{m.completed + m.failed}/{m.total}"
            status["eta"] = ""
            status["tokensPerSecond"] = 0.0
            status["outputUri"] = spec.output.uri
            completion_time = rfc3339(now)
            cond("Running", False, "Completed")
            cond("Complete", True, "AllRequestsRecorded",
                 f"{m.completed} succeeded, {m.failed} failed")
            return finish(Phase.SUCCEEDED, mem=new_memory)
        return finish(Phase.RUNNING, merge=True, mem=new_memory)

    # -- deadline ---------------------------------------------------------------------------------
    started = _parse_time(start_time)
    if started is not None and (now - started).total_seconds() > parse_duration(
        spec.completion_window
    ):
        completion_time = rfc3339(now)
        cond("Failed", True, "DeadlineExceeded",
             f"not finished within completionWindow {spec.completion_window}")
        cond("Running", False, "DeadlineExceeded")
        revoke.extend((p.pod, sid) for sid, p in placements.items())
        return finish(Phase.FAILED, revoke=tuple(revoke),
                      mem=replace(new_memory, placements={}))

    # -- suspended --------------------------------------------------------------------------------
    if spec.suspend:
        revoke.extend((p.pod, sid) for sid, p in placements.items())
        cond("Suspended", True, "SuspendedByUser", "spec.suspend is true")
        cond("Running", False, "Suspended")
        status["shards"]["assigned"] = 0
        status["eta"] = ""
        return finish(Phase.SUSPENDED, revoke=tuple(revoke),
                      mem=replace(new_memory, placements={}))
    if prev_phase == Phase.SUSPENDED.value:
        cond("Suspended", False, "Resumed", "spec.suspend is false")

    # -- placement --------------------------------------------------------------------------------
    load = {pod.name: pod.others_active for pod in observed.pods}
    for placement in placements.values():
        load[placement.pod] = load.get(placement.pod, 0) + 1
    pending = [s for s in plan.shards
               if s.shard_id not in observed.done and s.shard_id not in placements]
    assign: list[tuple[str, ShardPlan]] = []
    revoked_others: set[str] = set()
    pods = [p for p in observed.pods if p.ready]
    # Preemption hysteresis: a shortage must last preempt_after_s, and more ready pods than at
    # the last tick (capacity still arriving) start the wait again.
    starved_since = None if len(pods) > memory.ready_seen else memory.starved_since
    short = False
    for shard in pending:
        free = [p for p in pods if load.get(p.name, 0) < settings.max_shards_per_pod]
        if not free:
            short = True
            if starved_since is None:
                starved_since = now_s
            if now_s - starved_since < settings.preempt_after_s:
                break
            victim = _preemptible(pods, spec.priority, revoked_others)
            if victim is None:
                break
            pod_name, victim_shard = victim
            revoke.append((pod_name, victim_shard))
            revoked_others.add(victim_shard)
            events.append(("Normal", "ShardPreempted",
                           f"shard {victim_shard} yields pod {pod_name} to priority "
                           f"{spec.priority}"))
            load[pod_name] = load.get(pod_name, 0) - 1
            free = [p for p in pods if p.name == pod_name]
        preferred = affinity_pods.get(shard.affinity)
        target = max(
            free,
            key=lambda p: (p.name == preferred, p.spare_capacity,
                           -load.get(p.name, 0), p.name),
        )
        assign.append((target.name, shard))
        load[target.name] = load.get(target.name, 0) + 1
        affinity_pods[shard.affinity] = target.name
        placements[shard.shard_id] = Placement(target.name, now_s, now_s, 0)
    if assign and not start_time:
        start_time = rfc3339(now)
    new_memory = replace(new_memory, placements=placements, affinity_pods=affinity_pods,
                         starved_since=starved_since if short and len(assign) < len(pending)
                         else None, ready_seen=len(pods))
    status["shards"]["assigned"] = len(placements)

    if placements:
        cond("Running", True, "ShardsRunning",
             f"{len(placements)} shards on {len({p.pod for p in placements.values()})} pods")
        phase = Phase.RUNNING
    else:
        why = ("NoMatchingService" if observed.services_selected == 0
               else "NoReadyPods" if not any(p.ready for p in observed.pods) else "NoCapacity")
        cond("Running", False, why, "waiting for capacity")
        phase = Phase.RUNNING if start_time else Phase.PENDING
    return finish(phase, assign=tuple(assign), revoke=tuple(revoke), mem=new_memory)


def _preemptible(
    pods: list[CandidatePod], priority: int, taken: set[str]
) -> tuple[str, str] | None:
    """The lowest-priority other job's shard below ``priority`` on a ready pod, if any."""
    best: tuple[int, str, str] | None = None
    for pod in pods:
        for shard_id, other in pod.other_priorities:
            if other < priority and shard_id not in taken and (best is None or other < best[0]):
                best = (other, pod.name, shard_id)
    return None if best is None else (best[1], best[2])

