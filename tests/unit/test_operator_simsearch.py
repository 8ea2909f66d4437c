"""Simulated budget search: it follows the SLO, says when none is attainable, and caches.

Small seeded samples (20 virtual seconds of Llama-2-7B on an A100 at 2 requests/s,
1000-token prompts): each search takes well under a second.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import slipstream_scheduler
from slipstream_operator.budgets import AnalyticSearch, LoadStats, SLOTargets
from slipstream_operator.searchpool import BudgetSearches, SearchSubject
from slipstream_operator.simsearch import (
    SimSearchParams,
    SimulatedSearch,
    bucket_load,
    engine_limits,
    engine_model_name,
    synthesize,
)
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import EngineLimits
from slipstream_testbed.cluster import pid_alive

pytestmark = pytest.mark.unit

PROFILE = (
    Path(slipstream_scheduler.__file__).parent
    / "engine"
    / "profiles"
    / "latency_llama-2-7b_a100.json"
)
MODEL = LinearLatencyModel.from_json(PROFILE.read_text())
ENGINE = EngineConfig(model="llama-2-7b", gpu="a100")
PARAMS = SimSearchParams(horizon_s=20.0, iterations=3, min_online_requests=40)
LOAD = LoadStats(arrival_rate_rps=2.0, mean_prompt_tokens=1000.0, mean_output_tokens=200.0)


def test_a_tighter_tbt_slo_yields_a_smaller_budget_backed_by_trials() -> None:
    loose = SimulatedSearch(MODEL, ENGINE, PARAMS)(SLOTargets(tbt_mean_s=0.05), LOAD)
    tight = SimulatedSearch(MODEL, ENGINE, PARAMS)(SLOTargets(tbt_mean_s=0.04), LOAD)
    assert loose.source == tight.source == "simulated"
    assert loose.feasible and tight.feasible
    assert tight.budget_s < loose.budget_s
    for result in (loose, tight):
        assert result.floor_s <= result.budget_s <= result.ceiling_s
        # The budget is a passing trial and every larger candidate tried missed.
        met = {t.budget_s for t in result.trials if t.met}
        assert any(abs(b - result.budget_s) < 1e-12 for b in met)
        assert all(not t.met for t in result.trials if t.budget_s > result.budget_s + 1e-12)
        assert "tbt-mean" in result.summary()
    # Not the closed form in disguise: the analytic cap (target x 0.9) differs.
    analytic = AnalyticSearch(MODEL, ENGINE.limits())(SLOTargets(tbt_mean_s=0.05), LOAD)
    assert abs(analytic.budget_s - loose.budget_s) > 0.005


def test_an_unattainable_slo_yields_the_online_only_budget() -> None:
    result = SimulatedSearch(MODEL, ENGINE, PARAMS)(SLOTargets(tbt_p99_s=0.05), LOAD)
    assert not result.feasible
    assert result.budget_s == pytest.approx(result.floor_s)
    assert result.trials and not any(t.met for t in result.trials)
    assert "no budget meets the SLOs" in result.summary()


def test_the_search_is_deterministic_for_equal_inputs() -> None:
    a = SimulatedSearch(MODEL, ENGINE, PARAMS)(SLOTargets(tbt_mean_s=0.05), LOAD)
    b = SimulatedSearch(MODEL, ENGINE, PARAMS)(SLOTargets(tbt_mean_s=0.05), LOAD)
    assert a == b


def test_a_search_past_its_wall_time_keeps_the_analytic_answer() -> None:
    params = PARAMS.model_copy(update={"max_wall_s": 1e-9})
    result = SimulatedSearch(MODEL, ENGINE, params)(SLOTargets(tbt_mean_s=0.05), LOAD)
    analytic = AnalyticSearch(MODEL, ENGINE.limits())(SLOTargets(tbt_mean_s=0.05), LOAD)
    assert result.source == "analytic" and result.budget_s == analytic.budget_s
    assert "stopped" in result.note


def test_synthesized_sample_matches_the_load() -> None:
    wl = synthesize(LoadStats(4.0, 500.0, 100.0), SimSearchParams(horizon_s=100.0))
    rate = len(wl.online) / 100.0
    assert 3.2 < rate < 4.8
    mean_prompt = sum(r.prompt_tokens for r in wl.online) / len(wl.online)
    assert 400 < mean_prompt < 600
    assert wl.offline_backlog and len(wl.offline) == 64


def test_names_limits_and_buckets() -> None:
    assert engine_model_name("meta-llama/Llama-2-7b-hf", "A100") == "llama-2-7b"
    assert engine_model_name("mistralai/Mistral-7B", "h100") is None
    assert engine_limits(
        ["--max-num-seqs", "128", "--max-num-batched-tokens=4096"]
    ) == EngineLimits(max_num_seqs=128, max_num_batched_tokens=4096)
    assert engine_limits([]).reserve_full_sequence  # vLLM's default admission gate
    assert engine_limits(["--no-scheduler-reserve-full-isl", "--block-size", "32"]) == (
        EngineLimits(block_size=32, reserve_full_sequence=False)
    )
    near = bucket_load(LoadStats(2.0, 1000.0, 200.0), 1.25, 0.1)
    assert near == bucket_load(LoadStats(2.1, 1040.0, 195.0), 1.25, 0.1)
    assert near != bucket_load(LoadStats(3.0, 1000.0, 200.0), 1.25, 0.1)


def subject(model_name: str = "meta-llama/Llama-2-7b-hf") -> SearchSubject:
    return SearchSubject(model_name=model_name, gpu="a100", profile="shipped:test", model=MODEL)


def test_background_searches_answer_provisionally_then_from_the_cache() -> None:
    with ThreadPoolExecutor(max_workers=1) as pool:
        searches = BudgetSearches(PARAMS, executor=pool)
        run = searches.search_for(subject())
        targets = SLOTargets(tbt_mean_s=0.05)
        first = run(targets, LOAD)
        assert first.provisional and first.source == "analytic"
        assert searches.wait_idle(60.0)
        done = run(targets, LOAD)
        assert done.source == "simulated" and not done.provisional
        # The same bucket (2.1 rps) and a fresh search callable hit the cache.
        again = searches.search_for(subject())(targets, LoadStats(2.1, 1000.0, 200.0))
        assert again is done and searches.searches_started == 1
        # Another SLO is another search.
        assert run(SLOTargets(tbt_mean_s=0.04), LOAD).provisional
        assert searches.wait_idle(60.0) and searches.searches_started == 2


def test_a_model_without_an_engine_model_is_simulated_and_a_disabled_search_is_not() -> None:
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(gate.wait)  # the worker is busy: the search below stays queued
        searches = BudgetSearches(PARAMS, executor=pool)
        # No GPU profile for this model: it is simulated with the model in force timing each
        # step (slipstream_operator.simsearch.simulated_engine), not answered analytically.
        result = searches.search_for(subject("mistralai/Mistral-7B"))(
            SLOTargets(tbt_p99_s=0.1), LOAD)
        assert result.provisional and searches.searches_started == 1
        gate.set()
    off = BudgetSearches(PARAMS.model_copy(update={"enabled": False}))
    assert off.search_for(subject())(SLOTargets(tbt_p99_s=0.1), LOAD).note == ""
    assert off.searches_started == 0


def test_the_two_knob_search_finds_an_idle_budget_and_searches_the_online_one_with_it() -> None:
    params = PARAMS.model_copy(update={"search_idle": True})
    targets = SLOTargets(tbt_mean_s=0.05, ttft_p99_s=1.0)
    result = SimulatedSearch(MODEL, ENGINE, params)(targets, LOAD)
    assert result.idle_budget_s is not None
    assert result.floor_s <= result.idle_budget_s <= result.ceiling_s
    assert all(t.idle_budget_s is not None for t in result.trials)
    # The online budget's trials all ran with the idle budget that was found.
    online = [t for t in result.trials if t.idle_budget_s == result.idle_budget_s]
    assert any(abs(t.budget_s - result.budget_s) < 1e-12 and t.met for t in online)
    assert "idle budget" in result.summary()
    # Off: no idle budget is searched or reported.
    off = PARAMS.model_copy(update={"search_idle": False})
    plain = SimulatedSearch(MODEL, ENGINE, off)(targets, LOAD)
    assert plain.idle_budget_s is None and all(t.idle_budget_s is None for t in plain.trials)


def test_a_ramping_load_searches_only_its_newest_bucket() -> None:
    gate = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(gate.wait)  # the worker is busy: the searches below stay queued
        searches = BudgetSearches(PARAMS, executor=pool)
        run = searches.search_for(subject())
        targets = SLOTargets(tbt_mean_s=0.05)
        for rate in (1.0, 2.0, 4.0):
            assert run(targets, LoadStats(rate, 1000.0, 200.0)).provisional
        assert searches.searches_started == 3 and searches.searches_superseded == 2
        # Another SLO of the same service is not superseded by this one's load.
        assert run(SLOTargets(tbt_mean_s=0.04), LOAD).provisional
        assert searches.searches_superseded == 2
        gate.set()
        assert searches.wait_idle(120.0)
        assert run(targets, LoadStats(4.0, 1000.0, 200.0)).source == "simulated"
        assert run(targets, LoadStats(1.0, 1000.0, 200.0)).provisional  # never searched


def test_searches_run_in_a_child_process_by_default_and_survive_a_dead_worker() -> None:
    from concurrent.futures import ProcessPoolExecutor

    assert PARAMS.worker == "process"
    searches = BudgetSearches(PARAMS)
    try:
        run = searches.search_for(subject())
        targets = SLOTargets(tbt_mean_s=0.05)
        assert run(targets, LOAD).provisional
        assert isinstance(searches._executor, ProcessPoolExecutor)
        assert searches.wait_idle(120.0)
        assert run(targets, LOAD).source == "simulated"  # what the child found
        # The worker goes away (killed, or shut down under the operator): the next search
        # starts a new one instead of failing the reconcile.
        assert searches._executor is not None
        searches._executor.shutdown(wait=True)
        assert run(SLOTargets(tbt_mean_s=0.04), LOAD).provisional
        assert searches.wait_idle(120.0)
        assert run(SLOTargets(tbt_mean_s=0.04), LOAD).source == "simulated"
    finally:
        searches.close()
    threaded = BudgetSearches(PARAMS.model_copy(update={"worker": "thread"}))
    try:
        assert threaded.search_for(subject())(SLOTargets(tbt_mean_s=0.05), LOAD).provisional
        assert not isinstance(threaded._executor, ProcessPoolExecutor)
        assert threaded.wait_idle(120.0)
    finally:
        threaded.close()


_OWNER = """
import os, time
from slipstream_operator.searchpool import BudgetSearches
from slipstream_operator.simsearch import SimSearchParams
pool = BudgetSearches(SimSearchParams())._new_executor()
print(pool.submit(os.getpid).result(), flush=True)
time.sleep(600)
"""


def test_the_search_worker_exits_when_its_operator_is_killed() -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    try:
        worker = int(owner.stdout.readline())
        assert worker != owner.pid
        python = Path(sys.executable)  # what the spawned worker runs
        assert pid_alive(worker, python)  # alive while its operator is
        owner.send_signal(signal.SIGKILL)  # no shutdown of the pool can run
        owner.wait(10)
        deadline = time.monotonic() + 30  # a liveness bound, not a timing under test
        while time.monotonic() < deadline:
            # (a zombie counts as gone: whoever adopted the orphan may never reap it)
            if not pid_alive(worker, python):
                return
            time.sleep(0.1)
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the search worker outlived its operator")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        owner.stdout.close()
