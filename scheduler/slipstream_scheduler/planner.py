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
    ``offline_step_tokens`` caps the offline tokens of a step (HyGen*'s static
    cap at step granularity: no latency model, a fixed token count). A lone
    online request (no other online request running or waiting) may take the
    whole token cap as its chunk, as vLLM gives a request with nobody to starve:
    the chunk threshold protects other requests' decodes, and offline requests
    have no latency to protect.

``PlannerMode.ADMISSION`` (the sidecar, outside the engine)
    The sidecar cannot choose chunks; it decides which queued requests to
    submit. The engine will run, in its worst iteration, every in-flight
    decode plus pending prefill chunks up to the token cap, so the planner
    predicts that *peak* iteration: each in-flight request counted as a
    steady-state decode (context = its current context, or its prompt while
    still in prefill) plus, for requests in prefill, their next chunk (clipped
    in order to the token cap). The input is :class:`InFlight` (running sums
    the dispatcher keeps incrementally, :meth:`TwoPhasePlanner.plan_in_flight`)
    or a snapshot (one pass builds the sums).

    * **Pricing a candidate.** A queued request is priced exactly as the next
      plan will price it once in flight: its *last* chunk (context = prompt
      minus one chunk, never below its expected prefix-cache hit) plus its
      steady-state decode. Pricing the first chunk (context 0) admitted
      requests that the next plan found over the budget and preempted, then
      admitted again: the admit/abort ping-pong behind the demo's 86,299
      offline aborts.
    * **Online** requests are admitted without a budget check (holding them
      in the sidecar would only add queueing; the engine serves them first by
      priority). When slots or KV are short, in-flight offline requests are
      preempted, **cheapest first** (in prefill first, since a chunk costs as
      much as a hundred decodes and its progress is unknown; then the fewest
      tokens held; then the latest arrival). An online request that still does
      not fit stops the online queue, and then no offline request is admitted
      in that plan (the room its preemptions freed is the online request's).
    * **Preemption for the budget.** With online work present and the peak
      over the budget, offline requests are preempted cheapest first until it
      fits. When the online part alone exceeds the budget (an online prefill
      chunk) every offline request goes (HyGen's rule); with
      ``keep_offline_margin`` offline work may instead add to that step what
      the budget leaves it beside the online decodes (fewer aborts, longer
      online prefill steps: off by default, see ``docs/reliability.md``).
    * **Offline** candidates are admitted while the peak stays within the
      budget, except by the **progress rule**: on an idle engine (nothing in
      flight) one offline request is admitted even if its chunk alone exceeds
      the budget; otherwise a budget below one prefill chunk would stall the
      offline queue for good.

    ``StepPlan.scheduled`` is empty.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

from slipstream_scheduler.latency import BatchFeatures, LinearLatencyModel
from slipstream_scheduler.types import (
    Admission,
    EngineLimits,
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
    offline_step_tokens: int | None = None  # ITERATION: offline tokens per step; None: no cap
    preempt_for_online: bool = True  # online may preempt running offline requests
    queue_window: int = 64  # queued requests looked at per queue and plan
    min_new_prefill_tokens: int = 16  # smallest first chunk worth admitting offline, tokens
    max_preemptions: int = 16  # preemptions per plan, at most
    keep_offline_margin: bool = False  # ADMISSION: see TwoPhasePlanner.plan_in_flight


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class _Room:
    """KV blocks, sequence slots and the preemptions that made room, for one plan.

    Victims (running offline requests, from ``offline``) are sorted only when
    first needed: in vLLM's order (the largest ``(priority, arrival)`` first) for
    ITERATION mode, cheapest first for ADMISSION mode (:func:`_cheapest_last`).
    """

    __slots__ = (
        "_offline",
        "_order",
        "bs",
        "cheapest_first",
        "free_kv",
        "max_preemptions",
        "preempted",
        "reserve_full",
        "slots",
    )

    def __init__(
        self,
        offline: Callable[[], Iterable[RunningRequest]],
        free_kv: int,
        limits: EngineLimits,
        max_preemptions: int,
        *,
        count: int,
        cheapest_first: bool = False,
    ) -> None:
        self._offline = offline
        self.bs = limits.block_size
        self.free_kv = free_kv
        self.slots = limits.max_num_seqs - count
        self.reserve_full = limits.reserve_full_sequence
        self.max_preemptions = max_preemptions
        self.cheapest_first = cheapest_first
        self.preempted: list[str] = []
        self._order: list[RunningRequest] | None = None

    def next_victim(self) -> RunningRequest | None:
        if len(self.preempted) >= self.max_preemptions:
            return None
        if self._order is None:
            self._order = list(self._offline())
            if self.cheapest_first:
                self._order.sort(key=_cheapest_last)
            else:
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
        return self._budgets_of(snapshot.budget_s)

    def _budgets_of(self, budget: float | None) -> tuple[float, float, float | None]:
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
        offline_budget, online_budget, reported_budget = self._budgets(s)
        running = s.running
        room = _Room(
            lambda: (r for r in running if r.cls is _OFFLINE),
            s.free_kv_blocks,
            lim,
            rules.max_preemptions,
            count=len(running),
        )
        fill = _StepFill(lim.max_num_batched_tokens, _chunk_limit(lim), room)
        may_preempt = rules.preempt_for_online
        f = fill.f
        online_prefilling: list[RunningRequest] = []
        offline_prefilling: list[RunningRequest] = []
        offline_running = 0
        online_decoding = 0
        decode = self._decode
        scheduled = fill.scheduled

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
            online_decoding += 1
            if fill.tokens_left <= 0:
                continue
            ctx = r.computed_tokens + r.generated_tokens
            if ctx % bs == 0:  # the new token opens a block
                if room.free_kv < 1 and may_preempt:
                    room.preempt(1)
                if room.free_kv < 1:
                    continue  # NOTE: the engine would preempt this online request itself
                room.free_kv -= 1
            f.add_decode(1, ctx)
            fill.tokens_left -= 1
            scheduled.append(decode(r.request_id))

        # Phase 1b, 1c: running online prefill chunks, then new online requests. A lone
        # online request (no other online request running or waiting) may take the whole
        # token cap, as vLLM gives a lone request: the chunk threshold protects other
        # requests' decodes, and offline ones have no latency to protect.
        online_waiting = len(s.online_queue) if rules.admit_online else 0
        if not online_decoding and len(online_prefilling) + online_waiting == 1:
            fill.chunk_limit = lim.max_num_batched_tokens
        self._fill_prefilling(fill, online_prefilling, online_budget, online=True)
        if rules.admit_online:
            self._fill_queue(fill, s.online_queue, online_budget, online=True)
        fill.chunk_limit = _chunk_limit(lim)

        # Phase 2: offline work, only while the predicted step stays within budget.
        budget = offline_budget
        bounded = model is not None and budget < _INF
        if bounded and model is not None and model.predict_features(f) > budget:
            fill.tokens_left = 0  # online work alone fills (or overfills) the step
        step_cap = rules.offline_step_tokens
        tokens_after_offline = 0
        if step_cap is not None and fill.tokens_left > step_cap:
            tokens_after_offline = fill.tokens_left - step_cap
            fill.tokens_left = step_cap
        if fill.tokens_left > 0:
            skip = set(room.preempted) if room.preempted else None
            # 2a: running offline decodes.
            for r in s.running:
                if fill.tokens_left <= 0:
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
                fill.tokens_left -= 1
                scheduled.append(decode(r.request_id))
            # 2b, 2c: running offline prefill chunks, then new offline requests.
            if skip is not None:
                offline_prefilling = [r for r in offline_prefilling if r.request_id not in skip]
            self._fill_prefilling(fill, offline_prefilling, budget, online=False)
            if rules.admit_offline and not fill.online_blocked:
                fill.offline_in_flight = offline_running - len(room.preempted)
                self._fill_queue(fill, s.offline_queue, budget, online=False)
        fill.tokens_left += tokens_after_offline

        predicted = model.predict_features(f) if model is not None and f.tokens else 0.0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "plan %s: scheduled=%s admitted=%s preempted=%s tokens=%s predicted=%.6f",
                self.name,
                len(scheduled),
                len(fill.admitted),
                len(room.preempted),
                f.tokens,
                predicted,
            )
        return StepPlan(
            scheduled=tuple(scheduled),
            admitted=tuple(fill.admitted),
            preempted=tuple(room.preempted),
            predicted_step_s=predicted,
            budget_s=reported_budget,
        )

    def _chunk(self, f: BatchFeatures, context: int, want: int, budget: float, online: bool) -> int:
        """The prefill chunk of ``want`` tokens at most that the budget allows."""
        if want <= 0 or budget == _INF or self.model is None:
            return want
        x = self.model.max_prefill_tokens(f, context, budget, want)
        if online:
            # NOTE: the budget never stops online progress; below the floor it is exceeded.
            return max(x, min(want, self.rules.online_min_chunk_tokens))
        return x

    def _fill_prefilling(
        self, fill: _StepFill, prefilling: list[RunningRequest], budget: float, *, online: bool
    ) -> None:
        """Phases 1b/2b: the next chunk of each running request still in prefill.

        Online chunks may preempt offline work for KV and skip a request that gets
        nothing; offline chunks never preempt and stop at the first that gets nothing.
        """
        f, room, bs = fill.f, fill.room, fill.room.bs
        preempt = online and self.rules.preempt_for_online
        for r in prefilling:
            if fill.tokens_left <= 0:
                break
            computed = r.computed_tokens
            want = min(r.prompt_tokens - computed, fill.chunk_limit, fill.tokens_left)
            x = self._chunk(f, computed, want, budget, online)
            x = room.fit_chunk(x, computed, _blocks(computed, bs), preempt=preempt)
            if x <= 0:
                if online:
                    continue
                break
            f.add_prefill(x, computed)
            fill.tokens_left -= x
            fill.scheduled.append(Admission(r.request_id, x))

    def _fill_queue(
        self, fill: _StepFill, queue: Sequence[QueuedRequest], budget: float, *, online: bool
    ) -> None:
        """Phases 1c/2c: first chunks of new requests, in queue order, until one does not fit.

        Online requests may preempt offline work for a slot or KV; offline ones obey
        the offline cap and ``min_new_prefill_tokens``, and never preempt. Under
        ``reserve_full_sequence`` (vLLM's default) a request is admitted only if its whole
        sequence, less its cached blocks, fits in the free blocks, as vLLM admits it: a
        plan that admitted on its first chunk alone would be refused by the engine.
        """
        rules = self.rules
        f, room, bs = fill.f, fill.room, fill.room.bs
        full_gate = room.reserve_full
        preempt = online and rules.preempt_for_online
        cap = None if online else rules.offline_cap
        min_first = rules.min_new_prefill_tokens  # a per-step cap below it still admits
        if rules.offline_step_tokens is not None:
            min_first = min(min_first, rules.offline_step_tokens)
        for q in islice(queue, rules.queue_window):
            if fill.tokens_left <= 0:
                break
            if room.slots <= 0 and preempt:
                room.preempt(0, slots=1)
            if room.slots <= 0:
                break
            if cap is not None and fill.offline_in_flight >= cap:
                break
            ctx0 = _first_context(q)
            remaining = q.prompt_tokens - ctx0
            want = min(remaining, fill.chunk_limit, fill.tokens_left)
            x = self._chunk(f, ctx0, want, budget, online)
            if not online and (x <= 0 or x < min(remaining, min_first)):
                break
            if full_gate:
                whole = _blocks(q.prompt_tokens, bs) - ctx0 // bs
                if whole > room.free_kv and preempt:
                    room.preempt(whole)
                if whole > room.free_kv:
                    # As vLLM's walk stops at the first request it cannot admit: no
                    # offline request takes the blocks this online one waits for.
                    fill.online_blocked |= online
                    break
            x = room.fit_chunk(x, ctx0, ctx0 // bs, preempt=preempt)
            if x <= 0:
                fill.online_blocked |= online
                break
            f.add_prefill(x, ctx0)
            fill.tokens_left -= x
            room.slots -= 1
            if not online:
                fill.offline_in_flight += 1
            fill.admitted.append(Admission(q.request_id, x))

    # ------------------------------------------------------------------ ADMISSION

    def plan_in_flight(
        self,
        in_flight: InFlight,
        *,
        online_queue: Sequence[QueuedRequest],
        offline_queue: Sequence[QueuedRequest],
        free_kv_blocks: int,
        limits: EngineLimits,
        budget_s: float | None,
    ) -> StepPlan:
        """ADMISSION mode from running sums instead of a snapshot (the dispatcher's path).

        Same plan as :meth:`plan` on the equivalent snapshot; costs O(queue window +
        requests in prefill), plus O(offline in flight) only when something is preempted.
        """
        rules = self.rules
        model = self.model
        budget, _, reported_budget = self._budgets_of(budget_s)
        bounded = model is not None and budget < _INF
        fill = _AdmissionFill(in_flight, free_kv_blocks, limits, rules.max_preemptions)
        f = fill.f
        may_preempt = rules.preempt_for_online
        online_blocked = False  # an online request is left waiting for a slot or KV
        if rules.admit_online:
            online_blocked = fill.admit_run(
                online_queue, rules.queue_window, online=True, preempt=may_preempt
            )

        if bounded and model is not None and fill.online_present and may_preempt:
            # Offline work never takes the predicted peak over the budget: preempt the
            # cheapest offline requests until it fits. When online work alone is over
            # the budget (an online prefill chunk), offline work may add to that step
            # only what the budget leaves it next to the online decodes (keep_margin);
            # without the rule every offline request goes.
            online_alone = model.predict_features(f.minus(fill.f_off))
            limit = budget
            if online_alone > budget:
                limit = online_alone
                if rules.keep_offline_margin:
                    limit += max(0.0, budget - model.predict_features(fill.f_ond))
            while fill.f_off.tokens and model.predict_features(f) > limit:
                if not fill.preempt_one():
                    break

        # Offline work never takes the room a waiting online request needs (else the
        # room its preemptions freed goes to other offline work: abort/admit churn).
        if (
            rules.admit_offline
            and not online_blocked
            and not (
                bounded
                and model is not None
                and model.predict_features(f) > budget
                and not fill.may_exceed()
            )
        ):
            cap = rules.offline_cap
            if cap is not None:
                cap -= in_flight.offline_n - len(fill.room.preempted)
            fill.admit_run(
                offline_queue,
                rules.queue_window if cap is None else min(rules.queue_window, max(cap, 0)),
                online=False,
                model=model if bounded else None,
                budget=budget,
            )

        predicted = model.predict_features(f) if model is not None and f.tokens else 0.0
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "admission %s: in_flight=%s admitted=%s preempted=%s peak=%.6f",
                self.name,
                in_flight.count,
                len(fill.admitted),
                len(fill.room.preempted),
                predicted,
            )
        return StepPlan(
            scheduled=(),
            admitted=tuple(fill.admitted),
            preempted=tuple(fill.room.preempted),
            predicted_step_s=predicted,
            budget_s=reported_budget,
        )

    def _plan_admission(self, s: Snapshot) -> StepPlan:
        return self.plan_in_flight(
            InFlight.of(s.running),
            online_queue=s.online_queue,
            offline_queue=s.offline_queue,
            free_kv_blocks=s.free_kv_blocks,
            limits=s.limits,
            budget_s=s.budget_s,
        )


class _StepFill:
    """The mutable state of one ITERATION plan, shared by its fill phases."""

    __slots__ = (
        "admitted",
        "chunk_limit",
        "f",
        "offline_in_flight",
        "online_blocked",
        "room",
        "scheduled",
        "tokens_left",
    )

    def __init__(self, tokens_left: int, chunk_limit: int, room: _Room) -> None:
        self.f = BatchFeatures()
        self.tokens_left = tokens_left
        self.chunk_limit = chunk_limit
        self.room = room
        self.scheduled: list[Admission] = []
        self.admitted: list[Admission] = []
        self.offline_in_flight = 0
        self.online_blocked = False  # an online request was left waiting for KV


@dataclass(slots=True)
class InFlight:
    """What ADMISSION mode needs of the requests in flight, as running sums.

    ``*_ctx``: the sum, per class, of each in-flight request's steady-state
    decode context (its whole prompt while still in prefill, else computed +
    generated). ``prefilling``: the requests still in prefill, in submission
    order; each is priced as its next chunk. ``offline``: builds the in-flight
    offline requests (the preemption candidates) when a preemption is needed.
    """

    count: int
    online_n: int
    online_ctx: int
    offline_n: int
    offline_ctx: int
    prefilling: Sequence[RunningRequest]
    offline: Callable[[], Iterable[RunningRequest]]

    @classmethod
    def of(cls, running: Sequence[RunningRequest]) -> InFlight:
        """The sums of a snapshot's running requests (one pass)."""
        prefilling: list[RunningRequest] = []
        on_n = on_ctx = off_ctx = 0
        for r in running:
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
                off_ctx += ctx
        return cls(
            len(running),
            on_n,
            on_ctx,
            len(running) - on_n,
            off_ctx,
            prefilling,
            lambda: (r for r in running if r.cls is not _ONLINE),
        )


def _cheapest_last(r: RunningRequest) -> tuple[bool, int, float]:
    # Sorted ascending and popped from the end: in prefill first (its chunk costs as
    # much as a hundred decodes, and the sidecar cannot see how far it got), then the
    # fewest tokens held (least recompute), then the latest arrival.
    return (
        r.computed_tokens < r.prompt_tokens,
        -(r.computed_tokens + r.generated_tokens),
        r.arrival_s,
    )


class _AdmissionFill:
    """The predicted peak iteration of one ADMISSION plan and what changes it.

    ``f``: the whole peak; ``f_off``: its offline part; ``f_ond``: its online
    decodes only (what the budget must leave room beside).
    """

    __slots__ = (
        "admitted",
        "bs",
        "cap_tokens",
        "chunk_limit",
        "chunks",
        "count",
        "f",
        "f_off",
        "f_ond",
        "online_present",
        "room",
    )

    def __init__(
        self, fl: InFlight, free_kv: int, limits: EngineLimits, max_preemptions: int
    ) -> None:
        self.bs = limits.block_size
        self.cap_tokens = limits.max_num_batched_tokens
        self.chunk_limit = _chunk_limit(limits)
        self.room = _Room(
            fl.offline, free_kv, limits, max_preemptions, count=fl.count, cheapest_first=True
        )
        n = fl.online_n + fl.offline_n
        f = self.f = BatchFeatures()
        f.n_d = f.s_d_tok = f.tokens = n
        f.s_d_ctx = fl.online_ctx + fl.offline_ctx
        f_off = self.f_off = BatchFeatures()
        f_off.n_d = f_off.s_d_tok = f_off.tokens = fl.offline_n
        f_off.s_d_ctx = fl.offline_ctx
        f_ond = self.f_ond = BatchFeatures()
        f_ond.n_d = f_ond.s_d_tok = f_ond.tokens = fl.online_n
        f_ond.s_d_ctx = fl.online_ctx
        chunks: dict[str, int] = {}
        self.chunks = chunks
        chunk_limit, cap = self.chunk_limit, self.cap_tokens
        for r in fl.prefilling:
            x = min(r.prompt_tokens - r.computed_tokens, chunk_limit, cap - f.tokens)
            if x > 0:
                f.add_prefill(x, r.computed_tokens)
                if r.cls is not _ONLINE:
                    f_off.add_prefill(x, r.computed_tokens)
                chunks[r.request_id] = x
        self.count = fl.count
        self.online_present = fl.online_n > 0
        self.admitted: list[Admission] = []

    def may_exceed(self) -> bool:
        """The progress rule: on an idle engine (nothing in flight, nothing admitted
        yet) one offline request may take the peak over the budget."""
        return self.count == 0 and not self.admitted

    def preempt_one(self) -> bool:
        """Preempt the next (cheapest) victim and take it out of the peak."""
        victim = self.room.next_victim()
        if victim is None:
            return False
        computed = victim.computed_tokens
        for g in (self.f, self.f_off):
            if computed < victim.prompt_tokens:
                g.remove_decode(1, victim.prompt_tokens)
                x = self.chunks.get(victim.request_id, 0)
                if x:
                    g.remove_prefill(x, computed)
            else:
                g.remove_decode(1, computed + victim.generated_tokens)
        self.room.free_kv += _blocks(computed + victim.generated_tokens, self.bs)
        return True

    def admit_run(
        self,
        queue: Sequence[QueuedRequest],
        window: int,
        *,
        online: bool,
        preempt: bool = False,
        model: LinearLatencyModel | None = None,
        budget: float = _INF,
    ) -> bool:
        """Admit the first ``window`` requests of ``queue`` in order while each fits.

        Returns True when it stopped at one that did not fit (the rest wait: the
        queue is in policy order). Each candidate is priced as the dispatcher will
        price it once in flight (its *last* chunk plus its decode), so a request
        admitted now is not preempted by the next plan for the same peak (no
        admit/abort ping-pong). Online requests preempt offline ones for a slot or
        KV when ``preempt``; offline requests must keep the peak within ``budget``
        (when ``model`` is given), except one on an idle engine (the progress
        rule, :meth:`may_exceed`: a budget below one prefill chunk would otherwise
        stall the offline queue for good). One loop for both classes, with the
        accumulators updated in place (this is the planner's hot path).
        """
        room, bs, f = self.room, self.bs, self.f
        part = self.f_ond if online else self.f_off
        chunk_limit, cap_tokens = self.chunk_limit, self.cap_tokens
        admitted = self.admitted
        for q in islice(queue, window):
            prompt = q.prompt_tokens
            ctx0 = q.cached_tokens
            if ctx0 >= prompt:
                ctx0 = prompt - 1
            need = (prompt + bs) // bs - ctx0 // bs  # blocks of prompt + 1, less the cached
            if room.slots <= 0 or need > room.free_kv:
                while preempt and (room.slots <= 0 or need > room.free_kv):
                    if not self.preempt_one():
                        break
                if room.slots <= 0 or need > room.free_kv:
                    return True
            last = prompt - chunk_limit
            last = last if last > ctx0 else ctx0
            x = prompt - last
            left = cap_tokens - f.tokens
            x = x if x < left else left
            x = x if x > 0 else 0
            chunk = 1 if x else 0
            f.s_p += x
            f.n_p += chunk
            f.p_c += x * last
            f.n_d += 1
            f.s_d_tok += 1
            f.s_d_ctx += prompt
            f.tokens += x + 1
            if (
                model is not None
                and model.predict_features(f) > budget
                and not (self.count == 0 and not admitted)
            ):
                f.s_p -= x
                f.n_p -= chunk
                f.p_c -= x * last
                f.n_d -= 1
                f.s_d_tok -= 1
                f.s_d_ctx -= prompt
                f.tokens -= x + 1
                return True
            if online:
                self.online_present = True
            else:  # the offline part of the peak (the online part keeps decodes only)
                part.s_p += x
                part.n_p += chunk
                part.p_c += x * last
                part.tokens += x
            part.n_d += 1
            part.s_d_tok += 1
            part.s_d_ctx += prompt
            part.tokens += 1
            room.free_kv -= need
            room.slots -= 1
            first = prompt - ctx0
            admitted.append(Admission(q.request_id, first if first < chunk_limit else chunk_limit))
        return False


def _chunk_limit(lim: EngineLimits) -> int:
    """The largest prefill chunk one request gets in a step (vLLM's chunking rule)."""
    cap = lim.max_num_batched_tokens
    t = lim.long_prefill_token_threshold
    return t if 0 < t < cap else cap


def _first_context(q: QueuedRequest) -> int:
    """Tokens already in KV when a queued request starts (its prefix-cache hit).

    Only full blocks are shared by prefix caching, so the hit is rounded down
    to the block size by the caller's cache model; here it is only bounded: at
    least one prompt token is always computed (the engine needs the last
    position's logits), so a fully cached prompt still costs a 1-token chunk.
    """
    return max(0, min(q.cached_tokens, q.prompt_tokens - 1))
