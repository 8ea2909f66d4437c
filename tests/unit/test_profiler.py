"""The latency-model profiler: its batch sweep and the fit on the engine model."""

from __future__ import annotations

import json
import random
from importlib import resources

import pytest

from slipstream_scheduler.engine import EngineConfig, EngineModel
from slipstream_scheduler.latency import (
    CURVE_STEP_TOKENS,
    KNEE_GRID,
    FeatureSet,
    LinearLatencyModel,
    fit,
)
from slipstream_scheduler.profiler import engine_run_rows, fit_latency_model, profiling_batches
from slipstream_scheduler.types import EngineLimits, Phase

pytestmark = pytest.mark.unit


def test_profiling_batches_respect_limits_and_sweep_all_mixes() -> None:
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=1024)
    batches = profiling_batches(7, limits, n=300, max_context=2048)
    assert batches == profiling_batches(7, limits, n=300, max_context=2048)
    assert batches != profiling_batches(8, limits, n=300, max_context=2048)
    kinds = set()
    for b in batches:
        assert 1 <= len(b) <= 64
        assert sum(it.tokens for it in b) <= 1024
        assert all(it.tokens + it.context <= 2048 for it in b)
        kinds.add(frozenset(it.phase for it in b))
    assert kinds == {
        frozenset({Phase.DECODE}),
        frozenset({Phase.PREFILL}),
        frozenset({Phase.DECODE, Phase.PREFILL}),
    }
    sizes = [len(b) for b in batches if all(it.phase is Phase.DECODE for it in b)]
    assert min(sizes) < 8 and max(sizes) > 32


def test_engine_run_rows_come_from_real_steps() -> None:
    rows = engine_run_rows(EngineConfig(max_num_seqs=32), seed=1, n=80, max_context=2048)
    assert len(rows) == 80
    assert all(t > 0 and b for b, t in rows)
    assert any(any(it.phase is Phase.DECODE for it in b) for b, _ in rows)


def test_fit_on_the_engine_model_predicts_held_out_batches() -> None:
    model, report = fit_latency_model(
        EngineConfig(model="llama-2-7b", gpu="h100"), seed=0, n_batches=900, n_engine_steps=300
    )
    assert report.test_mape_engine < 0.02
    assert report.test_mape_sweep < 0.025
    assert report.rows_test_sweep == 180 and report.rows_test_engine == 60
    assert model.meta.gpu == "h100"
    assert report.knee_tokens == model.knee_tokens
    assert (f"knee={model.knee_tokens}" in report.summary()) == (model.knee_tokens > 0)
    # more measurement noise must show in the held-out error
    _, noisy = fit_latency_model(
        EngineConfig(model="llama-2-7b", gpu="h100", noise_cv=0.08),
        seed=0,
        n_batches=900,
        n_engine_steps=300,
    )
    assert noisy.test_mape_sweep > report.test_mape_sweep + 0.02


def test_the_hinge_captures_the_under_utilised_bend_of_the_engine_model() -> None:
    # llama-3-8b/a100 is the profile whose linear-operator curve bends the most.
    engine = EngineModel(EngineConfig(model="llama-3-8b", gpu="a100"), seed=0)
    rows = [(b, engine.measure(b)) for b in profiling_batches(0, engine.limits, 1200, 4096)]
    random.Random(0).shuffle(rows)
    train, test = rows[:900], rows[900:]

    def held_out(model: LinearLatencyModel) -> float:
        return sum(abs(model.predict(b) - t) / t for b, t in test) / len(test)

    straight = fit(
        train, feature_sets=[fs for fs in FeatureSet if not fs.has_hinge and not fs.has_curve]
    )
    bent = fit(train)
    assert bent.chosen.has_hinge and bent.model.knee_tokens in KNEE_GRID
    assert 32 <= bent.model.knee_tokens <= 512
    assert held_out(bent.model) < 0.75 * held_out(straight.model)


@pytest.mark.parametrize(
    "pair", ["llama-2-7b_a100", "llama-2-7b_h100", "llama-3-8b_a100", "llama-3-8b_h100"]
)
def test_shipped_latency_models_load(pair: str) -> None:
    text = (
        resources.files("slipstream_scheduler.engine.profiles")
        .joinpath(f"latency_{pair}.json")
        .read_text()
    )
    model = LinearLatencyModel.from_json(text)
    assert json.loads(text)["schema_version"] == 3
    assert model.stats is not None and model.stats.kfold_mape < 0.015
    assert f"{model.meta.model}_{model.meta.gpu}" == pair
    # The fit chose the token curve on every shipped profile, against every hinge set at
    # its best knee (`slipstream profile latency --all`, curve among the candidates).
    assert model.feature_set is FeatureSet.CONTEXT_CHUNK_CURVE and model.knee_tokens == 0
    assert model.curve_step_tokens == CURVE_STEP_TOKENS and len(model.token_curve) >= 2
    scores = dict(model.stats.candidates)
    assert scores["context+chunk+curve"] == model.stats.kfold_mape
    hinge = [v for k, v in scores.items() if k.endswith("hinge")]
    assert len(hinge) == 4 and model.stats.kfold_mape < min(hinge)
    assert {k for k, _ in model.stats.knee_grid} <= set(KNEE_GRID)
    # Written back as the same schema-3 document (what the operator and sidecar read).
    assert LinearLatencyModel.from_json(model.to_json()) == model
