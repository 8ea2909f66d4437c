"""The demo's load generator: trace parsing and bounds, exact prompt lengths, SSE counting,
summaries, the loopback-only rule, and a replay against fake OpenAI streaming servers."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from slipstream_cli.loadgen import (
    LoadConfig,
    LoadGenerator,
    NotLoopbackError,
    RequestResult,
    TraceError,
    TraceRequest,
    check_loopback,
    load_trace,
    parse_azure,
    prompt_text,
    schedule,
    stream_error,
    stream_tokens,
    summarize,
)

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,0
2023-11-16 18:15:56.6805900,5000,900
"""


@pytest.mark.unit
def test_parse_rebases_and_skips_empty_rows() -> None:
    rows = parse_azure(TRACE.splitlines())
    assert [(round(a, 4), p, o) for a, p, o in rows] == [
        (0.0, 374, 44), (4.3146, 396, 109), (10.0, 5000, 900)]


@pytest.mark.unit
def test_parse_rejects_other_formats(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="header"):
        parse_azure(["timestamp,input_length\n", "0,1\n"])
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.csv", LoadConfig(model="m"))


@pytest.mark.unit
def test_schedule_applies_speedup_caps_and_bounds() -> None:
    rows = parse_azure(TRACE.splitlines())
    fast = schedule(rows, LoadConfig(model="m", speedup=2.0, max_prompt_tokens=1000,
                                     max_output_tokens=100))
    assert [(round(r.arrival_s, 4), r.prompt_tokens, r.output_tokens) for r in fast] == [
        (0.0, 374, 44), (2.1573, 396, 100), (5.0, 1000, 100)]
    assert len(schedule(rows, LoadConfig(model="m", max_requests=2))) == 2
    assert [r.arrival_s for r in schedule(rows, LoadConfig(model="m", duration_s=5.0))] == [
        0.0, pytest.approx(4.3146, abs=1e-4)]


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["http://10.0.0.1:8000", "http://localhost:8000",
                                 "http://[::1]:8000", "http://127.example.com:80"])
def test_only_loopback_targets(bad: str) -> None:
    with pytest.raises(NotLoopbackError):
        check_loopback(bad)
    with pytest.raises(NotLoopbackError):
        LoadGenerator(["http://127.1.0.5:8000", bad], [], LoadConfig(model="m"))
    assert check_loopback("http://127.1.0.5:8000") == "http://127.1.0.5:8000"


@pytest.mark.unit
@pytest.mark.parametrize("tokens", [1, 17, 1500])
def test_prompts_have_exactly_the_trace_length(tokens: int) -> None:
    from slipstream_scheduler.textgen import Tokenizer

    rng = random.Random(3)
    a, b = prompt_text(tokens, rng), prompt_text(tokens, rng)
    assert len(Tokenizer().encode(a)) == tokens
    assert a != b or tokens == 1  # no shared prefixes between requests


@pytest.mark.unit
def test_stream_tokens_counts_text_chunks_only() -> None:
    chunk = {"choices": [{"index": 0, "text": " the"}]}
    assert stream_tokens(b"data: " + json.dumps(chunk).encode() + b"\n") == 1
    assert stream_tokens(b'data: {"choices": [{"text": ""}]}\n') == 0
    assert stream_tokens(b'data: {"choices": [{"delta": {"content": "x"}}]}') == 1
    assert stream_tokens(b'data: {"choices": [], "usage": {"completion_tokens": 3}}') is None
    assert stream_tokens(b"data: [DONE]\n") is None
    assert stream_tokens(b"\n") is None
    assert stream_tokens(b": keep-alive\n") is None


def _result(i: int, ok: bool, ttft: float | None, gaps: tuple[float, ...]) -> RequestResult:
    return RequestResult(i, "t", float(i), float(i) + 0.5 * i, ok, 200 if ok else 503, ttft,
                         gaps, len(gaps) + (1 if ttft is not None else 0))


@pytest.mark.unit
def test_summary_and_attainment() -> None:
    results = [_result(0, True, 0.1, (0.01, 0.02)), _result(1, True, 0.3, (0.2,)),
               _result(2, False, None, ())]
    s = summarize(results)
    assert (s.sent, s.ok, s.failed, s.output_tokens) == (3, 2, 1, 5)
    assert s.ttft_mean_s == pytest.approx(0.2)
    assert s.tbt_mean_s == pytest.approx((0.01 + 0.02 + 0.2) / 3)
    assert s.max_issue_lag_s == pytest.approx(1.0)
    assert s.attainment(results, ttft_s=0.2, tbt_s=0.05) == {
        "ttft": pytest.approx(0.5), "tbt": pytest.approx(2 / 3)}
    empty = summarize([])
    assert empty.ttft_p99_s is None and empty.sent == 0


# ---------------------------------------------------------------------------- real sockets


class FakeServer:
    """An OpenAI completions endpoint that streams ``max_tokens`` chunks ``gap_s`` apart."""

    def __init__(self, fail: bool = False, error_after: int | None = None) -> None:
        self.bodies: list[dict[str, object]] = []
        self.fail = fail
        self.error_after = error_after  # send an error event after this many chunks

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.05)
        for i in range(int(body["max_tokens"])):
            if i == self.error_after:
                error = {"error": {"message": "engine gone", "code": 503}}
                await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                return response
            if i:
                await asyncio.sleep(0.01)
            chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


async def _start(server: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def servers() -> AsyncIterator[tuple[list[FakeServer], list[str]]]:
    fakes = [FakeServer(), FakeServer(), FakeServer(fail=True)]
    started = [await _start(f) for f in fakes]
    yield fakes, [url for _, url in started]
    for runner, _ in started:
        await runner.cleanup()


@pytest.mark.integration
async def test_replay_round_robin_measures_ttft_and_gaps(
    servers: tuple[list[FakeServer], list[str]],
) -> None:
    fakes, urls = servers
    requests = [TraceRequest(0.02 * i, 10 + i, 3 + i % 2) for i in range(9)]
    gen = LoadGenerator(urls, requests, LoadConfig(model="llama-2-7b", max_requests=9))
    summary = await gen.run()
    assert [len(f.bodies) for f in fakes] == [3, 3, 3]
    assert (summary.sent, summary.ok, summary.failed) == (9, 6, 3)
    body = fakes[0].bodies[0]
    assert body["model"] == "llama-2-7b" and body["stream"] is True
    assert body["ignore_eos"] is True and body["max_tokens"] == 3
    for result in gen.results:
        if result.target == urls[2]:
            assert not result.ok and result.status == 503 and "overloaded" in result.error
            continue
        assert result.ok and result.done
        assert result.ended_s >= result.sent_s + (result.ttft_s or 0.0)
        want = requests[result.index].output_tokens
        assert result.output_tokens == want and len(result.gaps_s) == want - 1
        assert result.ttft_s is not None and result.ttft_s >= 0.05  # the server's first sleep
    assert summary.output_tokens == sum(r.output_tokens for r in requests
                                        if requests.index(r) % 3 != 2)


@pytest.mark.integration
async def test_stop_and_bounds_end_the_replay(
    servers: tuple[list[FakeServer], list[str]],
) -> None:
    fakes, urls = servers
    far = [TraceRequest(0.0, 5, 2), TraceRequest(0.0, 5, 2), TraceRequest(3600.0, 5, 2)]
    gen = LoadGenerator(urls[:1], far, LoadConfig(model="m"))
    task = asyncio.create_task(gen.run())
    while len(gen.results) < 2:
        await asyncio.sleep(0.01)
    gen.stop()
    summary = await asyncio.wait_for(task, timeout=30)
    assert summary.sent == 2 and len(fakes[0].bodies) == 2


@pytest.mark.unit
def test_stream_error_events_are_told_from_tokens() -> None:
    assert stream_error(b'data: {"error": {"message": "engine gone"}}\n')
    assert stream_error(b'data: {"object": "error", "message": "x"}\n')
    assert not stream_error(b'data: {"choices": [{"text": "error"}]}\n')
    assert not stream_error(b"data: [DONE]\n")
    assert not stream_error(b"data: {not json error\n")


@pytest.mark.integration
async def test_a_stream_that_fails_after_its_200_is_a_visible_failure() -> None:
    fake = FakeServer(error_after=2)
    runner, url = await _start(fake)
    try:
        gen = LoadGenerator([url], [TraceRequest(0.0, 5, 6)], LoadConfig(model="m"))
        summary = await gen.run()
    finally:
        await runner.cleanup()
    (result,) = gen.results
    assert summary.failed == 1 and not result.ok and not result.done
    assert result.status == 200 and result.output_tokens == 2
    assert "engine gone" in result.error
