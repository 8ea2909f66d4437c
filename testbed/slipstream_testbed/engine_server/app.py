"""vLLM's OpenAI-compatible HTTP API in front of the real-time engine model.

Routes (vLLM v0.11 ``vllm/entrypoints/openai/api_server.py``):
``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as SSE
``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``, or one JSON body),
``POST /tokenize``, ``POST /detokenize``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health`` (200, empty body), ``GET /version``, ``GET /metrics``.

Response bodies have vLLM's keys, nesting and null fields:
completion chunks are dumped with every field (vLLM's ``exclude_unset=False``),
chat chunks with only the fields vLLM sets (``exclude_unset=True``), the final
usage chunk without nulls. Ids are ``cmpl-``/``chatcmpl-`` plus the
``X-Request-Id`` header, the body's ``request_id`` or a random hex uuid, as in
``OpenAIServing._base_request_id``. Errors are vLLM's
``{"error": {"message", "type", "param", "code"}}``.

Aborts: the server runs with aiohttp's handler cancellation, so a client that
closes the connection cancels its handler (streaming or not, like vLLM's
``@with_cancellation``); the handler then aborts the request in the driver,
which frees it in the engine before the next step.

Hot path: a streaming handler wakes once per engine step with all its new
tokens, renders each chunk from pre-rendered JSON fragments (only the text is
JSON-encoded per chunk) and writes the step's chunks in one ``write``.

``n > 1`` runs one engine request per choice (seeds ``seed``, ``seed + 1``, ...);
``logprobs`` come in vLLM's shapes with made-up values. The chat role chunk
goes out with the first output, as vLLM sends it (not at arrival).

Deliberately left out: echo, tools, guided decoding, embeddings, the Responses
API, LoRA and API keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web

from slipstream_scheduler.engine.errors import RequestError as EngineRequestError
from slipstream_scheduler.textgen import ChatMessage, Tokenizer, UnknownTokenError, render_chat
from slipstream_testbed.engine_server.driver import Delta, Driver, GenerationParams, Stream
from slipstream_testbed.engine_server.errors import RequestError, error_body
from slipstream_testbed.engine_server.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from slipstream_testbed.engine_server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_body,
)

logger = logging.getLogger(__name__)

__all__ = ["VLLM_VERSION", "ServerConfig", "build_app"]

VLLM_VERSION = "0.11.0"
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """What the HTTP layer needs to know about the served engine."""

    served_model_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    policy: str  # "priority" | "fcfs"
    default_seed: int


class _Api:
    """The route handlers, sharing the driver, tokenizer and metrics."""

    def __init__(
        self, cfg: ServerConfig, driver: Driver, tokenizer: Tokenizer, metrics: EngineMetrics
    ) -> None:
        self.cfg = cfg
        self.driver = driver
        self.tok = tokenizer
        self.metrics = metrics
        self.created = int(time.time())

    # -- shared checks ----------------------------------------------------------------------

    def _model_name(self, requested: str | None) -> str:
        names = self.cfg.served_model_names
        if requested is None or requested in names:
            return requested or names[0]
        raise RequestError(
            f"The model `{requested}` does not exist.",
            status=HTTPStatus.NOT_FOUND,
            err_type="NotFoundError",
            param="model",
        )

    def _check_priority(self, priority: int) -> None:
        if priority != 0 and self.cfg.policy != "priority":
            raise RequestError(
                f"Got priority {priority} but Priority scheduling is not enabled.",
                param="priority",
            )

    def _max_tokens(self, prompt_len: int, requested: int | None) -> int:
        limit = self.cfg.max_model_len
        if prompt_len >= limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt_len} input tokens. Please reduce the length of the "
                "input messages.",
                param="prompt",
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_len} input tokens ({requested} > {limit} - {prompt_len}).",
                param="max_tokens",
            )
        return requested

    def _check_ids(self, ids: list[int]) -> None:
        for token_id in ids:
            if not self.tok.is_valid(token_id):
                raise RequestError(f"Token id {token_id} is out of vocabulary", param="prompt")

    @staticmethod
    def _base_id(request: web.Request, body_id: str | None) -> str:
        return request.headers.get("X-Request-Id") or body_id or uuid.uuid4().hex

    def _params(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int
    ) -> GenerationParams:
        return GenerationParams(
            max_tokens=max_tokens,
            seed=self.cfg.default_seed if body.seed is None else body.seed,
            min_tokens=min(body.min_tokens, max_tokens),
            ignore_eos=body.ignore_eos,
            priority=body.priority,
            stop=body.stop_strings,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output,
        )

    def _submit(self, base_id: str, prompt_ids: list[int], params: GenerationParams) -> Stream:
        try:
            return self.driver.submit(base_id, prompt_ids, params)
        except EngineRequestError as exc:
            raise RequestError(exc.reason, param="prompt") from exc

    # -- completions ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(CompletionRequest, await _json(request))
        model = self._model_name(body.model)
        body.check_stream_options()
        self._check_priority(body.priority)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            ids = self.tok.encode(prompt, add_bos=body.add_special_tokens)
        else:
            ids = prompt
            self._check_ids(ids)
        if not ids:
            raise RequestError("The prompt cannot be empty.", param="prompt")
        params = self._params(body, self._max_tokens(len(ids), body.max_tokens))
        rid = "cmpl-" + self._base_id(request, body.request_id)
        logprobs = None if body.logprobs is None else _Logprobs(self.tok, body.logprobs, chat=False)
        choices = self._choices(rid, ids, params, body.n, logprobs)
        fmt = _CompletionFormat(rid, int(time.time()), model, bool(body.return_token_ids), ids)
        if body.stream:
            return await self._stream(request, choices, fmt, body.stream_options)
        return await self._full(choices, fmt)

    # -- chat completions -------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(ChatCompletionRequest, await _json(request))
        model = self._model_name(body.model)
        body.check_stream_options()
        body.check_generation_prompt()
        body.check_logprobs()
        self._check_priority(body.priority)
        text = render_chat(
            [ChatMessage(m.role, m.text()) for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
        ids = self.tok.encode(text, add_bos=body.add_special_tokens)
        params = self._params(body, self._max_tokens(len(ids), body.effective_max_tokens))
        rid = "chatcmpl-" + self._base_id(request, body.request_id)
        logprobs = _Logprobs(self.tok, body.top_logprobs or 0, chat=True) if body.logprobs else None
        choices = self._choices(rid, ids, params, body.n, logprobs)
        role = "assistant" if body.add_generation_prompt else body.messages[-1].role
        fmt = _ChatFormat(rid, int(time.time()), model, bool(body.return_token_ids), ids, role=role)
        if body.stream:
            return await self._stream(request, choices, fmt, body.stream_options)
        return await self._full(choices, fmt)

    def _choices(
        self,
        rid: str,
        ids: list[int],
        params: GenerationParams,
        n: int,
        logprobs: _Logprobs | None,
    ) -> list[_Choice]:
        """One engine request per choice, as vLLM's ``n``: the same prompt (its prefix
        cached after the first), seeds ``seed``, ``seed + 1``, ..."""
        if n == 1:
            return [_Choice(0, self._submit(rid, ids, params), logprobs)]
        out: list[_Choice] = []
        try:
            for i in range(n):
                child = dataclasses.replace(params, seed=params.seed + i)
                out.append(_Choice(i, self._submit(f"{i}_{rid}", ids, child), logprobs))
        except RequestError:
            for c in out:
                self.driver.abort(c.stream)
            raise
        return out

    # -- the two response modes -------------------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        choices: list[_Choice],
        fmt: _CompletionFormat | _ChatFormat,
        options: Any,
    ) -> web.StreamResponse:
        include_usage = bool(options is not None and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        # vLLM sends the role chunk(s) with the first output, not at arrival.
        head = fmt.head(len(choices), continuous)
        try:
            await resp.prepare(request)
            while True:
                got = await _next_deltas(choices)
                out = b""
                for choice, delta in got:
                    if delta is None:
                        choice.done = True
                        continue
                    if delta.finish_reason == "abort":
                        err = error_body(
                            "Request aborted by the engine",
                            "BadRequestError",
                            HTTPStatus.BAD_REQUEST,
                        )
                        await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n" + _DONE)
                        return resp
                    out += fmt.chunk(delta, choice, _produced(choices), continuous)
                    if delta.finish_reason is not None:
                        choice.done = True
                if head and out:
                    out, head = head + out, b""
                if all(c.done for c in choices):
                    if include_usage:
                        out += fmt.usage_chunk(_produced(choices))
                    await resp.write(out + _DONE)
                    break
                if out:
                    await resp.write(out)
            await resp.write_eof()
            return resp
        except (ConnectionError, asyncio.CancelledError):
            logger.debug("client of %s went away", choices[0].stream.request_id)
            raise
        finally:
            for c in choices:
                if c.task is not None:
                    c.task.cancel()
                if not c.stream.finished:
                    self.driver.abort(c.stream)

    async def _full(
        self, choices: list[_Choice], fmt: _CompletionFormat | _ChatFormat
    ) -> web.StreamResponse:
        try:
            await asyncio.gather(*(_collect(c) for c in choices))
        finally:
            for c in choices:
                if not c.stream.finished:
                    self.driver.abort(c.stream)
        if any(c.last is None or c.last.finish_reason == "abort" for c in choices):
            raise RequestError("Request aborted by the engine")
        body = fmt.full(choices, _produced(choices))
        return web.Response(body=body, content_type="application/json")

    # -- tokenizer endpoints ----------------------------------------------------------------

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        raw = await _json(request)
        if isinstance(raw, dict) and "messages" in raw:
            chat = parse_body(TokenizeChatRequest, raw)
            self._model_name(chat.model)
            if chat.continue_final_message and chat.add_generation_prompt:
                raise RequestError(
                    "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                    param="continue_final_message",
                )
            text = render_chat(
                [ChatMessage(m.role, m.text()) for m in chat.messages],
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
            )
            ids = self.tok.encode(text, add_bos=chat.add_special_tokens)
            want_strs = bool(chat.return_token_strs)
        else:
            plain = parse_body(TokenizeCompletionRequest, raw)
            self._model_name(plain.model)
            ids = self.tok.encode(plain.prompt, add_bos=plain.add_special_tokens)
            want_strs = bool(plain.return_token_strs)
        return _json_response(
            {
                "count": len(ids),
                "max_model_len": self.cfg.max_model_len,
                "tokens": ids,
                "token_strs": [self.tok.token_str(i) for i in ids] if want_strs else None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(DetokenizeRequest, await _json(request))
        self._model_name(body.model)
        try:
            text = self.tok.decode(body.tokens)
        except UnknownTokenError as exc:
            raise RequestError(
                f"Token id {exc.token_id} is out of vocabulary", param="tokens"
            ) from exc
        return _json_response({"prompt": text})

    # -- informational endpoints ------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        del request
        cards = [self._card(name) for name in self.cfg.served_model_names]
        return _json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models/{model_id}``: one card, or vLLM's 404 for an unknown model."""
        name = request.match_info["model_id"]
        self._model_name(name)
        return _json_response(self._card(name))

    def _card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": self.cfg.model_root,
            "parent": None,
            "max_model_len": self.cfg.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def health(self, request: web.Request) -> web.StreamResponse:
        del request
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.StreamResponse:
        del request
        return _json_response({"version": VLLM_VERSION})

    async def prom(self, request: web.Request) -> web.StreamResponse:
        del request
        resp = web.Response(body=self.metrics.exposition())
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return resp


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"Invalid JSON body: {exc}", err_type="Bad Request") from exc
    except RecursionError as exc:
        raise RequestError("Invalid JSON body: nested too deeply", err_type="Bad Request") from exc


# -- response rendering ---------------------------------------------------------------------


def _json_response(body: Any, status: int = 200) -> web.Response:
    """Compact JSON, like FastAPI's ``JSONResponse`` in vLLM."""
    return web.Response(body=_dumps(body).encode(), status=status, content_type="application/json")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(prompt: int, completion: int, *, details: bool) -> str:
    tail = ',"prompt_tokens_details":null' if details else ""
    return (
        f'{{"prompt_tokens":{prompt},"total_tokens":{prompt + completion},'
        f'"completion_tokens":{completion}{tail}}}'
    )


class _Logprobs:
    """Log probabilities in vLLM's shapes, made up deterministically (the engine model has
    no distribution): the sampled token is the most likely, then ``k`` alternatives from
    the generation vocabulary, each less likely. ``k`` is completions' ``logprobs`` or
    chat's ``top_logprobs``."""

    def __init__(self, tok: Tokenizer, k: int, *, chat: bool) -> None:
        self.tok = tok
        self.k = k
        self.chat = chat
        self._gen = tok.generation_ids
        self._rank = {t: i for i, t in enumerate(self._gen)}

    def _entry(self, token_id: int, pos: int) -> tuple[str, float, list[tuple[str, float]]]:
        text = self.tok.token_str(token_id)
        lp = -round(0.02 + (hash((pos, token_id)) % 9973) / 9973 * 2.5, 4)
        start = self._rank.get(token_id, token_id % len(self._gen))
        alts: list[tuple[str, float]] = []
        j = 1
        while len(alts) < self.k and j <= len(self._gen):
            alt = self.tok.token_str(self._gen[(start + 7 * j) % len(self._gen)])
            if alt != text and all(alt != a for a, _ in alts):
                alts.append((alt, round(lp - 0.3 * len(alts) - 0.05, 4)))
            j += 1
        return text, lp, alts

    def completion(self, ids: tuple[int, ...], choice: _Choice) -> dict[str, Any]:
        """vLLM's ``CompletionLogProbs`` of ``ids``, the choice's next tokens."""
        offsets: list[int] = []
        lps: list[float] = []
        tokens: list[str] = []
        tops: list[dict[str, float]] = []
        for token_id in ids:
            text, lp, alts = self._entry(token_id, choice.pos)
            offsets.append(choice.offset)
            lps.append(lp)
            tokens.append(text)
            tops.append({text: lp, **dict(alts)})
            choice.pos += 1
            choice.offset += len(text)
        return {
            "text_offset": offsets,
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": tops,
        }

    def chat_content(self, ids: tuple[int, ...], choice: _Choice) -> list[dict[str, Any]]:
        """vLLM's ``ChatCompletionLogProbsContent`` entries of ``ids``."""
        out: list[dict[str, Any]] = []
        for token_id in ids:
            text, lp, alts = self._entry(token_id, choice.pos)
            top = [(text, lp), *alts][: self.k]
            out.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top
                    ],
                }
            )
            choice.pos += 1
        return out

    def of(self, ids: tuple[int, ...], choice: _Choice) -> dict[str, Any]:
        """The ``logprobs`` object of one chunk (or of a whole answer) for ``ids``."""
        if self.chat:
            return {"content": self.chat_content(ids, choice)}
        return self.completion(ids, choice)


@dataclass(slots=True)
class _Choice:
    """One of a request's ``n`` choices: its engine request and what was sent of it."""

    index: int
    stream: Stream
    logprobs: _Logprobs | None
    done: bool = False
    task: asyncio.Future[Delta | None] | None = None
    pos: int = 0  # output tokens given logprobs so far
    offset: int = 0  # characters of output text so far (completions' text_offset)
    parts: list[str] = field(default_factory=list)  # a whole answer's text
    ids: list[int] = field(default_factory=list)
    last: Delta | None = None

    def logprobs_json(self, delta: Delta) -> str:
        if self.logprobs is None:
            return "null"
        return _dumps(self.logprobs.of(delta.token_ids, self))


async def _next_deltas(choices: list[_Choice]) -> list[tuple[_Choice, Delta | None]]:
    """The next output of a request: of its one choice, or of whichever of its choices
    produced first (each at most once)."""
    if len(choices) == 1:
        one = choices[0]
        return [(one, await one.stream.next_delta())]
    for c in choices:
        if not c.done and c.task is None:
            c.task = asyncio.ensure_future(c.stream.next_delta())
    waiting = [c.task for c in choices if c.task is not None]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    out: list[tuple[_Choice, Delta | None]] = []
    for c in choices:
        if c.task is not None and c.task.done():
            out.append((c, c.task.result()))
            c.task = None
    return out


async def _collect(choice: _Choice) -> None:
    """A whole answer of one choice (its text, ids and last delta)."""
    while True:
        delta = await choice.stream.next_delta()
        if delta is None:
            return
        choice.parts.append(delta.text)
        choice.ids.extend(delta.token_ids)
        choice.last = delta
        if delta.finish_reason is not None:
            return


def _produced(choices: list[_Choice]) -> int:
    """Output tokens of all a request's choices so far (vLLM's ``completion_tokens``)."""
    return sum(c.stream.completion_tokens for c in choices)


class _CompletionFormat:
    """``text_completion`` bodies (vLLM ``CompletionStreamResponse``/``CompletionResponse``)."""

    def __init__(
        self, rid: str, created: int, model: str, return_ids: bool, prompt_ids: list[int]
    ) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.return_ids = return_ids
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self._sent_prompt_ids: set[int] = set()
        self._head = (
            f'data: {{"id":{_dumps(rid)},"object":"text_completion","created":{created},'
            f'"model":{_dumps(model)},"choices":[{{"index":'
        ).encode()

    def head(self, n: int, continuous: bool) -> bytes:
        del n, continuous
        return b""

    def chunk(
        self, delta: Delta, choice: _Choice, completion_tokens: int, continuous: bool
    ) -> bytes:
        prompt_ids = "null"
        token_ids = "null"
        if self.return_ids:
            token_ids = _dumps(list(delta.token_ids))
            if choice.index not in self._sent_prompt_ids:
                prompt_ids = _dumps(self.prompt_ids)
                self._sent_prompt_ids.add(choice.index)
        usage = _usage(self.prompt_len, completion_tokens, details=True) if continuous else "null"
        finish = _dumps(delta.finish_reason)
        tail = (
            f',"logprobs":{choice.logprobs_json(delta)},"finish_reason":{finish},'
            f'"stop_reason":{_dumps(delta.stop_reason)},'
            f'"prompt_token_ids":{prompt_ids},"token_ids":{token_ids}}}],"usage":{usage}}}\n\n'
        )
        return (
            self._head
            + b"%d" % choice.index
            + b',"text":'
            + _dumps(delta.text).encode()
            + tail.encode()
        )

    def usage_chunk(self, completion_tokens: int) -> bytes:
        return (
            f'data: {{"id":{_dumps(self.rid)},"object":"text_completion",'
            f'"created":{self.created},"model":{_dumps(self.model)},"choices":[],'
            f'"usage":{_usage(self.prompt_len, completion_tokens, details=False)}}}\n\n'
        ).encode()

    def full(self, choices: list[_Choice], completion_tokens: int) -> bytes:
        out = []
        for c in choices:
            assert c.last is not None
            lp = None if c.logprobs is None else c.logprobs.completion(tuple(c.ids), c)
            out.append(
                {
                    "index": c.index,
                    "text": "".join(c.parts),
                    "logprobs": lp,
                    "finish_reason": c.last.finish_reason,
                    "stop_reason": c.last.stop_reason,
                    "token_ids": c.ids if self.return_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": self.prompt_ids if self.return_ids else None,
                }
            )
        body = {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": json.loads(_usage(self.prompt_len, completion_tokens, details=True)),
            "kv_transfer_params": None,
        }
        return _dumps(body).encode()


class _ChatFormat:
    """``chat.completion`` bodies (vLLM ``ChatCompletionStreamResponse``/``...Response``)."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        return_ids: bool,
        prompt_ids: list[int],
        *,
        role: str,
    ) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.return_ids = return_ids
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.role = role
        self._prefix = (
            f'data: {{"id":{_dumps(rid)},"object":"chat.completion.chunk","created":{created},'
            f'"model":{_dumps(model)},"choices":['
        )
        self._content_head = (self._prefix + '{"index":').encode()

    def head(self, n: int, continuous: bool) -> bytes:
        """The role chunk of each choice (sent with the first output, as vLLM does)."""
        prompt_ids = _dumps(self.prompt_ids) if self.return_ids else "null"
        usage = f',"usage":{_usage(self.prompt_len, 0, details=False)}' if continuous else ""
        return b"".join(
            (
                f'{self._prefix}{{"index":{i},"delta":{{"role":{_dumps(self.role)},"content":""}},'
                f'"logprobs":null,"finish_reason":null}}],"prompt_token_ids":{prompt_ids}{usage}}}'
                "\n\n"
            ).encode()
            for i in range(n)
        )

    def chunk(
        self, delta: Delta, choice: _Choice, completion_tokens: int, continuous: bool
    ) -> bytes:
        token_ids = _dumps(list(delta.token_ids)) if self.return_ids else "null"
        usage = (
            f',"usage":{_usage(self.prompt_len, completion_tokens, details=False)}'
            if continuous
            else ""
        )
        logprobs = choice.logprobs_json(delta)
        if delta.finish_reason is None:
            tail = (
                f'}},"logprobs":{logprobs},"finish_reason":null,"token_ids":{token_ids}}}]'
                f"{usage}}}\n\n"
            )
        else:
            tail = (
                f'}},"logprobs":{logprobs},"finish_reason":{_dumps(delta.finish_reason)},'
                f'"stop_reason":{_dumps(delta.stop_reason)},"token_ids":{token_ids}}}]{usage}}}\n\n'
            )
        return (
            self._content_head
            + b'%d,"delta":{"content":' % choice.index
            + _dumps(delta.text).encode()
            + tail.encode()
        )

    def usage_chunk(self, completion_tokens: int) -> bytes:
        return (
            f'{self._prefix}],"usage":{_usage(self.prompt_len, completion_tokens, details=False)}'
            "}\n\n"
        ).encode()

    def full(self, choices: list[_Choice], completion_tokens: int) -> bytes:
        out = []
        for c in choices:
            assert c.last is not None
            lp = (
                None
                if c.logprobs is None
                else {"content": c.logprobs.chat_content(tuple(c.ids), c)}
            )
            out.append(
                {
                    "index": c.index,
                    "message": {
                        "role": self.role,
                        "content": "".join(c.parts),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": lp,
                    "finish_reason": c.last.finish_reason,
                    "stop_reason": c.last.stop_reason,
                    "token_ids": c.ids if self.return_ids else None,
                }
            )
        body = {
            "id": self.rid,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": out,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": json.loads(_usage(self.prompt_len, completion_tokens, details=True)),
            "prompt_logprobs": None,
            "prompt_token_ids": self.prompt_ids if self.return_ids else None,
            "kv_transfer_params": None,
        }
        return _dumps(body).encode()


# -- application ----------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return _json_response(exc.body(), status=int(exc.status))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        status = HTTPStatus(exc.status)
        return _json_response(
            error_body(exc.reason or status.phrase, status.phrase, status), status=exc.status
        )
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        logger.exception("internal error serving %s", request.path)
        return _json_response(
            error_body(
                "Internal server error", "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR
            ),
            status=500,
        )


def build_app(
    cfg: ServerConfig, driver: Driver, tokenizer: Tokenizer, metrics: EngineMetrics
) -> web.Application:
    """The aiohttp application; the driver is started and stopped with it."""
    api = _Api(cfg, driver, tokenizer, metrics)
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024**2)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model_id:.+}", api.model)
    app.router.add_get("/health", api.health)
    app.router.add_get("/version", api.version)
    app.router.add_get("/metrics", api.prom)

    async def lifecycle(_: web.Application) -> Any:
        driver.start()
        yield
        await driver.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
