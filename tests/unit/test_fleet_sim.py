"""Fleet simulation: routing, shard placement, and a small multi-engine replay."""

from __future__ import annotations

import math

import pytest

from slipstream_scheduler.sim.fleet import (
    FleetConfig,
    FleetError,
    make_shards,
    place_shards,
    route_online,
    simulate_fleet,
)
from slipstream_scheduler.sim.simulator import SimConfig
from slipstream_scheduler.sim.workload import SimRequest
from slipstream_scheduler.types import RequestClass


def _online(n: int, gap_s: float, prompt: int = 200, out: int = 20) -> list[SimRequest]:
    return [SimRequest(f"on-{i}", RequestClass.ONLINE, i * gap_s, prompt, out) for i in range(n)]


def _offline(n: int, prompt: int = 300, out: int = 8) -> list[SimRequest]:
    return [SimRequest(f"off-{i}", RequestClass.OFFLINE, 0.0, prompt, out) for i in range(n)]


@pytest.mark.unit
def test_least_work_spreads_a_burst_and_round_robin_cycles() -> None:
    burst = _online(8, 0.0)
    assert route_online(burst, 4, "round-robin", 1000.0) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert sorted(route_online(burst, 4, "least-work", 1000.0)) == [0, 0, 1, 1, 2, 2, 3, 3]
    # One long request: least-work keeps the next ones off its engine while it runs.
    big = [SimRequest("big", RequestClass.ONLINE, 0.0, 50_000, 10), *_online(4, 0.001)]
    routed = route_online(big, 3, "least-work", 1000.0)
    assert routed[0] == 0 and routed[1:3] == [1, 2]


@pytest.mark.unit
def test_least_work_forgets_requests_that_have_finished() -> None:
    # 60 s apart: each request (0.2 s prompt + ~20 tokens x 0.03 s) is done before the next,
    # so every engine is idle and the tie-break rotates; 2 ms apart, all three are busy.
    assert route_online(_online(6, 60.0), 3, "least-work", 1000.0) == [0, 1, 2, 0, 1, 2]
    burst = [*_online(3, 0.002), SimRequest("late", RequestClass.ONLINE, 0.003, 100, 5)]
    routed = route_online(burst, 3, "least-work", 1000.0)
    assert routed == [0, 1, 2, 0]  # all three busy: the tie-break's turn (4th request -> 0)


@pytest.mark.unit
def test_spare_placement_gives_more_shards_to_engines_with_more_spare() -> None:
    shards = make_shards("job", _offline(100), 5)
    assert len(shards) == 20 and shards[-1].shard_id == "job-00019"
    placed = place_shards(shards, [0.9, 0.3, 0.0], "spare")
    counts = [placed.count(i) for i in range(3)]
    assert counts[0] > counts[1] > counts[2]
    assert sum(counts) == 20
    assert place_shards(shards, [0.9, 0.3, 0.0], "even").count(2) == 6
    with pytest.raises(FleetError):
        make_shards("job", _offline(3), 0)


@pytest.mark.sim
def test_a_small_fleet_replay_pools_every_engine() -> None:
    online = _online(60, 0.05)
    shards = make_shards("job", _offline(40), 4)
    config = FleetConfig(engines=3, capacity_tokens_per_s=8000.0,
                         sim=SimConfig(policy="budget", budget_s=0.2))
    seen: list[int] = []
    outcome = simulate_fleet(online, shards, config, horizon_s=30.0,
                             on_engine=lambda i, _: seen.append(i))
    assert seen == [0, 1, 2]
    assert sum(len(x) for x in outcome.plan.online) == 60
    assert sum(len(x) for x in outcome.plan.shards) == 10
    assert outcome.online_requests == 60 and outcome.online_finished == 60
    assert outcome.online_ttft.count == 60 and not math.isnan(outcome.online_ttft.p99)
    assert outcome.offline_finished == 40
    assert outcome.offline_tokens_per_s > 0
