"""Admission policies: the named ways online and offline work may share a step.

Every policy is the same two-phase fill (:mod:`slipstream_scheduler.planner`)
with different rules, described by a frozen pydantic params model and listed in
one explicit registry, :data:`ADMISSION_POLICIES`:

==============  ===============================================================
``online-only``  online work only; offline is never admitted (the baseline)
``offline-only`` offline work only, at full batch (the offline-only baseline)
``naive``        "Sarathi++": online first, offline fills with no latency
                 budget, online preempts offline
``static-cap``   "HyGen*": ``naive`` plus a fixed cap on offline requests in
                 flight (the cap is profiled elsewhere, for the trace's peak)
``budget``       HyGen: offline work fills what the latency budget leaves
==============  ===============================================================

The simulator's ``budget-psm`` is ``budget`` with the offline queue in PSM
order; ordering is the job of whoever builds the snapshot, never the planner.

Deliberately left out: ordering, budget search, and anything stateful across
plans (an AIMD controller would be a separate policy with its own state).
Errors::

    AdmissionError
     +-- UnknownPolicyError  (name not in the registry)
     +-- PolicyConfigError   (params invalid, or a latency model missing)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.planner import FillRules, PlannerMode, TwoPhasePlanner


class AdmissionError(Exception):
    """Base of this module's errors."""


class UnknownPolicyError(AdmissionError, KeyError):
    """No admission policy has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown admission policy {name!r}; known: {sorted(ADMISSION_POLICIES)}")
        self.name = name

    def __str__(self) -> str:
        return str(self.args[0])


class PolicyConfigError(AdmissionError):
    """A policy cannot be built with what it was given."""

    def __init__(self, policy: str, reason: str) -> None:
        super().__init__(f"admission policy {policy!r}: {reason}")
        self.policy = policy
        self.reason = reason


class PolicyParams(BaseModel):
    """Knobs every policy shares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    queue_window: int = Field(
        default=64, ge=1, description="queued requests looked at per queue and plan; default 64"
    )
    min_new_prefill_tokens: int = Field(
        default=16,
        ge=1,
        description="smallest first prefill chunk worth admitting an offline request for, "
        "tokens; default 16",
    )
    max_preemptions: int = Field(
        default=16, ge=0, description="offline preemptions per plan, at most; default 16"
    )

    def rules(self) -> FillRules:
        raise NotImplementedError


class OnlineOnlyParams(PolicyParams):
    """``online-only``: offline work is never admitted."""

    def rules(self) -> FillRules:
        return FillRules(
            admit_offline=False,
            offline_budgeted=False,
            queue_window=self.queue_window,
            min_new_prefill_tokens=self.min_new_prefill_tokens,
            max_preemptions=self.max_preemptions,
        )


class OfflineOnlyParams(PolicyParams):
    """``offline-only``: offline work alone, at full batch; the online queue is ignored."""

    def rules(self) -> FillRules:
        return FillRules(
            admit_online=False,
            offline_budgeted=False,
            preempt_for_online=False,
            queue_window=self.queue_window,
            min_new_prefill_tokens=self.min_new_prefill_tokens,
            max_preemptions=0,
        )


class NaiveParams(PolicyParams):
    """``naive`` (Sarathi++): online first, offline fills with no budget."""

    def rules(self) -> FillRules:
        return FillRules(
            offline_budgeted=False,
            queue_window=self.queue_window,
            min_new_prefill_tokens=self.min_new_prefill_tokens,
            max_preemptions=self.max_preemptions,
        )


class StaticCapParams(PolicyParams):
    """``static-cap`` (HyGen*): naive plus a fixed cap on offline requests in flight, or
    (inside the engine) on offline tokens per step."""

    max_offline_in_flight: int | None = Field(
        default=16,
        ge=0,
        description="offline requests running at once, at most (null: no cap); profiled so "
        "the SLO holds at the trace's peak; default 16",
    )
    max_offline_step_tokens: int | None = Field(
        default=None,
        ge=0,
        description="inside the engine (the plugin): offline tokens per step, at most; a "
        "fixed cap with no latency model, profiled like the in-flight cap; default none",
    )

    def rules(self) -> FillRules:
        return FillRules(
            offline_budgeted=False,
            offline_cap=self.max_offline_in_flight,
            offline_step_tokens=self.max_offline_step_tokens,
            queue_window=self.queue_window,
            min_new_prefill_tokens=self.min_new_prefill_tokens,
            max_preemptions=self.max_preemptions,
        )


class BudgetParams(PolicyParams):
    """``budget`` (HyGen): offline work fills what the per-iteration latency budget leaves."""

    online_chunks_in_budget: bool = Field(
        default=False,
        description="also size online prefill chunks to the budget (at least "
        "online_min_chunk_tokens each); default false: the budget bounds offline work only",
    )
    online_min_chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="floor of a budget-sized online prefill chunk, tokens; default 256",
    )
    max_offline_in_flight: int | None = Field(
        default=None,
        ge=0,
        description="optional extra cap on offline requests running at once; default none",
    )
    keep_offline_margin: bool = Field(
        default=False,
        description="admission mode: when online work alone exceeds the budget (an online "
        "prefill chunk), keep in-flight offline work adding at most what the budget leaves "
        "it next to the online decodes (budget minus their predicted step) instead of "
        "preempting all of it; default false (HyGen's rule: fewer aborts, but it lengthens "
        "online prefill steps and measurably raises p99 TBT, docs/reliability.md)",
    )

    def rules(self) -> FillRules:
        return FillRules(
            offline_budgeted=True,
            keep_offline_margin=self.keep_offline_margin,
            online_chunks_in_budget=self.online_chunks_in_budget,
            online_min_chunk_tokens=self.online_min_chunk_tokens,
            offline_cap=self.max_offline_in_flight,
            queue_window=self.queue_window,
            min_new_prefill_tokens=self.min_new_prefill_tokens,
            max_preemptions=self.max_preemptions,
        )


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """A registry entry: a name, its params model and whether it needs a latency model."""

    name: str
    params_type: type[PolicyParams]
    needs_latency_model: bool
    summary: str

    def build(
        self,
        params: PolicyParams | Mapping[str, Any] | None = None,
        *,
        latency_model: LinearLatencyModel | None = None,
        mode: PlannerMode = PlannerMode.ITERATION,
    ) -> TwoPhasePlanner:
        """A planner for this policy. ``params`` may be the model or a plain mapping."""
        if params is None:
            params = self.params_type()
        elif not isinstance(params, PolicyParams):
            try:
                params = self.params_type.model_validate(dict(params))
            except ValidationError as exc:
                raise PolicyConfigError(self.name, str(exc)) from exc
        if not isinstance(params, self.params_type):
            raise PolicyConfigError(
                self.name,
                f"expected {self.params_type.__name__}, got {type(params).__name__}",
            )
        if self.needs_latency_model and latency_model is None:
            raise PolicyConfigError(self.name, "needs a fitted latency model")
        return TwoPhasePlanner(self.name, params.rules(), latency_model, mode)


ADMISSION_POLICIES: dict[str, AdmissionPolicy] = {
    "online-only": AdmissionPolicy(
        "online-only", OnlineOnlyParams, False, "online work only; offline never admitted"
    ),
    "offline-only": AdmissionPolicy(
        "offline-only", OfflineOnlyParams, False, "offline work only, at full batch"
    ),
    "naive": AdmissionPolicy(
        "naive", NaiveParams, False, "Sarathi++: online first, offline fills, no budget"
    ),
    "static-cap": AdmissionPolicy(
        "static-cap", StaticCapParams, False, "HyGen*: naive plus a fixed offline in-flight cap"
    ),
    "budget": AdmissionPolicy(
        "budget", BudgetParams, True, "HyGen: offline fills the per-iteration latency budget"
    ),
}


def build_planner(
    name: str,
    params: PolicyParams | Mapping[str, Any] | None = None,
    *,
    latency_model: LinearLatencyModel | None = None,
    mode: PlannerMode = PlannerMode.ITERATION,
) -> TwoPhasePlanner:
    """Look ``name`` up in :data:`ADMISSION_POLICIES` and build its planner."""
    try:
        policy = ADMISSION_POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(name) from None
    return policy.build(params, latency_model=latency_model, mode=mode)
