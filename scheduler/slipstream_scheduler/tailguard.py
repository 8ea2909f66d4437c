"""The tail guard of size-based orderings: past a deadline, a request is served in deadline order.

Size-based orderings (SJF, TRAIL-like, Gittins) lower the mean by serving small requests
first, and so leave a large request waiting while small ones keep arriving: inside vLLM at
load 0.9, Gittins' p99 TTFT is about twice FCFS's and its longest wait about 3.6 times
(``docs/benchmarks/ordering.md``). The guard bounds that wait without giving up the order
below the bound:

* every waiting online request has a deadline, ``arrival + max_wait_s``;
* a request past its deadline (*overdue*) is served before every request that is not, and
  overdue requests among themselves in deadline order (earliest first);
* the rest keep the ordering's key (Gittins rank, expected cost, ...).

Two results carry it. Below the deadline the key is the ordering's own (Gittins' rank
minimises mean response time for sizes known by distribution, Gittins 1989; Scully et al.
2018). Past it, earliest-deadline-first is Jackson's rule (1955): on one server it minimises
the maximum lateness, so no order of the overdue requests keeps the worst of them closer to
its deadline. With one ``max_wait_s`` for every request, deadline order is arrival order, so
an overdue request waits at most what FCFS would make it wait behind the overdue requests
that arrived before it.

The guard is part of an ordering's parameters (``max_wait_s``, ``ordering.py``); the
orderings carry it as ``ordering.guard``. The sidecar's queue (``dispatcher.OrderingQueue``)
and the plugin inside vLLM (``slipstream_vllm.scheduler``) both sort with :meth:`TailGuard.rank`.
Where requests can be displaced (preempted and recomputed), an overdue request held out by KV
blocks or slots displaces running requests that are not overdue, worst-ranked first, each at
most :data:`GUARD_MAX_DISPLACEMENTS` times; an overdue request is never displaced.

Where the deadline comes from in a pod (:func:`max_wait_for`): the service's own setting
(``spec.scheduling.maxWait``; 0 turns the guard off), else its TTFT p99 target, else four
times its TTFT mean target, else :data:`DEFAULT_MAX_WAIT_S`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_MAX_WAIT_S",
    "GUARD_MAX_DISPLACEMENTS",
    "MEAN_TARGET_FACTOR",
    "TailGuard",
    "max_wait_for",
    "unguarded_rank",
]

DEFAULT_MAX_WAIT_S = 30.0
"""The deadline of a service that sets neither ``maxWait`` nor a TTFT target, seconds."""

GUARD_MAX_DISPLACEMENTS = 1
"""How many times a request may be displaced for overdue ones (its recompute bounds how long
an overdue request waits for room)."""

MEAN_TARGET_FACTOR = 4.0
"""With only a TTFT mean target, the deadline is this many times it (a mean target says
where the bulk of first tokens should land, not the tail)."""


@dataclass(frozen=True, slots=True)
class TailGuard:
    """Deadline ``arrival + max_wait_s``; overdue requests first, in deadline order."""

    max_wait_s: float

    def __post_init__(self) -> None:
        if not (self.max_wait_s > 0 and math.isfinite(self.max_wait_s)):
            raise ValueError(f"max_wait_s must be finite and > 0, got {self.max_wait_s!r}")

    def overdue(self, arrival_s: float, now_s: float) -> bool:
        return now_s - arrival_s >= self.max_wait_s

    def rank(self, key: float, arrival_s: float, now_s: float) -> tuple[int, float, float]:
        """Sort key: overdue requests ``(0, arrival, 0)`` before the rest ``(1, key, arrival)``."""
        if now_s - arrival_s >= self.max_wait_s:
            return (0, arrival_s, 0.0)
        return (1, key, arrival_s)


def unguarded_rank(key: float, arrival_s: float) -> tuple[int, float, float]:
    """The sort key of an ordering without a guard, comparable with :meth:`TailGuard.rank`."""
    return (1, key, arrival_s)


def max_wait_for(
    *,
    max_wait_s: float | None = None,
    ttft_p99_s: float | None = None,
    ttft_mean_s: float | None = None,
) -> float | None:
    """The deadline a service's settings give the guard, seconds; ``None``: no guard.

    ``max_wait_s`` set: it (0: off). Else the TTFT p99 target, else
    :data:`MEAN_TARGET_FACTOR` times the TTFT mean target, else :data:`DEFAULT_MAX_WAIT_S`.
    """
    if max_wait_s is not None:
        if max_wait_s < 0 or not math.isfinite(max_wait_s):
            raise ValueError(f"max_wait_s must be finite and >= 0, got {max_wait_s!r}")
        return max_wait_s or None
    if ttft_p99_s:
        return ttft_p99_s
    if ttft_mean_s:
        return MEAN_TARGET_FACTOR * ttft_mean_s
    return DEFAULT_MAX_WAIT_S
