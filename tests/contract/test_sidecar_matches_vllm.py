"""Through the sidecar, clients get exactly the shapes real vLLM (v0.11.0) answers with.

The same recorded exchanges as ``test_engine_matches_vllm.py``, sent to a real
sidecar process in front of a real engine-model process: the sidecar must not
change a key, a type, the SSE framing or the finish reasons, for the endpoints
it serves (completions, chat completions, models) and for engine errors.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from shapes import assert_same_shape, assert_stream_matches, load_fixture, parse_sse

from integration.helpers_procs import Proc, engine_proc, sidecar_proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SERVED = "meta-llama/Llama-2-7b-hf"

JSON_FIXTURES = ["completions", "chat_completions", "models", "error_unknown_model",
                 "error_validation"]
STREAM_FIXTURES = [
    "completions_stream",
    "completions_stream_continuous_usage",
    "chat_completions_stream",
    "chat_completions_stream_continuous_usage",
]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    d: Path = tmp_path_factory.mktemp("contract-sidecar")
    eng = engine_proc(
        d, mean_output_tokens=1_000_000_000, extra=("--served-model-name", SERVED)
    ).start()
    sc = sidecar_proc(d, eng.url, extra=("--model", SERVED)).start()
    yield sc
    sc.stop()
    eng.stop()


def _exchange(url: str, fixture: dict[str, Any]) -> tuple[int, bytes, str]:
    method, path = fixture["endpoint"].split(" ", 1)
    body = fixture.get("request")
    data = None if method == "GET" else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


@pytest.mark.parametrize("name", JSON_FIXTURES)
def test_json_responses_match_through_the_sidecar(sidecar: Proc, name: str) -> None:
    fixture = load_fixture(name)
    status, raw, ctype = _exchange(sidecar.url, fixture)
    assert status == fixture["status"]
    assert ctype.startswith("application/json")
    assert_same_shape(fixture["response"], json.loads(raw))


@pytest.mark.parametrize("name", STREAM_FIXTURES)
def test_streams_match_through_the_sidecar(sidecar: Proc, name: str) -> None:
    fixture = load_fixture(name)
    status, raw, ctype = _exchange(sidecar.url, fixture)
    assert status == 200
    assert ctype.startswith("text/event-stream")
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert_stream_matches(fixture["sse"], chunks)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == fixture["request"]["max_tokens"]
