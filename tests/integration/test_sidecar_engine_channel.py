"""Engine mode through a real sidecar process and the engine model: the channel's files.

A capture proxy on 127.0.0.1 sits between the sidecar and the engine model and records
every request body, so the test sees exactly what the sidecar sent to the engine.
"""

from __future__ import annotations

import asyncio
import json
import stat
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers_procs import MODEL, bearer, control_stub, engine_proc, free_port, sidecar_proc

from slipstream_scheduler.enginecontrol import (
    OFFLINE_TOKEN_ARG,
    ClassCounts,
    ClassLatency,
    CumulativeHistogram,
    EngineReport,
    decode_control,
)
from slipstream_sidecar.proto import sidecar_pb2 as pb

pytestmark = pytest.mark.integration

TOKEN = "integration-token"


class Capture:
    """A forwarding HTTP proxy that records (path, JSON body) of every POST."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def seen(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            return list(self.bodies)

    def start(self) -> Capture:
        self._thread.start()
        self._ready.wait()
        return self

    def stop(self) -> None:
        assert self._stop is not None and self._loop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession()

        async def handle(request: web.Request) -> web.StreamResponse:
            data = await request.read()
            if request.method == "POST" and data:
                with self._lock:
                    self.bodies.append((request.path, json.loads(data)))
            async with session.request(
                request.method, self.upstream + request.path_qs, data=data or None,
                headers={"Content-Type": request.headers.get("Content-Type", "")},
            ) as up:
                resp = web.StreamResponse(status=up.status)
                resp.content_type = up.content_type
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    eng = engine_proc(tmp_path, max_num_seqs=16).start()
    yield eng.url
    eng.stop()


def _sidecar(tmp: Path, engine_url: str, chan: Path) -> Any:
    token = tmp / "token"
    token.write_text(TOKEN)
    return sidecar_proc(
        tmp, engine_url, token_file=token, state_dir=tmp / "state",
        extra=["--engine-channel", str(chan)],
    ).start()


def _control(chan: Path) -> Any:
    return decode_control((chan / "control.json").read_text())


def test_configure_reaches_the_channel_and_survives_a_restart(tmp_path: Path, engine: str) -> None:
    chan = tmp_path / "chan"
    sc = _sidecar(tmp_path, engine, chan)
    try:
        mode = stat.S_IMODE((chan / "offline.token").stat().st_mode)
        token = (chan / "offline.token").read_text().strip()
        assert mode == 0o600 and len(token) == 64
        first = _control(chan)
        assert (first.generation, first.policy, first.budget_s) == (0, "naive", None)
        coeffs = {"const": 0.004, "s_p": 2e-5, "n_d": 1e-4, "s_d_ctx": 1e-7}
        ch, stub = control_stub(sc.extra_ports["grpc"])
        with ch:
            r = stub.Configure(pb.ConfigureRequest(
                generation=3, budget_s=0.05, ordering="fcfs", idle_budget_s=float("inf"),
                slo=pb.Slo(ttft_p99_s=0.5, tbt_p99_s=0.1),
                latency_model=pb.LatencyModelSpec(kind="context", coefficients=coeffs),
            ), metadata=bearer(TOKEN))
            assert r.applied
            doc = _control(chan)
            assert (doc.generation, doc.policy, doc.budget_s, doc.ordering) == (
                3, "budget", 0.05, "fcfs")
            assert doc.idle_budget_s == float("inf")
            assert doc.slo == {"ttft_p99_s": 0.5, "tbt_p99_s": 0.1}
            assert doc.latency_model is not None
            assert doc.latency_model["coefficients"]["s_p"] == pytest.approx(2e-5)
            st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
            assert (st.generation, st.budget_s) == (3, 0.05)  # the plugin's, as configured
            assert st.idle_budget_s == float("inf")
            r = stub.Configure(pb.ConfigureRequest(generation=2, budget_s=9.0),
                               metadata=bearer(TOKEN))
            assert not r.applied
            assert _control(chan) == doc  # an older generation never reaches the plugin
            r = stub.Configure(pb.ConfigureRequest(generation=5, ordering="gittins"),
                               metadata=bearer(TOKEN))
            assert r.applied
            doc = _control(chan)
            assert (doc.generation, doc.policy, doc.budget_s, doc.ordering) == (
                5, "naive", None, "gittins")
            assert doc.latency_model is not None  # the model in force is kept
        # The plugin's report reaches the sidecar's /metrics (an old one: not "up").
        report = EngineReport(generation=5, written_at=1.0, offline_preemptions=4,
                              online_waiting=2, online=ClassLatency(ttft_p99_s=0.25))
        (chan / "status.json").write_text(report.model_dump_json())
        with urllib.request.urlopen(sc.url + "/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        for line in ("slipstream_engine_up 0.0", "slipstream_engine_generation 5.0",
                     'slipstream_engine_preemptions{class="offline"} 4.0',
                     'slipstream_engine_requests{class="online",state="waiting"} 2.0',
                     'slipstream_engine_ttft_seconds{class="online",stat="p99"} 0.25'):
            assert line in metrics, line
        # The online latency the operator reads from Status is the plugin's (engine mode:
        # no online request crossed this sidecar).
        ttft = CumulativeHistogram(upper_bounds=(0.1, 0.5, float("inf")),
                                   cumulative_counts=(3.0, 7.0, 8.0), sum=2.5, count=8.0)
        report = EngineReport(generation=5, written_at=1.0,
                              online_counts=ClassCounts(ttft=ttft, finished_ok=8.0,
                                                        output_tokens=640.0))
        (chan / "status.json").write_text(report.model_dump_json())
        ch, stub = control_stub(sc.extra_ports["grpc"])
        with ch:
            st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
        c = st.online_counters
        assert list(c.ttft_seconds.upper_bounds) == [0.1, 0.5, float("inf")]
        assert list(c.ttft_seconds.cumulative_counts) == [3.0, 7.0, 8.0]
        assert (c.ttft_seconds.count, c.finished_ok, c.output_tokens) == (8.0, 8.0, 640.0)
    finally:
        sc.stop()
    (chan / "control.json").unlink()
    sc = _sidecar(tmp_path, engine, chan)
    try:
        assert (chan / "offline.token").read_text().strip() == token
        assert stat.S_IMODE((chan / "offline.token").stat().st_mode) == 0o600
        again = _control(chan)  # rewritten at start from the sidecar's saved configuration
        assert (again.generation, again.ordering) == (5, "gittins")
    finally:
        sc.stop()


def test_offline_requests_carry_the_token_and_online_ones_do_not(
    tmp_path: Path, engine: str
) -> None:
    chan = tmp_path / "chan"
    cap = Capture(engine).start()
    sc = _sidecar(tmp_path, cap.url, chan)
    try:
        token = (chan / "offline.token").read_text().strip()
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": MODEL, "seed": i, "max_tokens": 8, "prompt": f"offline {i}",
                      **({"vllm_xargs": {"other": "kept"}} if i == 0 else {})}}
            for i in range(3)
        ]
        (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
        body = json.dumps({"model": MODEL, "prompt": "online hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(sc.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        ch, stub = control_stub(sc.extra_ports["grpc"])
        with ch:
            r = stub.AssignShard(pb.AssignShardRequest(shard=pb.Shard(
                shard_id="s1", job_namespace="default", job_name="job", model=MODEL,
                input_uri=f"file://{tmp_path / 'in.jsonl'}", line_start=0, line_end=3,
                output_uri=f"file://{tmp_path / 'out.jsonl'}",
                error_uri=f"file://{tmp_path / 'err.jsonl'}", priority=10,
            )), metadata=bearer(TOKEN))
            assert r.accepted
            while True:
                st = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN))
                states = {p.shard_id: p.state for p in st.shards}
                if states.get("s1") in (pb.SHARD_STATE_SUCCEEDED, pb.SHARD_STATE_FAILED):
                    break
                threading.Event().wait(0.2)
        assert states["s1"] == pb.SHARD_STATE_SUCCEEDED
    finally:
        sc.stop()
        cap.stop()
    gen = [(p, b) for p, b in cap.seen() if p == "/v1/completions"]
    offline = [b for _, b in gen if str(b.get("prompt", "")).startswith("offline")]
    online = [b for _, b in gen if b.get("prompt") == "online hello"]
    assert len(offline) >= 3 and len(online) == 1
    for b in offline:
        assert b["vllm_xargs"][OFFLINE_TOKEN_ARG] == token
    assert any(b["vllm_xargs"].get("other") == "kept" for b in offline)
    assert "vllm_xargs" not in online[0]
