"""``bench sidecar --reference-proxy``: the compiled reference hop streams, and passes errors on.

The reference proxy is the floor the bench reads the sidecar against, so it
must be a fair one: each piece of a streamed answer forwarded while the engine
is still generating (not buffered to the end), the answer and an engine error
unchanged.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import aiohttp
import pytest

from slipstream_cli.benches.sidecar import _build_refproxy, _free_port, _start_refproxy
from slipstream_testbed.engine_server import ServeOptions, serve

# A cold Go build cache compiles net/http first: about 25 s on an idle 2-core host.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_RUNNING = re.compile(rb"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)


async def _running(http: aiohttp.ClientSession, engine: str) -> float:
    async with http.get(engine + "/metrics") as resp:
        m = _RUNNING.search(await resp.read())
    assert m is not None
    return float(m.group(1))


async def test_reference_proxy_streams_while_the_engine_generates(tmp_path: Path) -> None:
    binary = await asyncio.to_thread(_build_refproxy, tmp_path)
    srv = await serve(ServeOptions(port=0))
    proc: subprocess.Popen[bytes] | None = None
    try:
        port = _free_port()
        proc = await asyncio.to_thread(
            _start_refproxy, binary, srv.url, port, tmp_path / "refproxy.log"
        )
        proxy = f"http://127.0.0.1:{port}"
        body = {"model": "llama-2-7b", "prompt": "Name three rivers.", "seed": 7, "stream": True}
        async with aiohttp.ClientSession() as http:
            streamed = {"max_tokens": 64, "ignore_eos": True} | body
            async with http.post(proxy + "/v1/completions", json=streamed) as resp:
                assert resp.status == 200
                first = await resp.content.readuntil(b"\n\n")
                # The first event came through while the engine still runs the request.
                running_at_first = await _running(http, srv.url)
                rest = await resp.content.read()
            async with http.post(srv.url + "/v1/completions", json=streamed) as resp:
                direct = await resp.read()
            bad = {"model": "no-such-model", "prompt": "x"}
            async with http.post(proxy + "/v1/completions", json=bad) as resp:
                proxied_error = (resp.status, await resp.read())
            async with http.post(srv.url + "/v1/completions", json=bad) as resp:
                direct_error = (resp.status, await resp.read())
    finally:
        if proc is not None:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 10)
        await srv.close()
    assert first.startswith(b"data: {")
    assert running_at_first >= 1
    events = (first + rest).split(b"\n\n")
    assert events[-2] == b"data: [DONE]"
    assert len(events) == len(direct.split(b"\n\n"))  # the same answer, event for event
    assert proxied_error[0] == direct_error[0] == 404
    assert proxied_error[1] == direct_error[1]


def test_reference_proxy_build_names_the_missing_toolchain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no go here
    with pytest.raises(RuntimeError, match="go toolchain"):
        _build_refproxy(tmp_path)
