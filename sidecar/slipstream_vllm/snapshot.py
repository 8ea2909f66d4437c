"""The planner's view of vLLM's state: a :class:`~slipstream_scheduler.types.Snapshot` of the
running requests, the ordered waiting queues (:mod:`~slipstream_vllm.ordering`), each queued
request's prefix-cache hit, the free KV blocks, and the budget in force (the idle budget when
no online request is in the engine).
"""

from __future__ import annotations

import math
import time

from vllm.v1.request import Request

from slipstream_scheduler.types import QueuedRequest, RequestClass, RunningRequest, Snapshot
from slipstream_vllm.state import _OFFLINE, _ONLINE, _State


class SnapshotMixin(_State):
    """Builds the step's :class:`~slipstream_scheduler.types.Snapshot` (module note)."""

    def _cached_tokens(self, req: Request) -> int:
        if req.num_computed_tokens > 0 or not self.cache_config.enable_prefix_caching:
            return int(req.num_computed_tokens)
        try:
            found = self.kv_cache_manager.coordinator.find_longest_cache_hit(
                req.block_hashes, req.num_tokens - 1
            )
            hit: int = found[1]
        except Exception:  # NOTE: a layout this lookup does not cover: assume no hit
            return 0
        return int(hit)

    def _running_view(self, r: Request, cls: RequestClass) -> RunningRequest:
        # With async scheduling a step may be in flight: its tokens are placeholders, already
        # counted in num_computed_tokens but not yet in num_tokens (vLLM's walk adds them back).
        inflight = int(getattr(r, "num_output_placeholders", 0))
        outputs = r.num_output_tokens + inflight
        if outputs >= 1 and r.num_tokens + inflight - r.num_computed_tokens == 1:  # decoding
            return RunningRequest(
                r.request_id,
                cls,
                r.num_prompt_tokens,
                r.num_prompt_tokens,
                outputs - 1,
                r.max_tokens,
                r.arrival_time,
                r.priority,
            )
        return RunningRequest(  # prefilling, or recomputing after a preemption
            r.request_id,
            cls,
            r.num_tokens + inflight,
            r.num_computed_tokens,
            0,
            r.max_tokens,
            r.arrival_time,
            r.priority,
        )

    def _queued_view(self, r: Request, cls: RequestClass) -> QueuedRequest:
        return QueuedRequest(
            r.request_id,
            cls,
            r.num_tokens,
            max(r.max_tokens - r.num_output_tokens, 1),
            r.arrival_time,
            cached_tokens=self._cached_tokens(r),
            already_generated=r.num_output_tokens,
        )

    def _idle_budget(self) -> float | None:
        """The budget with no online request in the engine: the idle budget when one is set
        (infinite: none), else the service's."""
        if not self.idle_budget_s:
            return self.budget_s
        return None if math.isinf(self.idle_budget_s) else self.idle_budget_s

    def _snapshot(self, online_q: list[Request], offline_q: list[Request]) -> Snapshot:
        running = tuple(self._running_view(r, self._class_of(r)) for r in self.running)
        window = self.planner.rules.queue_window
        online = tuple(self._queued_view(r, _ONLINE) for r in online_q[:window])
        offline = tuple(self._queued_view(r, _OFFLINE) for r in offline_q[:window])
        budget = self.budget_s
        if not online and all(q.cls is _OFFLINE for q in running):
            budget = self._idle_budget()
        self._budget_in_force = budget
        return Snapshot(
            time.time(),
            running,
            online,
            offline,
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            self.limits,
            budget,
        )
