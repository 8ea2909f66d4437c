"""The engine model timed by a batch-latency model instead of a GPU profile.

With ``timing_model`` every step takes what the model predicts for the step's batch
(times the seeded noise of ``noise_cv``), no GPU profile is loaded and the KV cache is
``num_gpu_blocks``; without it the engine times its steps with the GPU profile, noise
and all, exactly as before.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Literal

import pytest

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.engine.errors import ProfileNotFoundError
from slipstream_scheduler.engine.gpu import GpuTimingModel, load_profile
from slipstream_scheduler.engine.model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    StepResult,
)
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.sim.inengine import PlannedEngine
from slipstream_scheduler.sim.simulator import SimConfig, SimError, Simulator, simulate
from slipstream_scheduler.sim.workload import SimRequest, Workload
from slipstream_scheduler.types import BatchItem, Phase, RequestClass

pytestmark = pytest.mark.unit

UNPROFILED = "acme/Unprofiled-9b"  # no GPU profile ships for it

# const, s_p, s_p_sq, n_p, n_d, s_d_tok, s_d_ctx, p_c, tokens_over_knee
CONTEXT_MODEL = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT_CHUNK_HINGE,
    coefficients=(0.007, 5e-5, 1e-9, 2e-4, 1.3e-4, 0.0, 2.5e-8, 1e-9, 3e-5),
    knee_tokens=512,
)
TOKENS_MODEL = LinearLatencyModel(
    feature_set=FeatureSet.TOKENS,
    coefficients=(0.011, 7e-5, 0.0, 0.0, 1.7e-4, 3e-4, 0.0, 0.0),
)


def config(**overrides: object) -> EngineConfig:
    doc: dict[str, object] = {
        "model": UNPROFILED,
        "gpu": "tpu-v9",
        "num_gpu_blocks": 400,
        "noise_cv": 0.0,
        "long_prefill_token_threshold": 256,
        "max_num_batched_tokens": 1024,
    }
    doc.update(overrides)
    return EngineConfig.model_validate(doc)


def feed(engine: EngineModel, n: int = 80, seed: int = 1) -> None:
    rng = random.Random(seed)
    for i in range(n):
        engine.add(
            EngineRequest(
                f"r{i}",
                rng.randint(1, 1500),
                rng.randint(1, 200),
                priority=rng.randint(0, 2),
                arrival_s=0.01 * i,
            )
        )


def drain(engine: EngineModel, max_steps: int = 20_000) -> list[StepResult]:
    out: list[StepResult] = []
    while engine.has_work() and len(out) < max_steps:
        out.append(engine.step())
    assert not engine.has_work()
    return out


@pytest.mark.parametrize("path", ["auto", "walk", "reference"])
@pytest.mark.parametrize("model", [CONTEXT_MODEL, TOKENS_MODEL], ids=["context", "tokens"])
def test_each_step_takes_what_the_model_predicts_for_its_batch(
    path: str, model: LinearLatencyModel
) -> None:
    # 400 blocks of 16 tokens for 80 requests of up to 1700 tokens: preemptions, so the
    # walk runs too; prefills are chunked and long decodes run as steady decoders.
    engine = EngineModel(config(path=path), seed=3, timing_model=model)
    assert engine.timing_model is model
    feed(engine)
    steps = drain(engine)
    assert engine.stats().preemptions > 0
    assert sum(1 for s in steps if len(s.batch) > 1) > 100
    assert any(i.phase is Phase.PREFILL for s in steps for i in s.batch)
    for step in steps:
        assert step.duration_s == model.predict(step.batch)
    # Not the GPU profile's times: no profile exists for this (model, GPU) at all.
    with pytest.raises(ProfileNotFoundError):
        EngineModel(config(path=path))
    with pytest.raises(ValueError, match="latency model"):
        _ = engine.timing


def test_the_in_engine_planner_steps_are_timed_by_the_model_too() -> None:
    planner = build_planner("budget", None, latency_model=TOKENS_MODEL, mode=PlannerMode.ITERATION)
    engine = PlannedEngine(
        config(),
        seed=0,
        planner=planner,
        budget_s=0.05,
        idle_budget_s=None,
        offline_priority=1,
        timing_model=CONTEXT_MODEL,
    )
    feed(engine, n=30)
    steps = drain(engine)
    assert engine.plans > 0 and len(steps) > 30
    for step in steps:
        assert step.duration_s == CONTEXT_MODEL.predict(step.batch)


def test_measure_uses_the_model() -> None:
    engine = EngineModel(config(), timing_model=CONTEXT_MODEL)
    batch = [BatchItem(Phase.PREFILL, 300, 40), BatchItem(Phase.DECODE, 1, 900)]
    assert engine.measure(batch) == CONTEXT_MODEL.predict(batch)
    assert engine.measure([]) == 0.0


def test_the_residual_spread_is_the_engines_seeded_noise() -> None:
    cv = 0.1
    ratios: list[list[float]] = []
    for seed in (5, 5, 6):
        engine = EngineModel(config(noise_cv=cv), seed=seed, timing_model=TOKENS_MODEL)
        feed(engine, n=120, seed=2)
        ratios.append([s.duration_s / TOKENS_MODEL.predict(s.batch) for s in drain(engine)])
    same, again, other = ratios
    assert same == again  # seeded
    assert same != other
    assert len(same) > 1000
    assert statistics.fmean(same) == pytest.approx(1.0, abs=0.02)  # mean-preserving
    assert statistics.stdev(same) == pytest.approx(cv, rel=0.2)


def test_the_kv_cache_must_be_given() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        EngineModel(config(num_gpu_blocks=None), timing_model=CONTEXT_MODEL)
    # The model, not a profile, times the steps: a profile of its own is refused.
    profile = load_profile("llama-2-7b", "a100")
    with pytest.raises(ValueError, match="not both"):
        EngineModel(config(), profile=profile, timing_model=CONTEXT_MODEL)
    engine = EngineModel(config(num_gpu_blocks=123), timing_model=CONTEXT_MODEL)
    assert engine.stats().kv_blocks_total == 123


def test_without_a_timing_model_steps_keep_the_gpu_profile_and_its_noise() -> None:
    """The old path, recomputed here: GPU step time of the batch times the seeded
    log-normal noise, one draw per non-empty step, from ``random.Random(seed)``."""
    cv, seed = 0.05, 11
    cfg = EngineConfig(
        model="llama-2-7b", gpu="a100", num_gpu_blocks=400, noise_cv=cv,
        long_prefill_token_threshold=256, max_num_batched_tokens=1024,
    )
    engine = EngineModel(cfg, seed=seed)
    assert engine.timing_model is None
    feed(engine)
    steps = drain(engine)
    gpu = GpuTimingModel(load_profile("llama-2-7b", "a100"))
    rng = random.Random(seed)
    for step in steps:
        base = gpu.predict(step.batch)
        if base > 0.0:
            base *= math.exp(rng.gauss(0.0, cv) - 0.5 * cv * cv)
        assert step.duration_s == pytest.approx(base, rel=1e-12)
    # A latency model gives other times for the same schedule (the test can tell).
    timed = EngineModel(cfg, seed=seed, timing_model=TOKENS_MODEL)
    feed(timed)
    assert [s.duration_s for s in drain(timed)] != [s.duration_s for s in steps]


def workload() -> Workload:
    online = tuple(
        SimRequest(f"on-{i}", RequestClass.ONLINE, 0.25 * i, 300 + (37 * i) % 500, 60)
        for i in range(40)
    )
    offline = tuple(
        SimRequest(f"off-{i}", RequestClass.OFFLINE, 0.0, 512, 128) for i in range(16)
    )
    return Workload(online, offline, offline_backlog=True, horizon_s=10.0, name="t")


@pytest.mark.parametrize("mode", ["sidecar", "in-engine"])
def test_the_simulator_runs_a_model_without_a_gpu_profile(
    mode: Literal["sidecar", "in-engine"],
) -> None:
    def run(model: LinearLatencyModel) -> float:
        cfg = SimConfig(
            engine=config(num_gpu_blocks=2048, noise_cv=0.02),
            budget_s=0.05,
            mode=mode,
            backlog_depth=16,
            timing_model=model,
        )
        result = simulate(workload(), cfg, latency_model=model)
        assert result.engine.steps > 0 and result.metrics.online.ttft.mean > 0
        return result.metrics.online.ttft.mean

    slow = LinearLatencyModel(
        feature_set=TOKENS_MODEL.feature_set,
        coefficients=tuple(3.0 * c for c in TOKENS_MODEL.coefficients),
    )
    assert run(slow) > run(TOKENS_MODEL)  # the model times the steps


def test_a_timing_model_runs_on_the_engine_model_only() -> None:
    cfg = SimConfig(engine=config(), timing_model=TOKENS_MODEL)

    def factory(engine: EngineConfig, seed: int) -> EngineModel:
        return EngineModel(engine, seed, timing_model=TOKENS_MODEL)

    with pytest.raises(SimError, match="timing model"):
        Simulator(workload(), cfg, engine_factory=factory)
