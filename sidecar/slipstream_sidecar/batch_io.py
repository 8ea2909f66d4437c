"""OpenAI Batch API files: parse input lines, build output records, append durably.

Input lines are ``{"custom_id", "method", "url", "body"}``; output records are
``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": null}`` and error records the same with ``"response": null`` and
``"error": {"code", "message"}``. Record ids are deterministic
(``batch_req_<shard>_<line>``), so a line's record is recognisable after a
restart even when the line had no usable ``custom_id``.

Durability (:class:`DurableLog`): one complete line per ``write`` + ``flush`` +
``fsync`` on a file opened for append. On open, a torn trailing line (a crash
in the middle of a write) is truncated and every record already present is
indexed by line number and ``custom_id``, so the caller can skip them: each
line of the shard ends up in the output exactly once.

Deliberately left out: network I/O to the engine (``shards.py``) and
object-store appends (``s3://`` outputs are staged in a local log and uploaded
when the shard ends, because object stores cannot append).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream_sidecar.errors import BatchLineError

log = logging.getLogger(__name__)

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
SUPPORTED_URLS = (COMPLETIONS_URL, CHAT_URL)
UNSUPPORTED_BODY_FIELDS = ("logprobs", "echo", "prompt_logprobs", "best_of")
"""Fields a preemptible (resumable) request cannot honour exactly; such lines are refused."""

_RECORD_ID = re.compile(r"^batch_req_.*_L(\d+)$")


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One valid input line, ready to be sent to the engine."""

    line_no: int
    custom_id: str
    url: str
    body: dict[str, Any]

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


def record_id(shard_id: str, line_no: int) -> str:
    return f"batch_req_{shard_id}_L{line_no}"


def custom_id_of(raw: bytes) -> str | None:
    """The line's ``custom_id`` if it is a JSON object with a non-empty string one, else None."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    cid = doc.get("custom_id") if isinstance(doc, dict) else None
    return cid if isinstance(cid, str) and cid else None


def parse_line(
    raw: bytes, line_no: int, *, model: str, defaults: dict[str, Any] | None = None
) -> BatchRequest:
    """Validate one JSONL line; raise :class:`BatchLineError` naming the line otherwise."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchLineError(line_no, "invalid_json", f"not JSON: {exc}") from exc
    except RecursionError as exc:
        raise BatchLineError(line_no, "invalid_json", "not JSON: nested too deeply") from exc
    if not isinstance(doc, dict):
        raise BatchLineError(line_no, "invalid_json", "not a JSON object")
    custom_id = doc.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BatchLineError(line_no, "invalid_request", "missing custom_id")

    def fail(code: str, message: str) -> BatchLineError:
        return BatchLineError(line_no, code, message, custom_id)

    if doc.get("method", "POST") != "POST":
        raise fail("invalid_request", f"method {doc.get('method')!r} is not POST")
    url = doc.get("url")
    if url not in SUPPORTED_URLS:
        raise fail("invalid_url", f"url {url!r} is not one of {', '.join(SUPPORTED_URLS)}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise fail("invalid_request", "body is not an object")
    merged: dict[str, Any] = dict(defaults or {})
    merged.update(body)
    if merged.get("model") != model:
        raise fail("model_not_found", f"model {merged.get('model')!r} is not served ({model!r})")
    if url == COMPLETIONS_URL and not isinstance(merged.get("prompt"), str):
        raise fail("invalid_request", "prompt must be one string")
    if url == CHAT_URL and not (
        isinstance(merged.get("messages"), list) and merged["messages"]
    ):
        raise fail("invalid_request", "messages must be a non-empty list")
    if merged.get("n", 1) != 1:
        raise fail("invalid_request", "n must be 1")
    for name in UNSUPPORTED_BODY_FIELDS:
        if merged.get(name) not in (None, False, 0):
            raise fail("unsupported_parameter", f"{name} is not supported for batch lines")
    max_tokens = merged.get("max_tokens", merged.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise fail("invalid_request", "max_tokens must be a positive integer")
    # Clients of the batch API do not choose the engine priority; the shard does.
    merged.pop("priority", None)
    merged.pop("stream", None)
    merged.pop("stream_options", None)
    return BatchRequest(line_no=line_no, custom_id=custom_id, url=url, body=merged)


def success_record(
    shard_id: str, req: BatchRequest, request_id: str, body: dict[str, Any]
) -> bytes:
    doc = {
        "id": record_id(shard_id, req.line_no),
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def error_record(
    shard_id: str, line_no: int, custom_id: str | None, code: str, message: str
) -> bytes:
    doc = {
        "id": record_id(shard_id, line_no),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


@dataclass(slots=True)
class LogIndex:
    """What a log already holds: line numbers and custom_ids of complete records."""

    lines: set[int] = field(default_factory=set)
    custom_ids: set[str] = field(default_factory=set)
    truncated_bytes: int = 0


class DurableLog:
    """An append-only JSONL file: one fsynced complete line per :meth:`append`.

    Not thread-safe; the shard executor serialises appends per file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = LogIndex()
        self._fd: int | None = None

    def open(self) -> LogIndex:
        """Truncate a torn tail, index the complete records, open for append."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = b""
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                self.index.truncated_bytes = len(data) - end
                log.warning(
                    "truncating a torn record of %d bytes at the end of %s",
                    len(data) - end,
                    self.path,
                )
                os.ftruncate(fd, end)
                os.fsync(fd)
            for line in data[:end].splitlines():
                self._index_line(line)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        return self.index

    def _index_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            doc = json.loads(line)
        except ValueError:
            log.warning("unparsable record in %s ignored", self.path)
            return
        m = _RECORD_ID.match(str(doc.get("id", "")))
        if m:
            self.index.lines.add(int(m.group(1)))
        cid = doc.get("custom_id")
        if isinstance(cid, str):
            self.index.custom_ids.add(cid)

    def append(self, record: bytes) -> None:
        """Write one complete record (ending in a newline) and make it durable."""
        if self._fd is None:
            raise RuntimeError(f"{self.path} is not open")
        if not record.endswith(b"\n") or b"\n" in record[:-1]:
            raise ValueError("a record is exactly one line")
        view = memoryview(record)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self._index_line(record)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def local_path(uri: str) -> Path | None:
    """The filesystem path of a ``file://`` URI or bare path; None for other schemes."""
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    if "://" not in uri:
        return Path(uri)
    return None
