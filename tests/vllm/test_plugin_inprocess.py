"""Slipstream's scheduler plugin inside vLLM's real v1 Scheduler, stepped in-process on CPU.

``VllmEngine(scheduler_cls=...)`` builds vLLM's scheduler from the plugin class exactly as
``--scheduler-cls`` does, with vLLM's KV manager and prefix cache; each step's batch is what
vLLM's ``schedule()`` returned under the plugin. The checks read that batch, never the plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.enginecontrol import (
    OFFLINE_TOKEN_ARG,
    OFFLINE_TOKEN_FILE,
    EngineControl,
)
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import BatchItem, Phase

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PLUGIN = "slipstream_vllm.scheduler.SlipstreamScheduler"
CFG = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=400, noise_cv=0.0)


def _token(channel: Path) -> str:
    return (channel / OFFLINE_TOKEN_FILE).read_text()


def _control(channel: Path, **kw: Any) -> EngineControl:
    from slipstream_vllm.scheduler import write_control

    doc = EngineControl(**kw)
    write_control(channel, doc)
    return doc


def _engine(cfg: EngineConfig = CFG) -> Any:
    from slipstream_testbed.vllm.inprocess import VllmEngine

    return VllmEngine(cfg, scheduler_cls=PLUGIN)


def _add(
    eng: Any,
    rid: str,
    prompt: int,
    out: int,
    *,
    keys: tuple[Any, ...] = (),
    offline_token: str | None = None,
    priority: int = 0,
) -> None:
    ids = eng.synth.prompt(rid, prompt, keys)
    extra = {OFFLINE_TOKEN_ARG: offline_token} if offline_token is not None else None
    eng.add_tokens(rid, ids, out, priority=priority, extra_args=extra)


def _run(eng: Any, max_steps: int = 20_000) -> list[Any]:
    steps = []
    while eng.has_work():
        steps.append(eng.step())
        assert len(steps) < max_steps
    return steps


def _budget(model: LinearLatencyModel) -> float:
    # Four online decodes at a 600-token context plus a 96-token prefill chunk.
    batch = [BatchItem(Phase.DECODE, 1, 600)] * 4 + [BatchItem(Phase.PREFILL, 96, 0)]
    return model.predict(batch)


def test_offline_work_runs_only_within_the_budget(channel: Path, model: LinearLatencyModel) -> None:
    budget = _budget(model)
    _control(channel, generation=1, policy="budget", budget_s=budget, latency_model=model.to_dict())
    eng = _engine()
    eng.records = []
    token = _token(channel)
    for i in range(4):
        _add(eng, f"on{i}", 300, 80)
    for i in range(12):
        _add(eng, f"off{i}", 400, 40, offline_token=token)
    steps = _run(eng)
    offline_steps = 0
    for res, rec in zip(steps, eng.records, strict=True):
        if any(rid.startswith("off") for rid in rec.scheduled):
            offline_steps += 1
            assert model.predict(res.batch) <= budget * (1 + 1e-9), rec.scheduled
    assert offline_steps > 0
    sched = eng.scheduler
    assert sched.max_offline_over_budget_s is not None
    assert sched.max_offline_over_budget_s <= 1e-9
    assert eng.stats().generation_tokens == 4 * 80 + 12 * 40
    report = sched.report()
    assert report.generation == 1 and report.policy == "budget"
    assert report.offline_tokens == 12 * 40 and report.online_tokens == 4 * 80
    # Cumulative histograms, as the sidecar's Status carries them in engine mode.
    counts = report.online_counts
    assert counts.ttft.count == 4 and counts.ttft.cumulative_counts[-1] == 4
    assert counts.tbt.count == 4 * 79 and counts.finished_ok == 4 and counts.admitted == 4
    assert report.offline_counts.output_tokens == 12 * 40


def _first_token_steps(eng: Any) -> dict[str, int]:
    first: dict[str, int] = {}
    step = 0
    while eng.has_work():
        res = eng.step()
        for rid, _ in res.emitted:
            first.setdefault(rid, step)
        step += 1
        assert step < 20_000
    return first


def test_online_never_waits_behind_offline(channel: Path, model: LinearLatencyModel) -> None:
    _control(
        channel,
        generation=1,
        policy="budget",
        budget_s=_budget(model) * 3,
        latency_model=model.to_dict(),
    )
    token = _token(channel)

    def run(with_offline: bool) -> dict[str, int]:
        eng = _engine()
        if with_offline:
            for i in range(16):
                _add(eng, f"off{i}", 700, 200, offline_token=token)
            for _ in range(6):  # the offline backlog is running before online work arrives
                eng.step()
        for i in range(6):
            _add(eng, f"on{i}", 200 + 50 * i, 20)
        first = _first_token_steps(eng)
        return {rid: s for rid, s in first.items() if rid.startswith("on")}

    alone = run(False)
    mixed = run(True)
    assert set(alone) == set(mixed) == {f"on{i}" for i in range(6)}
    # The same step count from arrival to first token, with the offline backlog running.
    assert mixed == alone


def test_preempted_offline_request_resumes_with_every_token(channel: Path) -> None:
    from slipstream_testbed.vllm.inprocess import output_token

    _control(channel, generation=1, policy="naive")
    token = _token(channel)
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks=40, noise_cv=0.0)
    eng = _engine(cfg)
    for i in range(3):
        _add(eng, f"off{i}", 120, 150, offline_token=token)
    for _ in range(40):
        eng.step()
    for i in range(3):  # 3 x 140 tokens: 27 of the 40 blocks, so online work fits alone
        _add(eng, f"on{i}", 100, 40)
    _run(eng)
    sched = eng.scheduler
    assert sched.offline_preemptions > 0
    assert sched.online_preemptions == 0
    for i in range(3):
        rid = f"off{i}"
        seq = eng.synth.sequences[rid]
        produced = seq[120:]
        assert produced == [output_token(rid, j) for j in range(150)]


def test_psm_and_gittins_orders_are_observed(channel: Path) -> None:
    # Offline: two prompt families arrive interleaved; with one slot, PSM drains a family
    # before the other.
    token = _token(channel)
    _control(channel, generation=1, policy="naive", ordering="gittins")
    cfg = EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=2048, num_gpu_blocks=400, noise_cv=0.0
    )
    eng = _engine(cfg)
    fam = {"A": tuple(("famA", j) for j in range(8)), "B": tuple(("famB", j) for j in range(8))}
    for i in range(4):
        for f in "AB":
            _add(eng, f"off{f}{i}", 160, 4, keys=fam[f], offline_token=token)
    order = [rid for rid, _ in (_first_token_order(eng))]
    first_family = order[0][3]
    assert [r[3] for r in order[:4]] == [first_family] * 4, order

    # Online: the predictor learns that one template answers briefly and the other at length;
    # queued behind a long request, the briefly answered template is served first.
    eng = _engine(cfg)
    tmpl = {
        "short": tuple(("tmplS", j) for j in range(10)),
        "long": tuple(("tmplL", j) for j in range(10)),
    }
    for i in range(10):
        _add(eng, f"warmS{i}", 170, 8, keys=tmpl["short"])
        _add(eng, f"warmL{i}", 170, 160, keys=tmpl["long"])
    _run(eng)
    _add(eng, "blocker", 100, 50)
    eng.step()
    for i in range(3):
        _add(eng, f"qL{i}", 170, 160, keys=tmpl["long"])
        _add(eng, f"qS{i}", 170, 8, keys=tmpl["short"])
    order = [rid for rid, _ in _first_token_order(eng) if rid.startswith("q")]
    assert order[:3] == ["qS0", "qS1", "qS2"], order


def _first_token_order(eng: Any) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    step = 0
    while eng.has_work():
        for rid, _ in eng.step().emitted:
            seen.setdefault(rid, step)
        step += 1
        assert step < 20_000
    return sorted(seen.items(), key=lambda kv: kv[1])


def test_a_forged_offline_tag_or_priority_is_ignored(channel: Path) -> None:
    token = _token(channel)
    _control(channel, generation=1, policy="naive")
    cfg = EngineConfig(
        max_num_seqs=1, max_num_batched_tokens=2048, num_gpu_blocks=400, noise_cv=0.0
    )
    eng = _engine(cfg)
    # Real offline work with the best priority a client could ask for...
    _add(eng, "off0", 100, 30, offline_token=token, priority=-(10**9))
    _add(eng, "off1", 100, 30, offline_token=token, priority=-(10**9))
    # ...a hostile client claiming to be offline, and an online request asking to go last.
    _add(eng, "forged", 100, 30, offline_token="not-the-token")
    _add(eng, "meek", 100, 30, priority=10**9)
    order = [rid for rid, _ in _first_token_order(eng)]
    # One slot: whichever offline request got it first runs to the end, then both online
    # requests go ahead of the remaining offline one.
    assert order[1:3] == ["forged", "meek"] or order[:2] == ["forged", "meek"], order
    sched = eng.scheduler
    assert sched.forged_offline_tags == 1
    assert order.index("forged") < max(order.index("off0"), order.index("off1"))


def test_an_older_generation_is_ignored_and_survives_a_restart(
    channel: Path, model: LinearLatencyModel
) -> None:
    _control(channel, generation=5, policy="budget", budget_s=0.05, latency_model=model.to_dict())
    eng = _engine()
    sched = eng.scheduler
    assert sched.control.generation == 5 and sched.budget_s == 0.05
    import time

    from slipstream_vllm.scheduler import CONTROL_POLL_S

    # The channel thread reads the document off the scheduling thread; the next step takes it.
    _control(channel, generation=3, policy="naive")
    time.sleep(3 * CONTROL_POLL_S)
    assert sched._pending is None  # older than the one in force: never built
    _add(eng, "on0", 50, 3)
    _run(eng)
    assert sched.control.generation == 5 and sched.planner.name == "budget"
    _control(channel, generation=6, policy="budget", budget_s=0.07, latency_model=model.to_dict())
    deadline = time.monotonic() + 10
    while sched._pending is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sched._pending is not None and sched.control.generation == 5  # built, not yet taken
    _add(eng, "on1", 50, 3)
    _run(eng)
    assert sched.control.generation == 6 and sched.budget_s == 0.07
    # A new engine process (a restart) finds generation 6 in force at once.
    again = _engine().scheduler
    assert again.control.generation == 6 and again.budget_s == 0.07


def test_an_idle_engine_keeps_its_report_fresh(channel: Path) -> None:
    """No step runs while vLLM is idle; the channel thread rewrites the report meanwhile (the
    same figures, a new written_at), and the report of a later step replaces it."""
    import time

    from slipstream_scheduler.enginecontrol import EngineReport
    from slipstream_vllm.scheduler import STATUS_EVERY_S, STATUS_FILE

    eng = _engine()
    _add(eng, "on0", 40, 3)
    _run(eng)
    path = channel / STATUS_FILE

    def written(steps: int) -> EngineReport:
        # The channel thread writes the report (at most 0.2 s after a finish); wait for it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if path.exists():
                rep = EngineReport.model_validate_json(path.read_text())
                if rep.steps == steps:
                    return rep
            time.sleep(0.02)
        raise AssertionError(f"no report of step {steps}")

    first = written(eng.scheduler.steps)
    assert first.online_waiting == 0 and first.online_running == 0
    time.sleep(4 * STATUS_EVERY_S)  # idle: nothing calls into the scheduler
    later = EngineReport.model_validate_json(path.read_text())
    assert later.written_at > first.written_at
    assert later.model_copy(update={"written_at": first.written_at}) == first
    _add(eng, "on1", 40, 3)
    _run(eng)
    busy = written(eng.scheduler.steps)
    assert busy.steps > first.steps
    time.sleep(4 * STATUS_EVERY_S)
    assert EngineReport.model_validate_json(path.read_text()).steps == busy.steps
    eng.scheduler.shutdown()


def _static_cap(channel: Path, step_tokens: int, cfg: EngineConfig = CFG) -> tuple[Any, str]:
    """A plugin engine under ``static-cap`` with ``step_tokens`` offline tokens per step and no
    in-flight cap, and the pod's offline token."""
    _control(
        channel,
        generation=1,
        policy="static-cap",
        policy_params={"max_offline_in_flight": None, "max_offline_step_tokens": step_tokens},
    )
    return _engine(cfg), _token(channel)


def test_a_per_step_static_cap_bounds_offline_tokens_and_the_psm_walk_is_reused(
    channel: Path,
) -> None:
    # HyGen* inside vLLM: a fixed count of offline tokens per step, no latency model.
    eng, token = _static_cap(channel, 24)
    for i in range(6):
        _add(eng, f"off{i}", 300, 4, offline_token=token)
    _add(eng, "on0", 200, 6)
    sched = eng.scheduler
    walks: list[int] = []
    peek = sched._psm.peek_order

    def counted(n: int, now_s: float) -> tuple[str, ...]:
        walks.append(n)
        return peek(n, now_s)

    sched._psm.peek_order = counted
    offline_ids = {f"off{i}" for i in range(6)}
    steps = 0
    while eng.has_work() and steps < 40:
        eng.step()
        out = sched._last_plan
        assert out is not None
        planned = {a.request_id: a.tokens for a in (*out.scheduled, *out.admitted)}
        assert sum(n for rid, n in planned.items() if rid in offline_ids) <= 24, planned
        steps += 1
    # 24 tokens per step move the 300-token prompts slowly: most steps leave the waiting
    # queue as it was, and then the trie is not walked again.
    assert 0 < len(walks) < steps / 2, (len(walks), steps)
    before = len(walks)
    _add(eng, "off-late", 300, 4, offline_token=token)
    eng.step()
    assert len(walks) == before + 1  # a new arrival changes the queue: walked again


def test_a_per_step_cap_of_zero_holds_offline_work_back_without_falling_back(
    channel: Path,
) -> None:
    eng, token = _static_cap(channel, 0)
    for i in range(3):
        _add(eng, f"off{i}", 300, 4, offline_token=token)
    for _ in range(5):
        assert eng.step().num_tokens == 0  # an empty step, not vLLM's own walk
    assert eng.scheduler.fallback_steps == 0
    _add(eng, "on0", 200, 3)
    emitted: set[str] = set()
    for _ in range(10):
        emitted |= {rid for rid, _ in eng.step().emitted}
    assert emitted == {"on0"}


def test_a_lone_online_prompt_takes_the_token_cap_beside_offline_work(channel: Path) -> None:
    # vLLM lifts long_prefill_token_threshold only when one request is running or waiting;
    # the plugin plans the lift for a lone online request even with offline work in the step,
    # and vLLM's walk must follow the plan rather than cut the chunk back to the threshold.
    cfg = EngineConfig(
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        long_prefill_token_threshold=128,
        num_gpu_blocks=400,
        noise_cv=0.0,
    )
    eng, token = _static_cap(channel, 8, cfg)
    for i in range(2):
        _add(eng, f"off{i}", 300, 4, offline_token=token)
    eng.step()
    _add(eng, "on0", 2500, 3)
    offline: list[int] = []
    for _ in range(3):
        step = eng.step()
        plan = eng.scheduler._last_plan
        offline.append(
            sum(a.tokens for a in (*plan.scheduled, *plan.admitted) if a.request_id != "on0")
        )
    # 1,024 + 1,024 (the whole token cap) + 452 tokens beside 8 offline ones: the first token
    # comes out of the third step, not of the sixth (128 at a time once offline work shares
    # the step, which is when vLLM by itself brings its threshold back).
    assert offline[:2] == [0, 0] and offline[2] > 0
    assert "on0" in {rid for rid, _ in step.emitted}


FULL_CFG = EngineConfig(
    max_num_seqs=32, max_num_batched_tokens=512, num_gpu_blocks=200, noise_cv=0.0
)


def _kv_full_of_offline_decodes(channel: Path, model: LinearLatencyModel) -> tuple[Any, int]:
    """Five offline requests decoding with about 45 of 200 blocks free, a budget an online
    prefill chunk alone exceeds, then an online prompt of 63 blocks: its first chunk
    (32 blocks) fits the free blocks, its whole sequence does not."""
    budget = _budget(model)
    _control(channel, generation=1, policy="budget", budget_s=budget, latency_model=model.to_dict())
    eng = _engine(FULL_CFG)
    eng.records = []
    token = _token(channel)
    for i in range(5):
        _add(eng, f"off{i}", 480, 100, offline_token=token)
    while not all(
        eng.scheduler.requests[f"off{i}"].num_output_tokens >= 1 for i in range(5)
    ):
        eng.step()
    free = eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    assert 32 < free < 63, free
    _add(eng, "on0", 1000, 20)
    return eng, free


def test_an_online_prompt_vllm_admits_only_whole_preempts_offline_work_for_it(
    channel: Path, model: LinearLatencyModel
) -> None:
    # vLLM admits a waiting request only if its whole sequence fits the free blocks
    # (scheduler_reserve_full_isl, its default). The plan must do the same: one that admits
    # on the first chunk alone is refused by vLLM at every step, while the budget keeps the
    # offline decodes out of a step with an online prefill chunk in it.
    eng, _ = _kv_full_of_offline_decodes(channel, model)
    sched = eng.scheduler
    assert sched.limits.reserve_full_sequence
    first = None
    for step in range(400):
        if not eng.has_work():
            break
        res = eng.step()
        assert eng.records[-1].scheduled, f"step {step}: vLLM scheduled nothing"
        if first is None and any(rid == "on0" for rid, _ in res.emitted):
            first = step
    assert first is not None and first <= 2  # two 512-token chunks: no wait behind offline
    assert sched.offline_preemptions >= 1
    assert sched.fallback_steps == 0  # vLLM ran the plan every step
    assert eng.stats().generation_tokens == 5 * 100 + 20  # the preempted one resumed in full


def test_a_plan_vllm_refuses_whole_runs_vllms_own_walk_instead(
    channel: Path, model: LinearLatencyModel
) -> None:
    # A plan vLLM refuses in full (here: the planner told nothing of vLLM's admission gate)
    # must not leave the engine stepping on empty: vLLM's own walk runs that step.
    from dataclasses import replace

    eng, _ = _kv_full_of_offline_decodes(channel, model)
    sched = eng.scheduler
    sched.limits = replace(sched.limits, reserve_full_sequence=False)
    steps = _run(eng, max_steps=2_000)
    assert steps
    assert all(rec.scheduled for rec in eng.records)
    assert sched.fallback_steps >= 1
    assert eng.stats().generation_tokens == 5 * 100 + 20
