"""Unit tests of the batch-latency model: features, fit, selection, k-fold MAPE, JSON."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    SCHEMA_VERSION,
    BatchFeatures,
    FeatureSet,
    FitError,
    LatencyModelMeta,
    LinearLatencyModel,
    ModelFormatError,
    SchemaVersionError,
    feature_matrix,
    fit,
    kfold_mape,
)
from slipstream_scheduler.types import BatchItem, Phase

pytestmark = pytest.mark.unit

# A known "GPU": 6 ms floor, 0.1 ms per prefill token, quadratic attention,
# 0.05 ms per decode request, 40 ns per token of decode context.
TRUE = {
    "const": 6e-3,
    "s_p": 1e-4,
    "s_p_sq": 2e-9,
    "n_p": 3e-4,
    "n_d": 5e-5,
    "s_d_tok": 0.0,
    "s_d_ctx": 4e-8,
    "p_c": 0.0,
}


def _coef(overrides: dict[str, float] | None = None) -> tuple[float, ...]:
    values = dict(TRUE)
    values.update(overrides or {})
    return tuple(values[name] for name in FEATURE_NAMES)


def random_batch(rng: np.random.Generator) -> list[BatchItem]:
    batch = [
        BatchItem(Phase.DECODE, 1, int(rng.integers(16, 8000)))
        for _ in range(int(rng.integers(0, 200)))
    ]
    for _ in range(int(rng.integers(0, 4))):
        batch.append(
            BatchItem(Phase.PREFILL, int(rng.integers(1, 1024)), int(rng.integers(0, 4000)))
        )
    if not batch:
        batch.append(BatchItem(Phase.DECODE, 1, 100))
    return batch


def synthetic_rows(
    coef: tuple[float, ...], n: int = 600, noise: float = 0.01, seed: int = 7
) -> list[tuple[list[BatchItem], float]]:
    rng = np.random.default_rng(seed)
    batches = [random_batch(rng) for _ in range(n)]
    x = feature_matrix(batches)
    y = x @ np.array(coef) * (1.0 + noise * rng.standard_normal(n))
    return list(zip(batches, (float(v) for v in y), strict=True))


def test_features_of_a_small_batch() -> None:
    batch = [
        BatchItem(Phase.PREFILL, 100, 50),
        BatchItem(Phase.PREFILL, 20, 0),
        BatchItem(Phase.DECODE, 1, 300),
        BatchItem(Phase.DECODE, 1, 700),
    ]
    f = BatchFeatures.of(batch)
    assert f.row() == (1.0, 120.0, 14400.0, 2.0, 2.0, 2.0, 1000.0, 5000.0)
    assert f.tokens == 122
    f.remove(batch[0])
    assert f.row() == (1.0, 20.0, 400.0, 1.0, 2.0, 2.0, 1000.0, 0.0)


def test_incremental_predictions_match_the_whole_batch() -> None:
    model = LinearLatencyModel(FeatureSet.CONTEXT_CHUNK, _coef({"p_c": 1e-10}))
    rng = np.random.default_rng(3)
    batch = random_batch(rng)
    f = BatchFeatures.of(batch)
    assert model.predict_features(f) == pytest.approx(model.predict(batch), rel=1e-12)
    grown = [*batch, BatchItem(Phase.PREFILL, 77, 500)]
    assert model.predict_with_prefill(f, 77, 500) == pytest.approx(model.predict(grown))
    grown = [*batch, BatchItem(Phase.DECODE, 1, 900)]
    assert model.predict_with_decode(f, 900) == pytest.approx(model.predict(grown))
    assert model.predict([]) == 0.0


def test_fit_recovers_known_coefficients_and_picks_the_context_reading() -> None:
    result = fit(synthetic_rows(_coef()), meta=LatencyModelMeta(model="m", gpu="g"))
    assert result.chosen is FeatureSet.CONTEXT
    got = dict(zip(FEATURE_NAMES, result.model.coefficients, strict=True))
    for name in ("const", "s_p", "s_d_ctx", "n_d"):
        assert got[name] == pytest.approx(TRUE[name], rel=0.1), name
    assert result.model.stats is not None
    assert result.model.stats.kfold_mape < 0.015
    # The tokens reading cannot see context: clearly worse on these rows.
    assert result.kfold[FeatureSet.TOKENS] > 1.5 * result.kfold[FeatureSet.CONTEXT]


def test_fit_picks_the_tokens_reading_when_context_does_not_matter() -> None:
    result = fit(synthetic_rows(_coef({"s_d_ctx": 0.0, "n_d": 2e-4})))
    assert result.chosen is FeatureSet.TOKENS
    assert result.model.coefficients[FEATURE_NAMES.index("s_d_ctx")] == 0.0


def test_fit_picks_the_chunk_term_when_prefill_attends_to_its_prefix() -> None:
    result = fit(synthetic_rows(_coef({"p_c": 4e-9})))
    assert result.chosen is FeatureSet.CONTEXT_CHUNK
    p_c = result.model.coefficients[FEATURE_NAMES.index("p_c")]
    assert p_c == pytest.approx(4e-9, rel=0.1)


def test_fitted_coefficients_are_never_negative() -> None:
    # Times that *fall* with decode context: the unconstrained fit would go negative.
    rows = synthetic_rows(_coef({"s_d_ctx": 0.0}))
    rows = [
        (b, t * (1.0 - 1e-6 * sum(i.context for i in b if i.phase is Phase.DECODE) / 10))
        for b, t in rows
    ]
    model = fit(rows, feature_sets=[FeatureSet.CONTEXT]).model
    assert all(c >= 0.0 for c in model.coefficients[1:])


def test_kfold_mape_is_the_mean_out_of_fold_error() -> None:
    rng = np.random.default_rng(1)
    x = np.column_stack([np.ones(10), rng.uniform(1, 10, 10), np.zeros((10, 6))])
    # y = 2 + 3*s_p exactly, except one row off by +50 %.
    y = 2.0 + 3.0 * x[:, 1]
    y_bad = y.copy()
    y_bad[4] *= 1.5
    exact = kfold_mape(x, y, FeatureSet.TOKENS, folds=5)
    assert exact == pytest.approx(0.0, abs=1e-9)
    # Leave-one-out by hand for the perturbed row set.
    folds = 10
    by_hand = 0.0
    for i in range(10):
        keep = np.arange(10) != i
        coef, *_ = np.linalg.lstsq(x[keep][:, :2], y_bad[keep], rcond=None)
        by_hand += abs(x[i, :2] @ coef - y_bad[i]) / y_bad[i]
    assert kfold_mape(x, y_bad, FeatureSet.TOKENS, folds=folds) == pytest.approx(by_hand / 10)


def test_fit_rejects_bad_rows() -> None:
    with pytest.raises(FitError) as err:
        fit(synthetic_rows(_coef(), n=4))
    assert err.value.rows == 4
    rows = synthetic_rows(_coef(), n=50)
    rows[3] = (rows[3][0], 0.0)
    with pytest.raises(FitError, match="positive"):
        fit(rows)


def test_json_round_trip_keeps_coefficients_metadata_and_stats() -> None:
    meta = LatencyModelMeta(
        model="meta-llama/Llama-2-7b-hf",
        gpu="h100",
        engine={"max_num_batched_tokens": 2048, "tensor_parallel_size": 1},
        source="unit test",
    )
    model = fit(synthetic_rows(_coef(), n=200), meta=meta).model
    text = model.to_json()
    doc = json.loads(text)
    assert doc["schema_version"] == SCHEMA_VERSION
    assert doc["meta"]["engine"]["max_num_batched_tokens"] == 2048
    back = LinearLatencyModel.from_json(text)
    assert back == model


def test_wrong_schema_version_raises_a_clear_error() -> None:
    doc = json.loads(LinearLatencyModel(FeatureSet.CONTEXT, _coef()).to_json())
    doc["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(SchemaVersionError, match="re-run the profiler") as err:
        LinearLatencyModel.from_json(json.dumps(doc))
    assert err.value.found == SCHEMA_VERSION + 1
    assert isinstance(err.value, ModelFormatError)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(kind="something-else"),
        lambda d: d.update(feature_set="bogus"),
        lambda d: d["coefficients"].update(s_d_tok=1.0),  # outside the CONTEXT set
        lambda d: d["coefficients"].update(n_p=-1.0),  # would break monotonicity
        lambda d: d["coefficients"].update(extra=1.0),
    ],
)
def test_malformed_documents_are_rejected(mutate: object) -> None:
    doc = json.loads(LinearLatencyModel(FeatureSet.CONTEXT, _coef()).to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(ModelFormatError):
        LinearLatencyModel.from_json(json.dumps(doc))
    with pytest.raises(ModelFormatError):
        LinearLatencyModel.from_json("[1, 2]")


@settings(max_examples=200, deadline=None)
@given(
    decodes=st.integers(0, 300),
    ctx=st.integers(0, 16000),
    s_p=st.integers(0, 4096),
    context=st.integers(0, 8000),
    budget=st.floats(0.0, 0.2),
    limit=st.integers(0, 8192),
    c2=st.sampled_from([0.0, 2e-9]),
    c7=st.sampled_from([0.0, 1e-9]),
)
def test_max_prefill_is_the_largest_chunk_within_budget(
    decodes: int,
    ctx: int,
    s_p: int,
    context: int,
    budget: float,
    limit: int,
    c2: float,
    c7: float,
) -> None:
    model = LinearLatencyModel(FeatureSet.CONTEXT_CHUNK, _coef({"s_p_sq": c2, "p_c": c7}))
    f = BatchFeatures()
    for _ in range(decodes):
        f.add_decode(1, ctx)
    if s_p:
        f.add_prefill(s_p, 0)
    x = model.max_prefill_tokens(f, context, budget, limit)
    assert 0 <= x <= limit
    if x > 0:
        assert model.predict_with_prefill(f, x, context) <= budget
    if x < limit:
        assert model.predict_with_prefill(f, x + 1, context) > budget


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 512), st.integers(0, 4096)), max_size=40))
def test_prediction_is_monotone_when_an_item_is_added(
    items: list[tuple[bool, int, int]],
) -> None:
    model = LinearLatencyModel(FeatureSet.CONTEXT_CHUNK, _coef({"p_c": 1e-9}))
    f = BatchFeatures()
    last = model.predict_features(f)
    for prefill, tokens, context in items:
        if prefill:
            f.add_prefill(tokens, context)
        else:
            f.add_decode(1, context)
        now = model.predict_features(f)
        assert now >= last - 1e-15
        last = now
    assert math.isfinite(last)


def test_the_model_satisfies_the_latency_model_protocol() -> None:
    from slipstream_scheduler.protocols import LatencyModel

    model = LinearLatencyModel(FeatureSet.CONTEXT, _coef())
    assert isinstance(model, LatencyModel)


def test_minus_removes_a_sub_batch() -> None:
    whole = [BatchItem(Phase.PREFILL, 100, 50), BatchItem(Phase.DECODE, 1, 300)]
    part = BatchFeatures.of(whole[1:])
    assert BatchFeatures.of(whole).minus(part).row() == BatchFeatures.of(whole[:1]).row()
