"""Fleet simulation: many engines, online traffic routed to them, offline jobs spread over them.

Composes single-engine replays (:class:`~slipstream_scheduler.sim.simulator.Simulator`,
unchanged) with two fleet-level decisions that a platform makes before any
engine sees a request:

* **Routing** of online requests (:func:`route_online`): ``round-robin``, or
  ``least-work`` -- join the engine with the fewest requests estimated in
  flight, where a request's estimated time is its prompt at the engine's token
  capacity plus an output estimate (the running mean of the outputs routed so
  far, never the request's own length) at one decode step per token.
* **Placement** of offline shards (:func:`place_shards`): ``even`` (round-robin)
  or ``spare`` -- water-filling by each engine's spare capacity (one minus its
  expected online utilisation), so engines with less online traffic take more
  offline work, as the operator places shards by the sidecars' spare capacity.

Because routing and placement are decided from arrival information only (no
feedback from the engines), the engines are independent afterwards and each
is replayed on its own; :func:`simulate_fleet` runs them one after another and
pools the online latencies of all engines for the fleet's percentiles.

Pure: no clock reads (the caller times the decisions and the replays), no I/O.
Deliberately left out: feedback routing (queue lengths observed while
replaying, which would need the engines stepped in lockstep -- a hook the
single-engine simulator does not offer), shard moves between engines, and
engine failures.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.sim.metrics import Dist
from slipstream_scheduler.sim.simulator import SimConfig, SimResult, simulate
from slipstream_scheduler.sim.workload import SimRequest, Workload

Router = Literal["round-robin", "least-work"]
Placement = Literal["even", "spare"]


class FleetError(ValueError):
    """A fleet simulation cannot be set up (``what`` names the offending setting)."""

    def __init__(self, message: str, what: str) -> None:
        super().__init__(f"{what}: {message}")
        self.what = what


class FleetConfig(BaseModel):
    """A fleet replay's settings (resolved once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engines: int = Field(default=64, ge=1, description="Engines (GPU pods). Default: 64.")
    router: Router = Field(default="least-work", description="Online routing. Default: least-work.")
    placement: Placement = Field(default="spare", description="Shard placement. Default: spare.")
    capacity_tokens_per_s: float = Field(
        default=6000.0,
        gt=0,
        description="One engine's token throughput assumed by the router and the placement "
        "(prompt + output tokens/s). Default: 6000.",
    )
    decode_step_s: float = Field(
        default=0.03,
        gt=0,
        description="Seconds per generated token assumed by the router (one decode step, "
        "s). Default: 0.03.",
    )
    sim: SimConfig = Field(default_factory=SimConfig, description="Each engine's replay settings.")


@dataclass(frozen=True, slots=True)
class Shard:
    """A slice of an offline job: requests that run on one engine, in order."""

    shard_id: str
    requests: tuple[SimRequest, ...]

    @property
    def work_tokens(self) -> int:
        return sum(r.prompt_tokens + r.max_tokens for r in self.requests)


def make_shards(job: str, requests: Sequence[SimRequest], size: int) -> tuple[Shard, ...]:
    """Cut a job's requests into shards of ``size`` requests."""
    if size < 1:
        raise FleetError(f"shard size must be >= 1, got {size}", "shard_size")
    return tuple(
        Shard(f"{job}-{i // size:05d}", tuple(requests[i : i + size]))
        for i in range(0, len(requests), size)
    )


def route_online(
    requests: Sequence[SimRequest],
    engines: int,
    router: Router,
    capacity_tokens_per_s: float,
    decode_step_s: float = 0.03,
) -> list[int]:
    """The engine index of every request (requests sorted by arrival).

    ``least-work``: each engine keeps the estimated finish times of the requests
    sent to it (prompt at ``capacity_tokens_per_s``, then one token per
    ``decode_step_s`` for the estimated output); a request goes to the engine with
    the fewest requests estimated in flight, ties broken round-robin. Decode is
    sequential per request, so counting requests in flight tracks an engine's
    load better than a token fluid, which would drain long generations far too fast.
    """
    if engines < 1:
        raise FleetError("need at least one engine", "engines")
    if router == "round-robin":
        return [i % engines for i in range(len(requests))]
    active: list[list[float]] = [[] for _ in range(engines)]  # min-heaps of finish times
    seen_out = 0
    out: list[int] = []
    for seen, req in enumerate(requests):
        now = req.arrival_s
        best, best_n = 0, -1
        for k in range(engines):
            e = (seen + k) % engines
            heap = active[e]
            while heap and heap[0] <= now:
                heapq.heappop(heap)
            if best_n < 0 or len(heap) < best_n:
                best, best_n = e, len(heap)
        guess = seen_out / seen if seen else 128.0
        finish = now + req.prompt_tokens / capacity_tokens_per_s + guess * decode_step_s
        heapq.heappush(active[best], finish)
        out.append(best)
        seen_out += req.max_tokens  # the client's limit; known once the request is sent
    return out


def online_utilisation(
    requests: Sequence[SimRequest],
    assignment: Sequence[int],
    engines: int,
    horizon_s: float,
    capacity_tokens_per_s: float,
) -> list[float]:
    """Each engine's expected online utilisation (token work / capacity over the horizon)."""
    tokens = [0.0] * engines
    for req, engine in zip(requests, assignment, strict=True):
        tokens[engine] += req.prompt_tokens + req.max_tokens
    budget = max(horizon_s, 1e-9) * capacity_tokens_per_s
    return [t / budget for t in tokens]


def place_shards(
    shards: Sequence[Shard], spare: Sequence[float], placement: Placement
) -> list[int]:
    """The engine index of every shard.

    ``spare``: each shard goes to the engine whose offline work, relative to its
    spare fraction, stays smallest after taking it (a heap keyed by that ratio;
    an engine with no spare gets a tiny floor so it is used last, not never).
    """
    engines = len(spare)
    if engines < 1:
        raise FleetError("need at least one engine", "engines")
    if placement == "even":
        return [i % engines for i in range(len(shards))]
    weights = [max(s, 1e-3) for s in spare]
    load = [0.0] * engines
    heap = [(0.0, i) for i in range(engines)]
    out: list[int] = []
    for shard in shards:
        _, engine = heapq.heappop(heap)
        load[engine] += shard.work_tokens
        out.append(engine)
        heapq.heappush(heap, (load[engine] / weights[engine], engine))
    return out


@dataclass(frozen=True, slots=True)
class FleetPlan:
    """The fleet-level decisions: per engine, its online requests and its shards."""

    online: tuple[tuple[SimRequest, ...], ...]
    shards: tuple[tuple[Shard, ...], ...]
    utilisation: tuple[float, ...]


def plan_fleet(
    online: Sequence[SimRequest], shards: Sequence[Shard], config: FleetConfig, horizon_s: float
) -> FleetPlan:
    """Route the online requests, then place the shards on what the routing leaves spare."""
    n = config.engines
    routed = route_online(
        online, n, config.router, config.capacity_tokens_per_s, config.decode_step_s
    )
    util = online_utilisation(online, routed, n, horizon_s, config.capacity_tokens_per_s)
    placed = place_shards(shards, [max(0.0, 1.0 - u) for u in util], config.placement)
    per_online: list[list[SimRequest]] = [[] for _ in range(n)]
    for req, engine in zip(online, routed, strict=True):
        per_online[engine].append(req)
    per_shards: list[list[Shard]] = [[] for _ in range(n)]
    for shard, engine in zip(shards, placed, strict=True):
        per_shards[engine].append(shard)
    return FleetPlan(
        tuple(tuple(x) for x in per_online), tuple(tuple(x) for x in per_shards), tuple(util)
    )


@dataclass(frozen=True, slots=True)
class FleetOutcome:
    """The fleet's pooled online latencies and offline throughput, plus each engine's result."""

    plan: FleetPlan
    engines: tuple[SimResult, ...]
    online_ttft: Dist
    online_tbt: Dist
    online_requests: int
    online_finished: int
    offline_tokens_per_s: float
    offline_finished: int
    busy_fraction_min: float
    busy_fraction_max: float


def _pooled(results: Sequence[SimResult], key: str) -> Dist:
    arrays = [r.metrics.samples[key] for r in results if key in r.metrics.samples]
    if not arrays:
        return Dist(math.nan, math.nan, math.nan, 0)
    return Dist.of(np.concatenate(arrays))


EngineDone = Callable[[int, SimResult], None]
"""Called after each engine's replay (index, result), e.g. for progress or timing."""


def simulate_fleet(
    online: Sequence[SimRequest],
    shards: Sequence[Shard],
    config: FleetConfig,
    horizon_s: float,
    *,
    latency_model: LinearLatencyModel | None = None,
    on_engine: EngineDone | None = None,
) -> FleetOutcome:
    """Plan the fleet, replay every engine up to ``horizon_s`` and pool the results."""
    if horizon_s <= 0:
        raise FleetError(f"horizon must be > 0 s, got {horizon_s}", "horizon_s")
    plan = plan_fleet(online, shards, config, horizon_s)
    results: list[SimResult] = []
    for i in range(config.engines):
        offline = tuple(r for shard in plan.shards[i] for r in shard.requests)
        workload = Workload(
            online=plan.online[i], offline=offline, horizon_s=horizon_s, name=f"engine-{i}"
        )
        sim = config.sim.model_copy(update={"seed": config.sim.seed + i})
        result = simulate(workload, sim, latency_model=latency_model)
        results.append(result)
        if on_engine is not None:
            on_engine(i, result)
    duration = max((r.metrics.duration_s for r in results), default=0.0)
    busy = [r.metrics.busy_fraction for r in results]
    return FleetOutcome(
        plan=plan,
        engines=tuple(results),
        online_ttft=_pooled(results, "online_ttft"),
        online_tbt=_pooled(results, "online_tbt"),
        online_requests=sum(r.metrics.online.requests for r in results),
        online_finished=sum(r.metrics.online.finished for r in results),
        offline_tokens_per_s=(
            sum(r.metrics.offline.output_tokens for r in results) / duration
            if duration > 0
            else 0.0
        ),
        offline_finished=sum(r.metrics.offline.finished for r in results),
        busy_fraction_min=min(busy, default=0.0),
        busy_fraction_max=max(busy, default=0.0),
    )
