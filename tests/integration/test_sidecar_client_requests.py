"""What an OpenAI client sends, through the sidecar to the engine model on loopback:
every prompt form, the routes vLLM serves, clean errors. The engine model and the
sidecar's Python side run in this process, its compiled front as a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers_front import sidecar_for

from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.proxy import Proxy
from slipstream_testbed.engine_server import RunningServer, ServeOptions
from slipstream_testbed.engine_server import serve as serve_engine

pytestmark = pytest.mark.integration

MODEL = "llama-2-7b"


@dataclass
class Pair:
    engine: str  # the engine's base URL
    sidecar: str  # the sidecar's base URL
    proxy: Proxy


@contextlib.asynccontextmanager
async def _sidecar(
    engine_url: str, binary: Path, *, tokenize: bool = True
) -> AsyncIterator[tuple[str, Proxy]]:
    async with sidecar_for(engine_url, binary, tokenize=tokenize) as sc:
        yield sc.url, sc.proxy


@pytest.fixture
async def pair(front_binary: Path) -> AsyncIterator[Pair]:
    eng: RunningServer = await serve_engine(ServeOptions(port=0, scheduling_policy="priority"))
    try:
        async with _sidecar(eng.url, front_binary) as (url, proxy):
            yield Pair(eng.url, url, proxy)
    finally:
        await eng.close()


async def _call(
    method: str, url: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, data=data, headers=headers) as r,
    ):
        text = await r.read()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def _outcomes_now(proxy: Proxy) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in proxy.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "slipstream_requests_finished_total":
                out[sample.labels["outcome"]] = sample.value
    return out


async def _outcomes(proxy: Proxy, expected: dict[str, float]) -> dict[str, float]:
    """The finished-request counts once they are ``expected``, or as they are after 5 s: the
    front reports a request's end after its client has the answer."""
    for _ in range(100):
        got = _outcomes_now(proxy)
        if got == expected:
            break
        await asyncio.sleep(0.05)
    return got


@pytest.mark.parametrize(
    "prompt", [[1, 2, 3], ["a b"], [[1, 2, 3]], ["one two", "three"], [[5, 6], [7]]]
)
@pytest.mark.parametrize("stream", [False, True])
async def test_token_id_and_list_prompts_are_served(pair: Pair, prompt: Any, stream: bool) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": stream}
    direct = await _call("POST", pair.engine + "/v1/completions", body)
    via = await _call("POST", pair.sidecar + "/v1/completions", body)
    assert via[0] == direct[0], via
    if direct[0] == 200:
        assert await _outcomes(pair.proxy, {"ok": 1.0}) == {"ok": 1.0}


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [([1, 2, 3], 3), ([[1, 2, 3]], 3), ([[5, 6], [7]], 3)],
)
async def test_prompt_tokens_are_counted_in_every_form(
    pair: Pair, prompt: Any, expected: int
) -> None:
    client = EngineClient(pair.engine, connections=2, timeout_s=10.0)
    await client.start()
    try:
        assert (await client.tokenize({"model": MODEL, "prompt": prompt})).count == expected
        one = await client.tokenize({"model": MODEL, "prompt": "a b"})
        two = await client.tokenize({"model": MODEL, "prompt": "c"})
        both = await client.tokenize({"model": MODEL, "prompt": ["a b", "c"]})
        assert both.count == one.count + two.count
        assert (await client.tokenize({"model": MODEL, "prompt": ["a b"]})).tokens == one.tokens
    finally:
        await client.close()


async def test_a_tokenize_refusal_is_not_the_clients_answer(pair: Pair) -> None:
    # /tokenize refuses the unknown model; the client gets what the engine says of its
    # request (the same 404 as without the sidecar), counted as the client's error.
    body = {"model": "no-such-model", "prompt": "Hi", "max_tokens": 2}
    direct = await _call("POST", pair.engine + "/v1/completions", body)
    via = await _call("POST", pair.sidecar + "/v1/completions", body)
    assert via == direct
    assert direct[0] == 404
    assert await _outcomes(pair.proxy, {"client_error": 1.0}) == {"client_error": 1.0}


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusals_count_as_client_errors(pair: Pair, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": "many", "stream": stream}
    status, doc = await _call("POST", pair.sidecar + "/v1/completions", body)
    assert status == 400 and doc["error"]["code"] == 400
    assert await _outcomes(pair.proxy, {"client_error": 1.0}) == {"client_error": 1.0}


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]"])
async def test_the_sidecars_own_errors_have_vllms_type(pair: Pair, raw: bytes) -> None:
    direct = await _call("POST", pair.engine + "/v1/completions", raw=raw)
    via = await _call("POST", pair.sidecar + "/v1/completions", raw=raw)
    assert via[0] == direct[0] == 400
    assert via[1]["error"]["type"] == direct[1]["error"]["type"] == "Bad Request"
    assert set(via[1]["error"]) == {"message", "type", "param", "code"}
    assert await _outcomes(pair.proxy, {"client_error": 1.0}) == {"client_error": 1.0}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello world"}),
        ("POST", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 15043]}),
        ("POST", "/tokenize", {"model": "nope", "prompt": "x"}),
        ("GET", "/version", None),
        ("GET", f"/v1/models/{MODEL}", None),
        ("GET", "/v1/models/no-such-model", None),
    ],
)
async def test_vllms_other_routes_pass_through(
    pair: Pair, method: str, path: str, body: Any
) -> None:
    direct = await _call(method, pair.engine + path, body)
    via = await _call(method, pair.sidecar + path, body)
    if path.startswith("/v1/models/") and direct[0] == 200:
        for doc in (direct[1], via[1]):
            doc["permission"][0].pop("id")
    assert via == direct
    assert isinstance(direct[1], dict)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_INTERNALS = ("ClientConnectorError", "ConnectionKey", "Errno", "127.0.0.1", "POST /")


@pytest.mark.parametrize("tokenize", [True, False])
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
        (
            "POST",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        ),
        ("POST", "/tokenize", {"model": MODEL, "prompt": "Hi"}),
        ("GET", "/v1/models", None),
        ("GET", "/version", None),
    ],
)
async def test_an_engine_that_is_down_gets_a_clean_503(
    tokenize: bool, method: str, path: str, body: Any, front_binary: Path
) -> None:
    engine = f"http://127.0.0.1:{_closed_port()}"
    async with _sidecar(engine, front_binary, tokenize=tokenize) as (url, _):
        status, doc = await _call(method, url + path, body)
    assert status == 503
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
    assert err["message"] == "the inference engine is not reachable (connection refused)"
    assert not any(word in err["message"] for word in _INTERNALS)


@pytest.mark.parametrize(
    ("extra", "sequences"),
    [({"prompt": "a b"}, 1), ({"prompt": "a b", "n": 3}, 3), ({"prompt": ["a", "b"], "n": 2}, 4)],
)
async def test_the_dispatcher_sizes_every_sequence(
    pair: Pair, extra: dict[str, Any], sequences: int
) -> None:
    # n choices of each prompt: the engine runs that many sequences of max_tokens each.
    raw = json.dumps({"model": MODEL, "max_tokens": 8, **extra}).encode()
    adm = pair.proxy.inspect(raw, 0.0)
    assert not isinstance(adm, web.Response)
    assert await pair.proxy.measure(adm) is None
    assert adm.max_tokens == 8 * sequences
