"""Carrying one online stream from the engine to its client.

A :class:`Relay` is the :class:`~slipstream_sidecar.link.StreamSink` of one
streamed online request. The engine connection calls it with each piece of
the answer; it counts the tokens (TTFT and TBT, the dispatcher's progress)
and writes the piece to the client's transport in the same callback, so a
token costs no task wake-up and no trip through a stream reader and writer.

The request's handler still owns the HTTP exchange with the client: it waits
for the engine's head (:attr:`Relay.started`), sends the client its head with the
first bytes (:attr:`Relay.first`), then :meth:`Relay.attach` hands the client's
transport to the relay, and the handler waits for :attr:`Relay.done`.

Backpressure: when the client reads more slowly than the engine writes (more
than ``HIGH_WATER`` bytes queued for it), the relay stops reading from the
engine and looks again every ``DRAIN_POLL_S`` until the queue is below
``LOW_WATER``.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from slipstream_sidecar.controller import Controller, Ticket
from slipstream_sidecar.errors import EngineUnavailableError
from slipstream_sidecar.link import Exchange, broken_cause
from slipstream_sidecar.sse import EventScanner

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
DRAIN_POLL_S = 0.005

OK = "ok"
ENGINE_ERROR = "engine_error"
CLIENT_ERROR = "client_error"  # the engine refused the request (4xx): the client's error
CANCELLED = "cancelled"


class _Observer(Protocol):
    """A histogram (prometheus-client's child of one label)."""

    def observe(self, amount: float) -> None: ...


class Relay:
    """The sink of one streamed online answer (see the module's docstring)."""

    __slots__ = (
        "_chunked",
        "_exchange",
        "_last",
        "_loop",
        "_paused",
        "_pending",
        "_reported",
        "_scanner",
        "_tbt",
        "_texts",
        "_transport",
        "_ttft",
        "controller",
        "counted",
        "done",
        "exact",
        "first",
        "reason",
        "started",
        "status",
        "ticket",
    )

    def __init__(
        self, ticket: Ticket, controller: Controller, ttft: _Observer, tbt: _Observer
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.ticket = ticket
        self.controller = controller
        self._ttft = ttft
        self._tbt = tbt
        self.started: asyncio.Future[tuple[int, str | None]] = self._loop.create_future()
        self.first: asyncio.Future[None] = self._loop.create_future()
        self.done: asyncio.Future[str] = self._loop.create_future()
        self.status = 0
        self.counted = 0  # token events seen
        self.exact: int | None = None  # completion_tokens from the stream's usage
        self.reason = ""  # why the engine's answer broke off
        self._reported = 0
        self._texts = 0  # events with text seen (TBT is timed between them)
        self._last = ticket.arrival_s
        self._scanner = EventScanner()
        self._pending: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self._chunked = True
        self._exchange: Exchange | None = None
        self._paused = False

    @property
    def tokens(self) -> int:
        """Output tokens of the answer: the usage count when the stream had one."""
        return self.exact if self.exact is not None else self.counted

    def bind(self, exchange: Exchange) -> None:
        self._exchange = exchange

    def take_pending(self) -> bytes:
        data = b"".join(self._pending)
        self._pending.clear()
        return data

    def attach(self, transport: asyncio.Transport, *, chunked: bool) -> None:
        """Write the rest of the answer straight to the client's ``transport``."""
        self._chunked = chunked
        self._transport = transport
        rest = self.take_pending()
        if rest:
            self._write(rest)

    # -- StreamSink ---------------------------------------------------------------------------

    def head(self, status: int, content_type: str | None) -> None:
        self.status = status
        if not self.started.done():
            self.started.set_result((status, content_type))

    def body(self, data: bytes) -> None:
        if self.status != 200:
            self._pending.append(data)
            return
        self._count(data, self.controller.now())
        if self._transport is None:
            self._pending.append(data)
            if not self.first.done():
                self.first.set_result(None)
            return
        self._write(data)

    def end(self) -> None:
        self._resolve_first()
        self._finish(OK)

    def broken(self, reason: str) -> None:
        self.reason = reason
        if not self.started.done():
            self.started.set_exception(EngineUnavailableError(reason, cause=broken_cause(reason)))
            self.started.exception()  # retrieved: the handler may be gone
        self._resolve_first()
        self._finish(ENGINE_ERROR)

    # -- internals ----------------------------------------------------------------------------

    def _resolve_first(self) -> None:
        if not self.first.done():
            self.first.set_result(None)

    def _finish(self, outcome: str) -> None:
        if not self.done.done():
            self.done.set_result(outcome)

    def _count(self, data: bytes, t: float) -> None:
        for ev in self._scanner.feed(data):
            if ev.usage is not None:
                ct = ev.usage.get("completion_tokens")
                if isinstance(ct, int):
                    self.exact = ct
            if ev.tokens:
                if self.counted == 0:
                    self._ttft.observe(t - self.ticket.arrival_s)
                self.counted += 1
            if ev.content:  # gaps between events that carry text, as the client sees them
                if self._texts:
                    gap = t - self._last
                    self._tbt.observe(gap)
                    self.controller.observe_gap(gap)
                self._last = t
                self._texts += 1
        seen = self.tokens
        if seen != self._reported:
            self._reported = seen
            self.controller.progress(self.ticket, seen)

    def _write(self, data: bytes) -> None:
        transport = self._transport
        assert transport is not None
        if transport.is_closing():  # the client went away: abort the engine's request
            if self._exchange is not None:
                self._exchange.abort()
            self._finish(CANCELLED)
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)
        if not self._paused and transport.get_write_buffer_size() > HIGH_WATER:
            self._paused = True
            if self._exchange is not None:
                self._exchange.pause()
            self._loop.call_later(DRAIN_POLL_S, self._check_drain)

    def _check_drain(self) -> None:
        transport = self._transport
        if self.done.done() or transport is None:
            return
        if transport.is_closing():
            if self._exchange is not None:
                self._exchange.abort()
            self._finish(CANCELLED)
            return
        if transport.get_write_buffer_size() > LOW_WATER:
            self._loop.call_later(DRAIN_POLL_S, self._check_drain)
            return
        self._paused = False
        if self._exchange is not None:
            self._exchange.resume()
