"""The engine model's HTTP server against live vLLM: the same requests, compared field by field.

Both servers run with one sequence slot, ``--max-model-len 512`` and the served name of the tiny
model. Every response is compared key by key, nesting and nulls included. Values that differ by
nature are compared by type only: ids, ``created``, the generated text (random weights on one
side, the engine model's word generator on the other), error messages' wording, and prompt token
counts (the two tokenizers differ). Every other difference fails the test unless ``ALLOWED``
lists it, with the reason; ``ALLOWED`` mirrors the "Differences from vLLM" section of
``docs/engine-model-server.md``, and the test checks that the page names each entry.
"""

from __future__ import annotations

import json
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.helpers_procs import Proc, engine_proc
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = DEFAULT_SERVED_NAME
REPO = Path(__file__).resolve().parents[2]

# Keys whose values differ by nature: compared by type.
BY_TYPE = {"id", "created", "text", "content", "message", "prompt_tokens", "total_tokens"}

# "case:path" (case "*" for every case) -> why the engine model differs there.
ALLOWED: dict[str, str] = {
    "*:system_fingerprint": "vLLM 0.32 fills it with its version; the engine model renders "
    "vLLM 0.11.0's null",
    "*:usage.completion_tokens_details": "added after vLLM 0.11.0 (null)",
    "*:ec_transfer_params": "added after vLLM 0.11.0 (null)",
    "*:metrics": "added after vLLM 0.11.0 (null)",
    "*:choices[].routed_experts": "added after vLLM 0.11.0 (null, MoE models only)",
    "chat:prompt_text": "added after vLLM 0.11.0 (null)",
    "chat:choices[].message.reasoning": "vLLM 0.32's name for 0.11.0's reasoning_content",
    "chat:choices[].message.reasoning_content": "vLLM 0.11.0's name, renamed reasoning in 0.32",
    "chat:choices[].message.tool_calls": "vLLM 0.11.0 sends an empty list; 0.32 leaves it out",
    "chat-stream:role.prompt_text": "added after vLLM 0.11.0 (null)",
    "*-stream:usage.system_fingerprint": "vLLM 0.32 fills it in the usage chunk; vLLM 0.11.0 "
    "does not send the key there",
    "*-stream:token.usage": "vLLM 0.11.0 sends usage null in token chunks; 0.32 leaves it out",
    "*-stream:finish.usage": "vLLM 0.11.0 sends usage null in token chunks; 0.32 leaves it out",
    "too-long:error.param": "vLLM 0.32 names input_tokens; the engine model names prompt "
    "(vLLM 0.11.0)",
    "malformed:error.param": "vLLM 0.32 reports pydantic's location body.1; the engine "
    "model null",
}


@pytest.fixture(scope="module")
def vllm(vllm_one_seq: VllmServer) -> VllmServer:
    return vllm_one_seq


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    eng = engine_proc(
        tmp_path_factory.mktemp("engine"), max_num_seqs=1,
        extra=("--served-model-name", MODEL, "--max-model-len", "512"),
    ).start()
    yield eng
    eng.stop()


def post(url: str, body: dict[str, Any] | bytes) -> tuple[int, str, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def sse(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a stream; asserts vLLM's framing and the closing ``[DONE]``."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    docs = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: "), ev
        docs.append(json.loads(ev.removeprefix(b"data: ")))
    return docs


def kind(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return "usage"
    if "role" in (choices[0].get("delta") or {}):
        return "role"
    return "finish" if choices[0].get("finish_reason") is not None else "token"


def collapsed(kinds: list[str]) -> list[str]:
    """A stream's chunk kinds with each run of token chunks as one: vLLM puts every token
    produced since the client last read into one chunk, so on a loaded host several of a
    request's tokens can share a chunk (the engine model sends one chunk per token)."""
    out: list[str] = []
    for k in kinds:
        if not (k == "token" and out and out[-1] == "token"):
            out.append(k)
    return out


def diff(real: Any, model: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, what) for every place the engine model's value differs from vLLM's."""
    key = path.rsplit(".", 1)[-1]
    if isinstance(real, dict) and isinstance(model, dict):
        out = []
        for k in [*real, *(k for k in model if k not in real)]:
            sub = f"{path}.{k}" if path else k
            if k not in model:
                out.append((sub, f"missing in the engine model (vLLM: {real[k]!r:.60})"))
            elif k not in real:
                out.append((sub, f"only in the engine model ({model[k]!r:.60})"))
            else:
                out += diff(real[k], model[k], sub)
        return out
    if isinstance(real, list) and isinstance(model, list):
        if len(real) != len(model):
            return [(path, f"{len(real)} items in vLLM, {len(model)} in the engine model")]
        return [d for r, m in zip(real, model, strict=True) for d in diff(r, m, path + "[]")]
    if key in BY_TYPE:
        same = type(real) is type(model)
    else:
        same = real == model and type(real) is type(model)
    return [] if same else [(path, f"vLLM {real!r:.80}, engine model {model!r:.80}")]


class Recorder:
    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.failures: list[str] = []

    def check(self, case: str, found: list[tuple[str, str]]) -> None:
        for path, what in found:
            hit = [k for k in (f"{case}:{path}", f"*:{path}",
                               f"*-{case.split('-', 1)[-1]}:{path}") if k in ALLOWED]
            if hit:
                self.seen.update(hit)
            else:
                self.failures.append(f"{case}: {path}: {what}")


COMPLETION = {"model": MODEL, "prompt": "the batch job", "max_tokens": 3, "ignore_eos": True}
CHAT = {"model": MODEL, "max_tokens": 3, "ignore_eos": True,
        "messages": [{"role": "user", "content": "an online request"}]}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}

ERRORS: dict[str, tuple[str, dict[str, Any] | bytes]] = {
    "unknown-model": ("/v1/completions", {**COMPLETION, "model": "no-such-model"}),
    "unknown-model-chat": ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}),
    "too-long": ("/v1/completions", {**COMPLETION, "prompt": "word " * 700}),
    "too-long-chat": ("/v1/chat/completions",
                      {**CHAT, "messages": [{"role": "user", "content": "word " * 700}]}),
    "malformed": ("/v1/completions", b"{not json"),
    "malformed-chat": ("/v1/chat/completions", b"{not json"),
    "missing-prompt": ("/v1/completions", {"model": MODEL, "max_tokens": 2}),
}


def compare_all(vllm: VllmServer, engine: Proc, rec: Recorder) -> None:
    for case, path, body in (("completion", "/v1/completions", COMPLETION),
                             ("chat", "/v1/chat/completions", CHAT)):
        (rs, rt, rb), (ms, mt, mb) = (post(u + path, body) for u in (vllm.url, engine.url))
        assert (rs, rt) == (ms, mt) == (200, "application/json"), (rb, mb)
        real, model = json.loads(rb), json.loads(mb)
        assert real["usage"]["completion_tokens"] == model["usage"]["completion_tokens"] == 3
        rec.check(case, diff(real, model))
        # Eight tokens: even when vLLM merges tokens into chunks, some come as token chunks.
        (rs, rt, rb), (ms, mt, mb) = (post(u + path, {**body, **USAGE, "max_tokens": 8})
                                      for u in (vllm.url, engine.url))
        assert rs == ms == 200 and rt == mt and rt.startswith("text/event-stream"), (rt, mt)
        real_chunks, model_chunks = sse(rb), sse(mb)
        kinds = collapsed([kind(c) for c in real_chunks])
        assert kinds == collapsed([kind(c) for c in model_chunks]), (real_chunks, model_chunks)
        assert kinds[-1] == "usage" and kinds[-2] == "finish"
        for k in kinds:  # the first chunk of each kind, field by field
            r = next(c for c in real_chunks if kind(c) == k)
            m = next(c for c in model_chunks if kind(c) == k)
            rec.check(f"{case}-stream", [(f"{k}.{p}", w) for p, w in diff(r, m)])
    for case, (path, bad) in ERRORS.items():
        (rs, rt, rb), (ms, mt, mb) = (post(u + path, bad) for u in (vllm.url, engine.url))
        assert rs >= 400 and rs == ms, (case, rs, ms, rb, mb)
        assert rt == mt, (case, rt, mt)
        rec.check(case.removesuffix("-chat"), diff(json.loads(rb), json.loads(mb)))


def metric(url: str, *names: str) -> float:
    """The sum of the named series, read in one scrape."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] in names)


def arrivals(url: str) -> float:
    """Requests the engine has taken in: running, waiting and finished, read in one scrape
    (so a request moving between them is never counted twice or missed)."""
    return metric(url, "vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:request_success_total")


def wait_arrivals(url: str, count: float) -> None:
    deadline = time.monotonic() + 120
    while (seen := arrivals(url)) != count:
        assert seen < count, f"{seen} requests arrived, expected {count}"
        assert time.monotonic() < deadline, f"only {seen} of {count} requests arrived"
        time.sleep(0.02)


def open_stream(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A streamed request sent on a socket of its own, its answer left unread."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.sendall(b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(data), data))
    return sock


# Long streamed completions queued ahead of the chat request. A scrape of /metrics can stall
# for seconds on a loaded host, and the completions must outlast the scrapes that confirm the
# setup; they are cut short (closed, so the server aborts them) once the read is done.
BLOCKERS = 32


def role_before_scheduled(url: str) -> bool:
    """Whether a chat stream's first event reaches the client while its request still waits
    for the one slot.

    The completions arrive first and the chat request waits behind all of them (first come,
    first served, or equal priorities). After the read, the chat request must still be
    waiting; that scrape is answered after the read, so it cannot report an older state."""
    before = arrivals(url)
    blockers = [open_stream(url, "/v1/completions", {**COMPLETION, "max_tokens": 450})
                for _ in range(BLOCKERS)]
    try:
        wait_arrivals(url, before + BLOCKERS)
        with open_stream(url, "/v1/chat/completions", CHAT) as sock:
            wait_arrivals(url, before + BLOCKERS + 1)
            got = b""
            while select.select([sock], [], [], 0)[0]:
                piece = sock.recv(65536)
                if not piece:
                    break
                got += piece
            # The chat request is last in the queue: any request waiting means it still waits.
            assert metric(url, "vllm:num_requests_waiting") >= 1, "the completions ran out first"
            early = b"data: " in got
            for b in blockers:
                b.close()
            while b"data: [DONE]" not in got:
                piece = sock.recv(65536)
                assert piece, got
                got += piece
    finally:
        for b in blockers:
            b.close()
    return early


def test_engine_model_answers_like_vllm(vllm: VllmServer, engine: Proc) -> None:
    rec = Recorder()
    compare_all(vllm, engine, rec)
    real_early, model_early = role_before_scheduled(vllm.url), role_before_scheduled(engine.url)
    assert real_early is False, "vLLM sends the role chunk only once the request runs"
    if real_early != model_early:
        rec.check("chat-stream", [("role.timing", "the engine model sends it on arrival")])
    assert not rec.failures, "differences not in ALLOWED:\n" + "\n".join(rec.failures)
    unseen = set(ALLOWED) - rec.seen
    assert not unseen, f"ALLOWED lists differences no longer seen: {sorted(unseen)}"


def test_the_allow_list_is_the_documented_one() -> None:
    page = (REPO / "docs" / "engine-model-server.md").read_text()
    assert "## Differences from vLLM" in page
    section = page.split("## Differences from vLLM", 1)[1].split("\n## ", 1)[0]
    for key in ALLOWED:
        case, path = key.split(":", 1)
        assert f"`{case}`" in section and f"`{path}`" in section, key
