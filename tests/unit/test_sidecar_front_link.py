"""The Python end of the compiled front's control socket (``front.FrontLink``).

A real sidecar object (dispatcher, controller, metrics) and a real Unix socket
pair: the test plays the front, writing frames (some a byte at a time) and
reading the sidecar's answers.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.front import FrontLink
from slipstream_sidecar.settings import SidecarSettings

HEADER = struct.Struct("<cII")
ALLOWANCE = struct.Struct("<IIIdIi")


@dataclass
class Front:
    """The test's end of the socket pair."""

    sock: socket.socket
    link: FrontLink
    sidecar: Sidecar
    allowances: list[tuple[int, int, int, float, int, int]] = field(default_factory=list)

    async def send(self, kind: bytes, rid: int, payload: bytes, *, bytewise: bool = False) -> None:
        frame = HEADER.pack(kind, rid, len(payload)) + payload
        loop = asyncio.get_running_loop()
        if bytewise:
            for i in range(len(frame)):
                await loop.sock_sendall(self.sock, frame[i : i + 1])
                await asyncio.sleep(0)
        else:
            await loop.sock_sendall(self.sock, frame)

    async def receive(self) -> tuple[bytes, int, bytes]:
        """The next frame that is not an allowance (those are kept in ``allowances``)."""
        while True:
            kind, rid, payload = await self.receive_any()
            if kind != b"C":
                return kind, rid, payload
            self.allowances.append(ALLOWANCE.unpack(payload))

    async def receive_any(self) -> tuple[bytes, int, bytes]:
        loop = asyncio.get_running_loop()
        head = await self._exactly(loop, HEADER.size)
        kind, rid, n = HEADER.unpack(head)
        return kind, rid, await self._exactly(loop, n)

    async def next_allowance(self) -> tuple[int, int, int, float, int, int]:
        kind, _, payload = await self.receive_any()
        assert kind == b"C"
        return ALLOWANCE.unpack(payload)

    async def _exactly(self, loop: asyncio.AbstractEventLoop, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await asyncio.wait_for(loop.sock_recv(self.sock, n - len(data)), 5)
            assert chunk, "the sidecar closed the control socket"
            data += chunk
        return data

    def metric(self, series: str) -> float:
        self.sidecar.controller.refresh_gauges()
        text = self.sidecar.metrics.render().decode()
        m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
        assert m is not None, series
        return float(m.group(1))


@pytest.fixture
async def front(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Front]:
    settings = SidecarSettings(
        engine="http://127.0.0.1:9",  # never dialled: prompt lengths are estimated
        online_prompt_tokens="estimate",
        length_predictor="input",
        state_dir=tmp_path / "state",
        **getattr(request, "param", {}),
    )
    sidecar = Sidecar(settings)
    sidecar.controller.start()
    link = FrontLink(sidecar.proxy, sidecar.proxy_state)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_accepted_socket(lambda: link, theirs)
    await link.connected
    yield Front(ours, link, sidecar)
    transport.close()
    ours.close()
    await sidecar.controller.stop()
    sidecar.lengths.close()


def _arrival(body: dict[str, object]) -> bytes:
    return b"c" + json.dumps(body).encode()


def _progress(seen: int, ttft: float, gaps: list[float]) -> bytes:
    return struct.pack("<Id", seen, ttft) + b"".join(struct.pack("<d", g) for g in gaps)


def _end(outcome: bytes, tokens: int) -> bytes:
    return struct.pack("<cIddd", outcome, tokens, 0.25, 0.001, 0.0002)


async def test_an_arrival_is_granted_and_its_stream_reported(front: Front) -> None:
    body = {"model": "m", "prompt": "hello there", "max_tokens": 3, "stream": True}
    await front.send(b"A", 41, _arrival(body), bytewise=True)
    kind, rid, payload = await front.receive()
    assert (kind, rid) == (b"G", 41)
    assert int(payload) == front.sidecar.dispatcher.config.online_priority
    assert front.metric('slipstream_in_flight_requests{class="online"}') == 1
    await front.send(b"P", 41, _progress(1, 0.02, []))
    await front.send(b"P", 41, _progress(3, -1.0, [0.01, 0.0]))
    await front.send(b"E", 41, _end(b"o", 3))
    await asyncio.sleep(0.05)
    assert front.metric('slipstream_ttft_seconds_count{class="online"}') == 1
    assert front.metric('slipstream_ttft_seconds_sum{class="online"}') == pytest.approx(0.02)
    assert front.metric('slipstream_tbt_seconds_count{class="online"}') == 2
    assert front.metric('slipstream_output_tokens_total{class="online"}') == 3
    assert front.metric(
        'slipstream_requests_finished_total{class="online",outcome="ok"}'
    ) == 1
    assert front.metric('slipstream_in_flight_requests{class="online"}') == 0
    assert front.metric(
        'slipstream_proxy_overhead_seconds_count{stage="to_engine"}'
    ) == 1


async def test_a_body_that_is_not_json_is_refused_with_vllms_error_shape(front: Front) -> None:
    await front.send(b"A", 5, b"c{not json")
    kind, rid, payload = await front.receive()
    assert (kind, rid) == (b"R", 5)
    (status,) = struct.unpack_from("<H", payload)
    assert status == 400
    assert json.loads(payload[2:])["error"]["message"] == "request body is not JSON"
    assert front.link.open_requests == 0


async def test_a_clients_priority_is_replaced_in_a_rewritten_body(front: Front) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "priority": -1000}
    await front.send(b"A", 6, _arrival(body))
    kind, rid, payload = await front.receive()
    assert (kind, rid) == (b"B", 6)
    sent = json.loads(payload)
    assert sent["priority"] == front.sidecar.dispatcher.config.online_priority != -1000
    assert sent["prompt"] == "hi"


@pytest.mark.parametrize("front", [{"max_num_seqs": 1}], indirect=True)
async def test_a_client_gone_while_held_leaves_the_queue(front: Front) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
    await front.send(b"A", 1, _arrival(body))
    assert (await front.receive())[:2] == (b"G", 1)
    await front.send(b"A", 2, _arrival(body))
    await asyncio.sleep(0.05)
    assert front.metric('slipstream_queued_requests{class="online"}') == 1
    await front.send(b"E", 2, _end(b"c", 0))
    await asyncio.sleep(0.05)
    assert front.metric('slipstream_queued_requests{class="online"}') == 0
    assert front.metric(
        'slipstream_requests_finished_total{class="online",outcome="cancelled"}'
    ) == 1


async def test_an_unknown_frame_closes_the_link(front: Front) -> None:
    await front.send(b"Z", 1, b"")
    await asyncio.wait_for(asyncio.shield(front.link.lost), 5)


async def test_a_lost_front_settles_what_was_in_flight(front: Front) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
    await front.send(b"A", 9, _arrival(body))
    assert (await front.receive())[:2] == (b"G", 9)
    front.sock.close()
    await asyncio.wait_for(asyncio.shield(front.link.lost), 5)
    assert front.metric('slipstream_in_flight_requests{class="online"}') == 0
    assert front.metric(
        'slipstream_requests_finished_total{class="online",outcome="engine_error"}'
    ) == 1


async def test_the_allowance_follows_the_requests_sent_on_arrival(front: Front) -> None:
    seen, count, blocks, ratio, block_size, priority = await front.next_allowance()
    settings = front.sidecar.settings
    free = front.sidecar.dispatcher.est_free_kv_blocks
    assert (seen, count, blocks) == (0, settings.max_num_seqs, free)
    assert (ratio, block_size, priority) == (0.25, front.sidecar.kv.block_size, 0)
    body = {"model": "m", "prompt": "hello " * 40, "max_tokens": 32, "stream": True}
    await front.send(b"S", 3, _arrival(body))
    seen, count, blocks, *_ = await front.next_allowance()
    assert (seen, count) == (1, settings.max_num_seqs - 1)
    assert blocks < front.sidecar.dispatcher.kv_blocks
    assert front.metric('slipstream_in_flight_requests{class="online"}') == 1
    assert front.metric("slipstream_online_sent_on_arrival_total") == 1
    await front.send(b"E", 3, _end(b"o", 32))
    seen, count, *_ = await front.next_allowance()
    assert (seen, count) == (1, settings.max_num_seqs)
    assert front.metric('slipstream_requests_finished_total{class="online",outcome="ok"}') == 1


@pytest.mark.parametrize("front", [{"max_num_seqs": 1}], indirect=True)
async def test_no_allowance_while_a_request_is_held(front: Front) -> None:
    assert (await front.next_allowance())[1] == 1
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": True}
    await front.send(b"A", 1, _arrival(body))
    assert (await front.receive())[:2] == (b"G", 1)
    assert (await front.next_allowance())[1] == 0  # its slot is taken
    await front.send(b"A", 2, _arrival(body))  # held: the engine's one slot is taken
    await asyncio.sleep(0.05)
    assert front.metric('slipstream_queued_requests{class="online"}') == 1
    await front.send(b"E", 1, _end(b"o", 2))
    assert (await front.receive())[:2] == (b"G", 2)  # the held one, not a newcomer


async def test_a_draining_sidecar_gives_no_allowance(front: Front) -> None:
    assert (await front.next_allowance())[1] > 0
    front.sidecar.proxy_state.draining = True
    assert (await front.next_allowance())[1:3] == (0, 0)
