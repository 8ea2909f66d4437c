"""Offline shards through a real sidecar and engine model: outputs, errors, preemption, crashes.

Inputs are built from real prompts (Stanford Alpaca, ``prompts/alpaca_5000.dev.json``
in the shared data folder). Each line carries a seed, so the engine model's text is
a deterministic function of the request: the reference answer of a line is the
engine's own non-streaming answer to it, asked directly.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers_procs import MODEL, Proc, bearer, control_stub, engine_proc, sidecar_proc

from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

TOKEN = "integration-token"
_VOLATILE = re.compile(r'"(id|created)":("[^"]*"|\d+)')


def _prompts(shared_data: Path, n: int, skip: int = 0) -> list[str]:
    rows = json.loads((shared_data / "prompts" / "alpaca_5000.dev.json").read_text())
    out = []
    for row in rows[skip : skip + n]:
        text = row["instruction"] + ("\n\n" + row["input"] if row["input"] else "")
        out.append(text)
    return out


def write_batch(path: Path, prompts: list[str], *, max_tokens: int, bad: dict[int, bytes]) -> None:
    lines: list[bytes] = []
    for i, prompt in enumerate(prompts):
        if i in bad:
            lines.append(bad[i])
            continue
        if i % 3 == 2:
            body: dict[str, Any] = {
                "model": MODEL,
                "seed": i,
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt}],
            }
            url = "/v1/chat/completions"
        else:
            body = {"model": MODEL, "seed": i, "max_tokens": max_tokens, "prompt": prompt}
            url = "/v1/completions"
        doc = {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        lines.append(json.dumps(doc).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


def reference(engine_url: str, input_path: Path) -> dict[str, dict[str, Any]]:
    """custom_id -> the engine's own non-streaming body for each valid line."""
    out = {}
    for raw in input_path.read_bytes().splitlines():
        try:
            doc = json.loads(raw)
        except ValueError:
            continue
        if doc.get("url") not in ("/v1/completions", "/v1/chat/completions"):
            continue
        if doc["body"].get("model") != MODEL:
            continue
        req = urllib.request.Request(
            engine_url + doc["url"],
            data=json.dumps(doc["body"]).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError:
            continue  # the engine refuses it too (oversized prompt)
        out[doc["custom_id"]] = json.loads(_VOLATILE.sub(r'"\1":0', text))
    return out


def read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


@dataclass
class Stack:
    engine: Proc
    sidecar: Proc
    tmp: Path

    def stub(self) -> tuple[grpc.Channel, Any]:
        ch, stub = control_stub(self.sidecar.extra_ports["grpc"])
        return ch, stub  # type: ignore[return-value]


def start_stack(
    tmp: Path,
    *,
    sidecar_seqs: int = 64,
    engine_port: int | None = None,
    extra: Sequence[str] = (),
) -> Stack:
    token = tmp / "token"
    token.write_text(TOKEN)
    eng = engine_proc(tmp, port=engine_port, max_num_seqs=64).start()
    sc = sidecar_proc(
        tmp,
        eng.url,
        token_file=token,
        state_dir=tmp / "state",
        max_num_seqs=sidecar_seqs,
        extra=extra,
    ).start()
    return Stack(eng, sc, tmp)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = start_stack(tmp_path, sidecar_seqs=4)
    yield s
    s.sidecar.stop()
    s.engine.stop()


def shard_msg(tmp: Path, shard_id: str, n: int) -> pb.Shard:
    return pb.Shard(
        shard_id=shard_id,
        job_namespace="default",
        job_name="job",
        model=MODEL,
        input_uri=f"file://{tmp / 'in.jsonl'}",
        line_start=0,
        line_end=n,
        output_uri=f"file://{tmp / 'out.jsonl'}",
        error_uri=f"file://{tmp / 'err.jsonl'}",
        priority=10,
    )


def wait_shard(stub: Any, shard_id: str, timeout_s: float = 120) -> pb.ShardProgress:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
        for p in st.shards:
            if p.shard_id == shard_id and p.state in (
                pb.SHARD_STATE_SUCCEEDED,
                pb.SHARD_STATE_FAILED,
            ):
                return p
        time.sleep(0.2)
    raise TimeoutError(f"shard {shard_id} did not finish")


def online_load(url: str, n: int, stop: threading.Event, results: list[int]) -> None:
    body = json.dumps(
        {"model": MODEL, "prompt": "Write a haiku about the sea.", "max_tokens": 24, "stream": True}
    ).encode()
    for _ in range(n):
        if stop.is_set():
            return
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = resp.read()
            results.append(resp.status if data.endswith(b"data: [DONE]\n\n") else -1)


def check_exactly_once(
    tmp: Path, expected_ok: set[str], bad_lines: set[int], ref: dict[str, dict[str, Any]]
) -> None:
    out = read_records(tmp / "out.jsonl")
    err = read_records(tmp / "err.jsonl")
    ok_ids = [r["custom_id"] for r in out]
    assert len(ok_ids) == len(set(ok_ids)), "a custom_id was written twice"
    assert set(ok_ids) == expected_ok
    err_lines = sorted(int(r["id"].rsplit("_L", 1)[1]) for r in err)
    assert err_lines == sorted(bad_lines)
    for r in err:
        assert r["response"] is None
        assert f"line {int(r['id'].rsplit('_L', 1)[1])}" in r["error"]["message"]
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        got = json.loads(
            _VOLATILE.sub(r'"\1":0', json.dumps(r["response"]["body"], separators=(",", ":")))
        )
        assert got == ref[r["custom_id"]], r["custom_id"]


BAD = {
    3: b"{this is not json",
    5: json.dumps(
        {
            "custom_id": "req-5",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": "x"},
        }
    ).encode(),
    8: json.dumps(
        {
            "custom_id": "req-8",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "gpt-unknown", "prompt": "x"},
        }
    ).encode(),
    11: json.dumps(
        {
            "custom_id": "req-11",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "word " * 5000, "max_tokens": 8},
        }
    ).encode(),
}


def test_shard_with_online_streams_preempts_and_resumes_exactly(
    stack: Stack, shared_data: Path
) -> None:
    n = 24
    write_batch(stack.tmp / "in.jsonl", _prompts(shared_data, n), max_tokens=48, bad=BAD)
    ch, stub = stack.stub()
    with ch:
        resp = stub.AssignShard(
            pb.AssignShardRequest(shard=shard_msg(stack.tmp, "s1", n)), metadata=bearer(TOKEN)
        )
        assert resp.accepted
        again = stub.AssignShard(
            pb.AssignShardRequest(shard=shard_msg(stack.tmp, "s1", n)), metadata=bearer(TOKEN)
        )
        assert again.accepted  # idempotent: the same shard is not started twice
        stop = threading.Event()
        results: list[int] = []
        threads = [
            threading.Thread(target=online_load, args=(stack.sidecar.url, 6, stop, results))
            for _ in range(3)
        ]
        time.sleep(0.5)  # offline work fills the sidecar's 4 slots first
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        progress = wait_shard(stub, "s1")
        status = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
    assert results == [200] * 18
    assert progress.state == pb.SHARD_STATE_SUCCEEDED
    assert progress.completed == n - len(BAD) and progress.failed == len(BAD)
    assert status.offline.preempted_total > 0, "online bursts must preempt offline work"
    assert progress.preemptions == status.offline.preempted_total
    ref = reference(stack.engine.url, stack.tmp / "in.jsonl")
    expected = {f"req-{i}" for i in range(n) if i not in BAD}
    check_exactly_once(stack.tmp, expected, set(BAD), ref)


def _kill_mid_shard(tmp: Path, shared_data: Path, victim: str) -> None:
    n = 30
    write_batch(tmp / "in.jsonl", _prompts(shared_data, n, skip=100), max_tokens=40, bad=BAD)
    s = start_stack(tmp, sidecar_seqs=8)
    try:
        ch, stub = s.stub()
        with ch:
            stub.AssignShard(
                pb.AssignShardRequest(shard=shard_msg(tmp, "s2", n)), metadata=bearer(TOKEN)
            )
        deadline = time.monotonic() + 60
        while len(read_records(tmp / "out.jsonl")) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        done_before = len(read_records(tmp / "out.jsonl"))
        assert 0 < done_before < n - len(BAD), "kill must land mid-shard"
        if victim == "sidecar":
            s.sidecar.kill()
            s.sidecar.start()  # same ports, same state dir: it resumes its shard by itself
        else:
            s.engine.kill()
            time.sleep(1.0)
            s.engine.start()  # same port; the sidecar waits for /health and continues
        ch, stub = s.stub()
        with ch:
            progress = wait_shard(stub, "s2")
        assert progress.state == pb.SHARD_STATE_SUCCEEDED
        ref = reference(s.engine.url, tmp / "in.jsonl")
    finally:
        s.sidecar.stop()
        s.engine.stop()
    expected = {f"req-{i}" for i in range(n) if i not in BAD}
    check_exactly_once(tmp, expected, set(BAD), ref)


def test_kill_9_sidecar_mid_shard_then_restart(tmp_path: Path, shared_data: Path) -> None:
    _kill_mid_shard(tmp_path, shared_data, "sidecar")


def test_kill_9_engine_mid_shard_then_restart(tmp_path: Path, shared_data: Path) -> None:
    _kill_mid_shard(tmp_path, shared_data, "engine")
