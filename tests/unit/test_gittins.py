"""Gittins rank and request cost: closed form against brute force, and its known shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream_scheduler.gittins import (
    gittins_rank,
    gittins_rank_sorted,
    remaining_cost_sample,
    request_cost,
    surviving_lengths,
)

pytestmark = pytest.mark.unit

costs_st = st.lists(
    st.floats(min_value=0.5, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=30,
)


def brute_force_rank(costs: list[float], attained: float = 0.0) -> float | None:
    """inf over Δ of E[min(X', Δ)] / P(X' ≤ Δ) for X' = X − a | X > a, on many Δ."""
    x = np.array([c - attained for c in costs if c > attained])
    if x.size == 0:
        return None
    atoms = np.unique(x)
    mids = (atoms[:-1] + atoms[1:]) / 2 if atoms.size > 1 else np.array([])
    deltas = np.concatenate([atoms, mids, atoms * 1.5, [atoms.max() * 10]])
    best = float("inf")
    for d in deltas:
        p = float(np.mean(x <= d))
        if p > 0:
            best = min(best, float(np.mean(np.minimum(x, d))) / p)
    return best


def test_cost_formula() -> None:
    assert float(request_cost(100, 10)) == pytest.approx(10 * 10 / 2 + 100 * 10)
    np.testing.assert_allclose(request_cost(0, np.array([0.0, 2.0])), [0.0, 2.0])


@given(st.floats(min_value=0.5, max_value=1e9, allow_nan=False), st.integers(1, 20))
def test_point_distribution_rank_is_its_cost(cost: float, copies: int) -> None:
    # SJF order: a certain cost c has rank c.
    assert gittins_rank([cost] * copies) == pytest.approx(cost)


@settings(max_examples=200)
@given(costs_st, st.floats(min_value=0.0, max_value=1e6, allow_nan=False))
def test_closed_form_equals_brute_force(costs: list[float], attained: float) -> None:
    got = gittins_rank(costs, attained)
    want = brute_force_rank(costs, attained)
    if want is None:
        assert got is None
    else:
        assert got == pytest.approx(want, rel=1e-9)


@given(costs_st)
def test_rank_lies_between_smallest_cost_and_mean(costs: list[float]) -> None:
    g = gittins_rank(costs)
    assert g is not None
    assert min(costs) * (1 - 1e-12) <= g <= float(np.mean(costs)) * (1 + 1e-12)


@given(costs_st, st.floats(min_value=0.0, max_value=1.0))
def test_attained_service_before_any_sample_ends_lowers_rank(
    costs: list[float], frac: float
) -> None:
    # Monotonicity where it holds: while no sample is exhausted (a < min cost),
    # G(X − a) = min_j (N_j − a)/F_j ≤ G(X) − a.
    a = frac * min(costs) * 0.999
    g0, ga = gittins_rank(costs), gittins_rank(costs, a)
    assert g0 is not None and ga is not None
    assert ga <= g0 - a + 1e-9 * max(1.0, g0)


def test_bimodal_beats_a_point_with_smaller_mean() -> None:
    # SageSched Fig. 6: the mean is not the right key.
    bimodal = [10.0] * 6 + [1000.0] * 4  # mean 406
    point = [300.0] * 10  # mean 300
    gb, gp = gittins_rank(bimodal), gittins_rank(point)
    assert gb is not None and gp is not None
    assert gb < gp


def test_surviving_lengths_outliving_rule() -> None:
    lengths = np.array([10.0, 20.0, 30.0])
    np.testing.assert_array_equal(surviving_lengths(lengths, 15), [20.0, 30.0])
    # outlived the prediction: fall back to the global sample, conditioned
    fallback = np.array([5.0, 40.0, 80.0])
    np.testing.assert_array_equal(surviving_lengths(lengths, 30, fallback), [40.0, 80.0])
    # outlived both: O_new = 2·o
    np.testing.assert_array_equal(surviving_lengths(lengths, 100, fallback), [200.0])
    np.testing.assert_array_equal(surviving_lengths(np.array([]), 0), [2.0])


def test_remaining_costs_are_positive_and_conditioned() -> None:
    rc = remaining_cost_sample(np.array([10.0, 20.0]), input_tokens=5, generated_tokens=10)
    assert rc.tolist() == [float(request_cost(5, 20) - request_cost(5, 10))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1.0, 1e7), min_size=1, max_size=64))
def test_small_samples_take_a_loop_with_the_same_arithmetic_as_the_numpy_form(
    xs: list[float],
) -> None:
    costs = np.sort(np.asarray(xs, dtype=np.float64))
    m = costs.shape[0]
    f = np.arange(1, m + 1, dtype=np.float64) / m
    want = float(np.min((np.cumsum(costs) / m + costs * (1.0 - f)) / f))
    assert gittins_rank_sorted(costs) == want
    assert gittins_rank(list(xs)) == want
