"""How late the operator's event loop runs what it scheduled: the loop's own queueing delay.

Every tick, every sidecar reply and every watch event of the operator runs on one asyncio
loop. When the loop is busy (a burst of replies, a garbage collection, a slow handler), a
tick that is due waits, and that wait lands on the status lag. :class:`LoopLag` measures it
directly: a probe task sleeps ``period_s`` and records by how much it woke late. The
operator's ``/metrics`` serves the histogram (``slipstream_operator_event_loop_lag_seconds``).

Deliberately left out: which callback held the loop (a profiler's job, e.g. py-spy).
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Upper bounds (s) of the histogram's buckets; one more, +Inf, is implied."""


@dataclass(frozen=True, slots=True)
class LagHistogram:
    """Counts per bucket (``BUCKETS`` then +Inf, not cumulative), their sum and count."""

    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class LoopLag:
    """A histogram of the probe's wake-up delays."""

    def __init__(self, period_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive, not {period_s}")
        self.period_s = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts = [0] * (len(BUCKETS) + 1)
        self._sum = 0.0

    def observe(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        with self._lock:
            self._counts[bisect.bisect_left(BUCKETS, lag_s)] += 1
            self._sum += lag_s

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            before = self._clock()
            await asyncio.sleep(self.period_s)
            self.observe(self._clock() - before - self.period_s)

    def snapshot(self) -> LagHistogram:
        with self._lock:
            return LagHistogram(tuple(self._counts), self._sum)
