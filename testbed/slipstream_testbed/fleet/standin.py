"""Many fake sidecars in one asyncio process, for fleet-scale runs of the operator.

At fleet scale (thousands of pods) the operator cannot be fed by one real sidecar
and engine per pod. The stand-in answers exactly what the operator calls on a
pod (``observe.py``/``handlers.py``): the real control gRPC service
(``sidecar.proto``, the generated ``SidecarServicer``) on ``<pod IP>:9000``
with bearer-token checks, and ``GET /metrics`` on ``<pod IP>:8000`` with the
sidecar's metric names (the operator scrapes it only from pods whose ``Status``
has no ``online_counters``; ``status_counters=False`` plays such older sidecars).
Each pod gets its own grpc.aio server (the servicer must know which pod it is,
and gRPC does not tell a handler which local address was dialled); the HTTP
side is one aiohttp app with one listening site per IP (a handler reads its
local address from the transport).

Values change in a way a benchmark can time: :meth:`Standin.bump` adds one
online request per pod at a known time (TTFT/TBT histograms and counters move),
so an InferenceService's ``status.observed.samples`` rises by its replica count
once the operator has read every pod after the bump. Shards the operator
assigns are reported ``running`` with steady progress (a fixed number of lines
per second, never finishing unless ``finish_shards`` is set), spare capacity
varies per pod, and Configure is versioned like the real sidecar's.

Deliberately left out: the OpenAI proxy, engines, shard I/O (nothing is read or
written for a shard) and Drain
waiting (it answers at once). Never logs prompt text (there is none).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import resource
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web

from slipstream_sidecar.proto import sidecar_pb2 as pb
from slipstream_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from slipstream_sidecar.watch import paced_snapshots

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TBT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class StandinError(RuntimeError):
    """A fake pod could not be served (address in use, descriptor limit, unknown pod)."""

    def __init__(self, message: str, pod: str = "", address: str = "") -> None:
        super().__init__(f"{message} (pod {pod or '?'}, {address or '?'})")
        self.pod = pod
        self.address = address


@dataclass(frozen=True, slots=True)
class StandinConfig:
    """Ports and pacing of the fake pods (the InferenceService defaults: 8000/9000)."""

    http_port: int = 8000
    grpc_port: int = 9000
    lines_per_second: float = 2.0  # shard progress of a running fake shard
    tokens_per_line: int = 64  # output tokens credited per finished line
    finish_shards: bool = False  # True: a shard reaches `succeeded` when its lines are done
    watch_interval_s: float = 1.0
    status_counters: bool = True  # False: Status without online_counters (an older sidecar)


@dataclass
class FakeShard:
    """One assigned shard as the fake sidecar tracks it."""

    shard_id: str
    total: int
    since_s: float
    state: int = pb.SHARD_STATE_RUNNING


@dataclass
class FakePod:
    """The state of one fake sidecar (mutable, owned by the stand-in's loop)."""

    name: str
    ip: str
    token: str
    generation: int = 0
    budget_s: float | None = None
    ordering: str = "fcfs"
    ready: bool = True
    online_requests: int = 0
    shards: dict[str, FakeShard] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    """Set on every change a ``WatchStatus`` stream's signature covers (bump, Configure, Drain;
    its pacing clears it)."""

    def spare_capacity(self) -> float:
        """A plausible, pod-specific spare fraction in [0.2, 0.8] (stable per name)."""
        return 0.2 + 0.6 * (zlib.crc32(self.name.encode()) % 1000) / 999.0

    def progress(self, shard: FakeShard, now_s: float, config: StandinConfig) -> pb.ShardProgress:
        done = min(shard.total, int((now_s - shard.since_s) * config.lines_per_second))
        state = shard.state
        if config.finish_shards and done >= shard.total and state == pb.SHARD_STATE_RUNNING:
            state = pb.SHARD_STATE_SUCCEEDED
        rate = 0.0 if state != pb.SHARD_STATE_RUNNING else (
            config.lines_per_second * config.tokens_per_line)
        return pb.ShardProgress(
            shard_id=shard.shard_id, state=state,  # type: ignore[arg-type]
            total=shard.total, completed=done, in_flight=0 if done >= shard.total else 1,
            output_tokens=done * config.tokens_per_line, tokens_per_second=rate,
        )

    def status(self, now_s: float, config: StandinConfig) -> pb.StatusResponse:
        shards = [self.progress(s, now_s, config) for s in self.shards.values()]
        running = sum(1 for s in shards if s.state == pb.SHARD_STATE_RUNNING)
        msg = pb.StatusResponse(
            generation=self.generation,
            online=pb.ClassStatus(admitted_total=self.online_requests),
            offline=pb.ClassStatus(in_flight=running, admitted_total=len(self.shards)),
            spare_capacity=self.spare_capacity(),
            engine_ready=self.ready,
            draining=False,
            shards=shards,
            predicted_step_s=0.02 + 0.001 * running,
            observed_step_s=0.02 + 0.001 * running,
            ordering=self.ordering,
        )
        if self.budget_s is not None:
            msg.budget_s = self.budget_s
        if config.status_counters:
            msg.online_counters.CopyFrom(online_counters(self))
        return msg


def _histogram_pb(n: int, buckets: tuple[float, ...], value: float) -> pb.Histogram:
    return pb.Histogram(upper_bounds=[*buckets, math.inf],
                        cumulative_counts=[n if value <= le else 0 for le in buckets] + [n],
                        sum=value * n, count=n)


def online_counters(pod: FakePod) -> pb.ClassCounters:
    """The same online series as :func:`render_metrics`, as ``Status`` carries them."""
    n = pod.online_requests
    return pb.ClassCounters(
        ttft_seconds=_histogram_pb(n, TTFT_BUCKETS, 0.3),
        tbt_seconds=_histogram_pb(n, TBT_BUCKETS, 0.04),
        admitted=n, finished_ok=n, output_tokens=n * 128,
    )


def render_metrics(pod: FakePod) -> str:
    """The sidecar's online metrics for one pod, as Prometheus text (``observe.parse_sample``).

    Every bump adds one online request with TTFT 0.3 s and TBT 0.04 s (one token gap).
    """
    n = pod.online_requests
    lines: list[str] = []

    def histogram(name: str, buckets: tuple[float, ...], value: float) -> None:
        lines.append(f"# TYPE {name} histogram")
        for le in buckets:
            count = n if value <= le else 0
            lines.append(f'{name}_bucket{{class="online",le="{le}"}} {count}')
        lines.append(f'{name}_bucket{{class="online",le="+Inf"}} {n}')
        lines.append(f'{name}_sum{{class="online"}} {value * n}')
        lines.append(f'{name}_count{{class="online"}} {n}')

    histogram("slipstream_ttft_seconds", TTFT_BUCKETS, 0.3)
    histogram("slipstream_tbt_seconds", TBT_BUCKETS, 0.04)
    lines.append("# TYPE slipstream_requests_admitted_total counter")
    lines.append(f'slipstream_requests_admitted_total{{class="online"}} {n}')
    lines.append("# TYPE slipstream_requests_finished_total counter")
    lines.append(f'slipstream_requests_finished_total{{class="online",outcome="ok"}} {n}')
    lines.append("# TYPE slipstream_output_tokens_total counter")
    lines.append(f'slipstream_output_tokens_total{{class="online"}} {n * 128}')
    return "\n".join(lines) + "\n"


Handler = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class _TokenCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without ``authorization: Bearer <the pod's token>`` (constant-time)."""

    def __init__(self, pod: FakePod) -> None:
        self._pod = pod

    async def intercept_service(
        self, continuation: Handler, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode()
        handler = await continuation(details)
        expected = f"Bearer {self._pod.token}"
        if handler is None or hmac.compare_digest(presented.encode(), expected.encode()):
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

        if handler.unary_unary is None:
            return handler  # streaming methods are checked inside the servicer
        return grpc.unary_unary_rpc_method_handler(
            deny, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class FakeSidecarServicer(pb_grpc.SidecarServicer):
    """The control API of one fake pod."""

    def __init__(self, pod: FakePod, config: StandinConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pod = pod
        self.config = config
        self.clock = clock

    def _count(self, method: str) -> None:
        self.pod.calls[method] = self.pod.calls.get(method, 0) + 1

    async def Configure(  # noqa: N802
        self, request: pb.ConfigureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ConfigureResponse:
        self._count("Configure")
        pod = self.pod
        if request.generation <= pod.generation:
            return pb.ConfigureResponse(generation=pod.generation, applied=False)
        pod.generation = request.generation
        pod.budget_s = request.budget_s if request.HasField("budget_s") else None
        pod.ordering = request.ordering or pod.ordering
        pod.changed.set()
        return pb.ConfigureResponse(generation=pod.generation, applied=True)

    async def AssignShard(  # noqa: N802
        self, request: pb.AssignShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.AssignShardResponse:
        self._count("AssignShard")
        shard = request.shard
        if not shard.shard_id or shard.line_end <= shard.line_start:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty or unnamed shard")
        now = self.clock()
        known = self.pod.shards.get(shard.shard_id)
        if known is None or known.state == pb.SHARD_STATE_REVOKED:
            known = FakeShard(shard.shard_id, int(shard.line_end - shard.line_start), now)
            self.pod.shards[shard.shard_id] = known
        return pb.AssignShardResponse(
            accepted=self.pod.ready, progress=self.pod.progress(known, now, self.config))

    async def RevokeShard(  # noqa: N802
        self, request: pb.RevokeShardRequest, context: grpc.aio.ServicerContext
    ) -> pb.RevokeShardResponse:
        self._count("RevokeShard")
        shard = self.pod.shards.get(request.shard_id)
        if shard is None:
            return pb.RevokeShardResponse(revoked=False)
        shard.state = pb.SHARD_STATE_REVOKED
        del self.pod.shards[request.shard_id]
        return pb.RevokeShardResponse(
            revoked=True, progress=self.pod.progress(shard, self.clock(), self.config))

    async def Status(  # noqa: N802
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        self._count("Status")
        return self.pod.status(self.clock(), self.config)

    async def WatchStatus(  # noqa: N802
        self, request: pb.WatchStatusRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StatusResponse]:
        self._count("WatchStatus")
        presented = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(presented).encode(), f"Bearer {self.pod.token}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        pod = self.pod

        def snapshot() -> pb.StatusResponse:
            self._count("WatchStatus.sent")
            return pod.status(self.clock(), self.config)

        async for msg in paced_snapshots(
                snapshot, interval_s=max(request.interval_s or self.config.watch_interval_s, 0.05),
                min_interval_s=request.min_interval_s, changed=pod.changed, clock=self.clock):
            yield msg

    async def Drain(  # noqa: N802
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainResponse:
        self._count("Drain")
        self.pod.ready = False
        for shard in self.pod.shards.values():
            shard.state = pb.SHARD_STATE_REVOKED
        self.pod.shards.clear()
        self.pod.changed.set()
        return pb.DrainResponse(drained=True, online_in_flight=0)


def raise_fd_limit(wanted: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit towards ``wanted`` (capped by the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class Standin:
    """The fake pods of one process. Add and remove pods while it runs; ``bump`` moves values."""

    def __init__(self, config: StandinConfig | None = None) -> None:
        self.config = config or StandinConfig()
        self.pods: dict[str, FakePod] = {}  # by pod IP
        self._servers: dict[str, grpc.aio.Server] = {}
        self._sites: dict[str, web.TCPSite] = {}
        self._runner: web.AppRunner | None = None
        self.bumps = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()

    async def _metrics(self, request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        pod = self.pods.get(str(sock[0])) if sock else None
        if pod is None:
            raise web.HTTPNotFound(text="no fake pod on this address\n")
        pod.calls["metrics"] = pod.calls.get("metrics", 0) + 1
        return web.Response(text=render_metrics(pod),
                            content_type="text/plain", charset="utf-8")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def add_pod(self, name: str, ip: str, token: str) -> FakePod:
        """Serve a fake sidecar for pod ``name`` on ``ip`` (idempotent for the same pod)."""
        existing = self.pods.get(ip)
        if existing is not None and existing.name == name:
            existing.token = token
            return existing
        if existing is not None:
            await self.remove_pod(ip)  # the IP was reused by a new pod
        if self._runner is None:
            raise StandinError("start() the stand-in first", name, ip)
        pod = FakePod(name=name, ip=ip, token=token)
        server = grpc.aio.server(interceptors=[_TokenCheck(pod)],
                                 options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_SidecarServicer_to_server(FakeSidecarServicer(pod, self.config), server)
        address = f"{ip}:{self.config.grpc_port}"
        try:
            server.add_insecure_port(address)
            await server.start()
            site = web.TCPSite(self._runner, ip, self.config.http_port, reuse_address=True)
            await site.start()
        except (RuntimeError, OSError) as exc:
            await server.stop(None)
            raise StandinError(f"cannot listen: {exc}", name, address) from exc
        self.pods[ip] = pod
        self._servers[ip] = server
        self._sites[ip] = site
        logger.debug("fake sidecar for %s on %s", name, ip)
        return pod

    async def remove_pod(self, ip: str) -> bool:
        pod = self.pods.pop(ip, None)
        server = self._servers.pop(ip, None)
        site = self._sites.pop(ip, None)
        if server is not None:
            await server.stop(None)
        if site is not None:
            await site.stop()
        return pod is not None

    def bump(self) -> int:
        """One more online request on every pod; returns the number of bumps so far."""
        self.bumps += 1
        for pod in self.pods.values():
            pod.online_requests += 1
            pod.changed.set()
        return self.bumps

    def totals(self) -> dict[str, int]:
        calls: dict[str, int] = {}
        for pod in self.pods.values():
            for method, n in pod.calls.items():
                calls[method] = calls.get(method, 0) + n
        calls["pods"] = len(self.pods)
        calls["shards"] = sum(len(p.shards) for p in self.pods.values())
        return calls

    async def stop(self) -> None:
        for ip in list(self.pods):
            await self.remove_pod(ip)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
