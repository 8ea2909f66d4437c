"""``slipstream bench ordering`` gives the same rows whatever ``--jobs`` says.

A small run on the real AlpacaEval answers (80 requests, one load, one seed):
once in this process and once in two worker processes. Every run is seeded, so
the rows must agree to the last digit apart from their wall time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.sim


def _bench(out: Path, jobs: int) -> dict[str, object]:
    from slipstream_cli.benches import ordering

    parser = argparse.ArgumentParser()
    ordering.add_arguments(parser)
    args = parser.parse_args(
        [
            "--json",
            str(out),
            "--requests",
            "80",
            "--loads",
            "0.9",
            "--seeds",
            "0",
            "--costs",
            "output",
            "--orderings",
            "sjf",
            "gittins-r200",
            "gittins-nofb",
            "--jobs",
            str(jobs),
        ]
    )
    assert ordering.run(args) == 0
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_worker_processes_give_the_same_rows(tmp_path: Path) -> None:
    from slipstream_cli.workloads.alpaca_eval import DataMissingError, load_rows

    try:
        load_rows()
    except DataMissingError as exc:
        pytest.skip(f"shared data not available: {exc}")
    one = _bench(tmp_path / "one.json", 1)
    two = _bench(tmp_path / "two.json", 2)
    strip = [
        [{k: v for k, v in r.items() if k != "wall_s"} for r in doc["rows"]]  # type: ignore[attr-defined]
        for doc in (one, two)
    ]
    assert strip[0] == strip[1]
    assert [r["ordering"] for r in strip[0]] == ["sjf", "gittins-r200", "gittins-nofb"]
    assert all(r["finished"] == 80 for r in strip[0])
