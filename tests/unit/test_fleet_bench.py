"""The fleet bench's result shaping (no cluster, no simulation)."""

from __future__ import annotations

import pytest

from slipstream_cli.benches.fleet import BEGIN, END, markdown, splice, summary

pytestmark = pytest.mark.unit


def _scale(nodes: int, ok: bool = True) -> dict[str, object]:
    row: dict[str, object] = {"nodes": nodes, "services": nodes // 2, "pods": 2 * nodes,
                              "jobs": nodes // 5, "shards": 100 * nodes, "ok": ok}
    if ok:
        row.update({"ready_s": 1.0 * nodes, "status_lag_p99_s": 0.1 * nodes,
                    "status_lag_p50_s": 0.05 * nodes, "operator_cpu_cores": 0.001 * nodes,
                    "operator_rss_mb": 100.0, "api_rps": 0.7 * nodes, "pods_running_s": 2.0,
                    "ramp": {"cpu_cores": 0.2, "api_rps": 3.0}})
    else:
        row["error"] = "shards placed: not reached after 1200s"
    return row


def test_summary_reports_the_largest_scale_reached() -> None:
    result = summary([_scale(100), _scale(250), _scale(500, ok=False)], None)
    assert result["nodes"] == 250 and result["api_rps"] == pytest.approx(175.0)
    assert [s["nodes"] for s in result["scales"]] == [100, 250, 500]
    table = markdown(result)
    assert "| 250 | 125 | 500 | 50 | 25000 |" in table and "failed: shards placed" in table
    assert summary([], None)["nodes"] is None


def test_splice_replaces_only_the_results_block() -> None:
    doc = splice("# Fleet\n\nwhy\n", "| old |\n")
    assert doc.startswith("# Fleet\n\nwhy\n\n" + BEGIN) and doc.endswith(END + "\n")
    again = splice(doc + "\nafter\n", "| new |\n")
    assert "| old |" not in again and "| new |" in again
    assert again.startswith("# Fleet\n\nwhy\n") and again.endswith("\nafter\n")
    assert splice("", "| t |\n") == f"{BEGIN}\n| t |\n{END}\n"


def test_baseline_rows_are_shown_but_never_the_headline() -> None:
    before = dict(_scale(500), operator="before", baseline=True)
    after = dict(_scale(100), operator="after")
    result = summary([before, after], None)
    assert result["nodes"] == 100  # the baseline's larger scale is not the result
    table = markdown(result)
    assert "| operator | nodes |" in table
    assert "| before | 500 | 250 |" in table and "| after | 100 | 50 |" in table
    assert "| operator" not in markdown(summary([_scale(100)], None))
