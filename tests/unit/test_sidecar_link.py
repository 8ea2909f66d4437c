"""The lean engine link: HTTP/1.1 framing, keep-alive reuse, aborts and broken answers.

Every test talks to a real server on loopback: aiohttp's, or a raw asyncio one where
a test needs bytes no well-behaved server sends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from slipstream_sidecar import link as link_mod
from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.errors import EngineUnavailableError
from slipstream_sidecar.link import EngineLink
from slipstream_sidecar.proxy import serve

pytestmark = pytest.mark.unit


class Sink:
    """Records what the link hands over."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.content_type: str | None = None
        self.pieces: list[bytes] = []
        self.outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.reason = ""

    def head(self, status: int, content_type: str | None) -> None:
        self.status, self.content_type = status, content_type

    def body(self, data: bytes) -> None:
        self.pieces.append(data)

    def end(self) -> None:
        self.outcome.set_result("end")

    def broken(self, reason: str) -> None:
        self.reason = reason
        self.outcome.set_result("broken")

    async def result(self) -> str:
        return await asyncio.wait_for(self.outcome, 10)


async def _aiohttp_engine(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner, port = await serve(app, "127.0.0.1", 0)
    return runner, f"http://127.0.0.1:{port}"


async def _raw_engine(answer: bytes, *, close: bool = True) -> tuple[asyncio.Server, str]:
    """A server that reads one request head and writes ``answer`` verbatim."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        if close:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture
async def sse_engine() -> AsyncIterator[tuple[str, list[int]]]:
    """Streams five SSE events per request; records each request's client port."""
    ports: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert request.transport is not None
        ports.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(body["n"])):
            await resp.write(b'data: {"i":%d}\n\n' % i)
        await resp.write_eof()
        return resp

    runner, url = await _aiohttp_engine(handler)
    yield url, ports
    await runner.cleanup()


@pytest.fixture
async def sse_link(
    sse_engine: tuple[str, list[int]],
) -> AsyncIterator[tuple[EngineLink, list[int]]]:
    """A link to ``sse_engine``, closed afterwards; with the engine's record of client ports."""
    url, ports = sse_engine
    link = EngineLink(url)
    yield link, ports
    await link.close()


async def test_a_chunked_answer_arrives_unframed_and_the_connection_is_reused(
    sse_link: tuple[EngineLink, list[int]],
) -> None:
    link, ports = sse_link
    for _ in range(2):
        sink = Sink()
        await link.post("/v1/completions", b'{"n":5}', sink)
        assert await sink.result() == "end"
        assert sink.status == 200 and sink.content_type == "text/event-stream"
        assert b"".join(sink.pieces) == b"".join(b'data: {"i":%d}\n\n' % i for i in range(5))
        assert link.idle == 1
    assert len(ports) == 2 and ports[0] == ports[1]  # one keep-alive connection


async def test_a_finished_exchange_cannot_touch_the_next_request_on_its_connection(
    sse_link: tuple[EngineLink, list[int]],
) -> None:
    link, ports = sse_link
    first = Sink()
    done = await link.post("/v1/completions", b'{"n":1}', first)
    assert await first.result() == "end"
    second = Sink()
    await link.post("/v1/completions", b'{"n":400}', second)
    assert len(ports) == 1 or ports[-1] == ports[0]  # the same connection, reused
    assert not done.live
    done.abort()  # late (a cancelled caller's cleanup): must not cut the second answer
    done.pause()
    assert await second.result() == "end"
    assert len(b"".join(second.pieces)) == sum(len(b'data: {"i":%d}\n\n' % i) for i in range(400))


async def test_a_connection_idle_too_long_is_not_reused(
    sse_link: tuple[EngineLink, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    link, ports = sse_link
    monkeypatch.setattr(link_mod, "IDLE_MAX_S", 0.0)
    for _ in range(2):
        sink = Sink()
        await link.post("/v1/completions", b'{"n":1}', sink)
        assert await sink.result() == "end"
        await asyncio.sleep(0.01)
    assert len(ports) == 2 and ports[0] != ports[1]


async def test_an_error_answer_with_a_length_is_passed_whole() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"error": {"message": "no such model"}}, status=404)

    runner, url = await _aiohttp_engine(handler)
    link = EngineLink(url)
    try:
        sink = Sink()
        await link.post("/v1/completions", b"{}", sink)
        assert await sink.result() == "end"
        assert sink.status == 404 and sink.content_type == "application/json; charset=utf-8"
        assert b"".join(sink.pieces) == b'{"error": {"message": "no such model"}}'
    finally:
        await link.close()
        await runner.cleanup()


async def test_an_answer_delimited_by_the_close_ends_cleanly() -> None:
    server, url = await _raw_engine(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nhello"
    )
    link = EngineLink(url)
    try:
        sink = Sink()
        await link.post("/v1/completions", b"{}", sink)
        assert await sink.result() == "end"
        assert b"".join(sink.pieces) == b"hello"
        assert link.idle == 0
    finally:
        await link.close()
        server.close()


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        # cut inside the second chunk
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n9\r\nwor",
            "closed the connection",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhal", "closed the connection"),
        (b"SMTP ready\r\n\r\n", "unreadable answer"),
    ],
)
async def test_a_cut_or_unreadable_answer_is_broken_not_ended(answer: bytes, said: str) -> None:
    server, url = await _raw_engine(answer)
    link = EngineLink(url)
    try:
        sink = Sink()
        await link.post("/v1/completions", b"{}", sink)
        assert await sink.result() == "broken"
        assert said in sink.reason
        assert link.idle == 0
    finally:
        await link.close()
        server.close()


async def test_abort_closes_the_connection_the_engine_streams_on() -> None:
    gone = asyncio.Event()
    started = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(1000):
                await resp.write(b"data: {}\n\n")
                started.set()
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):
            gone.set()
            raise
        return resp

    runner, url = await _aiohttp_engine(handler)
    link = EngineLink(url)
    try:
        sink = Sink()
        exchange = await link.post("/v1/completions", b"{}", sink)
        await asyncio.wait_for(started.wait(), 10)
        exchange.abort()
        await asyncio.wait_for(gone.wait(), 10)  # the engine saw its request go
        assert not sink.outcome.done()  # an abort is the caller's own doing: no callback
        assert link.idle == 0
    finally:
        await link.close()
        await runner.cleanup()


async def test_no_engine_is_engine_unavailable() -> None:
    server, url = await _raw_engine(b"")
    server.close()
    await server.wait_closed()
    link = EngineLink(url, connect_timeout_s=2.0)
    with pytest.raises(EngineUnavailableError, match="POST /v1/completions"):
        await link.post("/v1/completions", b"{}", Sink())


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="expected http"):
        EngineLink("unix:///run/vllm.sock")


async def test_fetch_returns_the_whole_answer_and_cancelling_it_aborts_the_request() -> None:
    gone = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if body == b'{"slow":true}':
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                gone.set()  # the engine model, like vLLM, is cancelled when its client goes
                raise
        return web.json_response({"echo": body.decode()})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    client = EngineClient(f"http://127.0.0.1:{port}", connections=4, timeout_s=5.0)
    await client.start()
    try:
        status, ctype, body = await client.fetch("/v1/completions", b'{"a":1}')
        assert (status, ctype) == (200, "application/json; charset=utf-8")
        assert body == b'{"echo": "{\\"a\\":1}"}'
        slow = asyncio.ensure_future(client.fetch("/v1/completions", b'{"slow":true}'))
        await asyncio.sleep(0.2)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        await asyncio.wait_for(gone.wait(), 10)
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_sink_that_raises_breaks_its_answer_and_is_logged_by_type(
    sse_link: tuple[EngineLink, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    class Faulty(Sink):
        def body(self, data: bytes) -> None:
            raise KeyError("a prompt must not reach the log")

    link, _ = sse_link
    sink = Faulty()
    await link.post("/v1/completions", b'{"n":3}', sink)
    assert await sink.result() == "broken"
    assert sink.reason == "the sidecar failed relaying the answer: KeyError"
    assert "KeyError" in caplog.text and "prompt" not in caplog.text


class _RacingEngine:
    """Answers the first request of every connection (keep-alive), then closes the
    connection on its next request without a byte: the keep-alive race, where the server
    drops an idle connection as a request crosses it. The first ``unanswered`` new
    connections are closed that way at once. ``seen``: (connection, body) per request
    answered, (connection, b"dropped") per request closed on."""

    def __init__(self, server: asyncio.Server, handlers: list[asyncio.Task[None]]) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self.handlers = handlers
        self.seen: list[tuple[int, bytes]] = []

    async def close(self) -> None:
        self.server.close()
        await asyncio.gather(*self.handlers, return_exceptions=True)


async def _racing_engine(unanswered: int) -> _RacingEngine:
    handlers: list[asyncio.Task[None]] = []
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
    conns = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        task = asyncio.current_task()
        assert task is not None
        handlers.append(task)
        conns += 1
        me = conns
        with contextlib.suppress(asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            if me <= unanswered:
                engine.seen.append((me, b"dropped"))
            else:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                engine.seen.append((me, await reader.readexactly(length)))
                writer.write(answer)
                await writer.drain()
                await reader.readuntil(b"\r\n\r\n")  # the next request: closed on, unread
                engine.seen.append((me, b"dropped"))
        writer.close()

    engine = _RacingEngine(await asyncio.start_server(handle, "127.0.0.1", 0), handlers)
    return engine


async def test_a_request_on_a_reused_connection_the_engine_closed_is_sent_again() -> None:
    engine = await _racing_engine(unanswered=0)
    counted: list[int] = []
    link = EngineLink(engine.url, on_resend=lambda: counted.append(1))  # the metric's hook
    try:
        first = Sink()
        await link.post("/v1/completions", b'{"n":1}', first)
        assert await first.result() == "end"
        assert link.idle == 1
        second = Sink()
        await link.post("/v1/completions", b'{"n":2}', second)  # reuses, meets the close
        assert await second.result() == "end", second.reason
        assert second.status == 200 and b"".join(second.pieces) == b"ok"
        assert link.resent == 1 and counted == [1]
        # connection 1 answered the first and closed on the second; connection 2 answered it
        assert engine.seen == [(1, b'{"n":1}'), (1, b"dropped"), (2, b'{"n":2}')]
    finally:
        await link.close()
        await engine.close()


async def test_a_new_connection_closed_before_an_answer_is_broken_not_sent_again() -> None:
    engine = await _racing_engine(unanswered=1)
    link = EngineLink(engine.url)
    try:
        sink = Sink()
        await link.post("/v1/completions", b'{"n":1}', sink)
        assert await sink.result() == "broken"
        assert "closed the connection" in sink.reason
        assert link.resent == 0 and engine.seen == [(1, b"dropped")]
    finally:
        await link.close()
        await engine.close()


async def test_an_answer_begun_on_a_reused_connection_is_never_sent_again() -> None:
    cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    full = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        for answer in (full, cut):  # the second request on the connection is cut short
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            served += 1
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    link = EngineLink(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        for expected in ("end", "broken"):
            sink = Sink()
            await link.post("/v1/completions", b"{}", sink)
            assert await sink.result() == expected
        assert served == 2 and link.resent == 0
    finally:
        await link.close()
        server.close()
