"""The asyncio shell around the core's :class:`Dispatcher`.

The dispatcher (``slipstream_scheduler.dispatcher``) decides everything: which
held request enters the engine next, with which vLLM priority, and which
offline request to abort to make room. This module only feeds it events on
``time.monotonic()`` and carries out its decisions:

* ``register`` → ``arrive``; the caller awaits its :class:`Ticket` until the
  dispatcher submits it (the request is *held* in the sidecar until then).
  With ``grant_now`` (the proxy's online requests) an arrival that no held
  online request precedes and that fits the engine's free slots and KV is
  decided at once, inside ``register``: its ticket comes back granted, so its
  grant goes to the front without yielding to the event loop, and the engine
  starts on the first requests of a burst while the sidecar is still parsing
  the rest (``docs/benchmarks/sidecar.md``). It is the dispatcher's own
  ``decide``, so what it submits and in which order is what the coalesced
  pump would decide; only its timing moves. Each such decision costs the core
  O(requests in prefill) (a list of views cached at submission; the lone
  arrival itself is neither predicted nor keyed), so it is taken only while at
  most ``sync_prefill_limit`` (the sidecar setting) granted requests still
  await their first token (16: first measured at 8 and 32 on a loaded 2-core
  host, before the views were cached; re-measured on a quiet host against 32,
  256 and 512, where deciding every arrival at once cost no more CPU and cut
  the in-sidecar wait 25-100 fold but did not shorten the burst end to end:
  the wait it removes is the loop taking in the rest of the burst,
  ``docs/benchmarks/sidecar.md``); beyond that, arrivals are coalesced as below;
* the streams report ``progress`` / ``finished`` / ``failed`` / ``aborted``;
* after every event a *pump* runs ``decide`` once per event-loop turn
  (coalesced: a burst of arrivals in one turn is planned once), resolves the
  tickets it submits and fires the abort callbacks of the ones it aborts, and
  pumps again in the next turn while a decision submitted something and work
  is still held (one decision looks at a bounded window of each queue); a
  ticker also pumps every ``tick_s`` while anything is held, for decisions
  that depend only on time (it sleeps on an event while nothing is held, so an
  idle sidecar does not wake 200 times a second).

It keeps its own counts of held and in-flight requests per class, for metrics
and Status, and the observed iteration time (token gaps).

Deliberately left out: any ordering or admission logic (the dispatcher's job),
HTTP (``proxy.py``) and batch files (``shards.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from slipstream_scheduler.dispatcher import Decisions, Dispatcher, DispatcherStats, Incoming
from slipstream_scheduler.protocols import LatencyModel
from slipstream_scheduler.types import BatchItem, Phase, RequestClass
from slipstream_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

CLASS_LABEL = {RequestClass.ONLINE: "online", RequestClass.OFFLINE: "offline"}

_HELD, _GRANTED, _DONE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Grant:
    """The dispatcher's submit decision for one request."""

    priority: int
    resume_from_tokens: int


class Ticket:
    """One request's place in the dispatcher, as seen by the task that serves it."""

    __slots__ = (
        "_fut",
        "_on_abort",
        "abort_reason",
        "arrival_s",
        "cls",
        "generated",
        "label",
        "prefilling",
        "prompt_tokens",
        "request_id",
        "state",
    )

    def __init__(
        self, request_id: str, cls: RequestClass, arrival_s: float, prompt_tokens: int = 0
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.generated = 0  # tokens of the current submission
        self.cls = cls
        self.label = CLASS_LABEL[cls]
        self.arrival_s = arrival_s
        self.state = _HELD
        self.prefilling = False  # granted, no token seen on this submission yet
        self.abort_reason: str | None = None
        self._fut: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        self._on_abort: Callable[[], None] | None = None

    async def granted(self) -> Grant:
        """Wait until the dispatcher submits this request.

        The future is awaited directly (no ``asyncio.shield``, which costs one
        more event-loop turn per grant): a waiter cancelled while held cancels
        it, and the pump then skips it (``_grant``) until the waiter's
        ``failed`` takes the request out.
        """
        return await self._fut

    def when_granted(self, callback: Callable[[Grant], None]) -> None:
        """Call ``callback`` with the grant when the dispatcher submits this request (at
        once when it has; never when the request leaves first). For a caller with no
        task of its own to wait in (the compiled front, ``front.py``)."""

        def done(fut: asyncio.Future[Grant]) -> None:
            if not fut.cancelled():
                callback(fut.result())

        if self._fut.done():
            done(self._fut)
        else:
            self._fut.add_done_callback(done)

    def on_abort(self, callback: Callable[[], None] | None) -> None:
        """What to do when the dispatcher aborts this request (close its stream)."""
        self._on_abort = callback

    @property
    def aborting(self) -> bool:
        return self.abort_reason is not None


class Controller:
    """Feeds a :class:`Dispatcher` and carries out its decisions."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: SidecarMetrics,
        *,
        tick_s: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
        sync_prefill_limit: int = 16,
    ) -> None:
        if sync_prefill_limit < 0:
            raise ValueError("sync_prefill_limit must be >= 0")
        self.dispatcher = dispatcher
        self.metrics = metrics
        self._clock = clock
        self._tick_s = tick_s
        self._tickets: dict[str, Ticket] = {}
        self._pump_scheduled = False
        self._ticker: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # set while anything is held
        self.held = {"online": 0, "offline": 0}
        self.in_flight = {"online": 0, "offline": 0}
        self.admitted_total = {"online": 0, "offline": 0}
        self.preempted_total = {"online": 0, "offline": 0}
        self.observed_step_s = 0.0
        self.decide_calls = 0
        self.sync_grants = 0  # online requests granted inside register (grant_now)
        self.sync_prefill_limit = sync_prefill_limit
        self.prefilling = 0  # granted requests with no token on their submission yet
        self.latency_model: LatencyModel | None = None  # for the predicted-step gauge only
        # Called when the engine's load as the dispatcher sees it may have changed (a
        # decision, a request leaving): the compiled front's allowance is recomputed.
        self.on_change: Callable[[], None] | None = None
        self._admitted = {label: metrics.admitted.labels(label) for label in ("online", "offline")}
        self._grants_at_arrival = metrics.grants_at_arrival

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="dispatch-tick")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None

    async def _tick(self) -> None:
        while True:
            if not (self.held["online"] or self.held["offline"]):
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self._tick_s)
            if self.held["online"] or self.held["offline"]:
                self._pump()

    def _held_more(self) -> None:
        if not self._wake.is_set():
            self._wake.set()

    def now(self) -> float:
        return self._clock()

    # -- events from the streams -------------------------------------------------------------

    def register(self, incoming: Incoming, *, grant_now: bool = False) -> Ticket:
        """A new request arrives; it is held until :meth:`Ticket.granted` resolves.

        ``grant_now``: decide at once when the request may be granted without
        waiting for the rest of this loop turn's arrivals (see the module doc);
        the returned ticket is then already granted (or, rarely, still held: the
        dispatcher declined it, and the coalesced pump takes over).
        """
        if incoming.request_id in self._tickets:
            raise KeyError(f"request {incoming.request_id} is already registered")
        ticket = Ticket(
            incoming.request_id, incoming.cls, incoming.arrival_s, incoming.prompt_tokens
        )
        self._tickets[incoming.request_id] = ticket
        self.held[ticket.label] += 1
        self._held_more()
        now = self.now()
        self.dispatcher.arrive(incoming, now)
        if grant_now and self._may_grant_now(ticket, incoming):
            self._apply(self.dispatcher.decide(now))
            if ticket.state == _GRANTED:
                self.sync_grants += 1
                self._grants_at_arrival.inc()
            if not (self.held["online"] or self.held["offline"]):
                return ticket
        # NOTE: deferred to the end of this event-loop turn (microseconds, far inside one
        # engine iteration), so a burst of arrivals is planned once rather than once each.
        self._schedule_pump()
        return ticket

    def register_sent(self, incomings: list[Incoming]) -> list[Ticket]:
        """Online requests the compiled front already sent to the engine, inside the
        allowance it held (:meth:`online_allowance`): decided at once, together
        (``Dispatcher.arrive_submitted``), so their tickets come back granted."""
        tickets = []
        for incoming in incomings:
            if incoming.request_id in self._tickets:
                raise KeyError(f"request {incoming.request_id} is already registered")
            ticket = Ticket(
                incoming.request_id, incoming.cls, incoming.arrival_s, incoming.prompt_tokens
            )
            self._tickets[incoming.request_id] = ticket
            self.held[ticket.label] += 1  # until the decision below takes it in flight
            tickets.append(ticket)
        self._apply(self.dispatcher.arrive_submitted(incomings, self.now()))
        for ticket in tickets:
            if ticket.state == _GRANTED:
                self.sync_grants += 1
                self._grants_at_arrival.inc()
        return tickets

    def online_allowance(self) -> tuple[int, int]:
        """(requests, KV blocks) online arrivals may take on arrival, with no decision
        each (``Dispatcher.online_allowance``); (0, 0) while one is held."""
        return self.dispatcher.online_allowance()

    def changed(self) -> None:
        """Something that bounds admission changed (a decision, a request leaving, a
        Drain): tell whoever follows it (``on_change``)."""
        if self.on_change is not None:
            self.on_change()

    def _may_grant_now(self, ticket: Ticket, incoming: Incoming) -> bool:
        """Online, first in line, fits now, and the core's decision is still cheap."""
        return (
            ticket.cls is RequestClass.ONLINE
            and self.held["online"] == 1  # this one: no held online request precedes it
            and self.prefilling < self.sync_prefill_limit
            and self._online_fits(0, incoming.prompt_tokens + incoming.max_tokens)
        )

    def progress(self, ticket: Ticket, generated_tokens: int) -> None:
        """``generated_tokens`` seen so far on this submission's stream."""
        if ticket.state == _GRANTED:
            if ticket.prefilling and generated_tokens > 0:
                ticket.prefilling = False
                self.prefilling -= 1
            ticket.generated = generated_tokens
            self.dispatcher.progress(ticket.request_id, generated_tokens, self.now())
            self._schedule_pump()

    def observe_gap(self, gap_s: float) -> None:
        """A token gap of any stream: the engine's iteration time, smoothed."""
        self.observed_step_s += 0.05 * (gap_s - self.observed_step_s)

    def finished(self, ticket: Ticket, output_tokens: int) -> None:
        """The stream ended normally after ``output_tokens`` (left in ``ticket.generated``)."""
        if ticket.state == _GRANTED:
            ticket.generated = output_tokens
        if self._leave(ticket):
            self.dispatcher.finished(ticket.request_id, output_tokens, self.now())
            self._schedule_pump()
            self.changed()

    def failed(self, ticket: Ticket) -> None:
        """The request leaves: engine error, client gone, or shard revoked."""
        if self._leave(ticket):
            self.dispatcher.failed(ticket.request_id, self.now())
            self._schedule_pump()
            self.changed()

    def aborted(self, ticket: Ticket) -> None:
        """The stream of an aborted request is closed; it waits for its next grant."""
        if ticket.state != _GRANTED:
            return
        self._prefill_done(ticket)
        self.in_flight[ticket.label] -= 1
        self.held[ticket.label] += 1
        self._held_more()
        ticket.state = _HELD
        ticket.prompt_tokens += ticket.generated
        ticket.generated = 0
        ticket.abort_reason = None
        ticket._on_abort = None
        ticket._fut = asyncio.get_running_loop().create_future()
        self.dispatcher.aborted(ticket.request_id, self.now())
        self._schedule_pump()

    def _leave(self, ticket: Ticket) -> bool:
        if ticket.state == _DONE:
            return False
        if ticket.state == _HELD:
            self.held[ticket.label] -= 1
        else:
            self._prefill_done(ticket)
            self.in_flight[ticket.label] -= 1
        ticket.state = _DONE
        self._tickets.pop(ticket.request_id, None)
        if not ticket._fut.done():
            ticket._fut.cancel()
        return True

    def _prefill_done(self, ticket: Ticket) -> None:
        if ticket.prefilling:
            ticket.prefilling = False
            self.prefilling -= 1

    # -- decisions ---------------------------------------------------------------------------

    def set_budget(self, budget_s: float | None) -> None:
        self.dispatcher.set_budget(budget_s)
        self.metrics.budget.set(budget_s or 0.0)
        self._schedule_pump()

    def online_fits_now(self, tokens: int) -> bool:
        """Whether one more online request of ``tokens`` (prompt + output) would be
        submitted at the next decision along with every online request held now.

        True when the held online requests plus this one fit the free sequence
        slots (online in flight counted; offline in flight is preempted for
        online work, so it does not count) and, at this request's size each,
        the estimated free KV blocks. The ordering then cannot change what is
        submitted, only in which order within one decision.
        """
        return self._online_fits(self.held["online"] + 1, tokens)

    def _online_fits(self, waiting: int, tokens: int) -> bool:
        """``waiting`` online requests (at least one) of ``tokens`` each fit the free slots
        and estimated KV blocks."""
        waiting = max(waiting, 1)
        d = self.dispatcher
        cap = d.limits.max_num_seqs
        if d.config.max_online_inflight is not None:
            cap = min(cap, d.config.max_online_inflight)
        if self.in_flight["online"] + waiting > cap:
            return False
        blocks = -(-tokens // d.limits.block_size)
        return d.est_free_kv_blocks >= waiting * blocks

    def _schedule_pump(self) -> None:
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._scheduled_pump)

    def _scheduled_pump(self) -> None:
        self._pump_scheduled = False
        self._pump()

    def _pump(self) -> None:
        self._apply(self.dispatcher.decide(self.now()))

    def _apply(self, dec: Decisions) -> None:
        """Carry out one decision: resolve the tickets it submits, abort the ones it aborts."""
        self.decide_calls += 1
        for sub in dec.submit:
            ticket = self._tickets.get(sub.request_id)
            if ticket is None or ticket.state != _HELD:
                log.warning("dispatcher submitted unknown or busy request %s", sub.request_id)
                continue
            ticket.state = _GRANTED
            ticket.prefilling = True
            self.prefilling += 1
            self.held[ticket.label] -= 1
            self.in_flight[ticket.label] += 1
            self.admitted_total[ticket.label] += 1
            self._admitted[ticket.label].inc()
            if not ticket._fut.done():  # cancelled: its waiter's ``failed`` follows
                ticket._fut.set_result(Grant(sub.priority, sub.resume_from_tokens))
        for ab in dec.abort:
            ticket = self._tickets.get(ab.request_id)
            if ticket is None or ticket.state != _GRANTED or ticket.aborting:
                continue
            ticket.abort_reason = ab.reason
            self.preempted_total[ticket.label] += 1
            self.metrics.preemptions.labels(ticket.label).inc()
            if ticket._on_abort is not None:
                ticket._on_abort()
        if dec.submit and (self.held["online"] or self.held["offline"]):
            # The dispatcher shows the planner at most ``lookahead`` requests per
            # decision: plan again in the next loop turn rather than at the next
            # stream event or tick (a burst of 256 arrivals would wait 8 ticks).
            self._schedule_pump()
        if dec.submit or dec.abort:
            self.changed()
            log.debug(
                "dispatch: submit=%d abort=%d held=%s in_flight=%s",
                len(dec.submit),
                len(dec.abort),
                self.held,
                self.in_flight,
            )

    def stats(self) -> DispatcherStats:
        return self.dispatcher.stats()

    def running_batch(self) -> list[BatchItem]:
        """The engine's steady-state decode batch as the streams show it (for predictions)."""
        return [
            BatchItem(Phase.DECODE, 1, t.prompt_tokens + t.generated)
            for t in self._tickets.values()
            if t.state == _GRANTED
        ]

    def predicted_step_s(self) -> float:
        """The latency model's iteration time for the in-flight batch (0: no model)."""
        if self.latency_model is None:
            return 0.0
        return float(self.latency_model.predict(self.running_batch()))

    def refresh_gauges(self) -> None:
        for label in ("online", "offline"):
            self.metrics.queued.labels(label).set(self.held[label])
            self.metrics.in_flight.labels(label).set(self.in_flight[label])
        self.metrics.step.labels("observed").set(self.observed_step_s)
        self.metrics.step.labels("predicted").set(self.predicted_step_s())
