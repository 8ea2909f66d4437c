"""Per-pod latency budgets: the pure policy that turns SLOs and load into a budget.

A *budget* is the cap on the predicted time of one engine iteration that each
pod's sidecar enforces when it adds offline work to a batch (HyGen's two-phase
planner). It is set in two steps:

1. **Search** (HyGen's SLO-aware profiler): for the SLO targets, the latency
   model of (model, GPU) and the recent online arrival statistics, find the
   largest budget that still meets every target. The search is injected
   (:class:`BudgetSearch`): the operator wires in the simulator-backed search
   of ``simsearch`` (run in a worker by ``searchpool``); :class:`AnalyticSearch`
   is the closed-form fallback, also answered as a *provisional* result while
   the simulated search runs. It is re-run when the SLOs or the latency model
   (profile or calibration scale) change, when the arrival rate moved by more
   than ``research_load_change`` since the last search, and on every decision
   while the result in force is provisional (the worker may have finished).
   A re-search for a load change (same SLOs and model) keeps a simulated budget
   in force while only the provisional answer is in, and a searched budget within
   ``research_min_change`` of the one in force leaves it in force (the load it was
   searched at is updated): every new budget is a new configuration pushed to
   every pod and a status write, so a search that would only move it by noise
   changes nothing.
2. **Adapt** (AIMD on observed attainment, between searches): when any observed
   statistic exceeds its target, the budget is multiplied by
   ``decrease_factor`` at once (at most once per ``tighten_interval_s``, so one
   stale window is not punished twice); when every observed statistic sits
   below ``(1 - loosen_margin)`` of its target, it grows by
   ``increase_fraction`` of the searched budget, at most once per
   ``loosen_interval_s`` and never above ``loosen_limit`` x the searched
   budget. Tighten fast, loosen slowly: a missed SLO costs users now, an
   over-tight budget only costs offline throughput. Too few samples hold the
   budget where it is. ``reason`` names the decision that set the budget in force
   (``Searched``, ``Tightened``, ``Loosened``), or ``Held`` when a miss found it
   already at the floor; a decision that keeps the budget leaves the state as it is.

Everything here is a function of its arguments (time is passed in as
``now_s``). Deliberately left out: talking to sidecars, reading profiles from
disk, and the simulator trials themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, ConfigDict, Field

from slipstream_operator.api import SLOSpec, parse_duration
from slipstream_scheduler.latency import BatchFeatures, LinearLatencyModel
from slipstream_scheduler.types import EngineLimits


class BudgetParams(BaseModel):
    """Knobs of the adaptation loop."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decrease_factor: float = Field(
        default=0.7,
        gt=0,
        lt=1,
        description="Multiplier applied on an SLO miss (unitless). Default: 0.7.",
    )
    increase_fraction: float = Field(
        default=0.05,
        gt=0,
        le=1,
        description="Additive step, as a fraction of the searched budget. Default: 0.05.",
    )
    loosen_margin: float = Field(
        default=0.15,
        ge=0,
        lt=1,
        description="Loosen only while every metric <= (1 - margin) x target. Default: 0.15.",
    )
    loosen_limit: float = Field(
        default=1.25,
        ge=1,
        description="Cap on loosening, as a multiple of the searched budget. Default: 1.25.",
    )
    tighten_interval_s: float = Field(
        default=10.0, ge=0, description="Seconds between two decreases. Default: 10."
    )
    loosen_interval_s: float = Field(
        default=30.0, ge=0, description="Seconds between two increases. Default: 30."
    )
    research_load_change: float = Field(
        default=0.25,
        gt=0,
        description="Relative arrival-rate change that triggers a new search. Default: 0.25.",
    )
    research_min_change: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="A re-search (same SLOs and model) whose budget is within this relative "
        "change of the budget in force leaves it in force: no new configuration is pushed. "
        "Default: 0.05.",
    )
    min_samples: int = Field(
        default=20,
        ge=1,
        description="Online requests needed before observations count. Default: 20.",
    )


@dataclass(frozen=True, slots=True)
class SLOTargets:
    """SLO targets in seconds; None: not set."""

    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_mean_s: float | None = None
    tbt_p99_s: float | None = None

    @classmethod
    def from_spec(cls, slo: SLOSpec) -> SLOTargets:
        def get(target: object, name: str) -> float | None:
            value = getattr(target, name, None) if target is not None else None
            return None if value is None else parse_duration(value)

        return cls(
            ttft_mean_s=get(slo.ttft, "mean"),
            ttft_p99_s=get(slo.ttft, "p99"),
            tbt_mean_s=get(slo.tbt, "mean"),
            tbt_p99_s=get(slo.tbt, "p99"),
        )

    def items(self) -> list[tuple[str, float]]:
        """(metric name, target) for every set target, e.g. ("ttft-p99", 2.0)."""
        out = []
        for name in ("ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s"):
            value = getattr(self, name)
            if value is not None:
                out.append((name[:-2].replace("_", "-"), float(value)))
        return out


@dataclass(frozen=True, slots=True)
class LoadStats:
    """Recent online arrivals: rate and mean request shape."""

    arrival_rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float


@dataclass(frozen=True, slots=True)
class ObservedSLO:
    """Observed online latency statistics in seconds over the status window."""

    samples: int
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_mean_s: float | None = None
    tbt_p99_s: float | None = None

    def get(self, metric: str) -> float | None:
        value: float | None = getattr(self, metric.replace("-", "_") + "_s")
        return value


@dataclass(frozen=True, slots=True)
class TrialRecord:
    """One test run of a simulated search: the candidate budget and its verdict.

    ``worst`` names the SLO closest to (or furthest past) its limit, e.g.
    ``tbt-p99 168ms/170ms``.
    """

    budget_s: float
    met: bool
    worst: str = ""
    idle_budget_s: float | None = None  # the idle budget in force in this trial, if any


@dataclass(frozen=True, slots=True)
class SearchResult:
    """What a budget search found: the budget, the range it searched and its evidence.

    ``feasible`` is False when even ``floor_s`` (the online-only budget) misses
    an SLO; the budget is then the floor. ``provisional`` marks a stand-in
    answer (the analytic one) while the real search still runs. ``note`` is a
    one-line summary for events and conditions. ``idle_budget_s``: the idle
    budget found by a two-knob search (None: not searched, or none meets the SLOs).
    """

    budget_s: float
    floor_s: float
    ceiling_s: float
    source: str
    feasible: bool = True
    provisional: bool = False
    trials: tuple[TrialRecord, ...] = ()
    note: str = ""
    idle_budget_s: float | None = None

    def summary(self, limit: int = 8) -> str:
        """One line: source, verdict and up to ``limit`` trials (for events and conditions)."""
        head = f"{self.source} search"
        if self.note:
            head += f" ({self.note})"
        if not self.feasible:
            head += ": no budget meets the SLOs, online-only budget"
        if self.idle_budget_s is not None:
            head += f"; idle budget {self.idle_budget_s * 1000:.1f}ms"
        if not self.trials:
            return head
        shown = ", ".join(
            f"{t.budget_s * 1000:.1f}ms"
            + ("" if t.idle_budget_s is None else f"/idle {t.idle_budget_s * 1000:.1f}ms")
            + f" {'met' if t.met else 'missed'}"
            + (f" [{t.worst}]" if t.worst else "")
            for t in self.trials[:limit]
        )
        more = f", +{len(self.trials) - limit} more" if len(self.trials) > limit else ""
        return f"{head}; {len(self.trials)} trials: {shown}{more}"


BudgetSearch = Callable[[SLOTargets, LoadStats], SearchResult]
"""(targets, load) -> SearchResult. Must be deterministic; may be slow (it runs rarely)."""


@dataclass(frozen=True, slots=True)
class BudgetState:
    """The budget in force and what it was derived from. Kept by the caller between calls."""

    budget_s: float
    searched: SearchResult
    targets: SLOTargets
    searched_rate_rps: float
    changed_at_s: float
    reason: str  # what set budget_s: Searched | Tightened | Loosened | Held (a miss at the floor)
    model_key: str = ""


def attainment(targets: SLOTargets, observed: ObservedSLO) -> list[tuple[str, float, float]]:
    """(metric, observed, target) for every target with an observation."""
    out = []
    for metric, target in targets.items():
        value = observed.get(metric)
        if value is not None:
            out.append((metric, value, target))
    return out


def worst_metric(targets: SLOTargets, observed: ObservedSLO) -> tuple[str, float, float] | None:
    """The metric with the highest observed/target ratio, or None without observations."""
    rows = attainment(targets, observed)
    return max(rows, key=lambda r: r[1] / r[2]) if rows else None


def decide(
    state: BudgetState | None,
    *,
    targets: SLOTargets,
    load: LoadStats,
    observed: ObservedSLO,
    search: BudgetSearch,
    now_s: float,
    params: BudgetParams,
    model_key: str = "",
) -> BudgetState:
    """The next budget state (see the module docstring for the rules)."""
    found: SearchResult | None = None
    if state is None or _needs_search(state, targets, load, params, model_key):
        found = search(targets, load)
        if state is not None and _same_subject(state, targets, model_key):
            if found.provisional and not state.searched.provisional:
                # A load change: the simulated budget stays until the simulated answer is in
                # (the load still differs, so the next decision asks again).
                found = None
            elif _within(found.budget_s, state.budget_s, params.research_min_change):
                state = replace(state, searched_rate_rps=load.arrival_rate_rps)
                found = None
    elif state.searched.provisional:
        fresh = search(targets, load)  # the worker may have finished since the last call
        found = None if fresh.provisional else fresh
    if found is not None or state is None:
        assert found is not None  # state is None always searches
        return BudgetState(
            budget_s=found.budget_s,
            searched=found,
            targets=targets,
            searched_rate_rps=load.arrival_rate_rps,
            changed_at_s=now_s,
            reason="Searched",
            model_key=model_key,
        )
    if observed.samples < params.min_samples:
        return state
    rows = attainment(targets, observed)
    since = now_s - state.changed_at_s
    missed = any(value > target for _, value, target in rows)
    floor = state.searched.floor_s
    if missed:
        if since < params.tighten_interval_s and state.reason == "Tightened":
            return state
        new = max(floor, state.budget_s * params.decrease_factor)
        if new >= state.budget_s:
            return replace(state, reason="Held")
        return replace(state, budget_s=new, changed_at_s=now_s, reason="Tightened")
    comfortable = bool(rows) and all(
        value <= (1.0 - params.loosen_margin) * target for _, value, target in rows
    )
    if comfortable and since >= params.loosen_interval_s:
        limit = min(state.searched.ceiling_s, state.searched.budget_s * params.loosen_limit)
        new = min(limit, state.budget_s + params.increase_fraction * state.searched.budget_s)
        if new > state.budget_s:
            return replace(state, budget_s=new, changed_at_s=now_s, reason="Loosened")
    return state


def _same_subject(state: BudgetState, targets: SLOTargets, model_key: str) -> bool:
    return state.targets == targets and state.model_key == model_key


def _within(new: float, current: float, fraction: float) -> bool:
    return abs(new - current) <= fraction * current


def _needs_search(
    state: BudgetState, targets: SLOTargets, load: LoadStats, params: BudgetParams, model_key: str
) -> bool:
    if not _same_subject(state, targets, model_key):
        return True
    before = max(state.searched_rate_rps, 1e-9)
    change = abs(load.arrival_rate_rps - state.searched_rate_rps) / before
    return change > params.research_load_change


@dataclass(frozen=True, slots=True)
class AnalyticSearch:
    """Closed-form budget search from a latency model (no simulator trials).

    * ``floor``: predicted iteration time of the online-only steady state at
      the given load (a fixed point of Little's law: decodes in flight =
      rate x output tokens x step time; prefill tokens per step = rate x
      prompt tokens x step time).
    * ``ceiling``: predicted time of a full ``max_num_batched_tokens`` prefill
      step with the floor's decodes; a budget above it never binds.
    * TBT targets cap the budget directly (every iteration is one TBT sample
      for every running stream), with ``safety`` headroom for model error.
    * TTFT targets cap it at target / (prefill steps of a typical prompt + 1
      step of queueing), the prompt being the mean (mean target) or
      ``p99_prompt_factor`` x the mean (P99 target).

    The budget is the tightest cap, clamped into [floor, ceiling].
    """

    model: LinearLatencyModel
    limits: EngineLimits = field(default_factory=EngineLimits)
    safety: float = 0.1
    p99_prompt_factor: float = 3.0

    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        floor = self._online_step(load)
        ceiling = max(floor, self._full_step(load, floor))
        caps: list[float] = []
        scale = 1.0 - self.safety
        if targets.tbt_mean_s is not None:
            caps.append(targets.tbt_mean_s * scale)
        if targets.tbt_p99_s is not None:
            caps.append(targets.tbt_p99_s * scale)
        chunk = max(1, self.limits.max_num_batched_tokens)
        if targets.ttft_mean_s is not None:
            steps = math.ceil(max(1.0, load.mean_prompt_tokens) / chunk) + 1
            caps.append(targets.ttft_mean_s * scale / steps)
        if targets.ttft_p99_s is not None:
            prompt = max(1.0, load.mean_prompt_tokens * self.p99_prompt_factor)
            steps = math.ceil(prompt / chunk) + 1
            caps.append(targets.ttft_p99_s * scale / steps)
        budget = min(caps) if caps else ceiling
        budget = min(max(budget, floor), ceiling)
        return SearchResult(budget_s=budget, floor_s=floor, ceiling_s=ceiling, source="analytic")

    def _features(self, load: LoadStats, step_s: float) -> BatchFeatures:
        f = BatchFeatures()
        decodes = min(
            self.limits.max_num_seqs,
            max(1, math.ceil(load.arrival_rate_rps * load.mean_output_tokens * step_s)),
        )
        context = int(load.mean_prompt_tokens + load.mean_output_tokens / 2)
        for _ in range(decodes):
            f.add_decode(1, context)
        prefill = min(
            self.limits.max_num_batched_tokens,
            math.ceil(load.arrival_rate_rps * load.mean_prompt_tokens * step_s),
        )
        if prefill > 0:
            f.add_prefill(prefill, 0)
        return f

    def _online_step(self, load: LoadStats) -> float:
        step = max(self.model.predict_features(BatchFeatures()), 1e-4)
        for _ in range(20):
            nxt = self.model.predict_features(self._features(load, step))
            if abs(nxt - step) <= 1e-6:
                break
            step = nxt
        return max(step, 1e-4)

    def _full_step(self, load: LoadStats, floor: float) -> float:
        f = self._features(load, floor)
        room = max(0, self.limits.max_num_batched_tokens - f.tokens)
        if room == 0:
            return self.model.predict_features(f)
        return self.model.predict_with_prefill(f, room, 0)
