"""A lean HTTP/1.1 link to the engine for streamed answers.

Every token of every online stream passes through the sidecar. Through
aiohttp's client each chunk wakes the handler's task and goes through the
response's stream reader, then through the web response's writer: about a
quarter of the sidecar's CPU per chunk, spent after every engine step while
the finished streams' next requests wait behind it. Here the engine
connection's protocol hands each piece of the body to a :class:`StreamSink`
in the same loop callback that read it, and the sink writes it on.

One exchange: :meth:`EngineLink.post` writes ``POST path`` with a JSON body on
a pooled keep-alive connection (``http`` or ``https``); httptools (llhttp)
parses the answer and calls the sink: ``head`` once, ``body`` per piece (the
chunked framing removed), then ``end`` or ``broken``. Closing the connection
aborts the request (vLLM cancels a request whose connection drops).

One retry: a request sent on a *reused* connection that the engine closes
before a single byte of the answer arrives is sent once more on a new
connection. That is the keep-alive race (the server closed the idle
connection as the request crossed it), in which the engine did not take the
request. HTTP clients in general retry only idempotent methods there (RFC
9112, 9.3.1; Go's transport and aiohttp's client do so), but a generation
request changes nothing in the engine beyond its own answer, and the client
has seen none of it, so sending a POST again is safe here; at worst (an
engine that took it and died before answering) it is computed twice. Any
other break (a new connection, or an answer already begun) is reported to the
sink, and the caller decides.

Deliberately left out: redirects, proxies, compression (none is asked for),
trailers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from slipstream_sidecar.errors import EngineUnavailableError, describe, unreachable

log = logging.getLogger(__name__)

# NOTE: vLLM's server (uvicorn) closes a keep-alive connection idle for 5 s; one idle
# for longer than this is closed here rather than risk a request crossing the close.
IDLE_MAX_S = 2.0


class StreamSink(Protocol):
    """Receives one answer. Called from the event loop; must not raise."""

    def head(self, status: int, content_type: str | None) -> None: ...

    def body(self, data: bytes) -> None: ...

    def end(self) -> None: ...

    def broken(self, reason: str) -> None: ...


class Exchange:
    """One request in flight: pause, resume or abort the reading of its answer.

    Once its answer is complete (or broken) an exchange no longer touches the
    connection, which may by then carry another request.
    """

    __slots__ = ("_conn", "aborted")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.aborted = False

    @property
    def live(self) -> bool:
        return self._conn.exchange is self

    def pause(self) -> None:
        if self.live:
            self._conn.pause()

    def resume(self) -> None:
        if self.live:
            self._conn.resume()

    def abort(self) -> None:
        """Close the connection unless the answer is complete (the engine then aborts)."""
        self.aborted = True  # a retry not yet on its new connection is not sent
        if self.live:
            self._conn.abort()


class Collector:
    """A sink that gathers a whole answer: ``await collector.answer`` gives
    (status, content type, body), or raises :class:`EngineUnavailableError`."""

    __slots__ = ("_content_type", "_pieces", "_status", "answer")

    def __init__(self) -> None:
        self.answer: asyncio.Future[tuple[int, str | None, bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._status = 0
        self._content_type: str | None = None
        self._pieces: list[bytes] = []

    def head(self, status: int, content_type: str | None) -> None:
        self._status, self._content_type = status, content_type

    def body(self, data: bytes) -> None:
        self._pieces.append(data)

    def end(self) -> None:
        if not self.answer.done():
            self.answer.set_result((self._status, self._content_type, b"".join(self._pieces)))

    def broken(self, reason: str) -> None:
        if not self.answer.done():
            self.answer.set_exception(EngineUnavailableError(reason, cause=broken_cause(reason)))


def broken_cause(reason: str) -> str:
    """The client-safe cause of a broken answer (``StreamSink.broken``'s reason)."""
    if reason.startswith("the engine closed the connection"):
        return "it closed the connection"
    if reason.startswith("unreadable answer"):
        return "unreadable answer"
    return describe(None) if not reason else "connection failed"


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one exchange at a time."""

    def __init__(self, link: EngineLink) -> None:
        self._link = link
        self.transport: asyncio.Transport | None = None
        self._sink: StreamSink | None = None
        self.exchange: Exchange | None = None  # the one in flight
        self._parser: httptools.HttpResponseParser | None = None
        self._content_type: str | None = None
        self._framed = False  # the answer has Content-Length or chunked framing
        self._headers_done = False
        self._paused = False
        self.idle_since = 0.0
        self._request = b""  # the request in flight, kept for the one retry
        self._retry = False  # reused connection, nothing of the answer read yet

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        parser = self._parser
        if parser is None:  # bytes nobody asked for: the connection is not reusable
            self._close()
            return
        self._retry = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # A sink raised: our bug, not the engine's. The type only (no prompt text in logs).
            cause = exc.__context__
            log.error("a relay failed on the engine's answer: %s", type(cause).__name__)
            self._fail(f"the sidecar failed relaying the answer: {type(cause).__name__}")
        except httptools.HttpParserError as exc:
            self._fail(f"unreadable answer from the engine: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self._link._forget(self)
        self.transport = None
        if self._sink is None:
            return
        if self._retry and self.exchange is not None:
            sink, exchange, request = self._sink, self.exchange, self._request
            self._sink = self._parser = None
            self.exchange = None
            self._link._resend(request, sink, exchange, exc)
            return
        if self._headers_done and not self._framed and exc is None:
            self._complete()  # an answer delimited by the connection's close
        else:
            self._fail(f"the engine closed the connection: {exc!r}")

    # -- httptools callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.lower()
        if key == b"content-type":
            self._content_type = value.decode("latin-1")
        elif key in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None and self._sink is not None
        self._headers_done = True
        self._sink.head(self._parser.get_status_code(), self._content_type)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink.body(body)

    def on_message_complete(self) -> None:
        self._complete()

    # -- exchange -----------------------------------------------------------------------------

    def start(
        self,
        request: bytes,
        sink: StreamSink,
        *,
        reused: bool = False,
        exchange: Exchange | None = None,
    ) -> Exchange:
        """Send ``request``; ``exchange``: the one a retry carries over from its first try."""
        assert self.transport is not None and self.exchange is None
        if exchange is None:
            exchange = Exchange(self)
        else:
            exchange._conn = self
        self.exchange = exchange
        self._sink = sink
        self._parser = httptools.HttpResponseParser(self)
        self._content_type = None
        self._framed = self._headers_done = False
        self._request = request if reused else b""
        self._retry = reused
        self.transport.write(request)
        return exchange

    def pause(self) -> None:
        if self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and self._paused:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self._sink = self._parser = None
        self.exchange = None
        self._close()

    def _complete(self) -> None:
        sink, parser = self._sink, self._parser
        self._sink = self._parser = None
        self.exchange = None
        self._request = b""
        if sink is None:
            return
        reusable = parser is not None and parser.should_keep_alive() and self._framed
        if reusable and not self._paused and self.transport is not None:
            self._link._release(self)
        else:
            self._close()
        sink.end()

    def _fail(self, reason: str) -> None:
        sink = self._sink
        self._sink = self._parser = None
        self.exchange = None
        self._close()
        if sink is not None:
            sink.broken(reason)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class EngineLink:
    """Pooled keep-alive connections to one engine, for streamed answers."""

    def __init__(
        self,
        base_url: str,
        *,
        idle_limit: int = 1024,
        connect_timeout_s: float = 5.0,
        on_resend: Callable[[], None] | None = None,
    ):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"engine URL {base_url!r}: expected http://host:port or https://")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        self._prefix = url.path.rstrip("/")
        authority = url.netloc.rsplit("@", 1)[-1]
        self._head = f"Host: {authority}\r\nContent-Type: application/json\r\n".encode("latin-1")
        self._idle: list[_Connection] = []
        self._idle_limit = idle_limit
        self._connect_timeout_s = connect_timeout_s
        self._all: set[_Connection] = set()
        self._resending: set[asyncio.Task[None]] = set()
        self.resent = 0  # requests sent again after a reused connection closed under them
        self._on_resend = on_resend

    async def post(self, path: str, body: bytes, sink: StreamSink) -> Exchange:
        """Send ``POST path`` with a JSON ``body``; the answer goes to ``sink``.

        Raises :class:`EngineUnavailableError` when no connection can be made.
        """
        conn = self._reuse()
        reused = conn is not None
        if conn is None:
            conn = await self._connect(path)
        request = b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            (self._prefix + path).encode("latin-1"),
            self._head,
            len(body),
            body,
        )
        return conn.start(request, sink, reused=reused)

    def _resend(
        self, request: bytes, sink: StreamSink, exchange: Exchange, exc: Exception | None
    ) -> None:
        """The engine closed a reused connection before answering: send once more, on a
        new connection (called from ``connection_lost``; the connect is a task)."""
        log.debug("engine closed a reused connection under a request (%r); sending again", exc)
        self.resent += 1
        if self._on_resend is not None:
            self._on_resend()
        task = asyncio.get_running_loop().create_task(self._send_again(request, sink, exchange))
        self._resending.add(task)
        task.add_done_callback(self._resending.discard)

    async def _send_again(self, request: bytes, sink: StreamSink, exchange: Exchange) -> None:
        if exchange.aborted:
            return  # the caller gave up on it meanwhile; an abort has no callback
        try:
            conn = await self._connect(request.split(b" ", 2)[1].decode("latin-1"))
        except EngineUnavailableError as exc:
            sink.broken(str(exc))
            return
        except asyncio.CancelledError:
            sink.broken("the sidecar is shutting down")
            raise
        if exchange.aborted:
            conn._close()
            return
        conn.start(request, sink, exchange=exchange)

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        for task in list(self._resending):
            task.cancel()
        for conn in list(self._all):
            conn._fail("the sidecar is shutting down")
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run

    @property
    def idle(self) -> int:
        return len(self._idle)

    def _reuse(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            transport = conn.transport
            if transport is None or transport.is_closing():
                continue
            if now - conn.idle_since > IDLE_MAX_S:
                conn._close()
                continue
            return conn
        return None

    async def _connect(self, path: str) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self._host, self._port, ssl=self._ssl
                )
        except (OSError, TimeoutError) as exc:
            raise unreachable(f"POST {path}", exc) from exc
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self._idle_limit:
            conn._close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)
