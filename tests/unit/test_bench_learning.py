"""``slipstream bench learning``'s summaries: the spread over repeated vLLM runs, the
recording cost's two regimes, and the usage errors of its options (the figures themselves
are the benchmark's, docs/benchmarks/learning.md)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from slipstream_cli.benches import learning


def _run(mapes: list[float], baseline: float, floor: float) -> dict[str, Any]:
    return {
        "source": "vllm serve (CPU, tiny model)",
        "curve": [{"steps": s, "mape": m} for s, m in zip((100, 1000, 10000), mapes,
                                                           strict=False)],
        "baseline": {"mape": baseline},
        "noise_floor": {"mape": floor},
    }


def test_the_spread_gives_each_checkpoints_median_and_range_over_the_runs() -> None:
    runs = [_run([0.6, 0.4, 0.3], 0.2, 0.1), _run([0.5, 0.2, 0.25], 0.5, 0.1),
            _run([0.7, 0.3], 0.6, 0.2)]  # the last run stopped short of 10,000 steps
    sp = learning.spread(runs)
    assert sp is not None and sp["runs"] == 3
    by_steps = {c["steps"]: c for c in sp["curve"]}
    assert by_steps[100]["mape"] == {"median": 0.6, "min": 0.5, "max": 0.7}
    assert by_steps[1000]["over_noise_floor"] == {
        "median": pytest.approx(2.0), "min": pytest.approx(1.5), "max": pytest.approx(4.0)}
    assert by_steps[10000]["runs"] == 2
    assert by_steps[10000]["mape"]["median"] == pytest.approx(0.275)
    assert sp["baseline_mape"] == {"median": 0.5, "min": 0.2, "max": 0.6}
    assert learning.spread(runs[:1]) is None


def test_the_recording_cost_is_timed_in_both_regimes() -> None:
    cost = learning.recording_cost(64, steps=2000)
    assert cost["running"] == 64
    assert cost["us_per_step"] > 0 and cost["us_per_step_changing"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--vllm-runs", "0"], "--vllm-runs must be >= 1"),
    (["--steps-in", "x.jsonl"], "add --vllm-runs 1"),
])
def test_bad_options_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    learning.add_arguments(parser)
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        learning.run(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
