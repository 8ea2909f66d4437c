"""Token counting and TBT sampling against the streams of three engines.

``tests/fixtures/sse`` holds one streamed answer per file, written from the shapes
of the engine model, vLLM and llm-d-inference-sim. The same files drive the
compiled front's counter (``sidecar/front/sse_fixtures_test.go``). Here they go
through :class:`EventScanner` and, end to end, through the proxy in this process
in front of a loopback server that replays the stream, event by event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.proxy import Proxy, ProxyState, serve
from slipstream_sidecar.settings import SidecarSettings
from slipstream_sidecar.sse import EventScanner

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parents[1] / "fixtures" / "sse"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


def _stream(fx: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + ev.encode() + b"\n\n" for ev in fx["events"])


def test_there_are_streams_of_three_engines() -> None:
    assert {n.split("_")[0] for n in NAMES} >= {"engine", "vllm", "llm"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_the_scanner_counts_each_recorded_stream(name: str, step: int) -> None:
    fx = _load(name)
    stream = _stream(fx)
    sc = EventScanner()
    events = []
    for i in range(0, len(stream), step):
        events += sc.feed(stream[i : i + step])
    assert sum(e.tokens for e in events) == fx["tokens"]
    assert sum(e.content for e in events) == fx["content_events"]
    usage = [e.usage["completion_tokens"] for e in events if e.usage is not None]
    assert usage == ([] if fx["usage_tokens"] is None else [fx["usage_tokens"]])
    assert events[-1].done


@pytest.fixture
async def replay() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A loopback engine answering every generation request with the next queued stream."""
    queued: list[bytes] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for event in queued.pop(0).split(b"\n\n")[:-1]:
            await resp.write(event + b"\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    runner, port = await serve(app, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}", queued
    await runner.cleanup()


@pytest.mark.parametrize("name", NAMES)
async def test_the_proxy_counts_tokens_and_tbt_samples_as_the_client_sees_them(
    replay: tuple[str, list[bytes]], name: str
) -> None:
    url, queued = replay
    fx = _load(name)
    stream = _stream(fx)
    queued.append(stream)
    settings = SidecarSettings(max_num_seqs=8, kv_blocks=100_000)
    metrics = SidecarMetrics()
    ctl = Controller(build_dispatcher(settings, BrainConfig(None, "fcfs", None)), metrics)
    client = EngineClient(url, connections=4, timeout_s=30.0)
    await client.start()
    ctl.start()
    proxy = Proxy(client, ctl, metrics, ProxyState(), tokenize=False)
    runner, port = await serve(proxy.app(), "127.0.0.1", 0)
    chat = "chat" in name
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": 16, "stream": True}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "hi"}] if chat else "hi"
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(f"http://127.0.0.1:{port}{path}", json=body) as r,
        ):
            assert r.status == 200
            assert await r.read() == stream  # passed through byte for byte
    finally:
        await runner.cleanup()
        await ctl.stop()
        await client.close()
    want = fx["tokens"] if fx["usage_tokens"] is None else fx["usage_tokens"]
    assert metrics.output_tokens.labels("online")._value.get() == want
    tbt = metrics.registry.get_sample_value("slipstream_tbt_seconds_count", {"class": "online"})
    assert tbt == fx["content_events"] - 1
    ttft = metrics.registry.get_sample_value("slipstream_ttft_seconds_count", {"class": "online"})
    assert ttft == 1
