"""Latency-model refit: a systematic step-time error rescales the model, noise does not."""

from __future__ import annotations

import pytest

from slipstream_operator.calibration import (
    Calibration,
    CalibrationParams,
    StepSample,
    observe,
    scaled,
)
from slipstream_scheduler.latency import FeatureSet, LinearLatencyModel
from slipstream_scheduler.types import BatchItem, Phase

pytestmark = pytest.mark.unit

MODEL = LinearLatencyModel(
    feature_set=FeatureSet.CONTEXT,
    coefficients=(0.008, 6e-5, 0.0, 0.0, 1.5e-4, 0.0, 2e-8, 0.0),
)
PARAMS = CalibrationParams(window=6, threshold=0.2)


def samples(ratio: float, n: int, generation: int = 1) -> list[StepSample]:
    return [StepSample(0.040, 0.040 * ratio, generation) for _ in range(n)]


def test_scaled_model_predicts_proportionally() -> None:
    batch = [BatchItem(Phase.DECODE, 1, 512)] * 8 + [BatchItem(Phase.PREFILL, 256, 0)]
    assert scaled(MODEL, 1.5).predict(batch) == pytest.approx(1.5 * MODEL.predict(batch))
    assert scaled(MODEL, 1.0) is MODEL
    with pytest.raises(ValueError):
        scaled(MODEL, 0.0)


def test_a_sustained_error_refits_only_once_the_window_is_full() -> None:
    cal, refit = observe(Calibration(), samples(1.5, 5), PARAMS)
    assert refit is None and cal.scale == 1.0 and len(cal.ratios) == 5
    cal, refit = observe(cal, samples(1.5, 1), PARAMS)
    assert refit == pytest.approx(1.5) and cal.scale == pytest.approx(1.5)
    assert cal.ratios == () and cal.refits == 1


def test_errors_inside_the_threshold_and_outliers_leave_the_scale() -> None:
    noisy = samples(1.1, 4) + samples(0.9, 1) + samples(5.0, 1)  # median 1.1, one outlier
    cal, refit = observe(Calibration(), noisy, PARAMS)
    assert refit is None and cal.scale == 1.0


def test_the_scale_compounds_and_is_clamped() -> None:
    cal = Calibration(scale=2.0)
    cal, refit = observe(cal, samples(1.5, 6), PARAMS)  # the pods already run x2: now x3
    assert cal.scale == pytest.approx(3.0)
    cal, refit = observe(cal, samples(3.0, 6), PARAMS)
    assert cal.scale == PARAMS.max_scale
    cal, refit = observe(cal, samples(2.0, 6), PARAMS)  # pinned: nothing new to push
    assert refit is None and cal.scale == PARAMS.max_scale


def test_pods_on_older_generations_idle_pods_and_unknown_timings_do_not_count() -> None:
    cal = Calibration(scale=1.5, since_generation=4)
    stale = samples(2.0, 6, generation=3)
    unknown = [StepSample(0.0, 0.05, 4), StepSample(0.04, 0.0, 4)]
    idle = [StepSample(0.008, 0.03, 4, busy=False) for _ in range(6)]
    cal, refit = observe(cal, stale + unknown + idle, PARAMS)
    assert refit is None and cal.ratios == ()


def test_disabled_refit_never_changes_anything() -> None:
    off = PARAMS.model_copy(update={"enabled": False})
    cal, refit = observe(Calibration(), samples(3.0, 12), off)
    assert refit is None and cal == Calibration()
