"""An offline request whose stream ends after its last token but before its finish chunk.

vLLM rejects ``max_tokens: 0`` with a 400, so a request that already received all
``max_tokens`` tokens must be written as finished (``finish_reason: "length"``), not
continued. A stream that breaks earlier is continued with the tokens still owed.

The engine here is a small aiohttp app on loopback that streams like vLLM with
``continuous_usage_stats`` and can drop the connection after a given token; it answers
``max_tokens < 1`` the way vLLM's request validation does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.brain import BrainConfig, build_dispatcher
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.settings import SidecarSettings
from slipstream_sidecar.shards import EngineWatch, ShardRunner, ShardSpec, ShardState

pytestmark = pytest.mark.unit

MODEL = "m"


class BreakingEngine:
    """Streams one word per token and then a finish chunk; the first streams may stop early."""

    def __init__(self, cut_after: list[int], *, hang_before_done: bool = False) -> None:
        self.cut_after = list(cut_after)  # per completion request: tokens sent before the drop
        self.bodies: list[dict[str, Any]] = []
        self.hang_before_done = hang_before_done  # the first stream stalls before [DONE]
        self.finish_sent = asyncio.Event()

    async def tokenize(self, request: web.Request) -> web.Response:
        doc = await request.json()
        return web.json_response(
            {"tokens": list(range(len(doc["prompt"].split()))), "max_model_len": 4096}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        n = body["max_tokens"]
        if not isinstance(n, int) or n < 1:
            return web.json_response(
                {"error": {"message": "max_tokens: Input should be greater than or equal to 1",
                           "type": "Bad Request", "param": "max_tokens", "code": 400}},
                status=400,
            )
        cut = self.cut_after.pop(0) if self.cut_after else None
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prompt_tokens = len(body["prompt"].split())
        for i in range(n + 1):  # n tokens, then the finish chunk (no text, no new token)
            done = min(i + 1, n)
            chunk = {
                "id": f"cmpl-{len(self.bodies)}", "object": "text_completion", "created": 1,
                "model": MODEL,
                "choices": [{"index": 0, "text": f" w{i}" if i < n else "",
                             "finish_reason": "length" if i == n else None}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                          "total_tokens": prompt_tokens + done},
            }
            if cut is not None and i == cut:
                # The connection drops before this chunk: i tokens arrived, no finish, no [DONE].
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.finish_sent.set()
        if self.hang_before_done and len(self.bodies) == 1:
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.02)  # until the sidecar closes the stream
            return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def run_one_line(
    tmp_path: Path,
    engine: Any,
    max_tokens: int,
    *,
    max_num_seqs: int = 4,
    meanwhile: Callable[[Controller], Awaitable[None]] | None = None,
    url: str = "/v1/completions",
    line_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one batch line (a completion of "one two three" unless ``line_body``) through a
    ShardRunner against ``engine``'s routes (``engine.routes()``, else tokenize and
    completions) on loopback, and return its output record."""
    app = web.Application()
    routes = getattr(engine, "routes", None)
    for path, handler in (routes() if routes is not None else (
            ("/tokenize", engine.tokenize), ("/v1/completions", engine.completions))):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = EngineClient(f"http://127.0.0.1:{port}", connections=4, timeout_s=30)
    await client.start()
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({
        "custom_id": "only", "method": "POST", "url": url,
        "body": line_body or {"model": MODEL, "prompt": "one two three", "max_tokens": max_tokens},
    }) + "\n")
    settings = SidecarSettings(max_num_seqs=max_num_seqs, kv_blocks=10_000)
    metrics = SidecarMetrics()
    controller = Controller(
        build_dispatcher(settings, BrainConfig(None, "fcfs", None)), metrics, tick_s=0.05
    )
    watch = EngineWatch()
    watch.set(True)

    async def health_probe() -> None:  # the sidecar's readiness loop, at a test's pace
        while True:
            await asyncio.sleep(0.05)
            watch.set(True)

    probe = asyncio.get_running_loop().create_task(health_probe())
    spec = ShardSpec(
        shard_id="s0", job_namespace="ns", job_name="j", model=MODEL,
        input_uri=f"file://{inp}", line_start=0, line_end=1,
        output_uri=f"file://{tmp_path}/out.jsonl", error_uri=f"file://{tmp_path}/err.jsonl",
    )
    shard = ShardRunner(
        spec, controller=controller, engine=client, metrics=metrics, watch=watch, window=1,
        max_retries=2, staging_dir=None, storage_roots=(),
    )
    try:
        shard.start()
        if meanwhile is not None:
            await asyncio.wait_for(meanwhile(controller), 20)
        await asyncio.wait_for(shard.wait(), 20)
    finally:
        probe.cancel()
        await client.close()
        await runner.cleanup()
    assert shard.snapshot().state is ShardState.SUCCEEDED
    err = tmp_path / "err.jsonl"
    assert not err.exists() or not err.read_text(), err.read_text()
    (line,) = (tmp_path / "out.jsonl").read_text().splitlines()
    record: dict[str, Any] = json.loads(line)
    return record


async def test_all_tokens_then_a_broken_stream_is_finished_not_continued(
    tmp_path: Path,
) -> None:
    engine = BreakingEngine(cut_after=[8])  # all 8 tokens arrive; the finish chunk does not
    engine_bodies = engine.bodies
    record = await run_one_line(tmp_path, engine, max_tokens=8)
    body = record["response"]["body"]
    assert len(engine_bodies) == 1, [b["max_tokens"] for b in engine_bodies]
    assert body["choices"][0]["text"] == "".join(f" w{i}" for i in range(8))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8


async def test_a_stream_broken_early_is_continued_for_the_tokens_still_owed(
    tmp_path: Path,
) -> None:
    engine = BreakingEngine(cut_after=[3])  # 3 of 8 arrive; the continuation asks for 5
    record = await run_one_line(tmp_path, engine, max_tokens=8)
    assert [b["max_tokens"] for b in engine.bodies] == [8, 5]
    assert engine.bodies[1]["prompt"] == "one two three w0 w1 w2"
    body = record["response"]["body"]
    assert body["choices"][0]["text"] == " w0 w1 w2" + "".join(f" w{i}" for i in range(5))
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"


async def test_a_preemption_after_the_finish_chunk_does_not_continue_the_request(
    tmp_path: Path,
) -> None:
    """The abort lands between the finish chunk and [DONE]: the request is complete."""
    engine = BreakingEngine(cut_after=[], hang_before_done=True)

    async def online_arrives(controller: Controller) -> None:
        await engine.finish_sent.wait()
        await asyncio.sleep(0.2)  # the sidecar has read the finish chunk
        # One slot: the online arrival preempts the offline request still streaming.
        ticket = controller.register(Incoming("on-1", RequestClass.ONLINE, 16, 4, controller.now()))
        await asyncio.wait_for(ticket.granted(), 5)
        assert controller.preempted_total["offline"] == 1
        controller.finished(ticket, 4)

    record = await run_one_line(
        tmp_path, engine, max_tokens=6, max_num_seqs=1, meanwhile=online_arrives
    )
    assert [b["max_tokens"] for b in engine.bodies] == [6]
    body = record["response"]["body"]
    assert body["choices"][0]["text"] == "".join(f" w{i}" for i in range(6))
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
