"""Relaying a streamed answer: a slow client slows the engine's stream, a gone one aborts it.

The sidecar's Python side runs in this process and its compiled front as a child, in
front of a real aiohttp server standing in for the engine; the client is aiohttp's, over
loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from helpers_front import loopback, sidecar_for

from slipstream_sidecar.controller import Controller

pytestmark = pytest.mark.integration

EVENT = b"data: " + b"x" * (16 * 1024 - 8) + b"\n\n"  # 16 KiB
EVENTS = 3072  # 48 MiB: more than the kernel buffers on the way can hold


@dataclass
class Engine:
    url: str = ""
    written: int = 0  # events the engine's writes have returned from
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    slow: bool = False


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(EVENTS):
                await resp.write(EVENT)
                eng.written += 1
                if eng.slow:
                    await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            eng.gone.set()
            raise
        eng.finished.set()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with loopback(app) as url:
        eng.url = url
        yield eng


@contextlib.asynccontextmanager
async def _sidecar(
    engine: Engine, binary: Path, max_num_seqs: int
) -> AsyncIterator[tuple[str, Controller]]:
    """The sidecar in front of ``engine``: (its completions URL, its controller)."""
    async with sidecar_for(
        engine.url, binary, max_num_seqs=max_num_seqs, tokenize=False, tick_s=1.0
    ) as sc:
        yield sc.url + "/v1/completions", sc.controller


@pytest.fixture
async def proxied(engine: Engine, front_binary: Path) -> AsyncIterator[tuple[str, Controller]]:
    async with _sidecar(engine, front_binary, max_num_seqs=8) as sidecar:
        yield sidecar


BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}


async def test_a_client_that_stops_reading_stops_the_engines_stream(
    engine: Engine, proxied: tuple[str, Controller]
) -> None:
    url, ctl = proxied
    async with aiohttp.ClientSession() as s, s.post(url, json=BODY) as r:
        assert r.status == 200
        await asyncio.sleep(1.0)  # not reading: the sidecar must stop reading the engine
        assert not engine.finished.is_set()
        stalled_at = engine.written
        assert stalled_at < EVENTS
        got = await r.read()
    assert len(got) == EVENTS * len(EVENT) + len(b"data: [DONE]\n\n")
    assert got.endswith(EVENT + b"data: [DONE]\n\n")
    await asyncio.wait_for(engine.finished.wait(), 10)
    assert ctl.in_flight["online"] == 0


async def test_a_client_gone_mid_stream_aborts_the_engines_request(
    engine: Engine, proxied: tuple[str, Controller]
) -> None:
    url, ctl = proxied
    engine.slow = True
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=BODY)
        await r.content.readexactly(3 * len(EVENT))
        r.close()  # the client hangs up
    await asyncio.wait_for(engine.gone.wait(), 10)
    assert engine.written < EVENTS
    for _ in range(100):
        if ctl.in_flight["online"] == 0:
            break
        await asyncio.sleep(0.05)
    assert ctl.in_flight["online"] == 0
    assert ctl.metrics.finished.labels("online", "cancelled")._value.get() == 1


async def test_a_held_request_whose_client_hangs_up_leaves_the_queue(
    engine: Engine, front_binary: Path
) -> None:
    engine.slow = True
    async with (
        _sidecar(engine, front_binary, max_num_seqs=1) as (url, ctl),
        aiohttp.ClientSession() as s,
        s.post(url, json=BODY) as first,
    ):
        await first.content.readexactly(len(EVENT))  # the one seat is taken
        waiting = asyncio.ensure_future(s.post(url, json=BODY))
        for _ in range(100):
            if ctl.held["online"] == 1:
                break
            await asyncio.sleep(0.02)
        assert ctl.held["online"] == 1
        waiting.cancel()  # the second client hangs up while held
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        for _ in range(100):
            if ctl.held["online"] == 0:
                break
            await asyncio.sleep(0.02)
        assert ctl.held["online"] == 0
        assert ctl.in_flight["online"] == 1  # the first stream goes on
        assert not engine.gone.is_set()
