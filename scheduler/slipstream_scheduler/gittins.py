"""Request cost and the Gittins rank of a predicted cost distribution (SageSched).

SageSched orders requests by the Gittins *rank* (the reciprocal form of the
Gittins index) of their predicted cost distribution::

    G(D) = inf_{Δ>0}  E[min(X, Δ)] / P(X ≤ Δ),        X ~ D, smaller runs first

with the per-request cost ``C = O²/2 + I·O`` (``I`` input, ``O`` output tokens):
SageSched's ``memory`` cost, the KV memory a request holds integrated over its
decode steps, which is what a request costs when KV memory bounds the batch.
``cost="output"`` selects ``C = O``, the decode steps a request occupies, which
is what it costs when a slot cap (the sidecar's in-flight limit, or
``max_num_seqs``) bounds the batch and a step takes about the same time
whatever the contexts. Both are increasing in ``O`` for a fixed ``I``, so every
rule below holds for either.
For a discrete distribution with sorted atoms ``c_1 < … < c_m``, cumulative
probabilities ``F_j`` and partial sums ``S_j = Σ_{i≤j} p_i c_i``, the infimum is
attained at an atom, so ``G = min_j (S_j + c_j (1 − F_j)) / F_j``: one sort, two
cumulative sums and a minimum. Samples are equally likely (the
``LengthPredictor`` contract), and ties need no special care: inside a run of
equal atoms the numerator is constant and ``F_j`` grows, so the run's last
index gives the smallest ratio.

Attained service: after ``o`` output tokens a request has used
``a = o²/2 + I·o``; its rank is that of the remaining cost ``X − a | X > a``.
Because the cost is increasing in ``O`` for a fixed ``I``, conditioning on
``X > a`` is conditioning on ``O > o``.

Outliving rule (the paper is silent; our choice, see
``docs/concepts/ordering-and-prefix.md``): when no predicted sample exceeds
``o``, (1) use the fallback sample (e.g. the global distribution) conditioned
on ``O > o``; (2) if that is empty too, assume the request will run as long
again as it has so far: a point distribution at ``O = 2·max(o, 1)``.

Deliberately left out: where the samples come from (``lengths.py``), when to
reorder a queue or preempt (``ordering.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

CostKind = Literal["memory", "output"]
"""``memory``: ``C = O²/2 + I·O`` (SageSched); ``output``: ``C = O`` (decode steps)."""

__all__ = [
    "DEFAULT_REFRESH_EVERY_TOKENS",
    "CostKind",
    "gittins_rank",
    "gittins_rank_sorted",
    "remaining_cost_sample",
    "request_cost",
    "surviving_lengths",
]

DEFAULT_REFRESH_EVERY_TOKENS = 200
"""SageSched's bucket size: refresh a request's rank every 200 output tokens."""


def request_cost(
    input_tokens: float, output_tokens: float | FloatArray, cost: CostKind = "memory"
) -> FloatArray:
    """``C = O²/2 + I·O`` (``memory``) or ``C = O`` (``output``) for one or many lengths."""
    o = np.asarray(output_tokens, dtype=np.float64)
    if cost == "output":
        return np.array(o, dtype=np.float64)
    return np.asarray(0.5 * o * o + float(input_tokens) * o, dtype=np.float64)


def gittins_rank_sorted(costs: FloatArray) -> float:
    """Gittins rank of equally likely, ascending, positive costs (O(m)).

    Raises ``ValueError`` on an empty sample: the caller must decide what an
    empty distribution means (see ``surviving_lengths``).
    """
    m = costs.shape[0]
    if m == 0:
        raise ValueError("empty cost distribution")
    if m <= _SMALL_SAMPLE:
        return _rank_sorted_list(costs.tolist())
    f = np.arange(1, m + 1, dtype=np.float64) / m
    s = np.cumsum(costs) / m
    return float(np.min((s + costs * (1.0 - f)) / f))


_SMALL_SAMPLE = 64
"""Up to this many atoms a plain loop beats numpy's per-call overhead (the predictor's
sample is typically 8); the arithmetic is the same, step for step."""


def _rank_sorted_list(costs: list[float]) -> float:
    m = len(costs)
    total = 0.0
    best = math.inf
    for j, c in enumerate(costs, start=1):
        total += c
        f = j / m
        value = (total / m + c * (1.0 - f)) / f
        best = min(best, value)
    return best


def gittins_rank(costs: FloatArray | list[float], attained: float = 0.0) -> float | None:
    """Rank of the remaining cost ``X − attained | X > attained``.

    Returns None when no sample exceeds ``attained`` (the request outlived its
    distribution); :func:`surviving_lengths` applies the outliving rule.
    """
    if len(costs) <= _SMALL_SAMPLE:
        values = costs.tolist() if isinstance(costs, np.ndarray) else costs
        alive = sorted(float(c) - attained for c in values if c > attained)
        return _rank_sorted_list(alive) if alive else None
    c = np.sort(np.asarray(costs, dtype=np.float64))
    start = int(np.searchsorted(c, attained, side="right"))
    if start >= c.shape[0]:
        return None
    return gittins_rank_sorted(c[start:] - attained)


def surviving_lengths(
    sorted_lengths: FloatArray, generated_tokens: int, fallback_sorted: FloatArray | None = None
) -> FloatArray:
    """Output-length samples still possible after ``generated_tokens`` (all > it).

    Applies the outliving rule: predicted samples with ``O > o``; else fallback
    samples with ``O > o``; else the point ``O = 2·max(o, 1)``.
    """
    o = float(generated_tokens)
    start = int(np.searchsorted(sorted_lengths, o, side="right"))
    if start < sorted_lengths.shape[0]:
        return sorted_lengths[start:]
    if fallback_sorted is not None:
        start = int(np.searchsorted(fallback_sorted, o, side="right"))
        if start < fallback_sorted.shape[0]:
            return fallback_sorted[start:]
    return np.array([2.0 * max(o, 1.0)], dtype=np.float64)


def remaining_cost_sample(
    sorted_lengths: FloatArray,
    input_tokens: int,
    generated_tokens: int,
    fallback_sorted: FloatArray | None = None,
    cost: CostKind = "memory",
) -> FloatArray:
    """Ascending remaining costs ``C(O) − C(o)`` over the surviving samples (all > 0)."""
    alive = surviving_lengths(sorted_lengths, generated_tokens, fallback_sorted)
    attained = float(request_cost(input_tokens, float(generated_tokens), cost))
    return request_cost(input_tokens, alive, cost) - attained
