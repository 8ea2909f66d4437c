"""Steering vLLM's own walk to the planner's plan, and online displacement.

The plan's preemptions are made with vLLM's ``_preempt_request`` (recompute: the request keeps
every token it produced and resumes); running offline requests the plan leaves out are hidden
from the walk for this iteration (they keep their KV); the waiting queue the walk sees holds
exactly the plan's admissions, online first, in plan order; the token budget is the plan's
token total; and vLLM's ``schedule()`` then allocates blocks and builds the output as always
(:meth:`SteeringMixin._steer`). Under a preemptive ordering, or past the tail guard's deadline,
the best waiting online request may displace running online requests it outranks
(:meth:`SteeringMixin._displace_for`); in every walk, running online requests are ranked by
the ordering (:meth:`SteeringMixin._ranked_online`).

Approximations (NOTE: where this bends the plan):

* when the plan admits an online request, running offline prefill chunks are held back for
  that iteration (vLLM walks running requests before waiting ones, so an offline chunk would
  otherwise take the online request's tokens); counted as ``offline_deferred_chunks``;
* a plan that schedules nothing while there is work (KV exhausted, or an idle budget below the
  cheapest offline step) falls back to vLLM's own walk for that iteration, as the simulator's
  in-engine mode does (``fallback_steps``, in ``_Slipstream._slipstream_step``);
* chunk sizes follow from the token total and the walk's order, so vLLM's per-request
  ``long_prefill_token_threshold`` rules (off when one request is eligible) still apply.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, create_request_queue
from vllm.v1.request import Request, RequestStatus

from slipstream_scheduler.tailguard import GUARD_MAX_DISPLACEMENTS
from slipstream_scheduler.types import Snapshot, StepPlan
from slipstream_vllm.state import _ONLINE, _State


def _pending(req: Request) -> int:
    """Tokens the request has yet to compute, counting a token in flight (async scheduling)
    as computed, as vLLM's walk does."""
    return int(req.num_tokens + getattr(req, "num_output_placeholders", 0)
               - req.num_computed_tokens)


class SteeringMixin(_State):
    """vLLM's walk steered to the plan, and online displacement (module note)."""

    # ------------------------------------------------------------------ online preemption

    def _displace_for(self, head: Request, snap: Snapshot, plan: StepPlan) -> bool:
        """A preemptive ordering's displacement: when the best waiting online request is held
        out by KV blocks or slots (not by this step's tokens), preempt the running online
        requests it outranks (``Ordering.may_preempt``, worst key first) if together they free
        enough for its first chunk; recompute, as vLLM preempts. True if any was preempted."""
        rid = head.request_id
        if any(a.request_id == rid for a in plan.admitted) or not snap.online_queue:
            return False
        q = snap.online_queue[0]
        if q.request_id != rid:
            return False
        bs = self.block_size
        ctx0 = min(q.cached_tokens, q.prompt_tokens - 1)
        limit = self.limits.long_prefill_token_threshold or self.limits.max_num_batched_tokens
        chunk = min(q.prompt_tokens - ctx0, limit, self.limits.max_num_batched_tokens)
        need = -(-(ctx0 + chunk) // bs) - ctx0 // bs
        free = snap.free_kv_blocks
        slot_short = len(self.running) >= self.max_num_running_reqs
        if free >= need and not slot_short:
            return False  # held back by the step's tokens or budget: it runs soon anyway
        meta = self._meta.get(rid)
        now_g = self.clock()
        overdue = self._overdue(head, now_g)
        if meta is None or not (overdue or self.ordering.preemptive):
            return False
        head_key = self._online_key(head, meta)
        ranked = sorted(
            (
                (self._online_key(r, m), r, m)
                for r in self.running
                if (m := self._meta.get(r.request_id)) is not None and m.cls is _ONLINE
                and not self._overdue(r, now_g)
            ),
            key=lambda t: (-t[0], -t[1].arrival_time),
        )
        victims: list[Request] = []
        freed = 0
        for key, r, m in ranked:
            if free + freed >= need and (victims or not slot_short):
                break
            if overdue:  # the guard's displacement: any request not past its own deadline,
                if int(getattr(r, "num_preemptions", 0)) >= GUARD_MAX_DISPLACEMENTS:
                    continue  # at most once each
            elif not self.ordering.may_preempt(head_key, self._online_view(r, m), key):
                continue
            victims.append(r)
            freed += -(-r.num_computed_tokens // bs)
        if not victims or free + freed < need:
            return False
        now = time.monotonic()
        for r in victims:
            self.online_displaced_tokens += int(r.num_computed_tokens)
            self.running.remove(r)
            self._preempt_request(r, now)
            self.online_displacements += 1
        return True

    def _walk_fits(self, blocks_touched: int = 0) -> bool:
        """Whether the free KV blocks cover the most one walk of vLLM's can take: the token
        cap in blocks, a partly filled block per running and waiting request, and
        ``blocks_touched`` more (cached blocks a caller knows the walk may take up)."""
        most = (self.max_num_scheduled_tokens // self.block_size + len(self.running)
                + len(self.waiting) + 1 + blocks_touched)
        return bool(self.kv_cache_manager.block_pool.get_num_free_blocks() >= most)

    @contextlib.contextmanager
    def _ranked_online(self, *, plan_fits: bool = False) -> Iterator[None]:
        """For one walk of vLLM's, running online requests carry their rank in the ordering
        as their priority (client priority first, then key, then arrival), so the request
        vLLM preempts when KV runs out (the largest priority) is the ordering's last, and the
        walk gives blocks in rank order. Priorities are restored afterwards.

        ``plan_fits``: the walk's token cap is the plan's own total, so every running request
        gets its tokens in any order; then the ranking matters only if the walk can run out
        of KV blocks, and is skipped when the free blocks cover the most this walk can take
        (a block per request plus the cap's tokens in blocks)."""
        if plan_fits and self._walk_fits():
            yield
            return
        try:
            now = self.clock()
            online = [
                (int(r.priority), self._rank(r, m, now), r)
                for r in self.running
                if (m := self._meta.get(r.request_id)) is not None and m.cls is _ONLINE
            ]
        except Exception as exc:  # NOTE: the ordering at fault: vLLM's order for this walk
            self._guard.record("ordering", exc)
            online = []
        if len(online) < 2:
            yield
            return
        online.sort(key=lambda t: t[:2])
        saved = [(r, r.priority) for *_, r in online]
        rank_of = {id(r): i for i, (*_, r) in enumerate(online)}
        for i, (*_, r) in enumerate(online):
            r.priority = i
        self.running.sort(key=lambda r: rank_of.get(id(r), len(rank_of)))
        try:
            yield
        finally:
            for r, p in saved:
                r.priority = p

    def _steer(
        self, plan: StepPlan, snap: Snapshot, waiting: list[Request], throttle: bool
    ) -> SchedulerOutput:
        """vLLM's walk steered to ``plan`` (module note): the plan's preemptions, then the
        walk's running requests and waiting queue, then the walk itself."""
        self._preempt_planned(plan)
        waiting_by_id = {r.request_id: r for r in self.waiting}
        admitted = [
            waiting_by_id[a.request_id] for a in plan.admitted if a.request_id in waiting_by_id
        ]
        online_admit = any(self._class_of(r) is _ONLINE for r in admitted)
        planned = {a.request_id: a.tokens for a in plan.scheduled}
        cap = sum(planned.values()) + sum(a.tokens for a in plan.admitted)
        walk_running, hidden, cap = self._split_running(planned, cap, online_admit)
        queue = FCFSRequestQueue()
        for req in admitted:
            queue.add_request(req)
        admitted_ids = {a.request_id for a in plan.admitted}
        rest = [r for r in waiting if r.request_id not in admitted_ids]
        out = self._steered_walk(
            plan, throttle, running=walk_running, queue=queue, hidden=hidden, rest=rest, cap=cap
        )
        return out

    def _preempt_planned(self, plan: StepPlan) -> None:
        """The plan's preemptions, with vLLM's ``_preempt_request`` (recompute)."""
        now = time.monotonic()
        by_id = {r.request_id: r for r in self.running}
        for rid in plan.preempted:
            req = by_id.pop(rid, None)
            if req is None:
                continue
            self.running.remove(req)
            self._preempt_request(req, now)
            self.offline_preemptions += 1

    def _split_running(
        self, planned: dict[str, int], cap: int, online_admit: bool
    ) -> tuple[list[Request], list[Request], int]:
        """The running requests the walk sees (online, then offline decodes, then offline
        prefill chunks), those hidden from it (offline requests the plan leaves out, and
        offline chunks held back for an admitted online request), and the token cap less the
        held-back chunks' tokens."""
        online_run: list[Request] = []
        off_decode: list[Request] = []
        off_prefill: list[Request] = []
        hidden: list[Request] = []
        for req in self.running:
            if self._class_of(req) is _ONLINE:
                online_run.append(req)
                continue
            n = planned.get(req.request_id)
            if n is None:
                hidden.append(req)
            elif _pending(req) <= 1:
                off_decode.append(req)
            elif online_admit:
                hidden.append(req)
                cap -= n
                self.offline_deferred_chunks += 1
            else:
                off_prefill.append(req)
        return online_run + off_decode + off_prefill, hidden, cap

    def _steered_walk(
        self,
        plan: StepPlan,
        throttle: bool,
        *,
        running: list[Request],
        queue: FCFSRequestQueue,
        hidden: list[Request],
        rest: list[Request],
        cap: int,
    ) -> SchedulerOutput:
        """vLLM's ``schedule()`` over ``running`` and the waiting ``queue`` with at most
        ``cap`` tokens; afterwards, whatever happened, vLLM's queues hold every request again
        (``hidden`` back in the running list, ``rest`` and what the walk left in the waiting
        queue)."""
        saved_waiting, saved_cap = self.waiting, self.max_num_scheduled_tokens
        # A lone online request may be planned a chunk past the threshold (the planner lifts
        # it as vLLM does for a request with nobody to starve); vLLM would cut it back as soon
        # as offline work shares the step, so the threshold follows the plan for this walk.
        sc = self.scheduler_config
        saved_threshold = sc.long_prefill_token_threshold
        widest = max(
            (
                a.tokens
                for a in (*plan.scheduled, *plan.admitted)
                if self._is_online_id(a.request_id)
            ),
            default=0,
        )
        # From here to the walk's end vLLM's queues are rearranged; the finally undoes it.
        self.running = running
        self.waiting = queue
        self.max_num_scheduled_tokens = max(min(cap, saved_cap), 1)
        try:
            if 0 < saved_threshold < widest:
                sc.long_prefill_token_threshold = widest
            with self._ranked_online(plan_fits=True):
                self._walking = True
                out = super().schedule(throttle)
                self._walking = False
        finally:
            # Whatever happened in the walk, vLLM's queues hold every request again.
            left = list(self.waiting)  # admissions not taken, and the walk's own preemptions
            self.waiting = saved_waiting
            self.max_num_scheduled_tokens = saved_cap
            sc.long_prefill_token_threshold = saved_threshold
            self.running.extend(hidden)
            self._rebuild_waiting(left, rest)
        return out

    def _is_online_id(self, request_id: str) -> bool:
        meta = self._meta.get(request_id)
        return meta is None or meta.cls is _ONLINE

    def _psm_taken(self, request_id: str) -> None:
        if request_id in self._psm:
            self._psm.take(request_id)

    def _rebuild_waiting(self, left: list[Request], rest: list[Request]) -> None:
        q = create_request_queue(self.policy)
        seen: set[str] = set()
        for req in [*left, *rest, *self.waiting]:
            if req.request_id in seen or req.status == RequestStatus.RUNNING:
                continue
            if req.is_finished():
                continue
            seen.add(req.request_id)
            q.add_request(req)
        self.waiting = q
