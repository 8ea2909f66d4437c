"""The latency model learned from engine steps: records, the regime reservoir, validation
on held-out steps, and drift (``slipstream_scheduler.learning``)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.latency import feature_matrix, fit, fit_matrix
from slipstream_scheduler.learning import (
    LearnParams,
    RegimeReservoir,
    StepLearner,
    StepRecord,
    StepRecordError,
    matrix,
    read_records,
    without_stragglers,
)
from slipstream_scheduler.profiler import engine_run_rows
from slipstream_scheduler.types import BatchItem

PARAMS = LearnParams(min_steps=100, refit_every=200, holdout=100)


def record(batch: list[BatchItem], t: float) -> StepRecord:
    return StepRecord.of(batch, t)


@pytest.fixture(scope="module")
def engine_steps() -> list[tuple[list[BatchItem], float]]:
    """Steps of the engine model (llama-2-7b on an A100) under a mixed workload."""
    return [(list(b), t) for b, t in engine_run_rows(EngineConfig(), 3, 2500, 4096)]


def test_a_records_row_is_the_batchs_feature_row(
    engine_steps: list[tuple[list[BatchItem], float]],
) -> None:
    batches = [b for b, _ in engine_steps[:200]]
    x, y = matrix(record(b, t) for b, t in engine_steps[:200])
    assert np.array_equal(x, feature_matrix(batches))
    assert list(y) == [t for _, t in engine_steps[:200]]
    # The same fit whether the rows come as batches or as a record's sums.
    a = fit(engine_steps[:400], seed=1).model
    b = fit_matrix(*matrix(record(bb, t) for bb, t in engine_steps[:400]), seed=1).model
    assert a.coefficients == b.coefficients and a.feature_set == b.feature_set


def test_records_round_trip_and_a_bad_line_names_its_field() -> None:
    rec = StepRecord(wall_time=0.0125, num_prefill_requests=1, sum_prefill_tokens=300,
                     sum_prefill_kv_tokens=64, sum_prefill_chunk_kv=300 * 64,
                     num_decode_requests=7, sum_decode_tokens=7, sum_decode_kv_tokens=900,
                     at=1.5)
    assert StepRecord.from_json(rec.to_json()) == rec
    doc = json.loads(rec.to_json())
    assert doc["sum_decode_kv_tokens"] == 900 and doc["wall_time"] == 0.0125
    bad = dict(doc, num_decode_requests=-1)
    good, errors = read_records([rec.to_json(), json.dumps(bad), "{", "", rec.to_json()])
    assert good == [rec, rec]
    assert errors[0].startswith("line 2: num_decode_requests")
    assert errors[1].startswith("line 3: not JSON")
    with pytest.raises(StepRecordError, match="wall_time"):
        StepRecord.from_json(json.dumps(dict(doc, wall_time=0)))
    with pytest.raises(StepRecordError, match="empty"):
        StepRecord.from_json(json.dumps(dict(doc, num_prefill_requests=0,
                                             num_decode_requests=0)))


def test_the_reservoir_keeps_every_regime_under_a_flood_of_one() -> None:
    res = RegimeReservoir(per_stratum=16, seed=0)
    for i in range(20):
        res.add(StepRecord(0.05, num_prefill_requests=1, sum_prefill_tokens=512 + i))
    for i in range(20_000):
        res.add(StepRecord(0.01, num_decode_requests=8, sum_decode_tokens=8,
                           sum_decode_kv_tokens=8 * (100 + i % 50)))
    for _ in range(5):
        res.add(StepRecord(0.03, num_prefill_requests=1, sum_prefill_tokens=100,
                           num_decode_requests=4, sum_decode_tokens=4, sum_decode_kv_tokens=400))
    assert res.regimes() == {"prefill": 16, "decode": 16, "mixed": 5}
    assert len(res) == 37 and max(res.strata().values()) == 16
    # Algorithm R: the decode stratum is a sample of its whole history, not its first rows.
    kept = [r.sum_decode_kv_tokens for r in res if r.num_decode_requests == 8 and
            not r.num_prefill_requests]
    assert len(set(kept)) > 4


def test_a_model_is_learned_validated_and_kept_while_the_engine_is_the_same(
    engine_steps: list[tuple[list[BatchItem], float]],
) -> None:
    lr = StepLearner(PARAMS)
    outcomes = []
    for i, (b, t) in enumerate(engine_steps):
        lr.add(record(b, t))
        if lr.due():
            outcomes.append(lr.refit(now=float(i)))
    assert outcomes[0].accepted and outcomes[0].reason == "first"
    # Early fits see few regimes; a later one that predicts the recent steps better replaces
    # it, and once every regime is in the reservoir the model in force stays.
    assert all(o.reason in ("stale", "better", "drift") for o in outcomes[1:] if o.accepted)
    assert [o.reason for o in outcomes[-4:]] == ["same"] * 4
    assert lr.current is not None and lr.current.revision == sum(o.accepted for o in outcomes)
    assert lr.current.heldout_mape < 0.05  # the engine model's noise is 1-2 %
    assert lr.seen == len(engine_steps) and lr.current.seen_steps > lr.seen - PARAMS.refit_every


def test_a_fit_that_fails_validation_is_not_used() -> None:
    rng = random.Random(0)
    lr = StepLearner(PARAMS)
    for _ in range(400):  # times unrelated to what the steps computed
        n = rng.randint(1, 64)
        lr.add(StepRecord(rng.uniform(0.001, 1.0), num_decode_requests=n,
                          sum_decode_tokens=n, sum_decode_kv_tokens=n * rng.randint(1, 2000)))
    assert lr.due()
    out = lr.refit(now=0.0)
    assert not out.accepted and out.reason == "invalid" and lr.current is None
    assert out.heldout_mape is not None and out.heldout_mape > PARAMS.max_mape
    assert "held-out MAPE" in out.message and lr.rejected == 1


def test_drift_replaces_the_model_and_bumps_the_revision(
    engine_steps: list[tuple[list[BatchItem], float]],
) -> None:
    lr = StepLearner(PARAMS)
    half = len(engine_steps) // 2
    for i, (b, t) in enumerate(engine_steps[:half]):
        lr.add(record(b, t))
        if lr.due():
            lr.refit(now=float(i))
    assert lr.current is not None
    before = lr.current
    # The engine slows by 40 % (a clock cap, a new driver): recent steps no longer fit.
    outcomes = []
    for i, (b, t) in enumerate(engine_steps[half:] + engine_steps[:half]):
        lr.add(record(b, 1.4 * t))
        if lr.due():
            outcomes.append(lr.refit(now=float(half + i)))
    # The first fit after the change mixes old and new steps and fails validation, as the
    # model in force does: the history is dropped and the model is learned again.
    assert outcomes[0].reason == "reset" and not outcomes[0].accepted
    accepted = [o for o in outcomes if o.accepted]
    assert accepted and accepted[0].reason in ("stale", "drift")
    assert accepted[0].current_mape is not None and accepted[0].current_mape > 0.1
    assert lr.current.revision > before.revision and lr.current.model is not before.model
    assert lr.current.heldout_mape < 0.05


def test_params_are_checked() -> None:
    with pytest.raises(ValueError, match="fractions"):
        LearnParams(max_mape=1.5)
    with pytest.raises(ValueError, match="min_steps"):
        LearnParams(holdout=2)


def test_stragglers_are_left_out_of_fits_and_validation(
    engine_steps: list[tuple[list[BatchItem], float]],
) -> None:
    recs = [record(b, t) for b, t in engine_steps[:1200]]
    # One step in fifty is a host hiccup, twenty times slower than its batch explains.
    noisy = [replace(r, wall_time=20 * r.wall_time) if i % 50 == 7 else r
             for i, r in enumerate(recs)]
    kept = without_stragglers(noisy)
    assert len(kept) == len(noisy) - len(range(7, len(noisy), 50))
    assert all(r.wall_time < 10 * 0.2 for r in kept)
    lr = StepLearner(PARAMS)
    lr.extend(noisy)
    out = lr.refit(now=0.0)
    assert out.accepted and out.heldout_mape is not None and out.heldout_mape < 0.05


def test_after_a_fit_that_was_not_used_the_next_waits_for_new_steps() -> None:
    rng = random.Random(1)
    lr = StepLearner(PARAMS)

    def noise() -> StepRecord:
        n = rng.randint(1, 64)
        return StepRecord(rng.uniform(0.001, 1.0), num_decode_requests=n, sum_decode_tokens=n,
                          sum_decode_kv_tokens=n * rng.randint(1, 2000))

    lr.extend(noise() for _ in range(400))
    assert lr.due() and not lr.refit(now=0.0).accepted
    lr.extend(noise() for _ in range(PARAMS.refit_every - 1))
    assert not lr.due()
    lr.add(noise())
    assert lr.due() and lr.attempts == 1
