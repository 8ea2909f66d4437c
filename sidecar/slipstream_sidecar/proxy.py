"""The sidecar's online admission, and the routes it serves itself.

The pod's OpenAI HTTP port is served by the compiled front (``front.py``,
``slipstream-front``). For each generation request the front hands the
client's body to this process, where :class:`Proxy` reads what the dispatcher
needs (``inspect``, ``measure``), registers it (``register``) and, once it is
granted, tells the front the vLLM priority to send it with; the front
forwards the request and relays the answer byte for byte.

:meth:`Proxy.app` is the aiohttp application the front passes every other
route to, on a private Unix socket: ``GET /health`` (liveness: the process
answers), ``GET /ready`` (readiness: the engine's ``/health`` answered 200 at
the last check and no Drain is in progress), ``GET /metrics``, and the
engine's own routes, passed on as it answers them (``GET /v1/models``,
``/v1/models/{id}``, ``/version``, ``POST /tokenize``, ``/detokenize``).

Choices made here (``docs/sidecar.md``):

* A client's ``priority`` field is removed and replaced: clients never choose
  their class or priority; both come from the operator's configuration. A body
  without one is forwarded as the client's bytes with ``"priority":N`` put in
  front (by the front: a ``G`` grant), not decoded and encoded again.
* An online request that fits the engine when it arrives is granted inside
  ``Controller.register`` (``grant_now``), so its grant goes back to the front
  before this process yields to the event loop.
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
import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.textgen import block_hashes
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.controller import Controller, Grant, Ticket
from slipstream_sidecar.engine import EngineClient, TokenRatio, completion_prompts, prompt_chars
from slipstream_sidecar.errors import EngineError, EngineUnavailableError
from slipstream_sidecar.metrics import EngineView, SidecarMetrics
from slipstream_sidecar.predictor import PromptLengths, Vector, prompt_text

log = logging.getLogger(__name__)

_ids = itertools.count()
_PREFIX = os.urandom(3).hex()
_DEFAULT_MAX_TOKENS = 256
# Plain-text prompts tokenized before estimates are trusted, and the background
# sampling period of estimated ones (keeps the learned ratio current).
_CALIBRATION_MIN = 4
_CALIBRATE_EVERY = 32
_ABSENT = object()

# Outcome labels of ``slipstream_requests_finished_total``.
OK = "ok"
ENGINE_ERROR = "engine_error"
CLIENT_ERROR = "client_error"  # the request's own fault (4xx)


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
    """Online admission for the compiled front, and the routes it passes on (``app``)."""

    def __init__(
        self,
        engine: EngineClient,
        controller: Controller,
        metrics: SidecarMetrics,
        state: ProxyState,
        *,
        tokenize: bool = True,
        lengths: PromptLengths | None = None,
    ) -> None:
        self.engine = engine
        self.controller = controller
        self.metrics = metrics
        self.state = state
        self._tokenize = tokenize
        self.lengths = lengths
        self._e2e = metrics.e2e.labels("online")
        self.ratio = TokenRatio()
        self.estimated = 0  # online requests admitted on an estimated prompt length
        self._exact_pending = 0  # requests waiting for /tokenize before they arrive
        self._background: set[asyncio.Task[None]] = set()
        self.engine_view = EngineView(self._engine_metrics)  # the picker's vllm: series

    def app(self) -> web.Application:
        """The routes the front passes on (every one but the two generation routes)."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
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

    # -- admission (front.py) -----------------------------------------------------------------

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
        """What is read of every body: the client's priority (removed), the tokens asked
        for, the prompt's text when the length predictor reads it."""
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
        """The body for a grant the front cannot splice (``splices`` is false): the
        client's, decoded, with the dispatcher's priority."""
        adm.body["priority"] = grant.priority
        return json.dumps(adm.body, separators=(",", ":")).encode()

    def splices(self, adm: Admission) -> bool:
        """Whether the front may put the priority in front of the client's bytes as they are
        (a ``G`` grant): a non-empty UTF-8 JSON object that sent no priority of its own."""
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
        # In the dispatcher's block size, which follows the engine's (kvcache.py).
        return max(tok.count, 1), block_hashes(
            tok.tokens, self.controller.dispatcher.limits.block_size
        )


def sequences(body: dict[str, Any]) -> int:
    """Sequences the engine runs for a request: its ``n`` choices of each of its prompts
    (a completion's ``prompt`` may be a batch). At least 1."""
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    prompts = completion_prompts(body["prompt"]) if "prompt" in body else None
    return choices * (len(prompts) if prompts else 1)


def _spliceable(raw: bytes) -> bool:
    """UTF-8 (or ASCII) JSON starting with its object: not UTF-16/32, no byte-order mark."""
    return raw[:1] in _OBJECT_START and b"\x00" not in raw[:4]


_OBJECT_START = frozenset((b"{", b" ", b"\n", b"\r", b"\t"))


def _passthrough(status: int, body: bytes, content_type: str | None) -> web.Response:
    resp = web.Response(status=status, body=body)
    resp.headers["Content-Type"] = content_type or "application/json"
    return resp
