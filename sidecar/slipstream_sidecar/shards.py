"""Offline shard execution: OpenAI Batch lines through the dispatcher into durable output.

A shard is lines ``[line_start, line_end)`` of an OpenAI Batch JSONL input.
:class:`ShardRunner` reads them (fsspec), skips the lines whose records are
already in the output or error log (a restart), and runs each remaining line
as an offline request held by the dispatcher, at most ``shard_window`` at a
time. Every line ends as exactly one record: a success in the output log, or
an error record naming the line in the error log.

One offline request, as carried out here:

1. ``/tokenize`` gives the prompt's tokens (length, prefix-block hashes, and
   the oversized-prompt check against ``max_model_len``);
2. it is registered with the dispatcher and waits for a submit;
3. it streams from the engine with ``continuous_usage_stats`` (exact token
   counts) and accumulates the text (``assemble.py``);
4. if the dispatcher aborts it (preemption) the stream is closed, the
   dispatcher is told, and the next submit resumes it as a continuation: the
   prompt's token ids plus the output's, sent as a completion whether the line
   is a completion or a chat (a chat prompt's ids are its chat template's
   output), because text does not always tokenize back to the tokens that
   wrote it; only where the engine gave no token ids, the prompt plus the text
   so far (for chat: a final assistant message with
   ``continue_final_message``); ``max_tokens`` reduced by the tokens so far;
5. if the engine goes away mid-stream, what was received is kept, the request
   leaves the dispatcher, and it is registered again as a continuation once
   the engine is ready again;
6. when the stream finishes, the assembled non-streaming body is appended to
   the output log (fsynced) and the dispatcher is told.

Deliberately left out: scheduling (the dispatcher's), the control API
(``grpc_server.py``) and HTTP details (``engine.py``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import fsspec

from slipstream_scheduler.dispatcher import Incoming
from slipstream_scheduler.storage_scope import ScopeError, check_resolved_path
from slipstream_scheduler.textgen import block_hashes
from slipstream_scheduler.types import RequestClass
from slipstream_sidecar.assemble import Assembly
from slipstream_sidecar.batch_io import (
    BatchRequest,
    DurableLog,
    custom_id_of,
    error_record,
    local_path,
    parse_line,
    success_record,
)
from slipstream_sidecar.controller import Controller, Ticket
from slipstream_sidecar.engine import EngineClient
from slipstream_sidecar.errors import (
    BatchLineError,
    EngineError,
    EngineUnavailableError,
    ShardIOError,
)
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.sse import EventScanner

log = logging.getLogger(__name__)


class ShardState(enum.IntEnum):
    """Mirrors the proto's ShardState values."""

    PENDING = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    REVOKED = 5


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One assigned shard (the proto's ``Shard`` as a value)."""

    shard_id: str
    job_namespace: str
    job_name: str
    model: str
    input_uri: str
    line_start: int
    line_end: int
    output_uri: str
    error_uri: str
    priority: int = 0
    request_defaults: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(slots=True)
class ShardProgress:
    shard_id: str
    state: ShardState
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    tokens_per_second: float = 0.0
    message: str = ""


class _Outcome(enum.Enum):
    DONE = 1
    ABORTED = 2
    ENGINE_DOWN = 3
    HTTP_ERROR = 4


class EngineWatch:
    """The engine's readiness, shared by the proxy's /ready and the shard runners."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()

    def set(self, ready: bool) -> None:
        if ready:
            self.ready.set()
        else:
            self.ready.clear()

    async def wait(self) -> None:
        await self.ready.wait()


def duplicate_lines(lines: Sequence[tuple[int, bytes]]) -> dict[int, tuple[int, str]]:
    """Map each line that repeats an earlier line's custom_id to (that first line, the id).

    Derived from the shard's input alone (lines in input order), so a restarted runner makes
    the same decision: the first line is served, every later line with the id becomes a
    ``duplicate_custom_id`` error record.
    """
    first: dict[str, int] = {}
    dups: dict[int, tuple[int, str]] = {}
    for line_no, raw in lines:
        cid = custom_id_of(raw)
        if cid is None:
            continue
        seen = first.setdefault(cid, line_no)
        if seen != line_no:
            dups[line_no] = (seen, cid)
    return dups


class ShardRunner:
    """Runs one shard to completion (or revocation)."""

    def __init__(
        self,
        spec: ShardSpec,
        *,
        controller: Controller,
        engine: EngineClient,
        metrics: SidecarMetrics,
        watch: EngineWatch,
        window: int,
        max_retries: int,
        staging_dir: Path | None,
        storage_roots: Sequence[str] = (),
        clock: Callable[[], float] = time.monotonic,
        engine_xargs: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        # Engine mode: the ``vllm_xargs`` that mark a request offline to vLLM's plugin.
        self._xargs = dict(engine_xargs or {})
        self.controller = controller
        self.engine = engine
        self.metrics = metrics
        self.watch = watch
        self._window = window
        self._max_retries = max_retries
        self._staging = staging_dir
        self._roots = tuple(storage_roots)
        self._clock = clock
        self.progress = ShardProgress(spec.shard_id, ShardState.PENDING)
        self._task: asyncio.Task[None] | None = None
        self._out: DurableLog | None = None
        self._err: DurableLog | None = None
        self._lock = asyncio.Lock()
        self._started_s = 0.0
        self._tokens_at_start = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"shard-{self.spec.shard_id}"
        )

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    async def revoke(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.progress.state = ShardState.REVOKED
            self.progress.in_flight = 0

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def snapshot(self) -> ShardProgress:
        p = self.progress
        if p.state == ShardState.RUNNING:
            elapsed = self._clock() - self._started_s
            if elapsed > 0:
                p.tokens_per_second = (p.output_tokens - self._tokens_at_start) / elapsed
        return ShardProgress(**{k: getattr(p, k) for k in p.__slots__})

    # -- the shard ----------------------------------------------------------------------------

    def _in_scope(self, path: Path, field_name: str) -> None:
        """Refuse a local file whose resolved path (links followed) leaves the job's storage."""
        if not self._roots:
            return
        try:
            check_resolved_path(
                os.path.realpath(path), namespace=self.spec.job_namespace, roots=self._roots,
                field=field_name,
            )
        except ScopeError as exc:
            raise ShardIOError(self.spec.shard_id, str(path), str(exc)) from exc

    def _log_path(self, uri: str, kind: str) -> Path:
        path = local_path(uri)
        if path is not None:
            self._in_scope(path, "output_uri" if kind == "output" else "error_uri")
            return path
        if self._staging is None:
            raise ShardIOError(self.spec.shard_id, uri, "non-local output needs --state-dir")
        return self._staging / "shards" / self.spec.shard_id / f"{kind}.jsonl"

    async def _run(self) -> None:
        spec = self.spec
        try:
            out_path = self._log_path(spec.output_uri, "output")
            err_path = self._log_path(spec.error_uri, "errors")
            self._out, self._err = DurableLog(out_path), DurableLog(err_path)
            await asyncio.to_thread(self._out.open)
            await asyncio.to_thread(self._err.open)
            lines = await asyncio.to_thread(self._read_lines)
        except (OSError, ValueError, ShardIOError) as exc:
            self.progress.state = ShardState.FAILED
            self.progress.message = str(exc)
            log.error("shard %s cannot start: %s", spec.shard_id, exc)
            self._close_logs()
            return
        p = self.progress
        p.total = len(lines)
        p.state = ShardState.RUNNING
        self._started_s = self._clock()
        done_lines = self._out.index.lines | self._err.index.lines
        # A custom_id already in the *output* (a success of a line we cannot place) is not served
        # again; ids in the error log do not count, as a later line's duplicate_custom_id record
        # may be there before its first line was served.
        done_ids = set(self._out.index.custom_ids)
        dups = duplicate_lines(lines)
        p.completed = sum(1 for n, _ in lines if n in self._out.index.lines)
        p.failed = sum(1 for n, _ in lines if n in self._err.index.lines)
        todo = [(n, raw) for n, raw in lines if n not in done_lines]
        log.info(
            "shard %s: %d lines, %d already done, %d to run",
            spec.shard_id, len(lines), len(lines) - len(todo), len(todo),
        )
        sem = asyncio.Semaphore(self._window)
        tasks: set[asyncio.Task[None]] = set()
        try:
            for line_no, raw in todo:
                await sem.acquire()
                t = asyncio.get_running_loop().create_task(
                    self._line(line_no, raw, done_ids, dups.get(line_no)),
                    name=f"line-{spec.shard_id}-{line_no}",
                )
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                t.add_done_callback(lambda _t: sem.release())
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await asyncio.to_thread(self._upload)
            p.state = ShardState.SUCCEEDED
            log.info(
                "shard %s succeeded: %d completed, %d failed",
                spec.shard_id, p.completed, p.failed,
            )
        except asyncio.CancelledError:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
            raise
        except (OSError, ShardIOError) as exc:
            p.state = ShardState.FAILED
            p.message = str(exc)
            log.error("shard %s failed: %s", spec.shard_id, exc)
        finally:
            self._close_logs()

    def _close_logs(self) -> None:
        for lg in (self._out, self._err):
            if lg is not None:
                lg.close()

    def _read_lines(self) -> list[tuple[int, bytes]]:
        spec = self.spec
        out: list[tuple[int, bytes]] = []
        local = local_path(spec.input_uri)
        if local is not None:
            self._in_scope(local, "input_uri")
        try:
            with fsspec.open(spec.input_uri, "rb") as f:
                for n, raw in enumerate(f):
                    if n >= spec.line_end:
                        break
                    if n >= spec.line_start:
                        out.append((n, raw))
        except (OSError, ValueError) as exc:
            raise ShardIOError(spec.shard_id, spec.input_uri, str(exc)) from exc
        return out

    def _upload(self) -> None:
        for uri, lg in ((self.spec.output_uri, self._out), (self.spec.error_uri, self._err)):
            if local_path(uri) is None and lg is not None:
                try:
                    fs, path = fsspec.core.url_to_fs(uri)
                    fs.put_file(str(lg.path), path)
                except (OSError, ValueError) as exc:
                    raise ShardIOError(self.spec.shard_id, uri, str(exc)) from exc

    async def _append(self, lg: DurableLog | None, line_no: int, record: bytes) -> bool:
        assert lg is not None
        async with self._lock:
            if line_no in self._out.index.lines or line_no in self._err.index.lines:  # type: ignore[union-attr]
                return False
            await asyncio.to_thread(lg.append, record)
            return True

    async def _fail_line(self, err: BatchLineError) -> None:
        rec = error_record(self.spec.shard_id, err.line_no, err.custom_id, err.code, str(err))
        if await self._append(self._err, err.line_no, rec):
            self.progress.failed += 1
            self.metrics.batch_lines.labels("failed").inc()
            self.metrics.finished.labels("offline", "rejected").inc()

    # -- one line -----------------------------------------------------------------------------

    async def _line(
        self, line_no: int, raw: bytes, done_ids: set[str], dup: tuple[int, str] | None
    ) -> None:
        spec = self.spec
        try:
            if dup is not None:
                first, cid = dup
                raise BatchLineError(
                    line_no, "duplicate_custom_id",
                    f"custom_id repeats line {first}; custom_ids must be unique", cid,
                )
            req = parse_line(raw, line_no, model=spec.model, defaults=spec.request_defaults)
            if req.custom_id in done_ids:
                log.info("shard %s line %d: custom_id already written", spec.shard_id, line_no)
                return
            await self._serve(req)
        except BatchLineError as err:
            await self._fail_line(err)

    async def _tokenize(self, req: BatchRequest) -> tuple[tuple[int, ...], int | None]:
        while True:
            try:
                tok = await self.engine.tokenize(req.body)
                return tok.tokens, tok.max_model_len
            except EngineUnavailableError:
                self.watch.set(False)
                await self.watch.wait()
            except EngineError as exc:
                raise BatchLineError(
                    req.line_no, "invalid_request",
                    f"the engine cannot tokenize it ({exc.status}): "
                    f"{exc.body[:200].decode(errors='replace')}",
                    req.custom_id,
                ) from exc

    async def _serve(self, req: BatchRequest) -> None:
        tokens, max_model_len = await self._tokenize(req)
        n_prompt = len(tokens)
        max_tokens = req.body.get("max_tokens", req.body.get("max_completion_tokens"))
        if max_model_len is not None:
            if n_prompt + (max_tokens or 1) > max_model_len:
                raise BatchLineError(
                    req.line_no, "context_length_exceeded",
                    f"prompt of {n_prompt} tokens plus max_tokens "
                    f"{max_tokens or 1} exceeds the model's context of {max_model_len}",
                    req.custom_id,
                )
            if max_tokens is None:
                max_tokens = max_model_len - n_prompt
        elif max_tokens is None:
            max_tokens = 1024
        rid = f"off-{self.spec.shard_id}-{req.line_no}"
        asm = Assembly(chat=req.is_chat, prompt_ids=tokens)
        arrival = self.controller.now()
        retries = 0
        p = self.progress
        while True:  # one registration per engine life; a re-registration is a continuation
            base = asm.tokens
            # In the dispatcher's block size, which follows the engine's (kvcache.py).
            hashes = block_hashes(tokens, self.controller.dispatcher.limits.block_size)
            ticket = self.controller.register(
                Incoming(rid, RequestClass.OFFLINE, n_prompt + base, max_tokens - base, arrival,
                         block_hashes=hashes)
            )
            p.in_flight += 1
            try:
                outcome, status, body = await self._drive(ticket, req, asm, max_tokens, base)
            except BaseException:
                self.controller.failed(ticket)
                raise
            finally:
                p.in_flight -= 1
            if outcome is _Outcome.DONE:
                self.controller.finished(ticket, asm.last_segment_tokens)
                break
            self.controller.failed(ticket)
            if outcome is _Outcome.ENGINE_DOWN:
                self.watch.set(False)
                await self.watch.wait()
                continue
            retries += 1
            if 400 <= status < 500 or retries > self._max_retries:
                raise BatchLineError(
                    req.line_no, "engine_error",
                    f"the engine answered {status}: "
                    f"{body[:300].decode(errors='replace')}",
                    req.custom_id,
                )
            await asyncio.sleep(min(0.1 * 2**retries, 5.0))
        if asm.cut and not req.is_chat and asm.ids_complete:
            await self._detokenize(asm)
        answer = asm.body(return_token_ids=bool(req.body.get("return_token_ids")))
        record = success_record(self.spec.shard_id, req, asm.response_id or rid, answer)
        if await self._append(self._out, req.line_no, record):
            p.completed += 1
            self.metrics.batch_lines.labels("completed").inc()
            self.metrics.finished.labels("offline", "ok").inc()

    async def _trim_to_character(self, asm: Assembly) -> None:
        """Before a continuation from token ids: drop the output tokens at the end that the
        engine held back because they end inside a character (their text never came).
        Resumed after them, the engine would read a prompt that ends mid-character and
        misplace the text it streams next; resumed before them, it produces them again and
        streams their text with the character's last bytes, as an uninterrupted request
        does. vLLM's ``/detokenize`` of the last few tokens tells where a character ends (a
        character spans at most four byte-level tokens); if it cannot, nothing is dropped."""
        ids = asm.token_ids
        for drop in range(_CHAR_TOKENS):
            window = ids[max(len(ids) - drop - _CHAR_TOKENS, 0):len(ids) - drop]
            if not window:
                return
            text = await self._detokenize_ids(window)
            if text is None:
                return
            if not text.endswith("\ufffd"):
                asm.drop_last(drop)
                return

    async def _detokenize_ids(self, ids: list[int]) -> str | None:
        """The engine's ``/detokenize`` of ``ids``, or None when it cannot answer."""
        while True:
            try:
                resp = await self.engine.post("/detokenize", json.dumps({"tokens": ids}).encode())
                async with resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        return None
                text = json.loads(raw).get("prompt")
                return text if isinstance(text, str) else None
            except EngineUnavailableError:
                self.watch.set(False)
                await self.watch.wait()
            except (ValueError, AttributeError, aiohttp.ClientError):
                return None

    async def _detokenize(self, asm: Assembly) -> None:
        """Text of a resumed completion from its token ids, when a segment ended inside a
        character: vLLM held that character's first bytes back, so the texts lack them.
        If the engine cannot detokenize, the segments' text stands."""
        text = await self._detokenize_ids(asm.token_ids)
        if text is not None:
            asm.text_parts = [text]

    async def _drive(
        self, ticket: Ticket, req: BatchRequest, asm: Assembly, max_tokens: int, base: int
    ) -> tuple[_Outcome, int, bytes]:
        """Serve every grant of one registration until done, engine loss or HTTP error."""
        while True:
            grant = await ticket.granted()
            if base + grant.resume_from_tokens != asm.tokens + asm.dropped:
                log.warning(
                    "%s: dispatcher resumes from %d tokens, the stream gave %d",
                    ticket.request_id, base + grant.resume_from_tokens, asm.tokens + asm.dropped,
                )
            outcome, status, body = await self._segment(
                ticket, req, asm, max_tokens, grant.priority
            )
            if outcome is _Outcome.ABORTED:
                self.progress.preemptions += 1
                self.controller.aborted(ticket)
                continue
            return outcome, status, body

    def _segment_body(
        self, req: BatchRequest, asm: Assembly, max_tokens: int, priority: int, *, by_ids: bool
    ) -> bytes:
        body = dict(req.body)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        body["priority"] = priority
        body["return_token_ids"] = True
        if self._xargs:
            extra = body.get("vllm_xargs")
            body["vllm_xargs"] = {**(extra if isinstance(extra, dict) else {}), **self._xargs}
        done = asm.tokens
        body["max_tokens"] = max_tokens - done
        body.pop("max_completion_tokens", None)
        if done:
            if by_ids:
                for key in _CHAT_ONLY_KEYS:
                    body.pop(key, None)
                body["prompt"] = [*asm.prompt_ids, *asm.token_ids]
                body.pop("add_special_tokens", None)
            elif req.is_chat:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": asm.text}]
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
            else:
                body["prompt"] = body["prompt"] + asm.text
            if isinstance(body.get("min_tokens"), int):
                body["min_tokens"] = max(body["min_tokens"] - done, 0)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _segment(
        self, ticket: Ticket, req: BatchRequest, asm: Assembly, max_tokens: int, priority: int
    ) -> tuple[_Outcome, int, bytes]:
        if ticket.aborting:
            return _Outcome.ABORTED, 0, b""
        if _used_up(asm, max_tokens):  # nothing left to ask for (see below)
            asm.finish_reason = asm.finish_reason or "length"
            return _Outcome.DONE, 200, b""
        if asm.tokens and _resumes_from_ids(asm) and asm.checked_at != asm.tokens:
            await self._trim_to_character(asm)
            asm.checked_at = asm.tokens
        # A continuation from token ids is a completion, for a chat line too (its prompt ids
        # are the chat template's output): the engine then sees exactly the tokens so far.
        # Decided after the trim, which may have dropped every token produced.
        by_ids = asm.tokens > 0 and _resumes_from_ids(asm)
        data = self._segment_body(req, asm, max_tokens, priority, by_ids=by_ids)
        path = "/v1/completions" if by_ids else req.url
        resumed = asm.tokens
        try:
            resp = await self.engine.post(path, data)
        except EngineUnavailableError:
            return _Outcome.ENGINE_DOWN, 0, b""
        label = "offline"
        tokens_metric = self.metrics.output_tokens.labels(label)
        asm.begin_segment(chat=req.is_chat and not by_ids)
        complete = False
        try:
            if resp.status != 200:
                body = await resp.read()
                complete = True
                return _Outcome.HTTP_ERROR, resp.status, body
            if resumed:
                self.metrics.resumed_tokens.inc(resumed)
            ticket.on_abort(resp.close)
            if ticket.aborting:
                return _Outcome.ABORTED, 0, b""
            scanner = EventScanner()
            finished = False
            try:
                async for chunk in resp.content.iter_any():
                    if ticket.aborting:
                        break
                    before = asm.segment_tokens
                    for ev in scanner.feed(chunk):
                        if ev.done:
                            finished = True
                            continue
                        asm.feed(ev.payload)
                    if asm.segment_tokens != before:
                        tokens_metric.inc(asm.segment_tokens - before)
                        self.progress.output_tokens += asm.segment_tokens - before
                        self.controller.progress(ticket, asm.segment_tokens)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ValueError):
                if not ticket.aborting:
                    log.warning("%s: engine stream broke", ticket.request_id)
            if finished or asm.finish_reason is not None or _used_up(asm, max_tokens):
                # Every token it may have arrived; only the finish chunk or [DONE] may be
                # missing (the stream closed for a preemption or broke after the last token).
                # A continuation would ask for max_tokens 0, which vLLM rejects with a 400.
                if asm.finish_reason is None:
                    asm.finish_reason = "length"
                complete = finished
                return _Outcome.DONE, 200, b""
            if ticket.aborting:
                return _Outcome.ABORTED, 0, b""
            return _Outcome.ENGINE_DOWN, 0, b""
        finally:
            ticket.on_abort(None)
            asm.end_segment()
            if complete:
                resp.release()
            else:
                resp.close()  # the engine aborts the request when its connection drops


# Fields of a chat request that a completion request does not take (a chat line resumed from
# token ids is sent as a completion). Batch lines cannot ask for tools or logprobs.
_CHAT_ONLY_KEYS = (
    "messages", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "documents",
    "echo", "reasoning_effort", "include_reasoning", "mm_processor_kwargs",
)


_CHAR_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-level tokens


def _resumes_from_ids(asm: Assembly) -> bool:
    """Resume from the exact token ids (prompt and output so far), not from text: the engine
    gave an id for every token, and the prompt's ids are known. Text does not always tokenize
    back to the tokens that wrote it, so a text continuation can change what comes next."""
    return asm.ids_complete and bool(asm.prompt_ids)


def _used_up(asm: Assembly, max_tokens: int) -> bool:
    """All ``max_tokens`` output tokens were received, over every segment so far."""
    return asm.tokens >= max_tokens
