"""In-engine mode: the planner's ITERATION mode picks every iteration's batch inside the engine.

This is what an engine plugin (a vLLM ``--scheduler-cls`` running
:class:`~slipstream_scheduler.planner.TwoPhasePlanner` in
``PlannerMode.ITERATION``, or HyGen inside Sarathi-Serve) would add over the
sidecar. :class:`PlannedEngine` is the engine model with vLLM's scheduling walk
replaced, per iteration, by one call of the real planner:

1. a :class:`~slipstream_scheduler.types.Snapshot` of the engine's state
   (running requests, the waiting queue split by class in ``(priority,
   arrival)`` order with each request's prefix-cache hit, free KV blocks);
2. ``planner.plan(snapshot)``: online decodes, online chunks and new online
   requests first, then offline decodes, offline chunks and new offline
   requests while the predicted step stays within the budget (an offline
   decode or chunk that does not fit is skipped this iteration and keeps its
   KV; offline work is preempted only for an online request's KV or slot);
3. the plan carried out on the engine's KV pool and timed by its GPU model.

The budget is the online budget while any online request is in the engine
(running or waiting) and the *idle budget* otherwise (the dispatcher's
``idle_budget_s`` semantics: ``None`` the budget always applies, as in HyGen;
``inf`` unbounded), so the two modes are compared with the same knobs.

It is reported beside the sidecar numbers and is **never** what the sidecar
achieves. Approximations (NOTE: where this bends a real plugin):

* decoders are never kept virtual (every running request is walked every
  iteration: slower than the stock engine, same semantics);
* a plan that schedules nothing while there is work (an idle budget below
  the cheapest offline step, or KV exhausted by offline prefills) is replaced
  by vLLM's own walk for that iteration (counted in
  :attr:`PlannedEngine.fallback_steps`) so the engine never stalls;
* which offline requests enter the engine is decided in front of it, as the
  sidecar does in engine mode: without a budget, as many as its KV estimate and
  the engine's slots allow (see :mod:`slipstream_scheduler.sim.simulator`).

Deliberately left out: everything else of the engine (timing, KV pool, prefix
cache, request lifecycle: inherited unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

from slipstream_scheduler.engine.model import (
    EngineConfig,
    EngineModel,
    RequestState,
    StepResult,
    _Req,
)
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.planner import PlannerMode, TwoPhasePlanner
from slipstream_scheduler.types import (
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
    StepPlan,
)

_ONLINE = RequestClass.ONLINE
_OFFLINE = RequestClass.OFFLINE


class PlannedEngine(EngineModel):
    """The engine model scheduled by the planner's ITERATION mode (see the module note)."""

    def __init__(
        self,
        config: EngineConfig,
        seed: int = 0,
        *,
        planner: TwoPhasePlanner,
        budget_s: float | None,
        idle_budget_s: float | None,
        offline_priority: int,
        timing_model: LinearLatencyModel | None = None,
    ) -> None:
        if planner.mode is not PlannerMode.ITERATION:
            raise ValueError("in-engine mode needs a planner in PlannerMode.ITERATION")
        super().__init__(config, seed, timing_model=timing_model)
        self.planner = planner
        self.budget_s = budget_s
        self.idle_budget_s = idle_budget_s
        self.offline_priority = offline_priority
        self.plans = 0
        """Planner calls (one per iteration)."""
        self.fallback_steps = 0
        """Iterations run by vLLM's walk because the plan scheduled nothing."""
        self.skipped_offline = 0
        """Running offline requests left out of an iteration by the budget (summed over plans)."""
        self.max_offline_step_over_budget_s = -math.inf
        """Largest (predicted step - budget) over budgeted plans that scheduled offline work."""

    # ------------------------------------------------------------------ snapshot

    def _cls(self, r: _Req) -> RequestClass:
        return _ONLINE if r.priority < self.offline_priority else _OFFLINE

    def _hit_keys(self, r: _Req) -> tuple[list[Hashable], int]:
        """The request's cached leading blocks (as vLLM's WAITING loop finds them)."""
        if not self._cache:
            return [], 0
        bs = self._bs
        max_hit = (r.prompt + r.generated - 1) // bs
        if r.npreempt == 0:
            keys = list(r.hashes[:max_hit])
        else:
            keys = [self._key(r, i) for i in range(max_hit)]
        nhit, evictable = self.pool.longest_hit(keys)
        return keys[:nhit], evictable

    def _waiting(self) -> list[_Req]:
        """Waiting requests in ``(priority, arrival)`` order, each once."""
        heap = self._waiting_heap
        seen: set[int] = set()
        out: list[_Req] = []
        for entry in sorted(heap, key=lambda e: (e[0], e[1], e[2])):
            r = entry[3]
            if r.state is RequestState.WAITING and id(r) not in seen:
                seen.add(id(r))
                out.append(r)
        if len(heap) > 2 * len(out) + 64:  # drop stale entries (admitted out of heap order)
            self._waiting_heap = [(r.priority, r.arrival, r.seq, r) for r in out]
        return out

    def _snapshot(self, now_s: float, waiting: list[_Req]) -> Snapshot:
        running: list[RunningRequest] = []
        for r in self._running:
            pending = r.prompt + r.generated - r.computed
            cls = self._cls(r)
            if r.generated >= 1 and pending == 1:  # decoding: context = r.computed
                running.append(
                    RunningRequest(
                        r.rid,
                        cls,
                        r.prompt,
                        r.prompt,
                        r.generated - 1,
                        r.limit,
                        r.arrival,
                        r.priority,
                    )
                )
            else:  # (re)computing its prompt plus what it generated before a preemption
                running.append(
                    RunningRequest(
                        r.rid,
                        cls,
                        r.prompt + r.generated,
                        r.computed,
                        0,
                        r.limit,
                        r.arrival,
                        r.priority,
                    )
                )
        online: list[QueuedRequest] = []
        offline: list[QueuedRequest] = []
        bs = self._bs
        window = self.planner.rules.queue_window
        for r in waiting:
            cls = self._cls(r)
            dest = online if cls is _ONLINE else offline
            if len(dest) >= window:
                continue
            hit_keys, _ = self._hit_keys(r)
            dest.append(
                QueuedRequest(
                    r.rid,
                    cls,
                    r.prompt + r.generated,
                    r.limit,
                    r.arrival,
                    cached_tokens=len(hit_keys) * bs,
                    already_generated=r.generated,
                )
            )
        budget = self.budget_s
        if not online and all(q.cls is _OFFLINE for q in running):
            idle = self.idle_budget_s
            if idle is not None:
                budget = None if math.isinf(idle) else idle
        return Snapshot(
            now_s,
            tuple(running),
            tuple(online),
            tuple(offline),
            self.pool.free,
            self.limits,
            budget,
        )

    # ------------------------------------------------------------------ the step

    def step(self, now_s: float = 0.0) -> StepResult:
        """One iteration: snapshot, ``planner.plan``, carry the plan out, time it."""
        self._devirtualize_all()
        self._prefilling = list(self._running)
        waiting = self._waiting()
        snap = self._snapshot(now_s, waiting)
        plan = self.planner.plan(snap)
        self.plans += 1
        if not plan.scheduled and not plan.admitted and not plan.preempted:
            self.fallback_steps += 1
            return super().step(now_s)
        self._steps += 1
        finished = self._pending_finished
        self._pending_finished = []
        self._note_budget(snap, plan)
        preempted = self._carry_preemptions(plan)
        chunks: list[tuple[_Req, int]] = []
        self._carry_scheduled(plan, chunks)
        self._carry_admitted(plan, chunks)
        items, emitted, pairs, tokens, kv, done, _ = self._apply_chunks(chunks)
        for r in done:
            self._running.remove(r)
            self._release(r)
            self._done(r)
            finished.append((r.rid, r.reason))
        self._tick += 1
        self._prefilling = list(self._running)
        self._gen_tokens += len(emitted)
        duration = self._duration(tokens, len(chunks), pairs, kv, items) if chunks else 0.0
        return StepResult(
            duration_s=duration,
            emitted=tuple(emitted),
            finished=tuple(finished),
            preempted=tuple(preempted),
            num_tokens=tokens,
            explicit=items,
            dec_ctx=(),
            dec_base=0,
        )

    def _note_budget(self, snap: Snapshot, plan: StepPlan) -> None:
        budget = snap.budget_s
        if budget is None:
            return
        offline_running = {r.request_id for r in snap.running if r.cls is _OFFLINE}
        offline_queued = {q.request_id for q in snap.offline_queue}
        n_off = sum(1 for a in plan.scheduled if a.request_id in offline_running)
        n_off += sum(1 for a in plan.admitted if a.request_id in offline_queued)
        self.skipped_offline += len(offline_running) - len(plan.preempted) - n_off
        if n_off:
            over = plan.predicted_step_s - budget
            self.max_offline_step_over_budget_s = max(self.max_offline_step_over_budget_s, over)

    def _carry_preemptions(self, plan: StepPlan) -> list[str]:
        out: list[str] = []
        for rid in plan.preempted:
            r = self._reqs.get(rid)
            if r is None or r.state is not RequestState.RUNNING:
                continue
            self._running.remove(r)
            self._prefilling.remove(r)
            self._preempt(r)
            out.append(rid)
        return out

    def _carry_scheduled(self, plan: StepPlan, chunks: list[tuple[_Req, int]]) -> None:
        pool, bs = self.pool, self._bs
        for adm in plan.scheduled:
            r = self._reqs.get(adm.request_id)
            if r is None or r.state is not RequestState.RUNNING:
                continue
            n = min(adm.tokens, r.prompt + r.generated - r.computed)
            if n <= 0:
                continue
            need = -(-(r.computed + n) // bs) - len(r.blocks)
            if need > pool.free:
                continue  # NOTE: the plan's KV estimate was short; the request waits a step
            if need > 0:
                pool.take(need)
                r.blocks.extend([None] * need)
            chunks.append((r, n))

    def _carry_admitted(self, plan: StepPlan, chunks: list[tuple[_Req, int]]) -> None:
        pool, bs = self.pool, self._bs
        max_seqs = self.limits.max_num_seqs
        for adm in plan.admitted:
            r = self._reqs.get(adm.request_id)
            if r is None or r.state is not RequestState.WAITING:
                continue
            if len(self._running) >= max_seqs:
                break
            num_tokens = r.prompt + r.generated
            hit_keys, evictable = self._hit_keys(r)
            hit = len(hit_keys) * bs
            n = min(adm.tokens, num_tokens - hit)
            if n <= 0:
                continue
            need = -(-(hit + n) // bs) - len(hit_keys)
            if need > pool.free - evictable:
                continue
            self._n_waiting -= 1  # its heap entry is dropped lazily
            self._start(r, hit_keys, need, num_tokens)
            chunks.append((r, n))
