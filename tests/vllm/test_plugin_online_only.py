"""The plugin's online-only steps: with nothing waiting, no offline request in the engine and
KV blocks to spare, ``schedule()`` goes straight to vLLM's walk instead of building a snapshot
and planning. The plan there is known (every running request online, given its tokens in
running order, as vLLM does, none preempted), so the shortcut must not change a single step:
the same workload, stepped in lockstep on two plugins, one with the shortcut and one planning
every step, must schedule the same tokens and preempt the same requests, through chunked long
prompts, arrivals, an offline burst and long answers that outgrow the KV cache.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, OFFLINE_TOKEN_FILE, EngineControl
from slipstream_scheduler.latency import LinearLatencyModel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
# 512 tokens a step chunks the long prompts; 150 blocks of 16 tokens run out, so vLLM's walk
# preempts and the online ranking decides whom.
CFG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks=150, noise_cv=0.0)
ONLINE = [(100, 200), (700, 150), (300, 260), (1200, 60), (50, 300), (400, 180)]


def _engine(folder: Path, model: LinearLatencyModel, *, shortcut: bool) -> tuple[Any, str]:
    from slipstream_testbed.vllm.inprocess import VllmEngine
    from slipstream_vllm.scheduler import write_control

    folder.mkdir()
    token = secrets.token_hex(16)
    (folder / OFFLINE_TOKEN_FILE).write_text(token)
    write_control(folder, EngineControl(
        generation=1, policy="budget", ordering="gittins", budget_s=1.0,
        latency_model=model.to_dict(),
    ))
    os.environ["SLIPSTREAM_CHANNEL_DIR"] = str(folder)
    try:
        eng = VllmEngine(CFG, scheduler_cls=PLUGIN)
    finally:
        del os.environ["SLIPSTREAM_CHANNEL_DIR"]
    eng.scheduler.online_only_path = shortcut
    eng.records = []
    return eng, token


def _add(eng: Any, rid: str, prompt: int, out: int, token: str | None = None) -> None:
    extra = {OFFLINE_TOKEN_ARG: token} if token is not None else None
    eng.add_tokens(rid, eng.synth.prompt(rid, prompt, ()), out, extra_args=extra)


def test_online_only_steps_schedule_exactly_what_planning_would(
    tmp_path: Path, model: LinearLatencyModel
) -> None:
    engines = [_engine(tmp_path / name, model, shortcut=name == "shortcut")
               for name in ("shortcut", "planned")]
    try:
        for eng, _ in engines:
            for i, (prompt, out) in enumerate(ONLINE):
                _add(eng, f"on{i}", prompt, out)
        step = fast_preempted = 0
        while any(eng.has_work() for eng, _ in engines):
            if step % 25 == 0 and step // 25 < 16:  # arrivals while others run
                k = step // 25
                for eng, _ in engines:
                    _add(eng, f"late{k}", 60 + (k * 137) % 500, 40 + (k * 17) % 80)
            if step == 420:  # long answers that outgrow the KV cache while nothing waits
                for eng, _ in engines:
                    for j in range(5):
                        _add(eng, f"long{j}", 200, 400)
            if step == 20:  # an offline burst: planned steps until it is gone
                for eng, token in engines:
                    for j in range(4):
                        _add(eng, f"off{j}", 300, 20, token)
            fast_before = engines[0][0].scheduler.online_only_steps
            for eng, _ in engines:
                eng.step()
            if engines[0][0].scheduler.online_only_steps > fast_before:
                fast_preempted += len(engines[0][0].records[-1].preempted)
            a, b = (eng.records[-1] for eng, _ in engines)
            assert a.scheduled == b.scheduled, (
                step, a.scheduled, a.preempted, b.scheduled, b.preempted,
                [eng.stats().kv_blocks_used for eng, _ in engines],
                [eng.scheduler.online_only_steps for eng, _ in engines],
                [len(eng.scheduler.waiting) for eng, _ in engines])
            assert a.preempted == b.preempted, (step, a.preempted, b.preempted)
            step += 1
            assert step < 5_000
        fast, planned = (eng.scheduler for eng, _ in engines)
        assert planned.online_only_steps == 0
        assert fast.online_only_steps >= 50, fast.online_only_steps
        assert fast.online_only_steps < fast.steps  # arrivals and the offline burst planned
        assert fast_preempted == 0  # KV short: planned, never the shortcut
        assert sum(len(r.preempted) for r in engines[0][0].records) > 0, "no KV pressure"
        assert not fast._offline_ids  # every offline request finished and was dropped
        assert fast.report().offline_tokens == planned.report().offline_tokens == 4 * 20
    finally:
        for eng, _ in engines:
            eng.scheduler.shutdown()
