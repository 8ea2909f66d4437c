"""The compiled front (``slipstream-front``) with a real engine model and sidecar.

What ``test_sidecar_proxy.py`` (the routes and the bytes) does not reach: clients
that leave mid-stream or while held, Drain, the two processes living and dying
together, and a missing executable. The front here is the session's own build
(``front_binary``), passed with ``--front-binary``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers_procs import MODEL, Proc, bearer, control_stub, engine_proc, sidecar_proc

from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_testbed.cluster import pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "front-test-token"


def _stack(
    tmp: Path, binary: Path, *, seqs: int = 64, extra: tuple[str, ...] = ()
) -> tuple[Proc, Proc]:
    (tmp / "token").write_text(TOKEN)
    eng = engine_proc(tmp).start()
    sc = sidecar_proc(
        tmp,
        eng.url,
        token_file=tmp / "token",
        max_num_seqs=seqs,
        extra=["--front-binary", str(binary), *extra],
    ).start()
    return eng, sc


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert m is not None, series
    return float(m.group(1))


def _engine_running(url: str) -> float:
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", _metrics(url), re.M)
    assert m is not None
    return float(m.group(1))


def _wait_for(check: object, what: str, timeout_s: float = 20.0) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _open_stream(url: str, max_tokens: int = 4000) -> tuple[http.client.HTTPConnection, bytes]:
    """A long streamed request; returns its connection once the answer has started."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp.read1(65536)


def _front_pid(sidecar_pid: int) -> int:
    children = Path(f"/proc/{sidecar_pid}/task/{sidecar_pid}/children").read_text().split()
    for pid in map(int, children):
        if "slipstream-front" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    pytest.fail(f"no slipstream-front child of {sidecar_pid}: {children}")


def test_a_client_leaving_mid_stream_aborts_the_engine_request(
    tmp_path: Path, front_binary: Path
) -> None:
    eng, sc = _stack(tmp_path, front_binary)
    try:
        conn, first = _open_stream(sc.url)
        assert first.startswith(b"data: ")
        assert _engine_running(eng.url) == 1
        conn.close()  # the client goes away mid-answer
        _wait_for(lambda: _engine_running(eng.url) == 0, "the engine to abort the request")
        _wait_for(
            lambda: _value(_metrics(sc.url),
                           'slipstream_requests_finished_total{class="online",outcome="cancelled"}')
            == 1,
            "the sidecar to count the request cancelled",
        )
        text = _metrics(sc.url)
        assert _value(text, 'slipstream_in_flight_requests{class="online"}') == 0
        assert _value(text, 'slipstream_ttft_seconds_count{class="online"}') == 1
        assert _value(text, 'slipstream_output_tokens_total{class="online"}') == 0
    finally:
        sc.stop()
        eng.stop()


def test_a_held_request_whose_client_leaves_leaves_the_queue(
    tmp_path: Path, front_binary: Path
) -> None:
    eng, sc = _stack(tmp_path, front_binary, seqs=1)
    try:
        running, _ = _open_stream(sc.url)  # takes the sidecar's only slot
        host, port = sc.url.removeprefix("http://").split(":")
        held = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": MODEL, "prompt": "a short one", "max_tokens": 4, "stream": True}
        held.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        _wait_for(
            lambda: _value(_metrics(sc.url), 'slipstream_queued_requests{class="online"}') == 1,
            "the second request to be held",
        )
        held.close()
        _wait_for(
            lambda: _value(_metrics(sc.url), 'slipstream_queued_requests{class="online"}') == 0,
            "the held request to leave the queue",
        )
        running.close()
        _wait_for(
            lambda: _value(_metrics(sc.url), 'slipstream_in_flight_requests{class="online"}')
            == 0,
            "the running request to end",
        )
        text = _metrics(sc.url)
        assert _value(
            text, 'slipstream_requests_finished_total{class="online",outcome="cancelled"}'
        ) == 2
        assert _value(text, 'slipstream_requests_admitted_total{class="online"}') == 1
    finally:
        sc.stop()
        eng.stop()


def test_drain_refuses_new_requests_at_the_front(tmp_path: Path, front_binary: Path) -> None:
    eng, sc = _stack(tmp_path, front_binary)
    try:
        ch, stub = control_stub(sc.extra_ports["grpc"])
        with ch:  # type: ignore[attr-defined]
            r = stub.Drain(pb.DrainRequest(timeout_s=5), metadata=bearer(TOKEN))  # type: ignore[attr-defined]
            assert r.drained
        req = urllib.request.Request(
            sc.url + "/v1/completions",
            data=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 503
        assert json.loads(info.value.read())["error"]["message"] == "the sidecar is draining"
        info.value.close()
    finally:
        sc.stop()
        eng.stop()


def test_stopping_the_sidecar_stops_its_front(tmp_path: Path, front_binary: Path) -> None:
    eng, sc = _stack(tmp_path, front_binary)
    try:
        assert sc.popen is not None
        front = _front_pid(sc.popen.pid)
        sc.stop()
        assert sc.popen.returncode == 0
        _wait_for(lambda: not pid_alive(front, front_binary), "the front to exit", timeout_s=10)
    finally:
        sc.stop()
        eng.stop()


def test_a_killed_front_takes_the_sidecar_down(tmp_path: Path, front_binary: Path) -> None:
    eng, sc = _stack(tmp_path, front_binary)
    try:
        assert sc.popen is not None
        os.kill(_front_pid(sc.popen.pid), signal.SIGKILL)
        # The pod restarts the container; a sidecar without its front must not linger.
        assert sc.popen.wait(timeout=20) == 1
        assert "the compiled front exited" in sc.log_tail()
    finally:
        sc.stop()
        eng.stop()


def test_a_killed_sidecar_takes_its_front_down(tmp_path: Path, front_binary: Path) -> None:
    eng, sc = _stack(tmp_path, front_binary)
    try:
        assert sc.popen is not None
        front = _front_pid(sc.popen.pid)
        sc.kill()  # SIGKILL: no cleanup; the front sees its control socket close
        _wait_for(lambda: not pid_alive(front, front_binary), "the front to exit", timeout_s=10)
    finally:
        eng.stop()


def test_a_missing_front_executable_is_one_line_naming_how_to_build_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-front"
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream_cli.main", "sidecar",
         "--front-binary", str(missing), "--http-port", "0", "--grpc-port", "0",
         "--state-dir", str(tmp_path / "state")],
        check=False, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(missing) in proc.stderr and "make front" in proc.stderr
