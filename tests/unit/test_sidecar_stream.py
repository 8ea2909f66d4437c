"""Reading vLLM's SSE stream: token counting without JSON, and assembling offline answers."""

from __future__ import annotations

import json

import pytest

from slipstream_sidecar.assemble import Assembly
from slipstream_sidecar.sse import EventScanner

pytestmark = pytest.mark.unit


def _chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    doc: dict[str, object] = {
        "id": "cmpl-abc", "object": "text_completion", "created": 5, "model": "m",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "stop_reason": None}],
    }
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"


def test_scanner_splits_events_across_arbitrary_chunk_boundaries() -> None:
    stream = _chunk(" a") + _chunk(" b") + _chunk("", "length") + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        sc = EventScanner()
        events = sc.feed(stream[:cut]) + sc.feed(stream[cut:])
        assert [e.tokens for e in events] == [True, True, True, False]
        assert events[-1].done


def test_a_token_whose_text_vllm_holds_back_is_counted() -> None:
    # vLLM sends an event with empty text for a token that ends inside a UTF-8 character.
    sc = EventScanner()
    held = _chunk("") + _chunk("\u00e9 x")
    assert [e.tokens for e in sc.feed(held)] == [True, True]
    error = b'data: {"error":{"message":"incomplete","code":502}}\n\n'
    assert [e.tokens for e in sc.feed(error)] == [False]


def test_usage_is_parsed_only_when_present() -> None:
    sc = EventScanner()
    usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    (ev,) = sc.feed(_chunk(" x", usage=usage))
    assert ev.usage == usage and ev.tokens
    (ev,) = sc.feed(_chunk(" y"))
    assert ev.usage is None
    final = b'data: {"id":"c","choices":[],"usage":{"completion_tokens":9}}\n\n'
    (ev,) = sc.feed(final)
    assert not ev.tokens and ev.usage == {"completion_tokens": 9}


def test_chat_role_chunk_is_not_a_token() -> None:
    sc = EventScanner()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    word = b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
    assert [e.tokens for e in sc.feed(role + word)] == [False, True]


def test_assembly_concatenates_segments_and_sums_tokens() -> None:
    asm = Assembly(chat=False)
    asm.begin_segment()
    asm.feed(_chunk(" one", usage={"prompt_tokens": 4, "completion_tokens": 1})[6:-2])
    asm.feed(_chunk(" two", usage={"prompt_tokens": 4, "completion_tokens": 2})[6:-2])
    asm.end_segment()  # preempted here
    asm.begin_segment()
    asm.feed(_chunk(" three", usage={"prompt_tokens": 6, "completion_tokens": 1})[6:-2])
    asm.feed(_chunk("", "length", usage={"prompt_tokens": 6, "completion_tokens": 1})[6:-2])
    asm.end_segment()
    body = asm.body()
    assert body["choices"][0]["text"] == " one two three"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 7
    assert body["id"] == "cmpl-abc" and body["object"] == "text_completion"
    assert asm.last_segment_tokens == 1


def test_assembly_counts_events_without_usage() -> None:
    asm = Assembly(chat=True)
    asm.begin_segment()
    asm.feed(b'{"id":"x","created":1,"model":"m","choices":[{"delta":{"content":" a"}}]}')
    asm.feed(b'{"choices":[{"delta":{"content":" b"},"finish_reason":"stop"}]}')
    asm.end_segment()
    body = asm.body()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == " a b"
    assert body["usage"]["completion_tokens"] == 2


def test_assembly_keeps_token_ids_and_marks_a_character_cut_at_an_abort() -> None:
    asm = Assembly(chat=False, prompt_ids=(0, 5, 6))
    asm.begin_segment()
    first = {"choices": [{"index": 0, "text": " a", "finish_reason": None, "token_ids": [7]}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    held = {"choices": [{"index": 0, "text": "", "finish_reason": None, "token_ids": [200]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    asm.feed(json.dumps(first).encode())
    asm.feed(json.dumps(held).encode())
    asm.end_segment()  # aborted with a character's first bytes held back
    assert asm.cut and asm.ids_complete and asm.token_ids == [7, 200]
    body = asm.body(return_token_ids=True)
    assert body["choices"][0]["token_ids"] == [7, 200]
    assert body["choices"][0]["prompt_token_ids"] == [0, 5, 6]
    assert asm.body()["choices"][0]["token_ids"] is None
