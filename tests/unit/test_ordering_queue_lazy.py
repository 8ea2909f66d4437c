"""The online queue defers a lone request's prediction and key, and orders exactly as before.

A request pushed into an empty queue needs no key: nothing to order it
against. These tests check the three promises of ``OrderingQueue``'s lazy
keys: a lone request pushed, looked at and taken costs no prediction; any
sequence of pushes, takes, removals, progress and finished requests (fed to
a real, growing input-length history) gives the order the eager queue gives;
and a preemptive ordering still names its victim.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.dispatcher import Dispatcher, DispatcherConfig, Incoming, OrderingQueue
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.ordering import make_ordering
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.types import EngineLimits, RequestClass

pytestmark = pytest.mark.unit

ON = RequestClass.ONLINE


class CountingPredictor(InputLengthHistoryPredictor):
    """The core's input-length history, counting its predictions."""

    def __init__(self) -> None:
        super().__init__()
        self.predictions = 0

    def predict(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int
    ) -> npt.NDArray[np.float64]:
        self.predictions += 1
        return super().predict(vector, input_tokens)


def _fed(pred: InputLengthHistoryPredictor) -> InputLengthHistoryPredictor:
    for i in range(24):
        pred.observe(None, 50 + 40 * i, 10 + 37 * i)
    return pred


def _inc(rid: str, prompt: int, t: float = 0.0) -> Incoming:
    return Incoming(rid, ON, prompt, 2000, t)


@pytest.mark.parametrize("name", ["fcfs", "sjf", "trail", "gittins"])
def test_a_lone_request_pushed_looked_at_and_taken_costs_no_prediction(name: str) -> None:
    pred = CountingPredictor()
    _fed(pred)
    q = OrderingQueue(make_ordering(name), pred)
    for k in range(3):
        q.push(_inc(f"r{k}", 100 + k))
        assert len(q) == 1
        assert q.head(1, 0.0) == [f"r{k}"]
        assert q.head(32, 0.0) == [f"r{k}"]
        q.take(f"r{k}", 0.0)
        assert len(q) == 0
        q.progressed(f"r{k}", 5)  # a non-preemptive ordering keeps no running view
        if not q.ordering.preemptive:
            q.forget(f"r{k}")
    assert pred.predictions == (0 if not q.ordering.preemptive else 3)


def test_the_second_push_keys_the_lone_request_first() -> None:
    pred = CountingPredictor()
    _fed(pred)
    q = OrderingQueue(make_ordering("fcfs"), pred)  # equal keys: push order decides
    q.push(_inc("a", 100, 1.0))
    q.push(_inc("b", 100, 1.0))
    assert pred.predictions == 2
    assert q.head(2, 0.0) == ["a", "b"]
    q.remove("a")
    q.remove("b")
    assert len(q) == 0
    q.push(_inc("c", 100))
    q.remove("c")  # a lone request removed
    assert len(q) == 0 and q.head(4, 0.0) == []
    assert pred.predictions == 2


def test_a_preemptive_ordering_still_names_its_victim() -> None:
    # "long" ran alone (taken while lone, so no view was built); a much shorter
    # request arrives: Gittins lets it displace the long one.
    pred = CountingPredictor()
    for _ in range(8):
        pred.observe(None, 50, 10)
        pred.observe(None, 1000, 1500)
    q = OrderingQueue(make_ordering("gittins"), pred)
    q.push(_inc("long", 1000))
    q.take("long", 0.0)
    assert pred.predictions == 0
    q.push(_inc("short", 50, 1.0))
    assert q.reorder_victim() == "long"
    assert pred.predictions == 2


# ---- lazy == eager, under random event sequences --------------------------------------


def _step(
    q: OrderingQueue, pred: InputLengthHistoryPredictor, op: int, x: int, st_: dict[str, Any]
) -> None:
    """One event on ``q``; ``st_`` tracks ids queued, running and produced tokens."""
    queued: list[str] = st_["queued"]
    running: list[str] = st_["running"]
    if op == 0:
        rid = f"r{st_['n']}"
        st_["n"] += 1
        q.push(_inc(rid, 20 + x % 900, float(x % 7)))
        queued.append(rid)
    elif op == 1 and queued:
        head = q.head(1 + x % 3, 0.0)
        rid = head[x % len(head)]
        q.take(rid, 0.0)
        queued.remove(rid)
        running.append(rid)
    elif op == 2 and queued:
        rid = queued.pop(x % len(queued))
        q.remove(rid)
    elif op == 3 and running:
        rid = running[x % len(running)]
        st_["gen"][rid] = st_["gen"].get(rid, 0) + 1 + x % 300
        q.progressed(rid, st_["gen"][rid])
    elif op == 4 and running:  # finished: the dispatcher's order of calls
        rid = running.pop(x % len(running))
        q.forget(rid)
        q.settle()
        pred.observe(None, 20 + x % 900, 1 + x % 1500 + st_["gen"].get(rid, 0))
        q.observed()
    elif op == 5 and running:  # aborted to let a better one in: back in the queue
        victim = st_["victim"] = q.reorder_victim()
        if victim is not None:
            running.remove(victim)
            q.push(_inc(victim, 20 + x % 900, 0.5))
            queued.append(victim)


def _keys(q: OrderingQueue) -> tuple[dict[str, float], dict[str, float]]:
    q.settle()
    queued = {rid: q._q.key_of(rid) for rid in q._held if rid in q._q}
    return queued, {rid: key for rid, (_, key) in q._running.items()}


@settings(max_examples=80, deadline=None)
# A lone request waits while another finishes: its key must see the history before that.
@example(name="sjf", ops=[(0, 100), (1, 0), (0, 300), (4, 700), (0, 50)])
@example(name="gittins", ops=[(0, 100), (1, 0), (0, 300), (1, 0), (4, 700), (3, 5), (0, 9), (5, 0)])
@given(
    name=st.sampled_from(["fcfs", "sjf", "trail", "gittins"]),
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10_000)), max_size=60),
)
def test_lazy_keys_give_the_eager_order(name: str, ops: list[tuple[int, int]]) -> None:
    # A short history, so every finished request moves the predictions.
    preds = [InputLengthHistoryPredictor() for _ in range(2)]
    for p in preds:
        p.observe(None, 100, 50)
    queues = [OrderingQueue(make_ordering(name), p, fallback_refresh_every=4) for p in preds]
    queues[0].lazy_keys = False
    states: list[dict[str, Any]] = [
        {"n": 0, "queued": [], "running": [], "gen": {}} for _ in range(2)
    ]
    for op, x in ops:
        got = []
        for q, pred, s in zip(queues, preds, states, strict=True):
            s["victim"] = None
            _step(q, pred, op, x, s)
            got.append((len(q), q.head(64, 0.0), s["victim"]))
        assert got[0] == got[1]
        # Every deferred key, computed now on a copy, is the key the eager queue holds.
        assert _keys(queues[0]) == _keys(copy.deepcopy(queues[1]))
        assert states[0]["running"] == states[1]["running"]


@settings(max_examples=40, deadline=None)
@example(preempt=0, ops=[(0, 100), (0, 3), (1, 0), (0, 300), (3, 1400), (0, 9), (1, 0)])
@given(
    preempt=st.integers(0, 2),
    ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10_000)), max_size=60),
)
def test_a_dispatcher_decides_the_same_with_lazy_keys(
    preempt: int, ops: list[tuple[int, int]]
) -> None:
    # The dispatcher settles deferred keys before it feeds the predictor a finished request.
    disps = []
    for lazy in (False, True):
        pred = InputLengthHistoryPredictor()
        pred.observe(None, 100, 50)
        queue = OrderingQueue(
            make_ordering("gittins", {"max_preemptions": preempt}), pred, fallback_refresh_every=4
        )
        queue.lazy_keys = lazy
        planner = build_planner("naive", mode=PlannerMode.ADMISSION)
        disps.append(
            Dispatcher(
                DispatcherConfig(max_online_inflight=2),
                planner,
                online_queue=queue,
                length_predictor=pred,
                limits=EngineLimits(max_num_seqs=8),
            )
        )
    n = 0
    t = 0.0
    for op, x in ops:
        t += 0.01
        got = []
        for d in disps:
            live = sorted(r for r, rec in d._inflight.items() if not rec.aborting)
            if op == 0:
                d.arrive(_inc(f"r{n}", 20 + x % 900, t), t)
            elif op == 1:
                dec = d.decide(t)
                for a in dec.abort:
                    d.aborted(a.request_id, t)
                got.append(dec)
            elif op == 2 and live:
                rid = live[x % len(live)]
                _, gen, _ = d.request_state(rid)
                d.progress(rid, gen - d._recs[rid].resume_from + 1 + x % 250, t)
            elif op == 3 and live:
                rid = live[x % len(live)]
                _, gen, _ = d.request_state(rid)
                d.finished(rid, gen - d._recs[rid].resume_from + x % 1500, t)
            elif op == 4 and live:
                d.failed(live[x % len(live)], t)
            got.append(d.online_queue.head(16, t))
        n += op == 0
        assert got[: len(got) // 2] == got[len(got) // 2 :]
        eager, lazy = (d.online_queue for d in disps)
        assert isinstance(eager, OrderingQueue) and isinstance(lazy, OrderingQueue)
        assert _keys(eager) == _keys(copy.deepcopy(lazy))


def test_switching_orderings_keys_deferred_requests_with_the_new_one() -> None:
    got = []
    for lazy in (False, True):
        pred = _fed(InputLengthHistoryPredictor())
        q = OrderingQueue(make_ordering("gittins"), pred)
        q.lazy_keys = lazy
        q.push(_inc("run", 900))
        q.take("run", 0.0)  # lazily: no running view yet
        q.push(_inc("lone", 300, 1.0))  # lazily: unkeyed
        q.set_ordering(make_ordering("trail", {"cost": "memory"}))
        q.progressed("run", 250)
        q.push(_inc("next", 60, 2.0))
        got.append((q.head(3, 0.0), q.reorder_victim(), _keys(q)))
    assert got[0] == got[1]
