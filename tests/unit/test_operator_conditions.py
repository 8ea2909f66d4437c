"""Condition setters: changed flags and lastTransitionTime only on a flip."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from slipstream_operator.api import ConditionStatus
from slipstream_operator.conditions import find_condition, is_true, rfc3339, set_condition

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def test_new_condition_is_a_change_with_the_current_time() -> None:
    conds: list[dict[str, Any]] = []
    assert set_condition(conds, "Ready", True, reason="Ready", message="", now=T0,
                         observed_generation=1)
    assert conds == [{"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                      "observedGeneration": 1, "lastTransitionTime": "2026-01-01T12:00:00Z"}]


def test_same_values_are_not_a_change_and_keep_the_time() -> None:
    conds: list[dict[str, Any]] = []
    set_condition(conds, "Ready", True, reason="Ready", message="", now=T0, observed_generation=1)
    later = T0 + timedelta(minutes=5)
    assert not set_condition(conds, "Ready", True, reason="Ready", message="", now=later,
                             observed_generation=1)
    assert conds[0]["lastTransitionTime"] == rfc3339(T0)


def test_reason_change_without_flip_keeps_the_time() -> None:
    conds: list[dict[str, Any]] = []
    set_condition(conds, "SLOMet", False, reason="TTFTP99Exceeded", message="a", now=T0,
                  observed_generation=1)
    later = T0 + timedelta(minutes=1)
    assert set_condition(conds, "SLOMet", False, reason="TBTMeanExceeded", message="b", now=later,
                         observed_generation=2)
    cond = find_condition(conds, "SLOMet")
    assert cond is not None and cond["reason"] == "TBTMeanExceeded"
    assert cond["lastTransitionTime"] == rfc3339(T0)
    assert cond["observedGeneration"] == 2


def test_flip_moves_the_time() -> None:
    conds: list[dict[str, Any]] = []
    set_condition(conds, "Ready", False, reason="NoPods", message="", now=T0,
                  observed_generation=1)
    later = T0 + timedelta(seconds=30)
    assert set_condition(conds, "Ready", ConditionStatus.TRUE, reason="Ready", message="",
                         now=later, observed_generation=1)
    assert conds[0]["lastTransitionTime"] == rfc3339(later)
    assert is_true(conds, "Ready") and not is_true(conds, "SLOMet")


def test_naive_times_are_utc_and_aware_ones_are_converted() -> None:
    assert rfc3339(datetime(2026, 1, 1, 12)) == "2026-01-01T12:00:00Z"
    plus2 = datetime(2026, 1, 1, 14, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    assert rfc3339(plus2) == "2026-01-01T14:00:00Z"
