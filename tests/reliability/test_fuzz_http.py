"""Garbage on the HTTP ports of a real sidecar and a real engine model (hypothesis).

What is sent, over plain sockets so nothing is cleaned up on the way: random
bytes; random request lines and headers; random JSON values and near-valid
completion/chat bodies whose fields take wrong types, huge integers, NaN and
unknown models; wrong content types; bodies cut short of their
``Content-Length``; a body one byte over the 64 MiB limit; JSON nested
100,000 deep; and slowloris-style connections that never finish their
headers, held open while real traffic goes on.

What must hold: every exchange ends within a bound (a response or a close,
never a hang); a well-formed HTTP request always gets an HTTP answer; no
answer is a 5xx (the server did not crash inside a handler) and every 4xx
body is JSON with an ``error.message``; both processes are alive and serve a
real completion afterwards; neither log holds a traceback.

Deliberately left out: the gRPC port (``test_fuzz_grpc.py``).
"""

from __future__ import annotations

import json
import math
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rel_helpers import (
    RawResult,
    RelStack,
    fuzz_examples,
    fuzz_random,
    get_status,
    http_request,
    raw_exchange,
    start_rel_stack,
)

from integration.helpers_procs import MODEL

pytestmark = pytest.mark.integration

BOUND_S = 30.0  # no exchange may take longer (a streamed answer of <= 16 tokens included)
# aiohttp logs a refused malformed request (and a client that vanished mid-body) at ERROR with a
# traceback; those are the protocol layer doing its job. Any other exception in a log is a bug.
PROTOCOL_EXCEPTIONS = (
    "BadHttpMessage", "InvalidURLError", "LineTooLong", "BadStatusLine", "InvalidHeader",
    "ContentLengthError", "TransferEncodingError", "ConnectionResetError", "ModuleNotFoundError",
)
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Message)):", re.M)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelStack]:
    s = start_rel_stack(tmp_path_factory.mktemp("fuzz-http"), sidecar_seqs=16)
    yield s
    s.stop()


def _ports(stack: RelStack) -> dict[str, int]:
    return {"sidecar": stack.sidecar.port, "engine": stack.engine.port}


def fuzz_settings(default: int) -> settings:
    return settings(
        max_examples=fuzz_examples(default),
        deadline=None,
        database=None,
        derandomize=not fuzz_random(),
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def check_answer(res: RawResult, what: str, *, must_answer: bool) -> None:
    assert not res.hung, f"{what}: no answer and no close within {BOUND_S}s"
    if must_answer:
        assert res.status is not None, f"{what}: closed without an HTTP answer: {res.data[:200]!r}"
    if res.status is None:
        return
    assert res.status < 500, f"{what}: server error {res.status}: {res.data[:600]!r}"
    if res.status >= 400 and res.body and b"application/json" in res.data.split(b"\r\n\r\n")[0]:
        doc = json.loads(res.body)
        assert isinstance(doc.get("error", {}).get("message"), str), res.body[:300]


def _dumps(value: Any) -> bytes:
    # allow_nan: Python's json accepts NaN/Infinity on the way in, so servers must cope
    return json.dumps(value, allow_nan=True).encode()


# -- strategies ---------------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                  max_size=4),
    max_leaves=12,
)
weird_ints = st.integers(-5, 8) | st.integers(2**31, 2**70) | st.integers(-(2**70), -(2**31))
weird_numbers = weird_ints | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=5)
prompt_values = (
    st.text(max_size=120)
    | st.lists(st.integers(-(2**40), 2**40), max_size=8)
    | st.lists(st.text(max_size=10), max_size=3)
    | st.none()
    | st.integers()
)
message_values = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "", "x"]),
             "content": st.text(max_size=80) | st.none() | st.integers() | json_values}
        ),
        max_size=3,
    ),
    json_values,
)
optional_fields = st.fixed_dictionaries(
    {},
    optional={
        "stream": st.booleans() | st.text(max_size=3) | st.integers(),
        "priority": weird_ints,
        "temperature": weird_numbers,
        "seed": weird_ints,
        "n": weird_ints,
        "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | st.integers(),
        "logprobs": weird_ints | st.booleans(),
        "echo": st.booleans(),
        "min_tokens": weird_ints,
        "stream_options": json_values,
        "max_completion_tokens": weird_numbers,
    },
)
models = st.sampled_from([MODEL, MODEL, "gpt-4o", "", "../etc/passwd"]) | st.none() | json_scalars


@st.composite
def near_valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": draw(models), "max_tokens": draw(weird_numbers)}
    if chat:
        body["messages"] = draw(message_values)
    else:
        body["prompt"] = draw(prompt_values)
    body.update(draw(optional_fields))
    mt = body.get("max_tokens")
    if isinstance(mt, int) and 8 < mt < 2**31:
        body["max_tokens"] = 8  # keep valid generations short
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


content_types = st.sampled_from([
    "application/json", "application/json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz", "application/json; charset=utf-16", "",
])
paths = st.sampled_from([
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models",
    "/health", "/ready", "/metrics", "/v1/embeddings", "/%00", "/" + "a" * 5000, "/../../etc",
])
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "BREW"])


# -- tests --------------------------------------------------------------------------------------


@fuzz_settings(60)
@given(target=st.sampled_from(["sidecar", "engine"]), req=near_valid_request(),
       ctype=content_types)
def test_near_valid_bodies_get_a_clear_answer(
    stack: RelStack, target: str, req: tuple[str, dict[str, Any]], ctype: str
) -> None:
    path, body = req
    payload = http_request("POST", path, _dumps(body), {"Content-Type": ctype} if ctype else {})
    res = raw_exchange(_ports(stack)[target], payload, bound_s=BOUND_S, read_all=True)
    check_answer(res, f"{target} {path} {body!r:.300}", must_answer=True)


@fuzz_settings(50)
@given(target=st.sampled_from(["sidecar", "engine"]), path=paths, value=json_values,
       ctype=content_types)
def test_random_json_anywhere(
    stack: RelStack, target: str, path: str, value: Any, ctype: str
) -> None:
    payload = http_request("POST", path, _dumps(value), {"Content-Type": ctype} if ctype else {})
    res = raw_exchange(_ports(stack)[target], payload, bound_s=BOUND_S, read_all=True)
    check_answer(res, f"{target} {path}", must_answer=True)


@fuzz_settings(60)
@given(target=st.sampled_from(["sidecar", "engine"]), data=st.binary(max_size=2048))
def test_random_bytes_are_refused_or_closed(stack: RelStack, target: str, data: bytes) -> None:
    res = raw_exchange(_ports(stack)[target], data, bound_s=BOUND_S, half_close=True)
    check_answer(res, f"{target} raw {data[:80]!r}", must_answer=False)


@fuzz_settings(50)
@given(
    target=st.sampled_from(["sidecar", "engine"]),
    method=methods,
    path=paths | st.text(max_size=30).map(lambda t: "/" + t.replace(" ", "")),
    headers=st.dictionaries(
        st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
                min_size=1, max_size=20),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200),
        max_size=6,
    ),
    body=st.binary(max_size=512),
    cut=st.integers(0, 512),
)
def test_mangled_requests_and_short_bodies(
    stack: RelStack, target: str, method: str, path: str, headers: dict[str, str], body: bytes,
    cut: int,
) -> None:
    """Random methods/paths/headers; bodies cut short of their Content-Length, then EOF."""
    headers = {k: v for k, v in headers.items() if k.lower() not in {"host", "connection"}}
    headers.pop("Content-Length", None)
    headers["Content-Length"] = str(len(body))
    try:
        head = http_request(method, path, b"", headers)
    except UnicodeEncodeError:
        return
    payload = head.rsplit(b"\r\n\r\n", 1)[0] + b"\r\n\r\n" + body[:cut]
    res = raw_exchange(_ports(stack)[target], payload, bound_s=BOUND_S, half_close=True)
    check_answer(res, f"{target} {method} {path[:60]} cut {cut}/{len(body)}", must_answer=False)


@pytest.mark.parametrize("target", ["sidecar", "engine"])
def test_pathological_bodies(stack: RelStack, target: str) -> None:
    port = _ports(stack)[target]
    json_ct = {"Content-Type": "application/json"}
    # One byte over the 64 MiB body limit: refused with 413, not buffered without end.
    big = b'{"prompt": "' + b"a" * (64 * 1024 * 1024) + b'"}'
    res = raw_exchange(port, http_request("POST", "/v1/completions", big, json_ct),
                       bound_s=60, read_all=True)
    check_answer(res, f"{target} 64 MiB body", must_answer=True)
    assert res.status == 413, res.data[:300]
    # A prompt far past the model's context: a 4xx naming the length, not a crash.
    long_prompt = {"model": MODEL, "prompt": "word " * 20_000, "max_tokens": 4}
    res = raw_exchange(port, http_request("POST", "/v1/completions", _dumps(long_prompt), json_ct),
                       bound_s=BOUND_S, read_all=True)
    check_answer(res, f"{target} long prompt", must_answer=True)
    assert res.status == 400 and b"context length" in res.body, res.body[:300]
    # Non-finite numbers where floats are expected.
    for value in (math.nan, math.inf, -math.inf):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": value}
        res = raw_exchange(port, http_request("POST", "/v1/completions", _dumps(body), json_ct),
                           bound_s=BOUND_S, read_all=True)
        check_answer(res, f"{target} temperature={value}", must_answer=True)


@pytest.mark.parametrize("target", [
    "sidecar", "engine",
])
def test_deeply_nested_json_is_a_400(tmp_path: Path, target: str) -> None:
    """JSON nested 100,000 deep, on its own stack (its failure must not taint the shared logs)."""
    own = start_rel_stack(tmp_path)
    try:
        port = _ports(own)[target]
        deep = b"[" * 100_000 + b"]" * 100_000
        res = raw_exchange(
            port,
            http_request("POST", "/v1/completions", deep, {"Content-Type": "application/json"}),
            bound_s=BOUND_S, read_all=True,
        )
        assert own.healthy()
    finally:
        own.stop()
    check_answer(res, f"{target} deep JSON", must_answer=True)
    assert 400 <= (res.status or 0) < 500


def test_slow_clients_do_not_starve_others(stack: RelStack) -> None:
    """64 connections per server stop mid-headers or mid-body; real traffic still flows."""
    held: list[socket.socket] = []
    partials = [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",
        b"GET /health HTTP/1.1\r\nHo",
        b"POS",
    ]
    try:
        for port in _ports(stack).values():
            for i in range(64):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(partials[i % len(partials)])
                held.append(s)
        time.sleep(0.5)
        assert stack.healthy(), "a real completion must get through while slow clients wait"
        assert get_status(stack.sidecar.url + "/ready") == 200
    finally:
        for s in held:
            s.close()
    assert stack.healthy()


def test_processes_survive_and_logs_stay_clean(stack: RelStack) -> None:
    """Runs last in this module: after everything above, both still serve and logged no trace."""
    assert stack.healthy()
    for proc in (stack.sidecar, stack.engine):
        text = proc.log_path.read_text(errors="replace")
        raised = set(EXCEPTION_LINE.findall(text))
        unexpected = {e for e in raised if e.rsplit(".", 1)[-1] not in PROTOCOL_EXCEPTIONS}
        assert not unexpected, f"{proc.name} logged {unexpected}:\n{text[-3000:]}"
        assert "internal error serving" not in text
