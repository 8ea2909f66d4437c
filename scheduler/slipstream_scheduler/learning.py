"""Learning the batch-latency model from the engine a pod serves (HyGen's profiler, online).

The plugin inside vLLM records every step it schedules as a :class:`StepRecord`: the
step's composition (every feature :class:`~slipstream_scheduler.latency.BatchFeatures`
sums) and its measured wall time. The sidecar feeds the records to a :class:`StepLearner`,
which fits the core's latency model with the same fitting code the shipped profiles use
(:func:`slipstream_scheduler.latency.fit_matrix`) and publishes a fit only after it has
passed validation on recent steps it was not trained on.

Representation. A live engine spends most of its steps in one regime (decode-only under
chat traffic, prefill-heavy under a burst of offline work); a uniform sample of its history
would forget the others, and the model would extrapolate where the planner needs it most.
:class:`RegimeReservoir` therefore keeps one reservoir (Vitter's algorithm R) per stratum:
the step's kind (prefill-only, decode-only, mixed) times the power of two of its token
count and of its request count. Every stratum seen keeps up to ``per_stratum`` rows, drawn
uniformly from its own history.

Validation. Each record first enters a window of the most recent ``holdout`` steps; only
when it leaves the window does it reach the reservoir. The window is thus always steps the
fit has not seen, and recent ones: a candidate whose mean absolute percentage error (MAPE)
on it exceeds ``max_mape`` is not used. Stragglers (steps more than three times slower than
the median of their stratum: host hiccups no model of the batch predicts) are left out of
both the fit and the validation (:func:`without_stragglers`).

Drift. A candidate that passes replaces the model in force when there is none, when the
one in force fails the same validation (``stale``), when its error on the window is lower
by more than ``drift`` (``better``: a regime the old fit never saw), or when the two
disagree by more than ``drift`` (``drift``: mean relative difference of their predictions
over the window). Each replacement
increases the revision, which is what the operator re-searches a budget on. When both the
model in force and a fresh fit fail on the recent steps, the engine itself has changed (a
driver, a clock cap, another vLLM): the reservoir's history no longer describes it, so it is
emptied (``reset``) and learning starts again from the steps that follow.

The record schema (one JSON object per line, :meth:`StepRecord.to_json`) uses the names
of NVIDIA Dynamo's forward-pass metrics where the meaning is the same (``wall_time``,
``num_prefill_requests``, ``sum_prefill_tokens``, ``sum_prefill_kv_tokens``,
``num_decode_requests``, ``sum_decode_kv_tokens``); ``sum_decode_tokens`` and
``sum_prefill_chunk_kv`` (sum of chunk x context, the model's ``P_c``) are Slipstream's.

Pure: no I/O, no clock (callers pass times in).
"""

from __future__ import annotations

import enum
import json
import math
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.latency import (
    BatchFeatures,
    FitError,
    LatencyModelMeta,
    LinearLatencyModel,
    fit_matrix,
)
from slipstream_scheduler.types import BatchItem, Phase

RECORD_VERSION = 1
"""Version of the step-record schema :meth:`StepRecord.to_json` writes."""

_COUNT_FIELDS: tuple[str, ...] = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "sum_prefill_kv_tokens",
    "sum_prefill_chunk_kv",
    "num_decode_requests",
    "sum_decode_tokens",
    "sum_decode_kv_tokens",
)


class StepRecordError(ValueError):
    """A step record that cannot be read; the message names the field."""


class Regime(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: what it computed and how long it took (seconds)."""

    wall_time: float
    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    sum_prefill_kv_tokens: int = 0
    sum_prefill_chunk_kv: int = 0
    num_decode_requests: int = 0
    sum_decode_tokens: int = 0
    sum_decode_kv_tokens: int = 0
    at: float = 0.0  # when the step finished (unix seconds), for readers; not a feature

    @property
    def tokens(self) -> int:
        return self.sum_prefill_tokens + self.sum_decode_tokens

    @property
    def requests(self) -> int:
        return self.num_prefill_requests + self.num_decode_requests

    @property
    def regime(self) -> Regime:
        if self.num_prefill_requests and self.num_decode_requests:
            return Regime.MIXED
        return Regime.PREFILL if self.num_prefill_requests else Regime.DECODE

    def row(self) -> tuple[float, ...]:
        """The feature row :func:`slipstream_scheduler.latency.feature_matrix` builds for
        this step's batch (hinge column at knee 0: the step's tokens)."""
        return self.features().row()

    @classmethod
    def of(cls, batch: Sequence[BatchItem], wall_time: float, at: float = 0.0) -> StepRecord:
        """The record of a step that ran ``batch`` in ``wall_time`` seconds."""
        f = BatchFeatures.of(batch)
        ctx = sum(i.context for i in batch if i.phase is Phase.PREFILL)
        return cls(wall_time=wall_time, num_prefill_requests=f.n_p, sum_prefill_tokens=f.s_p,
                   sum_prefill_kv_tokens=ctx, sum_prefill_chunk_kv=f.p_c,
                   num_decode_requests=f.n_d, sum_decode_tokens=f.s_d_tok,
                   sum_decode_kv_tokens=f.s_d_ctx, at=at)

    def features(self) -> BatchFeatures:
        """The step as the accumulator the planner predicts from."""
        f = BatchFeatures()
        f.s_p, f.n_p = self.sum_prefill_tokens, self.num_prefill_requests
        f.p_c = self.sum_prefill_chunk_kv
        f.n_d, f.s_d_tok = self.num_decode_requests, self.sum_decode_tokens
        f.s_d_ctx, f.tokens = self.sum_decode_kv_tokens, self.tokens
        return f

    def to_json(self) -> str:
        doc: dict[str, Any] = {"v": RECORD_VERSION, "at": round(self.at, 6),
                               "wall_time": self.wall_time}
        for name in _COUNT_FIELDS:
            doc[name] = getattr(self, name)
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> StepRecord:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StepRecordError(f"not JSON: {exc.msg}") from exc
        if not isinstance(doc, dict):
            raise StepRecordError("a step record is a JSON object")
        if doc.get("v") != RECORD_VERSION:
            raise StepRecordError(f"v: version {doc.get('v')!r} is not {RECORD_VERSION}")
        wall = doc.get("wall_time")
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not (
            math.isfinite(wall) and wall > 0
        ):
            raise StepRecordError(f"wall_time: {wall!r} is not a positive number of seconds")
        counts: dict[str, int] = {}
        for name in _COUNT_FIELDS:
            value = doc.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StepRecordError(f"{name}: {value!r} is not a non-negative integer")
            counts[name] = value
        at = doc.get("at", 0.0)
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            raise StepRecordError(f"at: {at!r} is not a number")
        rec = cls(wall_time=float(wall), at=float(at), **counts)
        if rec.requests == 0:
            raise StepRecordError("num_prefill_requests, num_decode_requests: the step is empty")
        return rec


def read_records(lines: Iterable[str]) -> tuple[list[StepRecord], list[str]]:
    """Parse JSON lines; returns the records and one error per bad line (``line N: ...``),
    so one bad line costs only itself."""
    out: list[StepRecord] = []
    errors: list[str] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(StepRecord.from_json(line))
        except StepRecordError as exc:
            errors.append(f"line {i}: {exc}")
    return out, errors


def _pow2(n: int) -> int:
    return n.bit_length()  # 0 for 0, then 1, 2-3, 4-7, ... share a bucket


def stratum(rec: StepRecord) -> tuple[str, int, int]:
    """The reservoir stratum of a step: its regime, and the power of two of its token count
    and of its request count."""
    return rec.regime.value, _pow2(rec.tokens), _pow2(rec.requests)


class RegimeReservoir:
    """A bounded sample of every regime the engine has run (see the module docstring)."""

    def __init__(self, per_stratum: int = 64, seed: int = 0) -> None:
        if per_stratum < 1:
            raise ValueError("per_stratum must be at least 1")
        self.per_stratum = per_stratum
        self._rng = random.Random(seed)
        self._rows: dict[tuple[str, int, int], list[StepRecord]] = {}
        self._seen: dict[tuple[str, int, int], int] = {}

    def add(self, rec: StepRecord) -> None:
        key = stratum(rec)
        rows = self._rows.setdefault(key, [])
        seen = self._seen.get(key, 0) + 1
        self._seen[key] = seen
        if len(rows) < self.per_stratum:
            rows.append(rec)
            return
        j = self._rng.randrange(seen)  # algorithm R: every step of the stratum equally likely
        if j < self.per_stratum:
            rows[j] = rec

    def __len__(self) -> int:
        return sum(len(r) for r in self._rows.values())

    def __iter__(self) -> Iterator[StepRecord]:
        for key in sorted(self._rows):
            yield from self._rows[key]

    def strata(self) -> dict[tuple[str, int, int], int]:
        """Rows held per stratum."""
        return {k: len(v) for k, v in sorted(self._rows.items())}

    def regimes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (regime, _, _), rows in self._rows.items():
            out[regime] = out.get(regime, 0) + len(rows)
        return out


Floats = npt.NDArray[np.float64]


def matrix(records: Iterable[StepRecord]) -> tuple[Floats, Floats]:
    """Feature rows (as :func:`slipstream_scheduler.latency.feature_matrix` builds them, knee
    0) and seconds of ``records``."""
    recs = list(records)
    x = np.array([r.row() for r in recs], dtype=np.float64).reshape(len(recs), 9)
    y = np.array([r.wall_time for r in recs], dtype=np.float64)
    return x, y


def predictions(model: LinearLatencyModel, records: Iterable[StepRecord]) -> Floats:
    """The model's seconds for each step."""
    return np.array([model.predict_features(r.features()) for r in records], dtype=np.float64)


def mape(model: LinearLatencyModel, records: Iterable[StepRecord]) -> float:
    """Mean absolute percentage error (fraction) of ``model`` on ``records``."""
    recs = list(records)
    if not recs:
        return math.nan
    y = np.array([r.wall_time for r in recs], dtype=np.float64)
    return float(np.mean(np.abs(predictions(model, recs) - y) / y))


MIN_FIT_ROWS = 20
"""Fewest reservoir rows a fit is tried on (a workload of one regime fills few strata)."""

STRAGGLER = 3.0
"""A step slower than this many times the median of its stratum is a straggler."""


def without_stragglers(records: Iterable[StepRecord]) -> list[StepRecord]:
    """``records`` less the stragglers: steps slower than :data:`STRAGGLER` x the median
    step of their stratum (strata of at least five steps). A host hiccup (a page fault
    storm, a descheduled process, a garbage collection) makes one step many times slower
    than its composition explains; no latency model predicts it, and one such step in a
    least-squares fit or a mean error outweighs hundreds of ordinary ones."""
    recs = list(records)
    by: dict[tuple[str, int, int], list[float]] = {}
    for r in recs:
        by.setdefault(stratum(r), []).append(r.wall_time)
    cap = {k: STRAGGLER * float(np.median(v)) for k, v in by.items() if len(v) >= 5}
    return [r for r in recs if r.wall_time <= cap.get(stratum(r), math.inf)]


@dataclass(frozen=True, slots=True)
class LearnParams:
    min_steps: int = 200  # steps past the held-out window before the first fit
    refit_every: int = 500  # new steps between fits
    holdout: int = 256  # most recent steps kept out of the fit, to validate on
    per_stratum: int = 64
    max_mape: float = 0.10  # a fit above this held-out MAPE is not used
    drift: float = 0.05  # replace the model in force when predictions differ by more
    folds: int = 5

    def __post_init__(self) -> None:
        if self.min_steps < 10 or self.refit_every < 1 or self.holdout < 10:
            raise ValueError("min_steps >= 10, refit_every >= 1 and holdout >= 10 are required")
        if not (0 < self.max_mape < 1) or not (0 < self.drift < 1):
            raise ValueError("max_mape and drift are fractions in (0, 1)")


@dataclass(frozen=True, slots=True)
class Learned:
    """The model in force and its evidence."""

    model: LinearLatencyModel
    fit_steps: int
    seen_steps: int
    heldout_mape: float
    revision: int
    fitted_at: float


@dataclass(frozen=True, slots=True)
class FitOutcome:
    """What one :meth:`StepLearner.refit` did: ``accepted`` with a reason (``first``,
    ``stale``, ``better``, ``drift``), or not, with why (``invalid``, ``same``, ``error``,
    ``reset``)."""

    accepted: bool
    reason: str
    heldout_mape: float | None = None
    current_mape: float | None = None
    difference: float | None = None
    message: str = ""


@dataclass
class StepLearner:
    """Records in, a validated latency model out (see the module docstring)."""

    params: LearnParams = field(default_factory=LearnParams)
    meta: LatencyModelMeta = field(default_factory=LatencyModelMeta)
    seed: int = 0
    current: Learned | None = None
    seen: int = 0
    attempts: int = 0
    rejected: int = 0
    _recent: deque[StepRecord] = field(init=False)
    _reservoir: RegimeReservoir = field(init=False)
    _since_fit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.params.holdout)
        self._reservoir = RegimeReservoir(self.params.per_stratum, self.seed)

    @property
    def reservoir(self) -> RegimeReservoir:
        return self._reservoir

    @property
    def held_out(self) -> list[StepRecord]:
        """The recent steps no fit has seen (the validation window)."""
        return list(self._recent)

    def add(self, rec: StepRecord) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._reservoir.add(self._recent[0])  # leaves the held-out window: trainable
        self._recent.append(rec)
        self.seen += 1
        self._since_fit += 1

    def extend(self, recs: Iterable[StepRecord]) -> None:
        for rec in recs:
            self.add(rec)

    def due(self) -> bool:
        """Enough steps for a first fit, or enough new ones since the last attempt."""
        if (self.seen - self.params.holdout < self.params.min_steps
                or len(self._reservoir) < MIN_FIT_ROWS):
            return False
        return self.attempts == 0 or self._since_fit >= self.params.refit_every

    def refit(self, now: float) -> FitOutcome:
        """Fit on the reservoir, validate on the held-out window, and decide."""
        self._since_fit = 0
        self.attempts += 1
        x, y = matrix(without_stragglers(self._reservoir))
        held = without_stragglers(self._recent)
        try:
            cand = fit_matrix(x, y, folds=self.params.folds, seed=self.seed,
                              meta=self.meta).model
        except FitError as exc:
            self.rejected += 1
            return FitOutcome(False, "error", message=str(exc))
        err = mape(cand, held)
        cur_err = mape(self.current.model, held) if self.current is not None else None
        if err > self.params.max_mape:
            self.rejected += 1
            self._refresh(cur_err)
            msg = f"held-out MAPE {err:.1%} > {self.params.max_mape:.0%}"
            if cur_err is not None and cur_err > self.params.max_mape:
                self._reservoir = RegimeReservoir(self.params.per_stratum, self.seed)
                return FitOutcome(False, "reset", err, cur_err, message=msg + " and the model "
                                  f"in force is at {cur_err:.1%}: the engine changed; "
                                  "learning again from new steps")
            return FitOutcome(False, "invalid", err, cur_err, message=msg)
        if self.current is None or cur_err is None:
            return self._accept(cand, err, len(y), now, FitOutcome(True, "first", err))
        if cur_err > self.params.max_mape:
            return self._accept(cand, err, len(y), now,
                                FitOutcome(True, "stale", err, cur_err))
        if cur_err - err > self.params.drift:
            return self._accept(cand, err, len(y), now,
                                FitOutcome(True, "better", err, cur_err))
        cp, pp = predictions(cand, held), predictions(self.current.model, held)
        diff = float(np.mean(np.abs(cp - pp) / np.maximum(pp, 1e-9)))
        if diff > self.params.drift:
            return self._accept(cand, err, len(y), now,
                                FitOutcome(True, "drift", err, cur_err, diff))
        self._refresh(cur_err)
        return FitOutcome(False, "same", err, cur_err, diff,
                          message=f"predictions within {self.params.drift:.0%} of the model "
                          "in force")

    def _refresh(self, cur_err: float | None) -> None:
        if self.current is not None and cur_err is not None:
            c = self.current
            self.current = Learned(c.model, c.fit_steps, self.seen, cur_err, c.revision,
                                   c.fitted_at)

    def _accept(self, model: LinearLatencyModel, err: float, rows: int, now: float,
                outcome: FitOutcome) -> FitOutcome:
        revision = self.current.revision + 1 if self.current is not None else 1
        self.current = Learned(model, rows, self.seen, err, revision, now)
        return outcome
