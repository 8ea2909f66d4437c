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
    KNEE_GRID,
    MAX_CURVE_KNOTS,
    MAX_CURVE_SPAN_TOKENS,
    SCHEMA_VERSION,
    BatchFeatures,
    FeatureSet,
    FitError,
    LatencyModelMeta,
    LinearLatencyModel,
    ModelFormatError,
    SchemaVersionError,
    candidate_knees,
    feature_matrix,
    fit,
    kfold_mape,
    with_knee,
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
    "tokens_over_knee": 0.0,
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
    coef: tuple[float, ...], n: int = 600, noise: float = 0.01, seed: int = 7, knee: int = 0
) -> list[tuple[list[BatchItem], float]]:
    rng = np.random.default_rng(seed)
    batches = [random_batch(rng) for _ in range(n)]
    x = feature_matrix(batches, knee)
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
    assert f.row() == (1.0, 120.0, 14400.0, 2.0, 2.0, 2.0, 1000.0, 5000.0, 122.0)
    assert f.tokens == 122
    assert f.row(100)[-1] == 22.0 and f.row(122)[-1] == 0.0 and f.row(500)[-1] == 0.0
    f.remove(batch[0])
    assert f.row() == (1.0, 20.0, 400.0, 1.0, 2.0, 2.0, 1000.0, 0.0, 22.0)
    x = feature_matrix([batch, batch[1:]])
    assert np.array_equal(with_knee(x, 100), feature_matrix([batch, batch[1:]], 100))
    assert with_knee(x, 100)[:, -1].tolist() == [22.0, 0.0]


@pytest.mark.parametrize("knee", [0, 64, 5000])
def test_incremental_predictions_match_the_whole_batch(knee: int) -> None:
    model = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_HINGE,
        _coef({"p_c": 1e-10, "tokens_over_knee": 3e-5}),
        knee_tokens=knee,
    )
    rng = np.random.default_rng(3)
    batch = random_batch(rng)
    f = BatchFeatures.of(batch)
    assert model.predict_features(f) == pytest.approx(model.predict(batch), rel=1e-12)
    row = np.array(f.row(knee))
    assert model.predict_features(f) == pytest.approx(float(row @ np.array(model.coefficients)))
    grown = [*batch, BatchItem(Phase.PREFILL, 77, 500)]
    assert model.predict_with_prefill(f, 77, 500) == pytest.approx(model.predict(grown))
    grown = [*batch, BatchItem(Phase.DECODE, 1, 900)]
    assert model.predict_with_decode(f, 900) == pytest.approx(model.predict(grown))
    assert model.predict([]) == 0.0


def test_the_hinge_only_charges_tokens_past_the_knee() -> None:
    model = LinearLatencyModel(
        FeatureSet.TOKENS_HINGE, _coef({"s_d_ctx": 0.0, "tokens_over_knee": 1e-3}), knee_tokens=10
    )
    flat = LinearLatencyModel(FeatureSet.TOKENS, _coef({"s_d_ctx": 0.0}))
    for tokens, extra in ((1, 0.0), (10, 0.0), (11, 1e-3), (30, 20e-3)):
        batch = [BatchItem(Phase.PREFILL, tokens, 0)]
        assert model.predict(batch) - flat.predict(batch) == pytest.approx(extra, abs=1e-15)


def test_an_eight_column_tuple_is_a_model_without_hinge() -> None:
    eight = tuple(TRUE[name] for name in FEATURE_NAMES[:8])
    model = LinearLatencyModel(FeatureSet.CONTEXT, eight)
    assert model.coefficients == (*eight, 0.0) and model.knee_tokens == 0
    with pytest.raises(ModelFormatError, match="expected 9"):
        LinearLatencyModel(FeatureSet.CONTEXT, eight[:7])


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


def test_fit_recovers_a_hinge_and_its_knee() -> None:
    # Linear-operator cost flat until 384 tokens, then 60 us more per token.
    coef = _coef({"s_p": 1e-5, "s_p_sq": 0.0, "tokens_over_knee": 6e-5})
    result = fit(synthetic_rows(coef, n=800, knee=384))
    assert result.chosen is FeatureSet.CONTEXT_HINGE
    assert result.model.knee_tokens == 384 == result.knees[FeatureSet.CONTEXT_HINGE]
    got = dict(zip(FEATURE_NAMES, result.model.coefficients, strict=True))
    for name in ("const", "s_d_ctx", "n_d", "tokens_over_knee"):
        assert got[name] == pytest.approx(coef[FEATURE_NAMES.index(name)], rel=0.1), name
    # The straight-line sets cannot bend: clearly worse on these rows.
    assert result.kfold[FeatureSet.CONTEXT] > 1.5 * result.kfold[FeatureSet.CONTEXT_HINGE]
    assert result.model.stats is not None and result.model.stats.kfold_mape < 0.015
    grid = dict(result.model.stats.knee_grid)
    assert min(grid, key=grid.__getitem__) == 384 and len(grid) > 5
    # A knee between grid points is approximated by a neighbour.
    near = fit(synthetic_rows(coef, n=800, knee=300))
    assert near.chosen is FeatureSet.CONTEXT_HINGE and near.model.knee_tokens in (256, 384)


def test_parsimony_keeps_the_hinge_out_when_the_cost_is_straight() -> None:
    # TRUE has no bend: every hinge set fits about as well and is one column larger.
    result = fit(synthetic_rows(_coef()))
    assert result.chosen is FeatureSet.CONTEXT
    assert result.model.knee_tokens == 0
    hinge = result.kfold[FeatureSet.CONTEXT_HINGE]
    assert hinge <= result.kfold[FeatureSet.CONTEXT] * 1.02  # close: only parsimony decides


def test_candidate_knees_need_rows_on_both_sides() -> None:
    tokens = np.arange(1, 101, dtype=np.float64)  # 1..100
    assert candidate_knees(tokens, (2, 5, 50, 94, 95, 96, 200)) == [5, 50, 94, 95]
    assert candidate_knees(np.array([]), KNEE_GRID) == []
    # Every batch the same size: no knee is usable and the hinge sets are skipped.
    rows = [([BatchItem(Phase.DECODE, 1, 100 + i)], 0.01 + 1e-6 * i) for i in range(40)]
    result = fit(rows)
    assert not any(fs.has_hinge for fs in result.kfold)
    with pytest.raises(FitError, match="knee"):
        fit(rows, feature_sets=[FeatureSet.CONTEXT_HINGE])
    with pytest.raises(FitError, match="positive integers"):
        fit(rows, knees=[0])


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
    x = np.column_stack([np.ones(10), rng.uniform(1, 10, 10), np.zeros((10, 7))])
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
    assert doc["schema_version"] == 2 and SCHEMA_VERSION == 3  # no curve: still version 2
    assert doc["meta"]["engine"]["max_num_batched_tokens"] == 2048
    back = LinearLatencyModel.from_json(text)
    assert back == model
    coef = _coef({"s_p_sq": 0.0, "tokens_over_knee": 6e-5})
    hinged = fit(synthetic_rows(coef, n=400, knee=256), meta=meta).model
    assert hinged.knee_tokens == 256 and hinged.feature_set.has_hinge
    doc = json.loads(hinged.to_json())
    assert doc["knee_tokens"] == 256 and doc["coefficients"]["tokens_over_knee"] > 0
    assert LinearLatencyModel.from_json(hinged.to_json()) == hinged


def test_schema_version_1_documents_are_still_read() -> None:
    v1 = {
        "kind": "slipstream.latency-model",
        "schema_version": 1,
        "feature_set": "context+chunk",
        "coefficients": {name: TRUE[name] for name in FEATURE_NAMES[:8]},
        "units": "seconds per iteration",
        "meta": {"model": "m", "gpu": "g", "engine": {}, "source": "v1"},
        "fit": {
            "rows": 10,
            "folds": 5,
            "kfold_mape": 0.02,
            "train_mape": 0.02,
            "candidates": [["context", 0.03], ["context+chunk", 0.02]],
        },
    }
    model = LinearLatencyModel.from_json(json.dumps(v1))
    assert model.feature_set is FeatureSet.CONTEXT_CHUNK and model.knee_tokens == 0
    assert model.coefficients == _coef()
    assert model.stats is not None and model.stats.knee_grid == ()
    # Version 1 has no hinge: neither its column nor a hinge set is accepted there.
    bad = json.loads(json.dumps(v1))
    bad["coefficients"]["tokens_over_knee"] = 1e-5
    with pytest.raises(ModelFormatError, match="unknown coefficients"):
        LinearLatencyModel.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(v1))
    bad["feature_set"] = "context+chunk+hinge"
    with pytest.raises(ModelFormatError, match="schema version 2"):
        LinearLatencyModel.from_json(json.dumps(bad))


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
        lambda d: d["coefficients"].update(tokens_over_knee=1e-5),  # CONTEXT has no hinge
        lambda d: d.update(knee_tokens=128),  # a knee without a hinge
        lambda d: d.update(knee_tokens=-1),
        lambda d: d.update(knee_tokens=1.5),
        lambda d: d.update(schema_version=True),
    ],
)
def test_malformed_documents_are_rejected(mutate: object) -> None:
    doc = json.loads(LinearLatencyModel(FeatureSet.CONTEXT, _coef()).to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(ModelFormatError):
        LinearLatencyModel.from_json(json.dumps(doc))
    with pytest.raises(ModelFormatError):
        LinearLatencyModel.from_json("[1, 2]")


def _bisect_max_prefill(
    model: LinearLatencyModel, f: BatchFeatures, context: int, budget: float, limit: int
) -> int:
    """The reference: integer bisection on the (monotone) model."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.predict_with_prefill(f, mid, context) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Counting(LinearLatencyModel):
    """Counts the model evaluations ``max_prefill_tokens`` makes."""

    __slots__ = ()
    calls = 0

    def predict_with_prefill(self, f: BatchFeatures, tokens: int, context: int) -> float:
        _Counting.calls += 1
        return LinearLatencyModel.predict_with_prefill(self, f, tokens, context)


@settings(max_examples=300, deadline=None)
@given(
    decodes=st.integers(0, 300),
    ctx=st.integers(0, 16000),
    s_p=st.integers(0, 4096),
    context=st.integers(0, 8000),
    budget=st.floats(0.0, 0.2),
    limit=st.integers(0, 8192),
    c1=st.sampled_from([0.0, 1e-5, 1e-4]),
    c2=st.sampled_from([0.0, 2e-9]),
    c7=st.sampled_from([0.0, 1e-9]),
    c8=st.sampled_from([0.0, 3e-5, 2e-4]),
    knee=st.integers(0, 6000),
)
def test_max_prefill_equals_bisection_on_random_models(
    decodes: int,
    ctx: int,
    s_p: int,
    context: int,
    budget: float,
    limit: int,
    c1: float,
    c2: float,
    c7: float,
    c8: float,
    knee: int,
) -> None:
    model = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_HINGE,
        _coef({"s_p": c1, "s_p_sq": c2, "p_c": c7, "tokens_over_knee": c8}),
        knee_tokens=knee,
    )
    f = BatchFeatures()
    for _ in range(decodes):
        f.add_decode(1, ctx)
    if s_p:
        f.add_prefill(s_p, 0)
    x = model.max_prefill_tokens(f, context, budget, limit)
    assert x == _bisect_max_prefill(model, f, context, budget, limit)
    # The closed form lands on the answer: the rounding guard checks x and x + 1, no walk.
    counting = _Counting(model.feature_set, model.coefficients, knee_tokens=knee)
    _Counting.calls = 0
    assert counting.max_prefill_tokens(f, context, budget, limit) == x
    assert _Counting.calls <= 3
    assert 0 <= x <= limit
    if x > 0:
        assert model.predict_with_prefill(f, x, context) <= budget
    if x < limit:
        assert model.predict_with_prefill(f, x + 1, context) > budget


def test_max_prefill_lands_on_each_side_of_the_knee() -> None:
    # 10 ms floor, 10 us/token below the knee at 100 tokens, 110 us/token past it.
    coef = _coef(
        {
            "const": 1e-2,
            "s_p": 1e-5,
            "s_p_sq": 0.0,
            "n_p": 0.0,
            "n_d": 0.0,
            "s_d_ctx": 0.0,
            "tokens_over_knee": 1e-4,
        }
    )
    model = LinearLatencyModel(FeatureSet.CONTEXT_HINGE, coef, knee_tokens=100)
    f = BatchFeatures()
    assert model.max_prefill_tokens(f, 0, 1e-2 + 50e-5 + 1e-12, 4096) == 50  # before the knee
    assert model.max_prefill_tokens(f, 0, 1e-2 + 100e-5 + 1e-12, 4096) == 100  # at it
    # past it: 1 ms to the knee, then 110 us per token -> 10 more tokens for 1.1 ms
    assert model.max_prefill_tokens(f, 0, 1e-2 + 1e-3 + 1.1e-3 + 1e-12, 4096) == 110
    f.add_decode(150, 0)  # the step is already past the knee: every token pays 110 us
    assert model.max_prefill_tokens(f, 0, model.predict_features(f) + 2.1e-3, 4096) == 19


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 512), st.integers(0, 4096)), max_size=40))
def test_prediction_is_monotone_when_an_item_is_added(
    items: list[tuple[bool, int, int]],
) -> None:
    model = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_HINGE,
        _coef({"p_c": 1e-9, "tokens_over_knee": 5e-5}),
        knee_tokens=700,
    )
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


# --------------------------------------------------------------------------- token curve


def _stepped_rows(n: int = 500, seed: int = 3) -> list[tuple[list[BatchItem], float]]:
    """A GPU whose linear layers cost a staircase in tokens (GEMM tiles every 128 tokens)."""
    rng = np.random.default_rng(seed)
    batches = [random_batch(rng) for _ in range(n)]
    x = feature_matrix(batches)
    tokens = x[:, -1]
    stairs = 2e-3 * np.ceil(tokens / 128.0)
    y = x[:, :8] @ np.array(_coef()[:8]) + stairs
    y *= 1.0 + 0.002 * rng.standard_normal(n)
    return list(zip(batches, (float(v) for v in y), strict=True))


def _curve_model() -> LinearLatencyModel:
    curve = tuple(float(v) for v in np.cumsum([0.0, 10.0, 40.0, 40.0, 90.0, 140.0]))
    return LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_CURVE,
        _coef({"tokens_over_knee": 2e-6}),
        token_curve=curve,
        curve_step_tokens=32,
    )


def test_token_curve_is_opt_in_and_beats_the_hinge_on_a_staircase() -> None:
    rows = _stepped_rows()
    default = fit(rows)
    assert not default.chosen.has_curve  # not tried unless asked for
    both = fit(rows, feature_sets=[FeatureSet.CONTEXT_CHUNK_HINGE, FeatureSet.CONTEXT_CHUNK_CURVE])
    assert both.chosen is FeatureSet.CONTEXT_CHUNK_CURVE
    hinge = both.kfold[FeatureSet.CONTEXT_CHUNK_HINGE]
    curve = both.kfold[FeatureSet.CONTEXT_CHUNK_CURVE]
    print(f"k-fold MAPE on a staircase: hinge {hinge:.4f}, curve {curve:.4f}")
    assert curve < 0.7 * hinge
    model = both.model
    assert model.curve_step_tokens > 0 and model.token_curve[0] == 0.0
    assert all(b >= a for a, b in zip(model.token_curve, model.token_curve[1:], strict=False))
    # The prediction is the fitted columns: linear part plus c8 * phi(tokens).
    batch = rows[0][0]
    f = BatchFeatures.of(batch)
    phi = np.interp(
        f.tokens,
        np.arange(len(model.token_curve)) * model.curve_step_tokens,
        model.token_curve,
    )
    want = float(np.dot(f.row()[:8], model.coefficients[:8])) + model.coefficients[8] * phi
    assert model.predict(batch) == pytest.approx(want, rel=1e-9)


def test_curve_model_round_trips_and_scales_with_its_coefficients() -> None:
    model = _curve_model()
    doc = json.loads(model.to_json())
    assert doc["schema_version"] == 3 and doc["token_curve"]["step_tokens"] == 32
    back = LinearLatencyModel.from_json(model.to_json())
    assert back == model
    f = BatchFeatures.of([BatchItem(Phase.PREFILL, 100, 0), BatchItem(Phase.DECODE, 1, 500)])
    doubled = LinearLatencyModel(
        model.feature_set,
        tuple(2.0 * c for c in model.coefficients),
        token_curve=model.token_curve,
        curve_step_tokens=model.curve_step_tokens,
    )
    assert doubled.predict_features(f) == pytest.approx(2.0 * model.predict_features(f))
    # Past the last knot the curve continues with its last slope.
    far = BatchFeatures.of([BatchItem(Phase.PREFILL, 400, 0)])
    near = BatchFeatures.of([BatchItem(Phase.PREFILL, 300, 0)])
    c8 = model.coefficients[8]
    lin = model.coefficients[1] * 100 + model.coefficients[2] * (400**2 - 300**2)
    assert model.predict_features(far) - model.predict_features(near) == pytest.approx(
        lin + c8 * 100 * 140.0 / 32
    )


def test_curve_documents_are_checked() -> None:
    with pytest.raises(ModelFormatError, match="needs its token curve"):
        LinearLatencyModel(FeatureSet.CONTEXT_CHUNK_CURVE, _coef({"tokens_over_knee": 1e-6}))
    with pytest.raises(ModelFormatError, match="non-decreasing"):
        LinearLatencyModel(
            FeatureSet.CONTEXT_CHUNK_CURVE,
            _coef(),
            token_curve=(0.0, 2.0, 1.0),
            curve_step_tokens=8,
        )
    with pytest.raises(ModelFormatError, match="has none"):
        LinearLatencyModel(FeatureSet.CONTEXT, _coef(), token_curve=(0.0, 1.0), curve_step_tokens=8)
    doc = json.loads(_curve_model().to_json())
    doc["schema_version"] = 2
    with pytest.raises(ModelFormatError, match="schema version 3"):
        LinearLatencyModel.from_json(json.dumps(doc))


def test_curve_length_is_bounded() -> None:
    """A document or Configure call cannot make a process build an unbounded table."""
    longest = tuple(float(i) for i in range(MAX_CURVE_KNOTS))
    model = LinearLatencyModel(
        FeatureSet.CONTEXT_CHUNK_CURVE, _coef(), token_curve=longest, curve_step_tokens=32
    )
    assert len(model.token_curve) == MAX_CURVE_KNOTS
    with pytest.raises(ModelFormatError, match="too long: 4098 knots"):
        LinearLatencyModel(
            FeatureSet.CONTEXT_CHUNK_CURVE,
            _coef(),
            token_curve=(*longest, 1e9),
            curve_step_tokens=1,
        )
    span = MAX_CURVE_SPAN_TOKENS // 1000 + 1  # 1,001 knots at this step overshoot the span
    with pytest.raises(ModelFormatError, match="too long"):
        LinearLatencyModel(
            FeatureSet.CONTEXT_CHUNK_CURVE,
            _coef(),
            token_curve=longest[:1001],
            curve_step_tokens=span,
        )
    doc = json.loads(_curve_model().to_json())
    doc["token_curve"]["values"] = list(range(MAX_CURVE_KNOTS + 1))
    with pytest.raises(ModelFormatError, match="too long"):
        LinearLatencyModel.from_json(json.dumps(doc))


def test_schema_version_2_documents_are_still_read() -> None:
    doc = json.loads(
        LinearLatencyModel(
            FeatureSet.CONTEXT_HINGE, _coef({"tokens_over_knee": 1e-6}), knee_tokens=128
        ).to_json()
    )
    doc["schema_version"] = 2
    model = LinearLatencyModel.from_json(json.dumps(doc))
    assert model.knee_tokens == 128 and model.token_curve == ()


@settings(max_examples=200, deadline=None)
@given(
    prefill=st.integers(0, 900),
    decodes=st.integers(0, 64),
    context=st.integers(0, 3000),
    slack=st.floats(0.5, 40.0),
    limit=st.integers(1, 3000),
)
def test_curve_max_prefill_tokens_equals_a_linear_scan(
    prefill: int, decodes: int, context: int, slack: float, limit: int
) -> None:
    model = _curve_model()
    f = BatchFeatures()
    if prefill:
        f.add_prefill(prefill, 0)
    for _ in range(decodes):
        f.add_decode(1, 1000)
    budget = model.predict_features(f) * (1.0 + slack / 100.0) + 1e-4
    got = model.max_prefill_tokens(f, context, budget, limit)
    want = 0
    for x in range(1, limit + 1):
        if model.predict_with_prefill(f, x, context) > budget:
            break
        want = x
    assert got == want
