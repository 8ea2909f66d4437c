"""The plugin's online-only steps: with no offline request in the engine and KV blocks and
slots to spare, ``schedule()`` goes straight to vLLM's walk (over the online waiting queue in
the ordering's order) instead of building a snapshot and planning. The plan there is known
(every running request online, given its tokens in running order, as vLLM does; arrivals
admitted in rank order up to the token cap; none preempted), so the shortcut must not change
a single step:
the same workload, stepped in lockstep on two plugins, one with the shortcut and one planning
every step, must schedule the same tokens and preempt the same requests, through chunked long
prompts, arrivals, an offline burst and long answers that outgrow the KV cache.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import OFFLINE_TOKEN_ARG, OFFLINE_TOKEN_FILE, EngineControl
from slipstream_scheduler.latency import LinearLatencyModel

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
# 512 tokens a step chunks the long prompts; 150 blocks of 16 tokens run out, so vLLM's walk
# preempts and the online ranking decides whom. With 1,500 blocks nothing runs short, and the
# arrivals are admitted by the shortcut.
CFG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks=150, noise_cv=0.0)
AMPLE = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_gpu_blocks=1500,
                     noise_cv=0.0)
ONLINE = [(100, 200), (700, 150), (300, 260), (1200, 60), (50, 300), (400, 180)]


def _engine(
    folder: Path, model: LinearLatencyModel, cfg: EngineConfig, *, shortcut: bool
) -> tuple[Any, str]:
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
        eng = VllmEngine(cfg, scheduler_cls=PLUGIN)
    finally:
        del os.environ["SLIPSTREAM_CHANNEL_DIR"]
    eng.scheduler.online_only_path = shortcut
    eng.records = []
    return eng, token


def _add(eng: Any, rid: str, prompt: int, out: int, token: str | None = None,
         keys: tuple[str, ...] = ()) -> None:
    extra = {OFFLINE_TOKEN_ARG: token} if token is not None else None
    eng.add_tokens(rid, eng.synth.prompt(rid, prompt, keys), out, extra_args=extra)


Arrivals = Callable[[int], list[tuple[str, int, int, bool, tuple[str, ...]]]]
"""Step -> the requests added before it: (id, prompt, output, offline, prefix keys)."""


def _lockstep(tmp_path: Path, model: LinearLatencyModel, cfg: EngineConfig,
              arrivals: Arrivals) -> dict[str, Any]:
    """The same arrivals on a plugin with the shortcut and one planning every step, stepped
    in lockstep; every step must schedule the same tokens and preempt the same requests."""
    engines = [_engine(tmp_path / name, model, cfg, shortcut=name == "shortcut")
               for name in ("shortcut", "planned")]
    seen = {"fast_preempted": 0, "fast_admitted": 0}
    predicted = [0, 0]  # length predictions made, per engine
    for i, (eng, _) in enumerate(engines):
        predict = eng.scheduler._predict

        def counted(*a: Any, _i: int = i, _predict: Any = predict) -> Any:
            predicted[_i] += 1
            return _predict(*a)

        eng.scheduler._predict = counted
    try:
        step = 0
        while step == 0 or any(eng.has_work() for eng, _ in engines):
            for rid, prompt, out, offline, keys in arrivals(step):
                for eng, token in engines:
                    _add(eng, rid, prompt, out, token if offline else None, keys)
            fast = engines[0][0].scheduler
            fast_before, waiting_before = fast.online_only_steps, len(fast.waiting)
            for eng, _ in engines:
                eng.step()
            if fast.online_only_steps > fast_before:
                seen["fast_preempted"] += len(engines[0][0].records[-1].preempted)
                seen["fast_admitted"] += waiting_before - len(fast.waiting)
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
        seen.update(fast=fast, planned=planned, predicted=predicted,
                    preempted=sum(len(r.preempted) for r in engines[0][0].records))
        return seen
    finally:
        for eng, _ in engines:
            eng.scheduler.shutdown()


def test_online_only_steps_schedule_exactly_what_planning_would(
    tmp_path: Path, model: LinearLatencyModel
) -> None:
    def arrivals(step: int) -> list[tuple[str, int, int, bool, tuple[str, ...]]]:
        new = []
        if step == 0:
            new += [(f"on{i}", prompt, out, False, ()) for i, (prompt, out) in enumerate(ONLINE)]
        if step % 25 == 0 and step // 25 < 16:  # arrivals while others run
            k = step // 25
            new.append((f"late{k}", 60 + (k * 137) % 500, 40 + (k * 17) % 80, False, ()))
        if step == 420:  # long answers that outgrow the KV cache while nothing waits
            new += [(f"long{j}", 200, 400, False, ()) for j in range(5)]
        if step == 20:  # an offline burst: planned steps until it is gone
            new += [(f"off{j}", 300, 20, True, ()) for j in range(4)]
        return new

    seen = _lockstep(tmp_path, model, CFG, arrivals)
    fast, planned = seen["fast"], seen["planned"]
    assert fast.online_only_steps >= 50, fast.online_only_steps
    assert fast.online_only_steps < fast.steps  # the offline burst and KV shortage planned
    assert seen["fast_preempted"] == 0  # KV short: planned, never the shortcut
    assert seen["preempted"] > 0, "no KV pressure"
    assert not fast._offline_ids  # every offline request finished and was dropped
    assert fast.report().offline_tokens == planned.report().offline_tokens == 4 * 20


def test_online_arrivals_are_admitted_as_planning_would(
    tmp_path: Path, model: LinearLatencyModel
) -> None:
    """KV to spare: arrivals of every size (chunked long prompts, prompts sharing a prefix
    with running ones, several at once, more than the step's tokens) are admitted by the
    shortcut, in the ordering's order, exactly as the plan would."""
    def arrivals(step: int) -> list[tuple[str, int, int, bool, tuple[str, ...]]]:
        if step >= 240 or step % 6:
            return []
        k = step // 6
        n = 1 + k % 3
        return [
            (f"a{k}-{j}", 40 + (k * 131 + j * 57) % 900, 8 + (k * 29 + j * 13) % 70, False,
             ("system",) if (k + j) % 2 else ())
            for j in range(n)
        ]

    seen = _lockstep(tmp_path, model, AMPLE, arrivals)
    fast = seen["fast"]
    assert seen["fast_admitted"] >= 40, seen["fast_admitted"]
    # Planned only while more wait than the free slots take.
    assert fast.online_only_steps >= 0.8 * fast.steps, (fast.online_only_steps, fast.steps)
    assert seen["fast_preempted"] == 0  # displacing for a slot is the planned path's


def test_arrivals_admitted_whole_are_not_ranked(
    tmp_path: Path, model: LinearLatencyModel
) -> None:
    """Short prompts arriving one or two a step, into a few running requests: the step's
    tokens take every arrival whole, in any order, so the shortcut ranks none of them and
    predicts no lengths, where planning predicts every one; the steps are the same."""
    def arrivals(step: int) -> list[tuple[str, int, int, bool, tuple[str, ...]]]:
        if step >= 120 or step % 4:
            return []
        k = step // 4
        return [(f"s{k}-{j}", 30 + (k * 37 + j * 11) % 90, 6 + (k * 7) % 10, False, ())
                for j in range(1 + k % 2)]

    seen = _lockstep(tmp_path, model, AMPLE, arrivals)
    fast_predicted, planned_predicted = seen["predicted"]
    assert planned_predicted >= 40 and fast_predicted == 0, seen["predicted"]
    assert seen["fast"].online_only_steps == seen["fast"].steps
