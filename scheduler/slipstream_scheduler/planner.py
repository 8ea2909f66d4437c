"""HyGen's two-phase planner: online work first, offline work fills the latency budget.

Algorithm note (``research/algorithms.md`` §1.3, §1.9, §4.1)
------------------------------------------------------------
One plan is a pure function of a :class:`~slipstream_scheduler.types.Snapshot`.
It walks the work in a fixed order and keeps a
:class:`~slipstream_scheduler.latency.BatchFeatures` accumulator, so every
"does this still fit?" question is one O(1) model evaluation.

``PlannerMode.ITERATION`` (an engine's scheduler, Sarathi-style chunked prefill)
    Phase 1, online: running online decodes, then running online prefill
    chunks, then new online requests from the head of the online queue. Each
    prefill chunk is capped by ``long_prefill_token_threshold`` and by the
    tokens left under ``max_num_batched_tokens``. When KV blocks or sequence
    slots are short, running offline requests are preempted (lowest priority,
    latest arrival first, as vLLM picks its victim) and named in
    ``StepPlan.preempted``; the caller resumes them later as continuations, so
    nothing they produced is lost.
    Phase 2, offline: running offline decodes, running offline prefill
    chunks, then new offline requests, each added only while the predicted
    step stays within the budget. A prefill chunk is the largest that fits
    (``LinearLatencyModel.max_prefill_tokens``, HyGen's ``get_max_prefill``).
    The rule this guarantees: **offline work never takes the predicted step
    over the budget**. Online work is not held back by the budget unless
    ``online_chunks_in_budget`` is set (then each online prefill chunk is sized
    to the budget but still gets at least ``online_min_chunk_tokens``), so a
    plan may exceed the budget; when it does it holds no offline work at all.
    In ITERATION mode a short budget never preempts: offline requests that do
    not fit are simply not scheduled this step and keep their KV.

``PlannerMode.ADMISSION`` (the sidecar, outside the engine)
    The sidecar cannot choose chunks; it decides which queued requests to
    submit. The engine will run, in its worst iteration, every in-flight
    decode plus pending prefill chunks up to the token cap, so the planner
    predicts that *peak* iteration: each in-flight request counted as a
    steady-state decode (context = its current context, or its prompt while
    still in prefill) plus, for requests in prefill, their next chunk (clipped
    in order to the token cap). A candidate is admitted when the peak with its
    first chunk *and* its steady-state decode stays within the budget. That
    counts a prefilling request twice (chunk and decode), which is deliberately
    conservative by one decode token per prefilling request. Online requests
    are admitted without a budget check (holding them in the sidecar would only
    add queueing; the engine serves them first by priority); when slots or KV
    are then short, or online work is present and the peak exceeds the
    budget, in-flight offline requests are preempted (the sidecar aborts and
    later resumes them) until the peak fits; when the online part alone
    exceeds the budget (an online prefill chunk) every offline request goes,
    since offline work may never take the step over the budget. Offline
    decodes that fit next to online decodes stay. ``StepPlan.scheduled`` is
    empty.

Both modes look at no more than ``queue_window`` entries of each queue, stop at
the first queued request that cannot be admitted (queues are in policy order:
skipping ahead would break FCFS or PSM locality), and allocate little beyond
the output tuples (small lists of the requests still in prefill; decode
``Admission`` values are reused per request id).

Deliberately left out: ordering (the snapshot's queues arrive ordered),
choosing the budget (the profiler does), swapping KV to host memory, and any
clock: ``now_s`` is not read.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass
from itertools import islice

from slipstream_scheduler.latency import BatchFeatures, LinearLatencyModel
from slipstream_scheduler.types import (
    Admission,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
    StepPlan,
)

logger = logging.getLogger(__name__)

_ONLINE = RequestClass.ONLINE
_OFFLINE = RequestClass.OFFLINE
_INF = math.inf
_DECODE_CACHE_MAX = 16384


class PlannerMode(enum.Enum):
    """Where the plan is executed: inside the engine loop or at the sidecar's door."""

    ITERATION = "iteration"
    ADMISSION = "admission"


@dataclass(frozen=True, slots=True)
class FillRules:
    """The resolved knobs of one admission policy (built from its pydantic params).

    Defaults describe HyGen's budgeted policy.
    """

    admit_online: bool = True  # take new requests from the online queue
    admit_offline: bool = True  # take new requests from the offline queue
    offline_budgeted: bool = True  # offline work bounded by snapshot.budget_s
    online_chunks_in_budget: bool = False  # size online prefill chunks to the budget too
    online_min_chunk_tokens: int = 256  # floor for budget-sized online chunks, tokens
    offline_cap: int | None = None  # max offline requests in flight; None: no cap
    preempt_for_online: bool = True  # online may preempt running offline requests
    queue_window: int = 64  # queued requests looked at per queue and plan
    min_new_prefill_tokens: int = 16  # smallest first chunk worth admitting offline, tokens
    max_preemptions: int = 16  # preemptions per plan, at most


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Room:
    """KV blocks, sequence slots and the preemptions that made room, for one plan.

    Victims (running offline requests) are sorted only when first needed, in
    vLLM's order: the largest ``(priority, arrival)`` goes first.
    """

    __slots__ = ("_order", "bs", "free_kv", "max_preemptions", "preempted", "running", "slots")

    def __init__(self, s: Snapshot, max_preemptions: int) -> None:
        self.running = s.running
        self.bs = s.limits.block_size
        self.free_kv = s.free_kv_blocks
        self.slots = s.limits.max_num_seqs - len(s.running)
        self.max_preemptions = max_preemptions
        self.preempted: list[str] = []
        self._order: list[RunningRequest] | None = None

    def next_victim(self) -> RunningRequest | None:
        if len(self.preempted) >= self.max_preemptions:
            return None
        if self._order is None:
            self._order = [r for r in self.running if r.cls is _OFFLINE]
            self._order.sort(key=lambda r: (r.priority, r.arrival_s))
        if not self._order:
            return None
        victim = self._order.pop()
        self.preempted.append(victim.request_id)
        self.slots += 1
        return victim

    def preempt(self, blocks: int, slots: int = 0) -> None:
        """Preempt victims until ``blocks`` KV blocks and ``slots`` slots are free."""
        while self.free_kv < blocks or self.slots < slots:
            victim = self.next_victim()
            if victim is None:
                return
            self.free_kv += _blocks(victim.computed_tokens + victim.generated_tokens, self.bs)

    def fit_chunk(self, x: int, context: int, resident: int, *, preempt: bool) -> int:
        """Reserve KV for a chunk of ``x`` tokens after ``context`` (``resident``
        blocks already held); preempt for it if allowed, else shrink it."""
        bs = self.bs
        need = _blocks(context + x, bs) - resident
        if need > self.free_kv and preempt:
            self.preempt(need)
        if need > self.free_kv:
            x = (resident + self.free_kv) * bs - context
            if x <= 0:
                return 0
            need = _blocks(context + x, bs) - resident
        self.free_kv -= need
        return x


class TwoPhasePlanner:
    """The two-phase fill behind every admission policy (see the module note).

    ``model`` may be ``None`` for policies that use no budget; the plan's
    ``predicted_step_s`` is then 0.0. Implements the ``Planner`` protocol.
    """

    def __init__(
        self,
        name: str,
        rules: FillRules,
        model: LinearLatencyModel | None = None,
        mode: PlannerMode = PlannerMode.ITERATION,
    ) -> None:
        self.name = name
        self.rules = rules
        self.model = model
        self.mode = mode
        self._decode_admissions: dict[str, Admission] = {}

    def __repr__(self) -> str:
        return f"TwoPhasePlanner(name={self.name!r}, mode={self.mode.value}, rules={self.rules})"

    def plan(self, snapshot: Snapshot) -> StepPlan:
        if self.mode is PlannerMode.ITERATION:
            return self._plan_iteration(snapshot)
        return self._plan_admission(snapshot)

    # ------------------------------------------------------------------ helpers

    def _decode(self, request_id: str) -> Admission:
        # Admissions are immutable values; reusing the per-request decode one keeps
        # a 256-decode plan from building 256 new objects every step.
        adm = self._decode_admissions.get(request_id)
        if adm is None:
            if len(self._decode_admissions) >= _DECODE_CACHE_MAX:
                self._decode_admissions.clear()
            adm = Admission(request_id, 1)
            self._decode_admissions[request_id] = adm
        return adm

    def _budgets(self, snapshot: Snapshot) -> tuple[float, float, float | None]:
        """(offline budget, online budget, budget reported in the plan)."""
        budget = snapshot.budget_s
        rules = self.rules
        if budget is None or self.model is None or not rules.offline_budgeted:
            return _INF, _INF, None
        online = budget if rules.online_chunks_in_budget else _INF
        return budget, online, budget

    # ------------------------------------------------------------------ ITERATION

    def _plan_iteration(self, s: Snapshot) -> StepPlan:
        rules = self.rules
        model = self.model
        lim = s.limits
        bs = lim.block_size
        tokens_left = lim.max_num_batched_tokens
        chunk_limit = tokens_left
        if 0 < lim.long_prefill_token_threshold < chunk_limit:
            chunk_limit = lim.long_prefill_token_threshold
        offline_budget, online_budget, reported_budget = self._budgets(s)
        room = _Room(s, rules.max_preemptions)
        may_preempt = rules.preempt_for_online
        f = BatchFeatures()
        scheduled: list[Admission] = []
        admitted: list[Admission] = []
        online_prefilling: list[RunningRequest] = []
        offline_prefilling: list[RunningRequest] = []
        offline_running = 0
        decode = self._decode

        # Phase 1a: running online decodes (and sort out who is where).
        for r in s.running:
            if r.cls is not _ONLINE:
                offline_running += 1
                if r.computed_tokens < r.prompt_tokens:
                    offline_prefilling.append(r)
                continue
            if r.computed_tokens < r.prompt_tokens:
                online_prefilling.append(r)
                continue
            if tokens_left <= 0:
                continue
            ctx = r.computed_tokens + r.generated_tokens
            if ctx % bs == 0:  # the new token opens a block
                if room.free_kv < 1 and may_preempt:
                    room.preempt(1)
                if room.free_kv < 1:
                    continue  # NOTE: the engine would preempt this online request itself
                room.free_kv -= 1
            f.add_decode(1, ctx)
            tokens_left -= 1
            scheduled.append(decode(r.request_id))

        # Phase 1b: running online prefill chunks.
        for r in online_prefilling:
            if tokens_left <= 0:
                break
            computed = r.computed_tokens
            want = min(r.prompt_tokens - computed, chunk_limit, tokens_left)
            x = self._online_chunk(f, computed, want, online_budget)
            x = room.fit_chunk(x, computed, _blocks(computed, bs), preempt=may_preempt)
            if x <= 0:
                continue
            f.add_prefill(x, computed)
            tokens_left -= x
            scheduled.append(Admission(r.request_id, x))

        # Phase 1c: new online requests, in queue order.
        if rules.admit_online:
            for q in islice(s.online_queue, rules.queue_window):
                if tokens_left <= 0:
                    break
                if room.slots <= 0 and may_preempt:
                    room.preempt(0, slots=1)
                if room.slots <= 0:
                    break
                ctx0 = _first_context(q)
                want = min(q.prompt_tokens - ctx0, chunk_limit, tokens_left)
                x = self._online_chunk(f, ctx0, want, online_budget)
                x = room.fit_chunk(x, ctx0, ctx0 // bs, preempt=may_preempt)
                if x <= 0:
                    break
                f.add_prefill(x, ctx0)
                tokens_left -= x
                room.slots -= 1
                admitted.append(Admission(q.request_id, x))

        # Phase 2: offline work, only while the predicted step stays within budget.
        budget = offline_budget
        bounded = model is not None and budget < _INF
        skip = set(room.preempted) if room.preempted else None
        if bounded and model is not None and model.predict_features(f) > budget:
            tokens_left = 0  # online work alone fills (or overfills) the step
        if tokens_left > 0:
            # 2a: running offline decodes.
            for r in s.running:
                if tokens_left <= 0:
                    break
                if r.cls is _ONLINE or r.computed_tokens < r.prompt_tokens:
                    continue
                if skip is not None and r.request_id in skip:
                    continue
                ctx = r.computed_tokens + r.generated_tokens
                if bounded and model is not None and model.predict_with_decode(f, ctx) > budget:
                    break  # NOTE: later decodes would not fit either (bounded effort)
                if ctx % bs == 0:
                    if room.free_kv < 1:
                        continue
                    room.free_kv -= 1
                f.add_decode(1, ctx)
                tokens_left -= 1
                scheduled.append(decode(r.request_id))
            # 2b: running offline prefill chunks.
            for r in offline_prefilling:
                if tokens_left <= 0:
                    break
                if skip is not None and r.request_id in skip:
                    continue
                computed = r.computed_tokens
                want = min(r.prompt_tokens - computed, chunk_limit, tokens_left)
                x = self._offline_chunk(f, computed, want, budget)
                x = room.fit_chunk(x, computed, _blocks(computed, bs), preempt=False)
                if x <= 0:
                    break
                f.add_prefill(x, computed)
                tokens_left -= x
                scheduled.append(Admission(r.request_id, x))
            # 2c: new offline requests, in queue (PSM/FCFS) order.
            if rules.admit_offline:
                in_flight = offline_running - len(room.preempted)
                cap = rules.offline_cap
                for q in islice(s.offline_queue, rules.queue_window):
                    if tokens_left <= 0 or room.slots <= 0:
                        break
                    if cap is not None and in_flight >= cap:
                        break
                    ctx0 = _first_context(q)
                    remaining = q.prompt_tokens - ctx0
                    want = min(remaining, chunk_limit, tokens_left)
                    x = self._offline_chunk(f, ctx0, want, budget)
                    if x <= 0 or x < min(remaining, rules.min_new_prefill_tokens):
                        break
                    x = room.fit_chunk(x, ctx0, ctx0 // bs, preempt=False)
                    if x <= 0:
                        break
                    f.add_prefill(x, ctx0)
                    tokens_left -= x
                    room.slots -= 1
                    in_flight += 1
                    admitted.append(Admission(q.request_id, x))

        predicted = model.predict_features(f) if model is not None and f.tokens else 0.0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "plan %s: scheduled=%s admitted=%s preempted=%s tokens=%s predicted=%.6f",
                self.name,
                len(scheduled),
                len(admitted),
                len(room.preempted),
                f.tokens,
                predicted,
            )
        return StepPlan(
            scheduled=tuple(scheduled),
            admitted=tuple(admitted),
            preempted=tuple(room.preempted),
            predicted_step_s=predicted,
            budget_s=reported_budget,
        )

    def _online_chunk(self, f: BatchFeatures, context: int, want: int, budget: float) -> int:
        if want <= 0 or budget == _INF or self.model is None:
            return want
        x = self.model.max_prefill_tokens(f, context, budget, want)
        # NOTE: the budget never stops online progress; below the floor it is exceeded.
        return max(x, min(want, self.rules.online_min_chunk_tokens))

    def _offline_chunk(self, f: BatchFeatures, context: int, want: int, budget: float) -> int:
        if want <= 0 or budget == _INF or self.model is None:
            return want
        return self.model.max_prefill_tokens(f, context, budget, want)

    # ------------------------------------------------------------------ ADMISSION

    def _plan_admission(self, s: Snapshot) -> StepPlan:
        rules = self.rules
        model = self.model
        lim = s.limits
        bs = lim.block_size
        cap_tokens = lim.max_num_batched_tokens
        chunk_limit = cap_tokens
        if 0 < lim.long_prefill_token_threshold < chunk_limit:
            chunk_limit = lim.long_prefill_token_threshold
        budget, _, reported_budget = self._budgets(s)
        room = _Room(s, rules.max_preemptions)

        # The peak iteration: every in-flight request as a decode (sums kept in
        # locals, online and offline apart), then in-flight prefill chunks.
        prefilling: list[RunningRequest] = []
        on_n = on_ctx = off_n = off_ctx = 0
        for r in s.running:
            computed = r.computed_tokens
            if computed < r.prompt_tokens:
                prefilling.append(r)
                ctx = r.prompt_tokens
            else:
                ctx = computed + r.generated_tokens
            if r.cls is _ONLINE:
                on_n += 1
                on_ctx += ctx
            else:
                off_n += 1
                off_ctx += ctx
        f = BatchFeatures()
        f.n_d = f.s_d_tok = f.tokens = on_n + off_n
        f.s_d_ctx = on_ctx + off_ctx
        f_off = BatchFeatures()  # the offline part of the peak
        f_off.n_d = f_off.s_d_tok = f_off.tokens = off_n
        f_off.s_d_ctx = off_ctx
        chunks: dict[str, int] = {}
        for r in prefilling:
            x = min(r.prompt_tokens - r.computed_tokens, chunk_limit, cap_tokens - f.tokens)
            if x > 0:
                f.add_prefill(x, r.computed_tokens)
                if r.cls is not _ONLINE:
                    f_off.add_prefill(x, r.computed_tokens)
                chunks[r.request_id] = x
        online_present = on_n > 0

        def preempt_one() -> bool:
            """Preempt the next victim and take it out of the peak."""
            victim = room.next_victim()
            if victim is None:
                return False
            for g in (f, f_off):
                if victim.computed_tokens < victim.prompt_tokens:
                    g.remove_decode(1, victim.prompt_tokens)
                    x = chunks.get(victim.request_id, 0)
                    if x:
                        g.remove_prefill(x, victim.computed_tokens)
                else:
                    g.remove_decode(1, victim.computed_tokens + victim.generated_tokens)
            room.free_kv += _blocks(victim.computed_tokens + victim.generated_tokens, bs)
            return True

        admitted: list[Admission] = []
        may_preempt = rules.preempt_for_online
        if rules.admit_online:
            for q in islice(s.online_queue, rules.queue_window):
                prompt = q.prompt_tokens
                ctx0 = q.cached_tokens if q.cached_tokens < prompt else prompt - 1
                need = _blocks(prompt + 1, bs) - ctx0 // bs
                while (room.slots <= 0 or need > room.free_kv) and may_preempt:
                    if not preempt_one():
                        break
                if room.slots <= 0 or need > room.free_kv:
                    break
                first = prompt - ctx0
                first = min(first, chunk_limit)
                x = cap_tokens - f.tokens
                x = min(x, first)
                if x > 0:
                    f.add_prefill(x, ctx0)
                f.add_decode(1, prompt)
                room.free_kv -= need
                room.slots -= 1
                online_present = True
                admitted.append(Admission(q.request_id, first))

        bounded = model is not None and budget < _INF
        if bounded and model is not None and online_present and may_preempt:
            # Offline work never takes the predicted peak over the budget: preempt
            # offline requests until the peak fits, or until none is left when the
            # online work alone exceeds the budget (an online prefill chunk): every
            # offline token in that step would delay the online request further.
            limit = max(budget, model.predict_features(f.minus(f_off)))
            while f_off.tokens and model.predict_features(f) > limit:
                if not preempt_one():
                    break

        if rules.admit_offline and not (
            bounded and model is not None and model.predict_features(f) > budget
        ):
            in_flight = off_n - len(room.preempted)
            cap = rules.offline_cap
            for q in islice(s.offline_queue, rules.queue_window):
                if room.slots <= 0 or (cap is not None and in_flight >= cap):
                    break
                prompt = q.prompt_tokens
                ctx0 = q.cached_tokens if q.cached_tokens < prompt else prompt - 1
                need = _blocks(prompt + 1, bs) - ctx0 // bs
                if need > room.free_kv:
                    break
                first = prompt - ctx0
                first = min(first, chunk_limit)
                x = cap_tokens - f.tokens
                x = min(x, first)
                if x > 0:
                    f.add_prefill(x, ctx0)
                f.add_decode(1, prompt)
                if bounded and model is not None and model.predict_features(f) > budget:
                    f.remove_decode(1, prompt)
                    if x > 0:
                        f.remove_prefill(x, ctx0)
                    break
                room.free_kv -= need
                room.slots -= 1
                in_flight += 1
                admitted.append(Admission(q.request_id, first))

        predicted = model.predict_features(f) if model is not None and f.tokens else 0.0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "admission %s: in_flight=%s admitted=%s preempted=%s peak=%.6f",
                self.name,
                len(s.running),
                len(admitted),
                len(room.preempted),
                predicted,
            )
        return StepPlan(
            scheduled=(),
            admitted=tuple(admitted),
            preempted=tuple(room.preempted),
            predicted_step_s=predicted,
            budget_s=reported_budget,
        )


def _first_context(q: QueuedRequest) -> int:
    """Tokens already in KV when a queued request starts (its prefix-cache hit).

    Only full blocks are shared by prefix caching, so the hit is rounded down
    to the block size by the caller's cache model; here it is only bounded: at
    least one prompt token is always computed (the engine needs the last
    position's logits), so a fully cached prompt still costs a 1-token chunk.
    """
    return max(0, min(q.cached_tokens, q.prompt_tokens - 1))
