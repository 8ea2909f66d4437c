"""Simulation tier: ``slipstream sim --mode`` and the in-engine rows of ``bench colocation``.

Runs the real CLI entry point on a short window of the Azure conversation
trace (arXiv backlog) and reads back the JSON it writes: every row says which
mode produced it, and in-engine rows are never mixed into the sidecar figures.

Deliberately left out: the numbers themselves (docs/benchmarks/colocation.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream_cli.main import main

pytestmark = pytest.mark.sim

SHORT = ["--duration-s", "60", "--rate-scale", "0.0556"]


def test_sim_in_engine_mode_reports_its_mode_and_planner_counters(tmp_path: Path) -> None:
    out = tmp_path / "ie.json"
    args = ["sim", *SHORT, "--policy", "budget", "--budget", "0.03", "--mode", "in-engine"]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "in-engine"
    row = doc["summary"]
    assert row["mode"] == "in-engine"
    assert row["in_engine"]["plans"] > 0
    assert row["offline_tokens_per_s"] > 0
    side = tmp_path / "side.json"
    assert main(["sim", *SHORT, "--policy", "budget", "--budget", "0.03", "--json", str(side)]) == 0
    srow = json.loads(side.read_text())["summary"]
    assert srow["mode"] == "sidecar"
    assert srow["in_engine"] is None


def test_sim_in_engine_mode_refuses_a_policy_without_a_budget_or_cap(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sim", *SHORT, "--policy", "naive", "--mode", "in-engine"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream sim: error: ") and "budget or static-cap policy" in err


def test_sim_in_engine_static_cap_is_a_per_step_token_cap(tmp_path: Path) -> None:
    offline: dict[int, float] = {}
    for cap in (0, 32, 256):
        out = tmp_path / f"cap{cap}.json"
        args = ["sim", *SHORT, "--policy", "static-cap", "--mode", "in-engine"]
        assert main([*args, "--static-cap", str(cap), "--json", str(out)]) == 0
        row = json.loads(out.read_text())["summary"]
        assert row["mode"] == "in-engine" and row["static_cap"] == cap
        assert row["in_engine"]["plans"] > 0
        offline[cap] = row["offline_tokens_per_s"]
    assert offline[0] == 0.0
    assert 0.0 < offline[32] < offline[256]


def test_bench_colocation_labels_in_engine_rows_beside_the_sidecar_rows(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    args = [
        "bench",
        "colocation",
        *SHORT,
        "--extra-busy",
        "--policies",
        "online-only",
        "offline-only",
        "budget",
        "--in-engine",
        "default",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    modes = [(r["policy"], r["mode"]) for r in rows]
    assert modes == [
        ("online-only", "sidecar"),
        ("offline-only", "sidecar"),
        ("budget", "sidecar"),
        ("budget", "in-engine"),
    ]
    ie = rows[-1]
    for key in ("slo_met", "ttft_p99_s", "tbt_p99_s", "offline_tokens_per_s", "budget_s"):
        assert key in ie
    assert ie["in_engine"]["plans"] > 0
    assert "budget[in-engine]" in doc["loads"][0]["searches"]
    targets = doc["loads"][0]["targets"]
    # The sidecar's verdict is computed from the sidecar row, never the in-engine one.
    off = rows[1]["offline_tokens_per_s"]
    assert targets["budget_over_offline_only"] == pytest.approx(
        rows[2]["offline_tokens_per_s"] / off
    )
    assert targets["in_engine_over_offline_only"] == pytest.approx(ie["offline_tokens_per_s"] / off)
