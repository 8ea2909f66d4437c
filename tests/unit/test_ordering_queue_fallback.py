"""The online queue ranks a request that outlived its predicted sample on the global lengths.

The predictor is the core's real input-length history; its global distribution
(10, 200 and 400 tokens, by input length 50, 500 and 1000) is what a request
that outlived its own sample falls back on. A request of input 50 predicted at
10 tokens that has produced 300 can only be one of the 400-token answers: 100
tokens left. The old rule (no fallback: the point ``O = 2·o``) put 300 left and
ranked it behind a fresh 200-token request.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.dispatcher import (
    Abort,
    Dispatcher,
    DispatcherConfig,
    Incoming,
    OrderingQueue,
)
from slipstream_scheduler.lengths import GlobalDistributionPredictor, InputLengthHistoryPredictor
from slipstream_scheduler.ordering import GlobalFallback, PriorSampler, make_ordering
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.types import RequestClass

pytestmark = pytest.mark.unit

ON = RequestClass.ONLINE
# input tokens -> the output length every past request of that input produced
HISTORY = {50: 10, 500: 200, 1000: 400}


def _fed_predictor() -> InputLengthHistoryPredictor:
    pred = InputLengthHistoryPredictor()
    for _ in range(8):
        for inp, out in HISTORY.items():
            pred.observe(None, inp, out)
    return pred


def _inc(rid: str, prompt: int, t: float = 0.0) -> Incoming:
    return Incoming(rid, ON, prompt, 2000, t)


@pytest.mark.parametrize("cost", ["output", "memory"])
@pytest.mark.parametrize("name", ["gittins", "trail"])
def test_an_outliving_request_is_not_queued_behind_a_longer_fresh_one(name: str, cost: str) -> None:
    q = OrderingQueue(make_ordering(name, {"cost": cost}), _fed_predictor())
    q.push(_inc("a", 50))
    q.take("a", 0.0)
    q.progressed("a", 300)  # outlived its sample (10 tokens)
    q.push(_inc("a", 50))  # back in the queue after a reorder abort, at 300 tokens
    q.push(_inc("b", 500, 1.0))  # expects 200 tokens in all; "a" expects 100 more
    assert q.head(2, 1.0) == ["a", "b"]


def test_an_outliving_request_in_flight_is_not_displaced_by_a_longer_fresh_one() -> None:
    """Through the dispatcher: history fed by finished requests, one online slot."""
    pred = InputLengthHistoryPredictor()
    q = OrderingQueue(make_ordering("gittins", {"cost": "output"}), pred)
    d = Dispatcher(
        DispatcherConfig(max_online_inflight=1),
        build_planner("naive", mode=PlannerMode.ADMISSION),
        online_queue=q,
        length_predictor=pred,
    )
    t = 0.0
    for i in range(8):
        for inp, out in HISTORY.items():
            rid = f"h{i}-{inp}"
            d.arrive(_inc(rid, inp, t), t)
            assert [s.request_id for s in d.decide(t).submit] == [rid]
            d.finished(rid, out, t + 1.0)
            t += 1.0
    d.arrive(_inc("a", 50, t), t)
    assert [s.request_id for s in d.decide(t).submit] == ["a"]
    d.progress("a", 300, t + 10.0)
    d.arrive(_inc("b", 500, t + 10.0), t + 10.0)
    decisions = d.decide(t + 10.0)
    assert Abort("a", "reorder") not in decisions.abort
    assert d.stats().reorders == 0
    # ... while a fresh request shorter than what "a" has left does displace it
    d.arrive(_inc("c", 50, t + 11.0), t + 11.0)
    assert Abort("a", "reorder") in d.decide(t + 11.0).abort


class _CountingPrior(InputLengthHistoryPredictor):
    """The real input-length history, counting how often its prior is read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def prior_sample(self, k: int) -> npt.NDArray[np.float64]:
        if k == 16:  # the queue's reads (the predictor's own top-up asks for < 8)
            self.reads += 1
        return super().prior_sample(k)


def test_the_fallback_is_cached_and_refreshed_as_history_grows() -> None:
    pred = _CountingPrior()
    assert isinstance(pred, PriorSampler)
    q = OrderingQueue(
        make_ordering("gittins"), pred, fallback_samples=16, fallback_refresh_every=64
    )
    np.testing.assert_array_equal(q.fallback, [256.0])  # empty history: the default length
    for n in range(1, 2001):
        pred.observe(None, 100, n)
        q.observed()
        q.push(_inc(f"r{n}", 100))  # every push builds a view
    # 1, 2, 4, ... 64 finished requests apart, then every 64: not once per request
    assert pred.reads <= 1 + 7 + (2000 - 64) // 64
    fb = q.fallback
    assert fb.shape == (16,) and np.all(np.diff(fb) >= 0)
    # at most 64 requests stale: the quantiles of 1..N for N within 64 of 2000
    assert 1900 < fb[-1] <= 2000


def test_a_predictor_without_a_prior_gets_the_old_rule() -> None:
    class _Fixed:
        def predict(
            self, vector: npt.NDArray[np.float32] | None, input_tokens: int
        ) -> npt.NDArray[np.float64]:
            return np.array([10.0])

        def observe(
            self, vector: npt.NDArray[np.float32] | None, input_tokens: int, output_tokens: int
        ) -> None:
            return None

    q = OrderingQueue(make_ordering("gittins", {"cost": "output"}), _Fixed())
    assert q.fallback.shape == (0,)
    q.push(_inc("a", 50))
    q.take("a", 0.0)
    q.progressed("a", 300)
    q.push(_inc("a", 50))
    q.push(_inc("b", 50))
    assert q.head(2, 0.0) == ["b", "a"]  # ranked on O = 2·300: 300 tokens left


def test_zero_fallback_samples_disables_the_fallback() -> None:
    q = OrderingQueue(make_ordering("gittins"), _fed_predictor(), fallback_samples=0)
    assert q.fallback.shape == (0,)
    with pytest.raises(ValueError, match="fallback"):
        OrderingQueue(make_ordering("gittins"), _fed_predictor(), fallback_refresh_every=0)


def test_the_plugins_fallback_follows_the_same_rule() -> None:
    """The engine plugin keeps its fallback with the same class over the global predictor."""
    pred = GlobalDistributionPredictor()
    fb = GlobalFallback(pred)
    np.testing.assert_array_equal(fb.lengths, [256.0])  # no history: the default length
    reads = [fb.lengths]
    for n in range(1, 129):
        pred.observe(None, 100, n)
        fb.observed()
        reads.append(fb.lengths)
    changed = [i for i in range(1, len(reads)) if reads[i] is not reads[i - 1]]
    assert changed == [1, 2, 4, 8, 16, 32, 64, 128]  # after 1, 2, 4, ... 64 finishes, then 64
    assert reads[-1][-1] == 128.0 and np.all(np.diff(reads[-1]) >= 0)
    assert GlobalFallback(object()).lengths.shape == (0,)  # no global distribution: none
