"""The sidecar's OpenAI HTTP port against a real engine model process (loopback)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_procs import MODEL, Proc, engine_proc, sidecar_proc

from slipstream_sidecar.metrics import EPP_FAMILIES

pytestmark = pytest.mark.integration

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def _normalise(body: bytes) -> bytes:
    """Ids and timestamps differ between two runs of the same request; nothing else may."""
    return _VOLATILE.sub(rb'"\1":_', body)


def post(url: str, body: dict[str, object]) -> tuple[int, bytes, str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _has_uvloop() -> bool:
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


# The [sidecar] extra installs uvloop, which "auto" then runs on; "asyncio" is the
# fallback. Either way the compiled front serves the port, with the same bytes.
@pytest.fixture(scope="module", params=["auto", "asyncio"])
def procs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[Proc, Proc]]:
    d = tmp_path_factory.mktemp(f"proxy-{request.param}")
    extra = ["--event-loop", request.param]
    expected = "uvloop" if request.param == "auto" and _has_uvloop() else "asyncio"
    ready = f"loop={expected} engine=".encode()
    eng = engine_proc(d).start()
    sc = sidecar_proc(d, eng.url, extra=extra).start()
    deadline = time.monotonic() + 10
    while b"sidecar ready" not in sc.log_path.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready in sc.log_path.read_bytes()
    yield eng, sc
    sc.stop()
    eng.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_answers_are_the_engines_bytes(procs: tuple[Proc, Proc], path: str, stream: bool) -> None:
    eng, sc = procs
    body: dict[str, object] = {"model": MODEL, "max_tokens": 12, "seed": 7, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Name three primary colors."}]
    else:
        body["prompt"] = "Name three primary colors."
    direct = post(eng.url + path, body)
    proxied = post(sc.url + path, body)
    assert proxied[0] == direct[0] == 200
    assert proxied[2] == direct[2]
    assert _normalise(proxied[1]) == _normalise(direct[1])
    if stream:
        assert proxied[1].endswith(b"data: [DONE]\n\n")


def test_client_priority_is_ignored(procs: tuple[Proc, Proc]) -> None:
    eng, sc = procs
    # The engine would refuse this priority; the sidecar drops it and sets its own.
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "priority": "urgent!"}
    assert post(eng.url + "/v1/completions", body)[0] == 400
    status, raw, _ = post(sc.url + "/v1/completions", body)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 4


def test_engine_errors_pass_through(procs: tuple[Proc, Proc]) -> None:
    eng, sc = procs
    body = {"model": "no-such-model", "prompt": "Hi", "max_tokens": 4}
    direct = post(eng.url + "/v1/completions", body)
    proxied = post(sc.url + "/v1/completions", body)
    assert proxied[0] == direct[0] and proxied[0] >= 400
    assert json.loads(proxied[1]) == json.loads(direct[1])


def test_models_health_and_metrics(procs: tuple[Proc, Proc]) -> None:
    eng, sc = procs
    via, direct = get(sc.url + "/v1/models"), get(eng.url + "/v1/models")
    assert via[0] == direct[0] == 200
    assert _normalise(via[1]) == _normalise(direct[1])
    assert get(sc.url + "/health")[0] == 200
    assert get(sc.url + "/ready")[0] == 200
    post(sc.url + "/v1/completions",
         {"model": MODEL, "prompt": "Count to ten", "max_tokens": 6, "stream": True})
    text = get(sc.url + "/metrics")[1].decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    # The sidecar's own series, and the engine's vllm: ones an endpoint picker reads
    # (test_sidecar_epp_metrics.py).
    assert names and all(n.startswith("slipstream_") or n in EPP_FAMILIES for n in names)
    m = re.search(r'slipstream_ttft_seconds_count\{class="online"\} (\S+)', text)
    assert m and float(m.group(1)) >= 1
    m = re.search(r'slipstream_tbt_seconds_count\{class="online"\} (\S+)', text)
    assert m and float(m.group(1)) >= 5
    assert "vllm:num_requests_waiting{" in text


def test_ready_follows_the_engine(tmp_path: Path) -> None:
    eng = engine_proc(tmp_path, name="engine-ready").start()
    sc = sidecar_proc(tmp_path, eng.url, name="sidecar-ready").start()
    try:
        # /health answers before the first engine check has finished on a loaded host.
        deadline = time.monotonic() + 10
        while get(sc.url + "/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert get(sc.url + "/ready")[0] == 200
        eng.kill()
        deadline = time.monotonic() + 10
        while get(sc.url + "/ready")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert get(sc.url + "/ready")[0] == 503
        assert get(sc.url + "/health")[0] == 200  # liveness: the sidecar itself is fine
        status, raw, _ = post(sc.url + "/v1/completions",
                              {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 503 and b"error" in raw
        eng.start()
        deadline = time.monotonic() + 10
        while get(sc.url + "/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert get(sc.url + "/ready")[0] == 200
    finally:
        sc.stop()
        eng.stop()
