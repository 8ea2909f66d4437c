"""The compiled front: the online data path in a Go process, the decisions here.

The pod's OpenAI HTTP port is served by ``slipstream-front``
(``sidecar/front``, Go standard library), which this module starts and feeds.
For each generation request the front sends the client's body here over a
Unix socket; this process decides (``Proxy.inspect`` / ``measure`` /
``register``: the dispatcher, the ordering and the prompt-length rules) and
answers with a grant (the vLLM priority, or the rewritten body) or a refusal
(an error response). The front forwards the request, relays the answer byte
for byte and reports tokens (TTFT, gaps, counts) and the end; this process
turns those into the dispatcher's ``progress`` / ``finished`` / ``failed`` and
the metrics. Every other route (``/health``, ``/ready``, ``/metrics``,
``/v1/models``, the engine's routes the sidecar passes on) the front passes to
this process's own aiohttp application (``Proxy.app``) on a second Unix socket.

The allowance: while no online request is held, the dispatcher would submit
any online arrival that finds a slot and KV blocks free
(``Dispatcher.online_allowance``), so the front is told that rule ahead of
time and sends such arrivals to the engine at once, reporting each (``S``);
they are registered here as decided at arrival
(``Dispatcher.arrive_submitted``, one decision for the ones of one read).
The front uses it only while none of its arrivals awaits a reply here, so a
newcomer never overtakes a held request. Why: deciding in this process is what
a burst of arrivals waits for (``docs/benchmarks/sidecar.md``, "The sidecar's
own time on the path"); with the allowance the decision is off the request's
path.

Frames (both ways): kind (1 byte), request id (uint32), payload length
(uint32), little-endian, then the payload. Front to sidecar: ``A`` arrival
(route byte, body), ``S`` sent on arrival inside the allowance (route byte,
body), ``P`` progress (uint32 tokens seen, float64 TTFT or -1, float64 gaps;
at the first token, at each KV-block boundary and at the end), ``E`` end
(outcome byte, uint32 tokens, float64 end-to-end, time to the engine and
first relay write, -1 when none). Sidecar to front: ``G`` grant (the priority
in ASCII digits), ``B`` grant with this body, ``R`` refusal (uint16 status,
body), ``C`` allowance (uint32 ``S`` frames registered, uint32 requests,
uint32 KV blocks, float64 tokens per byte, uint32 block size, int32 online
priority).

The two processes live and die together: when the front exits or the control
socket closes, :meth:`CompiledFront.wait_closed` returns and the sidecar stops
(the pod restarts it); when the sidecar stops, it ends the front.

Deliberately left out: more than one front per sidecar, and a front on another
host (the socket is a private file of the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from aiohttp import web

from slipstream_sidecar.controller import Grant, Ticket
from slipstream_sidecar.logging_filters import install_payload_filter
from slipstream_sidecar.proxy import Admission, Proxy, ProxyState, error_response

log = logging.getLogger(__name__)

BINARY = "slipstream-front"
_HEADER = struct.Struct("<cII")
_PROGRESS = struct.Struct("<Id")
_END = struct.Struct("<cIddd")
_STATUS = struct.Struct("<H")
_ALLOWANCE = struct.Struct("<IIIdIi")
_ESTIMATE_TOKENS_PER_BYTE = 0.25  # the estimate mode's bytes/4
# The allowance is recomputed after every batch of frames and every decision; this
# also catches what changes the engine's load between them (offline tokens, Drain).
_ALLOWANCE_REFRESH_S = 0.1
_OUTCOMES = {b"o": "ok", b"e": "engine_error", b"x": "client_error", b"c": "cancelled"}
_START_TIMEOUT_S = 30.0


class FrontProtocolError(RuntimeError):
    """The front sent a frame this side cannot read."""


class FrontMissingError(FileNotFoundError):
    """The ``slipstream-front`` executable is not where the sidecar looks for it."""


def find_binary(configured: Path | None) -> Path:
    """The front's executable: the configured path, else ``slipstream-front`` beside this
    Python (a virtual environment's ``bin``, where ``make front`` builds it) or on ``PATH``
    (the image's ``/usr/local/bin``)."""
    if configured is not None:
        if not (configured.is_file() and os.access(configured, os.X_OK)):
            raise FrontMissingError(
                f"--front-binary {configured} is not an executable file (build it with "
                "`make front`)"
            )
        return configured
    beside = Path(sys.executable).parent / BINARY
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    if found is None:
        raise FrontMissingError(
            f"the {BINARY} executable is neither beside {sys.executable} nor on PATH "
            "(build it with `make front`, or give --front-binary)"
        )
    return Path(found)


@dataclass(slots=True)
class _Request:
    adm: Admission
    ticket: Ticket | None = None
    reported: int = 0
    gone: bool = False  # the client left before the request was registered


class FrontLink(asyncio.Protocol):
    """This side of the control socket: decisions out, the front's events in."""

    def __init__(self, proxy: Proxy, state: ProxyState) -> None:
        self.proxy = proxy
        self.state = state
        self.controller = proxy.controller
        metrics = proxy.metrics
        self._ttft = metrics.ttft.labels("online")
        self._tbt = metrics.tbt.labels("online")
        self._tokens = metrics.output_tokens.labels("online")
        self._to_engine = metrics.proxy_overhead.labels("to_engine")
        self._relay = metrics.proxy_overhead.labels("relay")
        self._sent_total = metrics.sent_on_arrival
        self._buf = bytearray()
        self._requests: dict[int, _Request] = {}
        self._transport: asyncio.Transport | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent_seen = 0  # requests the front sent on arrival, as registered here
        self._sent_batch: list[tuple[int, _Request]] = []  # read, not yet registered
        # The last one sent: (sent_seen, requests, KV blocks, block size, tokens per byte).
        self._allowance: tuple[int, int, int, int, float] | None = None
        self._refresh_scheduled = False
        self._refresher: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        self.connected: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()

    @property
    def open_requests(self) -> int:
        return len(self._requests)

    @property
    def allowance(self) -> tuple[int, int] | None:
        """The allowance last sent to the front, (requests, KV blocks); None before the first."""
        last = self._allowance
        return None if last is None else (last[1], last[2])

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._transport is not None:  # one front per sidecar
            transport.close()
            return
        self._transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass
        self.controller.on_change = self._schedule_refresh
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_periodically())
        self._schedule_refresh()  # the first allowance at once, not at the first refresh
        if not self.connected.done():
            self.connected.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.controller.on_change = None
        if self._refresher is not None:
            self._refresher.cancel()
        for req in self._requests.values():
            if req.ticket is not None:
                self.proxy.settle(req.adm, req.ticket, "engine_error", 0.0)
        self._requests.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        size = len(buf)
        try:
            while size - at >= _HEADER.size:
                kind, rid, n = _HEADER.unpack_from(buf, at)
                end = at + _HEADER.size + n
                if end > size:
                    break
                payload = bytes(buf[at + _HEADER.size : end])
                at = end
                self._frame(kind, rid, payload)
        except FrontProtocolError as exc:
            log.error("compiled front: %s; closing the control socket", exc)
            if self._transport is not None:
                self._transport.close()
        finally:
            del buf[:at]
            self._register_sent()
            self._schedule_refresh()

    # -- frames from the front ----------------------------------------------------------------

    def _frame(self, kind: bytes, rid: int, payload: bytes) -> None:
        if kind == b"S":
            self._sent(rid, payload)
            return
        # Anything else may concern (or be ranked behind) the requests sent before it.
        self._register_sent()
        if kind == b"P":
            self._progress(rid, payload)
        elif kind == b"A":
            self._arrive(rid, payload)
        elif kind == b"E":
            self._end(rid, payload)
        else:
            raise FrontProtocolError(f"unknown frame kind {kind!r}")

    def _arrive(self, rid: int, payload: bytes) -> None:
        arrival = self.controller.now()
        if self.state.draining:
            refusal = error_response(503, "the sidecar is draining", "ServiceUnavailableError")
            self._refuse(rid, refusal)
            return
        adm = self.proxy.inspect(payload[1:], arrival)
        if isinstance(adm, web.Response):
            self.proxy.metrics.finished.labels("online", "client_error").inc()
            self._refuse(rid, adm)
            return
        req = _Request(adm)
        self._requests[rid] = req
        if adm.exact:
            task = asyncio.get_running_loop().create_task(self._measure_then_admit(rid, req))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self._admit(rid, req)

    def _sent(self, rid: int, payload: bytes) -> None:
        """A request the front sent to the engine on arrival, inside its allowance: read
        now, registered with the others of its read (one decision for a burst)."""
        adm = self.proxy.inspect_sent(payload[1:], self.controller.now())
        self._sent_batch.append((rid, _Request(adm)))

    def _register_sent(self) -> None:
        batch = self._sent_batch
        if not batch:
            return
        self._sent_batch = []
        tickets = self.proxy.register_sent([req.adm for _, req in batch])
        for (rid, req), ticket in zip(batch, tickets, strict=True):
            req.ticket = ticket
            self._requests[rid] = req
        self.sent_seen += len(batch)
        self._sent_total.inc(len(batch))

    async def _measure_then_admit(self, rid: int, req: _Request) -> None:
        refused = await self.proxy.measure(req.adm)
        if req.gone:
            self.proxy.metrics.finished.labels("online", "cancelled").inc()
            return
        if refused is not None:
            self._requests.pop(rid, None)
            self._refuse(rid, refused)
            return
        self._admit(rid, req)

    def _admit(self, rid: int, req: _Request) -> None:
        ticket = self.proxy.register(req.adm)
        req.ticket = ticket
        ticket.when_granted(lambda grant: self._grant(rid, req, grant))

    def _grant(self, rid: int, req: _Request, grant: Grant) -> None:
        if req.gone:
            return
        if self.proxy.splices(req.adm):
            self._send(b"G", rid, b"%d" % grant.priority)
        else:
            self._send(b"B", rid, self.proxy.engine_body(req.adm, grant))

    def _progress(self, rid: int, payload: bytes) -> None:
        req = self._requests.get(rid)
        if req is None or req.ticket is None:
            return
        seen, ttft = _PROGRESS.unpack_from(payload)
        if ttft >= 0:
            self._ttft.observe(ttft)
        if len(payload) > _PROGRESS.size:
            tbt = self._tbt
            for (gap,) in struct.iter_unpack("<d", payload[_PROGRESS.size :]):
                tbt.observe(gap)
                self.controller.observe_gap(gap)
        if seen != req.reported:
            req.reported = seen
            self.controller.progress(req.ticket, seen)

    def _end(self, rid: int, payload: bytes) -> None:
        outcome_b, tokens, e2e, to_engine, relay = _END.unpack(payload)
        outcome = _OUTCOMES.get(outcome_b)
        if outcome is None:
            raise FrontProtocolError(f"unknown outcome {outcome_b!r}")
        req = self._requests.pop(rid, None)
        if req is None:
            return  # refused earlier: already settled
        if req.ticket is None:  # still measuring: settled when that ends
            req.gone = True
            return
        if to_engine >= 0:
            self._to_engine.observe(to_engine)
        if relay >= 0:
            self._relay.observe(relay)
        if outcome == "ok":
            self._tokens.inc(tokens)
            self.controller.finished(req.ticket, tokens)
        self.proxy.settle(req.adm, req.ticket, outcome, e2e)

    # -- the allowance ------------------------------------------------------------------------

    def _schedule_refresh(self) -> None:
        if not self._refresh_scheduled:
            self._refresh_scheduled = True
            asyncio.get_running_loop().call_soon(self._refresh)

    async def _refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(_ALLOWANCE_REFRESH_S)
            self._refresh()

    def _refresh(self) -> None:
        """Send the front the allowance in force, when it changed: (requests, KV blocks)
        it may send on arrival with no decision each, counted from the ``sent_seen``-th
        such request (those it sent after are its to subtract)."""
        self._refresh_scheduled = False
        if self.state.draining or not self.proxy.allowance_ready():
            count, blocks = 0, 0
        else:
            count, blocks = self.controller.online_allowance()
        ratio = self.proxy.ratio.ratio if self.proxy.tokenizes else _ESTIMATE_TOKENS_PER_BYTE
        # The block size follows the engine's once it is read (kvcache.py): sent when it changes.
        block_size = self.controller.dispatcher.limits.block_size
        allowance = (self.sent_seen, count, blocks, block_size, ratio)
        last = self._allowance
        if last is not None and last[:4] == allowance[:4] and abs(last[4] - ratio) < 0.01 * ratio:
            return
        self._allowance = allowance
        payload = _ALLOWANCE.pack(
            self.sent_seen,
            count,
            blocks,
            ratio,
            block_size,
            self.controller.dispatcher.config.online_priority,
        )
        self._send(b"C", 0, payload)

    # -- frames to the front ------------------------------------------------------------------

    def _refuse(self, rid: int, resp: web.Response) -> None:
        body = resp.body
        assert isinstance(body, bytes)
        self._send(b"R", rid, _STATUS.pack(resp.status) + body)

    def _send(self, kind: bytes, rid: int, payload: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.write(_HEADER.pack(kind, rid, len(payload)) + payload)


class CompiledFront:
    """The running front: its process, its sockets and the link to it."""

    def __init__(
        self,
        link: FrontLink,
        process: asyncio.subprocess.Process,
        port: int,
        workdir: Path,
        servers: tuple[asyncio.AbstractServer, web.AppRunner],
    ) -> None:
        self.link = link
        self.process = process
        self.port = port
        self._workdir = workdir
        self._control, self._runner = servers
        loop = asyncio.get_running_loop()
        self._exited = loop.create_task(process.wait())

    async def wait_closed(self) -> None:
        """Return when the front process exits or the control socket closes."""
        lost: asyncio.Future[object] = asyncio.ensure_future(asyncio.shield(self.link.lost))
        await asyncio.wait((self._exited, lost), return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()
        self._control.close()
        await self._control.wait_closed()
        await self._runner.cleanup()
        shutil.rmtree(self._workdir, ignore_errors=True)


async def start_front(
    proxy: Proxy,
    app: web.Application,
    *,
    engine: str,
    host: str,
    port: int,
    binary: Path,
    engine_connections: int,
) -> CompiledFront:
    """Serve ``app`` on a private Unix socket, open the control socket, start the front
    on ``host:port`` (0: any free port) and wait until it is connected and listening."""
    install_payload_filter()  # aiohttp would log the bytes of a malformed request (a prompt)
    workdir = Path(tempfile.mkdtemp(prefix="slipstream-front-"))
    internal = workdir / "http.sock"
    control_path = workdir / "control.sock"
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    await web.UnixSite(runner, str(internal)).start()
    link = FrontLink(proxy, proxy.state)
    loop = asyncio.get_running_loop()
    control = await loop.create_unix_server(lambda: link, path=str(control_path))
    process = await asyncio.create_subprocess_exec(
        str(binary),
        "--engine",
        engine,
        "--listen",
        f"{host}:{port}",
        "--control",
        str(control_path),
        "--internal",
        str(internal),
        "--engine-connections",
        str(engine_connections),
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), _START_TIMEOUT_S)
        if not line.startswith(b"listening on "):
            raise RuntimeError(f"{binary} did not start (exit status {await process.wait()})")
        bound = int(line.rsplit(b":", 1)[1])
        await asyncio.wait_for(asyncio.shield(link.connected), _START_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        control.close()
        await runner.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return CompiledFront(link, process, bound, workdir, (control, runner))
