"""Simulation tier: short windows of the real traces through the dispatcher and the engine model."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import pytest

from slipstream_cli.workloads import arxiv, azure, mmlu
from slipstream_scheduler.dispatcher import DispatcherConfig, OrderingQueue
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.ordering import make_ordering
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.sim.simulator import (
    SimConfig,
    SimResult,
    Simulator,
    online_only_step_s,
    profile_latency_model,
    simulate,
)
from slipstream_scheduler.sim.workload import SimRequest, Workload, scale_rate, window
from slipstream_scheduler.types import RequestClass, Snapshot, StepPlan

pytestmark = pytest.mark.sim

ENGINE = EngineConfig(long_prefill_token_threshold=256)
WINDOW_S = 240.0


@cache
def _online() -> tuple[SimRequest, ...]:
    # Azure conversation trace, arrival rate scaled to a moderate load, 4 minutes.
    return window(scale_rate(azure.load(), 0.08), 0.0, WINDOW_S)


@cache
def _offline() -> tuple[SimRequest, ...]:
    return arxiv.load(limit=600)


@cache
def _model() -> LinearLatencyModel:
    return profile_latency_model(ENGINE, samples=600)


def _workload() -> Workload:
    return Workload(_online(), _offline(), offline_backlog=True, horizon_s=WINDOW_S)


@cache
def _run(policy: str, budget: float | None = None, cap: int = 16, seed: int = 0) -> SimResult:
    cfg = SimConfig(engine=ENGINE, policy=policy, budget_s=budget, static_cap=cap, seed=seed)
    return simulate(_workload(), cfg, latency_model=_model())


def test_online_only_serves_no_offline_tokens() -> None:
    m = _run("online-only").metrics
    assert m.online.finished > 0.9 * len(_online())
    assert m.offline.output_tokens == 0
    assert m.offline.requests == 0


def test_offline_only_serves_no_online_tokens() -> None:
    m = _run("offline-only").metrics
    assert m.online.output_tokens == 0
    assert m.offline.tokens_per_s > 0
    assert m.busy_fraction > 0.99


def test_naive_colocation_raises_online_tbt() -> None:
    base = _run("online-only").metrics.online
    naive = _run("naive").metrics
    assert naive.offline.tokens_per_s > 0
    assert naive.online.tbt.p99 > 1.3 * base.tbt.p99
    assert naive.online.tbt.mean > 1.3 * base.tbt.mean


def test_budget_keeps_p99_tbt_near_its_budget() -> None:
    budget = 0.060
    b = _run("budget", budget).metrics
    naive = _run("naive").metrics
    assert b.offline.tokens_per_s > 0
    # The budget bounds the predicted peak iteration; the measured p99 gap stays
    # within the model's error of it, and far below naive co-location's.
    assert b.online.tbt.p99 <= budget * 1.10
    assert b.online.tbt.p99 < naive.online.tbt.p99


def test_static_cap_bounds_offline_in_flight_and_throughput() -> None:
    one = _run("static-cap", cap=1).metrics.offline.tokens_per_s
    many = _run("static-cap", cap=16).metrics.offline.tokens_per_s
    assert 0 < one < many


def test_preempted_offline_requests_produce_exactly_their_length() -> None:
    res = _run("budget", 0.060)
    assert res.metrics.dispatcher_preemptions > 0
    lengths = {r.request_id: r.output_tokens for r in _offline()}
    done = res.offline_output_by_request
    assert done
    for rid, produced in done.items():
        base = rid.split("~")[0]
        assert produced == lengths[base], rid
    assert res.dispatcher.resumed > 0


def test_deterministic_given_seed() -> None:
    cfg = SimConfig(engine=ENGINE, policy="budget", budget_s=0.06, seed=3)
    short = Workload(window(_online(), 0, 60.0), _offline(), offline_backlog=True, horizon_s=60.0)
    a = simulate(short, cfg, latency_model=_model()).metrics.to_dict()
    b = simulate(short, cfg, latency_model=_model()).metrics.to_dict()
    assert a == b
    other = cfg.model_copy(update={"seed": 4})
    c = simulate(short, other, latency_model=_model()).metrics.to_dict()
    assert c != a


def test_psm_raises_prefix_hit_rate_on_mmlu() -> None:
    reqs = mmlu.load(subjects=None, per_subject=8, seed=0)
    wl = Workload((), reqs, offline_backlog=False)
    small = EngineConfig(num_gpu_blocks=1200)
    rates = {}
    for order in ("fcfs", "psm"):
        cfg = SimConfig(engine=small, policy="offline-only", offline_order=order)
        res = simulate(wl, cfg)
        assert res.metrics.offline.finished == len(reqs)
        rates[order] = res.metrics.prefix_hit_rate
    assert rates["psm"] > rates["fcfs"] + 0.1


def test_ordering_queue_runs_and_reorders_online() -> None:
    online = window(scale_rate(azure.load(), 0.15), 0.0, 120.0)
    pred = InputLengthHistoryPredictor()
    q = OrderingQueue(make_ordering("gittins"), pred)
    cfg = SimConfig(
        engine=ENGINE,
        policy="online-only",
        dispatcher=DispatcherConfig(max_online_inflight=4, admit_offline=False),
    )
    res = simulate(Workload(online), cfg, length_predictor=pred, online_queue=q)
    m = res.metrics
    assert m.online.finished == len(online)
    # every online request produced exactly its real length, resumed or not
    assert m.online.output_tokens == sum(r.output_tokens for r in online)
    assert all(r.cls is RequestClass.ONLINE for r in online)


def _in_engine(
    budget: float,
    idle: float | None,
    on_plan: Callable[[Snapshot], None] | None = None,
    window: int | None = None,
) -> tuple[Simulator, SimResult]:
    """An in-engine run; ``on_plan`` sees every snapshot the planner is given."""
    cfg = SimConfig(
        engine=ENGINE,
        policy="budget",
        budget_s=budget,
        mode="in-engine",
        dispatcher=DispatcherConfig(idle_budget_s=idle),
        in_engine_offline_window=window,
    )
    sim = Simulator(_workload(), cfg, latency_model=_model())
    if on_plan is not None:
        planner = sim.engine.planner  # type: ignore[attr-defined]
        plan = planner.plan

        def recording(snapshot: Snapshot) -> StepPlan:
            on_plan(snapshot)
            return plan(snapshot)

        planner.plan = recording
    return sim, sim.run()


def _budget_spy(spy: list[tuple[float | None, bool]]) -> Callable[[Snapshot], None]:
    def record(snapshot: Snapshot) -> None:
        online = bool(snapshot.online_queue) or any(
            r.cls is RequestClass.ONLINE for r in snapshot.running
        )
        spy.append((snapshot.budget_s, online))

    return record


def test_in_engine_mode_runs_the_iteration_planner_within_its_budget() -> None:
    from slipstream_scheduler.sim.inengine import PlannedEngine

    budget = 0.04
    sim, res = _in_engine(budget, None)
    eng = sim.engine
    assert isinstance(eng, PlannedEngine)
    assert eng.planner.mode is PlannerMode.ITERATION
    m = res.metrics
    assert eng.plans >= m.steps > 0
    assert eng.fallback_steps == 0
    # Offline work never takes a planned iteration over the budget, and the
    # planner leaves offline decodes out when they do not fit (HyGen's skip).
    over = res.in_engine["max_offline_step_over_budget_s"]
    assert over is not None and over <= 1e-9
    assert res.in_engine["skipped_offline"] > 0
    assert m.offline.tokens_per_s > 0
    assert m.online.tbt.p99 < _run("naive").metrics.online.tbt.p99
    # Every offline request that finished produced exactly its real length.
    lengths = {r.request_id: r.output_tokens for r in _offline()}
    assert res.offline_output_by_request
    for rid, produced in res.offline_output_by_request.items():
        assert produced == lengths[rid.split("~")[0]], rid


def test_in_engine_mode_uses_the_idle_budget_only_without_online_work() -> None:
    spy: list[tuple[float | None, bool]] = []
    _, res = _in_engine(0.03, 0.1, _budget_spy(spy))
    assert res.metrics.offline.tokens_per_s > 0
    with_online = {b for b, online in spy if online}
    without = {b for b, online in spy if not online}
    assert with_online == {0.03}
    assert without == {0.1}
    spy_inf: list[tuple[float | None, bool]] = []
    _in_engine(0.03, math.inf, _budget_spy(spy_inf))
    assert {b for b, online in spy_inf if not online} == {None}


def _offline_in_engine(window: int | None) -> tuple[int, int, bool]:
    """(most offline requests in the engine at once, KV blocks, online passthrough)."""
    most = [0]

    def record(snapshot: Snapshot) -> None:
        n = len(snapshot.offline_queue)
        n += sum(1 for r in snapshot.running if r.cls is RequestClass.OFFLINE)
        most[0] = max(most[0], n)

    sim, _ = _in_engine(0.04, None, record, window)
    return most[0], sim.engine.pool.num_blocks, sim.dispatcher.config.online_passthrough


def test_in_engine_mode_fronts_the_engine_as_the_sidecar_does_in_engine_mode() -> None:
    # The sidecar in engine mode passes online traffic through and submits offline
    # work without a budget, as far as its KV estimate goes: here more requests
    # than a small window would hold, and no more than the KV cache takes.
    most, blocks, passthrough = _offline_in_engine(None)
    assert passthrough
    prompt_blocks = sorted(-(-r.prompt_tokens // ENGINE.block_size) for r in _offline())
    assert most > 32
    assert sum(prompt_blocks[:most]) <= blocks  # the dispatcher's KV estimate holds
    capped, _, _ = _offline_in_engine(8)
    assert capped == 8


def test_in_engine_mode_needs_a_budget_policy_and_an_iteration_planner() -> None:
    from slipstream_scheduler.admission import build_planner
    from slipstream_scheduler.sim.inengine import PlannedEngine
    from slipstream_scheduler.sim.simulator import SimError, Simulator

    cfg = SimConfig(engine=ENGINE, policy="naive", mode="in-engine")
    with pytest.raises(SimError):
        Simulator(_workload(), cfg, latency_model=_model())
    admission = build_planner("budget", latency_model=_model(), mode=PlannerMode.ADMISSION)
    with pytest.raises(ValueError, match="ITERATION"):
        PlannedEngine(
            ENGINE, planner=admission, budget_s=0.03, idle_budget_s=None, offline_priority=100
        )


@cache
def _run_idle(budget: float, idle: float | None) -> SimResult:
    cfg = SimConfig(
        engine=ENGINE,
        policy="budget",
        budget_s=budget,
        dispatcher=DispatcherConfig(idle_budget_s=idle),
    )
    return simulate(_workload(), cfg, latency_model=_model())


def test_idle_budget_runs_offline_between_online_requests_and_keeps_tbt() -> None:
    # An online budget of a small decode step admits no offline work next to
    # online work; the idle budget lets offline run while no online request is
    # in flight, and an arriving one preempts it before the next step.
    base = _run("online-only").metrics.online
    budget = online_only_step_s(ENGINE, _model())
    hygen = _run_idle(budget, None)
    idle = _run_idle(budget, 0.120)
    assert idle.metrics.offline.tokens_per_s > 5 * max(hygen.metrics.offline.tokens_per_s, 1.0)
    assert idle.metrics.dispatcher_preemptions > 0
    # TBT samples come from steps with online work: the idle budget must not show there.
    assert idle.metrics.online.tbt.p99 <= 1.05 * base.tbt.p99
    # An arrival waits at most for the step in progress (<= ~120 ms), on top of queueing.
    assert idle.metrics.online.ttft.mean <= base.ttft.mean + 0.120
    assert idle.metrics.online.finished == base.finished


def test_idle_budget_preemptions_lose_no_output() -> None:
    res = _run_idle(online_only_step_s(ENGINE, _model()), 0.120)
    lengths = {r.request_id: r.output_tokens for r in _offline()}
    done = res.offline_output_by_request
    assert done and res.dispatcher.resumed > 0
    for rid, produced in done.items():
        assert produced == lengths[rid.split("~")[0]], rid
