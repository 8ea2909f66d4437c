"""Reading just enough of vLLM's server-sent events to count tokens.

The proxy passes the engine's bytes through untouched; beside that it feeds
them to an :class:`EventScanner`, which cuts the stream at event boundaries
and classifies each event with byte searches. Only an event that carries
``"usage":{`` is JSON-parsed (the final usage chunk, or every chunk when the
request asked for ``continuous_usage_stats``), so the hot path does no JSON
work for ordinary token chunks.

Token counting rule: with usage in the stream, ``completion_tokens`` is exact;
without it, every event that carries non-empty ``text`` (completions) or
``content`` (chat) counts as one token, which is exact with vLLM's default
``--stream-interval 1`` and ``n=1``.

Deliberately left out: assembling responses (``assemble.py``) and anything
about multiple choices (``n>1``), which only the usage count handles exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_SEP = b"\n\n"
_DATA = b"data: "
_DONE = b"[DONE]"
_USAGE = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_EMPTY_TEXT = (b'"text":""', b'"content":""')
_NO_CONTENT = b'"content":null'


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE ``data:`` event: its JSON payload bytes and what the scanner saw."""

    payload: bytes
    tokens: bool  # carries output text
    usage: dict[str, Any] | None  # the parsed usage object, when present
    done: bool  # the ``[DONE]`` sentinel


class EventScanner:
    """Splits a byte stream into SSE events; keeps only an incomplete tail."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[Event]:
        buf = self._tail + data if self._tail else data
        parts = buf.split(_SEP)
        self._tail = parts.pop()
        return [classify(p) for p in parts if p]


def classify(raw: bytes) -> Event:
    payload = raw[len(_DATA) :] if raw.startswith(_DATA) else raw
    payload = payload.strip()
    if payload == _DONE:
        return Event(payload, tokens=False, usage=None, done=True)
    usage: dict[str, Any] | None = None
    if _USAGE in payload:
        try:
            parsed = json.loads(payload).get("usage")
        except ValueError:
            parsed = None
        usage = parsed if isinstance(parsed, dict) else None
    tokens = not (
        _EMPTY_CHOICES in payload
        or any(e in payload for e in _EMPTY_TEXT)
        or (_NO_CONTENT in payload and b'"text":' not in payload)
    )
    return Event(payload, tokens=tokens, usage=usage, done=False)
