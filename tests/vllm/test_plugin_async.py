"""The plugin on vLLM's AsyncScheduler, stepped as vLLM's engine core steps with async
scheduling on: the next ``schedule()`` before the last ``update_from_output()`` (a batch queue
of two), so a decoding request has a token in flight whenever it is planned again.

Checked against vLLM's real scheduler and KV manager: every request ends with exactly its
tokens, under KV pressure (preemptions) and with aborts mid-flight; the planner sees a
request with a token in flight as the decode it is; offline work stays within the budget; each
step is timed from its own scheduler output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, OFFLINE_TOKEN_FILE, EngineControl
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import BatchItem, Phase, RequestClass

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
CFG = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=400, noise_cv=0.0)
# Too few blocks for everything at once: vLLM preempts.
TIGHT = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=120,
                     noise_cv=0.0)


def _budget(model: LinearLatencyModel) -> float:
    batch = [BatchItem(Phase.DECODE, 1, 600)] * 4 + [BatchItem(Phase.PREFILL, 96, 0)]
    return model.predict(batch)


def _control(channel: Path, model: LinearLatencyModel) -> None:
    from slipstream_vllm.scheduler import write_control

    write_control(channel, EngineControl(
        generation=1, policy="budget", budget_s=_budget(model), latency_model=model.to_dict(),
        ordering="gittins", offline_order="psm",
    ))


def _engine(cfg: EngineConfig, cls: str | None) -> Any:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    return VllmEngine(cfg, scheduler_cls=cls, async_scheduling=True)


def _load(eng: Any, token: str | None, online: int = 6, offline: int = 12) -> dict[str, int]:
    want = _load_online(eng, online)
    for i in range(offline):
        ids = eng.synth.prompt(f"off{i}", 300, ("shared",))
        extra = {OFFLINE_TOKEN_ARG: token} if token is not None else None  # one per request
        eng.add_tokens(f"off{i}", ids, 25, extra_args=extra)
        want[f"off{i}"] = 25
    return want


def _load_online(eng: Any, online: int = 6) -> dict[str, int]:
    want: dict[str, int] = {}
    for i in range(online):
        out = 40 + 7 * i
        eng.add_tokens(f"on{i}", eng.synth.prompt(f"on{i}", 200 + 30 * i, ()), out)
        want[f"on{i}"] = out
    return want


def _run(eng: Any, want: dict[str, int], max_steps: int = 20_000) -> dict[str, int]:
    """Steps until done; the tokens each request produced, counted from vLLM's outputs."""
    got = dict.fromkeys(want, 0)
    steps = 0
    while eng.has_work():
        for rid, n in eng.step().emitted:
            got[rid] += n
        steps += 1
        assert steps < max_steps
    return got


def test_vllms_own_async_scheduler_under_the_pipelined_harness() -> None:
    eng = _engine(TIGHT, None)
    assert type(eng.scheduler).__name__ == "AsyncScheduler"
    want = _load(eng, None)
    assert _run(eng, want) == want
    assert eng.stats().preemptions > 0


def test_the_plugin_serves_every_token_once_with_a_step_in_flight(
    channel: Path, model: LinearLatencyModel
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    _control(channel, model)
    eng = _engine(TIGHT, PLUGIN)
    sched = eng.scheduler
    assert isinstance(sched, AsyncScheduler) and sched.async_scheduling
    # Offline work fills the KV cache first (no online work: no budget); online requests then
    # arrive and take KV from it (the plugin preempts offline requests in flight).
    want = _load(eng, (channel / OFFLINE_TOKEN_FILE).read_text(), online=0)
    in_flight_decodes = 0
    got = dict.fromkeys(want, 0)
    steps = 0
    while eng.has_work():
        if steps == 8:
            want.update(_load_online(eng))
            got.update(dict.fromkeys(want.keys() - got.keys(), 0))
        for r in sched.running:
            if r.num_output_placeholders > 0 and not r.is_prefill_chunk:
                # A token in flight: the planner must see the decode it is.
                view = sched._running_view(r, RequestClass.ONLINE)
                assert not view.in_prefill, (r.request_id, view)
                assert view.context_tokens == r.num_computed_tokens, (r.request_id, view)
                in_flight_decodes += 1
        for rid, n in eng.step().emitted:
            got[rid] += n
        steps += 1
        assert steps < 20_000
    assert got == want
    assert in_flight_decodes > 0
    assert eng.stats().preemptions > 0
    rep = sched.report()
    assert rep.offline_preemptions > 0
    assert rep.faults == {} and rep.fault_steps == 0
    assert rep.offline_tokens == sum(v for k, v in want.items() if k.startswith("off"))
    assert rep.measured_step_s is not None and rep.predicted_step_s is not None
    assert sched.max_offline_over_budget_s is not None
    assert sched.max_offline_over_budget_s <= 1e-9


def test_aborts_with_a_step_in_flight(channel: Path, model: LinearLatencyModel) -> None:
    _control(channel, model)
    eng = _engine(CFG, PLUGIN)
    want = _load(eng, (channel / OFFLINE_TOKEN_FILE).read_text())
    aborted = {"on1", "off3", "off7"}
    got = dict.fromkeys(want, 0)
    steps = 0
    while eng.has_work():
        if steps == 6:
            for rid in aborted:  # mid-flight: each has a batch scheduled, output not back
                assert eng.abort(rid)
        for rid, n in eng.step().emitted:
            got[rid] += n
        steps += 1
        assert steps < 20_000
    for rid, n in want.items():
        if rid in aborted:
            assert got[rid] < n
        else:
            assert got[rid] == n, rid
    assert not eng.scheduler.requests
    assert eng.scheduler.report().faults == {}


def test_the_synchronous_class_for_vllm_with_async_scheduling_off(
    channel: Path, model: LinearLatencyModel
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from slipstream_testbed.vllm.inprocess import VllmEngine

    _control(channel, model)
    eng = VllmEngine(TIGHT, scheduler_cls="slipstream_vllm.scheduler.SlipstreamSyncScheduler")
    assert not isinstance(eng.scheduler, AsyncScheduler)
    want = _load(eng, (channel / OFFLINE_TOKEN_FILE).read_text())
    assert _run(eng, want) == want
    assert eng.scheduler.report().faults == {}
