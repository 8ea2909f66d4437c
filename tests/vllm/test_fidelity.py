"""``slipstream bench fidelity``: the step-by-step comparison with vLLM's own scheduler.

The machinery must see a stream against itself as identical and a changed configuration as
different; and on a stream without KV pressure the engine model must schedule exactly as
vLLM 0.32 does (its threshold, admission and prefix-cache rules are the ones the engine
model follows).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from slipstream_cli.benches import fidelity
from slipstream_cli.main import main

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SMALL = dataclasses.replace(fidelity.SCENARIOS["azure-priority-kv-pressure"], requests=30)


def _stream() -> list[fidelity.Arrival]:
    return fidelity.build_stream(SMALL, fidelity.load_requests(SMALL.trace))


def test_vllm_against_itself_is_identical(tiny_model: Path) -> None:
    doc = fidelity.run_scenario(SMALL, engines="vllm-vllm")
    assert doc["requests"] == 30
    assert doc["steps"]["vllm"] == doc["steps"]["model"] > 0
    assert doc["identical_step_share"] == 1.0
    assert doc["finish_order_kendall_tau"] == 1.0
    assert doc["first_divergence"] is None


def test_a_different_configuration_is_seen(tiny_model: Path) -> None:
    stream = _stream()
    cfg = SMALL.engine()
    a = fidelity.run_vllm(cfg, stream, 100_000)
    b = fidelity.run_vllm(
        cfg.model_copy(update={"long_prefill_token_threshold": 64}), stream, 100_000
    )
    doc = fidelity.compare(a, b)
    assert doc["identical_step_share"] < 1.0
    assert doc["first_divergence"] is not None
    assert doc["divergent_steps_by_field"]["scheduled"] > 0
    # The same requests finish in both.
    assert sorted(fidelity.finish_steps(a)) == sorted(fidelity.finish_steps(b))


def test_kendall_tau() -> None:
    assert fidelity.kendall_tau({"a": 0, "b": 1, "c": 2}, {"a": 0, "b": 1, "c": 2}) == 1.0
    assert fidelity.kendall_tau({"a": 0, "b": 1, "c": 2}, {"a": 2, "b": 1, "c": 0}) == -1.0
    assert -1.0 < fidelity.kendall_tau({"a": 0, "b": 1, "c": 2}, {"a": 1, "b": 0, "c": 2}) < 1.0


def test_engine_model_schedules_like_vllm_without_kv_pressure(tiny_model: Path) -> None:
    scn = dataclasses.replace(fidelity.SCENARIOS["azure-fcfs"], requests=40)
    doc = fidelity.run_scenario(scn)
    assert doc["steps"]["model"] == doc["steps"]["vllm"]
    assert doc["identical_step_share"] == 1.0, doc["first_divergence"]


def test_engine_model_schedules_like_vllm_under_kv_pressure(tiny_model: Path) -> None:
    """Shared prefixes, a tight KV cache and priorities: preemptions, resumptions that hit
    their own cached blocks, and LRU eviction must all match vLLM's."""
    scn = dataclasses.replace(fidelity.SCENARIOS["mooncake-priority-kv-pressure"], requests=20)
    doc = fidelity.run_scenario(scn)
    assert doc["preemptions"]["vllm"] > 0
    assert doc["prefix_hit_tokens"]["vllm"] > 0
    assert doc["preemptions"]["model"] == doc["preemptions"]["vllm"]
    assert doc["identical_step_share"] == 1.0, doc["first_divergence"]
    assert doc["finish_order_kendall_tau"] == 1.0


def test_cli_writes_the_report(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "fidelity.json"
    rc = main(
        ["bench", "fidelity", "--scenario", "mooncake-fcfs", "--requests", "8", "--json", str(out)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    (row,) = doc["scenarios"]
    assert row["scenario"] == "mooncake-fcfs"
    for key in ("steps", "identical_step_share", "finish_order_kendall_tau", "preemptions"):
        assert key in row
    assert set(row["preemptions"]) == {"model", "vllm"}
    assert 0.0 <= row["identical_step_share"] <= 1.0


def test_cli_without_vllm_is_a_usage_error(tmp_path: Path) -> None:
    plain = REPO / ".venv" / "bin" / "python"
    if not plain.exists():
        pytest.skip("no .venv without vllm to run from")
    env = {**os.environ, "SLIPSTREAM_VLLM_PYTHON": str(plain)}
    proc = subprocess.run(
        [str(plain), "-m", "slipstream_cli.main", "bench", "fidelity", "--requests", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "usage: slipstream bench fidelity" in proc.stderr
    assert "vllm" in proc.stderr
    assert "Traceback" not in proc.stderr
