"""The engine model serves what vLLM serves to the sidecar's clients: ``n > 1``,
``logprobs`` in vLLM's shapes, the chat role chunk with the first output, and
``/v1/models/{id}``. The server runs in this process on loopback."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from slipstream_testbed.engine_server import RunningServer, ServeOptions, serve

pytestmark = pytest.mark.unit

MODEL = "llama-2-7b"
CHAT = [{"role": "user", "content": "Describe the sea in many words. " * 200}]


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    srv = await serve(ServeOptions(port=0))
    yield srv
    await srv.close()


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, json.loads(await r.read())


async def _events(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]


async def test_the_chat_role_chunk_comes_with_the_first_token(server: RunningServer) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 3, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/v1/chat/completions", json=body) as r,
    ):
        first = b""
        async for data, end_of_chunk in r.content.iter_chunks():
            first += data
            if end_of_chunk:
                break  # the engine's first write, whole
        await r.read()
    events = [json.loads(e[6:]) for e in first.split(b"\n\n") if e]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(events) >= 2 and events[1]["choices"][0]["delta"]["content"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_are_served(server: RunningServer, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "n": 3}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Once upon a time"
    status, doc = await _post(server.url + path, body)
    assert status == 200, doc
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert doc["usage"]["completion_tokens"] == 12
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in doc["choices"]]
    assert len(set(texts)) > 1  # each choice its own sample

    events = await _events(
        server.url + path, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert events[-1]["usage"]["completion_tokens"] == 12 and events[-1]["choices"] == []
    by_index: dict[int, list[Any]] = {}
    for ev in events[:-1]:
        (choice,) = ev["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for chunks in by_index.values():
        assert chunks[-1]["finish_reason"] == "length"
        if "chat" in path:
            assert chunks[0]["delta"] == {"role": "assistant", "content": ""}


async def test_completion_logprobs_have_vllms_shape(server: RunningServer) -> None:
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 5, "ignore_eos": True}
    status, doc = await _post(server.url + "/v1/completions", {**body, "logprobs": 2})
    assert status == 200, doc
    (choice,) = doc["choices"]
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert len(lp["tokens"]) == doc["usage"]["completion_tokens"] == 5
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for token, value, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert value <= 0 and top[token] == value and len(top) == 3
        assert max(top.values()) == value

    events = await _events(server.url + "/v1/completions", {**body, "logprobs": 0, "stream": True})
    for ev in events:
        (c,) = ev["choices"]
        assert "".join(c["logprobs"]["tokens"]) == c["text"]
        assert all(len(t) == 1 for t in c["logprobs"]["top_logprobs"])


async def test_chat_logprobs_have_vllms_shape(server: RunningServer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, doc = await _post(server.url + "/v1/chat/completions", body)
    assert status == 200, doc
    (choice,) = doc["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 4
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for e in content:
        assert list(e) == ["token", "logprob", "bytes", "top_logprobs"]
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]

    events = await _events(server.url + "/v1/chat/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    for ev in events[1:]:
        (c,) = ev["choices"]
        assert "".join(e["token"] for e in c["logprobs"]["content"]) == c["delta"]["content"]

    bad = {**body, "logprobs": False}
    status, doc = await _post(server.url + "/v1/chat/completions", bad)
    assert status == 400 and doc["error"]["param"] == "top_logprobs"


async def test_one_model_card_by_its_id(server: RunningServer) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + f"/v1/models/{MODEL}") as r:
            assert r.status == 200
            card = await r.json()
        async with s.get(server.url + "/v1/models/nope") as r:
            assert r.status == 404
            err = await r.json()
    assert card["id"] == MODEL and card["object"] == "model"
    assert err["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize(
    ("raw", "err_type"),
    [
        # vLLM 0.32: a body that fails request validation is "Bad Request" (the status
        # phrase); a refusal from the serving layer (no prompt) is "BadRequestError".
        (b"{not json", "Bad Request"),
        (json.dumps({"model": MODEL, "max_tokens": 2}).encode(), "BadRequestError"),
    ],
)
async def test_error_types_are_vllms(server: RunningServer, raw: bytes, err_type: str) -> None:
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(server.url + "/v1/completions", data=raw, headers=headers) as r,
    ):
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == err_type and err["code"] == 400
