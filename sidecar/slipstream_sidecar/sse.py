"""Reading just enough of vLLM's server-sent events to count tokens.

The proxy passes the engine's bytes through untouched; beside that it feeds
them to an :class:`EventScanner`, which cuts the stream at event boundaries
and classifies each event with byte searches. Only an event that carries
``"usage":{`` is JSON-parsed (the final usage chunk, or every chunk when the
request asked for ``continuous_usage_stats``), so the hot path does no JSON
work for ordinary token chunks.

Token counting rule: with usage in the stream, ``completion_tokens`` is exact;
without it, every event with a choice counts as one token, except

* chat's role chunk (its delta carries ``role``: vLLM's
  ``{"role":"assistant","content":""}``, or ``{"role":"assistant"}`` alone), and
* a finishing event that carries nothing: an empty chat delta (``"delta":{}``),
  or empty completion text from an engine whose choices have no
  ``stop_reason``. OpenAI's API and llm-d-inference-sim end a stream that way,
  after the last token; vLLM does not.

That is exact with vLLM's default ``--stream-interval 1`` and ``n=1``: vLLM
sends one event per token, also for a token whose text it holds back (an
incomplete UTF-8 character: ``"text":""``, its choice with ``stop_reason``) and
for a final token whose text a stop string cut.

Timing: an event is *content* when it carries text (a token event whose text
is not empty). TBT gaps are taken between content events only, as a client
sees them; TTFT is the first token event.

With ``n > 1`` each choice's events count for it (one event per token per
choice, each choice's role chunk excepted), so the rule holds for the sum.

Deliberately left out: assembling responses (``assemble.py``).
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
_CHOICES = ((b'"choices":[', _EMPTY_CHOICES), (b'"choices": [', b'"choices": []'))
_ROLE = b'"role":'
_EMPTY_DELTAS = (b'"delta":{}', b'"delta": {}')
_EMPTY_TEXTS = (b'"text":""', b'"text": ""')
_EMPTY_CONTENTS = (b'"content":""', b'"content": ""')
_STOP_REASON = b'"stop_reason"'


@dataclass(frozen=True, slots=True)
class Event:
    """One SSE ``data:`` event: its JSON payload bytes and what the scanner saw."""

    payload: bytes
    tokens: bool  # carries one output token (see the counting rule)
    content: bool  # a token event whose text is not empty (TBT is timed between these)
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
        return Event(payload, tokens=False, content=False, usage=None, done=True)
    usage: dict[str, Any] | None = None
    if _USAGE in payload:
        try:
            parsed = json.loads(payload).get("usage")
        except ValueError:
            parsed = None
        usage = parsed if isinstance(parsed, dict) else None
    tokens, content = _token(payload)
    return Event(payload, tokens=tokens, content=content, usage=usage, done=False)


def _token(payload: bytes) -> tuple[bool, bool]:
    """(counts as a token, carries text) for one event's payload (the counting rule)."""
    if not any(c in payload and e not in payload for c, e in _CHOICES):
        return False, False
    if b'"delta":' in payload:  # chat
        if _ROLE in payload or any(e in payload for e in _EMPTY_DELTAS):
            return False, False
        return True, not any(e in payload for e in _EMPTY_CONTENTS)
    if any(e in payload for e in _EMPTY_TEXTS):
        return _STOP_REASON in payload, False
    return True, True
