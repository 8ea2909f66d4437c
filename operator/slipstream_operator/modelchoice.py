"""Which latency model is in force for an InferenceService: a profile, else a learned one.

The budget search, the ``BudgetReady`` condition and the Configure calls all use the model
:func:`choose_model` returns:

1. the profile file found for the service's (model, GPU) (``profiles.find_profile``: the
   user folder before the shipped one). Its source reads ``profiled`` when the file's
   ``meta.source`` says ``slipstream profile engine`` wrote it (timed on a real engine),
   else ``shipped`` or ``user`` after the folder it came from. Calibration
   (``calibration``) scales it;
2. else the model the ready pods' sidecars learned from their own engine
   (``StatusResponse.learned_model``), accepted only when it was learned from at least
   ``min_steps`` engine steps and its held-out error (MAPE on recent steps the fit did not
   see) is at most ``max_mape``. Of the pods that report an acceptable model, the one in
   force keeps it (its new revisions replace it); otherwise the one learned from the most
   steps wins, ties going to the lower held-out error, then the pod name. A learned model is
   not calibrated: it is already fitted to this engine's step times;
3. else the learned model in force at the last reconcile, *held*: when its pod restarts, is
   not ready, or its sidecar's newest fit does not pass, the pods keep running with the
   budget searched from it, so that model stays in force (and says so, with why it is
   held) until a ready pod reports an acceptable one. It is not re-searched while held.

A learned model's key (``budget.profile``, the budget search's model key) names the pod and
the revision, so a refit the sidecar publishes (it does so only past its drift threshold, or
when the model in force failed validation) makes a new budget search.

Pure: values in, values out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from slipstream_operator.sidecar_client import LearnedLatency
from slipstream_scheduler.latency import LinearLatencyModel

PROFILED_BY = "slipstream profile engine"
"""How ``meta.source`` of a profile timed on a real engine starts."""


@dataclass(frozen=True, slots=True)
class LearnedParams:
    """When a learned model may be used (settings ``learned_max_mape``, ``learned_min_steps``)."""

    max_mape: float = 0.10
    min_steps: int = 200


@dataclass(frozen=True, slots=True)
class ModelInForce:
    """The latency model in force and where it came from."""

    model: LinearLatencyModel
    source: str  # shipped | user | profiled | learned
    name: str  # the profile (e.g. shipped:latency_llama-2-7b_h100.json), or the pod's name
    from_pod: bool = False  # reported by a pod (learned_model), not read from a profile file
    steps: int = 0  # from a pod: steps the fit used
    heldout_mape: float = math.inf  # from a pod: held-out error (fraction)
    revision: int = 0  # from a pod: its revision
    held: str = ""  # from a pod, kept in force though no ready pod reports it now: why

    @property
    def calibrated(self) -> bool:
        """Whether calibration scales it (profiles only)."""
        return not self.from_pod

    @property
    def key(self) -> str:
        """What the budget search is keyed by (a new revision is a new key)."""
        if self.from_pod:
            return f"{self.source}:{self.name} r{self.revision}"
        return self.name

    def describe(self) -> str:
        """For condition messages and events."""
        if self.from_pod:
            held = f"; held: {self.held}" if self.held else ""
            return (f"{self.source} by pod {self.name} (revision {self.revision}, "
                    f"{self.steps} steps, held-out error {_percent(self.heldout_mape)}{held})")
        return f"{self.source} profile {self.name.split(':', 1)[-1]}"

    def status(self, scale: float = 1.0) -> dict[str, Any]:
        """``status.latencyModel``."""
        out: dict[str, Any] = {"source": self.source, "name": self.name}
        if self.from_pod:
            out.update(steps=self.steps, heldoutMAPE=round(self.heldout_mape, 4),
                       revision=self.revision)
            if self.held:
                out["held"] = self.held[:1024]
        elif scale != 1.0:
            out["scale"] = round(scale, 4)
        return out


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model in force, or why there is none yet (``waiting``)."""

    in_force: ModelInForce | None
    waiting: str = ""


def _percent(fraction: float) -> str:
    return "unknown" if not math.isfinite(fraction) else f"{fraction * 100:.1f} %"


def profile_source(name: str, model: LinearLatencyModel) -> str:
    """``profiled``, ``user`` or ``shipped`` for a profile named ``<origin>:<file>``."""
    if model.meta.source.startswith(PROFILED_BY):
        return "profiled"
    return "user" if name.startswith("user:") else "shipped"


def _good(learned: LearnedLatency, params: LearnedParams) -> bool:
    return (learned.model is not None and learned.seen_steps >= params.min_steps
            and learned.heldout_mape <= params.max_mape)


def _steps(learned: LearnedLatency) -> int:
    return learned.seen_steps


def _learning(reports: list[tuple[str, LearnedLatency]], params: LearnedParams) -> str:
    """Why no reported model is good enough yet (the ``NoLatencyModel`` message's end)."""
    if not reports:
        return "learning from the engine: no ready pod reports a fitted model yet"
    pod, best = min(reports, key=lambda r: (-_steps(r[1]), r[1].heldout_mape, r[0]))
    steps = _steps(best)
    if best.source == "profiled" and best.model is not None:
        error = (f"{best.heldout_mape * 100:.0f} %" if math.isfinite(best.heldout_mape)
                 else "unknown")
        return (f"profiled at pod start on {steps} rows, held-out error {error}; the bar is "
                f"{params.min_steps} rows and {params.max_mape * 100:.0f} % (pod {pod})")
    if steps < params.min_steps:
        return f"learning from the engine: {steps}/{params.min_steps} steps (pod {pod})"
    if best.model is None:
        last = (f" (the last one: held-out error {best.heldout_mape * 100:.0f} % on recent "
                "steps)" if math.isfinite(best.heldout_mape) else "")
        return (f"learning from the engine: {steps} steps seen, no fit has passed validation "
                f"yet{last} (pod {pod})")
    error = (f"{best.heldout_mape * 100:.0f} %" if math.isfinite(best.heldout_mape)
             else "unknown")
    return (f"learning from the engine: held-out error {error} > "
            f"{params.max_mape * 100:.0f} % (pod {pod}, revision {best.revision}, "
            f"{steps} steps)")


def choose_model(
    profile: LinearLatencyModel | None, profile_name: str,
    reports: Iterable[tuple[str, LearnedLatency | None]], params: LearnedParams, *,
    held: ModelInForce | None = None, what: str = "",
) -> ModelChoice:
    """The model in force (see the module docstring).

    ``reports``: (pod name, what it learned) of the service's ready pods; ``held``: the model
    in force at the last reconcile (kept when no report is acceptable; pass None where learned
    models are off); ``what``: the (model, GPU) for messages.
    """
    if profile is not None:
        return ModelChoice(ModelInForce(profile, profile_source(profile_name, profile),
                                        profile_name))
    reported = sorted((pod, learned) for pod, learned in reports if learned is not None)
    good = [(pod, learned) for pod, learned in reported if _good(learned, params)]
    if not good:
        learning = _learning(reported, params)
        waiting = f"no latency profile for {what}; {learning}"
        if held is not None and held.from_pod:
            return ModelChoice(replace(held, held=learning), waiting)
        return ModelChoice(None, waiting)
    kept = [r for r in good if held is not None and held.from_pod and r[0] == held.name]
    pod, learned = kept[0] if kept else min(
        good, key=lambda r: (-r[1].seen_steps, r[1].heldout_mape, r[0]))
    assert learned.model is not None
    return ModelChoice(ModelInForce(learned.model, learned.source, pod, from_pod=True,
                                    steps=learned.seen_steps, heldout_mape=learned.heldout_mape,
                                    revision=learned.revision))
