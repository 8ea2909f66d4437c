"""Request orderings (FCFS, SJF, TRAIL-like, Gittins) behind one small Protocol, and the queue.

An ``Ordering`` turns a request's state (``RequestView``) into a sort key,
smaller first. Keys are computed when the state changes (arrival, and for
refreshing orderings when ``refresh_needed`` says a bucket boundary was
crossed), never per token, and kept in a ``KeyedQueue``: a heap of
``(key, seq, request_id)`` with lazy deletion, shared by the sidecar and the
simulator.

The orderings (registry ``ORDERINGS``; each has a pydantic params model):

* ``fcfs``: arrival time. Never refreshed, never preempts.
* ``sjf``: expected cost ``E[C] = E[O²]/2 + I·E[O]`` over the predicted sample
  ("mean of costs", unbiased, unlike the cost of the mean length, which
  ignores the spread; ``key="cost_of_mean"`` selects the latter). Key fixed at
  arrival, non-preemptive: SageSched's "Mean" ablation.
* ``trail``: shortest expected remaining cost ``E[C(O) − C(o) | O > o]``,
  refreshed every ``refresh_every_tokens``; limited preemption after TRAIL: a
  running request may be preempted only while ``o < c·E[O]`` (``c`` = 0.5)
  and at most ``max_preemptions`` times.
* ``gittins``: the Gittins rank at attained service (``gittins.py``), refreshed
  at bucket boundaries (200 tokens); a waiting request preempts the worst
  running one when its rank is below ``(1 − margin)`` times that one's
  (``margin`` = 0.15), at most ``max_preemptions`` times per request.

Request cost: ``sjf`` and the non-preemptive ``trail`` and ``gittins``
(``max_preemptions=0``, what the sidecar runs) default to SageSched's
``memory`` cost; preemptive ``trail`` and ``gittins`` default to ``output``
(``C = O``), which measured better for them under a slot cap, where it left
the non-preemptive ones level (``docs/benchmarks/ordering.md``; the 100-token
re-key interval measured no better than 200, so that default stays).

A request that outlived its predicted sample is handled by the outliving rule
of ``gittins.surviving_lengths`` (fallback sample, else ``O = 2·o``). The
fallback is the predictor's global distribution, kept by :class:`GlobalFallback`:
one rule for the sidecar's ``OrderingQueue`` and the engine plugin.

Errors::

    OrderingError
     └── UnknownOrderingError(name)

Deliberately left out: how requests are admitted or preempted (the planner and
the sidecar decide; an ordering only says whether a preemption is allowed), and
where the predicted sample comes from (``lengths.py``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, model_validator

from slipstream_scheduler.gittins import (
    DEFAULT_REFRESH_EVERY_TOKENS,
    CostKind,
    gittins_rank_sorted,
    remaining_cost_sample,
    request_cost,
)
from slipstream_scheduler.tailguard import TailGuard

__all__ = [
    "ORDERINGS",
    "FcfsOrdering",
    "FcfsParams",
    "GittinsOrdering",
    "GittinsParams",
    "KeyedQueue",
    "Ordering",
    "OrderingError",
    "RequestView",
    "SjfOrdering",
    "SjfParams",
    "TrailOrdering",
    "TrailParams",
    "UnknownOrderingError",
    "make_ordering",
]

FloatArray = npt.NDArray[np.float64]
_EMPTY: FloatArray = np.empty(0, dtype=np.float64)


class OrderingError(Exception):
    """Base of this module's errors."""


class UnknownOrderingError(OrderingError, KeyError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown ordering {name!r}; known: {sorted(ORDERINGS)}")
        self.name = name


@dataclass(frozen=True, slots=True, eq=False)
class RequestView:
    """What an ordering may look at. Build with ``RequestView.create`` (sorts the samples).

    ``lengths`` are the predicted output-length samples (tokens, ascending,
    equally likely); ``fallback`` the sample used once a request outlives them
    (e.g. the global distribution; empty: the ``O = 2·o`` rule).
    ``keyed_at_tokens`` is ``generated_tokens`` when the current key was
    computed (-1: never).
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    lengths: FloatArray
    generated_tokens: int = 0
    fallback: FloatArray = field(default_factory=lambda: _EMPTY)
    keyed_at_tokens: int = -1
    preemptions: int = 0

    @classmethod
    def create(
        cls,
        request_id: str,
        arrival_s: float,
        input_tokens: int,
        lengths: FloatArray | Sequence[float],
        *,
        fallback: FloatArray | Sequence[float] | None = None,
        generated_tokens: int = 0,
    ) -> RequestView:
        fb = _EMPTY if fallback is None else np.sort(np.asarray(fallback, dtype=np.float64))
        return cls(
            request_id=request_id,
            arrival_s=arrival_s,
            input_tokens=input_tokens,
            lengths=np.sort(np.asarray(lengths, dtype=np.float64)),
            generated_tokens=generated_tokens,
            fallback=fb,
        )

    def _fallback(self) -> FloatArray | None:
        return self.fallback if self.fallback.shape[0] else None

    def remaining_costs(self, cost: CostKind = "memory") -> FloatArray:
        """Ascending ``C(O) − C(o)`` over the samples still possible (outliving rule applied)."""
        return remaining_cost_sample(
            self.lengths, self.input_tokens, self.generated_tokens, self._fallback(), cost
        )

    def predicted_mean_tokens(self) -> float:
        if self.lengths.shape[0] == 0:
            return float(max(2 * self.generated_tokens, 1))
        return float(self.lengths.mean())


@runtime_checkable
class Ordering(Protocol):
    """A request ordering. Smaller keys are served first.

    Contract: ``key`` is a pure function of the view (no clock, no state);
    the caller computes it on arrival and again only when ``refresh_needed``
    is true, and records ``keyed_at_tokens``. ``may_preempt`` is asked only
    when ``preemptive`` is true: whether a waiting request with key
    ``waiting_key`` may displace ``running`` (whose current key is
    ``running_key``). ``guard`` (``tailguard.py``): the deadline past which a waiting
    request is served in deadline order; ``None``: none. The queue applies it, not ``key``.
    ``needs_lengths``: whether ``key`` and ``may_preempt`` read the view's predicted
    ``lengths`` (a caller may skip predicting them when not).
    """

    name: str
    preemptive: bool
    needs_lengths: bool
    guard: TailGuard | None

    def key(self, view: RequestView) -> float: ...

    def refresh_needed(self, view: RequestView) -> bool: ...

    def may_preempt(self, waiting_key: float, running: RequestView, running_key: float) -> bool: ...


def _guard(max_wait_s: float | None) -> TailGuard | None:
    return TailGuard(max_wait_s) if max_wait_s is not None else None


def _bucket_crossed(view: RequestView, every: int) -> bool:
    if view.keyed_at_tokens < 0:
        return True
    return view.generated_tokens // every != view.keyed_at_tokens // every


# --------------------------------------------------------------------------- FCFS


class FcfsParams(BaseModel):
    """FCFS has no knobs."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class FcfsOrdering:
    name = "fcfs"
    preemptive = False
    needs_lengths = False
    guard: TailGuard | None = None  # arrival order is deadline order already

    def __init__(self, params: FcfsParams | None = None) -> None:
        self.params = params if params is not None else FcfsParams()

    def key(self, view: RequestView) -> float:
        return view.arrival_s

    def refresh_needed(self, view: RequestView) -> bool:
        return view.keyed_at_tokens < 0

    def may_preempt(self, waiting_key: float, running: RequestView, running_key: float) -> bool:
        return False


# --------------------------------------------------------------------------- SJF


class SjfParams(BaseModel):
    """Knobs of SJF on the predicted distribution."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: Literal["mean_cost", "cost_of_mean"] = Field(
        default="mean_cost",
        description="'mean_cost' = E[O²/2 + I·O]; 'cost_of_mean' = C(E[O]). Default 'mean_cost'.",
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="Tail guard: a request that has waited this long (seconds) is served in "
        "deadline order ahead of the ranked ones (tailguard.py). None: no guard.",
    )
    cost: CostKind = Field(
        default="memory",
        description="'memory' = O²/2 + I·O (SageSched: KV memory bounds the batch); 'output' = "
        "O (decode steps: a slot cap bounds the batch). Default 'memory'.",
    )


class SjfOrdering:
    name = "sjf"
    preemptive = False
    needs_lengths = True

    def __init__(self, params: SjfParams | None = None) -> None:
        self.params = params if params is not None else SjfParams()
        self.guard = _guard(self.params.max_wait_s)

    def key(self, view: RequestView) -> float:
        cost = self.params.cost
        if self.params.key == "cost_of_mean":
            return float(request_cost(view.input_tokens, view.predicted_mean_tokens(), cost))
        return float(view.remaining_costs(cost).mean())

    def refresh_needed(self, view: RequestView) -> bool:
        return view.keyed_at_tokens < 0

    def may_preempt(self, waiting_key: float, running: RequestView, running_key: float) -> bool:
        return False


# --------------------------------------------------------------------------- TRAIL-like


def _default_cost(data: object) -> object:
    """Params validator: an unset ``cost`` is ``output`` if preemptive, else ``memory``.

    NOTE: a default measured per mode (``docs/benchmarks/ordering.md``): under a
    slot cap the output cost lowers the mean TTLT of preemptive TRAIL and Gittins
    at every load, and leaves non-preemptive Gittins level, where SageSched's cost stays.
    """
    if isinstance(data, dict) and "cost" not in data:
        preemptive = int(data.get("max_preemptions", 1)) > 0
        return {**data, "cost": "output" if preemptive else "memory"}
    return data


class TrailParams(BaseModel):
    """Knobs of the TRAIL-like shortest-remaining-predicted-cost ordering."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refresh_every_tokens: int = Field(
        default=DEFAULT_REFRESH_EVERY_TOKENS,
        ge=1,
        description="Re-key every this many tokens. 200.",
    )
    preempt_before_fraction: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description="c: preemptible only while generated < c·E[O], fraction. Default 0.5.",
    )
    max_preemptions: int = Field(
        default=1, ge=0, description="Per-request preemption cap. Default 1."
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="Tail guard: a request that has waited this long (seconds) is served in "
        "deadline order ahead of the ranked ones (tailguard.py). None: no guard.",
    )
    cost: CostKind = Field(
        default="output",
        description="'memory' = O²/2 + I·O (SageSched: KV memory bounds the batch); 'output' = "
        "O (decode steps: a slot cap bounds the batch). Default: 'output' when preemptive "
        "(max_preemptions > 0; measured lower mean TTLT under a slot cap at every load, "
        "docs/benchmarks/ordering.md), 'memory' when not (SageSched's).",
    )

    _cost_default = model_validator(mode="before")(_default_cost)


class TrailOrdering:
    name = "trail"
    preemptive = True
    needs_lengths = True

    def __init__(self, params: TrailParams | None = None) -> None:
        self.params = params if params is not None else TrailParams()
        self.guard = _guard(self.params.max_wait_s)
        # A cap of 0 makes the ordering non-preemptive: keys only, no displacement.
        self.preemptive = self.params.max_preemptions > 0

    def key(self, view: RequestView) -> float:
        return float(view.remaining_costs(self.params.cost).mean())

    def refresh_needed(self, view: RequestView) -> bool:
        return _bucket_crossed(view, self.params.refresh_every_tokens)

    def may_preempt(self, waiting_key: float, running: RequestView, running_key: float) -> bool:
        p = self.params
        early = (
            running.generated_tokens < p.preempt_before_fraction * running.predicted_mean_tokens()
        )
        return early and running.preemptions < p.max_preemptions and waiting_key < running_key


# --------------------------------------------------------------------------- Gittins


class GittinsParams(BaseModel):
    """Knobs of Gittins-rank ordering (SageSched)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    refresh_every_tokens: int = Field(
        default=DEFAULT_REFRESH_EVERY_TOKENS,
        ge=1,
        description="Bucket size: re-rank every this many output tokens. Default 200.",
    )
    preempt_margin: float = Field(
        default=0.15,
        ge=0.0,
        lt=1.0,
        description="Preempt only if waiting rank < (1 − margin)·running rank. Default 0.15.",
    )
    max_preemptions: int = Field(
        default=2, ge=0, description="Per-request preemption cap. Default 2."
    )
    max_wait_s: float | None = Field(
        default=None,
        gt=0,
        description="Tail guard: a request that has waited this long (seconds) is served in "
        "deadline order ahead of the ranked ones (tailguard.py). None: no guard.",
    )
    cost: CostKind = Field(
        default="output",
        description="'memory' = O²/2 + I·O (SageSched: KV memory bounds the batch); 'output' = "
        "O (decode steps: a slot cap bounds the batch). Default: 'output' when preemptive "
        "(max_preemptions > 0; under a slot cap it measured 1-10 % lower mean TTLT than "
        "'memory'), 'memory' when not (level with 'output' there, so SageSched's cost stays; "
        "docs/benchmarks/ordering.md).",
    )

    _cost_default = model_validator(mode="before")(_default_cost)


class GittinsOrdering:
    name = "gittins"
    preemptive = True
    needs_lengths = True

    def __init__(self, params: GittinsParams | None = None) -> None:
        self.params = params if params is not None else GittinsParams()
        self.guard = _guard(self.params.max_wait_s)
        # A cap of 0 makes the ordering non-preemptive: ranks only, no displacement.
        self.preemptive = self.params.max_preemptions > 0

    def key(self, view: RequestView) -> float:
        return gittins_rank_sorted(view.remaining_costs(self.params.cost))

    def refresh_needed(self, view: RequestView) -> bool:
        return _bucket_crossed(view, self.params.refresh_every_tokens)

    def may_preempt(self, waiting_key: float, running: RequestView, running_key: float) -> bool:
        return (
            running.preemptions < self.params.max_preemptions
            and waiting_key < (1.0 - self.params.preempt_margin) * running_key
        )


# --------------------------------------------------------------------------- registry

ORDERINGS: dict[str, tuple[type[BaseModel], Callable[..., Ordering]]] = {
    "fcfs": (FcfsParams, FcfsOrdering),
    "sjf": (SjfParams, SjfOrdering),
    "trail": (TrailParams, TrailOrdering),
    "gittins": (GittinsParams, GittinsOrdering),
}
"""name -> (params model, factory taking an instance of it)."""


def make_ordering(name: str, params: dict[str, object] | BaseModel | None = None) -> Ordering:
    """Build a registered ordering; ``params`` is validated against its model."""
    try:
        model, factory = ORDERINGS[name]
    except KeyError:
        raise UnknownOrderingError(name) from None
    if isinstance(params, BaseModel):
        validated = model.model_validate(params.model_dump())
    else:
        validated = model.model_validate(params or {})
    return factory(validated)


# --------------------------------------------------------------------------- fallback


@runtime_checkable
class PriorSampler(Protocol):
    """A length predictor that can also give its global (prior) output-length distribution.

    ``prior_sample(k)`` returns at most ``k`` ascending, equally likely output
    lengths (tokens) summarising every request the predictor has seen (the
    core's history predictors and the sidecar's ``PromptLengths`` have it).
    """

    def prior_sample(self, k: int) -> npt.NDArray[np.float64]: ...


class GlobalFallback:
    """The outliving rule's fallback: the predictor's global distribution, cached.

    :attr:`lengths` is ``prior_sample(samples)``, sorted, read again only after
    ``refresh_every`` finished requests (fewer while the history is small: after
    1, 2, 4, ... of them), never per request; the owner calls :meth:`observed`
    for each finished request it fed the predictor. Without a sampler (a
    predictor with no global distribution) or with ``samples=0`` it is empty,
    and the outliving rule falls back on the point ``O = 2·o``.
    """

    __slots__ = ("_at", "_every", "_k", "_lengths", "_observed", "_sampler")

    def __init__(
        self, sampler: object, *, samples: int = 256, refresh_every: int = 64
    ) -> None:
        if samples < 0 or refresh_every < 1:
            raise ValueError("fallback samples must be >= 0, fallback refresh_every >= 1")
        self._sampler = sampler if isinstance(sampler, PriorSampler) and samples else None
        self._k = samples
        self._every = refresh_every
        self._lengths: npt.NDArray[np.float64] = np.empty(0, dtype=np.float64)
        self._observed = 0  # finished requests reported by observed()
        self._at = -1  # _observed when the distribution was last read (-1: never)

    def observed(self) -> None:
        """A request finished and was fed to the predictor: the distribution may be stale."""
        self._observed += 1

    @property
    def lengths(self) -> npt.NDArray[np.float64]:
        """The global distribution, ascending (empty: none)."""
        at = self._at
        if self._sampler is not None and (
            at < 0 or self._observed - at >= min(self._every, max(at, 1))
        ):
            sample = np.asarray(self._sampler.prior_sample(self._k), dtype=np.float64)
            self._lengths = np.sort(sample)
            self._at = self._observed
        return self._lengths


# --------------------------------------------------------------------------- queue


class KeyedQueue:
    """Min-heap of ``(key, seq, request_id)`` with lazy deletion.

    ``push`` of a queued id updates its key (the old entry turns stale);
    ``remove`` is O(1); stale entries are dropped when they reach the top, and
    the heap is rebuilt when they outnumber the live ones. Equal keys pop in
    push order (``seq``).
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[float, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    def push(self, request_id: str, key: float) -> None:
        seq = next(self._seq)
        self._live[request_id] = (key, seq)
        heapq.heappush(self._heap, (key, seq, request_id))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def key_of(self, request_id: str) -> float:
        return self._live[request_id][0]

    def remove(self, request_id: str) -> None:
        del self._live[request_id]

    def _is_live(self, entry: tuple[float, int, str]) -> bool:
        cur = self._live.get(entry[2])
        return cur is not None and cur[1] == entry[1]

    def _drop_stale(self) -> None:
        while self._heap and not self._is_live(self._heap[0]):
            heapq.heappop(self._heap)

    def peek(self) -> tuple[str, float]:
        self._drop_stale()
        if not self._heap:
            raise IndexError("peek at an empty queue")
        key, _, rid = self._heap[0]
        return rid, key

    def pop(self) -> tuple[str, float]:
        rid, key = self.peek()
        heapq.heappop(self._heap)
        del self._live[rid]
        return rid, key

    def smallest(self, n: int) -> list[tuple[str, float]]:
        """The ``n`` first (id, key) pairs in pop order, without popping."""
        live = ((k, s, r) for r, (k, s) in self._live.items())
        return [(r, k) for k, _, r in heapq.nsmallest(n, live)]

    def _compact(self) -> None:
        self._heap = [(k, s, r) for r, (k, s) in self._live.items()]
        heapq.heapify(self._heap)
