"""The tail guard: past its deadline a waiting request is served in deadline order.

The rule (``slipstream_scheduler.tailguard``), the orderings' ``max_wait_s`` parameter, the
deadline a service's settings give, and the sidecar's online queue under a guard: before the
deadline the ordering's order, after it the overdue requests first (earliest first), an
overdue request never displaced and displacing the worst-ranked one that is not, once; and a
property: under any arrivals, no request is passed over by a later arrival once it is overdue.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from slipstream_scheduler.dispatcher import Incoming, OrderingQueue
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.ordering import make_ordering
from slipstream_scheduler.tailguard import (
    DEFAULT_MAX_WAIT_S,
    MEAN_TARGET_FACTOR,
    TailGuard,
    max_wait_for,
    unguarded_rank,
)
from slipstream_scheduler.types import RequestClass

pytestmark = pytest.mark.unit

ON = RequestClass.ONLINE


def _pred() -> InputLengthHistoryPredictor:
    """Output length grows with the prompt: a long prompt ranks behind short ones."""
    pred = InputLengthHistoryPredictor()
    for i in range(24):
        pred.observe(None, 50 + 40 * i, 10 + 37 * i)
    return pred


def _inc(rid: str, prompt: int, t: float) -> Incoming:
    return Incoming(rid, ON, prompt, 2000, t)


# --------------------------------------------------------------------------- the rule


def test_overdue_requests_rank_first_in_deadline_order_and_the_rest_by_key() -> None:
    g = TailGuard(10.0)
    now = 100.0
    ranks = {
        "old-big": g.rank(1e9, 80.0, now),  # waited 20 s: overdue
        "older-big": g.rank(5e9, 85.0, now),  # waited 15 s: overdue, arrived later
        "new-small": g.rank(1.0, 95.0, now),  # waited 5 s
        "new-mid": g.rank(50.0, 91.0, now),
    }
    assert sorted(ranks, key=ranks.__getitem__) == ["old-big", "older-big", "new-small", "new-mid"]
    assert g.overdue(90.0, now) and not g.overdue(90.01, now)
    # Below the deadline the guard's rank sorts as the unguarded one does.
    assert g.rank(3.0, 99.0, now) == unguarded_rank(3.0, 99.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_guard_needs_a_finite_positive_wait(bad: float) -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        TailGuard(bad)


def test_the_deadline_comes_from_the_setting_then_the_ttft_targets_then_the_default() -> None:
    assert max_wait_for(max_wait_s=7.0, ttft_p99_s=2.0) == 7.0
    assert max_wait_for(max_wait_s=0.0, ttft_p99_s=2.0) is None  # 0: off
    assert max_wait_for(ttft_p99_s=2.0, ttft_mean_s=0.5) == 2.0
    assert max_wait_for(ttft_mean_s=0.5) == MEAN_TARGET_FACTOR * 0.5
    assert max_wait_for() == DEFAULT_MAX_WAIT_S
    with pytest.raises(ValueError, match="max_wait_s"):
        max_wait_for(max_wait_s=-1.0)


@pytest.mark.parametrize("name", ["sjf", "trail", "gittins"])
def test_size_based_orderings_take_the_guard_as_a_parameter(name: str) -> None:
    assert make_ordering(name).guard is None
    guarded = make_ordering(name, {"max_wait_s": 12.5})
    assert guarded.guard == TailGuard(12.5)
    with pytest.raises(ValidationError, match="max_wait_s"):
        make_ordering(name, {"max_wait_s": 0})
    with pytest.raises(ValidationError):
        make_ordering("fcfs", {"max_wait_s": 5})  # arrival order is deadline order already
    assert make_ordering("fcfs").guard is None


# --------------------------------------------------------------------------- the sidecar's queue


def test_the_queue_keeps_key_order_before_the_deadline_and_serves_overdue_first_after() -> None:
    q = OrderingQueue(make_ordering("sjf", {"max_wait_s": 10.0}), _pred())
    q.push(_inc("big", 900, 0.0))
    for i in range(4):
        q.push(_inc(f"small{i}", 60, 1.0 + i))
    assert q.head(5, 5.0)[-1] == "big"  # before its deadline: behind every small one
    assert q.head(1, 5.0) == ["small0"]
    assert q.head(1, 10.0) == ["big"]  # at its deadline: first
    assert q.head(3, 11.5) == ["big", "small0", "small1"]  # small0 (t=1) is overdue too
    q.take("big", 11.5)
    assert q.head(2, 11.5) == ["small0", "small1"]
    q.forget("small0")
    assert q.head(1, 11.5) == ["small1"]


def test_an_unguarded_queue_lets_a_big_request_wait_behind_later_small_ones() -> None:
    """The control: the same arrivals without a guard."""
    q = OrderingQueue(make_ordering("sjf"), _pred())
    q.push(_inc("big", 900, 0.0))
    for i in range(4):
        q.push(_inc(f"small{i}", 60, 1.0 + i))
    assert q.head(1, 1000.0) == ["small0"]
    assert q.head(5, 1000.0)[-1] == "big"


def test_switching_orderings_rebuilds_the_guards_view() -> None:
    q = OrderingQueue(make_ordering("sjf"), _pred())
    q.push(_inc("big", 900, 0.0))
    q.push(_inc("small", 60, 1.0))
    assert q.head(1, 50.0) == ["small"]
    q.set_ordering(make_ordering("sjf", {"max_wait_s": 10.0}))
    assert q.head(1, 50.0) == ["big"]
    q.set_ordering(make_ordering("sjf"))
    assert q.head(1, 50.0) == ["small"]


def test_an_overdue_request_is_never_displaced_and_displaces_the_worst_once() -> None:
    order = make_ordering("gittins", {"max_wait_s": 10.0, "preempt_margin": 0.0})
    q = OrderingQueue(order, _pred())
    q.push(_inc("run-big", 900, 0.0))
    q.push(_inc("run-mid", 600, 8.0))
    q.take("run-big", 0.0)
    q.take("run-mid", 8.0)
    q.push(_inc("tiny", 50, 9.0))
    # Before any deadline: the tiny one outranks the worst running one and displaces it.
    assert q.reorder_victim(9.0) == "run-big"
    # At t=12 run-big is past its deadline: it is not displaced; run-mid (arrived at 8) is.
    assert q.reorder_victim(12.0) == "run-mid"
    # A big waiting request past its deadline displaces the worst running one that is not,
    # whatever their keys, and each at most once.
    q2 = OrderingQueue(make_ordering("gittins", {"max_wait_s": 10.0}), _pred())
    q2.push(_inc("small-running", 60, 15.0))
    q2.take("small-running", 15.0)
    q2.push(_inc("waiting-big", 900, 0.0))
    assert q2.reorder_victim(5.0) is None  # not overdue: the big one outranks nothing
    assert q2.reorder_victim(20.0) == "small-running"
    q2.push(_inc("small-running", 60, 15.0))  # resumed: back in the queue, then running
    q2.take("waiting-big", 20.0)
    q2.take("small-running", 20.0)
    q2.push(_inc("waiting-big2", 900, 1.0))
    assert q2.reorder_victim(20.0) is None  # displaced once already


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.floats(0.0, 50.0), st.integers(50, 1000)), min_size=2, max_size=30
    ),
    serve_every=st.floats(0.5, 5.0),
    max_wait=st.floats(1.0, 20.0),
)
def test_an_overdue_request_is_never_passed_over_by_a_later_arrival(
    arrivals: list[tuple[float, int]], serve_every: float, max_wait: float
) -> None:
    """Serve one request every ``serve_every`` seconds: whenever the served one is not the
    earliest overdue request, no overdue request is waiting; and overdue ones leave in
    arrival order."""
    q = OrderingQueue(make_ordering("gittins", {"max_wait_s": max_wait}), _pred())
    pending = sorted((t, f"r{i}", p) for i, (t, p) in enumerate(arrivals))
    waiting: dict[str, float] = {}
    served_overdue: list[float] = []
    now = 0.0
    while pending or waiting:
        now += serve_every
        while pending and pending[0][0] <= now:
            t, rid, prompt = pending.pop(0)
            q.push(_inc(rid, prompt, t))
            waiting[rid] = t
        if not waiting:
            continue
        (rid,) = q.head(1, now)
        overdue = [a for a in waiting.values() if now - a >= max_wait]
        if overdue:
            assert waiting[rid] == min(overdue)
            served_overdue.append(waiting[rid])
        q.take(rid, now)
        del waiting[rid]
    assert served_overdue == sorted(served_overdue)


def test_the_guards_arrival_view_stays_small_and_right_under_churn() -> None:
    q = OrderingQueue(make_ordering("sjf", {"max_wait_s": 5.0}), _pred())
    q.push(_inc("oldest", 900, 0.0))  # waits throughout, at the arrival heap's top
    for i in range(500):
        q.push(_inc(f"r{i}", 60, 1.0 + i))
        q.take(f"r{i}", 1.0 + i)  # taken at once: its arrival entry turns stale
    assert len(q._by_arrival) <= 2 * len(q) + 64 + 1
    q.push(_inc("late", 60, 600.0))
    assert q.head(2, 602.0) == ["oldest", "late"]  # overdue first; late is not overdue yet
    assert q.head(2, 606.0) == ["oldest", "late"]  # both overdue: arrival order
