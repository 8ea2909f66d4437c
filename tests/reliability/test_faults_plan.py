"""The seeded fault schedules of ``slipstream_testbed.faults``: reproducible, complete, spaced."""

from __future__ import annotations

import itertools

import pytest

from slipstream_testbed.faults import ALL_FAULTS, ControlPlane, FaultError, plan_faults

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
