"""The sidecar's end of the engine channel against the plugin inside vLLM's real Scheduler.

The sidecar's :class:`EngineChannel` writes the token and the control document exactly as a
pod's sidecar does; the plugin, built by vLLM from ``--scheduler-cls``'s class, reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG
from slipstream_scheduler.sim.simulator import profile_latency_model
from slipstream_sidecar.enginechannel import EngineChannel, control_document

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
CFG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks=400, noise_cv=0.0)


@pytest.fixture
def channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineChannel]:
    ch = EngineChannel(tmp_path / "channel")
    monkeypatch.setenv("SLIPSTREAM_CHANNEL_DIR", str(ch.directory))
    yield ch


def _add(eng: Any, rid: str, prompt: int, out: int, xargs: dict[str, str] | None) -> None:
    eng.add_tokens(rid, eng.synth.prompt(rid, prompt, ()), out, extra_args=xargs)


def test_the_plugin_applies_the_sidecars_document_and_trusts_only_its_token(
    channel: EngineChannel,
) -> None:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    model = profile_latency_model(CFG, samples=200)
    channel.write(control_document(generation=4, budget_s=0.05, idle_budget_s=float("inf"),
                                   ordering="gittins", latency_model=model.to_dict(),
                                   slo={"ttft_p99_s": 0.5}))
    eng = VllmEngine(CFG, scheduler_cls=PLUGIN)
    sched = eng.scheduler
    assert sched.control is not None and sched.control.generation == 4
    assert sched.planner.name == "budget" and sched.budget_s == 0.05
    assert sched.idle_budget_s == float("inf")  # not turned into "the budget always"
    _add(eng, "off0", 40, 4, channel.offline_xargs())
    _add(eng, "forged", 40, 4, {OFFLINE_TOKEN_ARG: "0" * 64})
    _add(eng, "on0", 40, 4, None)
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        assert steps < 10_000
    rep = sched.report()
    assert rep.forged_offline_tags == 1
    assert rep.offline_tokens == 4 and rep.online_tokens == 8
