"""The engine gets the dispatcher's priority, put in front of the client's own bytes.

The sidecar's Python side runs in this process and its compiled front as a child, in
front of a loopback engine that records every body it is sent.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from helpers_front import allowance_given, loopback, sidecar_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("tokenize", [False, True])
async def test_the_engine_gets_the_dispatchers_priority_in_the_clients_bytes(
    front_binary: Path, tokenize: bool
) -> None:
    # tokenize=False: sent on arrival inside the front's allowance; tokenize=True: the
    # engine here has no /tokenize, so the sidecar decides each and grants it.
    seen: list[bytes] = []

    async def engine_completions(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":" hi"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    engine_app = web.Application()
    engine_app.router.add_post("/v1/completions", engine_completions)
    raw = b'{"model": "m", "prompt": "Hi", "max_tokens": 1, "stream": true}'
    with_client_priority = b'{"model":"m","prompt":"Hi","max_tokens":1,"stream":true,'
    with_client_priority += b'"priority":-5}'
    async with (
        loopback(engine_app) as engine_url,
        sidecar_for(engine_url, front_binary, max_num_seqs=4, tokenize=tokenize, tick_s=1.0) as sc,
    ):
        if not tokenize:
            await allowance_given(sc)
        async with aiohttp.ClientSession() as s:
            for body in (raw, with_client_priority):
                async with s.post(
                    sc.url + "/v1/completions",
                    data=body,
                    headers={"Content-Type": "application/json"},
                ) as r:
                    assert r.status == 200
                    assert (await r.read()).endswith(b"data: [DONE]\n\n")
        ctl = sc.controller
        for _ in range(100):  # the front reports each end after its client has it
            if ctl.metrics.finished.labels("online", "ok")._value.get() == 2:
                break
            await asyncio.sleep(0.05)
    assert seen[0] == b'{"priority":0,' + raw[1:]  # spliced: the client's bytes
    assert json.loads(seen[1]) == json.loads(with_client_priority) | {"priority": 0}
    assert ctl.sync_grants == 2 and ctl.in_flight["online"] == 0
    sent = ctl.metrics.sent_on_arrival._value.get()
    assert sent == (0 if tokenize else 1)  # a client's own priority is always decided
