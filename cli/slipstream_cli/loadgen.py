"""Replay an online trace as OpenAI streaming requests against sidecars, measuring TTFT/TBT.

The demo's (and the end-to-end tests') online client. A trace in the Azure LLM 2023 format
(``TIMESTAMP,ContextTokens,GeneratedTokens``) gives arrival times and lengths; arrivals are
re-based to 0 s and divided by ``speedup``. Each request is a streaming ``/v1/completions``
call whose prompt has exactly the trace's context length under the engine model's tokenizer
(words drawn with a seeded RNG, so prompts share no prefix, like the trace), with
``max_tokens`` and ``ignore_eos`` set to the trace's output length (capped). Targets are
used round-robin. The client measures, per request, the time to the first streamed token
(TTFT) and the gaps between later tokens (TBT), as a user would.

Bounded: at most ``max_requests`` requests, none issued after ``duration_s``, each with a
total timeout, at most ``concurrency`` open at once; :meth:`LoadGenerator.stop` ends it
early. Loopback only: every target address must lie in 127.0.0.0/8
(:class:`NotLoopbackError` otherwise).

Deliberately left out: chat completions, prompt text from real datasets (the Azure trace
has none), retries (a failed request is a result), and open-loop catch-up after overload
(a request is issued late rather than dropped; the lag is recorded).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
# Word ids of the engine model's tokenizer that round-trip one-to-one (slipstream_scheduler
# .textgen.Tokenizer: ids from 16 are its words with a leading space).
_WORD_IDS = range(16, 200)


KEEPALIVE_S = 2.0
"""An idle connection is reused for this long at most: below vLLM's own keep-alive
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s), as the sidecar's front and its Python client keep
theirs. With aiohttp's default (15 s) a request can go out on a connection vLLM is closing
at that moment, and fail with a reset or a disconnect that the engine never saw: three of
2,594 requests straight to vLLM in an engine-mode soak (docs/reliability.md, "Soak")."""


class LoadgenError(Exception):
    """The load generator cannot run as asked.

    LoadgenError
    ├── NotLoopbackError   a target outside 127.0.0.0/8 (``target``)
    └── TraceError         an unreadable trace (``path``, ``line``)
    """


class NotLoopbackError(LoadgenError):
    def __init__(self, target: str) -> None:
        super().__init__(f"{target}: the load generator only sends to 127.0.0.0/8")
        self.target = target


class TraceError(LoadgenError):
    def __init__(self, message: str, path: Path | None = None, line: int = 0) -> None:
        where = f"{path}:{line}: " if path is not None else ""
        super().__init__(where + message)
        self.path = path
        self.line = line


class LoadConfig(BaseModel):
    """How a trace is replayed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="`model` of every request (the served model name).")
    speedup: float = Field(
        1.0, gt=0, description="Arrival times are divided by this (2: twice as fast). Default 1."
    )
    duration_s: float = Field(
        120.0, gt=0, description="No request is issued after this many seconds. Default 120."
    )
    max_requests: int = Field(2000, ge=1, description="Requests issued at most. Default 2000.")
    max_prompt_tokens: int = Field(
        2048, ge=1, description="Prompt lengths are capped to this (tokens). Default 2048."
    )
    max_output_tokens: int = Field(
        256, ge=1, description="Output lengths are capped to this (tokens). Default 256."
    )
    concurrency: int = Field(256, ge=1, description="Requests open at once. Default 256.")
    request_timeout_s: float = Field(
        120.0, gt=0, description="Total timeout of one request (s). Default 120."
    )
    seed: int = Field(0, description="Seed of the prompt words. Default 0.")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace row: arrival offset (s, after speed-up) and lengths (tokens, after caps)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What the client saw of one request."""

    index: int
    target: str
    scheduled_s: float
    sent_s: float
    ok: bool
    status: int
    ttft_s: float | None
    gaps_s: tuple[float, ...]
    output_tokens: int
    error: str = ""
    ended_s: float = 0.0  # when the client saw the end: the last byte, the error or the status
    done: bool = False  # the stream ended with ``data: [DONE]``


@dataclass(frozen=True, slots=True)
class LoadSummary:
    """Aggregates of a run; latencies in seconds (None when nothing was measured)."""

    sent: int
    ok: int
    failed: int
    output_tokens: int
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_mean_s: float | None
    tbt_p99_s: float | None
    max_issue_lag_s: float

    def attainment(self, results: Sequence[RequestResult], ttft_s: float | None = None,
                   tbt_s: float | None = None) -> dict[str, float | None]:
        """Share of successful requests whose TTFT (token gaps, for TBT) met the target."""
        ok = [r for r in results if r.ok]
        out: dict[str, float | None] = {}
        if ttft_s is not None:
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            out["ttft"] = sum(t <= ttft_s for t in ttfts) / len(ttfts) if ttfts else None
        if tbt_s is not None:
            gaps = [g for r in ok for g in r.gaps_s]
            out["tbt"] = sum(g <= tbt_s for g in gaps) / len(gaps) if gaps else None
        return out


def check_loopback(url: str) -> str:
    """``url`` unchanged if its host is a numeric 127.0.0.0/8 address; else NotLoopbackError."""
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError as exc:
        raise NotLoopbackError(url) from exc
    if address not in LOOPBACK:
        raise NotLoopbackError(url)
    return url


def parse_azure(lines: Iterable[str], path: Path | None = None) -> list[tuple[float, int, int]]:
    """(arrival s from the first row, context tokens, generated tokens) of an Azure CSV.

    Rows with zero context or zero generated tokens are skipped (nothing to serve)."""
    from slipstream_cli.workloads import WorkloadError
    from slipstream_cli.workloads.azure import parse_lines

    try:
        requests = parse_lines(lines, prefix="loadgen")
    except (WorkloadError, ValueError) as exc:
        raise TraceError(str(exc), path) from exc
    return [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests]


def schedule(rows: Sequence[tuple[float, int, int]], config: LoadConfig) -> list[TraceRequest]:
    """The requests a run issues: speed-up, caps, and the count and time bounds applied."""
    out: list[TraceRequest] = []
    for arrival, prompt, output in rows:
        at = arrival / config.speedup
        if at > config.duration_s or len(out) >= config.max_requests:
            break
        out.append(TraceRequest(at, min(prompt, config.max_prompt_tokens),
                                min(output, config.max_output_tokens)))
    return out


def load_trace(path: Path, config: LoadConfig) -> list[TraceRequest]:
    """Read an Azure-format trace file and :func:`schedule` it."""
    try:
        with path.open(encoding="utf-8") as f:
            return schedule(parse_azure(f, path), config)
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc}", path) from exc


def prompt_text(tokens: int, rng: random.Random) -> str:
    """A prompt of exactly ``tokens`` tokens under the engine model's tokenizer."""
    from slipstream_scheduler.textgen import Tokenizer

    return Tokenizer().decode([rng.choice(_WORD_IDS) for _ in range(tokens)])


def stream_error(line: bytes) -> bool:
    """Whether one SSE line is an error event (``{"error": ...}`` or ``"object": "error"``),
    as vLLM and the sidecar send when a stream fails after its 200."""
    text = line.strip()
    if not text.startswith(b"data:") or b"error" not in text:
        return False
    try:
        chunk = json.loads(text[5:].strip())
    except ValueError:
        return False
    return isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error")


def stream_tokens(line: bytes) -> int | None:
    """Tokens carried by one SSE line of a completions stream (None: not a data chunk)."""
    text = line.strip()
    if not text.startswith(b"data:"):
        return None
    payload = text[5:].strip()
    if payload == b"[DONE]":
        return None
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    choices = chunk.get("choices") or []
    if not choices:
        return None
    piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or ""
    return 1 if piece else 0


def summarize(results: Sequence[RequestResult]) -> LoadSummary:
    ok = [r for r in results if r.ok]
    ttfts = np.array([r.ttft_s for r in ok if r.ttft_s is not None], dtype=float)
    gaps = np.array([g for r in ok for g in r.gaps_s], dtype=float)

    def stat(values: np.ndarray, q: float | None) -> float | None:
        if values.size == 0:
            return None
        return float(values.mean()) if q is None else float(np.quantile(values, q))

    return LoadSummary(
        sent=len(results),
        ok=len(ok),
        failed=len(results) - len(ok),
        output_tokens=sum(r.output_tokens for r in results),
        ttft_mean_s=stat(ttfts, None),
        ttft_p50_s=stat(ttfts, 0.5),
        ttft_p99_s=stat(ttfts, 0.99),
        tbt_mean_s=stat(gaps, None),
        tbt_p99_s=stat(gaps, 0.99),
        max_issue_lag_s=max((r.sent_s - r.scheduled_s for r in results), default=0.0),
    )


@dataclass
class LoadGenerator:
    """One bounded replay of ``requests`` against ``targets`` (base URLs of sidecars)."""

    targets: Sequence[str]
    requests: Sequence[TraceRequest]
    config: LoadConfig
    results: list[RequestResult] = field(default_factory=list)
    _stop: asyncio.Event | None = None

    def __post_init__(self) -> None:
        if not self.targets:
            raise LoadgenError("no targets to send to")
        for url in self.targets:
            check_loopback(url)

    def stop(self) -> None:
        """Issue nothing more (requests in flight finish or time out)."""
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> LoadSummary:
        self._stop = asyncio.Event()
        rng = random.Random(self.config.seed)
        limit = asyncio.Semaphore(self.config.concurrency)
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=self.config.concurrency,
                                         keepalive_timeout=KEEPALIVE_S)
        begin = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            for i, req in enumerate(self.requests):
                delay = req.arrival_s - (time.monotonic() - begin)
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), timeout=delay)
                if self._stop.is_set() or time.monotonic() - begin > self.config.duration_s:
                    break
                await limit.acquire()
                target = self.targets[i % len(self.targets)]
                prompt = prompt_text(req.prompt_tokens, rng)
                tasks.append(asyncio.create_task(self._one(
                    session, limit, i, target=target, req=req, prompt=prompt, begin=begin)))
            if tasks:
                await asyncio.gather(*tasks)
        self.results.sort(key=lambda r: r.index)
        return summarize(self.results)

    async def _one(self, session: aiohttp.ClientSession, limit: asyncio.Semaphore, index: int,
                   *, target: str, req: TraceRequest, prompt: str, begin: float) -> None:
        body = {
            "model": self.config.model,
            "prompt": prompt,
            "max_tokens": req.output_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        sent = time.monotonic()
        first: float | None = None
        last = sent
        gaps: list[float] = []
        tokens = 0
        status = 0
        error = ""
        done = False
        try:
            async with session.post(f"{target}/v1/completions", json=body) as response:
                status = response.status
                if status != 200:
                    error = (await response.text())[:300]
                else:
                    async for line in response.content:
                        if line.strip() == b"data: [DONE]":
                            done = True
                            continue
                        if stream_error(line):
                            error = line.decode(errors="replace").strip()[:300]
                        n = stream_tokens(line)
                        if not n:
                            continue
                        now = time.monotonic()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        tokens += n
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            limit.release()
        ok = status == 200 and not error and first is not None
        self.results.append(RequestResult(
            index=index, target=target, scheduled_s=req.arrival_s, sent_s=sent - begin, ok=ok,
            status=status, ttft_s=(first - sent) if first is not None else None,
            gaps_s=tuple(gaps), output_tokens=tokens, error=error,
            ended_s=time.monotonic() - begin, done=done,
        ))
