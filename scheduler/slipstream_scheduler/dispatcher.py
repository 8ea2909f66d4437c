"""The dispatcher: what the sidecar submits to, holds from and aborts in one vLLM engine.

This is the sidecar's brain, kept in the pure core so the simulator runs
exactly the code the sidecar ships (``docs/design/dispatcher.md``). It sees
only what a client of vLLM sees: the requests it sent, the tokens streamed
back, finishes and errors. From that it estimates the engine's running
batch, and on every :meth:`Dispatcher.decide` asks the :class:`Planner`
(admission mode) how far down each queue to go:

* online requests wait here (not in vLLM's queue) in their ordering's order
  whenever the engine is saturated, so the ordering is real;
* offline requests are admitted only while the predicted iteration time stays
  within the budget (or under a static cap, per the admission policy), in
  FCFS or PSM order;
* running offline requests the planner marks for preemption are aborted; each
  keeps what it produced and re-enters the offline queue at its old place,
  and is later resubmitted as a continuation (prompt + tokens so far).

Algorithm note: ``decide`` is event-driven. It re-plans only when something
the plan depends on changed (an arrival, a finish, a first token, an abort,
a budget change) and there is something to admit; token progress alone only
updates the running estimate. One plan per call at most. The estimate is
kept incrementally (per class: requests in flight and the sum of their
prompt + generated tokens; the requests still in prefill, in order, with
their planner views built once at submission), so a
plan costs O(queue lookahead + requests in prefill) with a
:class:`~slipstream_scheduler.planner.TwoPhasePlanner` in ADMISSION mode;
the in-flight offline requests are listed only when something must be
preempted. Any other :class:`Planner` gets a full snapshot.

Deliberately left out: I/O, clocks (every call takes ``now_s``), the HTTP
streams themselves, the engine's internals (chunk positions, actual KV use,
vLLM's waiting queue) which a sidecar cannot see. Errors::

    DispatcherError
     +-- UnknownRequestError   (an event for a request id the dispatcher does not hold)
     +-- DuplicateRequestError (arrive() with an id already held)
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field
from sortedcontainers import SortedList

from slipstream_scheduler.ordering import (
    GlobalFallback,
    KeyedQueue,
    Ordering,
    RequestView,
)
from slipstream_scheduler.planner import InFlight, PlannerMode, TwoPhasePlanner
from slipstream_scheduler.protocols import LengthPredictor, Planner
from slipstream_scheduler.psm import PsmQueue
from slipstream_scheduler.tailguard import GUARD_MAX_DISPLACEMENTS
from slipstream_scheduler.types import (
    EngineLimits,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
)

logger = logging.getLogger(__name__)

Vector = npt.NDArray[np.float32]


class DispatcherError(Exception):
    """Base of the dispatcher's errors; ``request_id`` names the request concerned."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class UnknownRequestError(DispatcherError):
    """An event arrived for a request the dispatcher does not hold."""


class DuplicateRequestError(DispatcherError):
    """``arrive`` was called twice with the same request id."""


class DispatcherConfig(BaseModel):
    """How the dispatcher maps queues onto one engine. Resolved once, before the loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    online_priority: int = Field(
        default=0, description="vLLM priority of online requests (lower first)."
    )
    offline_priority: int = Field(
        default=100, description="vLLM priority of offline requests; larger than online's."
    )
    lookahead: int = Field(
        default=32, ge=1, description="Queued requests per class shown to the planner per decision."
    )
    max_online_inflight: int | None = Field(
        default=None,
        ge=1,
        description="Online requests in flight at most (None: up to max_num_seqs). A cap "
        "below the engine's keeps online requests queued here, in the ordering's order.",
    )
    max_offline_inflight: int | None = Field(
        default=None,
        ge=0,
        description="Offline requests in flight at most (None: the planner decides).",
    )
    admit_offline: bool = Field(default=True, description="False: never submit offline work.")
    online_passthrough: bool = Field(
        default=False,
        description="Engine mode: every online request is submitted on arrival, unplanned "
        "and uncapped (the engine's own queue holds it, and the plugin orders it there).",
    )
    preempt_offline: bool = Field(
        default=True, description="Abort running offline requests when the planner asks to."
    )
    idle_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="Per-iteration budget while no online request is held or in flight, "
        "seconds; None (default): the budget applies always, as in HyGen. A larger value (inf: "
        "unbounded) lets offline work run larger steps in online idle periods and bounds the "
        "step an arriving online request may find in progress; on arrival the online budget "
        "applies and offline work is preempted until the predicted step fits it.",
    )
    kv_headroom_blocks: int = Field(
        default=0, ge=0, description="KV blocks (16 tokens) kept free in the estimate; default 0."
    )


@dataclass(frozen=True, slots=True)
class Incoming:
    """A new request as the shell received it."""

    request_id: str
    cls: RequestClass
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    vector: Vector | None = field(default=None, compare=False, repr=False)
    block_hashes: tuple[int, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Submit:
    """Send ``request_id`` to the engine with vLLM ``priority``.

    ``resume_from_tokens`` > 0: a continuation; the prompt is the original
    prompt plus the first ``resume_from_tokens`` output tokens and
    ``max_tokens`` is reduced by that many.
    """

    request_id: str
    priority: int
    resume_from_tokens: int = 0


AbortReason = Literal["preempt", "reorder"]


@dataclass(frozen=True, slots=True)
class Abort:
    """Close the stream of ``request_id`` (the engine frees its KV)."""

    request_id: str
    reason: AbortReason


@dataclass(frozen=True, slots=True)
class Decisions:
    """What the shell must carry out now, in this order: aborts, then submits."""

    submit: tuple[Submit, ...] = ()
    abort: tuple[Abort, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.submit or self.abort)


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """Counters and gauges for metrics and status."""

    online_queued: int
    offline_queued: int
    online_inflight: int
    offline_inflight: int
    submitted: int
    resumed: int
    preemptions: int
    finished: int
    failed: int
    plans: int
    budget_s: float | None
    est_free_kv_blocks: int
    reorders: int = 0  # online requests aborted to let a better-ranked one in


class RequestQueue(Protocol):
    """A queue of held requests in policy order (FCFS, PSM, an ordering's adapter).

    Contract: ``push`` may be called again for a request that was taken (a
    preempted request coming back; it should regain its old place);
    ``head(n, now_s)`` lists the first ``n`` ids in order without removing
    them; ``take`` removes an id that was just admitted (it was among the
    head); ``remove`` drops any queued id (cancelled).
    """

    def push(self, request: Incoming) -> None: ...

    def head(self, n: int, now_s: float) -> list[str]: ...

    def take(self, request_id: str, now_s: float) -> None: ...

    def remove(self, request_id: str) -> None: ...

    def __len__(self) -> int: ...


class FifoQueue:
    """FCFS by first arrival; a request pushed again keeps its original place."""

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        self._seq: dict[str, int] = {}
        self._next = itertools.count()

    def push(self, request: Incoming) -> None:
        rid = request.request_id
        seq = self._seq.setdefault(rid, next(self._next))
        self._order.add((seq, rid))

    def head(self, n: int, now_s: float) -> list[str]:
        return [rid for _, rid in self._order.islice(0, n)]

    def take(self, request_id: str, now_s: float) -> None:
        self.remove(request_id)

    def remove(self, request_id: str) -> None:
        self._order.discard((self._seq[request_id], request_id))

    def forget(self, request_id: str) -> None:
        """The request left for good: drop its remembered place."""
        self._seq.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._order)


class PsmOfflineQueue:
    """Adapter: :class:`slipstream_scheduler.psm.PsmQueue` over prefix-block hashes.

    The trie is keyed by the request's 16-token block hashes (one trie edge
    per block, ``block_size=1`` over hashes), which is the granularity vLLM's
    prefix cache shares at. A preempted request re-enters with its original
    arrival, so the anti-starvation rule still sees its age.
    """

    def __init__(self, queue: PsmQueue) -> None:
        self._q = queue

    def push(self, request: Incoming) -> None:
        keys = [h & 0x7FFF_FFFF_FFFF_FFFF for h in request.block_hashes]
        self._q.push(request.request_id, keys, request.arrival_s)

    def head(self, n: int, now_s: float) -> list[str]:
        return list(self._q.peek_order(n, now_s))

    def take(self, request_id: str, now_s: float) -> None:
        order = self._q.peek_order(1, now_s)
        if order and order[0] == request_id:
            self._q.pop(now_s)  # moves the DFS cursor
        else:
            self._q.remove(request_id)

    def remove(self, request_id: str) -> None:
        self._q.remove(request_id)

    def __len__(self) -> int:
        return len(self._q)


class OrderingQueue:
    """The online queue in a core :class:`~slipstream_scheduler.ordering.Ordering`'s order.

    Keys come from the ordering over the length predictor's sample, computed
    on arrival (and on re-entry after a reorder abort, at the tokens produced
    so far). For a preemptive ordering (TRAIL-like, Gittins) the queue also
    keeps the keys of the requests in flight, refreshed only when the ordering
    says a bucket boundary was crossed, and :meth:`reorder_victim` names the
    in-flight request a waiting one may displace. The sidecar cannot change a
    request's priority inside vLLM, so displacing means abort and resume as a
    continuation (digest §2.8 (a)).

    Lazy keys (attribute ``lazy_keys``, default True): a request pushed into an empty
    queue is held as the *lone* request, unkeyed: a key only orders it against
    others, so its prediction and key wait until the next ``push`` (which keys
    it first, so ties keep the eager order), ``reorder_victim`` or
    :meth:`settle`. Taken while still lone it costs nothing, and for a
    preemptive ordering its running view is built when first needed
    (``progressed``, ``reorder_victim``, ``settle``). The order is exactly the
    eager one because nothing the key depends on may change meanwhile: the
    fallback's refresh is checked at push as before, a lone request carrying
    a vector is predicted at push (the sidecar's predictor hands over a
    sample prepared for that vector, which must not linger), and the
    dispatcher calls :meth:`settle` before it feeds the predictor a finished
    request (a later prediction would see a longer history).

    Every view carries the predictor's global distribution (``prior_sample``,
    when the predictor has one) as the fallback of the outliving rule: a
    request that ran past every length of its sample is ranked on the global
    lengths above what it produced, not on the point ``O = 2·o`` (which ranks
    it behind nearly every new arrival). The fallback is cached and refreshed
    only after ``fallback_refresh_every`` finished requests (fewer while the
    history is small: after 1, 2, 4, ... of them), never per request.
    """

    def __init__(
        self,
        ordering: Ordering,
        predictor: LengthPredictor,
        *,
        fallback_samples: int = 256,
        fallback_refresh_every: int = 64,
    ) -> None:
        self.ordering = ordering
        self._predictor = predictor
        self._q = KeyedQueue()
        self._held: dict[str, Incoming] = {}
        self._generated: dict[str, int] = {}
        self._preemptions: dict[str, int] = {}
        self._samples: dict[str, npt.NDArray[np.float64]] = {}
        self._running: dict[str, tuple[RequestView, float]] = {}
        # False: key every request on push, as before lazy keys (set before the first push;
        # tests and benchmarks compare against it).
        self.lazy_keys = True
        # Invariant: while ``_lone`` is set, ``_q`` is empty (the lone request is the queue).
        self._lone: Incoming | None = None
        # Taken while lone by a preemptive ordering, no running view yet: id -> tokens at take.
        self._unviewed: dict[str, int] = {}
        self._fallback = GlobalFallback(
            predictor, samples=fallback_samples, refresh_every=fallback_refresh_every
        )
        # The tail guard's view of the keyed queue: (arrival, seq, id), lazily deleted (an
        # entry is live while its id is queued with that seq). Kept only under a guard.
        self._by_arrival: list[tuple[float, int, str]] = []
        self._arrival_seq: dict[str, int] = {}
        self._arrival_count = itertools.count()

    @property
    def fallback(self) -> npt.NDArray[np.float64]:
        """The cached global distribution views fall back on (ascending; empty: none)."""
        return self._fallback.lengths

    def observed(self) -> None:
        """A request finished and was fed to the predictor: the fallback may be stale."""
        self._fallback.observed()

    def _sample(self, req: Incoming) -> npt.NDArray[np.float64]:
        rid = req.request_id
        sample = self._samples.get(rid)
        if sample is None:
            sample = np.sort(
                np.asarray(self._predictor.predict(req.vector, req.prompt_tokens), np.float64)
            )
            self._samples[rid] = sample
        return sample

    def _view(self, req: Incoming, generated: int, keyed_at: int = -1) -> RequestView:
        rid = req.request_id
        return RequestView(
            request_id=rid,
            arrival_s=req.arrival_s,
            input_tokens=req.prompt_tokens,
            lengths=self._sample(req),
            generated_tokens=generated,
            fallback=self.fallback,
            keyed_at_tokens=keyed_at,
            preemptions=self._preemptions.get(rid, 0),
        )

    def _key_lone(self) -> None:
        """Key the lone request into the heap (it is no longer alone, or a key is asked for)."""
        lone = self._lone
        if lone is not None:
            self._lone = None
            rid = lone.request_id
            self._enqueue(rid, self.ordering.key(self._view(lone, self._generated.get(rid, 0))))

    def _view_unviewed(self) -> None:
        """Build the running views of the requests taken while lone (preemptive orderings)."""
        if self._unviewed:
            pending, self._unviewed = self._unviewed, {}
            for rid, g in pending.items():
                view = self._view(self._held[rid], g, g)
                self._running[rid] = (view, self.ordering.key(view))

    def settle(self) -> None:
        """Compute every deferred prediction and key now (before the predictor learns more)."""
        self._key_lone()
        self._view_unviewed()

    def push(self, request: Incoming) -> None:
        rid = request.request_id
        self._held[rid] = request
        self._running.pop(rid, None)
        self._unviewed.pop(rid, None)
        lone = self._lone
        if lone is not None and lone.request_id == rid:
            self._lone = request  # pushed again while lone: still alone, still unkeyed
            return
        if self.lazy_keys and lone is None and not len(self._q):
            self.fallback  # noqa: B018  (the refresh check eager keying would make here)
            if request.vector is not None:
                self._sample(request)
            self._lone = request
            return
        self._key_lone()
        view = self._view(request, self._generated.get(rid, 0))
        self._enqueue(rid, self.ordering.key(view))

    def _enqueue(self, rid: str, key: float) -> None:
        """Into the keyed queue, and, under a tail guard, into its arrival order."""
        self._q.push(rid, key)
        if self.ordering.guard is not None and rid not in self._arrival_seq:
            seq = next(self._arrival_count)
            self._arrival_seq[rid] = seq
            heapq.heappush(self._by_arrival, (self._held[rid].arrival_s, seq, rid))
            if len(self._by_arrival) > 2 * len(self._arrival_seq) + 64:  # mostly stale
                self._by_arrival = [
                    e for e in self._by_arrival if self._arrival_seq.get(e[2]) == e[1]
                ]
                heapq.heapify(self._by_arrival)

    def _overdue(self, n: int, now_s: float) -> list[str]:
        """Up to ``n`` queued requests past the guard's deadline, earliest first."""
        guard = self.ordering.guard
        heap = self._by_arrival
        if guard is None or not heap:
            return []
        out: list[tuple[float, int, str]] = []
        while heap and len(out) < n:
            entry = heapq.heappop(heap)
            arrival, seq, rid = entry
            if self._arrival_seq.get(rid) != seq or rid not in self._q:
                if self._arrival_seq.get(rid) == seq:
                    del self._arrival_seq[rid]
                continue  # stale: taken or gone
            if not guard.overdue(arrival, now_s):
                heapq.heappush(heap, entry)
                break
            out.append(entry)
        for entry in out:
            heapq.heappush(heap, entry)
        return [rid for _, _, rid in out]

    def head(self, n: int, now_s: float) -> list[str]:
        if self._lone is not None:
            return [self._lone.request_id] if n > 0 else []
        overdue = self._overdue(n, now_s)
        if overdue:
            first = set(overdue)
            rest = [rid for rid, _ in self._q.smallest(n) if rid not in first]
            return (overdue + rest)[:n]
        if n == 1 and len(self._q):
            return [self._q.peek()[0]]
        return [rid for rid, _ in self._q.smallest(n)]

    def take(self, request_id: str, now_s: float) -> None:
        lone = self._lone
        if lone is not None and lone.request_id == request_id:
            self._lone = None
            if self.ordering.preemptive:
                self._unviewed[request_id] = self._generated.get(request_id, 0)
            return
        self._q.remove(request_id)
        self._arrival_seq.pop(request_id, None)
        if self.ordering.preemptive:
            req = self._held[request_id]
            g = self._generated.get(request_id, 0)
            view = self._view(req, g, g)
            self._running[request_id] = (view, self.ordering.key(view))

    def remove(self, request_id: str) -> None:
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """The request left for good (queued or not)."""
        lone = self._lone
        if lone is not None and lone.request_id == request_id:
            self._lone = None
        elif request_id in self._q:
            self._q.remove(request_id)
        self._arrival_seq.pop(request_id, None)
        self._held.pop(request_id, None)
        self._generated.pop(request_id, None)
        self._preemptions.pop(request_id, None)
        self._samples.pop(request_id, None)
        self._running.pop(request_id, None)
        self._unviewed.pop(request_id, None)

    def progressed(self, request_id: str, generated_total: int) -> None:
        """Output tokens produced so far (all submissions); re-keys at bucket boundaries."""
        self._generated[request_id] = generated_total
        g0 = self._unviewed.pop(request_id, None)
        if g0 is not None:
            view0 = self._view(self._held[request_id], g0, g0)
            self._running[request_id] = (view0, self.ordering.key(view0))
        cur = self._running.get(request_id)
        if cur is None:
            return
        view = cur[0]
        probe = RequestView(
            view.request_id,
            view.arrival_s,
            view.input_tokens,
            view.lengths,
            generated_total,
            view.fallback,
            view.keyed_at_tokens,
            view.preemptions,
        )
        if self.ordering.refresh_needed(probe):
            fresh = self._view(self._held[request_id], generated_total, generated_total)
            self._running[request_id] = (fresh, self.ordering.key(fresh))

    def set_ordering(self, ordering: Ordering) -> None:
        """Switch orderings at run time: held and in-flight requests are re-keyed.

        A lone request and running views not built yet stay deferred: they are
        keyed with the ordering in force when first needed.
        """
        self.ordering = ordering
        self._by_arrival, self._arrival_seq = [], {}
        for rid, req in self._held.items():
            if rid in self._q:
                self._enqueue(rid, ordering.key(self._view(req, self._generated.get(rid, 0))))
        if not ordering.preemptive:
            self._running.clear()
            self._unviewed.clear()
            return
        for rid, (view, _) in list(self._running.items()):
            self._running[rid] = (view, ordering.key(view))

    def reorder_victim(self, now_s: float | None = None) -> str | None:
        """An in-flight request the best waiting one may displace, if the ordering allows.

        Under a tail guard (``now_s`` given, ``tailguard.py``) a request past its deadline is
        never displaced, and one at the head displaces the worst-ranked request that is not,
        if that one was displaced fewer than ``GUARD_MAX_DISPLACEMENTS`` times."""
        if not self.ordering.preemptive or not (self._running or self._unviewed) or not len(self):
            return None
        self.settle()
        guard = self.ordering.guard
        overdue_head = guard is not None and now_s is not None and bool(self._overdue(1, now_s))
        _, best = self._q.peek()
        candidates = [
            kv
            for kv in self._running.items()
            if guard is None or now_s is None or not guard.overdue(kv[1][0].arrival_s, now_s)
        ]
        if not candidates:
            return None
        rid, (view, key) = max(candidates, key=lambda kv: kv[1][1])
        if overdue_head:
            allowed = self._preemptions.get(rid, 0) < GUARD_MAX_DISPLACEMENTS
        else:
            allowed = self.ordering.may_preempt(best, view, key)
        if allowed:
            self._preemptions[rid] = self._preemptions.get(rid, 0) + 1
            return rid
        return None

    def __len__(self) -> int:
        return len(self._q) + (self._lone is not None)


@dataclass(slots=True)
class _Rec:
    request_id: str
    cls: RequestClass
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    incoming: Incoming
    generated: int = 0  # output tokens produced over all submissions
    resume_from: int = 0  # ``generated`` when the current submission started
    inflight: bool = False
    aborting: bool = False
    preemptions: int = 0
    cached: int = 0  # expected prefix-cache hit of the current submission, tokens


class Dispatcher:
    """One engine's admission layer. See the module docstring and ``docs/design/dispatcher.md``."""

    def __init__(
        self,
        config: DispatcherConfig,
        planner: Planner,
        *,
        online_queue: RequestQueue | None = None,
        offline_queue: RequestQueue | None = None,
        length_predictor: LengthPredictor | None = None,
        limits: EngineLimits | None = None,
        kv_blocks: int = 1 << 30,
        budget_s: float | None = None,
    ) -> None:
        self.config = config
        self.planner = planner
        self.online_queue: RequestQueue = online_queue if online_queue is not None else FifoQueue()
        self.offline_queue: RequestQueue = (
            offline_queue if offline_queue is not None else FifoQueue()
        )
        self.length_predictor = length_predictor
        self.limits = limits if limits is not None else EngineLimits()
        self.kv_blocks = kv_blocks
        self._budget_s = budget_s
        self._recs: dict[str, _Rec] = {}
        self._inflight: dict[str, _Rec] = {}
        self._n_inflight = {RequestClass.ONLINE: 0, RequestClass.OFFLINE: 0}
        # Running sums of the requests in flight and not being aborted (the planner's
        # input, kept incrementally): count and sum of prompt + generated per class,
        # and those still in prefill (no token yet on this submission), in order, each
        # with its planner view built once at submission (it cannot change before the
        # first token), valid for the (chunk, online, offline priority) in ``_pf_stamp``.
        self._n_live = {RequestClass.ONLINE: 0, RequestClass.OFFLINE: 0}
        self._ctx_sum = {RequestClass.ONLINE: 0, RequestClass.OFFLINE: 0}
        self._prefilling: dict[str, RunningRequest] = {}
        self._pf_stamp = self._view_stamp()
        self._dirty = True
        self._bs = self.limits.block_size
        # KV estimate: prompt blocks in flight counted once per distinct hash
        self._block_refs: dict[int, int] = {}
        self._private_blocks = 0  # blocks of in-flight requests without hashes + output blocks
        oq = self.online_queue
        self._reorder: OrderingQueue | None = (
            oq if isinstance(oq, OrderingQueue) and oq.ordering.preemptive else None
        )
        self._reorders = 0
        self._submitted = self._resumed = self._preemptions = 0
        self._finished = self._failed = self._plans = 0

    # ---- events from the shell -------------------------------------------------

    def arrive(self, req: Incoming, now_s: float) -> None:
        """A new request (online from a client, offline from an assigned shard)."""
        if req.request_id in self._recs:
            raise DuplicateRequestError("request already held", req.request_id)
        rec = _Rec(req.request_id, req.cls, req.prompt_tokens, req.max_tokens, req.arrival_s, req)
        self._recs[req.request_id] = rec
        self._queue(rec).push(req)
        self._dirty = True

    def online_allowance(self) -> tuple[int, int]:
        """(requests, KV blocks): how many online arrivals, using how many KV blocks in
        all, the dispatcher would submit on arrival, as :meth:`decide` would, with no
        decision per arrival.

        The planner's online phase admits an online request whenever a sequence slot
        and KV blocks are free for it (offline work in flight is preempted to make
        room, so it takes no slot here). That rule needs no plan while no online
        request is held; while one is, the allowance is (0, 0): a newcomer must not
        overtake it. A shell that sends arrivals inside this allowance straight to the
        engine reports each with :meth:`arrive_submitted`.
        """
        if len(self.online_queue):
            return 0, 0
        room = self.limits.max_num_seqs - self._n_inflight[RequestClass.ONLINE]
        cap = self.config.max_online_inflight
        if cap is not None:
            room = min(room, cap - self._n_inflight[RequestClass.ONLINE])
        blocks = self.est_free_kv_blocks
        if room <= 0 or blocks <= 0:
            return 0, 0
        return room, blocks

    def arrive_submitted(self, reqs: Sequence[Incoming], now_s: float) -> Decisions:
        """Online requests the shell sent to the engine on arrival, inside the
        :meth:`online_allowance` it held then. They arrive and are decided at once
        (one plan per ``lookahead`` of them, not one each), so what their admission
        sets off (offline work preempted to make room, more work submitted) is in the
        returned decisions, as from :meth:`decide`. Were the planner to hold one (an
        allowance gone stale in flight), it is taken in flight all the same, with the
        online priority: the engine has it."""
        for req in reqs:
            if req.cls is not RequestClass.ONLINE:
                raise DispatcherError("only online requests arrive submitted", req.request_id)
        for req in reqs:
            self.arrive(req, now_s)
        pending = {req.request_id for req in reqs}
        submits: list[Submit] = []
        aborts: list[Abort] = []
        while pending:
            dec = self.decide(now_s)
            submits += dec.submit
            aborts += dec.abort
            taken = pending.intersection(s.request_id for s in dec.submit)
            if not taken:
                break
            pending -= taken
        for req in reqs:
            rid = req.request_id
            if rid in pending:
                self.online_queue.take(rid, now_s)
                self._take(self._recs[rid])
                self._submitted += 1
                self._dirty = True
                submits.append(Submit(rid, self.config.online_priority, 0))
        return Decisions(tuple(submits), tuple(aborts))

    def progress(self, request_id: str, generated_tokens: int, now_s: float) -> None:
        """``generated_tokens`` tokens seen so far on this submission's stream."""
        rec = self._get(request_id)
        before = rec.generated - rec.resume_from
        if not rec.inflight or generated_tokens <= before:
            return
        if before == 0:
            self._dirty = True  # prefill done: the batch estimate changes shape
            self._prefilling.pop(request_id, None)
        if not rec.aborting:
            self._ctx_sum[rec.cls] += rec.resume_from + generated_tokens - rec.generated
        self._private_blocks += self._out_blocks(rec.resume_from + generated_tokens) - (
            self._out_blocks(rec.generated)
        )
        rec.generated = rec.resume_from + generated_tokens
        if self._reorder is not None and rec.cls is RequestClass.ONLINE:
            self._reorder.progressed(request_id, rec.generated)

    def finished(self, request_id: str, output_tokens: int, now_s: float) -> None:
        """This submission's stream ended normally after ``output_tokens`` tokens."""
        rec = self._get(request_id)
        self.progress(request_id, output_tokens, now_s)
        self._release(rec)
        self._recs.pop(request_id)
        self._forget(rec)
        self._finished += 1
        if self.length_predictor is not None and rec.cls is RequestClass.ONLINE:
            if isinstance(self.online_queue, OrderingQueue):
                # Deferred keys first: they must see the history the eager ones saw.
                self.online_queue.settle()
            self.length_predictor.observe(rec.incoming.vector, rec.prompt_tokens, rec.generated)
            if isinstance(self.online_queue, OrderingQueue):
                self.online_queue.observed()
        self._dirty = True

    def failed(self, request_id: str, now_s: float) -> None:
        """The engine rejected or dropped the request: it leaves the dispatcher."""
        rec = self._get(request_id)
        if rec.inflight:
            self._release(rec)
        else:
            self._queue(rec).remove(request_id)
        self._recs.pop(request_id)
        self._forget(rec)
        self._failed += 1
        self._dirty = True

    def aborted(self, request_id: str, now_s: float) -> None:
        """The shell closed the stream of an :class:`Abort`; the request is queued again."""
        rec = self._get(request_id)
        if not rec.aborting:
            raise DispatcherError("aborted() for a request not being aborted", request_id)
        self._release(rec)
        rec.aborting = False
        rec.preemptions += 1
        self._queue(rec).push(rec.incoming)
        self._dirty = True

    def set_budget(self, budget_s: float | None) -> None:
        """The per-iteration latency budget (seconds; None: unbounded)."""
        self._budget_s = budget_s
        self._dirty = True

    @property
    def budget_s(self) -> float | None:
        return self._budget_s

    # ---- decisions ---------------------------------------------------------------

    def decide(self, now_s: float) -> Decisions:
        """What to submit and abort now. Cheap (no plan) when nothing relevant changed."""
        if not self._dirty:
            return Decisions()
        self._dirty = False
        cfg = self.config
        n_on = len(self.online_queue)
        n_off = len(self.offline_queue) if cfg.admit_offline else 0
        if n_on == 0 and n_off == 0:
            return Decisions()
        on_room = self.limits.max_num_seqs
        if cfg.max_online_inflight is not None:
            on_room = cfg.max_online_inflight - self._n_inflight[RequestClass.ONLINE]
        off_room = self.limits.max_num_seqs
        if cfg.max_offline_inflight is not None:
            off_room = cfg.max_offline_inflight - self._n_inflight[RequestClass.OFFLINE]
        passed: list[Submit] = []
        if cfg.online_passthrough and n_on > 0:
            passed = self._pass_online(now_s)
            n_on = 0
            if n_off == 0:
                self._dirty = True
                return Decisions(tuple(passed))
        reorder_abort: Abort | None = None
        if self._reorder is not None and n_on > 0 and on_room <= 0:
            victim = self._reorder.reorder_victim(now_s)
            if victim is not None:
                vrec = self._inflight.get(victim)
                if vrec is not None and not vrec.aborting:
                    self._mark_aborting(vrec)
                    self._reorders += 1
                    reorder_abort = Abort(victim, "reorder")
        online_ids = (
            self.online_queue.head(min(cfg.lookahead, on_room), now_s) if n_on > 0 < on_room else []
        )
        offline_ids = (
            self.offline_queue.head(min(cfg.lookahead, off_room), now_s)
            if n_off > 0 < off_room
            else []
        )
        if not online_ids and not offline_ids:
            if reorder_abort is not None or passed:
                self._dirty = True
                return Decisions(tuple(passed), () if reorder_abort is None else (reorder_abort,))
            return Decisions()
        budget = self._budget_s
        if (
            budget is not None
            and cfg.idle_budget_s is not None
            and n_on == 0
            and self._n_inflight[RequestClass.ONLINE] == 0
        ):
            # No online work to protect: offline fills up to the idle budget, which
            # bounds the step an arriving online request may wait for (its TTFT).
            budget = None if math.isinf(cfg.idle_budget_s) else cfg.idle_budget_s
        on_q = [self._queued_view(self._recs[r]) for r in online_ids]
        off_q = [self._queued_view(self._recs[r]) for r in offline_ids]
        planner = self.planner
        if isinstance(planner, TwoPhasePlanner) and planner.mode is PlannerMode.ADMISSION:
            # The incremental path: running sums instead of a snapshot of every request.
            plan = planner.plan_in_flight(
                self._in_flight_sums(),
                online_queue=on_q,
                offline_queue=off_q,
                free_kv_blocks=self.est_free_kv_blocks,
                limits=self.limits,
                budget_s=budget,
            )
        else:
            snap = Snapshot(
                now_s=now_s,
                running=tuple(self._running_view()),
                online_queue=tuple(on_q),
                offline_queue=tuple(off_q),
                free_kv_blocks=self.est_free_kv_blocks,
                limits=self.limits,
                budget_s=budget,
            )
            plan = planner.plan(snap)
        cached = {q.request_id: q.cached_tokens for q in (*on_q, *off_q)}
        self._plans += 1
        aborts: list[Abort] = [] if reorder_abort is None else [reorder_abort]
        if cfg.preempt_offline:
            for rid in plan.preempted:
                rec = self._inflight.get(rid)
                if rec is None or rec.cls is not RequestClass.OFFLINE or rec.aborting:
                    continue
                self._mark_aborting(rec)
                self._preemptions += 1
                aborts.append(Abort(rid, "preempt"))
        submits: list[Submit] = passed
        for adm in plan.admitted:
            rec = self._recs.get(adm.request_id)
            if rec is None or rec.inflight:
                continue
            if rec.cls is RequestClass.OFFLINE and not cfg.admit_offline:
                continue
            self._queue(rec).take(rec.request_id, now_s)
            rec.cached = cached.get(rec.request_id, 0)
            self._take(rec)
            prio = cfg.online_priority if rec.cls is RequestClass.ONLINE else cfg.offline_priority
            submits.append(Submit(rec.request_id, prio, rec.generated))
            self._submitted += 1
            if rec.generated:
                self._resumed += 1
        if submits or aborts:
            # The engine estimate changed: a follow-up plan may admit more.
            self._dirty = True
            logger.debug(
                "decide t=%.3f submit=%d abort=%d queued=%d/%d inflight=%d/%d",
                now_s,
                len(submits),
                len(aborts),
                len(self.online_queue),
                len(self.offline_queue),
                self._n_inflight[RequestClass.ONLINE],
                self._n_inflight[RequestClass.OFFLINE],
            )
        return Decisions(tuple(submits), tuple(aborts))

    def _pass_online(self, now_s: float) -> list[Submit]:
        """``online_passthrough``: submit every queued online request, in queue order."""
        out: list[Submit] = []
        prio = self.config.online_priority
        while len(self.online_queue):
            (rid,) = self.online_queue.head(1, now_s)
            rec = self._recs[rid]
            self.online_queue.take(rid, now_s)
            if rec.inflight:
                continue
            rec.cached = self._queued_view(rec).cached_tokens
            self._take(rec)
            out.append(Submit(rid, prio, rec.generated))
            self._submitted += 1
            if rec.generated:
                self._resumed += 1
        return out

    # ---- views -------------------------------------------------------------------

    def _running_view(self) -> Iterator[RunningRequest]:
        on_p, off_p = self.config.online_priority, self.config.offline_priority
        chunk = self._chunk()
        for rec in self._inflight.values():
            if not rec.aborting:
                yield self._running(rec, chunk, on_p, off_p)

    def _running(self, rec: _Rec, chunk: int, on_p: int, off_p: int) -> RunningRequest:
        prompt = rec.prompt_tokens + rec.resume_from
        gen = rec.generated - rec.resume_from
        # The stream shows no prefill progress: price the pending prefill as its
        # last (costliest, longest-context) chunk, conservatively, and no earlier
        # than its expected prefix-cache hit (as the planner priced its admission).
        computed = prompt if gen else min(max(prompt - chunk, rec.cached), prompt - 1)
        return RunningRequest(
            request_id=rec.request_id,
            cls=rec.cls,
            prompt_tokens=prompt,
            computed_tokens=computed,
            generated_tokens=gen,
            max_tokens=rec.max_tokens - rec.resume_from,
            arrival_s=rec.arrival_s,
            priority=on_p if rec.cls is RequestClass.ONLINE else off_p,
        )

    def _chunk(self) -> int:
        lim = self.limits
        chunk = lim.max_num_batched_tokens
        if 0 < lim.long_prefill_token_threshold < chunk:
            chunk = lim.long_prefill_token_threshold
        return chunk

    def _view_stamp(self) -> tuple[int, int, int]:
        """What a prefilling request's planner view depends on besides the request."""
        return self._chunk(), self.config.online_priority, self.config.offline_priority

    def _in_flight_sums(self) -> InFlight:
        """The planner's view of what is in flight, from the running sums (O(in prefill))."""
        stamp = self._view_stamp()
        chunk, on_p, off_p = stamp
        if stamp != self._pf_stamp:  # limits or config replaced: rebuild the cached views
            self._pf_stamp = stamp
            for rid in self._prefilling:
                self._prefilling[rid] = self._running(self._recs[rid], chunk, on_p, off_p)
        prefilling = list(self._prefilling.values())
        on, off = RequestClass.ONLINE, RequestClass.OFFLINE

        def offline() -> Iterator[RunningRequest]:
            for rec in self._inflight.values():
                if rec.cls is off and not rec.aborting:
                    yield self._running(rec, chunk, on_p, off_p)

        return InFlight(
            count=self._n_live[on] + self._n_live[off],
            online_n=self._n_live[on],
            online_ctx=self._ctx_sum[on],
            offline_n=self._n_live[off],
            offline_ctx=self._ctx_sum[off],
            prefilling=prefilling,
            offline=offline,
        )

    def _queued_view(self, rec: _Rec) -> QueuedRequest:
        return QueuedRequest(
            request_id=rec.request_id,
            cls=rec.cls,
            prompt_tokens=rec.prompt_tokens + rec.generated,
            max_tokens=rec.max_tokens,
            arrival_s=rec.arrival_s,
            cached_tokens=self._cached_estimate(rec),
            already_generated=rec.generated,
        )

    def _cached_estimate(self, rec: _Rec) -> int:
        n = 0
        refs = self._block_refs
        for h in rec.incoming.block_hashes:
            if h not in refs:
                break
            n += 1
        return min(n * self._bs, rec.prompt_tokens - 1) if n else 0

    @property
    def est_free_kv_blocks(self) -> int:
        """KV blocks the engine should have free, as far as the streams tell."""
        used = len(self._block_refs) + self._private_blocks
        return max(self.kv_blocks - used - self.config.kv_headroom_blocks, 0)

    def request_state(self, request_id: str) -> tuple[bool, int, int]:
        """(in flight, output tokens produced in all, preemptions) of a held request."""
        rec = self._get(request_id)
        return rec.inflight, rec.generated, rec.preemptions

    def stats(self) -> DispatcherStats:
        return DispatcherStats(
            online_queued=len(self.online_queue),
            offline_queued=len(self.offline_queue),
            online_inflight=self._n_inflight[RequestClass.ONLINE],
            offline_inflight=self._n_inflight[RequestClass.OFFLINE],
            submitted=self._submitted,
            resumed=self._resumed,
            preemptions=self._preemptions,
            finished=self._finished,
            failed=self._failed,
            plans=self._plans,
            budget_s=self._budget_s,
            est_free_kv_blocks=self.est_free_kv_blocks,
            reorders=self._reorders,
        )

    # ---- bookkeeping -------------------------------------------------------------

    def _get(self, request_id: str) -> _Rec:
        rec = self._recs.get(request_id)
        if rec is None:
            raise UnknownRequestError("unknown request", request_id)
        return rec

    def _queue(self, rec: _Rec) -> RequestQueue:
        return self.online_queue if rec.cls is RequestClass.ONLINE else self.offline_queue

    def _forget(self, rec: _Rec) -> None:
        q = self._queue(rec)
        if isinstance(q, FifoQueue | OrderingQueue):
            q.forget(rec.request_id)

    def _unlive(self, rec: _Rec) -> None:
        """Take an in-flight request out of the running sums (aborting or leaving)."""
        self._n_live[rec.cls] -= 1
        self._ctx_sum[rec.cls] -= rec.prompt_tokens + rec.generated
        self._prefilling.pop(rec.request_id, None)

    def _mark_aborting(self, rec: _Rec) -> None:
        rec.aborting = True
        self._unlive(rec)

    def _out_blocks(self, generated: int) -> int:
        return -(-generated // self._bs)

    def _take(self, rec: _Rec) -> None:
        rec.inflight = True
        rec.resume_from = rec.generated
        self._inflight[rec.request_id] = rec
        self._n_inflight[rec.cls] += 1
        self._n_live[rec.cls] += 1
        self._ctx_sum[rec.cls] += rec.prompt_tokens + rec.generated
        # rec.cached is set: the view is final until the first token (or an abort).
        self._prefilling[rec.request_id] = self._running(rec, *self._pf_stamp)
        refs = self._block_refs
        for h in rec.incoming.block_hashes:
            refs[h] = refs.get(h, 0) + 1
        tail = rec.prompt_tokens - len(rec.incoming.block_hashes) * self._bs
        self._private_blocks += self._out_blocks(max(tail, 0)) + self._out_blocks(rec.generated)

    def _release(self, rec: _Rec) -> None:
        if not rec.inflight:
            raise DispatcherError("request is not in flight", rec.request_id)
        if not rec.aborting:
            self._unlive(rec)
        rec.inflight = False
        del self._inflight[rec.request_id]
        self._n_inflight[rec.cls] -= 1
        refs = self._block_refs
        for h in rec.incoming.block_hashes:
            left = refs[h] - 1
            if left:
                refs[h] = left
            else:
                del refs[h]
        tail = rec.prompt_tokens - len(rec.incoming.block_hashes) * self._bs
        self._private_blocks -= self._out_blocks(max(tail, 0)) + self._out_blocks(rec.generated)
