"""Online-only steps: a step the plan is known for, taken as vLLM's own walk.

With no offline request in the engine, every waiting request fitting the free slots, and the
free KV blocks covering the most the walk can take, the planner's plan is vLLM's walk over the
online waiting queue in the ordering's rank order (every running request online, given its
tokens in running order; arrivals admitted in rank order up to the token cap; nobody
preempted or displaced). Such a step skips the snapshot and the plan
(:meth:`OnlineOnlyMixin._online_only_step`), and when the token cap takes every arrival whole
it skips ranking them too, so their lengths are predicted only if ranking comes to matter.
``tests/vllm/test_plugin_online_only.py`` holds these steps to planning's, step by step.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import Request

from slipstream_vllm.state import _State
from slipstream_vllm.steering import _pending


class OnlineOnlyMixin(_State):
    """When a step is online-only, and that step (module note)."""

    def _online_only(self) -> bool:
        """No offline request is in the engine, everything waiting fits the free slots, and
        the free KV blocks cover the most this walk can take (a block per running request,
        the token cap in blocks, and every waiting request's tokens in blocks, which covers
        its prefix-cache hits too): then the plan is vLLM's own walk over the online waiting
        queue in the ordering's order. Every request is online; the planner gives running
        requests their tokens first, in running order, as vLLM does, then admits in rank
        order up to the token cap, as vLLM's walk does over a queue in that order; with KV
        and slots to spare nobody is preempted or displaced. Only offline work and KV or
        slot shortage are the planner's choices. O(1) but for the waiting requests, and
        while offline requests are live: ``any`` stops at the first one vLLM holds."""
        if self.kv_holding_waiting:
            return False
        waiting = self.waiting
        if len(self.running) + len(waiting) > self.max_num_running_reqs:
            return False
        bs = self.block_size
        if not self._walk_fits(sum(-(-r.num_tokens // bs) for r in waiting)):
            return False
        ids = self._offline_ids
        if ids:
            if any(rid in self.requests for rid in ids):
                return False
            ids.clear()
        return True

    def _online_only_step(self, throttle_prefills: bool) -> SchedulerOutput:
        """A step with only online requests in the engine and KV and slots to spare
        (:meth:`_online_only`): vLLM's walk, without building the snapshot or planning,
        over the waiting requests in the ordering's order."""
        self.steps += 1
        self.online_only_steps += 1
        self._budget_in_force = self.budget_s if self.running else self._idle_budget()
        if not self.waiting:
            self._queue_counts = (0, 0, len(self.running), 0)
            self._walking = True
            out = super().schedule(throttle_prefills)
            self._walking = False
            return self._finish_schedule(out, None)
        self._stage = "ordering"
        waiting = list(self.waiting)
        if self.ordering.needs_lengths and self._all_admitted_whole(waiting):
            # Every arrival gets all its tokens this step, whatever the order: none is
            # ranked, so none has its lengths predicted now (only if ranking comes to matter).
            online_q = waiting
        else:
            online_q, _ = self._ordered_queues(waiting)
        self._queue_counts = (len(online_q), 0, len(self.running), 0)
        queue = FCFSRequestQueue()
        for req in online_q:
            queue.add_request(req)
        self._stage = "steer"
        saved = self.waiting
        self.waiting = queue
        try:
            self._walking = True
            out = super().schedule(throttle_prefills)
            self._walking = False
        finally:  # vLLM's queue again: what the walk left waiting, in vLLM's own order
            left = list(self.waiting)
            self.waiting = saved
            self._rebuild_waiting(left, [])
        return self._finish_schedule(out, None)

    def _all_admitted_whole(self, waiting: list[Request]) -> bool:
        """Whether the token cap covers every running request's pending tokens and every
        waiting request's, so that the walk admits all of them whole, in any order (slots and
        KV blocks are :meth:`_online_only`'s to check)."""
        room = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        for r in waiting:
            pending = r.num_tokens - r.num_computed_tokens
            if 0 < threshold < pending:
                return False  # chunked whatever the order: who goes first matters
            room -= pending
        if room < len(self.running):
            return False
        room -= sum(_pending(r) for r in self.running)
        return room >= 0
