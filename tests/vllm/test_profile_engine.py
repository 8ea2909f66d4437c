"""``slipstream profile engine`` against real ``vllm serve`` (CPU, the tiny model).

The profile runs through the engine's OpenAI API with a short budget; the model it writes must
read back, price a batch of 8 decodes above a batch of 1, and be found by the operator's
profile lookup in the folder it was written to. No error bound is asserted: the CPU's step
times are noisy, and the test host runs other work beside it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from slipstream_cli.main import main
from slipstream_operator.modelchoice import profile_source
from slipstream_operator.profiles import find_profile
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import BatchItem, Phase
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BUDGET_S = 75


def test_profile_engine_writes_a_model_the_operator_finds(
    vllm_server: VllmServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "latency_tiny-llama_cpu.json"
    code = main(["profile", "engine", "--url", vllm_server.url, "--model", DEFAULT_SERVED_NAME,
                 "--gpu", "cpu", "--out", str(out), "--budget-s", str(BUDGET_S),
                 "--max-streams", "16", "--max-prompt-tokens", "384"])
    printed = capsys.readouterr()
    with capsys.disabled():
        print("\n" + printed.out)  # the summary, for the log
    assert code == 0, printed.err
    assert out.is_file()

    model = LinearLatencyModel.from_json(out.read_text())
    assert model.meta.source == f"slipstream profile engine {vllm_server.url}"
    assert model.meta.model == DEFAULT_SERVED_NAME and model.meta.gpu == "cpu"
    assert model.stats is not None and model.stats.rows >= 20

    def decodes(n: int) -> list[BatchItem]:
        return [BatchItem(Phase.DECODE, 1, 128)] * n

    # Non-negative coefficients: never cheaper for more work; and the step has a price.
    assert model.predict(decodes(8)) >= model.predict(decodes(1)) > 0

    found = re.search(r"held-out MAPE (\S+)%, p95 APE (\S+)%", printed.out)
    assert found is not None, printed.out
    assert math.isfinite(float(found.group(1))) and math.isfinite(float(found.group(2)))
    # The held-out error travels in the model's fit block, as printed.
    assert model.stats.heldout_mape == pytest.approx(float(found.group(1)) / 100, abs=1e-4)
    for regime in ("decode", "prefill"):
        rows = re.search(rf"{regime}\s+rows: (\d+) train", printed.out)
        assert rows is not None and int(rows.group(1)) > 0, printed.out

    profile = find_profile(DEFAULT_SERVED_NAME, "cpu", extra_dir=tmp_path)
    assert profile is not None and profile.name == f"user:{out.name}"
    assert profile.model.to_json() == model.to_json()
    assert profile_source(profile.name, profile.model) == "profiled"
