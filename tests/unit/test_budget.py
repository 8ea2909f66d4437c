"""The SLO-aware budget search: SLO parsing, judging, and the bisection over a monotone trial."""

from __future__ import annotations

import math

import pytest

from slipstream_scheduler.budget import (
    BudgetError,
    MissingBaselineError,
    SloSyntaxError,
    bisect_largest,
    judge,
    parse_slo,
    search_budget,
)

pytestmark = pytest.mark.unit


def test_parse_absolute_and_tolerance() -> None:
    a = parse_slo("ttft:p99:2s")
    assert (a.metric, a.stat, a.limit_s, a.tolerance) == ("ttft", "p99", 2.0, None)
    b = parse_slo("TBT:mean:150ms")
    assert b.limit_s == pytest.approx(0.150)
    c = parse_slo("tbt:p99:+10%")
    assert c.tolerance == pytest.approx(0.10) and c.limit_s is None
    assert str(c) == "tbt:p99:+10%" and str(b) == "tbt:mean:150ms"
    assert parse_slo(str(a)) == a


@pytest.mark.parametrize(
    "bad", ["ttft:p98:2s", "ttft:p99", "ttft:p99:2", "tbt:p99:10%", "x:p99:1s"]
)
def test_parse_rejects(bad: str) -> None:
    with pytest.raises(SloSyntaxError):
        parse_slo(bad)


def test_tolerance_needs_baseline() -> None:
    slo = parse_slo("tbt:p99:+10%")
    with pytest.raises(MissingBaselineError):
        slo.limit(None)
    assert slo.limit({"tbt_p99_s": 0.05}) == pytest.approx(0.055)


def test_judge_strictest_governs_and_nan_fails() -> None:
    slos = [parse_slo("ttft:p99:2s"), parse_slo("tbt:p99:+10%")]
    base = {"tbt_p99_s": 0.050, "ttft_p99_s": 0.5}
    checks = judge(slos, {"ttft_p99_s": 1.0, "tbt_p99_s": 0.056}, base)
    assert [c.met for c in checks] == [True, False]
    checks = judge(slos, {"ttft_p99_s": math.nan, "tbt_p99_s": 0.05}, base)
    assert [c.met for c in checks] == [False, True]


def _model(x: float) -> dict[str, float]:
    # A monotone stand-in for the simulator: latency grows with the budget.
    return {"tbt_p99_s": 0.030 + 0.5 * x, "ttft_p99_s": 0.4 + 10 * x}


def test_bisect_finds_the_largest_passing_value() -> None:
    slos = [parse_slo("tbt:p99:40ms"), parse_slo("ttft:p99:500ms")]
    # tbt: x <= 0.02, ttft: x <= 0.01 -> ttft governs
    res = bisect_largest(_model, slos, 0.0, 0.1, iterations=20, rel_tol=0.001)
    assert res.feasible
    assert res.value is not None and 0.0095 <= res.value <= 0.01
    assert res.trials[0].value == 0.1 and not res.trials[0].met
    assert all(t.met == (t.value <= 0.01) for t in res.trials)


def test_bisect_hi_passes_and_lo_fails() -> None:
    slos = [parse_slo("tbt:p99:1s")]
    assert bisect_largest(_model, slos, 0.0, 0.1).value == 0.1
    strict = [parse_slo("tbt:p99:1ms")]
    res = bisect_largest(_model, strict, 0.0, 0.1)
    assert res.value is None and not res.feasible and len(res.trials) == 2


def test_bisect_integer_cap() -> None:
    slos = [parse_slo("ttft:p99:1s")]
    res = bisect_largest(
        lambda n: {"ttft_p99_s": 0.1 * n}, slos, 0, 64, integer=True, iterations=10
    )
    assert res.value == 10


def test_search_budget_tolerance_over_baseline() -> None:
    seen: list[float] = []

    def run(b: float) -> dict[str, float]:
        seen.append(b)
        return {"tbt_p99_s": 0.04 + 0.1 * b}

    base = {"tbt_p99_s": 0.05}
    res = search_budget(run, [parse_slo("tbt:p99:+10%")], 0.01, 0.5, baseline=base, iterations=12)
    # 0.04 + 0.1 b <= 0.055  <=>  b <= 0.15
    assert seen[0] == 0.5
    assert res.value is not None and 0.14 <= res.value <= 0.15


def test_needs_an_slo() -> None:
    with pytest.raises(BudgetError):
        bisect_largest(_model, [], 0.0, 1.0)
