"""``slipstream sim --engine vllm``: the simulator with vLLM's own scheduler choosing batches.

A short window of the Azure conversation trace with the arXiv backlog, the budget policy
(the sidecar's dispatcher aborts offline work and resumes it as continuations), run end to
end through the CLI entry point with vLLM's real v1 scheduler and KV manager in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream_cli.main import main

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SHORT = ["--duration-s", "20", "--rate-scale", "0.0556", "--policy", "budget", "--budget", "0.03"]


def test_sim_engine_vllm_end_to_end(tiny_model: Path, tmp_path: Path) -> None:
    runs = {}
    for engine in ("vllm", "model"):
        out = tmp_path / f"{engine}.json"
        assert main(["sim", *SHORT, "--engine", engine, "--json", str(out)]) == 0
        runs[engine] = json.loads(out.read_text())
    doc = runs["vllm"]
    assert doc["engine"] == "vllm"
    row = doc["summary"]
    assert row["engine"] == "vllm"
    m = doc["metrics"]
    assert m["steps"] > 0
    assert row["online_tokens_per_s"] > 0
    assert row["offline_tokens_per_s"] > 0
    assert row["ttft_p99_s"] is not None
    # The same trace reaches both engines: the same online requests are served.
    model = runs["model"]
    assert model["summary"]["engine"] == "model"
    assert m["online"]["requests"] == model["metrics"]["online"]["requests"] > 0


def test_bench_colocation_rows_name_their_engine(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    args = [
        "bench",
        "colocation",
        "--duration-s",
        "15",
        "--rate-scale",
        "0.0556",
        "--extra-busy",
        "--policies",
        "online-only",
        "offline-only",
        "--engine",
        "vllm",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["engine"] == "vllm"
    rows = [r for load in doc["loads"] for r in load["rows"]]
    assert rows
    assert {r["engine"] for r in rows} == {"vllm"}
    assert {r["policy"] for r in rows} == {"online-only", "offline-only"}
