"""Skipping /tokenize only when the prompt length cannot change what the dispatcher submits."""

from __future__ import annotations

import asyncio

import pytest

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.engine import EngineClient, TokenRatio, prompt_chars
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.proxy import Proxy, ProxyState
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit


def _controller(max_num_seqs: int, kv_blocks: int = 100_000) -> Controller:
    settings = SidecarSettings(max_num_seqs=max_num_seqs, kv_blocks=kv_blocks)
    dispatcher = build_dispatcher(settings, BrainConfig(None, "fcfs", None))
    return Controller(dispatcher, SidecarMetrics(), tick_s=1.0, clock=lambda: 100.0)


def _proxy(ctl: Controller) -> Proxy:
    engine = EngineClient("http://127.0.0.1:9", connections=1, timeout_s=1.0)  # never called
    state = ProxyState()
    return Proxy(engine, ctl, ctl.metrics, state)


def test_prompt_chars_counts_plain_text_only() -> None:
    assert prompt_chars({"prompt": "hello"}) == 5
    assert prompt_chars({"prompt": [1, 2, 3]}) is None
    assert prompt_chars({"prompt": ["a", "b"]}) is None
    chat = {"messages": [{"role": "user", "content": "abcd"}, {"role": "user", "content": "ef"}]}
    one = prompt_chars({"messages": [{"role": "user", "content": ""}]})
    assert one is not None and prompt_chars(chat) == 6 + 2 * one
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert prompt_chars(parts) is None


def test_token_ratio_learns_the_engines_ratio() -> None:
    r = TokenRatio(initial=0.25)
    for _ in range(50):
        r.observe(1000, 400)
    assert r.ratio == pytest.approx(0.4, rel=0.02)
    assert r.estimate(500) == 200
    r.observe(0, 10)  # ignored
    assert r.estimate(0) == 1


async def test_estimates_only_after_calibration_and_while_everything_held_fits() -> None:
    ctl = _controller(max_num_seqs=2)
    proxy = _proxy(ctl)
    body = {"prompt": "x" * 400, "max_tokens": 8}
    assert proxy._estimate_now(body, 8) is None  # not calibrated yet
    for _ in range(4):
        proxy.ratio.observe(400, 100)
    assert proxy._estimate_now(body, 8) == (100, 8)
    # One online request held and one in flight: a third does not fit two slots.
    t1 = ctl.register(Incoming("a", RequestClass.ONLINE, 100, 8, 100.0))
    assert proxy._estimate_now(body, 8) == (100, 8)  # held one + this one fit
    ctl._pump()
    assert t1._fut.done() and ctl.in_flight["online"] == 1
    ctl.register(Incoming("b", RequestClass.ONLINE, 100, 8, 100.0))
    assert proxy._estimate_now(body, 8) is None


async def test_no_estimate_for_token_ids_unknown_length_or_a_pending_tokenize() -> None:
    ctl = _controller(max_num_seqs=8)
    proxy = _proxy(ctl)
    for _ in range(4):
        proxy.ratio.observe(400, 100)
    assert proxy._estimate_now({"prompt": [1, 2, 3], "max_tokens": 8}, 8) is None
    # No max_tokens and no known max_model_len: only /tokenize tells the default.
    assert proxy._estimate_now({"prompt": "abc"}, None) is None
    proxy.state.max_model_len = 4096
    assert proxy._estimate_now({"prompt": "x" * 400}, None) == (100, 3996)
    proxy._exact_pending = 1  # an earlier request is being tokenized: do not overtake it
    assert proxy._estimate_now({"prompt": "abc", "max_tokens": 8}, 8) is None


async def test_no_estimate_when_kv_is_short() -> None:
    ctl = _controller(max_num_seqs=64, kv_blocks=10)
    proxy = _proxy(ctl)
    for _ in range(4):
        proxy.ratio.observe(400, 100)
    assert proxy._estimate_now({"prompt": "x" * 400, "max_tokens": 8}, 8) == (100, 8)
    assert proxy._estimate_now({"prompt": "x" * 4000, "max_tokens": 8}, 8) is None


async def test_a_burst_beyond_one_decisions_window_is_granted_without_waiting_for_a_tick() -> None:
    ctl = _controller(max_num_seqs=512)  # tick_s=1.0 and no ticker started: pumps only
    lookahead = ctl.dispatcher.config.lookahead
    tickets = [
        ctl.register(Incoming(f"o{i}", RequestClass.ONLINE, 100, 8, 100.0))
        for i in range(3 * lookahead + 5)
    ]
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(t._fut.done() for t in tickets)
    assert ctl.held["online"] == 0 and ctl.in_flight["online"] == len(tickets)
