"""The engine server over real loopback sockets: vLLM's API, real-time stepping, aborts."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from slipstream_testbed.engine_server import RunningServer, ServeOptions, serve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

MODEL = "llama-2-7b"


async def start(**overrides: Any) -> RunningServer:
    opts = ServeOptions(port=0, scheduling_policy="priority", **overrides)
    return await serve(opts)


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    srv = await start(mean_output_tokens=20.0)
    yield srv
    await srv.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def sse_events(raw: bytes) -> list[str]:
    """Payloads of an SSE body; asserts vLLM's exact framing."""
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payloads.append(event[len("data: ") :])
    return payloads


async def stream_completion(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    async with http.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        payloads = sse_events(await resp.read())
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url + "/v1/completions", json=body) as resp:
        data: dict[str, Any] = await resp.json()
        assert resp.status == 200, data
        return data


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} {labels} not exposed")


async def wait_for_metric(
    http: aiohttp.ClientSession, url: str, name: str, value: float, **labels: str
) -> None:
    for _ in range(200):
        if await metric(http, url, name, **labels) == value:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name} never reached {value}")


async def test_streaming_completion_tokens_and_usage(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    chunks = await stream_completion(
        http,
        server.url,
        {
            "model": MODEL,
            "prompt": "Tell me about rivers",
            "max_tokens": 12,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    usage_chunk = chunks[-1]
    token_chunks = chunks[:-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    prompt_tokens = usage_chunk["usage"]["prompt_tokens"]
    assert usage_chunk["usage"]["total_tokens"] == prompt_tokens + 12
    assert [c["choices"][0]["finish_reason"] for c in token_chunks[:-1]] == [None] * (
        len(token_chunks) - 1
    )
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in token_chunks)
    assert len(text.split()) == 12
    assert all(c["usage"] is None for c in token_chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-")

    full = await complete(
        http,
        server.url,
        {"model": MODEL, "prompt": "Tell me about rivers", "max_tokens": 12, "ignore_eos": True},
    )
    assert full["choices"][0]["text"] == text  # same default seed: same text
    assert full["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 12,
        "completion_tokens": 12,
        "prompt_tokens_details": None,
    }


async def test_continuous_usage_and_request_id(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    chunks = await stream_completion(
        http,
        server.url,
        {
            "prompt": "abc",
            "max_tokens": 5,
            "ignore_eos": True,
            "request_id": "my-req",
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts)
    assert counts[-1] == 5
    assert {c["id"] for c in chunks} == {"cmpl-my-req"}


async def test_seed_changes_text_and_eos_stops_early(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    texts = set()
    reasons = set()
    for seed in range(8):
        out = await complete(http, server.url, {"prompt": "Once", "max_tokens": 200, "seed": seed})
        texts.add(out["choices"][0]["text"])
        reasons.add(out["choices"][0]["finish_reason"])
    assert len(texts) == 8
    assert "stop" in reasons  # mean output 20 tokens: EOS long before 200


async def test_resumed_request_continues_the_same_text(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    """Preempt by closing the stream, resume with prompt + text so far: identical output."""
    prompt = "Write a story about a lighthouse keeper"
    seed = 11
    total = 60
    full = await complete(http, server.url, {"prompt": prompt, "max_tokens": total, "seed": seed})
    full_text = full["choices"][0]["text"]
    full_reason = full["choices"][0]["finish_reason"]
    n_full = full["usage"]["completion_tokens"]
    assert n_full >= 6, "seed 11 must give a long enough answer for this test"

    head = ""
    n_head = 0
    async with http.post(
        server.url + "/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": total,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            head += chunk["choices"][0]["text"]
            n_head = chunk["usage"]["completion_tokens"]
            if n_head >= n_full // 2:
                break  # leaving the block closes the connection: an abort
    assert 0 < n_head < n_full
    resumed = await complete(
        http,
        server.url,
        {
            "prompt": prompt + head,
            "max_tokens": total - n_head,
            "seed": seed,
        },
    )
    assert head + resumed["choices"][0]["text"] == full_text
    assert resumed["choices"][0]["finish_reason"] == full_reason
    assert n_head + resumed["usage"]["completion_tokens"] == n_full


async def test_chat_continuation_with_continue_final_message(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    msgs = [{"role": "user", "content": "Describe the sea"}]
    body = {"messages": msgs, "max_tokens": 20, "ignore_eos": True, "seed": 3}
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        full = await resp.json()
    text = full["choices"][0]["message"]["content"]
    words = text.split(" ")  # text is " w1 w2 ...": words[0] == ""
    head = " ".join(words[:9])  # the first 8 tokens
    async with http.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [*msgs, {"role": "assistant", "content": head}],
            "add_generation_prompt": False,
            "continue_final_message": True,
            "max_tokens": 12,
            "ignore_eos": True,
            "seed": 3,
        },
    ) as resp:
        tail = await resp.json()
    assert head + tail["choices"][0]["message"]["content"] == text


async def test_stop_strings_cut_the_text(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    base = {"prompt": "List things", "max_tokens": 30, "ignore_eos": True, "seed": 5}
    text = (await complete(http, server.url, base))["choices"][0]["text"]
    stop = " " + text.split(" ")[10]
    cut = text.index(stop)
    out = await complete(http, server.url, {**base, "stop": [stop]})
    assert out["choices"][0]["text"] == text[:cut]
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["stop_reason"] == stop
    chunks = await stream_completion(http, server.url, {**base, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


async def test_client_disconnect_aborts_and_frees_the_request(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    url = server.url
    body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        await resp.content.readline()
        assert await metric(http, url, "vllm:num_requests_running") == 1.0
    await wait_for_metric(http, url, "vllm:num_requests_running", 0.0)
    await wait_for_metric(http, url, "vllm:request_success_total", 1.0, finished_reason="abort")

    # Non-streaming: the client gives up while waiting for the whole answer.
    task = asyncio.create_task(
        complete(http, url, {"prompt": "long", "max_tokens": 3000, "ignore_eos": True})
    )
    await wait_for_metric(http, url, "vllm:num_requests_running", 1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for_metric(http, url, "vllm:num_requests_running", 0.0)
    await wait_for_metric(http, url, "vllm:request_success_total", 2.0, finished_reason="abort")
    assert server.driver.num_live == 0


async def test_priority_orders_the_waiting_queue(http: aiohttp.ClientSession) -> None:
    srv = await start(max_num_seqs=2)
    try:
        order: list[str] = []

        async def run(name: str, priority: int, max_tokens: int) -> None:
            body = {
                "prompt": f"request {name}",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "priority": priority,
                "stream": True,
            }
            async with http.post(srv.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()
                order.append(name)
                await resp.read()

        blockers = [asyncio.create_task(run(f"B{i}", 0, 25)) for i in range(2)]
        await wait_for_metric(http, srv.url, "vllm:num_requests_running", 2.0)
        tasks = [asyncio.create_task(run(f"L{i}", 10, 3)) for i in range(2)]
        await wait_for_metric(http, srv.url, "vllm:num_requests_waiting", 2.0)
        tasks += [asyncio.create_task(run(f"H{i}", -5, 3)) for i in range(2)]
        await wait_for_metric(http, srv.url, "vllm:num_requests_waiting", 4.0)
        await asyncio.gather(*blockers, *tasks)
        later = order[2:]
        assert sorted(later[:2]) == ["H0", "H1"], order
        assert sorted(later[2:]) == ["L0", "L1"], order
    finally:
        await srv.close()


async def test_priority_needs_the_priority_policy(http: aiohttp.ClientSession) -> None:
    srv = await serve(ServeOptions(port=0, scheduling_policy="fcfs"))
    try:
        async with http.post(
            srv.url + "/v1/completions", json={"prompt": "x", "priority": 3}
        ) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["param"] == "priority"
        assert "Priority scheduling is not enabled" in err["message"]
        out = await complete(http, srv.url, {"prompt": "x", "max_tokens": 2, "priority": 0})
        assert out["choices"][0]["text"] or out["choices"][0]["finish_reason"] == "stop"
    finally:
        await srv.close()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "model": "nope"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "echo": True}, 400, "echo"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": [40_000]}, 400, "prompt"),
    ],
)
async def test_bad_requests_get_vllm_errors(
    server: RunningServer,
    http: aiohttp.ClientSession,
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    async with http.post(server.url + "/v1/completions", json=body) as resp:
        assert resp.status == status
        data = await resp.json()
    assert set(data) == {"error"}
    assert set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["code"] == status
    assert data["error"]["param"] == param
    assert data["error"]["message"]


async def test_metrics_have_vllm_names_and_labels(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    await complete(http, server.url, {"prompt": "warm up", "max_tokens": 3, "ignore_eos": True})
    async with http.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:iteration_tokens_total_bucket",
    ]:
        assert re.search(
            rf'^{re.escape(name)}\{{[^}}]*engine="0"[^}}]*model_name="{MODEL}"', text, re.M
        ), name
    assert await metric(http, server.url, "vllm:generation_tokens_total") == 3.0
    assert (
        await metric(http, server.url, "vllm:request_success_total", finished_reason="length")
        == 1.0
    )
    assert await metric(http, server.url, "vllm:time_to_first_token_seconds_count") == 1.0
    assert await metric(http, server.url, "vllm:inter_token_latency_seconds_count") == 2.0


async def test_shared_prefix_hits_the_prefix_cache(
    server: RunningServer, http: aiohttp.ClientSession
) -> None:
    prefix = " ".join(["the model"] * 100)  # 200 tokens, 12 full blocks
    await complete(http, server.url, {"prompt": prefix + " one", "max_tokens": 1})
    assert await metric(http, server.url, "vllm:prefix_cache_hits_total") == 0.0
    await complete(http, server.url, {"prompt": prefix + " two", "max_tokens": 1})
    assert await metric(http, server.url, "vllm:prefix_cache_hits_total") >= 192.0


async def test_tokenize_and_detokenize(server: RunningServer, http: aiohttp.ClientSession) -> None:
    url = server.url
    async with http.post(
        url + "/tokenize", json={"prompt": "Hello the model", "return_token_strs": True}
    ) as resp:
        tok = await resp.json()
    assert tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 4096
    assert "".join(tok["token_strs"]) == "<s>Hello the model"
    async with http.post(url + "/detokenize", json={"tokens": tok["tokens"][1:]}) as resp:
        assert await resp.json() == {"prompt": "Hello the model"}
    async with http.post(
        url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ) as resp:
        chat = await resp.json()
    assert chat["token_strs"] is None
    out = await complete(http, url, {"prompt": "Hello the model", "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == tok["count"]
    async with http.post(
        url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        },
    ) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == chat["count"]
    async with http.post(url + "/detokenize", json={"tokens": [-1]}) as resp:
        assert resp.status == 400


async def test_informational_endpoints(server: RunningServer, http: aiohttp.ClientSession) -> None:
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
        assert await resp.read() == b""
    async with http.get(server.url + "/version") as resp:
        assert "version" in await resp.json()
    async with http.get(server.url + "/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 4096
    async with http.get(server.url + "/nope") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == 404


async def test_many_concurrent_streams(http: aiohttp.ClientSession) -> None:
    """256 streams on one driver loop: every one completes with its tokens."""
    srv = await start()
    try:

        async def one(i: int) -> tuple[int, int]:
            chunks = await stream_completion(
                http,
                srv.url,
                {
                    "prompt": f"stream {i}",
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                },
            )
            text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
            return len(text.split()), chunks[-1]["usage"]["completion_tokens"]

        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as many:
            http = many
            results = await asyncio.gather(*(one(i) for i in range(256)))
        assert results == [(16, 16)] * 256
        assert srv.driver.stats.steps < 256 * 16  # batched: far fewer steps than tokens
    finally:
        await srv.close()
