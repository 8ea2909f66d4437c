"""An online stream cut by a dying engine ends with an error event, never silently."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from helpers_procs import MODEL, engine_proc, sidecar_proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_engine_death_mid_stream_reaches_the_client_as_an_error(tmp_path: Path) -> None:
    eng = engine_proc(tmp_path).start()
    sc = sidecar_proc(tmp_path, eng.url).start()
    conn: http.client.HTTPConnection | None = None
    try:
        host, port = sc.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.read1(65536)
        assert first.startswith(b"data: ")
        eng.kill()  # SIGKILL while the answer is streaming
        rest = b""
        try:
            while chunk := resp.read1(65536):
                rest += chunk
        except (http.client.IncompleteRead, ConnectionError):
            pytest.fail("the sidecar dropped the client's connection instead of reporting")
        events = [e for e in (first + rest).split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] != b"data: [DONE]", "a cut answer must not look complete"
        error = json.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == 502 and "incomplete" in error["message"]
    finally:
        if conn is not None:
            conn.close()
        sc.stop()
        eng.stop()
