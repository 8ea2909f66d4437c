"""Latency-model calibration: refit a profile's scale from the sidecars' step timings.

Every sidecar Status reports ``predicted_step_s`` (its latency model's
prediction for the engine's current iteration) and ``observed_step_s`` (the
last iteration's duration, measured from token gaps). A shipped profile can be
off for a real deployment (another vLLM version, driver, clocks, a noisy
neighbour); when it is, every budget is off by the same factor, because the
sidecar compares *predicted* step times against the budget.

The refit is one multiplicative factor on every coefficient: the batch
composition a full least-squares refit needs is not in the Status, and one
factor is what a systematic error of a well-shaped model looks like. Rule
(:func:`observe`):

* each reconcile adds one ratio ``observed / predicted`` per pod that reports
  both (> 0), has requests in flight (an idle pod predicts the empty batch
  while its observed time is a smoothed memory of past token gaps) *and* runs
  the configuration generation carrying the current scale (pods still on older
  coefficients would measure the old model);
* once ``window`` ratios are in and their median is off by more than
  ``threshold`` (|median - 1| > threshold), the scale is multiplied by the
  median (clamped to [``min_scale``, ``max_scale``]), the window is cleared
  and the caller re-searches the budget with the scaled model and pushes the
  scaled coefficients. A median inside the threshold leaves the scale alone:
  small errors are the AIMD loop's business.

Pure: values in, values out. Deliberately left out: reading sidecars, per-pod
scales (pods of a service are identical), and refitting individual
coefficients.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field

from slipstream_scheduler.latency import LinearLatencyModel


class CalibrationParams(BaseModel):
    """Knobs of the latency-model refit."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="Refit the scale at all. Default: true.")
    threshold: float = Field(
        default=0.2,
        gt=0,
        lt=1,
        description="Refit when the median observed/predicted ratio is off by more than this "
        "fraction (unitless). Default: 0.2.",
    )
    window: int = Field(
        default=12,
        ge=3,
        description="Ratios (one per pod per reconcile) the median is taken over. Default: 12.",
    )
    min_scale: float = Field(
        default=0.25, gt=0, le=1, description="Lowest scale a refit may set. Default: 0.25."
    )
    max_scale: float = Field(
        default=4.0, ge=1, description="Highest scale a refit may set. Default: 4."
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """The scale in force and the ratios gathered since it was set.

    ``since_generation``: the configuration generation whose pushes carry this
    scale (0: any); samples from pods on older generations are ignored.
    """

    scale: float = 1.0
    ratios: tuple[float, ...] = ()
    since_generation: int = 0
    refits: int = 0


@dataclass(frozen=True, slots=True)
class StepSample:
    """One pod's predicted and observed step time at the generation it runs."""

    predicted_s: float
    observed_s: float
    generation: int
    busy: bool = True  # requests in flight (samples of idle pods are ignored)


def scaled(model: LinearLatencyModel, factor: float) -> LinearLatencyModel:
    """``model`` with every coefficient multiplied by ``factor`` (> 0): predictions x factor."""
    if factor <= 0:
        raise ValueError(f"scale must be > 0, got {factor}")
    if factor == 1.0:
        return model
    return replace(model, coefficients=tuple(c * factor for c in model.coefficients), stats=None)


def observe(
    cal: Calibration, samples: Iterable[StepSample], params: CalibrationParams
) -> tuple[Calibration, float | None]:
    """The next calibration and, when this call refitted, the median ratio that triggered it."""
    if not params.enabled:
        return cal, None
    fresh = [
        s.observed_s / s.predicted_s
        for s in samples
        if s.busy
        and s.predicted_s > 0
        and s.observed_s > 0
        and s.generation >= cal.since_generation
    ]
    ratios = (cal.ratios + tuple(fresh))[-params.window :]
    if len(ratios) < params.window:
        return replace(cal, ratios=ratios), None
    median = statistics.median(ratios)
    if abs(median - 1.0) <= params.threshold:
        return replace(cal, ratios=ratios), None
    scale = min(params.max_scale, max(params.min_scale, cal.scale * median))
    if scale == cal.scale:  # pinned at a clamp: nothing new to push
        return replace(cal, ratios=()), None
    return Calibration(
        scale=scale, ratios=(), since_generation=cal.since_generation, refits=cal.refits + 1
    ), median
