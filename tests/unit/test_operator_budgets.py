"""Budget policy: analytic search bounds, search triggers and AIMD adaptation."""

from __future__ import annotations

import pytest

from slipstream_operator.api import SLOSpec
from slipstream_operator.budgets import (
    AnalyticSearch,
    BudgetParams,
    BudgetState,
    LoadStats,
    ObservedSLO,
    SearchResult,
    SLOTargets,
    decide,
    worst_metric,
)
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.types import EngineLimits

pytestmark = pytest.mark.unit

# Roughly Llama-2-7B on an H100: 8 ms fixed, 60 us per prefill token, 0.15 ms per decode,
# 20 ns per context token of a decode.
MODEL = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.008, 6e-5, 0.0, 0.0, 1.5e-4, 0.0, 2e-8, 0.0),
)
LOAD = LoadStats(arrival_rate_rps=2.0, mean_prompt_tokens=1000.0, mean_output_tokens=200.0)
PARAMS = BudgetParams()


class CountingSearch:
    def __init__(self, budget: float = 0.05) -> None:
        self.calls = 0
        self.budget = budget

    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        self.calls += 1
        return SearchResult(budget_s=self.budget, floor_s=0.01, ceiling_s=0.2, source="fake")


def targets() -> SLOTargets:
    return SLOTargets.from_spec(SLOSpec.model_validate({"tbt": {"p99": "100ms"},
                                                        "ttft": {"mean": "1s"}}))


def test_targets_from_spec() -> None:
    t = targets()
    assert t.tbt_p99_s == pytest.approx(0.1) and t.ttft_mean_s == pytest.approx(1.0)
    assert t.items() == [("ttft-mean", 1.0), ("tbt-p99", pytest.approx(0.1))]


def test_analytic_search_is_bounded_and_respects_tbt() -> None:
    result = AnalyticSearch(MODEL, EngineLimits(max_num_batched_tokens=2048))(targets(), LOAD)
    assert result.floor_s <= result.budget_s <= result.ceiling_s
    assert result.budget_s <= 0.1 * 0.9 + 1e-12  # the TBT P99 target with 10 % headroom
    assert result.floor_s > MODEL.coefficients[0]  # online load costs more than an empty step


def test_tighter_slo_gives_a_smaller_budget() -> None:
    search = AnalyticSearch(MODEL)
    loose = search(SLOTargets(tbt_p99_s=0.2), LOAD).budget_s
    tight = search(SLOTargets(tbt_p99_s=0.05), LOAD).budget_s
    assert tight < loose


def test_heavier_load_raises_the_floor() -> None:
    search = AnalyticSearch(MODEL)
    light = search(targets(), LOAD).floor_s
    heavy = search(targets(), LoadStats(20.0, 1000.0, 200.0)).floor_s
    assert heavy > light


def _start(search: CountingSearch) -> BudgetState:
    return decide(None, targets=targets(), load=LOAD, observed=ObservedSLO(samples=0),
                  search=search, now_s=0.0, params=PARAMS)


def test_first_call_searches() -> None:
    search = CountingSearch()
    state = _start(search)
    assert search.calls == 1 and state.reason == "Searched" and state.budget_s == 0.05


def test_miss_tightens_multiplicatively_then_waits() -> None:
    search = CountingSearch()
    state = _start(search)
    missed = ObservedSLO(samples=100, tbt_p99_s=0.12, ttft_mean_s=0.5)
    state = decide(state, targets=targets(), load=LOAD, observed=missed, search=search,
                   now_s=1.0, params=PARAMS)
    assert state.reason == "Tightened" and state.budget_s == pytest.approx(0.035)
    again = decide(state, targets=targets(), load=LOAD, observed=missed, search=search,
                   now_s=2.0, params=PARAMS)
    assert again.budget_s == state.budget_s  # same stale window is not punished twice
    later = decide(state, targets=targets(), load=LOAD, observed=missed, search=search,
                   now_s=1.0 + PARAMS.tighten_interval_s, params=PARAMS)
    assert later.budget_s == pytest.approx(0.035 * 0.7)
    assert search.calls == 1


def test_tightening_stops_at_the_floor() -> None:
    search = CountingSearch()
    state = _start(search)
    missed = ObservedSLO(samples=100, tbt_p99_s=1.0)
    for i in range(1, 30):
        state = decide(state, targets=targets(), load=LOAD, observed=missed, search=search,
                       now_s=i * 100.0, params=PARAMS)
    assert state.budget_s == pytest.approx(0.01)


def test_comfortable_margin_loosens_additively_and_slowly_up_to_the_limit() -> None:
    search = CountingSearch()
    state = _start(search)
    good = ObservedSLO(samples=100, tbt_p99_s=0.05, ttft_mean_s=0.3)
    early = decide(state, targets=targets(), load=LOAD, observed=good, search=search,
                   now_s=5.0, params=PARAMS)
    assert early.budget_s == state.budget_s
    step = PARAMS.increase_fraction * 0.05
    loosened = decide(state, targets=targets(), load=LOAD, observed=good, search=search,
                      now_s=PARAMS.loosen_interval_s, params=PARAMS)
    assert loosened.reason == "Loosened"
    assert loosened.budget_s == pytest.approx(0.05 + step)
    for i in range(2, 40):
        loosened = decide(loosened, targets=targets(), load=LOAD, observed=good, search=search,
                          now_s=i * PARAMS.loosen_interval_s, params=PARAMS)
    assert loosened.budget_s == pytest.approx(0.05 * PARAMS.loosen_limit)


def test_near_target_holds() -> None:
    search = CountingSearch()
    state = _start(search)
    close = ObservedSLO(samples=100, tbt_p99_s=0.095)
    held = decide(state, targets=targets(), load=LOAD, observed=close, search=search,
                  now_s=100.0, params=PARAMS)
    # Kept as it is: the reason still names what set the value, so the status does not move.
    assert held == state and held.reason == "Searched"


def test_too_few_samples_hold() -> None:
    search = CountingSearch()
    state = _start(search)
    few = ObservedSLO(samples=3, tbt_p99_s=5.0)
    held = decide(state, targets=targets(), load=LOAD, observed=few, search=search,
                  now_s=100.0, params=PARAMS)
    assert held.budget_s == state.budget_s


def test_slo_or_load_change_re_searches() -> None:
    search = CountingSearch()
    state = _start(search)
    same = decide(state, targets=targets(), load=LoadStats(2.2, 1000.0, 200.0),
                  observed=ObservedSLO(samples=0), search=search, now_s=1.0, params=PARAMS)
    assert search.calls == 1 and same.budget_s == state.budget_s
    decide(state, targets=targets(), load=LoadStats(3.0, 1000.0, 200.0),
           observed=ObservedSLO(samples=0), search=search, now_s=1.0, params=PARAMS)
    assert search.calls == 2
    decide(state, targets=SLOTargets(tbt_p99_s=0.2), load=LOAD,
           observed=ObservedSLO(samples=0), search=search, now_s=1.0, params=PARAMS)
    assert search.calls == 3


def test_worst_metric() -> None:
    worst = worst_metric(targets(), ObservedSLO(samples=10, tbt_p99_s=0.09, ttft_mean_s=1.5))
    assert worst is not None and worst[0] == "ttft-mean"
    assert worst_metric(targets(), ObservedSLO(samples=0)) is None


class PendingThenDone:
    """A search whose first answers are provisional (the worker is busy), then final."""

    def __init__(self, pending_calls: int) -> None:
        self.calls = 0
        self.pending_calls = pending_calls

    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        self.calls += 1
        if self.calls <= self.pending_calls:
            return SearchResult(budget_s=0.05, floor_s=0.01, ceiling_s=0.2, source="analytic",
                                provisional=True)
        return SearchResult(budget_s=0.08, floor_s=0.01, ceiling_s=0.2, source="simulated")


def test_a_provisional_budget_adapts_until_the_real_search_lands() -> None:
    search = PendingThenDone(pending_calls=2)
    quiet = ObservedSLO(samples=100, tbt_p99_s=0.2)  # above the 100 ms target
    state = decide(None, targets=targets(), load=LOAD, observed=quiet, search=search, now_s=0.0,
                   params=PARAMS)
    assert state.searched.provisional and state.budget_s == 0.05
    # Still provisional: the search is asked again, and AIMD keeps working meanwhile.
    state = decide(state, targets=targets(), load=LOAD, observed=quiet, search=search, now_s=20.0,
                   params=PARAMS)
    assert search.calls == 2 and state.reason == "Tightened"
    assert state.budget_s == pytest.approx(0.035)
    # The worker finished: the searched budget replaces the stand-in.
    state = decide(state, targets=targets(), load=LOAD, observed=quiet, search=search, now_s=40.0,
                   params=PARAMS)
    assert state.reason == "Searched" and state.budget_s == 0.08
    assert not state.searched.provisional
    # Final results are not asked for again while nothing changes.
    decide(state, targets=targets(), load=LOAD, observed=quiet, search=search, now_s=60.0,
           params=PARAMS)
    assert search.calls == 3


class Sequence:
    """A search that answers the given results in turn (the last one from then on)."""

    def __init__(self, *results: SearchResult) -> None:
        self.results = list(results)
        self.calls = 0

    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        self.calls += 1
        return self.results[min(self.calls, len(self.results)) - 1]


def _result(budget_s: float, provisional: bool = False) -> SearchResult:
    return SearchResult(budget_s=budget_s, floor_s=0.01, ceiling_s=0.2,
                        source="analytic" if provisional else "simulated",
                        provisional=provisional)


def test_a_load_change_keeps_the_simulated_budget_until_the_new_simulation_lands() -> None:
    search = Sequence(_result(0.06), _result(0.03, provisional=True), _result(0.04))
    few = ObservedSLO(samples=0)
    state = decide(None, targets=targets(), load=LOAD, observed=few, search=search, now_s=0.0,
                   params=PARAMS)
    assert state.budget_s == 0.06
    busier = LoadStats(4.0, 1000.0, 200.0)
    # The new simulation runs: the analytic stand-in does not replace a simulated budget.
    pending = decide(state, targets=targets(), load=busier, observed=few, search=search,
                     now_s=5.0, params=PARAMS)
    assert pending == state and search.calls == 2
    # Asked again (the load still differs from the searched one); it landed: adopted.
    landed = decide(pending, targets=targets(), load=busier, observed=few, search=search,
                    now_s=10.0, params=PARAMS)
    assert search.calls == 3 and landed.budget_s == 0.04 and landed.reason == "Searched"
    assert landed.searched_rate_rps == 4.0 and landed.changed_at_s == 10.0


def test_a_search_that_moves_the_budget_by_noise_leaves_it_in_force() -> None:
    search = Sequence(_result(0.060), _result(0.0585), _result(0.0585))
    few = ObservedSLO(samples=0)
    state = decide(None, targets=targets(), load=LOAD, observed=few, search=search, now_s=0.0,
                   params=PARAMS)
    busier = LoadStats(3.0, 1000.0, 200.0)
    kept = decide(state, targets=targets(), load=busier, observed=few, search=search,
                  now_s=5.0, params=PARAMS)
    # 2.5 % apart: same budget, evidence and reason (no new configuration, no status change);
    # only the load it was searched at moves, so it is not searched again.
    assert (kept.budget_s, kept.searched, kept.reason) == (0.060, state.searched, "Searched")
    assert kept.searched_rate_rps == 3.0
    decide(kept, targets=targets(), load=busier, observed=few, search=search, now_s=10.0,
           params=PARAMS)
    assert search.calls == 2
    # A new SLO is always adopted, provisional or not, however close.
    strict = SLOTargets(tbt_p99_s=0.05)
    moved = decide(kept, targets=strict, load=busier, observed=few, search=search,
                   now_s=15.0, params=PARAMS)
    assert moved.targets == strict and moved.budget_s == 0.0585 and moved.changed_at_s == 15.0


def test_a_provisional_answer_to_a_new_slo_is_adopted_at_once() -> None:
    search = Sequence(_result(0.06), _result(0.02, provisional=True))
    few = ObservedSLO(samples=0)
    state = decide(None, targets=targets(), load=LOAD, observed=few, search=search, now_s=0.0,
                   params=PARAMS)
    strict = SLOTargets(tbt_p99_s=0.03)
    moved = decide(state, targets=strict, load=LOAD, observed=few, search=search, now_s=5.0,
                   params=PARAMS)
    assert moved.budget_s == 0.02 and moved.searched.provisional
