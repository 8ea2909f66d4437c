"""The SLO-aware profiler: find the largest per-iteration budget that keeps every SLO.

HyGen's profiler (``research/algorithms.md`` §1.4): a statistical SLO (p99
TBT, mean TTFT, ...) is not a per-iteration budget, so the budget is found by
binary search with *test runs*: each candidate is replayed on a workload
sample with a saturating offline backlog, the online latencies are measured,
and the largest candidate whose every SLO holds wins. Several SLOs at once:
all must hold, so the strictest governs. An SLO is absolute (``ttft:p99:2s``)
or a tolerance over online-only serving (``tbt:p99:+10%``), which needs the
online-only baseline's observation.

This module is pure: the caller passes the trial function (the simulator in
the CLI and the operator; anything that maps a budget to observed latencies)
and gets back the budget and the evidence (every trial's observation).
:func:`bisect_largest` is the generic search, also used to profile the
static offline cap of the ``static-cap`` baseline.

Deliberately left out: running simulations, choosing the workload sample,
and any clock. Errors::

    BudgetError
     +-- SloSyntaxError   (an SLO string that does not parse; carries ``text``)
     +-- MissingBaselineError (a tolerance SLO without a baseline observation)
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

Observed = Mapping[str, float]
"""Observed online latencies of one run, keyed ``<metric>_<stat>_s`` (e.g. ``tbt_p99_s``)."""

Metric = Literal["ttft", "tbt", "ttlt"]
Stat = Literal["mean", "p50", "p99"]


class BudgetError(Exception):
    """Base of the profiler's errors."""


class SloSyntaxError(BudgetError):
    """An SLO string did not parse."""

    def __init__(self, text: str, why: str) -> None:
        super().__init__(f"bad SLO {text!r}: {why} (expected e.g. ttft:p99:2s or tbt:p99:+10%)")
        self.text = text


class MissingBaselineError(BudgetError):
    """A tolerance SLO needs the online-only baseline's observation."""

    def __init__(self, key: str) -> None:
        super().__init__(f"SLO on {key} is a tolerance over online-only, but no baseline given")
        self.key = key


class Slo(BaseModel):
    """One latency objective on the online class.

    Exactly one of ``limit_s`` (absolute, seconds) and ``tolerance`` (fraction
    over the online-only baseline: 0.1 means within +10 %) is set.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: Metric = Field(description="ttft, tbt or ttlt.")
    stat: Stat = Field(description="mean, p50 or p99.")
    limit_s: float | None = Field(default=None, gt=0, description="Absolute limit in seconds.")
    tolerance: float | None = Field(
        default=None, ge=0, description="Allowed fraction over online-only (0.1 = +10 %)."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> Slo:
        if (self.limit_s is None) == (self.tolerance is None):
            raise ValueError("set exactly one of limit_s and tolerance")
        return self

    @property
    def key(self) -> str:
        """The observation key this SLO reads, e.g. ``tbt_p99_s``."""
        return f"{self.metric}_{self.stat}_s"

    def limit(self, baseline: Observed | None) -> float:
        """The absolute limit in seconds (resolving a tolerance against ``baseline``)."""
        if self.limit_s is not None:
            return self.limit_s
        if baseline is None or self.key not in baseline:
            raise MissingBaselineError(self.key)
        assert self.tolerance is not None
        return baseline[self.key] * (1.0 + self.tolerance)

    def __str__(self) -> str:
        if self.limit_s is not None:
            return f"{self.metric}:{self.stat}:{_fmt_s(self.limit_s)}"
        assert self.tolerance is not None
        return f"{self.metric}:{self.stat}:+{self.tolerance * 100:g}%"


def _fmt_s(x: float) -> str:
    return f"{x * 1000:g}ms" if x < 1 else f"{x:g}s"


_SLO = re.compile(r"^(ttft|tbt|ttlt):(mean|p50|p99):(.+)$")
_ABS = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(ms|s)$")
_TOL = re.compile(r"^\+(\d+(?:\.\d*)?|\.\d+)%$")


def parse_slo(text: str) -> Slo:
    """Parse ``METRIC:STAT:LIMIT``: ``ttft:p99:2s``, ``tbt:mean:60ms``, ``tbt:p99:+10%``."""
    m = _SLO.match(text.strip().lower())
    if not m:
        raise SloSyntaxError(
            text, "want METRIC:STAT:LIMIT with METRIC ttft|tbt|ttlt, STAT mean|p50|p99"
        )
    metric, stat, limit = cast(Metric, m.group(1)), cast(Stat, m.group(2)), m.group(3)
    a = _ABS.match(limit)
    if a:
        v = float(a.group(1)) * (1e-3 if a.group(2) == "ms" else 1.0)
        if v <= 0:
            raise SloSyntaxError(text, "limit must be > 0")
        return Slo(metric=metric, stat=stat, limit_s=v, tolerance=None)
    t = _TOL.match(limit)
    if t:
        return Slo(metric=metric, stat=stat, limit_s=None, tolerance=float(t.group(1)) / 100.0)
    raise SloSyntaxError(text, f"limit {limit!r} is neither 2s / 150ms nor +10%")


@dataclass(frozen=True, slots=True)
class Check:
    """One SLO judged on one observation."""

    slo: str
    key: str
    limit_s: float
    observed_s: float
    met: bool


def judge(slos: Sequence[Slo], observed: Observed, baseline: Observed | None) -> tuple[Check, ...]:
    """Every SLO checked against ``observed`` (a missing or NaN observation fails)."""
    out = []
    for s in slos:
        lim = s.limit(baseline)
        v = observed.get(s.key, math.nan)
        out.append(Check(str(s), s.key, lim, v, bool(v <= lim)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Trial:
    """One test run of the search: the candidate, what it observed, the verdicts."""

    value: float
    observed: Mapping[str, float]
    checks: tuple[Check, ...]

    @property
    def met(self) -> bool:
        return all(c.met for c in self.checks)


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The largest passing value (None: even ``lo`` fails) and every trial, in run order."""

    value: float | None
    trials: tuple[Trial, ...]
    lo: float
    hi: float

    @property
    def feasible(self) -> bool:
        return self.value is not None


def bisect_largest(
    run: Callable[[float], Observed],
    slos: Sequence[Slo],
    lo: float,
    hi: float,
    *,
    baseline: Observed | None = None,
    iterations: int = 8,
    integer: bool = False,
    rel_tol: float = 0.02,
) -> SearchResult:
    """Largest value in ``[lo, hi]`` whose trial meets every SLO (monotone assumption).

    Tries ``hi`` first (if it passes, it wins), then ``lo`` (if it fails,
    nothing does), then bisects at most ``iterations`` times or until the
    bracket is within ``rel_tol`` of its upper end (or 1 for ``integer``).
    """
    if not slos:
        raise BudgetError("no SLO to search against")
    if not lo <= hi:
        raise BudgetError(f"empty range [{lo}, {hi}]")
    for s in slos:
        s.limit(baseline)  # fail early on a tolerance without baseline
    trials: list[Trial] = []

    def attempt(v: float) -> bool:
        obs = run(v)
        t = Trial(v, dict(obs), judge(slos, obs, baseline))
        trials.append(t)
        logger.info("budget trial value=%.6g met=%s", v, t.met)
        return t.met

    if attempt(hi):
        return SearchResult(hi, tuple(trials), lo, hi)
    if lo == hi or not attempt(lo):
        return SearchResult(None, tuple(trials), lo, hi)
    good, bad = lo, hi
    for _ in range(iterations):
        if integer:
            if bad - good <= 1:
                break
            mid = float(math.floor((good + bad) / 2))
        else:
            if bad - good <= rel_tol * bad:
                break
            mid = 0.5 * (good + bad)
        if attempt(mid):
            good = mid
        else:
            bad = mid
    return SearchResult(good, tuple(trials), lo, hi)


def search_budget(
    run: Callable[[float], Observed],
    slos: Sequence[Slo],
    lo_s: float,
    hi_s: float,
    *,
    baseline: Observed | None = None,
    iterations: int = 8,
) -> SearchResult:
    """HyGen's profiler: the largest per-iteration budget (seconds) meeting every SLO.

    ``lo_s``: an online-only iteration's predicted time at the profiled load;
    ``hi_s``: a full ``max_num_batched_tokens`` iteration's.

    NOTE: the range is deliberately *not* clipped to the TBT limit (the
    digest's suggestion): a TBT sample exists only while an online request
    decodes, so at low online load an iteration may well exceed the TBT limit
    when no online request is in it; the search finds out.
    """
    return bisect_largest(run, slos, lo_s, hi_s, baseline=baseline, iterations=iterations)
