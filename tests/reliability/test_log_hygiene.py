"""No prompt text and no secret reaches the logs, even at DEBUG.

A real engine and sidecar run with ``-vv`` (DEBUG, every library logger too)
and a control token that is a distinctive string. Traffic carries a
distinctive prompt phrase through every path that might echo it: online
completions and chat, streaming and not, a client that hangs up mid-stream, a
request the engine refuses (too long), bad JSON, an offline shard with good
lines, lines the sidecar refuses (wrong model, oversized) and a preemption;
the control API is called with the right token and with wrong ones. Then
every log line is searched for the phrase, its first and last words, and the
token.

Deliberately left out: the operator's log (it never sees prompts; its token
handling is the Secret's) and the engine's access log format (paths only).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from rel_helpers import (
    TOKEN,
    RelStack,
    assign,
    http_request,
    raw_exchange,
    records,
    start_rel_stack,
    wait_done,
)

from integration.helpers_procs import MODEL, SLIPSTREAM, bearer
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

PHRASE = "QUOKKA-ZEPHYR-7741 tell me about the marmalade lighthouse"
NEEDLES = ("QUOKKA-ZEPHYR-7741", "marmalade lighthouse", TOKEN)


def post(url: str, body: dict[str, Any], timeout: float = 60) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.read()
        err.close()
        return int(err.code)


def test_no_prompt_text_or_token_in_debug_logs(tmp_path: Path) -> None:
    stack = debug_stack(tmp_path)
    try:
        sc, eng = stack.sidecar.url, stack.engine.url
        # Offline: good lines, refused lines, and enough work for online to preempt.
        lines = [
            json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": MODEL, "prompt": f"{PHRASE} #{i}", "max_tokens": 40}})
            for i in range(12)
        ]
        lines.append(json.dumps({"custom_id": "wrong", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "gpt-4o", "prompt": PHRASE}}))
        lines.append(json.dumps({"custom_id": "long", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": MODEL, "prompt": (PHRASE + " ") * 3000,
                                          "max_tokens": 4}}))
        lines.append("{" + PHRASE)  # not JSON
        (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
        assign(stack, "hyg", len(lines), tmp_path)
        time.sleep(0.3)
        # Online while offline runs: every path through the proxy.
        results: list[int] = []

        def online(i: int) -> None:
            if i % 2:
                body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "stream": i % 4 == 1,
                                        "messages": [{"role": "user", "content": PHRASE}]}
                results.append(post(sc + "/v1/chat/completions", body))
            else:
                body = {"model": MODEL, "prompt": PHRASE, "max_tokens": 8, "stream": i % 4 == 0}
                results.append(post(sc + "/v1/completions", body))

        threads = [threading.Thread(target=online, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results.count(200) == 12, results
        for base in (sc, eng):
            assert post(base + "/v1/completions",
                        {"model": MODEL, "prompt": (PHRASE + " ") * 3000, "max_tokens": 4}) == 400
            assert post(base + "/v1/completions", {"model": "nope", "prompt": PHRASE}) in (400, 404)
            res = raw_exchange(int(base.rsplit(":", 1)[1]), http_request(
                "POST", "/v1/completions", b'{"prompt": "' + PHRASE.encode(),
                {"Content-Type": "application/json"}), read_all=True)
            assert res.status == 400
        # A client that hangs up mid-stream.
        with socket.create_connection(("127.0.0.1", stack.sidecar.port), timeout=10) as s:
            body = json.dumps({"model": MODEL, "prompt": PHRASE, "max_tokens": 200,
                               "stream": True}).encode()
            s.sendall(http_request("POST", "/v1/completions", body,
                                   {"Content-Type": "application/json"}))
            s.recv(100)
        # The control API with the right token and with wrong ones.
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
            stub = ch.unary_unary("/slipstream.sidecar.v1alpha1.Sidecar/Status",
                                  request_serializer=pb.StatusRequest.SerializeToString,
                                  response_deserializer=pb.StatusResponse.FromString)
            stub(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
            for md in (bearer(TOKEN[:-1]), bearer(PHRASE), (("authorization", TOKEN),)):
                with pytest.raises(grpc.RpcError):
                    stub(pb.StatusRequest(), metadata=md, timeout=10)
        progress = wait_done(stack, "hyg")
        assert progress.state == pb.SHARD_STATE_SUCCEEDED
        assert progress.completed == 12 and progress.failed == 3
        assert len(records(tmp_path / "out.jsonl")) == 12
        time.sleep(0.5)
    finally:
        stack.stop()
    check_logs(stack)


def check_logs(stack: RelStack) -> None:
    texts = {p.name: p.log_path.read_text(errors="replace") for p in (stack.engine, stack.sidecar)}
    assert any(" DEBUG " in t for t in texts.values()), "DEBUG logging was not on"
    leaks = {
        (name, needle): [ln for ln in text.splitlines() if needle in ln][:2]
        for name, text in texts.items()
        for needle in NEEDLES
        if needle in text
    }
    assert not leaks, f"logs leak: {leaks}"


def debug_stack(tmp_path: Path) -> RelStack:
    stack = start_rel_stack(tmp_path, sidecar_seqs=4, mean_output_tokens=24)
    for proc in (stack.engine, stack.sidecar):
        proc.stop()
        proc.args.insert(len(SLIPSTREAM), "-vv")
        proc.start()
    return stack


def test_no_prompt_text_in_logs_when_the_body_overruns_its_length(tmp_path: Path) -> None:
    stack = debug_stack(tmp_path)
    try:
        for port in (stack.sidecar.port, stack.engine.port):
            body = json.dumps({"model": MODEL, "prompt": PHRASE, "max_tokens": 2}).encode()
            smuggle = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n"
                       b"Content-Type: application/json\r\n\r\n" + body + b"\r\n\r\n")
            raw_exchange(port, smuggle, bound_s=5, read_all=True)
        time.sleep(0.3)
        assert stack.healthy()
    finally:
        stack.stop()
    check_logs(stack)
