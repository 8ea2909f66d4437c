"""The sidecar builds the very queues the simulator runs (same code, only the clock differs)."""

from __future__ import annotations

import pytest

from slipstream_scheduler.dispatcher import Incoming, OrderingQueue, PsmOfflineQueue
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.brain import (
    BrainConfig,
    build_dispatcher,
    build_online_queue,
    sidecar_ordering,
)
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["fcfs", "sjf", "trail", "gittins"])
def test_orderings_never_displace_in_flight_online_requests(name: str) -> None:
    ordering = sidecar_ordering(name)
    assert ordering.name == name
    assert ordering.preemptive is False


def test_unknown_ordering_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown ordering 'lifo'"):
        sidecar_ordering("lifo")


def test_dispatcher_uses_the_cores_online_and_psm_offline_queues() -> None:
    settings = SidecarSettings(engine="http://127.0.0.1:8001", idle_budget_s=0.15)
    cfg = BrainConfig(None, "gittins", None, idle_budget_s=settings.idle_budget_s)
    d = build_dispatcher(settings, cfg)
    assert isinstance(d.online_queue, OrderingQueue)
    assert isinstance(d.offline_queue, PsmOfflineQueue)
    assert d.config.idle_budget_s == pytest.approx(0.15)


def test_set_ordering_rekeys_held_requests() -> None:
    q = build_online_queue("fcfs", InputLengthHistoryPredictor())
    # FCFS keys by arrival: the later request waits behind the earlier one.
    q.push(Incoming("late", RequestClass.ONLINE, 10, 50, arrival_s=2.0))
    q.push(Incoming("early", RequestClass.ONLINE, 4000, 50, arrival_s=1.0))
    assert q.head(2, 3.0) == ["early", "late"]
    # SJF keys by expected cost: the short prompt now goes first.
    q.set_ordering(sidecar_ordering("sjf"))
    assert q.head(2, 3.0) == ["late", "early"]


def test_the_dispatcher_prices_prefills_with_the_engine_long_prefill_cap() -> None:
    settings = SidecarSettings(long_prefill_token_threshold=512)
    dispatcher = build_dispatcher(settings, BrainConfig(budget_s=None, ordering="fcfs",
                                                        latency_model=None))
    assert dispatcher.limits.long_prefill_token_threshold == 512
