"""``slipstream sim --engine vllm --mode in-engine``: Slipstream's plugin inside vLLM's scheduler.

The simulator's in-engine mode with vLLM's real v1 scheduler under ``SlipstreamScheduler``
(configured as the sidecar would configure it): every batch is the plugin's steering of vLLM's
walk, timed by the engine model's GPU timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream_cli.main import main

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SHORT = ["--duration-s", "10", "--rate-scale", "0.0556", "--policy", "budget", "--budget", "0.03"]


def test_sim_runs_the_plugin_inside_vllms_scheduler(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "plugin.json"
    assert main(["sim", *SHORT, "--engine", "vllm", "--mode", "in-engine", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["summary"]
    assert (row["engine"], row["mode"]) == ("vllm", "plugin")
    assert row["offline_tokens_per_s"] > 0 and row["online_tokens_per_s"] > 0
    counters = row["in_engine"]
    assert counters["plans"] > 0
    # Whenever the plugin ran offline work, vLLM's batch was predicted within the budget.
    assert counters["max_offline_step_over_budget_s"] is not None
    assert counters["max_offline_step_over_budget_s"] <= 1e-9
