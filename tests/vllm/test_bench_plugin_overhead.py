"""``slipstream bench plugin-overhead``: a small run of the benchmark docs/benchmarks cites.

Every configuration it reports stays in the regime it claims (steady: every request decoding,
none preempted or waiting; churn: answers finishing and replaced, none preempted; the bench
raises otherwise), the online-only configurations take vLLM's walk without a plan on nearly
every step, arrivals included, and the mixed one plans every step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_rows_in_the_steady_state(tmp_path: Path) -> None:
    from slipstream_cli.benches import plugin_overhead

    parser = argparse.ArgumentParser()
    plugin_overhead.add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args([
        "--running", "16", "--steps", "20", "--rounds", "2",
        "--config", "naive-fcfs", "budget-gittins-mixed", "--workload", "steady", "churn",
        "--json", str(out),
    ])
    assert plugin_overhead.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == plugin_overhead.SCHEMA and doc["rounds"] == 2
    rows = {(r["workload"], r["config"]): r for r in doc["rows"]}
    assert set(rows) == {(w, c) for w in ("steady", "churn")
                         for c in ("naive-fcfs", "budget-gittins-mixed")}
    for r in rows.values():
        assert r["running"] == 16 and r["steps"] == 40
        assert r["stock_median_us"] > 0 and r["plugin_median_us"] > 0
        assert r["ratio"] == pytest.approx(r["plugin_median_us"] / r["stock_median_us"])
    for workload in ("steady", "churn"):
        # Online traffic alone takes vLLM's walk, arrivals included; a job's planned.
        assert rows[workload, "naive-fcfs"]["online_only_share"] > 0.5
        assert rows[workload, "budget-gittins-mixed"]["online_only_share"] == 0.0
    assert rows["steady", "naive-fcfs"]["arrivals_per_step"] == 0
    # 16 answers of 64 to 192 tokens: one finishes (and is replaced) every few steps.
    assert 0 < rows["churn", "naive-fcfs"]["arrivals_per_step"] < 0.5
