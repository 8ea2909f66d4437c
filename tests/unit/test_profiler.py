"""The latency-model profiler: its batch sweep and the fit on the engine model."""

from __future__ import annotations

from importlib import resources

import pytest

from slipstream_scheduler.engine import EngineConfig
from slipstream_scheduler.latency import LinearLatencyModel
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
    assert kinds == {frozenset({Phase.DECODE}), frozenset({Phase.PREFILL}),
                     frozenset({Phase.DECODE, Phase.PREFILL})}
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
    assert report.test_mape_engine < 0.03
    assert report.test_mape_sweep < 0.04
    assert report.rows_test_sweep == 180 and report.rows_test_engine == 60
    assert model.meta.gpu == "h100"
    # more measurement noise must show in the held-out error
    _, noisy = fit_latency_model(
        EngineConfig(model="llama-2-7b", gpu="h100", noise_cv=0.08),
        seed=0, n_batches=900, n_engine_steps=300,
    )
    assert noisy.test_mape_sweep > report.test_mape_sweep + 0.02


@pytest.mark.parametrize("pair", ["llama-2-7b_a100", "llama-2-7b_h100", "llama-3-8b_a100",
                                  "llama-3-8b_h100"])
def test_shipped_latency_models_load(pair: str) -> None:
    text = resources.files("slipstream_scheduler.engine.profiles").joinpath(
        f"latency_{pair}.json").read_text()
    model = LinearLatencyModel.from_json(text)
    assert model.stats is not None and model.stats.kfold_mape < 0.05
    assert f"{model.meta.model}_{model.meta.gpu}" == pair
