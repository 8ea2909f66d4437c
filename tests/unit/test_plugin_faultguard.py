"""The plugin's fault guard (slipstream_vllm.failsafe), on its own: counting per part,
rate-limited logging, tripping after repeated faults and resetting on a new generation."""

from __future__ import annotations

import logging

import pytest

from slipstream_vllm.failsafe import LOG_EVERY_S, TRIP_FAULTS, TRIP_WINDOW_S, FaultGuard

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_fault_is_swallowed_and_counted_under_its_part() -> None:
    guard = FaultGuard(Clock())
    ran_after = False
    with guard.part("planner"):
        raise ValueError("boom")
    ran_after = True
    assert ran_after and guard.counts["planner"] == 1 and guard.total == 1
    assert not guard.tripped


def test_what_is_not_an_exception_still_propagates() -> None:
    guard = FaultGuard(Clock())
    with pytest.raises(KeyboardInterrupt), guard.part("planner"):
        raise KeyboardInterrupt


def test_repeated_faults_within_the_window_trip_until_reset() -> None:
    clock = Clock()
    guard = FaultGuard(clock)
    for _ in range(TRIP_FAULTS - 1):
        guard.record("ordering", RuntimeError("x"))
        clock.t += TRIP_WINDOW_S / TRIP_FAULTS
    assert not guard.tripped
    guard.record("psm", RuntimeError("y"))
    assert guard.tripped and "last: psm" in guard.tripped_reason
    guard.reset()
    assert not guard.tripped and guard.tripped_reason == ""
    assert guard.counts["ordering"] == TRIP_FAULTS - 1  # counts survive a reset
    guard.record("psm", RuntimeError("z"))  # the window starts again after a reset
    assert not guard.tripped


def test_faults_spread_wider_than_the_window_never_trip() -> None:
    clock = Clock()
    guard = FaultGuard(clock)
    for _ in range(5 * TRIP_FAULTS):
        guard.record("planner", RuntimeError("x"))
        clock.t += TRIP_WINDOW_S / (TRIP_FAULTS - 1) + 0.01
    assert not guard.tripped


def test_logging_is_once_then_rate_limited_per_part(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    guard = FaultGuard(clock)
    caplog.set_level(logging.ERROR, logger="slipstream_vllm.failsafe")
    for _ in range(3):
        guard.record("report", OSError("disk"))
    assert len([r for r in caplog.records if "fault in report" in r.getMessage()]) == 1
    assert caplog.records[0].exc_info is not None  # the first one carries its traceback
    clock.t += LOG_EVERY_S
    guard.record("report", OSError("disk"))
    assert any("3 more faults in report" in r.getMessage() for r in caplog.records)
