"""The engine server answers with the shapes real vLLM (v0.11.0) answers with.

Every fixture in ``tests/contract/vllm/`` is one recorded exchange; this test
sends the fixture's request to the engine server (serving the fixture's model
name) and compares status, keys, nesting, JSON types, SSE framing, chunk
sequence and finish reasons (``shapes.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from shapes import (
    FINISH_REASONS,
    assert_same_shape,
    assert_stream_matches,
    load_fixture,
    parse_sse,
)

from slipstream_testbed.engine_server import RunningServer, ServeOptions, serve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SERVED = "meta-llama/Llama-2-7b-hf"

JSON_FIXTURES = [
    "completions",
    "chat_completions",
    "tokenize",
    "tokenize_no_strs",
    "tokenize_chat",
    "detokenize",
    "models",
    "version",
    "error_unknown_model",
    "error_validation",
]
STREAM_FIXTURES = [
    "completions_stream",
    "completions_stream_continuous_usage",
    "chat_completions_stream",
    "chat_completions_stream_continuous_usage",
]


async def _server(policy: str) -> RunningServer:
    return await serve(
        ServeOptions(
            port=0,
            scheduling_policy=policy,  # type: ignore[arg-type]
            served_model_names=(SERVED,),
            mean_output_tokens=1e9,
        )
    )


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    srv = await _server("priority")
    yield srv
    await srv.close()


async def _exchange(
    session: aiohttp.ClientSession, url: str, fixture: dict[str, Any]
) -> tuple[int, bytes, str]:
    method, path = fixture["endpoint"].split(" ", 1)
    body = fixture["request"]
    async with session.request(method, url + path, json=body) as resp:
        return resp.status, await resp.read(), resp.headers.get("Content-Type", "")


@pytest.mark.parametrize("name", JSON_FIXTURES)
async def test_json_responses_match(server: RunningServer, name: str) -> None:
    fixture = load_fixture(name)
    async with aiohttp.ClientSession() as session:
        status, raw, ctype = await _exchange(session, server.url, fixture)
    assert status == fixture["status"]
    assert ctype.startswith("application/json")
    assert_same_shape(fixture["response"], json.loads(raw))


@pytest.mark.parametrize("name", STREAM_FIXTURES)
async def test_streams_match(server: RunningServer, name: str) -> None:
    fixture = load_fixture(name)
    async with aiohttp.ClientSession() as session:
        status, raw, ctype = await _exchange(session, server.url, fixture)
    assert status == 200
    assert ctype.startswith("text/event-stream")
    payloads = parse_sse(raw)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert_stream_matches(fixture["sse"], chunks)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == fixture["request"]["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_priority_error_matches() -> None:
    fixture = load_fixture("error_priority_without_priority_policy")
    srv = await _server("fcfs")
    try:
        async with aiohttp.ClientSession() as session:
            status, raw, _ = await _exchange(session, srv.url, fixture)
    finally:
        await srv.close()
    assert status == fixture["status"]
    body = json.loads(raw)
    assert_same_shape(fixture["response"], body)
    assert body["error"]["message"] == fixture["response"]["error"]["message"]


def test_fixtures_are_self_consistent() -> None:
    """Guard the fixtures themselves: framing, finish reasons, usage arithmetic."""
    for name in STREAM_FIXTURES:
        fixture = load_fixture(name)
        sse = fixture["sse"]
        assert sse[-1] == "[DONE]"
        raw = "".join(f"data: {json.dumps(c) if c != '[DONE]' else c}\n\n" for c in sse)
        assert len(parse_sse(raw)) == len(sse)
        for chunk in sse[:-1]:
            for choice in chunk["choices"]:
                assert choice["finish_reason"] in FINISH_REASONS | {None}
    for name in ["completions", "chat_completions"]:
        usage = load_fixture(name)["response"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
