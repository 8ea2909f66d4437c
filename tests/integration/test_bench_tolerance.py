"""Simulation tier: ``slipstream bench tolerance`` on a short window of the Azure trace.

Runs the real CLI entry point and reads back its JSON: one sidecar row per tolerance (and an
in-engine row beside each with ``--in-engine``), limits that are the online-only p99s raised
by each tolerance, shares computed against the offline-only run of the same invocation.

Deliberately left out: the numbers themselves (docs/benchmarks/colocation.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from slipstream_cli.benches.tolerance import _tolerances, crossing
from slipstream_cli.main import main

pytestmark = pytest.mark.sim


def test_each_tolerance_gets_its_own_limits_budgets_and_share(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    args = ["bench", "tolerance", "--duration-s", "60", "--rate-scale", "0.0556",
            "--tolerances", "100,10", "--in-engine", "--json", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert [(r["tolerance_pct"], r["mode"]) for r in doc["rows"]] == [
        (10, "sidecar"), (10, "in-engine"), (100, "sidecar"), (100, "in-engine")]
    base = doc["online_only"]
    for row in doc["rows"]:
        factor = 1 + row["tolerance_pct"] / 100
        assert row["ttft_p99_limit_s"] == pytest.approx(base["ttft_p99_s"] * factor)
        assert row["tbt_p99_limit_s"] == pytest.approx(base["tbt_p99_s"] * factor)
        assert row["offline_share"] == pytest.approx(
            row["offline_tokens_per_s"] / doc["offline_only_tokens_per_s"])
        if row["slo_met"]:
            assert row["tbt_p99_s"] <= row["tbt_p99_limit_s"]
            assert row["ttft_p99_s"] <= row["ttft_p99_limit_s"]
    sidecar = {r["tolerance_pct"]: r for r in doc["rows"] if r["mode"] == "sidecar"}
    # Ten times the tolerance lets the profiler choose a larger online budget.
    assert sidecar[100]["budget_s"] > sidecar[10]["budget_s"]
    assert doc["crossing_pct"] == crossing(doc["rows"], doc["goal"])
    assert (tmp_path / "t.png").stat().st_size > 0


def test_the_crossing_is_the_smallest_tolerance_meeting_its_slos_at_the_goal() -> None:
    rows = [
        {"tolerance_pct": 50, "mode": "sidecar", "slo_met": True, "offline_share": 0.70},
        {"tolerance_pct": 100, "mode": "sidecar", "slo_met": False, "offline_share": 0.90},
        {"tolerance_pct": 150, "mode": "sidecar", "slo_met": True, "offline_share": 0.86},
        {"tolerance_pct": 50, "mode": "in-engine", "slo_met": True, "offline_share": 0.88},
    ]
    assert crossing(rows, 0.85) == 150
    assert crossing(rows, 0.85, "in-engine") == 50
    assert crossing(rows, 0.95) is None


def test_tolerances_must_be_positive_whole_percentages() -> None:
    assert _tolerances("50,10,50") == [10, 50]
    with pytest.raises(argparse.ArgumentTypeError, match="--tolerances"):
        _tolerances("ten")
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        _tolerances("0,10")
