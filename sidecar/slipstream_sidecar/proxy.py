"""The OpenAI-compatible HTTP front door of one pod (online traffic).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming
SSE and not), ``GET /v1/models``, ``GET /health`` (liveness: the process
answers), ``GET /ready`` (readiness: the engine's ``/health`` answered 200 at
the last check and no Drain is in progress), ``GET /metrics``.

A request is held in the sidecar until the dispatcher submits it, then sent
to the engine with the priority the dispatcher chose. The engine's answer is
passed through byte for byte (status, content type, body or SSE chunks); the
sidecar only *reads* the stream to time tokens (TTFT, TBT) and count them.

Choices made here (``docs/sidecar.md``):

* A client's ``priority`` field is removed and replaced: clients never choose
  their class or priority; both come from the operator's configuration. A body
  without one is forwarded as the client's bytes with ``"priority":N`` put in
  front (``with_priority``), not decoded and encoded again.
* An online request that fits the engine when it arrives is granted inside
  ``Controller.register`` (``grant_now``), so its handler sends it to the
  engine before yielding to the event loop.
* A client's non-streaming request is sent upstream non-streaming and its
  bytes passed through unchanged; its token count comes from ``usage`` at the
  end (no TTFT/TBT samples for it). Streaming requests are forwarded as sent
  (no ``stream_options`` injected, so the bytes are what vLLM would send the
  client) and tokens are counted from the events (``sse.py``).
* Prompt lengths come from the engine's ``/tokenize`` (setting
  ``online_prompt_tokens``), whose token ids also give the prefix-block hashes,
  whenever they can change a decision: while online requests are held (the
  ordering uses the length) or the engine's slots or KV are short. When the
  dispatcher will submit the request at its next decision anyway, the length
  is estimated from the prompt's characters at a ratio learned from earlier
  ``/tokenize`` answers (``engine.TokenRatio``), which keeps one loopback round
  trip through the engine off the critical path (``docs/benchmarks/sidecar.md``);
  one such request in ``_CALIBRATE_EVERY`` is still tokenized, in the
  background, to keep the ratio current.

Deliberately left out: the control API (gRPC port only), authentication of
online clients (the Service/Gateway in front does that), request rewriting
beyond ``priority``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import HttpVersion11, web
from prometheus_client import CONTENT_TYPE_LATEST

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.textgen import block_hashes
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.controller import Controller, Grant, Ticket
from slipstream_sidecar.engine import EngineClient, TokenRatio, completion_prompts, prompt_chars
from slipstream_sidecar.errors import EngineError, EngineUnavailableError
from slipstream_sidecar.logging_filters import install_payload_filter
from slipstream_sidecar.metrics import EngineView, SidecarMetrics
from slipstream_sidecar.predictor import PromptLengths, Vector, prompt_text
from slipstream_sidecar.relay import CANCELLED, CLIENT_ERROR, ENGINE_ERROR, OK, Relay

log = logging.getLogger(__name__)

_ids = itertools.count()
_PREFIX = os.urandom(3).hex()
_DEFAULT_MAX_TOKENS = 256
# Plain-text prompts tokenized before estimates are trusted, and the background
# sampling period of estimated ones (keeps the learned ratio current).
_CALIBRATION_MIN = 4
_CALIBRATE_EVERY = 32
_ABSENT = object()


def error_response(status: int, message: str, err_type: str = "Bad Request") -> web.Response:
    """An error in vLLM's ErrorResponse shape (used only for the sidecar's own errors).

    A body the sidecar cannot read is one vLLM refuses in its request validation, whose
    ``type`` is the status phrase (``"Bad Request"``), so that is the default here.
    """
    doc = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(doc, status=status)


def unavailable(exc: EngineUnavailableError) -> web.Response:
    """503 for an engine that cannot be reached: a clean message (the details are logged)."""
    log.warning("engine unreachable: %s", exc)
    return error_response(503, exc.public, "ServiceUnavailableError")


def outcome_of(status: int) -> str:
    """The outcome label of a request the engine answered with ``status`` (not 200)."""
    return CLIENT_ERROR if 400 <= status < 500 else ENGINE_ERROR


@dataclass(slots=True)
class Admission:
    """One online request between its arrival and the engine (``Proxy.inspect``)."""

    arrival: float
    raw: bytes
    body: dict[str, Any]
    client_priority: bool  # the client sent a ``priority`` (removed from ``body``)
    asked: object  # max_tokens or max_completion_tokens as sent
    text: str | None  # the prompt's text, when the length predictor reads it
    sequences: int = 1  # sequences the engine runs for it: n choices of each prompt
    exact: bool = False  # the length is to be measured (/tokenize), not estimated
    prompt_tokens: int = 0
    max_tokens: int = 0
    hashes: tuple[int, ...] = ()
    vector: Vector | None = None


class ProxyState:
    """Flags the proxy shares with the rest of the sidecar."""

    def __init__(self) -> None:
        self.engine_ready = False
        self.draining = False
        self.max_model_len: int | None = None


class Proxy:
    """The aiohttp application serving online clients."""

    def __init__(
        self,
        engine: EngineClient,
        controller: Controller,
        metrics: SidecarMetrics,
        state: ProxyState,
        *,
        tokenize: bool = True,
        block_size: int = 16,
        lengths: PromptLengths | None = None,
    ) -> None:
        self.engine = engine
        self.controller = controller
        self.metrics = metrics
        self.state = state
        self._tokenize = tokenize
        self._bs = block_size
        self.lengths = lengths
        self._ttft = metrics.ttft.labels("online")
        self._to_engine = metrics.proxy_overhead.labels("to_engine")
        self._relay = metrics.proxy_overhead.labels("relay")
        self._tbt = metrics.tbt.labels("online")
        self._e2e = metrics.e2e.labels("online")
        self._tokens = metrics.output_tokens.labels("online")
        self.ratio = TokenRatio()
        self.estimated = 0  # online requests admitted on an estimated prompt length
        self._exact_pending = 0  # requests waiting for /tokenize before they arrive
        self._background: set[asyncio.Task[None]] = set()
        self.engine_view = EngineView(self._engine_metrics)  # the picker's vllm: series

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        # Served by the engine as by vLLM; passed through as they are.
        app.router.add_get("/v1/models/{model_id:.+}", self._forward)
        app.router.add_get("/version", self._forward)
        app.router.add_post("/tokenize", self._forward)
        app.router.add_post("/detokenize", self._forward)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        return app

    # -- simple routes ------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        if self.state.draining:
            return web.Response(status=503, text="draining")
        if not self.state.engine_ready:
            return web.Response(status=503, text="engine not ready")
        return web.Response(status=200, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        self.controller.refresh_gauges()
        if self.lengths is not None:
            self.lengths.refresh_gauges()
        held = self.controller.held["online"] + self._exact_pending
        resp = web.Response(body=self.metrics.render() + await self.engine_view.render(held))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp

    async def _engine_metrics(self) -> bytes | None:
        try:
            status, body, _ = await asyncio.wait_for(self.engine.get("/metrics"), 2.0)
        except (EngineUnavailableError, TimeoutError):
            return None
        return body if status == 200 else None

    async def _models(self, request: web.Request) -> web.Response:
        try:
            status, body, ctype = await self.engine.get("/v1/models")
        except EngineUnavailableError as exc:
            return unavailable(exc)
        return _passthrough(status, body, ctype)

    async def _forward(self, request: web.Request) -> web.Response:
        """A route the engine serves and the sidecar does not read: its answer as it is."""
        body = await request.read() if request.method == "POST" else None
        try:
            status, data, ctype = await self.engine.request(request.method, request.raw_path, body)
        except EngineUnavailableError as exc:
            return unavailable(exc)
        return _passthrough(status, data, ctype)

    # -- generation ---------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions")

    async def _generate(self, request: web.Request, path: str) -> web.StreamResponse:
        arrival = self.controller.now()
        if self.state.draining:
            return error_response(503, "the sidecar is draining", "ServiceUnavailableError")
        adm = self.inspect(await request.read(), arrival)
        if isinstance(adm, web.Response):
            self.metrics.finished.labels("online", CLIENT_ERROR).inc()
            return adm
        if adm.exact:
            refused = await self.measure(adm)
            if refused is not None:
                return refused
        ticket = self.register(adm)
        outcome = "cancelled"
        try:
            # Already granted when it fits at once (a done future: no loop turn here).
            data = self.engine_body(adm, await ticket.granted())
            self._to_engine.observe(self.controller.now() - arrival)
            if adm.body.get("stream"):
                resp, outcome = await self._stream(request, path, data, ticket)
            else:
                resp, outcome = await self._unary(path, data, ticket)
            return resp
        except EngineUnavailableError as exc:
            outcome = ENGINE_ERROR
            return unavailable(exc)
        finally:
            self.settle(adm, ticket, outcome, self.controller.now() - arrival)

    # -- admission, shared with the compiled front (front.py) ---------------------------------

    def inspect(self, raw: bytes, arrival: float) -> Admission | web.Response:
        """Read one generation request's body: what the dispatcher needs to know of it,
        its prompt length estimated when an exact one cannot matter (``_estimate_now``),
        else marked for :meth:`measure`; an error response for a body that is not a JSON
        object."""
        try:
            body = json.loads(raw)
        except RecursionError:
            return error_response(400, "request body is nested too deeply")
        except ValueError:
            return error_response(400, "request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body is not a JSON object")
        adm = self._admission(raw, body, arrival)
        fast = self._estimate_now(body, adm.asked)
        if fast is not None:
            adm.prompt_tokens, adm.max_tokens = fast
        else:
            adm.exact = True
            self._exact_pending += 1  # later arrivals wait for /tokenize too (no overtaking)
        return adm

    def inspect_sent(self, raw: bytes, arrival: float) -> Admission:
        """:meth:`inspect` for a request the compiled front already sent to the engine
        inside its allowance: its prompt length is estimated (the request is not held,
        so no exact length can change a decision), as for any request that cannot be
        held. A body this side cannot read (the front read it) still becomes an
        admission, sized by its bytes: the engine has it."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            body = {}
        adm = self._admission(raw, body, arrival)
        chars = prompt_chars(body) if self._tokenize else None
        if chars is None:
            adm.prompt_tokens = max(len(raw) // 4, 1)
        else:
            adm.prompt_tokens = self.ratio.estimate(chars)
            self._estimated(body, chars)
        adm.max_tokens = self._max_tokens(adm.asked, adm.prompt_tokens, adm.sequences)
        return adm

    def _admission(self, raw: bytes, body: dict[str, Any], arrival: float) -> Admission:
        """What both front doors read of a body: the client's priority (removed), the
        tokens asked for, the prompt's text when the length predictor reads it."""
        # NOTE: clients cannot raise their own priority; the dispatcher sets it.
        client_priority = body.pop("priority", _ABSENT) is not _ABSENT
        asked = body.get("max_tokens") or body.get("max_completion_tokens")
        lengths = self.lengths
        text = prompt_text(body) if lengths is not None and lengths.uses_text else None
        return Admission(arrival, raw, body, client_priority, asked, text, sequences(body))

    def register_sent(self, adms: list[Admission]) -> list[Ticket]:
        """Hand admissions of :meth:`inspect_sent` to the dispatcher, already granted."""
        return self.controller.register_sent([self._incoming(adm) for adm in adms])

    @property
    def tokenizes(self) -> bool:
        """Prompt lengths come from the engine's /tokenize (else bytes/4)."""
        return self._tokenize

    def allowance_ready(self) -> bool:
        """Whether estimated prompt lengths may be trusted yet (the front may send requests
        on arrival only then; until then each is measured and decided here)."""
        return not self._tokenize or self.ratio.observations >= _CALIBRATION_MIN

    async def measure(self, adm: Admission) -> web.Response | None:
        """The exact prompt length of an admission :meth:`inspect` marked ``exact`` (and its
        embedding when it may be held); an error response when the engine refuses it."""
        try:
            adm.prompt_tokens, adm.hashes = await self._measure(adm.body, adm.raw)
            adm.max_tokens = self._max_tokens(adm.asked, adm.prompt_tokens, adm.sequences)
            if adm.text is not None and not self.controller.online_fits_now(
                adm.prompt_tokens + adm.max_tokens
            ):
                # It may be held: its place in the order needs its predicted lengths.
                adm.vector = await self._embed(adm.text, adm.prompt_tokens)
        except EngineUnavailableError as exc:
            self.metrics.finished.labels("online", ENGINE_ERROR).inc()
            return unavailable(exc)
        except EngineError as exc:
            # /tokenize refused it (a model name, a prompt form it does not take): that
            # answer is not the request's. Sized by its bytes, the request goes on, and
            # what the engine says of the request itself is what the client gets.
            log.debug("/tokenize refused a prompt (%s); sized by its bytes", exc)
            adm.prompt_tokens, adm.hashes = max(len(adm.raw) // 4, 1), ()
            adm.max_tokens = self._max_tokens(adm.asked, adm.prompt_tokens, adm.sequences)
        finally:
            self._exact_pending -= 1
        return None

    def register(self, adm: Admission) -> Ticket:
        """Hand the admission to the dispatcher (granted at once when it fits)."""
        return self.controller.register(self._incoming(adm), grant_now=True)

    def _incoming(self, adm: Admission) -> Incoming:
        return Incoming(
            f"on-{_PREFIX}-{next(_ids)}",
            RequestClass.ONLINE,
            adm.prompt_tokens,
            adm.max_tokens,
            adm.arrival,
            vector=adm.vector,
            block_hashes=adm.hashes,
        )

    def engine_body(self, adm: Admission, grant: Grant) -> bytes:
        """The body sent to the engine: the client's, with the dispatcher's priority."""
        if adm.client_priority or not adm.body or not _spliceable(adm.raw):
            adm.body["priority"] = grant.priority
            return json.dumps(adm.body, separators=(",", ":")).encode()
        return with_priority(adm.raw, grant.priority)

    def splices(self, adm: Admission) -> bool:
        """Whether :meth:`engine_body` would splice the priority into the client's bytes."""
        return not adm.client_priority and bool(adm.body) and _spliceable(adm.raw)

    def settle(self, adm: Admission, ticket: Ticket, outcome: str, e2e_s: float) -> None:
        """The request has left (``outcome``): the dispatcher and the metrics are told."""
        if outcome != OK:
            self.controller.failed(ticket)
        elif adm.text is not None and adm.vector is None and self.lengths is not None:
            # Admitted without an embedding: the text history learns it in the background.
            self.lengths.learn(adm.text, adm.prompt_tokens, ticket.generated)
        self.metrics.finished.labels("online", outcome).inc()
        self._e2e.observe(e2e_s)

    async def _embed(self, text: str, prompt_tokens: int) -> Vector | None:
        assert self.lengths is not None
        try:
            return await self.lengths.embed_and_predict(text, prompt_tokens)
        except Exception as exc:  # the ordering falls back to the input length
            log.warning("prompt embedding failed (%s); keyed by input length", type(exc).__name__)
            return None

    def _max_tokens(self, asked: object, prompt_tokens: int, seqs: int = 1) -> int:
        """Output tokens the request may take: per sequence (``max_tokens``, else what the
        context leaves), times its sequences (``n`` choices of each prompt)."""
        if isinstance(asked, int) and asked >= 1:
            return asked * seqs
        mml = self.state.max_model_len
        per = mml - prompt_tokens // seqs if mml and mml > prompt_tokens // seqs else 0
        return (per or _DEFAULT_MAX_TOKENS) * seqs

    def _estimate_now(self, body: dict[str, Any], asked: object) -> tuple[int, int] | None:
        """(estimated prompt tokens, max tokens) when the exact count cannot matter, else None.

        It cannot matter when the dispatcher will submit the request at its next
        decision whatever its length: no request is waiting for ``/tokenize``
        (it would be overtaken) and the controller says every held online
        request plus this one fits the engine's free slots and KV.
        """
        if not self._tokenize or self._exact_pending:
            return None
        chars = prompt_chars(body)
        if chars is None or self.ratio.observations < _CALIBRATION_MIN:
            return None
        if not (isinstance(asked, int) and asked >= 1) and not self.state.max_model_len:
            return None
        prompt_tokens = self.ratio.estimate(chars)
        max_tokens = self._max_tokens(asked, prompt_tokens, sequences(body))
        if not self.controller.online_fits_now(prompt_tokens + max_tokens):
            return None
        self._estimated(body, chars)
        return prompt_tokens, max_tokens

    def _estimated(self, body: dict[str, Any], chars: int) -> None:
        """One more request admitted on an estimated length: every ``_CALIBRATE_EVERY``-th
        is tokenized in the background, to keep the learned ratio current."""
        self.estimated += 1
        if self.estimated % _CALIBRATE_EVERY == 0:
            task = asyncio.get_running_loop().create_task(self._calibrate(body, chars))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _calibrate(self, body: dict[str, Any], chars: int) -> None:
        try:
            tok = await self.engine.tokenize(body)
        except (EngineError, aiohttp.ClientError, RuntimeError) as exc:
            log.debug("background /tokenize failed: %r", exc)
            return
        self.ratio.observe(chars, tok.count)
        if tok.max_model_len:
            self.state.max_model_len = tok.max_model_len

    async def _measure(self, body: dict[str, Any], raw: bytes) -> tuple[int, tuple[int, ...]]:
        if not self._tokenize:
            return max(len(raw) // 4, 1), ()
        tok = await self.engine.tokenize(body)
        if tok.max_model_len:
            self.state.max_model_len = tok.max_model_len
        chars = prompt_chars(body)
        if chars is not None:
            self.ratio.observe(chars, tok.count)
        return max(tok.count, 1), block_hashes(tok.tokens, self._bs)

    async def _unary(
        self, path: str, data: bytes, ticket: Ticket
    ) -> tuple[web.StreamResponse, str]:
        status, content_type, body = await self.engine.fetch(path, data)
        if status != 200:
            return _passthrough(status, body, content_type), outcome_of(status)
        tokens = 0
        try:
            usage = json.loads(body).get("usage") or {}
            tokens = int(usage.get("completion_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            log.warning("engine answer without usage; counting 0 output tokens")
        self._tokens.inc(tokens)
        self.controller.finished(ticket, tokens)
        return _passthrough(200, body, content_type), OK

    async def _stream(
        self, request: web.Request, path: str, data: bytes, ticket: Ticket
    ) -> tuple[web.StreamResponse, str]:
        relay = Relay(ticket, self.controller, self._ttft, self._tbt)
        exchange = await self.engine.stream(path, data, relay)
        relay.bind(exchange)
        complete = False
        try:
            status, content_type = await relay.started
            if status != 200:
                await relay.done
                complete = True
                return _passthrough(status, relay.take_pending(), content_type), outcome_of(status)
            resp = web.StreamResponse(status=200)
            resp.headers["Content-Type"] = content_type or "text/event-stream; charset=utf-8"
            if request.version >= HttpVersion11:
                resp.enable_chunked_encoding()  # what aiohttp does anyway, but now it says so
            await resp.prepare(request)
            await relay.first
            # The bytes read so far go through aiohttp's writer (which knows the head is out);
            # the relay writes the rest from the engine connection's callbacks.
            t = self.controller.now()
            try:
                await resp.write(relay.take_pending())
            except ConnectionError:
                return resp, CANCELLED  # the client went away; the engine's request is aborted
            self._relay.observe(self.controller.now() - t)
            transport = request.transport
            if transport is None:
                return resp, CANCELLED
            relay.attach(transport, chunked=resp.chunked)
            outcome = await relay.done
            if outcome == ENGINE_ERROR:
                log.warning(
                    "engine stream of %s broke after %d events: %s",
                    ticket.request_id,
                    relay.counted,
                    relay.reason,
                )
                # Tell the client in-band, in vLLM's error shape, rather than ending the stream
                # cleanly: without [DONE] or an error a cut answer looks like a short one.
                with contextlib.suppress(ConnectionError):
                    await resp.write(_STREAM_BROKE)
                return resp, ENGINE_ERROR
            if outcome != OK:
                return resp, outcome
            complete = True
            await resp.write_eof()
            n = relay.tokens
            self._tokens.inc(n)
            self.controller.finished(ticket, n)
            return resp, OK
        finally:
            if not complete:
                exchange.abort()  # the engine aborts the request when its connection drops


_STREAM_BROKE = (
    b'data: {"error": {"message": "the inference engine stopped while streaming this answer; '
    b'it is incomplete", "type": "EngineStreamError", "param": null, "code": 502}}\n\n'
)


def sequences(body: dict[str, Any]) -> int:
    """Sequences the engine runs for a request: its ``n`` choices of each of its prompts
    (a completion's ``prompt`` may be a batch). At least 1."""
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    prompts = completion_prompts(body["prompt"]) if "prompt" in body else None
    return choices * (len(prompts) if prompts else 1)


def with_priority(raw: bytes, priority: int) -> bytes:
    """``raw`` (a non-empty JSON object without a ``priority`` member) with ``priority`` as
    its first member: the client's bytes otherwise unchanged, without re-encoding the
    body (whose prompt may be large) for every request."""
    start = raw.index(b"{") + 1
    return b'{"priority":%d,%s' % (priority, raw[start:])


def _spliceable(raw: bytes) -> bool:
    """UTF-8 (or ASCII) JSON starting with its object: not UTF-16/32, no byte-order mark."""
    return raw[:1] in _OBJECT_START and b"\x00" not in raw[:4]


_OBJECT_START = frozenset((b"{", b" ", b"\n", b"\r", b"\t"))


def _passthrough(status: int, body: bytes, content_type: str | None) -> web.Response:
    resp = web.Response(status=status, body=body)
    resp.headers["Content-Type"] = content_type or "application/json"
    return resp


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Start ``app`` on ``host:port`` (0: any free port); returns the runner and the port."""
    install_payload_filter()  # aiohttp would log the bytes of a malformed request (a prompt)
    # A client that hangs up cancels its handler: a held request leaves the queue at once,
    # an in-flight one's engine request is aborted without waiting for its next token.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    await asyncio.sleep(0)
    return runner, int(bound)
