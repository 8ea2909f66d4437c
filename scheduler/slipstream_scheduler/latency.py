"""HyGen's batch-latency model: predicts one engine iteration's wall time.

The model is linear in a handful of batch-composition features (HyGen §1.2 in
``research/algorithms.md``) plus one hinge::

    T = c0 + c1*S_p + c2*S_p**2 + c3*N_p + c4*N_d + c5*S_d_tok + c6*S_d_ctx + c7*P_c
        + c8*max(0, tokens - knee)

``S_p`` prefill tokens in the step, ``N_p``/``N_d`` prefill/decode requests,
``S_d_tok`` decode tokens (the literal reading of HyGen's ``S_d``), ``S_d_ctx``
the sum of the decode requests' context lengths (the attention reading of
``S_d``) and ``P_c = sum(chunk_i * context_i)`` over prefill chunks (a chunk's
attention against its already-computed prefix, which matters with chunked
prefill and prefix caching). ``tokens`` is every token in the step: below
the ``knee`` the GPU is under-utilised and the linear operators cost nearly the
same whatever the batch, above it they turn throughput-bound; the hinge is the
extra slope past the knee (a convex bend, so its coefficient is non-negative
like the others). A :class:`FeatureSet` names which coefficients are fitted; the
others are zero, so prediction is one fixed expression.

Hot path: the planner never re-sums a batch. It keeps a :class:`BatchFeatures`
accumulator, adds one item in O(1), and asks
:meth:`LinearLatencyModel.predict_features` (a few multiply-adds over a
precomputed coefficient tuple) or :meth:`LinearLatencyModel.max_prefill_tokens`
(closed-form solution of the quadratic in the chunk size, one quadratic on each
side of the knee: HyGen's ``get_max_prefill``). ``predict(batch)`` implements the ``LatencyModel``
protocol for callers that hold a plain batch.

Fitting: least squares with every coefficient except the intercept kept
non-negative (active-set elimination: fit, drop the most negative feature,
refit). Non-negative coefficients make the prediction monotone when an item is
added, which the planner and the closed-form chunk solver rely on. Feature-set
selection is by k-fold MAPE with a parsimony rule; the knee of the hinge sets
is picked from a grid by the same k-fold MAPE (see :func:`fit`).

Persistence is a JSON *string* with a schema version and model / GPU /
engine-settings metadata; reading and writing files is the caller's job.
Version 2 adds the hinge (``knee_tokens`` and the ``tokens_over_knee``
coefficient); version 1 documents (no hinge) are still read, as the same model
with a zero hinge, so no migration is needed. Version 3 adds the optional token
curve (feature set ``context+chunk+curve``: the last coefficient scales a fitted
monotone piecewise-linear curve of the step's token count instead of the hinge;
opt-in in :func:`fit`); a model without a curve is still written as version 2.

Deliberately left out: file I/O, online refitting from live step timings, and
any feature that needs more than the batch composition (GPU clocks, TP
collectives). Errors::

    LatencyModelError
     +-- FitError            (bad rows: too few, non-positive times, ...)
     +-- ModelFormatError    (JSON that is not a latency model we can read)
          +-- SchemaVersionError
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from slipstream_scheduler.types import BatchItem, Phase

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3
"""Newest version :meth:`LinearLatencyModel.to_json` writes: 3 for a model with a token
curve. A model without one is written as version 2, so builds that predate the curve
(an operator or sidecar mid-rollout) still read it."""

READABLE_SCHEMA_VERSIONS = (1, 2, 3)
"""Versions :meth:`LinearLatencyModel.from_json` reads (1: the eight linear columns only;
2: adds the hinge; 3: adds the optional token curve)."""

MODEL_KIND = "slipstream.latency-model"

FEATURE_NAMES: tuple[str, ...] = (
    "const",
    "s_p",
    "s_p_sq",
    "n_p",
    "n_d",
    "s_d_tok",
    "s_d_ctx",
    "p_c",
    "tokens_over_knee",
)
"""Order of the coefficient tuple and of the columns of :func:`feature_matrix`."""

_N_FEATURES = len(FEATURE_NAMES)
_N_LINEAR = _N_FEATURES - 1  # the schema-1 columns: everything but the hinge
_HINGE = _N_FEATURES - 1

KNEE_GRID: tuple[int, ...] = (
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
    1536,
    2048,
    3072,
    4096,
)
"""Candidate knees (tokens per step) :func:`fit` tries for the hinge sets.

Roughly geometric (x1.5 / x1.33), because the bend sits anywhere from a few
dozen tokens (small models, big GPUs) to a few hundred. Knees with fewer than
:data:`MIN_SIDE_SHARE` of the rows on either side are skipped: there the hinge
cannot be told apart from the linear ``S_p`` term.
"""

MIN_SIDE_SHARE = 0.05
"""Least share of the rows that must lie on each side of a candidate knee."""

CURVE_STEP_TOKENS = 32
"""Knot spacing of the token curve (tokens per step): one non-negative slope per segment.

Measured on the four shipped profiles (``docs/concepts/engine-model.md``): 64 leaves
the A100 sweeps over 1.3 % MAPE, 16 gains under 0.2 points more for four times the
fitting time."""

MAX_CURVE_KNOTS = 4097
"""Most values a token curve may hold (4096 segments): bounds what a document or a
``Configure`` call can make a process allocate. The shipped profiles use 65."""

MAX_CURVE_SPAN_TOKENS = 131072
"""Largest step (tokens) a token curve may span, ``(knots - 1) * curve_step_tokens``:
prediction indexes a dense per-token table of that length."""


# --------------------------------------------------------------------------- errors


class LatencyModelError(Exception):
    """Base of this module's errors."""


class FitError(LatencyModelError):
    """The rows given to :func:`fit` cannot produce a model."""

    def __init__(self, message: str, *, rows: int) -> None:
        super().__init__(f"{message} (rows={rows})")
        self.rows = rows


class ModelFormatError(LatencyModelError):
    """A JSON document is not a latency model this code can read."""

    def __init__(self, message: str, *, field_name: str | None = None) -> None:
        super().__init__(message if field_name is None else f"{message} (field {field_name!r})")
        self.field_name = field_name


class SchemaVersionError(ModelFormatError):
    """The document's schema version is not the one this code writes."""

    def __init__(self, found: object, expected: int = SCHEMA_VERSION) -> None:
        readable = ", ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
        super().__init__(
            f"latency model schema version {found!r} is not supported; this build reads "
            f"versions {readable} and writes {expected}: re-run the profiler to write a "
            "current model",
            field_name="schema_version",
        )
        self.found = found
        self.expected = expected


# --------------------------------------------------------------------------- features


class FeatureSet(enum.Enum):
    """Which readings of HyGen's features a model uses (the names of fitted columns).

    ``TOKENS`` reads ``S_d`` as decode tokens (equal to ``N_d`` without
    speculative decoding, so it adds nothing then); ``CONTEXT`` reads it as the
    sum of decode context lengths; the ``*_CHUNK`` sets add ``P_c``; the
    ``*_HINGE`` sets add ``max(0, tokens - knee)``.
    """

    TOKENS = "tokens"
    CONTEXT = "context"
    TOKENS_CHUNK = "tokens+chunk"
    CONTEXT_CHUNK = "context+chunk"
    TOKENS_HINGE = "tokens+hinge"
    CONTEXT_HINGE = "context+hinge"
    TOKENS_CHUNK_HINGE = "tokens+chunk+hinge"
    CONTEXT_CHUNK_HINGE = "context+chunk+hinge"
    CONTEXT_CHUNK_CURVE = "context+chunk+curve"

    @property
    def columns(self) -> tuple[str, ...]:
        return _COLUMNS[self]

    @property
    def has_hinge(self) -> bool:
        return "tokens_over_knee" in _COLUMNS[self] and self is not FeatureSet.CONTEXT_CHUNK_CURVE

    @property
    def has_curve(self) -> bool:
        """The last coefficient scales a fitted monotone token curve instead of the hinge."""
        return self is FeatureSet.CONTEXT_CHUNK_CURVE

    @property
    def mask(self) -> tuple[bool, ...]:
        cols = _COLUMNS[self]
        return tuple(name in cols for name in FEATURE_NAMES)


_BASE = ("const", "s_p", "s_p_sq", "n_p", "n_d")
_COLUMNS: dict[FeatureSet, tuple[str, ...]] = {
    FeatureSet.TOKENS: (*_BASE, "s_d_tok"),
    FeatureSet.CONTEXT: (*_BASE, "s_d_ctx"),
    FeatureSet.TOKENS_CHUNK: (*_BASE, "s_d_tok", "p_c"),
    FeatureSet.CONTEXT_CHUNK: (*_BASE, "s_d_ctx", "p_c"),
    FeatureSet.TOKENS_HINGE: (*_BASE, "s_d_tok", "tokens_over_knee"),
    FeatureSet.CONTEXT_HINGE: (*_BASE, "s_d_ctx", "tokens_over_knee"),
    FeatureSet.TOKENS_CHUNK_HINGE: (*_BASE, "s_d_tok", "p_c", "tokens_over_knee"),
    FeatureSet.CONTEXT_CHUNK_HINGE: (*_BASE, "s_d_ctx", "p_c", "tokens_over_knee"),
    FeatureSet.CONTEXT_CHUNK_CURVE: (*_BASE, "s_d_ctx", "p_c", "tokens_over_knee"),
}

DEFAULT_FEATURE_SETS: tuple[FeatureSet, ...] = tuple(fs for fs in FeatureSet if not fs.has_curve)
"""What :func:`fit` tries by default: the curve set is opt-in (it costs seconds to fit
and a model with a curve needs schema 3 end to end)."""


class BatchFeatures:
    """Running sums over a batch; adding or removing one item is O(1).

    Mutable on purpose: the planner owns one per plan and grows it item by
    item. ``tokens`` (all tokens in the step) is kept for the token cap and
    for the hinge (a model's knee is applied at prediction time, so one
    accumulator serves any model).
    """

    __slots__ = ("n_d", "n_p", "p_c", "s_d_ctx", "s_d_tok", "s_p", "tokens")

    def __init__(self) -> None:
        self.s_p = 0
        self.n_p = 0
        self.n_d = 0
        self.s_d_tok = 0
        self.s_d_ctx = 0
        self.p_c = 0
        self.tokens = 0

    @classmethod
    def of(cls, batch: Iterable[BatchItem]) -> BatchFeatures:
        acc = cls()
        for item in batch:
            acc.add(item)
        return acc

    def add_prefill(self, tokens: int, context: int) -> None:
        self.s_p += tokens
        self.n_p += 1
        self.p_c += tokens * context
        self.tokens += tokens

    def add_decode(self, tokens: int, context: int) -> None:
        self.n_d += 1
        self.s_d_tok += tokens
        self.s_d_ctx += context
        self.tokens += tokens

    def remove_prefill(self, tokens: int, context: int) -> None:
        self.s_p -= tokens
        self.n_p -= 1
        self.p_c -= tokens * context
        self.tokens -= tokens

    def remove_decode(self, tokens: int, context: int) -> None:
        self.n_d -= 1
        self.s_d_tok -= tokens
        self.s_d_ctx -= context
        self.tokens -= tokens

    def add(self, item: BatchItem) -> None:
        if item.phase is Phase.PREFILL:
            self.add_prefill(item.tokens, item.context)
        else:
            self.add_decode(item.tokens, item.context)

    def remove(self, item: BatchItem) -> None:
        if item.phase is Phase.PREFILL:
            self.remove_prefill(item.tokens, item.context)
        else:
            self.remove_decode(item.tokens, item.context)

    def copy(self) -> BatchFeatures:
        other = BatchFeatures()
        other.s_p = self.s_p
        other.n_p = self.n_p
        other.n_d = self.n_d
        other.s_d_tok = self.s_d_tok
        other.s_d_ctx = self.s_d_ctx
        other.p_c = self.p_c
        other.tokens = self.tokens
        return other

    def minus(self, other: BatchFeatures) -> BatchFeatures:
        """A new accumulator for this batch without ``other`` (one of its sub-batches)."""
        out = self.copy()
        out.s_p -= other.s_p
        out.n_p -= other.n_p
        out.n_d -= other.n_d
        out.s_d_tok -= other.s_d_tok
        out.s_d_ctx -= other.s_d_ctx
        out.p_c -= other.p_c
        out.tokens -= other.tokens
        return out

    def row(self, knee_tokens: int = 0) -> tuple[float, ...]:
        """The raw feature row, in :data:`FEATURE_NAMES` order, hinge at ``knee_tokens``."""
        s_p = float(self.s_p)
        return (
            1.0,
            s_p,
            s_p * s_p,
            float(self.n_p),
            float(self.n_d),
            float(self.s_d_tok),
            float(self.s_d_ctx),
            float(self.p_c),
            float(max(0, self.tokens - knee_tokens)),
        )

    def __repr__(self) -> str:
        return (
            f"BatchFeatures(s_p={self.s_p}, n_p={self.n_p}, n_d={self.n_d}, "
            f"s_d_tok={self.s_d_tok}, s_d_ctx={self.s_d_ctx}, p_c={self.p_c}, "
            f"tokens={self.tokens})"
        )


def feature_matrix(
    batches: Sequence[Sequence[BatchItem]], knee_tokens: int = 0
) -> npt.NDArray[np.float64]:
    """Raw feature rows (``len(batches)`` x 9) for fitting or evaluation.

    The last column is ``max(0, tokens - knee_tokens)``; with the default knee
    of 0 it is the step's total token count, from which :func:`with_knee`
    derives the column for any other knee without re-summing the batches.
    """
    out = np.empty((len(batches), _N_FEATURES), dtype=np.float64)
    for i, batch in enumerate(batches):
        out[i] = BatchFeatures.of(batch).row(knee_tokens)
    return out


def with_knee(x: npt.NDArray[np.float64], knee_tokens: int) -> npt.NDArray[np.float64]:
    """A copy of ``x`` (built with knee 0) whose hinge column uses ``knee_tokens``."""
    out = x.copy()
    out[:, _HINGE] = np.maximum(0.0, x[:, _HINGE] - knee_tokens)
    return out


# --------------------------------------------------------------------------- model


class LatencyModelMeta(BaseModel):
    """Where a fitted model is valid: which model, GPU and engine settings it was profiled on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(default="", description="served model name, e.g. meta-llama/Llama-2-7b-hf")
    gpu: str = Field(default="", description="GPU the rows come from, e.g. h100")
    engine: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="engine settings that change iteration time (max_num_batched_tokens, "
        "tensor_parallel_size, dtype, ...); default: empty",
    )
    source: str = Field(default="", description="how the rows were produced")


def _default_meta() -> LatencyModelMeta:
    return LatencyModelMeta()


def _heldout(value: object) -> float | None:
    """A fit block's ``heldout_mape``: a finite non-negative fraction, or None."""
    if value is None:
        return None
    mape = float(value)  # type: ignore[arg-type]  # a bad type raises, as the block's others
    if not (math.isfinite(mape) and mape >= 0):
        raise ValueError(f"heldout_mape must be finite and >= 0, got {value!r}")
    return mape


@dataclass(frozen=True, slots=True)
class FitStats:
    """How well a model fitted: k-fold MAPE of every candidate and of the chosen set."""

    rows: int
    folds: int
    kfold_mape: float  # of the chosen feature set, fraction (0.02 = 2 %)
    train_mape: float  # of the final model on all rows, fraction
    candidates: tuple[tuple[str, float], ...]  # (feature-set value, k-fold MAPE at its best knee)
    knee_grid: tuple[tuple[int, float], ...] = ()  # (knee, k-fold MAPE) of the best hinge set
    # MAPE on rows held out of the fit altogether (fraction); None when none were held out.
    heldout_mape: float | None = None


@dataclass(frozen=True, slots=True)
class LinearLatencyModel:
    """A fitted (or hand-written) linear batch-latency model. Seconds per iteration.

    ``coefficients`` follow :data:`FEATURE_NAMES`; entries outside
    ``feature_set`` are zero. Every coefficient but the intercept must be
    non-negative, which makes the prediction monotone in the batch. An
    8-tuple (the schema-1 columns, no hinge) is accepted and padded with a
    zero hinge coefficient. ``knee_tokens`` is where the hinge starts (tokens
    per step); it must be 0 for a set without the hinge. A hinge set with the
    knee left at 0 is still a valid model, only a conservative one (it charges
    the hinge slope from the first token).

    The curve set (``context+chunk+curve``) replaces the hinge by a fitted
    monotone curve ``phi(tokens)``, piecewise linear with knots every
    ``curve_step_tokens``: ``token_curve`` holds ``phi`` at the knots
    (``phi(0) = 0``, non-decreasing, normalised to an average slope of 1)
    and the last coefficient scales it, so multiplying every coefficient by
    a factor still scales every prediction by it. Past the last knot ``phi``
    continues with its last segment's slope.
    """

    feature_set: FeatureSet
    coefficients: tuple[float, ...]
    meta: LatencyModelMeta = field(default_factory=_default_meta)
    stats: FitStats | None = None
    knee_tokens: int = 0
    token_curve: tuple[float, ...] = ()
    curve_step_tokens: int = 0
    _phi: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.coefficients) == _N_LINEAR:
            object.__setattr__(self, "coefficients", (*self.coefficients, 0.0))
        if len(self.coefficients) != _N_FEATURES:
            raise ModelFormatError(
                f"expected {_N_FEATURES} coefficients, got {len(self.coefficients)}",
                field_name="coefficients",
            )
        mask = self.feature_set.mask
        for name, used, value in zip(FEATURE_NAMES, mask, self.coefficients, strict=True):
            if not math.isfinite(value):
                raise ModelFormatError(f"coefficient {name} is not finite", field_name=name)
            if not used and value != 0.0:
                raise ModelFormatError(
                    f"coefficient {name} is outside feature set {self.feature_set.value}",
                    field_name=name,
                )
            if name != "const" and value < 0.0:
                raise ModelFormatError(
                    f"coefficient {name} is negative; the model must be monotone",
                    field_name=name,
                )
        knee = self.knee_tokens
        if isinstance(knee, bool) or not isinstance(knee, int) or knee < 0:
            raise ModelFormatError(
                f"knee_tokens must be a non-negative integer, got {knee!r}",
                field_name="knee_tokens",
            )
        if knee and not self.feature_set.has_hinge:
            raise ModelFormatError(
                f"knee_tokens is set but feature set {self.feature_set.value} has no hinge",
                field_name="knee_tokens",
            )
        self._check_curve()

    def _check_curve(self) -> None:
        curve, step = self.token_curve, self.curve_step_tokens
        if not self.feature_set.has_curve:
            if curve or step:
                raise ModelFormatError(
                    f"a token curve is set but feature set {self.feature_set.value} has none",
                    field_name="token_curve",
                )
            return
        if isinstance(step, bool) or not isinstance(step, int) or step <= 0 or len(curve) < 2:
            raise ModelFormatError(
                "feature set context+chunk+curve needs its token curve (>= 2 knots) and a "
                "positive curve_step_tokens; a transport that carries only the named "
                "coefficients cannot rebuild this model",
                field_name="token_curve",
            )
        if len(curve) > MAX_CURVE_KNOTS or (len(curve) - 1) * step > MAX_CURVE_SPAN_TOKENS:
            raise ModelFormatError(
                f"token curve too long: {len(curve)} knots every {step} tokens (at most "
                f"{MAX_CURVE_KNOTS} knots spanning {MAX_CURVE_SPAN_TOKENS} tokens)",
                field_name="token_curve",
            )
        finite = all(math.isfinite(v) for v in curve)
        rising = all(b >= a for a, b in itertools.pairwise(curve))
        if curve[0] != 0.0 or not finite or not rising:
            raise ModelFormatError(
                "token_curve must start at 0 and be finite and non-decreasing",
                field_name="token_curve",
            )
        # Dense per-token table: prediction is one index, whatever the knot count.
        dense: list[float] = []
        for j in range(len(curve) - 1):
            a, slope = curve[j], (curve[j + 1] - curve[j]) / step
            dense.extend(a + slope * i for i in range(step))
        dense.append(curve[-1])
        object.__setattr__(self, "_phi", tuple(dense))

    def _phi_at(self, tokens: int) -> float:
        """``phi(tokens)`` past the dense table: the last segment's slope continued."""
        phi, step = self._phi, self.curve_step_tokens
        last = len(phi) - 1
        return phi[last] + (phi[last] - phi[last - step]) / step * (tokens - last)

    def _over(self, tokens: int) -> float:
        """The last column's value for a step of ``tokens`` tokens (hinge or curve)."""
        phi = self._phi
        if phi:
            if tokens < len(phi):
                return phi[tokens] if tokens > 0 else 0.0
            return self._phi_at(tokens)
        over = tokens - self.knee_tokens
        return float(over) if over > 0 else 0.0

    # -- prediction -------------------------------------------------------------------

    def predict_features(self, f: BatchFeatures) -> float:
        """Seconds for the batch summarised by ``f``. The planner's hot path."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self.coefficients
        s_p = f.s_p
        t = f.tokens
        phi = self._phi
        if phi:
            g = (phi[t] if t < len(phi) else self._phi_at(t)) if t > 0 else 0.0
        else:
            over = t - self.knee_tokens
            g = over if over > 0 else 0.0
        return (
            c0
            + (c1 + c2 * s_p) * s_p
            + c3 * f.n_p
            + c4 * f.n_d
            + c5 * f.s_d_tok
            + c6 * f.s_d_ctx
            + c7 * f.p_c
            + c8 * g
        )

    def predict(self, batch: Sequence[BatchItem]) -> float:
        """Seconds for one iteration over ``batch`` (the ``LatencyModel`` protocol)."""
        if not batch:
            return 0.0
        return self.predict_features(BatchFeatures.of(batch))

    def predict_with_prefill(self, f: BatchFeatures, tokens: int, context: int) -> float:
        """Seconds for ``f`` plus one prefill chunk, without touching ``f``."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self.coefficients
        s_p = f.s_p + tokens
        return (
            c0
            + (c1 + c2 * s_p) * s_p
            + c3 * (f.n_p + 1)
            + c4 * f.n_d
            + c5 * f.s_d_tok
            + c6 * f.s_d_ctx
            + c7 * (f.p_c + tokens * context)
            + c8 * self._over(f.tokens + tokens)
        )

    def predict_with_decode(self, f: BatchFeatures, context: int, tokens: int = 1) -> float:
        """Seconds for ``f`` plus one decode, without touching ``f``."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self.coefficients
        s_p = f.s_p
        return (
            c0
            + (c1 + c2 * s_p) * s_p
            + c3 * f.n_p
            + c4 * (f.n_d + 1)
            + c5 * (f.s_d_tok + tokens)
            + c6 * (f.s_d_ctx + context)
            + c7 * f.p_c
            + c8 * self._over(f.tokens + tokens)
        )

    def max_prefill_tokens(
        self, f: BatchFeatures, context: int, budget_s: float, limit: int
    ) -> int:
        """Largest chunk ``x <= limit`` with ``predict(f + prefill(x, context)) <= budget_s``.

        HyGen's ``get_max_prefill``. Adding a chunk of ``x`` tokens predicts
        ``A + B*x + C*x**2`` with ``B, C >= 0`` (non-negative coefficients)
        while the step stays at or below the knee, and the same quadratic with
        ``B + c8`` and ``A + c8*(tokens - knee)`` past it: continuous and
        non-decreasing in ``x``. The root of the first piece is the answer
        when it lies at or before the knee, otherwise the root of the second
        is. Floored, then checked against the model to absorb rounding.
        Returns 0 when not even a 1-token chunk fits.
        """
        if limit <= 0:
            return 0
        if self._phi:
            return self._max_prefill_search(f, context, budget_s, limit)
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self.coefficients
        s_p = f.s_p
        a = (
            c0
            + (c1 + c2 * s_p) * s_p
            + c3 * (f.n_p + 1)
            + c4 * f.n_d
            + c5 * f.s_d_tok
            + c6 * f.s_d_ctx
            + c7 * f.p_c
        )
        b = c1 + 2.0 * c2 * s_p + c7 * context
        # Chunk size at which the step reaches the knee (<= 0: already past it).
        x_knee = self.knee_tokens - f.tokens
        if c8 > 0.0 and x_knee <= 0:
            a += c8 * -x_knee
            b += c8
            x_real = _quadratic_root(a, b, c2, budget_s)
        else:
            x_real = _quadratic_root(a, b, c2, budget_s)
            if c8 > 0.0 and x_real > x_knee:
                x_real = _quadratic_root(a - c8 * x_knee, b + c8, c2, budget_s)
        if x_real < 0.0:
            return 0
        x = limit if x_real >= limit else int(x_real)
        # Floating-point guard: at most a couple of steps either way.
        while x > 0 and self.predict_with_prefill(f, x, context) > budget_s:
            x -= 1
        while x < limit and self.predict_with_prefill(f, x + 1, context) <= budget_s:
            x += 1
        return x

    def _max_prefill_search(
        self, f: BatchFeatures, context: int, budget_s: float, limit: int
    ) -> int:
        """``max_prefill_tokens`` for a curve model.

        The prediction is ``a + b*x + c2*x**2 + c8*phi(tokens + x)``: monotone,
        and a quadratic between two knots of the curve. A binary search over
        the knots finds the segment where the budget runs out (a handful of
        evaluations), then the segment's quadratic is solved in closed form.
        """
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self.coefficients
        s_p, t0, step, phi = f.s_p, f.tokens, self.curve_step_tokens, self._phi
        a = (
            c0
            + (c1 + c2 * s_p) * s_p
            + c3 * (f.n_p + 1)
            + c4 * f.n_d
            + c5 * f.s_d_tok
            + c6 * f.s_d_ctx
            + c7 * f.p_c
        )
        b = c1 + 2.0 * c2 * s_p + c7 * context

        def total(x: int) -> float:
            return a + (b + c2 * x) * x + c8 * self._over(t0 + x)

        if total(1) > budget_s:
            return 0
        if total(limit) <= budget_s:
            return limit
        # Knots (token counts, multiples of step) strictly after t0 and within the limit.
        last_knot = len(phi) - 1
        j_lo, j_hi = t0 // step + 1, min(last_knot, t0 + limit) // step
        seg_start = t0  # token count where the budget's segment starts (at or before t0 + x)
        while j_lo <= j_hi:
            mid = (j_lo + j_hi) // 2
            if total(mid * step - t0) <= budget_s:
                seg_start = mid * step
                j_lo = mid + 1
            else:
                j_hi = mid - 1
        # phi is linear from seg_start to the next knot (or past the table).
        base = seg_start - seg_start % step if seg_start < last_knot else last_knot - step
        slope = (phi[base + step] - phi[base]) / step
        phi0 = self._over(seg_start) - slope * (seg_start - t0)  # phi(t0 + x) = phi0 + slope*x
        x_real = _quadratic_root(a + c8 * phi0, b + c8 * slope, c2, budget_s)
        x = limit if x_real >= limit else max(0, int(x_real))
        # Floating-point and segment-edge guard: a couple of steps either way.
        while x > 0 and total(x) > budget_s:
            x -= 1
        while x < limit and total(x + 1) <= budget_s:
            x += 1
        return x

    # -- persistence -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": MODEL_KIND,
            "schema_version": SCHEMA_VERSION if self.token_curve else 2,
            "feature_set": self.feature_set.value,
            "coefficients": dict(zip(FEATURE_NAMES, self.coefficients, strict=True)),
            "knee_tokens": self.knee_tokens,
            "units": "seconds per iteration; knee_tokens in tokens per step",
            "meta": self.meta.model_dump(mode="json"),
        }
        if self.token_curve:
            doc["token_curve"] = {
                "step_tokens": self.curve_step_tokens,
                "values": list(self.token_curve),
            }
        if self.stats is not None:
            doc["fit"] = {
                "rows": self.stats.rows,
                "folds": self.stats.folds,
                "kfold_mape": self.stats.kfold_mape,
                "train_mape": self.stats.train_mape,
                "candidates": [list(c) for c in self.stats.candidates],
                "knee_grid": [list(k) for k in self.stats.knee_grid],
            }
            if self.stats.heldout_mape is not None:
                doc["fit"]["heldout_mape"] = self.stats.heldout_mape
        return doc

    def to_json(self) -> str:
        """The model as a JSON document (write it to a file yourself)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> LinearLatencyModel:
        if doc.get("kind") != MODEL_KIND:
            raise ModelFormatError(
                f"not a latency model: kind is {doc.get('kind')!r}", field_name="kind"
            )
        version = doc.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
            raise SchemaVersionError(version)
        names = FEATURE_NAMES if version >= 2 else FEATURE_NAMES[:_N_LINEAR]
        try:
            feature_set = FeatureSet(doc["feature_set"])
        except (KeyError, ValueError) as exc:
            raise ModelFormatError(
                "missing or unknown feature set", field_name="feature_set"
            ) from exc
        if version < 2 and feature_set.has_hinge:
            raise ModelFormatError(
                f"feature set {feature_set.value} needs schema version 2",
                field_name="feature_set",
            )
        if version < 3 and (feature_set.has_curve or "token_curve" in doc):
            raise ModelFormatError("a token curve needs schema version 3", field_name="token_curve")
        curve: tuple[float, ...] = ()
        step = 0
        curve_doc = doc.get("token_curve")
        if curve_doc is not None:
            if not isinstance(curve_doc, Mapping):
                raise ModelFormatError("token_curve must be an object", field_name="token_curve")
            raw_step, values = curve_doc.get("step_tokens"), curve_doc.get("values")
            if isinstance(raw_step, bool) or not isinstance(raw_step, int):
                raise ModelFormatError(
                    "token_curve.step_tokens must be an integer", field_name="token_curve"
                )
            if not isinstance(values, list):
                raise ModelFormatError(
                    "token_curve.values must be a list", field_name="token_curve"
                )
            try:
                curve, step = tuple(float(v) for v in values), raw_step
            except (TypeError, ValueError) as exc:
                raise ModelFormatError(
                    f"token_curve.values: {exc}", field_name="token_curve"
                ) from exc
        raw = doc.get("coefficients")
        if not isinstance(raw, Mapping):
            raise ModelFormatError("coefficients must be an object", field_name="coefficients")
        unknown = set(raw) - set(names)
        if unknown:
            raise ModelFormatError(
                f"unknown coefficients {sorted(unknown)} for schema version {version}",
                field_name="coefficients",
            )
        knee = doc.get("knee_tokens", 0) if version >= 2 else 0
        if isinstance(knee, bool) or not isinstance(knee, int):
            raise ModelFormatError("knee_tokens must be an integer", field_name="knee_tokens")
        try:
            coefficients = tuple(float(raw.get(name, 0.0)) for name in FEATURE_NAMES)
            meta = LatencyModelMeta.model_validate(doc.get("meta", {}))
        except (TypeError, ValueError, ValidationError) as exc:
            raise ModelFormatError(f"invalid model document: {exc}") from exc
        stats = None
        fit_doc = doc.get("fit")
        if isinstance(fit_doc, Mapping):
            try:
                stats = FitStats(
                    rows=int(fit_doc["rows"]),
                    folds=int(fit_doc["folds"]),
                    kfold_mape=float(fit_doc["kfold_mape"]),
                    train_mape=float(fit_doc["train_mape"]),
                    candidates=tuple((str(k), float(v)) for k, v in fit_doc["candidates"]),
                    knee_grid=tuple((int(k), float(v)) for k, v in fit_doc.get("knee_grid", ())),
                    heldout_mape=_heldout(fit_doc.get("heldout_mape")),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelFormatError(f"invalid fit block: {exc}", field_name="fit") from exc
        return cls(
            feature_set=feature_set,
            coefficients=coefficients,
            meta=meta,
            stats=stats,
            knee_tokens=knee,
            token_curve=curve,
            curve_step_tokens=step,
        )

    @classmethod
    def from_json(cls, text: str) -> LinearLatencyModel:
        """Parse a document written by :meth:`to_json`; checks kind and schema version."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"latency model is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ModelFormatError("latency model JSON must be an object")
        return cls.from_dict(doc)


def _quadratic_root(a: float, b: float, c: float, budget_s: float) -> float:
    """Largest real ``x`` with ``a + b*x + c*x**2 <= budget_s`` (``b, c >= 0``).

    Negative when even ``x = 0`` is over budget; ``inf`` when nothing grows.
    """
    slack = budget_s - a
    if slack < 0.0:
        return -1.0
    if c > 0.0:
        return (math.sqrt(b * b + 4.0 * c * slack) - b) / (2.0 * c)
    if b > 0.0:
        return slack / b
    return math.inf


# --------------------------------------------------------------------------- fitting


def _nonneg_lstsq(
    x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], mask: Sequence[bool]
) -> npt.NDArray[np.float64]:
    """Least squares over the masked columns; all but column 0 (intercept) kept >= 0.

    Active-set elimination: solve, drop the most negative coefficient, repeat.
    Columns are scaled to unit max first: ``S_p**2`` and ``P_c`` are ~1e7 while
    ``N_p`` is ~1, and unscaled least squares loses digits.
    """
    active = [i for i, used in enumerate(mask) if used]
    coef = np.zeros(x.shape[1], dtype=np.float64)
    while active:
        sub = x[:, active]
        scale = np.max(np.abs(sub), axis=0)
        scale[scale == 0.0] = 1.0
        sol, *_ = np.linalg.lstsq(sub / scale, y, rcond=None)
        sol = sol / scale
        negative = [(sol[k], k) for k, col in enumerate(active) if col != 0 and sol[k] < 0.0]
        if not negative:
            coef[:] = 0.0
            coef[active] = sol
            # Columns with no data (all zero) can come back as tiny non-zeros.
            coef[[i for i in active if i != 0 and not np.any(x[:, i])]] = 0.0
            return coef
        _, worst = min(negative)
        del active[worst]
    return coef


def _mape(
    x: npt.NDArray[np.float64], y: npt.NDArray[np.float64], coef: npt.NDArray[np.float64]
) -> float:
    return float(np.mean(np.abs(x @ coef - y) / y))


def kfold_mape(
    x: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
    feature_set: FeatureSet,
    *,
    folds: int = 5,
    seed: int = 0,
) -> float:
    """Mean absolute percentage error (fraction) of ``feature_set`` under k-fold CV.

    ``x`` is a :func:`feature_matrix` (its hinge column at the knee to score).
    Rows are shuffled with ``seed`` and split into ``folds`` near-equal parts;
    each part is predicted by a model fitted on the others; the result is the
    mean over *all rows* of ``|pred - y| / y``.
    """
    return _kfold(x, y, feature_set.mask, folds=folds, seed=seed)


def _kfold(
    x: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
    mask: Sequence[bool],
    *,
    folds: int,
    seed: int,
) -> float:
    n = len(y)
    if folds < 2 or n < folds:
        raise FitError(f"k-fold needs at least {max(folds, 2)} rows and folds >= 2", rows=n)
    order = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(order, folds)
    total = 0.0
    for k, test in enumerate(parts):
        train = np.concatenate([p for j, p in enumerate(parts) if j != k])
        coef = _nonneg_lstsq(x[train], y[train], mask)
        total += float(np.sum(np.abs(x[test] @ coef - y[test]) / y[test]))
    return total / n


@dataclass(frozen=True, slots=True)
class FitResult:
    """The chosen model and the evidence for choosing it."""

    model: LinearLatencyModel
    chosen: FeatureSet
    kfold: Mapping[FeatureSet, float]  # each hinge set at its best knee
    knees: Mapping[FeatureSet, int] = field(default_factory=dict)  # best knee per hinge set


def curve_matrix(
    x: npt.NDArray[np.float64], step: int = CURVE_STEP_TOKENS
) -> npt.NDArray[np.float64]:
    """``x`` (built with knee 0) with its hinge column replaced by token-curve segments.

    Segment ``j`` is ``clip(tokens - j*step, 0, step)``: the tokens of the step
    that fall in ``[j*step, (j+1)*step)``, so its coefficient is the curve's
    slope there. Enough segments to cover the largest step in ``x``.
    """
    tokens = x[:, _HINGE]
    top = max(1, math.ceil(float(np.max(tokens, initial=0.0)) / step))
    knots = np.arange(top, dtype=np.float64) * step
    segments = np.clip(tokens[:, None] - knots[None, :], 0.0, float(step))
    return np.hstack([x[:, :_HINGE], segments])


def _curve_mask(columns: int) -> list[bool]:
    base = FeatureSet.CONTEXT_CHUNK.mask[:_HINGE]
    return [*base, *([True] * (columns - _HINGE))]


def _curve_model_parts(
    coef: npt.NDArray[np.float64], step: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(nine coefficients, token curve) from a fit over :func:`curve_matrix` columns.

    The curve is normalised to an average slope of 1 over its knots and the
    last coefficient carries its scale; a curve the fit zeroed comes back
    empty (the caller falls back to the set without it).
    """
    slopes = coef[_HINGE:]
    knots = np.concatenate([[0.0], np.cumsum(slopes * step)])
    top = float(knots[-1])
    linear = tuple(float(c) for c in coef[:_HINGE])
    if top <= 0.0:
        return (*linear, 0.0), ()
    scale = top / (step * len(slopes))
    values = knots / scale
    values[0] = 0.0
    return (*linear, scale), tuple(float(v) for v in np.maximum.accumulate(values))


def candidate_knees(tokens: npt.NDArray[np.float64], grid: Sequence[int]) -> list[int]:
    """The knees of ``grid`` with at least :data:`MIN_SIDE_SHARE` of ``tokens`` on each side."""
    n = len(tokens)
    if n == 0:
        return []
    out = []
    for knee in sorted(set(grid)):
        above = float(np.count_nonzero(tokens > knee)) / n
        if MIN_SIDE_SHARE <= above <= 1.0 - MIN_SIDE_SHARE:
            out.append(knee)
    return out


def fit(
    rows: Sequence[tuple[Sequence[BatchItem], float]],
    *,
    feature_sets: Sequence[FeatureSet] | None = None,
    knees: Sequence[int] | None = None,
    folds: int = 5,
    seed: int = 0,
    parsimony: float = 0.02,
    meta: LatencyModelMeta | None = None,
) -> FitResult:
    """Fit a :class:`LinearLatencyModel` on ``(batch, seconds)`` rows.

    Every candidate feature set (all eight by default) is scored by k-fold
    MAPE; a hinge set is scored at each knee of ``knees`` (default
    :data:`KNEE_GRID`, less those with too few rows on a side, see
    :func:`candidate_knees`) and keeps its best one. The winner is the
    *smallest* set whose MAPE is within ``parsimony`` (relative, default 2 %)
    of the best one: a superset always fits the training rows at least as
    well, so without this rule noise alone would pick the largest set (the
    hinge is one column more than the set it extends, so it has to earn its
    place the same way). Ties in size go to the lower MAPE. The winner is
    refitted on all rows.

    Choosing the knee by the same k-fold MAPE that ranks the sets makes a
    hinge set's score slightly optimistic (the best of a dozen knees); held-out
    rows, as the profiler keeps, measure the chosen model without that bias.
    """
    n = len(rows)
    y = np.fromiter((float(t) for _, t in rows), dtype=np.float64, count=n)
    x = feature_matrix([b for b, _ in rows])  # hinge column at knee 0: total tokens
    return fit_matrix(x, y, feature_sets=feature_sets, knees=knees, folds=folds, seed=seed,
                      parsimony=parsimony, meta=meta)


def fit_matrix(
    x: npt.NDArray[np.float64],
    y: npt.NDArray[np.float64],
    *,
    feature_sets: Sequence[FeatureSet] | None = None,
    knees: Sequence[int] | None = None,
    folds: int = 5,
    seed: int = 0,
    parsimony: float = 0.02,
    meta: LatencyModelMeta | None = None,
) -> FitResult:
    """:func:`fit` on feature rows already built: ``x`` as :func:`feature_matrix` makes it
    (knee 0), ``y`` the seconds of each row. Rows learned from a live engine arrive as
    feature sums (:mod:`slipstream_scheduler.learning`), not as batches."""
    n = len(y)
    if x.shape != (n, _N_FEATURES):
        raise FitError(f"feature rows must be {n} x {_N_FEATURES}, got {x.shape}", rows=n)
    candidates = list(feature_sets) if feature_sets is not None else list(DEFAULT_FEATURE_SETS)
    if not candidates:
        raise FitError("no feature set to try", rows=n)
    grid = list(knees) if knees is not None else list(KNEE_GRID)
    if any(isinstance(k, bool) or not isinstance(k, int) or k <= 0 for k in grid):
        raise FitError("knees must be positive integers (tokens per step)", rows=n)
    min_rows = max(folds, max(len(fs.columns) for fs in candidates) + 1)
    if n < min_rows:
        raise FitError(f"need at least {min_rows} rows to fit", rows=n)
    if not np.all(np.isfinite(y)) or np.any(y <= 0.0):
        raise FitError("iteration times must be finite and positive", rows=n)
    usable = candidate_knees(x[:, _HINGE], grid)
    if not usable:
        dropped = [fs for fs in candidates if fs.has_hinge]
        if dropped:
            logger.info("no usable knee in %s for these rows: hinge sets not tried", grid)
        candidates = [fs for fs in candidates if not fs.has_hinge]
        if not candidates:
            raise FitError("no knee has enough rows on both sides to fit a hinge", rows=n)
    x_at = {k: with_knee(x, k) for k in usable}
    x_curve = curve_matrix(x) if any(fs.has_curve for fs in candidates) else x
    curve_mask = _curve_mask(x_curve.shape[1])
    scores: dict[FeatureSet, float] = {}
    best_knee: dict[FeatureSet, int] = {}
    knee_scores: dict[FeatureSet, list[tuple[int, float]]] = {}
    for fs in candidates:
        if fs.has_hinge:
            per_knee = [(k, kfold_mape(x_at[k], y, fs, folds=folds, seed=seed)) for k in usable]
            k_best, s_best = min(per_knee, key=lambda ks: (ks[1], ks[0]))
            scores[fs], best_knee[fs], knee_scores[fs] = s_best, k_best, per_knee
        elif fs.has_curve:
            scores[fs] = _kfold(x_curve, y, curve_mask, folds=folds, seed=seed)
        else:
            scores[fs] = kfold_mape(x, y, fs, folds=folds, seed=seed)
    best = min(scores.values())
    eligible = [fs for fs in candidates if scores[fs] <= best * (1.0 + parsimony)]
    chosen = min(eligible, key=lambda fs: (len(fs.columns), scores[fs]))
    knee = best_knee.get(chosen, 0)
    curve: tuple[float, ...] = ()
    if chosen.has_curve:
        raw = _nonneg_lstsq(x_curve, y, curve_mask)
        train_mape = _mape(x_curve, y, raw)
        coefficients, curve = _curve_model_parts(raw, CURVE_STEP_TOKENS)
        if not curve:  # the fit zeroed the curve: the same set without it
            score, chosen = scores[chosen], FeatureSet.CONTEXT_CHUNK
            scores.setdefault(chosen, score)
            coef = _nonneg_lstsq(x, y, chosen.mask)
            train_mape = _mape(x, y, coef)
            coefficients = tuple(float(c) for c in coef)
    else:
        x_fit = x_at[knee] if chosen.has_hinge else x
        coef = _nonneg_lstsq(x_fit, y, chosen.mask)
        if chosen.has_hinge and coef[_HINGE] == 0.0:
            knee = 0  # the fit dropped the hinge: keep the document canonical
        train_mape = _mape(x_fit, y, coef)
        coefficients = tuple(float(c) for c in coef)
    hinge_sets = [fs for fs in candidates if fs.has_hinge]
    grid_of = min(hinge_sets, key=lambda fs: scores[fs]) if hinge_sets else None
    stats = FitStats(
        rows=n,
        folds=folds,
        kfold_mape=scores[chosen],
        train_mape=train_mape,
        candidates=tuple((fs.value, scores[fs]) for fs in candidates),
        knee_grid=tuple(knee_scores[grid_of]) if grid_of is not None else (),
    )
    model = LinearLatencyModel(
        feature_set=chosen,
        coefficients=coefficients,
        meta=meta if meta is not None else LatencyModelMeta(),
        stats=stats,
        knee_tokens=knee,
        token_curve=curve,
        curve_step_tokens=CURVE_STEP_TOKENS if curve else 0,
    )
    logger.info(
        "latency model fitted: rows=%s set=%s knee=%s kfold_mape=%.4f candidates=%s",
        n,
        chosen.value,
        knee,
        scores[chosen],
        {fs.value: round(v, 5) for fs, v in scores.items()},
    )
    return FitResult(model=model, chosen=chosen, kfold=scores, knees=best_knee)
