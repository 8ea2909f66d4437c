"""Readiness against an engine whose ``/health`` is slow, refused or failing.

A loaded host can leave one ``/health`` check unanswered; the engine stays ready until
``engine_silent_checks`` in a row go unanswered. A refused connection or an error status
turns it not ready at once. The engine is a loopback aiohttp server whose ``/health`` can be
told to stall past the check's timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from integration.helpers_procs import until
from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.engine import EngineClient, Health
from slipstream_sidecar.settings import SidecarSettings

pytestmark = pytest.mark.unit

TIMEOUT_S = 0.2  # the check's timeout in these tests
STALL_S = 1.0  # a stalled /health answers this late: past the timeout


@dataclass
class Engine:
    url: str = ""
    stall: int = 0  # the next `stall` checks answer only after STALL_S (-1: all)
    status: int = 200
    checks: int = 0


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()

    async def health(_: web.Request) -> web.Response:
        eng.checks += 1
        if eng.stall:
            eng.stall -= 1 if eng.stall > 0 else 0
            await asyncio.sleep(STALL_S)
        return web.Response(status=eng.status)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    eng.url = str(server.make_url("")).rstrip("/")
    yield eng
    await server.close()


async def metrics(_: web.Request) -> web.Response:
    return web.Response(text="", content_type="text/plain")


async def test_one_check_tells_up_silent_and_down(engine: Engine) -> None:
    client = EngineClient(engine.url, connections=2, timeout_s=5.0, health_timeout_s=TIMEOUT_S)
    await client.start()
    try:
        assert await client.health_check() is Health.UP
        engine.stall = 1
        assert await client.health_check() is Health.SILENT
        engine.status = 503
        assert await client.health_check() is Health.DOWN
        assert not await client.health()
    finally:
        await client.close()
    refused = EngineClient("http://127.0.0.1:9", connections=1, timeout_s=5.0,
                           health_timeout_s=TIMEOUT_S)
    await refused.start()
    try:
        assert await refused.health_check() is Health.DOWN
    finally:
        await refused.close()


def _sidecar(engine: Engine, silent_checks: int = 3) -> Sidecar:
    return Sidecar(SidecarSettings(engine=engine.url, ready_poll_s=0.05, kv_blocks=100,
                                   block_size=16, engine_health_timeout_s=TIMEOUT_S,
                                   engine_silent_checks=silent_checks))


async def test_a_ready_engine_stays_ready_through_fewer_silent_checks_than_the_limit(
    engine: Engine,
) -> None:
    sc = _sidecar(engine)
    await sc.start()
    try:
        assert sc.status().engine_ready
        seen: list[bool] = []
        engine.stall, before = 2, engine.checks
        # Watch every state until two checks after the stalls have answered.
        while engine.checks < before + 4:
            seen.append(sc.status().engine_ready)
            await asyncio.sleep(0.01)
        assert engine.stall == 0 and all(seen), "two silent checks turned the engine not ready"
        # The limit reached: not ready; the first answer in time makes it ready again.
        engine.stall = -1
        await until("the engine's loss", lambda: not sc.status().engine_ready)
        assert engine.checks - before >= 4 + 3
        engine.stall = 0
        await until("the engine back", lambda: sc.status().engine_ready)
    finally:
        await sc.stop()


async def test_an_error_status_turns_the_engine_not_ready_at_once(engine: Engine) -> None:
    sc = _sidecar(engine, silent_checks=1000)
    await sc.start()
    try:
        assert sc.status().engine_ready
        engine.status, before = 503, engine.checks
        await until("the engine's loss", lambda: not sc.status().engine_ready)
        assert engine.checks - before == 1
        engine.status = 200
        await until("the engine back", lambda: sc.status().engine_ready)
    finally:
        await sc.stop()


async def test_a_limit_of_one_turns_a_silent_engine_not_ready_at_once(engine: Engine) -> None:
    sc = _sidecar(engine, silent_checks=1)
    await sc.start()
    try:
        engine.stall, before = -1, engine.checks
        await until("the engine's loss", lambda: not sc.status().engine_ready)
        assert engine.checks - before == 1
    finally:
        await sc.stop()
