"""Each pod's ``Status`` as a ``WatchStatus`` stream, and the service ticks it wakes.

Polling ``Status`` on a timer makes a change on a pod wait for its service's next tick (up to
one reconcile interval) and costs one gRPC call per pod per interval. Here the operator keeps
one ``WatchStatus`` stream per pod instead. The sidecar sends a snapshot every interval (the
heartbeat) and, with ``min_interval_s``, as soon as what the operator acts on changes
(``slipstream_sidecar.watch``: budgets and generation in force, readiness, draining, the
online counters), at most once per ``min_interval_s``.

* :class:`StatusFeed` runs the streams. Each snapshot goes into the shared ``Status`` cache
  (:meth:`SharedSidecarControl.offer`) as a *live* reply: while its stream is up it answers
  every look however old it is, because a change would have been sent. A snapshot whose
  change signature differs from the pod's previous one wakes the pod's owner (its
  InferenceService). A stream that fails is retried with backoff; meanwhile the pod is
  asked with unary ``Status`` as before.
* :class:`TickPacer` decides when a service ticks: on its own grid every ``interval_s``, and
  ``settle_s`` after a wake (so that the other pods' snapshots of the same change arrive
  too), but never twice within ``min_gap_s``. A change therefore reaches the status within
  about ``settle_s`` plus one tick when the service has been quiet, and within ``min_gap_s``
  plus one tick when its pods keep changing (then it ticks every ``min_gap_s``).

Deliberately left out: waking job ticks (their status is progress, which the heartbeat
carries every interval), and a stream per pod per owner (a pod is followed for one service).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from slipstream_operator.errors import SidecarError
from slipstream_operator.sidecar_client import PodAddress, SharedSidecarControl, SidecarStatus

logger = logging.getLogger(__name__)

SETTLE_S = 0.25
"""Seconds a woken tick waits for the rest of its pods' snapshots of the same change."""

RETRY_S = (0.5, 10.0)
"""First and largest wait before a failed stream is opened again (doubling in between)."""


class WatchFn(Protocol):
    """Opens one pod's stream: (change signature, status) per snapshot; raises SidecarError."""

    def __call__(self, address: PodAddress, *, interval_s: float,
                 min_interval_s: float) -> AsyncIterator[tuple[Hashable, SidecarStatus]]: ...


@dataclass
class _Stream:
    address: PodAddress
    owner: str
    task: asyncio.Task[None] | None = None
    signature: Hashable | None = None
    up: bool = False


class StatusFeed:
    """One ``WatchStatus`` stream per followed pod, feeding ``control``'s cache."""

    def __init__(self, control: SharedSidecarControl, watch: WatchFn, *, interval_s: float,
                 min_interval_s: float, on_change: Callable[[str], None],
                 retry_s: tuple[float, float] = RETRY_S) -> None:
        self.control = control
        self._watch = watch
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self._on_change = on_change
        self._retry_s = retry_s
        self._streams: dict[str, _Stream] = {}  # pod name -> its stream
        self.snapshots = 0
        """Snapshots received, over all streams."""
        self.changes = 0
        """Snapshots whose change signature differed from the pod's previous one."""
        self.opened = 0
        """Streams opened (first opens and re-opens after a failure)."""
        self.up = 0
        """Streams up now (kept as a count: the metrics thread reads it)."""

    @property
    def live_for_s(self) -> float:
        """How long a snapshot stays live without another: one heartbeat, plus slack."""
        return 1.5 * self.interval_s + 1.0

    def follow(self, owner: str, addresses: Iterable[PodAddress]) -> None:
        """Stream exactly ``addresses`` for ``owner``: open new ones, close the owner's others.

        A pod whose address or token changed gets a new stream.
        """
        wanted = {a.pod: a for a in addresses}
        for pod, stream in list(self._streams.items()):
            if stream.owner == owner and wanted.get(pod) != stream.address:
                self._stop(pod)
        for pod, address in wanted.items():
            current = self._streams.get(pod)
            if current is not None and current.address == address:
                continue
            if current is not None:  # followed for another owner: the newest owner takes it
                self._stop(pod)
            stream = _Stream(address, owner)
            stream.task = asyncio.ensure_future(self._run(stream))
            self._streams[pod] = stream

    def drop(self, owner: str) -> None:
        """Close every stream of ``owner`` (its InferenceService is gone)."""
        for pod in [p for p, s in self._streams.items() if s.owner == owner]:
            self._stop(pod)

    def streaming(self, owner: str | None = None) -> int:
        """Streams that are up (of ``owner``, or all)."""
        return sum(1 for s in self._streams.values()
                   if s.up and (owner is None or s.owner == owner))

    def _stop(self, pod: str) -> None:
        stream = self._streams.pop(pod)
        self._down(stream)
        if stream.task is not None:
            stream.task.cancel()
        self.control.unlive(stream.address)

    async def _run(self, stream: _Stream) -> None:
        wait, longest = self._retry_s
        while True:
            try:
                self.opened += 1
                async for signature, status in self._watch(
                        stream.address, interval_s=self.interval_s,
                        min_interval_s=self.min_interval_s):
                    if not stream.up:
                        stream.up = True
                        self.up += 1
                    wait = self._retry_s[0]
                    self.snapshots += 1
                    self.control.offer(stream.address, status, live_for_s=self.live_for_s)
                    previous, stream.signature = stream.signature, signature
                    if previous is not None and previous != signature:
                        self.changes += 1
                        self._on_change(stream.owner)
                logger.info("WatchStatus of pod %s ended; opening it again", stream.address.pod)
            except SidecarError as exc:
                logger.info("%s", exc)
            self._down(stream)
            self.control.unlive(stream.address)
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)

    def _down(self, stream: _Stream) -> None:
        if stream.up:
            stream.up = False
            self.up -= 1

    def stats(self) -> dict[str, float]:
        """Counters for the operator's metrics (safe to call from another thread)."""
        return {"streams": float(self.up), "snapshots": float(self.snapshots),
                "changes": float(self.changes), "opened": float(self.opened)}

    async def close(self) -> None:
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for pod in list(self._streams):
            self._stop(pod)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass
class _Pace:
    due_s: float
    last_s: float = float("-inf")
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class TickPacer:
    """When each owner (an InferenceService's uid) ticks; see the module docstring."""

    def __init__(self, *, interval_s: float, min_gap_s: float, settle_s: float = SETTLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or min_gap_s < 0 or settle_s < 0:
            raise ValueError("interval_s must be positive; min_gap_s and settle_s not negative")
        self.interval_s = interval_s
        self.min_gap_s = min(min_gap_s, interval_s)
        self.settle_s = settle_s
        self._clock = clock
        self._paces: dict[str, _Pace] = {}
        self.woken_turns = 0
        """Turns that a change started (the rest were due on the grid)."""

    def wake(self, owner: str) -> None:
        """Something ``owner`` shows changed: tick soon (unknown owners are ignored)."""
        pace = self._paces.get(owner)
        if pace is not None:
            pace.woken.set()

    def pending(self, owner: str) -> bool:
        """Whether a change woke ``owner`` since its last turn."""
        pace = self._paces.get(owner)
        return pace is not None and pace.woken.is_set()

    def forget(self, owner: str) -> None:
        pace = self._paces.pop(owner, None)
        if pace is not None:
            pace.woken.set()  # a turn still waiting returns at once

    async def turn(self, owner: str,
                   stopped: Callable[[], Awaitable[object]] | None = None) -> str:
        """Wait for ``owner``'s next tick; returns ``"due"``, ``"change"`` or ``"stopped"``.

        The first turn of an owner is due at once. ``stopped`` (kopf's ``stopped.wait``) ends
        the wait early.
        """
        pace = self._paces.get(owner)
        if pace is None:
            pace = self._paces[owner] = _Pace(due_s=self._clock())
        reason = ""
        while not reason:
            now = self._clock()
            if now >= pace.due_s:
                reason = "due"
                break
            until = pace.due_s
            if pace.woken.is_set():
                ready_s = max(pace.last_s + self.min_gap_s, now + self.settle_s)
                if ready_s < pace.due_s:
                    if await self._sleep(ready_s - now, stopped):
                        return "stopped"
                    reason = "change" if self._clock() < pace.due_s else "due"
                    break
                pace.woken.clear()  # the grid's own tick comes first and will see the change
            if await self._wait(pace.woken, until - now, stopped):
                return "stopped"
            if self._paces.get(owner) is not pace:
                return "stopped"
        now = self._clock()
        pace.woken.clear()
        pace.last_s = now
        if reason == "change":
            self.woken_turns += 1
        # Keep the owner's grid; a grid tick closer than min_gap_s to this one is skipped.
        while pace.due_s < now + self.min_gap_s:
            pace.due_s += self.interval_s
        return reason

    @staticmethod
    async def _sleep(delay: float, stopped: Callable[[], Awaitable[object]] | None) -> bool:
        if stopped is None:
            await asyncio.sleep(delay)
            return False
        stop = asyncio.ensure_future(stopped())
        try:
            done, _ = await asyncio.wait({stop}, timeout=delay)
        finally:
            stop.cancel()
        return bool(done)

    @staticmethod
    async def _wait(event: asyncio.Event, delay: float,
                    stopped: Callable[[], Awaitable[object]] | None) -> bool:
        waiters: set[asyncio.Future[object]] = {asyncio.ensure_future(event.wait())}
        stop = asyncio.ensure_future(stopped()) if stopped is not None else None
        if stop is not None:
            waiters.add(stop)
        try:
            done, _ = await asyncio.wait(waiters, timeout=delay,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return stop is not None and stop in done
