"""The sidecar's HTTP port in the test's own process: its compiled front in front of the
sidecar's Python side (controller, proxy, metrics), which the test can read.

``slipstream-front`` runs as a child process (``front.start_front``, as ``slipstream
sidecar`` starts it), built once per session by the ``front_binary`` fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.front import CompiledFront, start_front
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.proxy import Proxy, ProxyState
from slipstream_sidecar.settings import SidecarSettings


@dataclass(frozen=True)
class InProcess:
    """A running sidecar: its front (a child process) and its Python side (here)."""

    front: CompiledFront
    proxy: Proxy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.front.port}"

    @property
    def controller(self) -> Controller:
        return self.proxy.controller

    @property
    def metrics(self) -> SidecarMetrics:
        return self.proxy.metrics


@contextlib.asynccontextmanager
async def sidecar_for(
    engine_url: str,
    binary: Path,
    *,
    max_num_seqs: int = 64,
    tokenize: bool = True,
    tick_s: float = 0.005,
) -> AsyncIterator[InProcess]:
    """A sidecar (FCFS, no budget, a KV pool nothing fills) in front of ``engine_url``,
    its front on a free loopback port."""
    settings = SidecarSettings(max_num_seqs=max_num_seqs, kv_blocks=100_000)
    metrics = SidecarMetrics()
    dispatcher = build_dispatcher(settings, BrainConfig(None, "fcfs", None))
    ctl = Controller(dispatcher, metrics, tick_s=tick_s)
    client = EngineClient(engine_url, connections=8, timeout_s=30.0)
    await client.start()
    ctl.start()
    proxy = Proxy(client, ctl, metrics, ProxyState(), tokenize=tokenize)
    try:
        front = await start_front(
            proxy,
            proxy.app(),
            engine=engine_url,
            host="127.0.0.1",
            port=0,
            binary=binary,
            engine_connections=8,
        )
        try:
            yield InProcess(front, proxy)
        finally:
            await front.stop()
    finally:
        await ctl.stop()
        await client.close()


@contextlib.asynccontextmanager
async def loopback(app: web.Application) -> AsyncIterator[str]:
    """``app`` (a stand-in engine) served on a free loopback port: its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# The front reads control frames on a goroutine of its own, within microseconds of
# their writing; a request sent in the same instant could still beat the frame.
_FRONT_READS_S = 0.1


async def allowance_given(sidecar: InProcess, timeout_s: float = 5.0) -> tuple[int, int]:
    """The first allowance the sidecar sent its front that lets a request through on
    arrival (the front then sends such requests without asking), once the front has
    had time to read it; fails after ``timeout_s``."""
    for _ in range(round(timeout_s / 0.02)):
        given = sidecar.front.link.allowance
        if given is not None and given[0] > 0:
            await asyncio.sleep(_FRONT_READS_S)
            return given
        await asyncio.sleep(0.02)
    raise AssertionError(f"no allowance after {timeout_s} s: {sidecar.front.link.allowance}")
