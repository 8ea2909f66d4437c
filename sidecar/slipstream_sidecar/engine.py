"""The sidecar's client of the engine's public HTTP API (vLLM's OpenAI server).

Online requests go to the engine from the compiled front (``front.py``); this
process's requests (offline work, ``/tokenize`` for prompt lengths and
prefix-block hashes, ``/health``, ``/v1/models`` and the other routes passed
on) share one pooled :class:`aiohttp.ClientSession`. Aborting a request is
closing its connection (vLLM cancels the request when the connection drops);
the connection is then not reused.

:class:`TokenRatio` estimates a prompt's token count from its characters, at a
tokens-per-character ratio learned from the engine's own ``/tokenize`` answers,
so the proxy can skip that round trip when the count cannot change a decision.

Deliberately left out: retries (callers decide) and any parsing of response
bodies beyond ``/tokenize`` and ``/v1/models``.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from slipstream_sidecar.errors import EngineError, unreachable

log = logging.getLogger(__name__)

JSON_HEADERS = {"Content-Type": "application/json"}


class Health(enum.Enum):
    """One check of the engine's ``/health``."""

    UP = "up"
    SILENT = "silent"  # no answer in time
    DOWN = "down"  # refused, reset, or an answer other than 200


@dataclass(frozen=True, slots=True)
class Tokenized:
    """The engine's ``/tokenize`` answer."""

    tokens: tuple[int, ...]  # of the (first) prompt
    max_model_len: int | None
    others: int = 0  # tokens of a batch's other prompts (``"prompt": ["a", "b"]``)

    @property
    def count(self) -> int:
        return len(self.tokens) + self.others


Prompt = str | tuple[int, ...]


def completion_prompts(prompt: object) -> list[Prompt] | None:
    """The prompts of a completion request's ``prompt`` in every form the OpenAI API and
    vLLM accept: text, token ids, a batch of texts or of token-id lists. None: neither."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(_is_id(t) for t in prompt):
        return [tuple(prompt)]
    out: list[Prompt] = []
    for p in prompt:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            out.append(tuple(p))
        else:
            return None
    return out


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def prompt_chars(request: dict[str, Any]) -> int | None:
    """Characters of text a completion or chat request asks the engine to tokenize.

    None: the prompt is not plain text (token ids, a batch of prompts, multimodal
    parts), so only ``/tokenize`` can count it.
    """
    if "messages" in request:
        msgs = request["messages"]
        if not isinstance(msgs, list):
            return None
        n = 0
        for m in msgs:
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, str):
                return None
            n += len(content) + _CHAT_OVERHEAD_CHARS
        return n
    prompt = request.get("prompt")
    return len(prompt) if isinstance(prompt, str) else None


# NOTE: a chat template adds role markers around each message; counted as this many
# characters per message (the learned ratio absorbs the rest).
_CHAT_OVERHEAD_CHARS = 16


class TokenRatio:
    """Tokens per character of the engine's tokenizer, learned from ``/tokenize`` answers.

    An exponentially weighted mean of ``tokens / chars`` (weight ``alpha`` per
    observation), starting at ``initial`` (about 4 characters per token for
    English text with a LLaMA-style tokenizer).
    """

    __slots__ = ("alpha", "observations", "ratio")

    def __init__(self, initial: float = 0.25, alpha: float = 0.05) -> None:
        self.ratio = initial
        self.alpha = alpha
        self.observations = 0

    def estimate(self, chars: int) -> int:
        """Estimated tokens of ``chars`` characters (at least 1)."""
        return max(1, round(chars * self.ratio))

    def observe(self, chars: int, tokens: int) -> None:
        if chars <= 0 or tokens <= 0:
            return
        r = tokens / chars
        # The first observations weigh more, so a fresh sidecar converges quickly.
        a = max(self.alpha, 1.0 / (self.observations + 1))
        self.ratio += a * (r - self.ratio)
        self.observations += 1


KEEPALIVE_S = 2.0
"""Seconds an idle engine connection is kept for reuse. Below the engine's own keep-alive
(vLLM's uvicorn closes an idle connection after 5 s): a request sent on a connection the
engine has just closed fails ("connection failed") without reaching it."""


class EngineClient:
    """Pooled HTTP client to one engine."""

    def __init__(
        self,
        base_url: str,
        *,
        connections: int,
        timeout_s: float,
        health_timeout_s: float = 2.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._connections = connections
        self._timeout_s = timeout_s
        self._health_timeout_s = health_timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._connections,
            limit_per_host=self._connections,
            ttl_dns_cache=None,
            keepalive_timeout=KEEPALIVE_S,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self._timeout_s, sock_connect=5.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("EngineClient.start() was not called")
        return self._session

    def url(self, path: str) -> str:
        return self.base_url + path

    async def post(self, path: str, body: bytes) -> aiohttp.ClientResponse:
        """Send a request; the caller reads and releases (or closes, to abort) the response."""
        try:
            return await self.session.post(self.url(path), data=body, headers=JSON_HEADERS)
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise unreachable(f"POST {path}", exc) from exc

    async def health(self) -> bool:
        """Whether the engine's ``/health`` answers 200 in time."""
        return await self.health_check() is Health.UP

    async def health_check(self) -> Health:
        """The engine's ``/health``: 200 in time (UP), no answer in time (SILENT: a busy host
        or a stalled engine, not yet a lost one), or a refused connection or any other answer
        (DOWN)."""
        try:
            async with self.session.get(
                self.url("/health"), timeout=aiohttp.ClientTimeout(total=self._health_timeout_s)
            ) as resp:
                await resp.read()
                return Health.UP if resp.status == 200 else Health.DOWN
        except TimeoutError:
            return Health.SILENT
        except aiohttp.ClientError:
            return Health.DOWN

    async def get(self, path: str) -> tuple[int, bytes, str]:
        """GET ``path``: (status, body, content type)."""
        return await self.request("GET", path)

    async def request(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, bytes, str]:
        """``method path`` with an optional JSON ``body``: (status, body, content type)."""
        headers = JSON_HEADERS if body is not None else None
        try:
            async with self.session.request(
                method, self.url(path), data=body, headers=headers
            ) as resp:
                return resp.status, await resp.read(), resp.content_type
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise unreachable(f"{method} {path}", exc) from exc

    async def first_model(self) -> str:
        status, body, _ = await self.get("/v1/models")
        if status != 200:
            raise EngineError("GET /v1/models failed", status=status, body=body)
        try:
            return str(json.loads(body)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError("GET /v1/models: unexpected answer", body=body) from exc

    async def tokenize(self, request: dict[str, Any]) -> Tokenized:
        """Tokenize a completion prompt or chat messages the way the engine will."""
        if "messages" in request:
            payload: dict[str, Any] = {
                "messages": request["messages"],
                "add_generation_prompt": True,
            }
            for key in (
                "model",
                "continue_final_message",
                "add_generation_prompt",
                "chat_template",
                "chat_template_kwargs",
            ):
                if key in request:
                    payload[key] = request[key]
            if payload.get("continue_final_message"):
                payload["add_generation_prompt"] = False
        else:
            prompts = completion_prompts(request.get("prompt", ""))
            if prompts is None:
                raise EngineError("the prompt is not text or token ids", status=400)
            found: list[Tokenized] = []
            for prompt in prompts:
                if isinstance(prompt, tuple):  # token ids: the engine takes them as they are
                    found.append(Tokenized(tokens=prompt, max_model_len=None))
                    continue
                one = {**request, "prompt": prompt}
                found.append(await self._tokenize_text(one))
            mml = next((t.max_model_len for t in found if t.max_model_len), None)
            rest = sum(t.count for t in found[1:])
            return Tokenized(tokens=found[0].tokens, max_model_len=mml, others=rest)
        return await self._post_tokenize(payload)

    async def _tokenize_text(self, request: dict[str, Any]) -> Tokenized:
        payload: dict[str, Any] = {"prompt": request["prompt"]}
        if "model" in request:
            payload["model"] = request["model"]
        if "add_special_tokens" in request:
            payload["add_special_tokens"] = request["add_special_tokens"]
        return await self._post_tokenize(payload)

    async def _post_tokenize(self, payload: dict[str, Any]) -> Tokenized:
        resp = await self.post("/tokenize", json.dumps(payload).encode())
        async with resp:
            body = await resp.read()
            if resp.status != 200:
                raise EngineError("POST /tokenize failed", status=resp.status, body=body)
        try:
            doc = json.loads(body)
            tokens = tuple(int(t) for t in doc["tokens"])
            mml = doc.get("max_model_len")
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError("POST /tokenize: unexpected answer", body=body) from exc
        return Tokenized(tokens=tokens, max_model_len=int(mml) if mml is not None else None)
