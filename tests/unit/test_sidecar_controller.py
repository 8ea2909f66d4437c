"""The asyncio shell around the real Dispatcher: holding, granting, preempting, resuming."""

from __future__ import annotations

import asyncio

import pytest

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _controller(max_num_seqs: int, ordering: str = "fcfs") -> tuple[Controller, FakeClock]:
    settings = SidecarSettings(max_num_seqs=max_num_seqs, kv_blocks=100_000)
    dispatcher = build_dispatcher(settings, BrainConfig(None, ordering, None))
    clock = FakeClock()
    return Controller(dispatcher, SidecarMetrics(), tick_s=1.0, clock=clock), clock


def _req(rid: str, cls: RequestClass, prompt: int = 64, max_tokens: int = 32) -> Incoming:
    return Incoming(rid, cls, prompt, max_tokens, 100.0)


async def test_online_requests_are_held_while_the_engine_is_full() -> None:
    ctl, _ = _controller(max_num_seqs=2)
    tickets = [ctl.register(_req(f"o{i}", RequestClass.ONLINE)) for i in range(3)]
    await asyncio.sleep(0)
    granted = [t for t in tickets if t._fut.done()]
    assert len(granted) == 2
    assert ctl.held["online"] == 1 and ctl.in_flight["online"] == 2
    ctl.finished(granted[0], 10)
    grant = await asyncio.wait_for(tickets[2].granted(), 1.0)
    assert grant.priority == 0 and grant.resume_from_tokens == 0
    assert ctl.in_flight["online"] == 2 and ctl.held["online"] == 0


async def test_online_arrival_preempts_offline_and_it_resumes_with_its_tokens() -> None:
    ctl, _ = _controller(max_num_seqs=2)
    off = [ctl.register(_req(f"f{i}", RequestClass.OFFLINE)) for i in range(2)]
    grants = [await asyncio.wait_for(t.granted(), 1.0) for t in off]
    assert all(g.priority > 0 for g in grants)
    closed: list[str] = []
    for t in off:
        t.on_abort(lambda t=t: closed.append(t.request_id))
        ctl.progress(t, 5)
    on = ctl.register(_req("o", RequestClass.ONLINE))
    await asyncio.sleep(0)
    assert len(closed) == 1, "one offline request is aborted to make room"
    victim = next(t for t in off if t.request_id == closed[0])
    assert victim.aborting
    ctl.aborted(victim)  # the shell closed the stream
    await asyncio.wait_for(on.granted(), 1.0)
    assert ctl.preempted_total["offline"] == 1
    ctl.finished(on, 3)
    resumed = await asyncio.wait_for(victim.granted(), 1.0)
    assert resumed.resume_from_tokens == 5


async def test_a_cancelled_held_request_leaves_the_dispatcher() -> None:
    ctl, _ = _controller(max_num_seqs=1)
    first = ctl.register(_req("a", RequestClass.ONLINE))
    second = ctl.register(_req("b", RequestClass.ONLINE))
    await asyncio.wait_for(first.granted(), 1.0)
    ctl.failed(second)  # the client went away while held
    assert ctl.held["online"] == 0
    assert ctl.dispatcher.stats().online_queued == 0
    ctl.finished(first, 1)
    assert ctl.in_flight["online"] == 0


async def test_gittins_ordering_is_served_by_the_core_registry() -> None:
    ctl, _ = _controller(max_num_seqs=1, ordering="gittins")
    first = ctl.register(_req("a", RequestClass.ONLINE))
    await asyncio.wait_for(first.granted(), 1.0)
    ctl.register(_req("b", RequestClass.ONLINE, prompt=4000))
    short = ctl.register(_req("c", RequestClass.ONLINE, prompt=10))
    ctl.finished(first, 8)
    # With equal predicted lengths, C = O²/2 + I·O is smaller for the short prompt.
    grant = await asyncio.wait_for(short.granted(), 1.0)
    assert grant.resume_from_tokens == 0
