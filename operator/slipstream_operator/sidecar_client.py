"""The operator's side of the sidecar control API (gRPC), behind a small Protocol.

Pods are addressed by ``status.podIP`` and the sidecar's gRPC port, never by a
Service or DNS name: the operator talks to one specific pod. Every call carries
``authorization: Bearer <token>`` (the service's auth Secret) and a deadline.
Replies are turned into this module's frozen dataclasses so that the pure
reconcilers never see protobuf types; :class:`SidecarControl` is what the
handlers depend on, and tests pass an in-memory fake implementing it.

:class:`SharedSidecarControl` wraps any :class:`SidecarControl` for the handlers:
one ``Status`` per pod per ``max_age_s`` shared by every object that looks at the
pod (a service tick and the ticks of the jobs that select it; a look may ask for a
younger reply: the handlers' service ticks ask the pod at every tick, and job ticks
take the service tick's reply for up to 1.2 intervals), one call in flight
per pod (concurrent askers await the same reply), every call under one bounded set of
slots (bounded fan-out) in which an urgent ``Status`` (a service tick's: it holds the
service's status) is served before the rest (job ticks' ``Status``, Configure,
AssignShard, RevokeShard), up to three in a row while the rest wait, and a pod's
cached reply dropped when the operator changes the pod's shards (AssignShard,
RevokeShard) so the next look sees the change. A
Configure the pod acknowledged at the call's generation updates the cached reply's
configuration fields from the call instead (``ConfigureResponse`` carries only the
generation in force, and at that generation the configuration is the call's), so a
fleet-wide budget change does not make every tick ask every pod again.

``WatchStatus`` streams (``statusfeed.py``) put their snapshots into the same cache with
:meth:`SharedSidecarControl.offer`: such a reply stays *live* (it answers any look, whatever
its age) while its stream is up, since the sidecar sends every change the operator acts on;
a pod without a stream is asked with ``Status`` as above.

Deliberately left out: retries (the next timer tick is the retry).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, TypeVar

from slipstream_operator.errors import SidecarError
from slipstream_operator.observe import Histogram, Sample
from slipstream_scheduler.latency import LatencyModelError, LinearLatencyModel

logger = logging.getLogger(__name__)


class ShardReport(NamedTuple):
    """One shard as a sidecar reports it.

    A named tuple rather than a frozen dataclass: every Status reply makes one per shard on
    the pod (50 on a pod of a 1,000-node fleet), and a frozen dataclass's ``__init__`` costs
    about three times a tuple's.
    """

    shard_id: str
    state: str  # pending | running | succeeded | failed | revoked | unknown
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    tokens_per_second: float = 0.0
    message: str = ""


ACTIVE_STATES = ("pending", "running")


class JobShards(NamedTuple):
    """One job's shards on one pod."""

    reports: tuple[ShardReport, ...]
    active: int  # how many of them are pending or running


def shard_job(shard_id: str) -> str:
    """The job a shard belongs to: ``<namespace>.<name>-<index>`` -> ``<namespace>.<name>``."""
    return shard_id.rsplit("-", 1)[0]


def group_by_job(reports: Iterable[ShardReport]) -> dict[str, JobShards]:
    """A pod's shard reports grouped by job, in report order within each job."""
    grouped: dict[str, list[ShardReport]] = {}
    for report in reports:
        grouped.setdefault(shard_job(report.shard_id), []).append(report)
    return {
        job: JobShards(tuple(rs), sum(1 for r in rs if r.state in ACTIVE_STATES))
        for job, rs in grouped.items()
    }


LEARNED_SOURCES = ("learned", "profiled")


@dataclass(frozen=True, slots=True)
class LearnedLatency:
    """The latency model a pod's sidecar learned from its own engine (``learned_model``).

    ``model`` is None while the pod has no fitted model yet (or reported one that does not
    make a valid model: logged, and treated as none); ``seen_steps`` then still says how far
    its learning got.
    """

    model: LinearLatencyModel | None
    source: str = "learned"  # learned (served steps) | profiled (slipstream profile engine)
    fit_steps: int = 0  # steps the fit used
    seen_steps: int = 0  # steps recorded in all
    heldout_mape: float = math.inf  # fraction, on recent steps the fit did not see
    revision: int = 0  # increases with every fit that replaced the previous one
    fitted_at: float = 0.0  # unix seconds of the accepted fit


@dataclass(frozen=True, slots=True)
class KvCacheReport:
    """The engine's KV cache as a pod's sidecar admits with it (``kv_cache`` in Status):
    ``num_blocks`` blocks of ``block_size`` tokens, each number's source ``engine`` (read
    from vLLM's ``/metrics``), ``setting`` or ``default``."""

    num_blocks: int
    block_size: int
    num_blocks_source: str = "default"
    block_size_source: str = "default"

    @property
    def from_engine(self) -> bool:
        """Whether the blocks are the engine's own count (in ``block_size`` tokens)."""
        return self.num_blocks_source == "engine"


@dataclass(frozen=True, slots=True)
class SidecarStatus:
    """One Status reply.

    ``by_job`` is ``shards`` grouped by job, computed once per reply: every job tick of a
    namespace reads the same cached reply of each pod, and each needs only its own shards
    and a count of the others' (at 1,000 nodes a pod holds about 50 shards of 20 jobs).
    """

    generation: int
    engine_ready: bool
    draining: bool
    spare_capacity: float
    budget_s: float | None
    online_in_flight: int = 0
    online_admitted_total: int = 0
    offline_in_flight: int = 0
    shards: tuple[ShardReport, ...] = ()
    predicted_step_s: float = 0.0
    observed_step_s: float = 0.0
    latency_kind: str = ""  # feature set of the latency model in force; "": none (or old pod)
    latency_curve_knots: int = 0  # values of its token curve; 0: no curve
    online_sample: Sample | None = None
    """The online class's histograms and counters, stamped with the operator's monotonic
    clock when the reply arrived; None from a sidecar that does not send them (the operator
    then scrapes its ``/metrics``)."""
    learned: LearnedLatency | None = None
    """The model the pod learned from its own engine; None from a sidecar that reports none."""
    kv_cache: KvCacheReport | None = None
    """The engine's KV cache the pod admits with; None from a sidecar older than the field."""
    by_job: Mapping[str, JobShards] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_job", group_by_job(self.shards))


@dataclass(frozen=True, slots=True)
class ConfigureCall:
    """What the operator pushes to a pod: budget, SLOs, ordering, latency model."""

    generation: int
    budget_s: float | None
    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_mean_s: float | None = None
    tbt_p99_s: float | None = None
    ordering: str = ""
    latency_kind: str = ""
    latency_coefficients: dict[str, float] = field(default_factory=dict, hash=False)
    latency_knee_tokens: int = 0
    # The context+chunk+curve set's token curve (LinearLatencyModel.token_curve: phi at every
    # latency_curve_step_tokens tokens) and its knot spacing; empty and 0 for other sets.
    latency_token_curve: tuple[float, ...] = ()
    latency_curve_step_tokens: int = 0
    # Step limit while the pod has no online work (seconds; inf: unbounded). 0 clears it (the
    # budget applies always); None leaves the sidecar's value as it is.
    idle_budget_s: float | None = None
    # The ordering's tail guard (seconds; 0: none); None leaves it to the pod (from the SLO).
    max_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """AssignShard's payload."""

    shard_id: str
    job_namespace: str
    job_name: str
    model: str
    input_uri: str
    line_start: int
    line_end: int
    output_uri: str
    error_uri: str
    priority: int
    request_defaults_json: str = "{}"


@dataclass(frozen=True, slots=True)
class PodAddress:
    """Where one pod's sidecar listens, and the token it expects."""

    pod: str
    ip: str
    port: int
    token: str

    @property
    def target(self) -> str:
        return f"{self.ip}:{self.port}"


class SidecarControl(Protocol):
    """The control calls the operator makes. Raise :class:`SidecarError` on failure."""

    async def status(self, address: PodAddress) -> SidecarStatus: ...

    async def configure(self, address: PodAddress, call: ConfigureCall) -> int:
        """Returns the generation in force after the call."""
        ...

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        """Returns whether the sidecar accepted the shard."""
        ...

    async def revoke(self, address: PodAddress, shard_id: str) -> bool: ...


_STATES = {0: "unknown", 1: "pending", 2: "running", 3: "succeeded", 4: "failed", 5: "revoked"}


def _online_sample(counters: object, taken_s: float) -> Sample | None:
    """A :class:`Sample` from a ``ClassCounters`` message; None when a histogram is
    malformed (bounds and counts of different lengths), so the pod is scraped instead."""
    from slipstream_sidecar.proto import sidecar_pb2 as pb

    assert isinstance(counters, pb.ClassCounters)

    def histogram(h: pb.Histogram) -> Histogram | None:
        bounds, counts = list(h.upper_bounds), list(h.cumulative_counts)
        if len(bounds) != len(counts):
            return None
        buckets = tuple(zip(bounds, counts, strict=True))
        if bounds != sorted(bounds):  # the sidecar sends them ascending; sort anything else
            buckets = tuple(sorted(buckets))
        return Histogram(buckets=buckets, total=h.sum, count=h.count)

    ttft, tbt = histogram(counters.ttft_seconds), histogram(counters.tbt_seconds)
    if ttft is None or tbt is None:
        logger.warning("a sidecar sent a malformed histogram in Status; scraping it instead")
        return None
    return Sample(at_s=taken_s, ttft=ttft, tbt=tbt, admitted=counters.admitted,
                  finished=counters.finished_ok, output_tokens=counters.output_tokens)


@functools.lru_cache(maxsize=256)
def _warn_malformed(source: str, revision: int, problem: str) -> None:
    """Logged once per (source, revision, problem): a pod repeats its model every Status."""
    logger.warning("a sidecar reported a malformed %s latency model (revision %d): %s; "
                   "ignoring it", source, revision, problem)


def learned_from_pb(msg: object) -> LearnedLatency:
    """A :class:`LearnedLatency` from a ``LearnedModel`` message; a spec without coefficients
    or one that does not make a valid model (logged) gives ``model=None``."""
    from slipstream_sidecar.brain import latency_model_from_spec
    from slipstream_sidecar.proto import sidecar_pb2 as pb

    assert isinstance(msg, pb.LearnedModel)
    source = msg.source if msg.source in LEARNED_SOURCES else "learned"
    model: LinearLatencyModel | None = None
    spec = msg.model
    if msg.HasField("model") and spec.coefficients:
        try:
            model = latency_model_from_spec(
                spec.kind, dict(spec.coefficients), int(spec.knee_tokens),
                token_curve=tuple(spec.token_curve),
                curve_step_tokens=int(spec.curve_step_tokens))
        except (ValueError, LatencyModelError) as exc:
            _warn_malformed(source, int(msg.revision), str(exc)[:300])
    mape = float(msg.heldout_mape)
    return LearnedLatency(
        model=model,
        source=source,
        fit_steps=int(msg.fit_steps),
        seen_steps=int(msg.seen_steps),
        heldout_mape=mape if math.isfinite(mape) and mape >= 0 else math.inf,
        revision=int(msg.revision),
        fitted_at=float(msg.fitted_at),
    )


class GrpcSidecarControl:
    """:class:`SidecarControl` over grpc.aio, one channel per pod address."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self._timeout_s = timeout_s
        self._channels: dict[str, tuple[object, object]] = {}  # target: (channel, stub)

    def _stub(self, address: PodAddress) -> object:
        import grpc

        from slipstream_sidecar.proto import sidecar_pb2_grpc

        # One channel and one stub per pod address: building a stub builds a multicallable
        # per method, which at fleet size cost as much as the calls' own setup.
        held = self._channels.get(address.target)
        if held is None:
            channel = grpc.aio.insecure_channel(address.target)
            held = (channel, sidecar_pb2_grpc.SidecarStub(channel))
            self._channels[address.target] = held
        return held[1]

    async def _call(self, address: PodAddress, method: str, request: object) -> object:
        import grpc

        stub = self._stub(address)
        metadata = (("authorization", f"Bearer {address.token}"),)
        try:
            # The call's own deadline bounds it (connecting included); an asyncio.wait_for
            # around it would add a task per call, which shows at 2,000 pods.
            return await getattr(stub, method)(request, metadata=metadata,
                                               timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise SidecarError(f"{method} failed: {exc.code().name}: {exc.details()}",
                               pod=address.pod, address=address.target) from exc
        except (grpc.RpcError, TimeoutError, OSError) as exc:
            raise SidecarError(f"{method} failed: {exc!r}", pod=address.pod,
                               address=address.target) from exc

    async def status(self, address: PodAddress) -> SidecarStatus:
        from slipstream_sidecar.proto import sidecar_pb2 as pb

        reply = await self._call(address, "Status", pb.StatusRequest())
        assert isinstance(reply, pb.StatusResponse)
        return status_from_pb(reply)

    async def watch(self, address: PodAddress, *, interval_s: float,
                    min_interval_s: float) -> AsyncIterator[tuple[Hashable, SidecarStatus]]:
        """The pod's ``WatchStatus`` stream: (change signature, status) per snapshot.

        No deadline (the stream is meant to stay open); ends or raises :class:`SidecarError`
        when the pod closes it or fails.
        """
        import grpc

        from slipstream_sidecar.proto import sidecar_pb2 as pb
        from slipstream_sidecar.watch import change_signature

        stub = self._stub(address)
        metadata = (("authorization", f"Bearer {address.token}"),)
        call = stub.WatchStatus(  # type: ignore[attr-defined]
            pb.WatchStatusRequest(interval_s=interval_s, min_interval_s=min_interval_s),
            metadata=metadata)
        try:
            async for reply in call:
                yield change_signature(reply), status_from_pb(reply)
        except grpc.aio.AioRpcError as exc:
            raise SidecarError(f"WatchStatus failed: {exc.code().name}: {exc.details()}",
                               pod=address.pod, address=address.target) from exc
        except (grpc.RpcError, OSError) as exc:
            raise SidecarError(f"WatchStatus failed: {exc!r}", pod=address.pod,
                               address=address.target) from exc
        finally:
            call.cancel()


    async def configure(self, address: PodAddress, call: ConfigureCall) -> int:
        from slipstream_sidecar.proto import sidecar_pb2 as pb

        slo = pb.Slo()
        for name in ("ttft_mean_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s"):
            value = getattr(call, name)
            if value is not None:
                setattr(slo, name, value)
        request = pb.ConfigureRequest(
            generation=call.generation,
            slo=slo,
            ordering=call.ordering,
            latency_model=pb.LatencyModelSpec(
                kind=call.latency_kind,
                coefficients=call.latency_coefficients,
                knee_tokens=call.latency_knee_tokens,
                token_curve=call.latency_token_curve,
                curve_step_tokens=call.latency_curve_step_tokens,
            ),
        )
        if call.budget_s is not None:
            request.budget_s = call.budget_s
        if call.idle_budget_s is not None:
            request.idle_budget_s = call.idle_budget_s
        if call.max_wait_s is not None:
            request.max_wait_s = call.max_wait_s
        reply = await self._call(address, "Configure", request)
        assert isinstance(reply, pb.ConfigureResponse)
        return int(reply.generation)

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        from slipstream_sidecar.proto import sidecar_pb2 as pb

        request = pb.AssignShardRequest(
            shard=pb.Shard(
                shard_id=shard.shard_id,
                job_namespace=shard.job_namespace,
                job_name=shard.job_name,
                model=shard.model,
                input_uri=shard.input_uri,
                line_start=shard.line_start,
                line_end=shard.line_end,
                output_uri=shard.output_uri,
                error_uri=shard.error_uri,
                priority=shard.priority,
                request_defaults_json=shard.request_defaults_json,
            )
        )
        reply = await self._call(address, "AssignShard", request)
        assert isinstance(reply, pb.AssignShardResponse)
        return bool(reply.accepted)

    async def revoke(self, address: PodAddress, shard_id: str) -> bool:
        from slipstream_sidecar.proto import sidecar_pb2 as pb

        reply = await self._call(address, "RevokeShard", pb.RevokeShardRequest(shard_id=shard_id))
        assert isinstance(reply, pb.RevokeShardResponse)
        return bool(reply.revoked)

    async def close(self) -> None:
        for channel, _ in self._channels.values():
            await channel.close()  # type: ignore[attr-defined]
        self._channels.clear()


def status_from_pb(reply: object) -> SidecarStatus:
    """A :class:`SidecarStatus` from a ``StatusResponse`` (``Status`` or ``WatchStatus``)."""
    from slipstream_sidecar.proto import sidecar_pb2 as pb

    assert isinstance(reply, pb.StatusResponse)
    return SidecarStatus(
        generation=reply.generation,
        engine_ready=reply.engine_ready,
        draining=reply.draining,
        spare_capacity=reply.spare_capacity,
        budget_s=reply.budget_s if reply.HasField("budget_s") else None,
        online_in_flight=reply.online.in_flight,
        online_admitted_total=reply.online.admitted_total,
        offline_in_flight=reply.offline.in_flight,
        shards=tuple(
            ShardReport(s.shard_id, _STATES.get(s.state, "unknown"), s.total, s.completed,
                        s.failed, s.in_flight, s.output_tokens, s.tokens_per_second,
                        s.message)
            for s in reply.shards
        ),
        predicted_step_s=reply.predicted_step_s,
        observed_step_s=reply.observed_step_s,
        latency_kind=reply.latency_model.kind,
        latency_curve_knots=len(reply.latency_model.token_curve),
        online_sample=(_online_sample(reply.online_counters, time.monotonic())
                       if reply.HasField("online_counters") else None),
        learned=(learned_from_pb(reply.learned_model)
                 if reply.HasField("learned_model") else None),
        kv_cache=_kv_cache_from_pb(reply.kv_cache) if reply.HasField("kv_cache") else None,
    )


def _kv_cache_from_pb(msg: object) -> KvCacheReport | None:
    """A :class:`KvCacheReport` from a ``KvCache`` message; None when it names no blocks."""
    from slipstream_sidecar.proto import sidecar_pb2 as pb

    assert isinstance(msg, pb.KvCache)
    if msg.num_blocks <= 0 or msg.block_size <= 0:
        return None
    return KvCacheReport(
        int(msg.num_blocks), int(msg.block_size), msg.num_blocks_source, msg.block_size_source
    )


T = TypeVar("T")

OFFER_GUARD_S = 1.0
"""Seconds after a call that changed a pod during which its streamed snapshots are not kept."""


async def gather_bounded(calls: Iterable[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run ``calls`` concurrently, at most ``limit`` at once; results in order.

    An exception of one call propagates after every call has finished (none is abandoned).
    """
    semaphore = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with semaphore:
            return await call()

    results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class _Cached:
    status: SidecarStatus
    at_s: float
    live_until_s: float = 0.0  # a streamed snapshot answers any look until then


class _Waiter:
    """One caller waiting for a slot; ``urgent`` may be raised while it waits."""

    __slots__ = ("future", "urgent")

    def __init__(self, future: asyncio.Future[None], urgent: bool) -> None:
        self.future = future
        self.urgent = urgent


class PrioritySlots:
    """A counting semaphore whose waiters are served urgent first, each class in arrival order,
    except that after ``urgent_run`` urgent grants in a row a waiting normal one goes next.

    So under contention normal callers still get at least 1 / (``urgent_run`` + 1) of the
    slots: a steady stream of urgent calls (a service tick's ``Status`` for every pod of a
    large fleet) cannot starve them (job ticks' ``Status`` and ``AssignShard``). A waiter can
    be made urgent while it waits (:meth:`promote`): it is then queued with the urgent ones
    too, and whichever queue reaches it first grants it (the other entry is skipped). A
    waiter cancelled after being granted gives its slot back.
    """

    def __init__(self, limit: int, urgent_run: int = 3) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        if urgent_run < 1:
            raise ValueError(f"urgent_run must be at least 1, not {urgent_run}")
        self._free = limit
        self.urgent_run = urgent_run
        self._run = 0  # urgent grants since the last normal one
        self._urgent: deque[_Waiter] = deque()
        self._normal: deque[_Waiter] = deque()

    def waiter(self, urgent: bool) -> _Waiter:
        return _Waiter(asyncio.get_running_loop().create_future(), urgent)

    async def acquire(self, waiter: _Waiter) -> None:
        if self._free > 0:  # free slots only while nobody waits (release hands slots over)
            self._free -= 1
            waiter.future.set_result(None)
            return
        (self._urgent if waiter.urgent else self._normal).append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release()  # granted just as it was cancelled: pass the slot on
            raise

    def promote(self, waiter: _Waiter) -> None:
        """Serve ``waiter`` as urgent from now on (no-op once it holds a slot)."""
        if not waiter.urgent and not waiter.future.done():
            waiter.urgent = True
            self._urgent.append(waiter)

    @staticmethod
    def _next(queue: deque[_Waiter]) -> _Waiter | None:
        while queue:
            waiter = queue.popleft()
            if not waiter.future.done():  # skip the cancelled and the already granted
                return waiter
        return None

    def release(self) -> None:
        urgent_first = self._run < self.urgent_run
        for queue in ((self._urgent, self._normal) if urgent_first
                      else (self._normal, self._urgent)):
            waiter = self._next(queue)
            if waiter is not None:
                self._run = self._run + 1 if queue is self._urgent else 0
                waiter.future.set_result(None)
                return
        self._free += 1

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot (a promoted one is queued twice but counted once)."""
        return len({id(w) for q in (self._urgent, self._normal) for w in q
                    if not w.future.done()})


class SharedSidecarControl:
    """A :class:`SidecarControl` that shares Status replies per pod and bounds concurrency.

    ``status(address)`` returns the pod's last reply if it is younger than ``max_age_s`` (and
    asked with the same token; a look may ask for a younger one with its own ``max_age_s``),
    else asks the pod; while one ask is in flight, others for the same pod await it. Failures
    are not cached. ``assign`` and ``revoke`` go straight through and drop the pod's cached
    reply, both before and after the call (a reply asked for while the change was in flight is
    not kept either). ``configure`` does the same, except that once the pod answers with the
    call's generation, the reply cached before the call (or one asked meanwhile) is kept with
    ``generation``, ``budget_s`` and (when the call carries coefficients) the latency model
    fields set from the call, and its age unchanged. At most ``limit`` calls of any kind are in
    flight at once; ``status(..., urgent=True)`` waits ahead of every other call
    (:class:`PrioritySlots`: up to three urgent grants in a row), and makes a call in flight
    for the same pod that still waits for a slot urgent.
    """

    def __init__(self, inner: SidecarControl, *, max_age_s: float, limit: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.max_age_s = max_age_s
        self.limit = limit
        self._clock = clock
        self._slots = PrioritySlots(limit)
        self._cache: dict[str, _Cached] = {}
        self._flying: dict[str, tuple[asyncio.Future[SidecarStatus], int, _Waiter]] = {}
        self._epochs: dict[str, int] = {}
        self._forgot_s: dict[str, float] = {}  # key -> when the pod was last changed by a call
        self.asked = 0
        """Status calls that reached the inner control (the rest were answered from memory)."""
        self.failed = 0
        """Of those, the ones that failed (time-out, refused, unauthenticated, ...)."""
        self.refreshed = 0
        """Cached replies updated from an acknowledged Configure instead of dropped."""
        self.offered = 0
        """Streamed snapshots kept as replies (:meth:`offer`)."""

    @staticmethod
    def _key(address: PodAddress) -> str:
        return f"{address.pod}@{address.target}#{address.token}"

    def forget(self, address: PodAddress) -> None:
        """Drop the pod's cached reply (the next ``status`` asks the pod).

        A reply already in flight is still returned to its askers but not kept: it may
        predate the change that made the caller forget it.
        """
        key = self._key(address)
        self._cache.pop(key, None)
        self._epochs[key] = self._epochs.get(key, 0) + 1
        self._forgot_s[key] = self._clock()

    def forget_pods(self, pods: set[str]) -> None:
        """Drop cached replies of the pods named in ``pods`` (gone pods)."""
        for key in [k for k in self._cache if k.split("@", 1)[0] in pods]:
            del self._cache[key]
        for key in [k for k in self._epochs
                    if k.split("@", 1)[0] in pods and k not in self._flying]:
            del self._epochs[key]
            self._forgot_s.pop(key, None)

    def offer(self, address: PodAddress, status: SidecarStatus, *, live_for_s: float) -> bool:
        """Keep a streamed snapshot as the pod's reply, live for ``live_for_s`` seconds.

        Refused (False) within ``OFFER_GUARD_S`` of a call that changed the pod: a snapshot
        taken before the change may still be on its way. The pod's reply is then dropped
        instead (it may be older still, e.g. one updated from a Configure), so the next look
        asks the pod; the stream's next snapshot is kept.
        """
        key = self._key(address)
        now = self._clock()
        if now - self._forgot_s.get(key, float("-inf")) < OFFER_GUARD_S:
            self._cache.pop(key, None)
            return False
        self._cache[key] = _Cached(status, now, now + live_for_s)
        self.offered += 1
        return True

    def unlive(self, address: PodAddress) -> None:
        """The pod's stream is down: its last snapshot ages like a polled reply from now on."""
        key = self._key(address)
        cached = self._cache.get(key)
        if cached is not None and cached.live_until_s:
            self._cache[key] = _Cached(cached.status, cached.at_s)

    async def status(self, address: PodAddress, *, urgent: bool = False,
                     max_age_s: float | None = None) -> SidecarStatus:
        key = self._key(address)
        cached = self._cache.get(key)
        limit = self.max_age_s if max_age_s is None else max_age_s
        if cached is not None:
            now = self._clock()
            if now - cached.at_s < limit or now < cached.live_until_s:
                return cached.status
        epoch = self._epochs.get(key, 0)
        flying = self._flying.get(key)
        if flying is not None and flying[1] == epoch:
            # Join the call in flight, unless it started before the pod was changed.
            if urgent:
                self._slots.promote(flying[2])
            return await asyncio.shield(flying[0])
        future: asyncio.Future[SidecarStatus] = asyncio.get_running_loop().create_future()
        waiter = self._slots.waiter(urgent)
        self._flying[key] = (future, epoch, waiter)
        try:
            await self._slots.acquire(waiter)
            try:
                self.asked += 1
                started = self._clock()
                status = await self.inner.status(address)
            finally:
                self._slots.release()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            self.failed += 1
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        else:
            if self._epochs.get(key, 0) == epoch:
                self._cache[key] = _Cached(status, started)
            future.set_result(status)
            return status
        finally:
            if self._flying.get(key, (None, 0, None))[0] is future:
                del self._flying[key]

    async def _bounded(self, call: Callable[[], Awaitable[T]]) -> T:
        await self._slots.acquire(self._slots.waiter(urgent=False))
        try:
            return await call()
        finally:
            self._slots.release()

    async def _change(self, address: PodAddress, call: Callable[[], Awaitable[T]]) -> T:
        """A call that changes the pod: its cached reply is dropped before and after (a
        Status that started meanwhile may predate the change)."""
        self.forget(address)
        try:
            return await self._bounded(call)
        finally:
            self.forget(address)

    async def configure(self, address: PodAddress, call: ConfigureCall) -> int:
        key = self._key(address)
        before = self._cache.get(key)
        self.forget(address)
        acked = 0
        try:
            acked = await self._bounded(lambda: self.inner.configure(address, call))
            return acked
        finally:
            meanwhile = self._cache.get(key)  # asked after the forget: may predate the change
            self.forget(address)  # and so may any reply still in flight
            base = meanwhile or before
            if acked == call.generation and base is not None:
                # At the call's generation the pod runs the call's configuration (a call
                # without coefficients keeps the pod's latency model, as the sidecar does).
                status = replace(base.status, generation=acked, budget_s=call.budget_s)
                if call.latency_coefficients:
                    status = replace(status, latency_kind=call.latency_kind,
                                     latency_curve_knots=len(call.latency_token_curve))
                self._cache[key] = _Cached(status, base.at_s)
                self.refreshed += 1

    async def assign(self, address: PodAddress, shard: ShardAssignment) -> bool:
        return await self._change(address, lambda: self.inner.assign(address, shard))

    async def revoke(self, address: PodAddress, shard_id: str) -> bool:
        return await self._change(address, lambda: self.inner.revoke(address, shard_id))
