"""The seeded fault schedules of ``slipstream_testbed.faults``: reproducible, complete, spaced."""

from __future__ import annotations

import itertools

import pytest

from slipstream_testbed.faults import (
    ALL_FAULTS,
    POD_KILLS,
    ControlPlane,
    FaultError,
    plan_faults,
    plan_timed_faults,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(20))
def test_a_plan_has_every_fault_once_in_window_and_spaced(seed: int) -> None:
    plan = plan_faults(seed, pods=3)
    assert sorted(f.kind for f in plan.faults) == sorted(ALL_FAULTS)
    points = [f.at_progress for f in plan.faults]
    assert points == sorted(points)
    assert all(0.08 <= p <= 0.85 for p in points)
    assert all(b - a >= 0.03 - 1e-4 for a, b in itertools.pairwise(points))
    assert all(0 <= f.target < 3 and 0.2 <= f.down_s <= 3.0 for f in plan.faults)


def test_the_seed_decides_the_plan() -> None:
    assert plan_faults(7) == plan_faults(7)
    assert len({plan_faults(s).describe() for s in range(10)}) == 10


def test_bad_window_and_unknown_component_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        plan_faults(0, first=0.9, last=0.5)
    with pytest.raises(FaultError, match="not a component"):
        ControlPlane.__new__(ControlPlane)._component("kubelet")


@pytest.mark.parametrize("seed", range(10))
def test_a_timed_plan_strikes_every_kind_in_turn_spaced_and_inside_the_run(seed: int) -> None:
    plan = plan_timed_faults(seed, duration_s=1800, every_s=150, pods=2)
    assert len(plan) == 12
    kinds = [f.kind for f in plan]
    for i in range(0, 12, 3):  # rounds of every kind once
        assert sorted(kinds[i:i + 3]) == sorted(POD_KILLS)
    times = [f.at_s for f in plan]
    assert all(b - a >= 75 - 0.2 for a, b in itertools.pairwise(times))
    assert times[0] >= 37.5 - 0.1 and times[-1] <= 1800 - 37.5 + 0.1
    assert {f.target for f in plan} <= {0, 1}
    assert plan_timed_faults(seed, 1800, 150) == plan


def test_a_timed_plan_needs_room_for_one_fault() -> None:
    with pytest.raises(ValueError, match="no fault fits"):
        plan_timed_faults(0, duration_s=60, every_s=120)
    with pytest.raises(ValueError, match="one kind"):
        plan_timed_faults(0, duration_s=600, every_s=120, kinds=())
    assert len({tuple(plan_timed_faults(s, 600, 100)) for s in range(8)}) == 8
