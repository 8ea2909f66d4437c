"""Granting an online request inside ``register`` when it fits."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar import __main__ as sidecar_main
from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


def _controller(
    max_num_seqs: int, ordering: str = "fcfs", limit: int = 32, kv_blocks: int = 100_000
) -> Controller:
    settings = SidecarSettings(max_num_seqs=max_num_seqs, kv_blocks=kv_blocks)
    dispatcher = build_dispatcher(settings, BrainConfig(None, ordering, None))
    return Controller(
        dispatcher, SidecarMetrics(), tick_s=1.0, clock=lambda: 100.0, sync_prefill_limit=limit
    )


def _on(rid: str, prompt: int = 64) -> Incoming:
    return Incoming(rid, RequestClass.ONLINE, prompt, 32, 100.0)


async def test_a_fitting_arrival_comes_back_granted_without_a_loop_turn() -> None:
    ctl = _controller(max_num_seqs=4)
    ticket = ctl.register(_on("a"), grant_now=True)
    assert ticket._fut.done() and ticket._fut.result().priority == 0
    assert ctl.in_flight["online"] == 1 and ctl.held["online"] == 0
    assert ctl.sync_grants == 1 and ctl.prefilling == 1
    plain = ctl.register(_on("b"))  # without grant_now: held until the pump's turn
    assert not plain._fut.done()
    await asyncio.sleep(0)
    assert plain._fut.done() and ctl.prefilling == 2
    ctl.progress(ticket, 1)
    assert ctl.prefilling == 1
    ctl.finished(plain, 3)  # no token seen yet on its stream: leaves prefill too
    assert ctl.prefilling == 0


async def test_an_arrival_never_overtakes_a_held_request() -> None:
    ctl = _controller(max_num_seqs=1, ordering="gittins")
    first = ctl.register(_on("a"), grant_now=True)
    assert first._fut.done()
    long = ctl.register(_on("b", prompt=4000), grant_now=True)  # no slot: held
    short = ctl.register(_on("c", prompt=10), grant_now=True)  # one is held before it
    assert not long._fut.done() and not short._fut.done()
    assert ctl.sync_grants == 1 and ctl.held["online"] == 2
    ctl.finished(first, 8)
    # The held queue keeps the ordering's order: C = O²/2 + I·O is smaller for "c".
    await asyncio.wait_for(short.granted(), 1.0)
    assert not long._fut.done()


async def test_a_fitting_arrival_behind_a_held_one_waits_for_the_pump() -> None:
    ctl = _controller(max_num_seqs=4, kv_blocks=200)
    ctl.register(_on("a"), grant_now=True)
    big = ctl.register(_on("b", prompt=4000), grant_now=True)  # more KV than there is
    small = ctl.register(_on("c", prompt=10), grant_now=True)  # fits, but "b" is held
    assert not small._fut.done() and ctl.sync_grants == 1  # no decision spent on it
    await asyncio.sleep(0)  # the pump's plan: FCFS, "b" first, and "b" does not fit
    assert not small._fut.done() and not big._fut.done() and ctl.held["online"] == 2


async def test_sync_grants_stop_while_many_requests_await_their_first_token() -> None:
    ctl = _controller(max_num_seqs=8, limit=2)
    a = ctl.register(_on("a"), grant_now=True)
    b = ctl.register(_on("b"), grant_now=True)
    c = ctl.register(_on("c"), grant_now=True)
    assert a._fut.done() and b._fut.done() and not c._fut.done()
    assert ctl.sync_grants == 2
    await asyncio.wait_for(c.granted(), 1.0)  # the coalesced pump takes it
    assert ctl.prefilling == 3
    for t in (a, b):
        ctl.progress(t, 1)
    d = ctl.register(_on("d"), grant_now=True)
    assert d._fut.done() and ctl.sync_grants == 3


async def test_offline_arrivals_are_never_granted_inside_register() -> None:
    ctl = _controller(max_num_seqs=4)
    off = ctl.register(Incoming("f", RequestClass.OFFLINE, 64, 32, 100.0), grant_now=True)
    assert not off._fut.done() and ctl.sync_grants == 0
    await asyncio.wait_for(off.granted(), 1.0)


async def test_an_arrival_decided_at_once_preempts_offline_work_in_that_decision() -> None:
    ctl = _controller(max_num_seqs=2)
    off = [ctl.register(Incoming(f"f{i}", RequestClass.OFFLINE, 64, 32, 100.0)) for i in range(2)]
    for t in off:
        await asyncio.wait_for(t.granted(), 1.0)
        ctl.progress(t, 5)
    closed: list[str] = []
    for t in off:
        t.on_abort(lambda t=t: closed.append(t.request_id))
    on = ctl.register(_on("o"), grant_now=True)
    # One decision inside register: the offline stream is told to close and the
    # online request is sent in its place, before the handler yields.
    assert len(closed) == 1 and on._fut.done() and ctl.sync_grants == 1
    victim = next(t for t in off if t.request_id == closed[0])
    assert victim.aborting and ctl.preempted_total["offline"] == 1
    ctl.aborted(victim)
    assert ctl.held["offline"] == 1 and ctl.in_flight == {"online": 1, "offline": 1}


async def test_the_sync_prefill_limit_setting_reaches_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    sidecar_main.add_arguments(parser)
    assert parser.parse_args(["--sync-prefill-limit", "5"]).sync_prefill_limit == 5
    with pytest.raises(ValidationError):
        SidecarSettings(sync_prefill_limit=-1)
    monkeypatch.setenv("SLIPSTREAM_SIDECAR_SYNC_PREFILL_LIMIT", "0")
    sc = Sidecar(SidecarSettings(state_dir=tmp_path))
    assert sc.controller.sync_prefill_limit == 0
    ticket = sc.controller.register(_on("a"), grant_now=True)  # 0: never decided at once
    assert not ticket._fut.done() and sc.controller.sync_grants == 0
    await asyncio.sleep(0)  # the coalesced pump grants it
    assert ticket._fut.done()
    sc.lengths.close()
