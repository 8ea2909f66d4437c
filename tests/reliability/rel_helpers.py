"""Shared pieces of the reliability tests: raw HTTP over a socket, a stack of real processes.

``raw_exchange`` talks HTTP/1.1 (or garbage) to a port over a plain socket, with
a hard bound on every read, and reports what came back: a status code, a clean
close, or a hang (the bound ran out). The fuzz tests use it because ordinary
HTTP clients refuse to send what they are testing. ``RelStack`` is an engine
model and a sidecar as real subprocesses on loopback (``helpers_procs``), with a
control token and a state dir, and a way to ask both whether they are healthy.

Deliberately left out: Kubernetes (``cli/slipstream_testbed/faults.py`` and the
cluster fixtures) and any assertion (tests make their own).
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from integration.helpers_procs import MODEL, Proc, bearer, engine_proc, sidecar_proc
from slipstream_sidecar.proto import sidecar_pb2 as pb

TOKEN = "reliability-secret-token-7f3a9c"  # distinctive, so the log-hygiene test can grep for it


def fuzz_examples(default: int) -> int:
    """How many hypothesis examples a fuzz test runs (``SLIPSTREAM_FUZZ_EXAMPLES`` overrides)."""
    raw = os.environ.get("SLIPSTREAM_FUZZ_EXAMPLES")
    return int(raw) if raw else default


def fuzz_random() -> bool:
    """Derandomised by default (CI reproducible); ``SLIPSTREAM_FUZZ_RANDOM=1`` explores."""
    return os.environ.get("SLIPSTREAM_FUZZ_RANDOM", "") in {"1", "true", "yes"}


@dataclass(frozen=True, slots=True)
class RawResult:
    """What one raw exchange produced."""

    status: int | None  # HTTP status of the first response line, None if none came
    closed: bool  # the server closed the connection
    hung: bool  # the bound ran out with the connection open and no response
    data: bytes  # everything received (headers and, with ``read_all``, the body)
    seconds: float

    @property
    def body(self) -> bytes:
        """The bytes after the headers."""
        return self.data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in self.data else b""


def raw_exchange(
    port: int,
    payload: bytes,
    *,
    host: str = "127.0.0.1",
    bound_s: float = 10.0,
    half_close: bool = False,
    read_all: bool = False,
) -> RawResult:
    """Send ``payload``; read until a status line and headers (``read_all``: until the close)
    or a close, or until ``bound_s`` runs out."""
    start = time.monotonic()
    got = b""
    closed = False
    with socket.create_connection((host, port), timeout=bound_s) as sock:
        try:
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            closed = True
        deadline = start + bound_s
        while not closed:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            got += chunk
            if not read_all and b"\r\n\r\n" in got and len(got) >= 12:
                break  # a status line and headers: enough to judge
    status = None
    if got.startswith(b"HTTP/1."):
        try:
            status = int(got.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = None
    hung = status is None and not closed
    return RawResult(status, closed, hung, got, time.monotonic() - start)


def http_request(
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
) -> bytes:
    """A well-formed HTTP/1.1 request (``Connection: close``) as bytes."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    hdrs = dict(headers or {})
    if body or method == "POST":
        hdrs.setdefault("Content-Length", str(len(body)))
    lines += [f"{k}: {v}" for k, v in hdrs.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def get_status(url: str, timeout: float = 10.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as err:
        err.close()
        return int(err.code)


def complete(base_url: str, prompt: str = "Say hi.", max_tokens: int = 4,
             timeout: float = 60.0) -> dict[str, Any]:
    """One small non-streaming completion; raises on any non-200 answer."""
    req = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


@dataclass
class RelStack:
    """An engine model and a sidecar in front of it, both real processes."""

    engine: Proc
    sidecar: Proc
    tmp: Path

    @property
    def grpc_port(self) -> int:
        return self.sidecar.extra_ports["grpc"]

    def alive(self) -> bool:
        procs = (self.engine.popen, self.sidecar.popen)
        return all(p is not None and p.poll() is None for p in procs)

    def healthy(self) -> bool:
        """Both processes alive, both answer /health, and a real completion goes through."""
        if not self.alive():
            return False
        if get_status(self.engine.url + "/health") != 200:
            return False
        if get_status(self.sidecar.url + "/health") != 200:
            return False
        doc = complete(self.sidecar.url)
        return bool(doc.get("choices"))

    def stop(self) -> None:
        self.sidecar.stop()
        self.engine.stop()


def start_rel_stack(
    tmp: Path,
    *,
    sidecar_seqs: int = 16,
    engine_seqs: int = 64,
    mean_output_tokens: int = 16,
    sidecar_extra: Sequence[str] = (),
    engine_extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> RelStack:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    eng = engine_proc(
        tmp, max_num_seqs=engine_seqs, mean_output_tokens=mean_output_tokens, extra=engine_extra
    )
    if env is not None:
        eng.env = {**os.environ, **env}
    eng.start()
    sc = sidecar_proc(
        tmp, eng.url, token_file=token, state_dir=tmp / "state", max_num_seqs=sidecar_seqs,
        extra=sidecar_extra,
    )
    if env is not None:
        sc.env = {**(sc.env or os.environ), **env}
    try:
        sc.start()
    except RuntimeError:
        eng.stop()
        raise
    return RelStack(eng, sc, tmp)


# -- offline shards through the control API ----------------------------------------------------


def assign(stack: RelStack, shard_id: str, n: int, tmp: Path) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        stub = ch.unary_unary(
            "/slipstream.sidecar.v1alpha1.Sidecar/AssignShard",
            request_serializer=pb.AssignShardRequest.SerializeToString,
            response_deserializer=pb.AssignShardResponse.FromString,
        )
        shard = pb.Shard(
            shard_id=shard_id, job_namespace="default", job_name="bad", model=MODEL,
            input_uri=f"file://{tmp / 'in.jsonl'}", line_start=0, line_end=n,
            output_uri=f"file://{tmp / 'out.jsonl'}", error_uri=f"file://{tmp / 'err.jsonl'}",
            priority=10,
        )
        reply = stub(pb.AssignShardRequest(shard=shard), metadata=bearer(TOKEN), timeout=30)
        assert reply.accepted


def shard_progress(stack: RelStack, shard_id: str) -> pb.ShardProgress | None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        stub = ch.unary_unary(
            "/slipstream.sidecar.v1alpha1.Sidecar/Status",
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusResponse.FromString,
        )
        st = stub(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=30)
    return next((s for s in st.shards if s.shard_id == shard_id), None)


def wait_done(stack: RelStack, shard_id: str, timeout_s: float = 180) -> pb.ShardProgress:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = shard_progress(stack, shard_id)
        if p is not None and p.state in (pb.SHARD_STATE_SUCCEEDED, pb.SHARD_STATE_FAILED):
            return p
        time.sleep(0.2)
    raise AssertionError(f"shard {shard_id} did not end within {timeout_s}s")


def records(path: Path) -> list[dict[str, Any]]:
    """Every line must parse: a corrupt output file fails here."""
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_bytes().splitlines()]
