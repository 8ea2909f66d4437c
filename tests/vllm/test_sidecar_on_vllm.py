"""The sidecar in front of real ``vllm serve`` (CPU, the tiny model): online, offline, crashes.

Two live vLLM servers serve the module, both ``--max-num-seqs 1`` (so the order vLLM serves in
is observable: one request at a time) and ``--dtype float32`` (greedy decoding is then the same
whatever else is in the batch, so a request's uninterrupted answer, asked of vLLM directly, is
the reference for the same request through the sidecar, preempted or not). The tests that need
a request to arrive at a given moment (behind others in vLLM's queue, or while an offline line
is mid-answer) use the second, :data:`PAUSABLE`: they hold vLLM's scheduler with its own
``/pause`` while they set the moment up, so that nothing in them races the host's speed. Each
test starts its own sidecar (a real ``slipstream sidecar`` process on loopback) in front of its
server. The kill -9 test restarts the first server and runs last.

Token ids, not text, are compared wherever exactness matters: the tiny model's byte-level
tokenizer does not round-trip arbitrary generated text.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration.helpers_procs import Proc, bearer, control_stub, sidecar_proc
from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_testbed.vllm import DEFAULT_SERVED_NAME, VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = DEFAULT_SERVED_NAME
TOKEN = "vllm-tier-token"
VOLATILE = ("id", "created")


@pytest.fixture(scope="module")
def vllm(vllm_one_seq: VllmServer) -> VllmServer:
    return vllm_one_seq


@dataclass
class Stack:
    vllm: VllmServer
    sidecar: Proc
    tmp: Path
    _status: tuple[Any, Any] | None = None  # (channel, stub) kept for status()

    def stub(self) -> tuple[Any, Any]:
        ch, stub = control_stub(self.sidecar.extra_ports["grpc"])
        return ch, stub

    def status(self) -> Any:
        """The sidecar's Status, over one channel kept for the stack's life, as the operator
        keeps one per sidecar (tests poll it often; each new channel is a new connection and
        HTTP/2 handshake). A call that gets no answer in 60 s fails."""
        if self._status is None:
            self._status = self.stub()
        try:
            return self._status[1].Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=60)
        except grpc.RpcError as exc:
            raise AssertionError(f"Status failed: {exc!r}\n{self.stall_report()}") from exc

    def stall_report(self) -> str:
        """What a failed Status call leaves to read: whether a new channel gets an answer (the
        kept one or the server stalled), the sidecar's threads' stacks (SIGUSR1 makes it write
        them to its log), and the host's load, memory and page faults."""
        ch, stub = self.stub()
        try:
            stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
            fresh = "a new channel got an answer at once"
        except grpc.RpcError as exc:
            fresh = f"a new channel got no answer either: {exc.code()}"
        finally:
            ch.close()
        proc = self.sidecar.popen
        state = ""
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                state = " ".join(line for line in Path(f"/proc/{proc.pid}/status").read_text()
                                 .splitlines() if line.startswith(("State", "Threads", "VmRSS")))
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
        host = ""
        with contextlib.suppress(OSError):
            mem = Path("/proc/meminfo").read_text().splitlines()
            vm = Path("/proc/vmstat").read_text().splitlines()
            host = (f"loadavg {Path('/proc/loadavg').read_text().strip()}; "
                    + "; ".join(x for x in mem if x.startswith("MemAvailable"))
                    + "; " + "; ".join(x for x in vm if x.startswith("pgmajfault")))
        return (f"{fresh}; sidecar {state}; host {host}\n"
                f"sidecar log:\n{self.sidecar.log_tail(12000)}")

    def close(self) -> None:
        if self._status is not None:
            self._status[0].close()
            self._status = None


def start_sidecar(vllm: VllmServer, tmp: Path, *, seqs: int, kv_blocks: int | None = 4096) -> Stack:
    """A sidecar in front of ``vllm``; ``kv_blocks`` None: it reads the engine's KV cache."""
    token = tmp / "token"
    token.write_text(TOKEN)
    sc = sidecar_proc(tmp, vllm.url, token_file=token, state_dir=tmp / "state",
                      max_num_seqs=seqs, kv_blocks=kv_blocks,
                      extra=("--model", MODEL)).start(timeout_s=120)
    return Stack(vllm, sc, tmp)


def vllm_kv_cache(vllm: VllmServer) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) as vLLM serves them (``vllm:cache_config_info``), checked
    against the KV size in tokens its log states at start."""
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    (labels,) = [
        dict(s.labels)
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:cache_config_info"
        for s in f.samples
    ]
    blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    logged = re.findall(r"KV cache size: ([\d,]+) tokens", vllm.log_path.read_text())
    assert logged and int(logged[-1].replace(",", "")) == blocks * size, logged
    return blocks, size


def kv_cache(stack: Stack) -> tuple[int, int, str, str]:
    kv = stack.status().kv_cache
    return kv.num_blocks, kv.block_size, kv.num_blocks_source, kv.block_size_source


@pytest.fixture
def stack4(vllm: VllmServer, tmp_path: Path) -> Iterator[Stack]:
    """A sidecar that believes the engine has 4 slots (vLLM runs 1: the rest wait in vLLM)."""
    s = start_sidecar(vllm, tmp_path, seqs=4)
    yield s
    s.close()
    s.sidecar.stop()


# -- HTTP helpers ------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any] | bytes, timeout: float = 120) -> tuple[int, str, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = post(url, body)
    assert status == 200, raw
    doc: dict[str, Any] = json.loads(raw)
    return doc


@dataclass
class Streamed:
    chunks: list[dict[str, Any]]
    done: bool
    sent_s: float
    first_token_s: float | None
    token_ids: list[int]

    @property
    def token_events(self) -> int:
        """Events that carried tokens (vLLM sends several tokens in one event when its API
        server falls behind the engine)."""
        return sum(1 for c in self.chunks for ch in c.get("choices") or () if ch.get("token_ids"))

    @property
    def text_events(self) -> int:
        """Token events whose text is not empty (the sidecar times TBT between these)."""
        return sum(1 for c in self.chunks for ch in c.get("choices") or ()
                   if ch.get("token_ids")
                   and (ch.get("text") or (ch.get("delta") or {}).get("content")))

    @property
    def usage_tokens(self) -> int | None:
        for c in reversed(self.chunks):
            if c.get("usage"):
                return int(c["usage"]["completion_tokens"])
        return None

    def shape(self) -> list[Any]:
        """The chunks with the generated text and token ids taken out, in order, with each run
        of chunks that carry tokens merged into one. vLLM's API server puts every token
        produced since the client last read into one chunk, so how many chunks carry tokens
        depends on how it kept up with the engine (under load all 12 can come in one): merged,
        a run has the first chunk's prompt ids and the last one's finish reason, as the one
        chunk vLLM would have sent."""
        out: list[Any] = []
        merging = False
        for c in strip(self.chunks):
            tokens = False
            for ch in c.get("choices") or ():
                tokens = bool(ch.pop("token_ids", None)) or tokens
                ch.pop("text", None)
                (ch.get("delta") or {}).pop("content", None)
            if tokens and merging and _merged(out[-1], c) is not None:
                out[-1] = _merged(out[-1], c)
            elif not out or out[-1] != c:
                out.append(c)
            merging = tokens
        return out

    def text(self) -> str:
        return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                       for c in self.chunks for ch in c.get("choices") or ())


_EARLY = ("prompt_token_ids",)  # sent with a request's first tokens
_LATE = ("finish_reason", "stop_reason", "usage")  # sent with its last


def _merged(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any] | None:
    """Two stripped token chunks as one (``first``'s prompt ids, ``then``'s finish and stop
    reasons and usage), or None when they differ in anything else."""

    def merge(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        for k in {*x, *y}:
            if k in _EARLY:
                out[k] = x.get(k) if x.get(k) is not None else y.get(k)
            elif k in _LATE:
                out[k] = y.get(k)
            elif k == "choices":
                a, b = x.get(k) or [], y.get(k) or []
                if len(a) != len(b):
                    return None
                merged = [merge(i, j) for i, j in zip(a, b, strict=True)]
                if any(m is None for m in merged):
                    return None
                out[k] = merged
            elif x.get(k, _ABSENT) != y.get(k, _ABSENT):
                return None
            else:
                out[k] = x[k]
        return {k: out[k] for k in [*x, *(k for k in y if k not in x)]}

    return merge(first, then)


_ABSENT = object()


def stream(url: str, body: dict[str, Any]) -> Streamed:
    """POST a streamed request; time the first chunk carrying a token (token ids counted)."""
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        sent = time.monotonic()
        conn.request("POST", path, json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        buf, done, first = b"", False, None
        chunks: list[dict[str, Any]] = []
        ids: list[int] = []
        while piece := resp.read1(65536):
            now = time.monotonic()
            buf += piece
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                assert ev.startswith(b"data: "), ev
                payload = ev.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    done = True
                    continue
                doc = json.loads(payload)
                chunks.append(doc)
                for ch in doc.get("choices") or ():
                    got = ch.get("token_ids") or []
                    if got and first is None:
                        first = now
                    ids += got
        assert buf == b""
        return Streamed(chunks, done, sent, first, ids)
    finally:
        conn.close()


def strip(doc: Any) -> Any:
    """``doc`` with the fields that differ per request (ids, creation time) blanked."""
    if isinstance(doc, dict):
        return {k: ("<v>" if k in VOLATILE else strip(v)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [strip(v) for v in doc]
    return doc


def metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} not on {url}/metrics"
    return total


COMPLETION = {"model": MODEL, "prompt": "the batch job of the model", "max_tokens": 12,
              "temperature": 0, "ignore_eos": True}
CHAT = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "an online request"}]}


# -- online ------------------------------------------------------------------------------------


def test_online_bodies_are_vllms_own(vllm: VllmServer, stack4: Stack) -> None:
    sc = stack4.sidecar.url
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        direct = post_json(vllm.url + path, body)
        via = post_json(sc + path, body)
        assert strip(via) == strip(direct), path
        assert via["usage"]["completion_tokens"] == 12
        for opts in ({}, {"stream_options": {"include_usage": True}}):
            d = stream(vllm.url + path, {**body, **opts, "return_token_ids": True})
            v = stream(sc + path, {**body, **opts, "return_token_ids": True})
            assert d.done and v.done
            assert v.shape() == d.shape(), (path, opts)
            assert v.token_ids == d.token_ids and len(v.token_ids) == 12
            assert v.text() == d.text()
    # vLLM's errors reach the client as vLLM sent them, status included.
    for bad in ({**COMPLETION, "model": "no-such-model"},
                {**COMPLETION, "prompt": "word " * 600}):
        d_status, d_type, d_raw = post(vllm.url + "/v1/completions", bad)
        v_status, v_type, v_raw = post(sc + "/v1/completions", bad)
        assert d_status >= 400 and v_status == d_status, (d_raw, v_raw)
        assert v_type == d_type and json.loads(v_raw) == json.loads(d_raw)


def settled_count(url: str, name: str, at_least: float, timeout_s: float = 30) -> float:
    """An online counter of the sidecar once it has reached ``at_least`` (or at ``timeout_s``).
    The sidecar books a request's samples when its relay ends, which can be just after the
    client has read the last event: read at once, the counter may not have them yet."""
    deadline = time.monotonic() + timeout_s
    while (value := metric(url, name, **{"class": "online"})) < at_least:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return value


def test_token_counts_and_latencies_match_what_the_client_saw(stack4: Stack) -> None:
    sc = stack4.sidecar.url
    seen: list[Streamed] = []
    # (the sidecar's TBT samples, the client's gaps between events with text) per request
    gaps: list[tuple[float, int]] = []
    before = 0.0
    for i in range(6):
        path, body = ("/v1/completions", COMPLETION) if i % 2 else ("/v1/chat/completions", CHAT)
        opts: dict[str, Any] = {"stream_options": {"include_usage": True}} if i % 3 == 0 else {}
        seen.append(stream(sc + path, {**body, **opts, "max_tokens": 20 + 7 * i, "seed": i,
                                       "temperature": 1.0, "return_token_ids": True}))
        now = settled_count(sc, "slipstream_tbt_seconds_count", before + seen[-1].text_events - 1)
        gaps.append((now - before, seen[-1].text_events - 1))
        before = now
    assert all(a == b for a, b in gaps), gaps
    assert all(s.done for s in seen)
    assert sum(len(s.token_ids) for s in seen) == sum(20 + 7 * i for i in range(6))
    # What the client can count from the stream: usage when it asked for it (exact), else
    # one token per event, which is what the sidecar counts too (exact while vLLM sends one
    # event per token; see docs/sidecar.md).
    client_tokens = sum(s.usage_tokens if s.usage_tokens is not None else s.token_events
                        for s in seen)
    assert [s.usage_tokens for s in seen if s.usage_tokens is not None] == [20, 41]
    assert metric(sc, "slipstream_output_tokens_total", **{"class": "online"}) == client_tokens
    assert metric(sc, "slipstream_ttft_seconds_count", **{"class": "online"}) == len(seen)
    assert metric(sc, "slipstream_tbt_seconds_count", **{"class": "online"}) == sum(
        s.text_events - 1 for s in seen
    )
    # Each request's TTFT at the sidecar lies inside the client's (it arrives later and relays
    # the first token before the client reads it), so the sums are ordered the same way.
    client_ttft = sum(s.first_token_s - s.sent_s for s in seen if s.first_token_s is not None)
    assert 0 < metric(sc, "slipstream_ttft_seconds_sum", **{"class": "online"}) <= client_ttft
    online = stack4.status().online_counters
    assert online.output_tokens == client_tokens
    assert online.ttft_seconds.count == len(seen)
    assert online.tbt_seconds.count == sum(s.text_events - 1 for s in seen)


# -- offline -----------------------------------------------------------------------------------


def write_shard(path: Path, bodies: list[dict[str, Any] | bytes]) -> None:
    lines = []
    for i, body in enumerate(bodies):
        if isinstance(body, bytes):
            lines.append(body)
            continue
        url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": body}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")


def assign(stack: Stack, shard_id: str, n: int, stem: str = "") -> None:
    ch, stub = stack.stub()
    with ch:
        resp = stub.AssignShard(pb.AssignShardRequest(shard=pb.Shard(
            shard_id=shard_id, job_namespace="default", job_name="job", model=MODEL,
            input_uri=f"file://{stack.tmp / f'in{stem}.jsonl'}", line_start=0, line_end=n,
            output_uri=f"file://{stack.tmp / f'out{stem}.jsonl'}",
            error_uri=f"file://{stack.tmp / f'err{stem}.jsonl'}", priority=10,
        )), metadata=bearer(TOKEN))
    assert resp.accepted


def wait_shard(stack: Stack, shard_id: str, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in stack.status().shards:
            if p.shard_id == shard_id and p.state in (pb.SHARD_STATE_SUCCEEDED,
                                                      pb.SHARD_STATE_FAILED):
                return p
        time.sleep(0.2)
    raise TimeoutError(f"shard {shard_id} did not finish")


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def wait_until(cond: Any, what: str, timeout_s: float = 60,
               detail: Callable[[], str] = lambda: "", poll_s: float = 0.1) -> None:
    """Poll ``cond`` every ``poll_s`` until it holds; past ``timeout_s`` raise, with
    ``detail()`` (what was last seen) in the message."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} {detail()}".strip())
        time.sleep(poll_s)


def offline_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"offline line {i} of the shard", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}


LONG = 2000  # tokens: seconds of decoding for the tiny model on this CPU

PAUSABLE: dict[str, Any] = {
    "max_num_seqs": 1, "max_model_len": 2048,
    "extra_args": ("--dtype", "float32", "--enable-log-requests"),
    "env": {"VLLM_SERVER_DEV_MODE": "1"},
}
"""A one-sequence, float32 server of 2,048 positions whose scheduler the test can hold:
``VLLM_SERVER_DEV_MODE=1`` mounts vLLM's ``POST /pause`` and ``/resume``, and
``--enable-log-requests`` logs each request as vLLM's API server hands it to the engine."""


@pytest.fixture
def pausable(shared_vllm: Any) -> VllmServer:
    srv: VllmServer = shared_vllm(**PAUSABLE)
    return srv


@contextlib.contextmanager
def paused(vllm: VllmServer) -> Iterator[None]:
    """vLLM's scheduler held (``POST /pause?mode=keep``): it takes no step, what runs stays
    where it is, requests added meanwhile wait in its queue; on leaving, ``/resume``, and the
    scheduler goes on in its own order. Whatever the host's speed, nothing moves in between."""
    status, _, raw = post(vllm.url + "/pause?mode=keep", b"")
    assert status == 200, raw
    try:
        yield
    finally:
        status, _, raw = post(vllm.url + "/resume", b"")
        assert status == 200, raw


def added(vllm: VllmServer) -> int:
    """Requests vLLM's API server has handed to the engine (its ``Added request`` lines). The
    hand-over and ``/resume`` travel on the same socket to the engine, in order: a request
    counted here before ``/resume`` is sent is in the scheduler's queue when it resumes."""
    return vllm.log_path.read_text(errors="replace").count("Added request ")


@pytest.fixture
def long_stack4(pausable: VllmServer, tmp_path: Path) -> Iterator[Stack]:
    """As ``stack4``, before the pausable server: requests of 2,000 tokens keep it busy for
    seconds each."""
    s = start_sidecar(pausable, tmp_path, seqs=4)
    yield s
    s.close()
    s.sidecar.stop()


def test_vllm_serves_in_the_priority_the_sidecar_assigns(long_stack4: Stack) -> None:
    """vLLM runs one request at a time. With its scheduler paused, two offline lines and then
    one online request, all through the sidecar, are added to vLLM's queue; then it resumes.
    The online request (priority 0) is served before the offline lines (priority 100) that
    reached vLLM first: it is answered while no offline line has finished (an offline line,
    once running, holds the slot for seconds).

    Each step of the setup is read twice: the sidecar's Status says it has sent the request,
    and vLLM's log says its API server handed it to the engine. Neither reading races the
    engine: while paused, nothing in vLLM moves, however slow the host."""
    stack, vllm = long_stack4, long_stack4.vllm
    tmp = stack.tmp
    write_shard(tmp / "in.jsonl", [offline_body(i, LONG) for i in range(2)])
    out = tmp / "out.jsonl"
    # The shared server must first be idle (an earlier test's requests may still be draining).
    # Each probe of vLLM's gauges is a /metrics request: rendering it runs on vLLM's API server
    # loop, so probing fast slows the server the test is watching.
    wait_until(lambda: gauges(vllm) == (0, 0), "vLLM idle", 300, poll_s=0.5)

    def sent(cls: str) -> int:
        return int(getattr(stack.status(), cls).in_flight)

    late: list[int] = []

    def online() -> None:
        post_json(stack.sidecar.url + "/v1/completions", {**COMPLETION, "max_tokens": 8})
        late.append(len(records(out)))

    u = threading.Thread(target=online)

    def shown() -> str:
        status = stack.status()
        shards = [(p.shard_id, p.state, p.completed, p.in_flight, p.message)
                  for p in status.shards]
        log = stack.sidecar.log_path
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        return (f"(sidecar: engine ready {status.engine_ready}, offline queued "
                f"{status.offline.queued} in flight {status.offline.in_flight}, online in flight "
                f"{status.online.in_flight}; shards (id, state, completed, in flight, message) "
                f"{shards}; vLLM added {added(vllm) - base} since the pause; the sidecar's "
                f"log ends:\n" + "\n".join(tail) + ")")

    with paused(vllm):
        base = added(vllm)
        assign(stack, "prio", 2)
        wait_until(lambda: sent("offline") == 2 and added(vllm) - base >= 2,
                   "offline lines in vLLM's queue", 300, shown, poll_s=0.5)
        u.start()
        wait_until(lambda: sent("online") == 1 and added(vllm) - base >= 3,
                   "online request in vLLM's queue", 300, shown, poll_s=0.5)
        assert added(vllm) - base == 3 and not records(out), shown()
    u.join(300)
    assert late, "the online request got no answer"
    assert late == [0], f"an offline line was served before the online request: {shown()}"
    progress = wait_shard(stack, "prio")
    assert progress.completed == 2 and progress.preemptions == 0


def gauges(vllm: VllmServer) -> tuple[float, float]:
    """vLLM's (running, waiting) request gauges."""
    return (metric(vllm.url, "vllm:num_requests_running"),
            metric(vllm.url, "vllm:num_requests_waiting"))


def chat_offline_body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True,
            "messages": [{"role": "user", "content": f"offline line {i} of the shard"}]}


@pytest.fixture
def stack1(pausable: VllmServer, tmp_path: Path) -> Iterator[Stack]:
    """A sidecar that knows the engine runs one request at a time: its one offline request
    is the one vLLM is decoding, so an online arrival aborts it mid-answer."""
    s = start_sidecar(pausable, tmp_path, seqs=1)
    yield s
    s.close()
    s.sidecar.stop()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_online_burst_preempts_offline_and_continuations_keep_every_token(
    stack1: Stack, kind: str
) -> None:
    """Every line of the shard is a completion, or every line a chat. Online requests arrive
    while an offline line is mid-answer; the sidecar (one slot) aborts the line at each
    arrival and later resumes it as a continuation. Each line's output is then compared on
    token ids with the same request asked of vLLM directly, uninterrupted."""
    vllm = stack1.vllm
    n = 12
    line, max_tokens, path = ((offline_body, 480, "/v1/completions") if kind == "completion"
                              else (chat_offline_body, 440, "/v1/chat/completions"))
    bodies: list[dict[str, Any] | bytes] = [line(i, max_tokens) for i in range(n)]
    write_shard(stack1.tmp / "in.jsonl", bodies)
    sc = stack1.sidecar.url

    # The online request goes while vLLM's scheduler is paused with an offline line mid-answer
    # in it, so the line it cuts has tokens to resume from, however slow the host: nothing
    # decodes until the cut is made. Mid-answer is read once the sidecar has every token vLLM
    # produced before the pause (what was still in the stream's buffers is in: the sidecar's
    # offline tokens equal vLLM's generated tokens since the test began), so a line that had
    # already ended in the engine is never taken for one in flight. One line at a time, all of
    # max_tokens each: the tokens of the current line are the count modulo max_tokens. Until
    # such a pause is found, the test retries every 24 offline tokens (at most 60 times).
    results: list[Streamed] = []
    errors: list[BaseException] = []
    sent_at: list[tuple[float, float]] = []  # (s into the shard, offline tokens) at each send
    skipped: list[str] = []  # why each pause found no line mid-answer
    shard_done = threading.Event()
    generated_before = metric(vllm.url, "vllm:generation_tokens_total")

    def offline_tokens() -> float:
        return metric(sc, "slipstream_output_tokens_total", **{"class": "offline"})

    def resumed_tokens() -> float:
        return metric(sc, "slipstream_offline_resumed_tokens_total")

    lost = 0.0  # tokens vLLM generated that never reached the sidecar (a stream that broke)

    def line_mid_answer() -> str | None:
        """While vLLM is paused: None when one offline line is in flight with tokens produced
        and tokens to go, else why not. Waits for the sidecar to read what vLLM produced; what
        it still lacks after 10 s is taken as lost, and this pause is skipped."""
        nonlocal lost
        deadline = time.monotonic() + 10
        while True:
            generated = metric(vllm.url, "vllm:generation_tokens_total") - generated_before
            seen = offline_tokens()
            if seen + lost == generated or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if seen + lost != generated:
            lost = generated - seen
            return f"the sidecar has {seen} offline tokens, vLLM generated {generated}"
        if (n_in := metric(sc, "slipstream_in_flight_requests", **{"class": "offline"})) != 1:
            return f"{n_in} offline lines in flight"
        if seen % max_tokens == 0:
            return f"a line ended at {seen} tokens"
        return None

    def cut_while_paused(i: int) -> Streamed | None:
        """One online request sent while vLLM is paused with an offline line mid-answer; its
        answer once vLLM resumes (None: no line was mid-answer at the pause)."""
        box: list[Streamed] = []
        with paused(vllm):
            if (why := line_mid_answer()) is not None:
                skipped.append(why)
                return None
            cuts = metric(sc, "slipstream_preemptions_total")
            u = threading.Thread(target=lambda: box.append(stream(sc + "/v1/completions", {
                **COMPLETION, "max_tokens": 16, "seed": i, "return_token_ids": True})))
            u.start()
            wait_until(lambda: metric(sc, "slipstream_preemptions_total") > cuts,
                       "the sidecar cutting the offline line", 120, poll_s=0.2)
        u.join(120)
        assert box, "the online request got no answer"
        return box[0]

    def online() -> None:
        start = time.monotonic()
        try:
            for i in range(60):
                base = offline_tokens()
                while (now := offline_tokens()) < base + 24:
                    if shard_done.wait(0.05):
                        return
                sent_at.append((round(time.monotonic() - start, 2), now))
                before = resumed_tokens()
                got = cut_while_paused(i)
                if got is None:
                    continue
                results.append(got)
                # The cut line had tokens and tokens to go: it is resumed from them.
                wait_until(lambda b=before: resumed_tokens() > b,
                           "the cut line resumed from its tokens", 120, poll_s=0.2)
                return
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    started = time.monotonic()
    assign(stack1, "burst", n)
    u = threading.Thread(target=online, daemon=True)
    u.start()
    try:
        progress = wait_shard(stack1, "burst")
    finally:
        took = time.monotonic() - started
        shard_done.set()
        u.join(150)
    seen = (f"(s into the shard, offline tokens) at each pause: {sent_at}; pauses without a "
            f"line mid-answer: {skipped}; the shard took {took:.1f} s; the sidecar's warnings: "
            f"{warnings(stack1)}")
    assert not errors, (errors, seen)
    assert len(results) == 1 and results[0].done, (len(results), seen)
    assert progress.state == pb.SHARD_STATE_SUCCEEDED and progress.completed == n
    assert progress.preemptions > 0, "the online requests must abort offline work"
    out = {r["custom_id"]: r for r in records(stack1.tmp / "out.jsonl")}
    assert set(out) == {f"req-{i}" for i in range(n)} and len(out) == n
    for i in range(n):
        ref = post_json(vllm.url + path, line(i, max_tokens))
        got = out[f"req-{i}"]["response"]["body"]
        assert got["object"] == ref["object"]
        for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got["usage"][k] == ref["usage"][k], (i, k)
        gc, rc = got["choices"][0], ref["choices"][0]
        assert gc["token_ids"] == rc["token_ids"], i
        assert gc["finish_reason"] == "length"
        if kind == "completion":
            assert gc["prompt_token_ids"] == rc["prompt_token_ids"]
            assert gc["text"] == rc["text"], (i, first_difference(gc["text"], rc["text"]))
        else:
            assert got["prompt_token_ids"] == ref["prompt_token_ids"]
            assert gc["message"]["content"] == rc["message"]["content"], (
                i, first_difference(gc["message"]["content"], rc["message"]["content"]))
            assert gc["message"]["role"] == "assistant"


def warnings(stack: Stack) -> list[str]:
    """The sidecar's log lines at WARNING or above, for an assertion message."""
    text = stack.sidecar.log_tail(1 << 20)
    return [ln for ln in text.splitlines() if " WARNING " in ln or " ERROR " in ln][-20:]


def first_difference(got: str, want: str) -> str:
    """Where two texts part, with a little context, for an assertion message."""
    k = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
             min(len(got), len(want)))
    return f"at {k}: got {got[max(k - 20, 0):k + 20]!r}, want {want[max(k - 20, 0):k + 20]!r}"


def test_shard_errors_name_their_line_and_the_rest_finishes(stack4: Stack) -> None:
    bodies: list[dict[str, Any] | bytes] = [offline_body(i, 8) for i in range(6)]
    bodies[1] = b"{not json"
    bodies[4] = {**offline_body(4, 8), "prompt": "word " * 700}
    write_shard(stack4.tmp / "in.jsonl", bodies)
    assign(stack4, "errs", len(bodies))
    progress = wait_shard(stack4, "errs")
    assert progress.state == pb.SHARD_STATE_SUCCEEDED
    assert (progress.completed, progress.failed) == (4, 2)
    errs = {int(r["id"].rsplit("_L", 1)[1]): r for r in records(stack4.tmp / "err.jsonl")}
    assert sorted(errs) == [1, 4]
    for line, rec in errs.items():
        assert rec["response"] is None and f"line {line}" in rec["error"]["message"]
    assert errs[4]["custom_id"] == "req-4"
    ok = [r["custom_id"] for r in records(stack4.tmp / "out.jsonl")]
    assert sorted(ok) == ["req-0", "req-2", "req-3", "req-5"]


def test_kill_9_of_vllm_mid_shard_then_restart(vllm: VllmServer, tmp_path: Path) -> None:
    """Last in the module: it restarts the module's vLLM (same port)."""
    # Seconds of work after the trigger (24 lines of 160 tokens, one at a time in vLLM): with
    # 12 lines of 48 the whole shard once finished before the kill landed.
    n, max_tokens = 24, 160
    write_shard(tmp_path / "in.jsonl", [offline_body(i, max_tokens) for i in range(n)])
    s = start_sidecar(vllm, tmp_path, seqs=4, kv_blocks=None)
    try:
        # Without --kv-blocks or --block-size the sidecar admits with vLLM's own KV cache
        # (on CPU: blocks of 128 tokens, where the sidecar's default is 16).
        blocks, size = vllm_kv_cache(vllm)
        assert kv_cache(s) == (blocks, size, "engine", "engine")
        assign(s, "crash", n)
        wait_until(lambda: len(records(tmp_path / "out.jsonl")) >= 3, "3 lines done")
        vllm.kill()
        done_before = len(records(tmp_path / "out.jsonl"))
        assert done_before < n, "the kill must land mid-shard"
        vllm.start()
        progress = wait_shard(s, "crash")
        assert progress.state == pb.SHARD_STATE_SUCCEEDED and progress.completed == n
        # Read again from the restarted engine (same flags: the same cache).
        assert kv_cache(s) == (*vllm_kv_cache(vllm), "engine", "engine")
    finally:
        s.close()
        s.sidecar.stop()
    ids = [r["custom_id"] for r in records(tmp_path / "out.jsonl")]
    assert sorted(ids) == sorted(f"req-{i}" for i in range(n)), "each custom_id exactly once"
    assert records(tmp_path / "err.jsonl") == []
    # A line cut by the crash resumed from its exact tokens: the same tokens as one
    # uninterrupted request.
    for r in records(tmp_path / "out.jsonl"):
        got = r["response"]["body"]
        i = int(r["custom_id"].removeprefix("req-"))
        ref = post_json(vllm.url + "/v1/completions", offline_body(i, max_tokens))
        assert got["usage"]["completion_tokens"] == max_tokens
        assert got["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], r["custom_id"]
