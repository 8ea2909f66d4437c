"""Time the operator's event loop loses to Python's cyclic garbage collector.

A collection runs in whichever thread triggers it and holds the GIL throughout, so while it
runs no tick makes progress. With a large heap (kopf's copy of every watched body, the
sidecars' cached replies) a collection of the oldest generation can take a noticeable share
of a second, and that share lands directly on the status lag. :class:`GcTimes` hooks
``gc.callbacks`` and keeps, per generation, the collections, the seconds spent in them and
the longest one; the operator's ``/metrics`` serves them (``slipstream_operator_gc_*``).

At 1,000 nodes the collector took a third of the operator's CPU (0.26 of 0.75 cores; most
of it full collections of the oldest generation), so the operator also tunes it
(:func:`tune`, :func:`refreeze_schedule`): a larger threshold for the youngest generation, so
that objects that live for one tick die young instead of being promoted, and a periodic
``gc.collect()`` + ``gc.freeze()``, so that routine collections of the oldest generation skip
everything that was alive at the last freeze (kopf's copies of the watched bodies, the
indexes, the imported code). A freeze is undone first (``gc.unfreeze()``), so cyclic garbage
among once-frozen objects is collected at the next one rather than kept forever.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

GENERATIONS = (0, 1, 2)
FIRST_FREEZE_S = 60.0
"""Seconds after start of the first freeze; the gap then doubles up to the interval."""


@dataclass(frozen=True, slots=True)
class GcGeneration:
    """Totals for one generation since :meth:`GcTimes.install`."""

    collections: int
    seconds: float
    longest_s: float


class GcTimes:
    """Collections, seconds and the longest pause per generation, from ``gc.callbacks``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._collections = [0, 0, 0]
        self._seconds = [0.0, 0.0, 0.0]
        self._longest = [0.0, 0.0, 0.0]

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        started, self._started = self._started, None
        generation = info.get("generation")
        if started is None or generation not in GENERATIONS:
            return
        elapsed = max(self._clock() - started, 0.0)
        with self._lock:
            self._collections[generation] += 1
            self._seconds[generation] += elapsed
            self._longest[generation] = max(self._longest[generation], elapsed)

    def snapshot(self) -> dict[int, GcGeneration]:
        with self._lock:
            return {g: GcGeneration(self._collections[g], self._seconds[g], self._longest[g])
                    for g in GENERATIONS}


def tune(young_threshold: int) -> tuple[int, int, int]:
    """Set the youngest generation's threshold (0: leave Python's default); returns the
    thresholds in force."""
    if young_threshold > 0:
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, middle, oldest)
    threshold: tuple[int, int, int] = gc.get_threshold()
    return threshold


def refreeze(full: bool = True) -> int:
    """Freeze what is alive now; returns how many objects are frozen.

    ``full``: unfreeze and collect every generation first (one pause over the whole heap), so
    cyclic garbage among once-frozen objects is freed. Without it the freeze costs no
    collection: what is already garbage in a cycle stays frozen until the next full one.
    """
    if full:
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def refreeze_schedule(interval_s: float,
                      first_s: float = FIRST_FREEZE_S) -> Iterator[tuple[float, bool]]:
    """``(gap, full)`` of each freeze: gaps of ``first_s``, then doubling, then ``interval_s``
    for ever (the heap grows most while the operator lists and places a fleet, early in its
    life); a freeze is full once ``interval_s`` has passed since the last full one (or the
    start), so the early ones cost no pause and the full collection runs once an interval."""
    gap = min(first_s, interval_s)
    since_full = 0.0
    while True:
        since_full += gap
        full = since_full >= interval_s
        yield gap, full
        if full:
            since_full = 0.0
        gap = min(gap * 2, interval_s)


async def refreeze_forever(interval_s: float,
                           sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """:func:`refreeze` on :func:`refreeze_schedule` until cancelled (the operator's life)."""
    for gap, full in refreeze_schedule(interval_s):
        await sleep(gap)
        started = time.perf_counter()
        frozen = refreeze(full)
        logger.debug("gc: froze %d objects in %.3fs (full: %s)", frozen,
                     time.perf_counter() - started, full)
