"""``slipstream bench ordering --engine vllm``: the ordering runs inside vLLM, under the plugin.

A small run on the real AlpacaEval answers mixed with arXiv summarisations, in a KV cache
small enough that KV blocks bound the batch: every request finishes, the rows carry the
engine-mode columns, and the run is seeded (the same command gives the same rows).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ARGS = [
    "--engine", "vllm",
    "--requests", "60",
    "--kv-blocks", "300",
    "--long-share", "0.2",
    "--loads", "0.9",
    "--seeds", "0",
    "--costs", "memory",
    "--orderings", "fcfs", "gittins-r200",
]


def _bench(out: Path, extra: list[str] | None = None) -> dict[str, object]:
    from slipstream_cli.benches import ordering

    parser = argparse.ArgumentParser()
    ordering.add_arguments(parser)
    args = parser.parse_args(["--json", str(out), *ARGS, *(extra or [])])
    assert ordering.run(args) == 0
    doc: dict[str, object] = json.loads(out.read_text())
    return doc


def test_engine_mode_rows(tmp_path: Path) -> None:
    from slipstream_cli.workloads.alpaca_eval import DataMissingError, load_rows

    try:
        load_rows()
    except DataMissingError as exc:
        pytest.skip(f"shared data not available: {exc}")
    doc = _bench(tmp_path / "a.json")
    assert doc["engine"] == "vllm" and doc["regime"] == "in-engine"
    assert doc["kv_blocks"] == 300 and doc["inflight_cap"] is None
    rows = doc["rows"]
    assert isinstance(rows, list)
    assert [r["ordering"] for r in rows] == ["fcfs", "gittins-r200"]
    for r in rows:
        assert r["finished"] == 60
        assert r["engine"] == "vllm"
        assert r["max_wait_s"] >= r["ttft_p99_s"] > 0
        assert r["preemptions"] >= r["displacements"] >= 0
    again = _bench(tmp_path / "b.json")
    strip = [
        [{k: v for k, v in r.items() if k != "wall_s"} for r in d["rows"]]  # type: ignore[attr-defined]
        for d in (doc, again)
    ]
    assert strip[0] == strip[1]


def test_a_bad_long_share_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from slipstream_cli.benches import ordering

    parser = argparse.ArgumentParser()
    ordering.add_arguments(parser)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--json", "x.json", "--long-share", "1.5"])
    assert exc.value.code == 2
    assert "--long-share" in capsys.readouterr().err
