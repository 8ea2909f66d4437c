"""Token counting and TBT sampling through the sidecar, against the streams of three engines.

The recorded streams of ``tests/fixtures/sse`` (the engine model's, vLLM's and
llm-d-inference-sim's shapes; the same files drive ``sse.go``'s and ``sse.py``'s own
tests) are replayed, event by event, by a loopback engine; the sidecar's compiled front
relays each to an aiohttp client, and its Python side's metrics must count what the
client saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers_front import allowance_given, loopback, sidecar_for

from fixtures.sse_streams import NAMES, load, stream

pytestmark = pytest.mark.integration


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
    async with loopback(app) as url:
        yield url, queued


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tokenize", [False, True])
async def test_the_sidecar_counts_tokens_and_tbt_samples_as_the_client_sees_them(
    replay: tuple[str, list[bytes]], name: str, tokenize: bool, front_binary: Path
) -> None:
    # tokenize=False: the front sends the request on arrival (its allowance);
    # tokenize=True: the replaying engine has no /tokenize, so the sidecar decides it.
    url, queued = replay
    fx = load(name)
    data = stream(fx)
    queued.append(data)
    chat = "chat" in name
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "m", "max_tokens": 16, "stream": True}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "hi"}] if chat else "hi"
    ok = {"class": "online", "outcome": "ok"}
    async with sidecar_for(url, front_binary, max_num_seqs=8, tokenize=tokenize) as sc:
        if not tokenize:
            await allowance_given(sc)
        async with aiohttp.ClientSession() as s, s.post(sc.url + path, json=body) as r:
            assert r.status == 200
            assert await r.read() == data  # passed through byte for byte
        registry = sc.metrics.registry
        for _ in range(100):  # the front reports the end after the client has the answer
            if registry.get_sample_value("slipstream_requests_finished_total", ok):
                break
            await asyncio.sleep(0.05)
    assert registry.get_sample_value("slipstream_requests_finished_total", ok) == 1
    want = fx["tokens"] if fx["usage_tokens"] is None else fx["usage_tokens"]
    assert registry.get_sample_value("slipstream_output_tokens_total", {"class": "online"}) == want
    tbt = registry.get_sample_value("slipstream_tbt_seconds_count", {"class": "online"})
    assert tbt == fx["content_events"] - 1
    ttft = registry.get_sample_value("slipstream_ttft_seconds_count", {"class": "online"})
    assert ttft == 1
    sent = registry.get_sample_value("slipstream_online_sent_on_arrival_total")
    assert sent == (0 if tokenize else 1)
