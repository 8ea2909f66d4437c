"""A chat line resumed after its stream broke: from token ids, as a completion.

Text does not always tokenize back to the tokens that wrote it, so a chat line that resumed
from its text (a final assistant message with ``continue_final_message``) could go on
differently from an uninterrupted request. The sidecar resumes it from the chat prompt's
token ids plus the output's, as a completion; tokens whose text the engine held back when
the stream broke (a character not yet complete) are produced again after the boundary.

The engine here streams like vLLM with ``return_token_ids``: token 12 is the first half of
"é" (no text of its own), token 13 completes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from unit.test_sidecar_shard_length_limit import MODEL, run_one_line

pytestmark = pytest.mark.unit

PROMPT_IDS = [100, 101, 102]  # what the chat template makes of the messages
TEXT = {10: "a", 11: "b", 12: "", 13: "é", 14: "c", 15: "d", 16: "e", 17: "f"}


class ChatEngine:
    """Chat streams break after ``cut`` tokens; completions over token ids never do."""

    def __init__(self, cut: int) -> None:
        self.cut = cut
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def routes(self) -> list[tuple[str, Any]]:
        return [("/tokenize", self.tokenize), ("/detokenize", self.detokenize),
                ("/v1/chat/completions", self.chat), ("/v1/completions", self.completions)]

    async def tokenize(self, request: web.Request) -> web.Response:
        doc = await request.json()
        assert "messages" in doc
        return web.json_response({"tokens": PROMPT_IDS, "max_model_len": 4096})

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = (await request.json())["tokens"]
        text = "".join(TEXT[i] for i in ids) + ("\ufffd" if ids and ids[-1] == 12 else "")
        return web.json_response({"prompt": text})

    async def _stream(self, request: web.Request, first: int, n: int, chat: bool,
                      cut: int | None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(n):
            if cut is not None and k == cut:
                assert request.transport is not None
                request.transport.close()
                return resp
            tid = first + k
            choice: dict[str, Any] = {"index": 0, "token_ids": [tid],
                                      "finish_reason": "length" if k == n - 1 else None}
            if chat:
                choice["delta"] = {"content": TEXT[tid]} if TEXT[tid] else {}
            else:
                choice["text"] = TEXT[tid]
            chunk = {"id": "chatcmpl-1" if chat else "cmpl-2", "created": 1, "model": MODEL,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "choices": [choice],
                     "usage": {"prompt_tokens": 3, "completion_tokens": k + 1,
                               "total_tokens": 4 + k}}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(("chat", body))
        return await self._stream(request, 10, body["max_tokens"], True, self.cut)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(("completions", body))
        first = body["prompt"][-1] + 1
        return await self._stream(request, first, body["max_tokens"], False, None)


LINE = {"model": MODEL, "max_tokens": 8, "return_token_ids": True, "temperature": 0,
        "messages": [{"role": "user", "content": "hi"}]}


async def test_a_chat_line_resumes_from_token_ids_before_a_held_back_character(
    tmp_path: Path,
) -> None:
    engine = ChatEngine(cut=3)  # "a", "b", then token 12 (half of "é", no text): the drop
    record = await run_one_line(tmp_path, engine, 8, url="/v1/chat/completions", line_body=LINE)
    assert [kind for kind, _ in engine.calls] == ["chat", "completions"]
    cont = engine.calls[1][1]
    # Token 12 came without its text: it is asked for again, after the clean boundary.
    assert cont["prompt"] == [*PROMPT_IDS, 10, 11]
    assert cont["max_tokens"] == 6
    assert "messages" not in cont and "continue_final_message" not in cont
    body = record["response"]["body"]
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["content"] == "abécdef"
    assert choice["token_ids"] == list(range(10, 18))
    assert body["prompt_token_ids"] == PROMPT_IDS
    assert body["usage"]["completion_tokens"] == 8
    assert choice["finish_reason"] == "length"


async def test_a_chat_line_cut_on_a_character_boundary_drops_nothing(tmp_path: Path) -> None:
    engine = ChatEngine(cut=5)  # a, b, (12), é, c: the text is whole
    record = await run_one_line(tmp_path, engine, 8, url="/v1/chat/completions", line_body=LINE)
    cont = engine.calls[1][1]
    assert cont["prompt"] == [*PROMPT_IDS, 10, 11, 12, 13, 14]
    assert cont["max_tokens"] == 3
    choice = record["response"]["body"]["choices"][0]
    assert choice["message"]["content"] == "abécdef"
    assert choice["token_ids"] == list(range(10, 18))
