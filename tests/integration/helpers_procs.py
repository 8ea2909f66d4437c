"""Start ``slipstream engine`` and ``slipstream sidecar`` as real subprocesses on loopback.

Helpers for integration tests and benchmarks (import as ``helpers_procs``):
each process gets free ephemeral ports on 127.0.0.1, its output goes to a log
file beside the test's tmp dir, and ``start`` returns once the process answers
``GET /health`` (or raises with the log's tail). ``kill`` sends SIGKILL (the
``kill -9`` of the durability tests); ``stop`` sends SIGTERM and waits.

Deliberately left out: anything Kubernetes (``tests/fixtures/cluster.py``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
SLIPSTREAM = [sys.executable, "-m", "slipstream_cli.main"]
MODEL = "llama-2-7b"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout_s}s ({last!r})")


@dataclass
class Proc:
    """A started subprocess and where it listens."""

    name: str
    args: list[str]
    log_path: Path
    port: int
    extra_ports: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] | None = None
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_path: str = "/health", timeout_s: float = 60.0) -> Proc:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=self.env,
            start_new_session=True,
        )
        log.close()
        try:
            wait_http(self.url + ready_path, timeout_s, self.popen)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"{self.name} failed to start: {exc}\n{self.log_tail()}") from exc
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no cleanup, no flush (what a crash or OOM kill looks like)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def engine_proc(
    log_dir: Path,
    *,
    port: int | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    kv_blocks: int = 4096,
    mean_output_tokens: int = 64,
    extra: Sequence[str] = (),
    name: str = "engine",
) -> Proc:
    """An engine model on vLLM's HTTP API with the priority policy (not started yet)."""
    port = port or free_port()
    args = [
        *SLIPSTREAM, "engine", "--host", "127.0.0.1", "--port", str(port),
        "--model", MODEL, "--seed", str(seed), "--scheduling-policy", "priority",
        "--max-num-seqs", str(max_num_seqs), "--kv-blocks", str(kv_blocks),
        "--mean-output-tokens", str(mean_output_tokens), *extra,
    ]
    return Proc(name, args, log_dir / f"{name}.log", port)


def sidecar_proc(
    log_dir: Path,
    engine_url: str,
    *,
    token_file: Path | None = None,
    state_dir: Path | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    max_num_seqs: int = 64,
    kv_blocks: int | None = 4096,
    extra: Sequence[str] = (),
    name: str = "sidecar",
) -> Proc:
    """A sidecar in front of ``engine_url`` (not started yet); ``extra_ports['grpc']``.
    ``kv_blocks`` None: no ``--kv-blocks`` (the sidecar reads the engine's)."""
    http_port = http_port or free_port()
    grpc_port = grpc_port or free_port()
    args = [
        *SLIPSTREAM, "sidecar", "--engine", engine_url, "--host", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--max-num-seqs", str(max_num_seqs),
        *(["--kv-blocks", str(kv_blocks)] if kv_blocks is not None else []),
        *(["--auth-token-file", str(token_file)] if token_file else []),
        *(["--state-dir", str(state_dir)] if state_dir else []),
        *extra,
    ]
    env = dict(os.environ)
    return Proc(name, args, log_dir / f"{name}.log", http_port, {"grpc": grpc_port}, env)


def control_stub(grpc_port: int) -> tuple[object, object]:
    """A (channel, SidecarStub) to a sidecar's control port; close the channel when done."""
    import grpc

    from slipstream_sidecar.proto import sidecar_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    return channel, sidecar_pb2_grpc.SidecarStub(channel)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``token``."""
    return (("authorization", f"Bearer {token}"),)


_T = TypeVar("_T")


async def until(
    what: str, probe: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02
) -> None:
    """Await until ``probe()`` is true, on the running event loop (the code under test runs on
    it meanwhile); AssertionError after ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def eventually(
    what: str, probe: Callable[[], _T | None], timeout: float = 60.0, interval: float = 0.1
) -> _T:
    """``probe()`` until it returns something other than None; AssertionError after
    ``timeout`` seconds, naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a GET of ``url`` answers 200 (no proxy: every address here is loopback)."""
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except OSError:
        return False
