"""Turning streamed segments of one offline request into its non-streaming answer.

An offline request is sent streaming (so it can be preempted and resumed
without losing what it produced) but must be written to the batch output as
the non-streaming body an uninterrupted request would have returned. This
module accumulates the ``data:`` chunks of every segment (the original
submission and its continuations) and builds that body: text concatenated,
``usage.completion_tokens`` summed, ``usage.prompt_tokens`` the original
prompt's, id/created/model from the first segment, finish reason from the last.
Segments are asked for their token ids (``return_token_ids``), which are kept
too: a request resumes from the exact tokens (``ShardRunner``; a chat line's
continuation is then a completion, whose chunks are read as such), and the
body carries them when the line asked for them.

The shapes follow vLLM's ``CompletionResponse`` and ``ChatCompletionResponse``
(v0.11 field order included, as the engine model renders them), so the body
is what the engine would have returned to the same request sent non-streaming.

Deliberately left out: logprobs, ``n > 1`` and tool calls, which batch lines
may not ask for (``batch_io.parse_line``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Assembly:
    """Everything one offline request has produced so far, over all its segments."""

    chat: bool
    text_parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0  # over finished segments
    segment_tokens: int = 0  # in the current segment (cumulative usage or event count)
    prompt_tokens: int | None = None  # the original prompt's (first segment's usage)
    response_id: str | None = None
    created: int | None = None
    model: str | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    segments: int = 0
    last_segment_tokens: int = 0  # tokens of the segment that ended last
    prompt_ids: tuple[int, ...] = ()  # the original prompt's (from /tokenize)
    token_ids: list[int] = field(default_factory=list)  # output token ids, every segment
    held_back: bool = False  # the last token so far came without text (a partial character)
    cut: bool = False  # a segment ended inside a character: its text lacks those bytes
    segment_chat: bool = field(init=False)  # the current segment's chunk shape
    dropped: int = 0  # output tokens forgotten at segment ends (``drop_last``), all segments
    checked_at: int = -1  # output tokens when the last boundary was checked (``ShardRunner``)

    def __post_init__(self) -> None:
        self.segment_chat = self.chat

    @property
    def ids_complete(self) -> bool:
        """Every output token so far came with its id (the engine honours return_token_ids)."""
        return len(self.token_ids) == self.tokens

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def tokens(self) -> int:
        """Output tokens produced over all segments, the current one included."""
        return self.completion_tokens + self.segment_tokens

    def drop_last(self, n: int) -> None:
        """Forget the last ``n`` output tokens of finished segments: tokens the engine had
        produced but held back as text (a character not yet complete) when the segment
        ended. The continuation produces them again, after a clean character boundary."""
        if n <= 0:
            return
        del self.token_ids[-n:]
        self.completion_tokens -= n
        self.dropped += n
        self.held_back = False
        self.cut = False

    def begin_segment(self, *, chat: bool | None = None) -> None:
        """A new segment starts; ``chat`` says whether its chunks are chat-shaped (a chat
        line resumed from token ids streams as a completion). Default: the line's own kind."""
        self.segment_chat = self.chat if chat is None else chat
        self.segments += 1
        self.segment_tokens = 0
        self.finish_reason = None
        self.stop_reason = None

    def end_segment(self) -> None:
        """The current segment ended (finished or aborted): bank its tokens."""
        if self.held_back and self.finish_reason is None:
            self.cut = True
        self.completion_tokens += self.segment_tokens
        self.last_segment_tokens = self.segment_tokens
        self.segment_tokens = 0

    def feed(self, payload: bytes) -> None:
        """One SSE ``data:`` payload (not ``[DONE]``) of the current segment."""
        doc = json.loads(payload)
        if self.response_id is None:
            self.response_id = doc.get("id")
            self.created = doc.get("created")
            self.model = doc.get("model")
        got_text = False
        chat = self.segment_chat
        for choice in doc.get("choices") or ():
            delta = choice.get("delta") or {}
            piece = delta.get("content") if chat else choice.get("text")
            if piece:
                self.text_parts.append(piece)
                got_text = True
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids.extend(ids)
                if ids:
                    self.held_back = not piece
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        usage = doc.get("usage")
        if isinstance(usage, dict):
            if self.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                self.segment_tokens = ct
        elif got_text:
            self.segment_tokens += 1

    def body(self, *, return_token_ids: bool = False) -> dict[str, Any]:
        """The non-streaming response an uninterrupted request would have returned
        (with ``token_ids`` and ``prompt_token_ids`` when the request asked for them)."""
        out_ids = list(self.token_ids) if return_token_ids else None
        prompt_ids = list(self.prompt_ids) if return_token_ids else None
        prompt = self.prompt_tokens or 0
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + self.tokens,
            "completion_tokens": self.tokens,
            "prompt_tokens_details": None,
        }
        if self.chat:
            return {
                "id": self.response_id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": self.text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning_content": None,
                        },
                        "logprobs": None,
                        "finish_reason": self.finish_reason,
                        "stop_reason": self.stop_reason,
                        "token_ids": out_ids,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": usage,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids,
                "kv_transfer_params": None,
            }
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": self.text,
                    "logprobs": None,
                    "finish_reason": self.finish_reason,
                    "stop_reason": self.stop_reason,
                    "token_ids": out_ids,
                    "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "kv_transfer_params": None,
        }
