"""A service whose (model, GPU) has no engine-model GPU profile is still searched by
simulation: the model in force times the simulated steps, with its held-out error as
their spread, in the mode the service runs in.
"""

from __future__ import annotations

from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

import pytest

from slipstream_operator import simsearch
from slipstream_operator.budgets import (
    AnalyticSearch,
    BudgetParams,
    BudgetSearch,
    LoadStats,
    ObservedSLO,
    SearchResult,
    SLOTargets,
)
from slipstream_operator.observe import WindowStats
from slipstream_operator.reconcile_service import (
    ObjectRef,
    PodView,
    ServiceMemory,
    ServiceObserved,
    reconcile_service,
)
from slipstream_operator.searchpool import BudgetSearches, SearchSubject
from slipstream_operator.sidecar_client import LearnedLatency, SidecarStatus
from slipstream_operator.simsearch import (
    SimSearchParams,
    SimulatedSearch,
    engine_kv_blocks,
    simulated_engine,
)
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.sim.simulator import SimConfig, SimResult
from slipstream_scheduler.sim.workload import Workload
from slipstream_scheduler.types import EngineLimits

pytestmark = pytest.mark.unit

LEARNED = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.011, 7e-5, 0.0, 0.0, 1.7e-4, 0.0, 3e-8, 0.0),
)
PARAMS = SimSearchParams(horizon_s=10.0, iterations=2, min_online_requests=10, search_idle=False)
LOAD = LoadStats(arrival_rate_rps=2.0, mean_prompt_tokens=1000.0, mean_output_tokens=200.0)
TARGETS = SLOTargets(tbt_p99_s=0.1)


def subject(model_name: str = "acme/Unprofiled-9b", **kw: Any) -> SearchSubject:
    return SearchSubject(model_name=model_name, gpu="h100", profile="learned:chat-0 r3",
                         model=LEARNED, **kw)


class Capture:
    """An executor that keeps the jobs instead of running them."""

    def __init__(self) -> None:
        self.jobs: list[SimulatedSearch] = []

    def submit(self, job: SimulatedSearch, *args: Any) -> Future[SearchResult]:
        self.jobs.append(job)
        return Future()


def queued_job(s: SearchSubject, params: SimSearchParams = PARAMS) -> SimulatedSearch:
    capture = Capture()
    searches = BudgetSearches(params, executor=capture)  # type: ignore[arg-type]
    first = searches.search_for(s)(TARGETS, LOAD)
    assert first.provisional and first.source == "analytic"  # the stand-in while it runs
    assert searches.searches_started == 1
    (job,) = capture.jobs
    return job


def test_a_model_without_a_gpu_profile_is_simulated_with_the_model_in_force(
        monkeypatch: pytest.MonkeyPatch) -> None:
    job = queued_job(subject(mode="in-engine", timing_cv=0.031))
    assert job.timed_by_model and job.mode == "in-engine"
    assert job.model is LEARNED
    assert job.engine.num_gpu_blocks == PARAMS.kv_tokens // 16  # the documented default
    assert job.engine.noise_cv == pytest.approx(0.031)  # the held-out error

    configs: list[SimConfig] = []
    real = simsearch.simulate

    def recording(workload: Workload, config: SimConfig, **kw: Any) -> SimResult:
        configs.append(config)
        return real(workload, config, **kw)

    monkeypatch.setattr(simsearch, "simulate", recording)
    result = job(TARGETS, LOAD)
    assert result.source == "simulated" and result.trials  # not the analytic search
    assert len(configs) == len(result.trials)
    for config in configs:
        assert config.mode == "in-engine"  # the service's mode is kept
        assert config.timing_model is LEARNED
        assert config.engine.noise_cv == pytest.approx(0.031)
    assert "steps timed by the latency model (3.1% spread" in result.summary()
    assert result.floor_s <= result.budget_s <= result.ceiling_s


def test_a_model_with_a_gpu_profile_keeps_the_engine_model() -> None:
    job = queued_job(subject("meta-llama/Llama-2-7b-hf", timing_cv=0.031))
    assert not job.timed_by_model and job.mode == "sidecar"
    assert job.engine.model == "llama-2-7b" and job.engine.num_gpu_blocks is None
    assert job.engine.noise_cv == 0.01  # the engine model's own noise


def test_the_spread_and_kv_cache_fall_back_to_documented_defaults() -> None:
    limits = EngineLimits(block_size=32)
    for cv in (None, float("inf"), float("nan")):
        engine, timed = simulated_engine("acme/Unprofiled-9b", "h100", limits, PARAMS,
                                         timing_cv=cv)
        assert timed and engine.noise_cv == PARAMS.timing_cv == 0.05
        assert engine.num_gpu_blocks == 65536 // 32
    engine, _ = simulated_engine("acme/Unprofiled-9b", "h100", limits, PARAMS, kv_blocks=999,
                                 timing_cv=0.9)
    assert engine.num_gpu_blocks == 999 and engine.noise_cv == 0.5  # capped spread
    assert engine_kv_blocks([]) is None
    assert engine_kv_blocks(["--num-gpu-blocks-override", "1200", "--block-size", "16"]) == 1200
    assert engine_kv_blocks(["--num-gpu-blocks-override=7", "--num-gpu-blocks-override=9"]) == 9
    assert engine_kv_blocks(["--num-gpu-blocks-override", "x"]) is None
    # The spread and the KV cache are part of what the cache is keyed by.
    assert subject(timing_cv=0.02).key != subject(timing_cv=0.03).key
    assert subject(kv_blocks=100).key != subject().key


def test_disabled_or_without_targets_the_search_stays_analytic() -> None:
    capture = Capture()
    off = BudgetSearches(PARAMS.model_copy(update={"enabled": False}),
                         executor=capture)  # type: ignore[arg-type]
    result = off.search_for(subject())(TARGETS, LOAD)
    assert result.source == "analytic" and not result.provisional and not capture.jobs
    on = BudgetSearches(PARAMS, executor=capture)  # type: ignore[arg-type]
    assert on.search_for(subject())(SLOTargets(), LOAD).source == "analytic"
    assert not capture.jobs


# ------------------------------------------------------------------ the reconciler's subject


class Recorder:
    def __init__(self) -> None:
        self.subjects: list[SearchSubject] = []

    def __call__(self, s: SearchSubject) -> BudgetSearch:
        self.subjects.append(s)

        def search(targets: SLOTargets, load: LoadStats) -> SearchResult:
            return AnalyticSearch(s.calibrated, s.limits)(targets, load)

        return search


def test_the_reconciler_hands_the_learned_models_error_and_kv_cache_to_the_search() -> None:
    from slipstream_operator.api import InferenceServiceSpec

    spec = InferenceServiceSpec.model_validate({
        "model": "acme/Unprofiled-9b",
        "engine": {"image": "vllm/vllm-openai:v0.11.0",
                   "args": ["--max-num-seqs", "128", "--num-gpu-blocks-override", "3000"]},
        "replicas": 1,
        "slo": {"tbt": {"p99": "100ms"}},
        "scheduling": {"enforcement": "engine"},
    })
    report = LearnedLatency(LEARNED, source="learned", fit_steps=1234, seen_steps=1300,
                            heldout_mape=0.031, revision=3, fitted_at=1.7e9)
    status = SidecarStatus(generation=0, engine_ready=True, draining=False, spare_capacity=0.5,
                           budget_s=None, predicted_step_s=0.0, observed_step_s=0.0,
                           online_in_flight=3, learned=report)
    window = WindowStats(observed=ObservedSLO(samples=100, tbt_p99_s=0.05), load=LOAD,
                         span_s=60.0)
    observed = ServiceObserved(pods=(PodView("chat-0", "127.1.0.9", True, status),),
                               token="tok", window=window, latency_model=None, profile="")
    search = Recorder()
    reconcile_service(ObjectRef("chat", "team-a", "uid-1", 3), spec, observed, ServiceMemory(),
                      previous_status={}, now=datetime(2026, 1, 1, tzinfo=UTC), now_s=0.0,
                      params=BudgetParams(min_samples=5), search_for=search)
    (s,) = search.subjects
    assert s.model is LEARNED and s.mode == "in-engine"
    assert s.timing_cv == pytest.approx(0.031) and s.kv_blocks == 3000
    engine, timed = simulated_engine(s.model_name, s.gpu, s.limits, PARAMS,
                                     kv_blocks=s.kv_blocks, timing_cv=s.timing_cv)
    assert timed and engine.num_gpu_blocks == 3000 and engine.max_num_seqs == 128
