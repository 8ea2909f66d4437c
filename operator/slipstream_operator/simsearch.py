"""The simulator-backed budget search (HyGen's SLO-aware profiler) for one service.

:class:`SimulatedSearch` is a :data:`~slipstream_operator.budgets.BudgetSearch`:
given the SLO targets and the recent online load it

1. synthesises a workload sample: Poisson online arrivals at the observed rate
   for ``horizon_s`` seconds, prompt and output lengths log-normal around the
   observed means (``length_sigma``), and a saturating offline backlog of
   fixed-shape requests, all from one seeded generator;
2. bisects the budget with ``slipstream_scheduler.budget.search_budget``,
   each trial a replay of that sample by the core simulator in the service's
   mode: ``sidecar`` (the sidecar's dispatcher and ADMISSION planner in front of
   the engine model) or, for
   ``enforcement: engine``, ``in-engine`` (the planner picks each step's batch
   inside the engine, as the scheduler plugin does), judging the online TTFT/TBT
   mean and P99 against the targets;
3. returns the largest passing budget, or the online-only budget (the floor)
   with ``feasible=False`` when even that misses, plus every trial's verdict.

The range is the analytic search's [floor, ceiling] (``budgets.AnalyticSearch``
with the calibrated model), so both searches bound the AIMD loop alike.

Calibration as time dilation: with a refit scale ``s`` (real steps are ``s``
times what the profile predicts) the simulated engine, which runs the
profile's own timing, is a GPU ``s`` times faster than the real one. Replaying
the real system in profile time means arrivals ``s`` times as fast and targets
divided by ``s``; the budget found is then multiplied by ``s`` to be read by
the calibrated model the sidecars run.

The simulated engine times its steps with the engine model's GPU profile of the
(model, GPU) pair where Slipstream ships one; the latency model searched with (a
profile, or a model a pod learned from its own engine) is the planner's, as in the pods.
Where no GPU profile exists (:func:`simulated_engine`), the model in force times the
steps too (``SimConfig.timing_model``), with its held-out error as the step-time spread
(``timing_cv`` where unknown) and the KV cache of ``--num-gpu-blocks-override`` or
``kv_tokens``: the search then tests the budget against the model's own view of the
GPU, noise included, rather than against an independent engine model.

Deterministic for equal inputs (seeded); bounded by ``max_wall_s`` between
trials (a running trial finishes; each is bounded by ``horizon_s`` of virtual
time and ``max_steps``). Deliberately left out: caching and running in the
background (``searchpool``), and searching the idle budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from slipstream_operator.budgets import (
    AnalyticSearch,
    LoadStats,
    SearchResult,
    SLOTargets,
    TrialRecord,
)
from slipstream_operator.calibration import scaled
from slipstream_operator.profiles import slugs
from slipstream_scheduler.budget import Observed, Slo, search_budget
from slipstream_scheduler.dispatcher import DispatcherConfig
from slipstream_scheduler.engine.gpu import available_profiles
from slipstream_scheduler.engine.model import EngineConfig
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.sim.simulator import SimConfig, simulate
from slipstream_scheduler.sim.workload import SimRequest, Workload
from slipstream_scheduler.types import BatchItem, EngineLimits, Phase, RequestClass

logger = logging.getLogger(__name__)


class SimSearchParams(BaseModel):
    """Knobs of the simulated budget search and of its cache."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=True,
        description="Search by simulation (with the engine model's GPU profile of the "
        "(model, GPU), or else with the model in force timing the steps); false: the "
        "analytic search only. Default: true.",
    )
    timing_cv: float = Field(
        default=0.05,
        ge=0,
        le=0.5,
        description="Where the model in force times the simulated steps (no GPU profile of "
        "the (model, GPU)): their spread (coefficient of variation) when the model carries "
        "no held-out error (a profile, not a pod's learned model). Default: 0.05.",
    )
    kv_tokens: int = Field(
        default=65536,
        ge=1,
        description="Where the model in force times the simulated steps: the KV cache "
        "(tokens) when the engine's args give no --num-gpu-blocks-override (a latency model "
        "knows no memory). Default: 65536, below every shipped profile's cache (Llama-2-7B "
        "at 0.9 of an 80 GB A100 holds about 104k tokens).",
    )
    horizon_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Virtual seconds one trial replays at least. Default: 60.",
    )
    min_online_requests: int = Field(
        default=50,
        ge=1,
        description="The sample is made long enough for this many online requests, up to "
        "max_horizon_s (a P99 over a handful of requests says little). Default: 50.",
    )
    max_horizon_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="Longest sample (virtual seconds). Default: 300.",
    )
    headroom: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="Trials are judged against target x (1 - headroom): the sample is "
        "Poisson with log-normal lengths, real traffic is burstier. Default: 0.1.",
    )
    iterations: int = Field(
        default=6, ge=1, le=12, description="Bisection steps after the two end trials. Default: 6."
    )
    seed: int = Field(default=0, description="Seed of the workload sample and engine noise.")
    length_sigma: float = Field(
        default=0.6,
        ge=0,
        le=2,
        description="Log-normal sigma of online prompt and output lengths (unitless). "
        "Default: 0.6.",
    )
    min_rate_rps: float = Field(
        default=0.1,
        gt=0,
        description="Arrival rate assumed below this (requests/s), so a trial has online "
        "requests to judge. Default: 0.1.",
    )
    offline_prompt_tokens: int = Field(
        default=512,
        ge=1,
        description="Prompt length of the offline backlog (tokens). Default: 512.",
    )
    offline_output_tokens: int = Field(
        default=256,
        ge=1,
        description="Output length of the offline backlog (tokens). Default: 256.",
    )
    offline_requests: int = Field(
        default=64, ge=1, description="Distinct offline requests in the backlog. Default: 64."
    )
    max_steps: int = Field(
        default=50_000,
        ge=100,
        description="Engine steps one trial may take at most. Default: 50000.",
    )
    max_wall_s: float = Field(
        default=60.0,
        gt=0,
        description="Wall seconds one search may take; checked between trials, past it the "
        "analytic answer stands. Default: 60.",
    )
    bucket_ratio: float = Field(
        default=1.25,
        gt=1,
        description="Loads are rounded to powers of this ratio (rate, prompt and output means) "
        "before searching, so a steady service hits the cache. Default: 1.25.",
    )
    search_idle: bool = Field(
        default=True,
        description="Also search the idle budget (the step limit while no online request is "
        "in flight; the two-knob search of docs/benchmarks/colocation.md) before the online "
        "budget, which is then searched with it in force from the cheapest step up; both are "
        "pushed to the pods (Configure's idle_budget_s). Default: true.",
    )
    cache_entries: int = Field(
        default=256, ge=1, description="Searched results kept (LRU). Default: 256."
    )
    worker: Literal["process", "thread"] = Field(
        default="process",
        description="Where simulated searches run: a child process of the operator (the "
        "simulation, pure Python, then never holds the GIL the operator's event loop needs; at "
        "1,000 nodes a search in a thread took 6.6 s of the loop's time during the first load "
        "change of every service) or a thread of the operator. Default: process.",
    )


class SearchTimeoutError(Exception):
    """The search ran past ``max_wall_s``."""


def engine_model_name(model: str, gpu: str) -> str | None:
    """The engine model's profile name for a served model on ``gpu``, or None if not shipped."""
    shipped = {m for m, g in available_profiles() if g == gpu.lower()}
    return next((s for s in slugs(model) if s in shipped), None)


# vLLM's batching flags -> the EngineLimits field (and sidecar setting) of the same meaning.
ENGINE_LIMIT_FLAGS = {
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--block-size": "block_size",
    "--long-prefill-token-threshold": "long_prefill_token_threshold",
}


def engine_limit_args(args: Sequence[str]) -> dict[str, int]:
    """The batching limits given on the engine's command line (``--flag value`` or
    ``--flag=value``; the last occurrence wins, as in vLLM's parser), by EngineLimits field.
    Flags left out keep vLLM's default, which depends on the vLLM version and the GPU."""
    values: dict[str, int] = {}
    items = list(args)
    for i, arg in enumerate(items):
        name, eq, value = arg.partition("=")
        if name in ENGINE_LIMIT_FLAGS:
            raw = value if eq else (items[i + 1] if i + 1 < len(items) else "")
            field_name = ENGINE_LIMIT_FLAGS[name]
            floor = 0 if field_name == "long_prefill_token_threshold" else 1
            if raw.isdigit() and int(raw) >= floor:
                values[field_name] = int(raw)
    return values


def engine_limits(args: Sequence[str]) -> EngineLimits:
    """vLLM's batching limits from the engine's command line (defaults where absent),
    with its admission gate (``--[no-]scheduler-reserve-full-isl``, on by default)."""
    full = True
    for arg in args:
        if arg in ("--scheduler-reserve-full-isl", "--no-scheduler-reserve-full-isl"):
            full = arg == "--scheduler-reserve-full-isl"
    given, default = engine_limit_args(args), EngineLimits()
    return EngineLimits(
        max_num_seqs=given.get("max_num_seqs", default.max_num_seqs),
        max_num_batched_tokens=given.get(
            "max_num_batched_tokens", default.max_num_batched_tokens
        ),
        block_size=given.get("block_size", default.block_size),
        long_prefill_token_threshold=given.get(
            "long_prefill_token_threshold", default.long_prefill_token_threshold
        ),
        reserve_full_sequence=full,
    )


def engine_kv_blocks(args: Sequence[str]) -> int | None:
    """The KV blocks given on the engine's command line (vLLM's
    ``--num-gpu-blocks-override``, last occurrence wins), or None."""
    found: int | None = None
    items = list(args)
    for i, arg in enumerate(items):
        name, eq, value = arg.partition("=")
        if name == "--num-gpu-blocks-override":
            raw = value if eq else (items[i + 1] if i + 1 < len(items) else "")
            if raw.isdigit() and int(raw) >= 1:
                found = int(raw)
    return found


@dataclass(frozen=True, slots=True)
class KvSize:
    """The KV cache a budget search simulates: ``blocks`` KV blocks of ``block_size`` tokens,
    as the pods' engines publish it (``engine``) or as ``--num-gpu-blocks-override`` in the
    engine's args gives it (``args``)."""

    blocks: int
    block_size: int
    source: Literal["engine", "args"]

    def status(self) -> dict[str, Any]:
        """``status.kvCache`` of the InferenceService."""
        return {"blocks": self.blocks, "blockSize": self.block_size, "source": self.source}


def service_kv(args: Sequence[str], reported: Iterable[tuple[int, int]]) -> KvSize | None:
    """The KV cache of a service's engine: what its ready pods read from their engines
    (``reported``: (blocks, block size) per pod), the smallest in tokens where they differ;
    else the engine's ``--num-gpu-blocks-override`` in blocks of its ``--block-size``; None
    where neither says (the search then sizes it itself: ``simulated_engine``)."""
    pods = sorted(reported, key=lambda kv: (kv[0] * kv[1], kv[1]))
    if pods:
        return KvSize(pods[0][0], pods[0][1], "engine")
    blocks = engine_kv_blocks(args)
    if blocks is None:
        return None
    return KvSize(blocks, engine_limits(args).block_size, "args")


def simulated_engine(
    model_name: str,
    gpu: str,
    limits: EngineLimits,
    params: SimSearchParams,
    *,
    kv_blocks: int | None = None,
    timing_cv: float | None = None,
) -> tuple[EngineConfig, bool]:
    """The engine a simulated search replays on, and whether the model in force times its
    steps (True: no GPU profile of (``model_name``, ``gpu``) ships; ``timing_cv``, the
    model's held-out error, or ``params.timing_cv`` where None or not finite, is then its
    step-time spread).

    ``kv_blocks`` (blocks of ``limits.block_size`` tokens: the engine's own, from its pods
    or its args, ``service_kv``) sizes its KV cache; where None, a GPU profile sizes it from
    GPU memory as vLLM does, and a model-timed engine gets ``params.kv_tokens``.
    """
    profile = engine_model_name(model_name, gpu)
    shape: dict[str, Any] = {
        "gpu": gpu.lower(),
        "max_num_seqs": limits.max_num_seqs,
        "max_num_batched_tokens": limits.max_num_batched_tokens,
        "block_size": limits.block_size,
    }
    if profile is not None:
        return EngineConfig(model=profile, num_gpu_blocks=kv_blocks, **shape), False
    cv = timing_cv if timing_cv is not None and math.isfinite(timing_cv) else params.timing_cv
    engine = EngineConfig(
        model=model_name,
        num_gpu_blocks=kv_blocks or max(1, params.kv_tokens // limits.block_size),
        noise_cv=min(max(cv, 0.0), 0.5),
        **shape,
    )
    return engine, True


def bucket(value: float, ratio: float) -> float:
    """``value`` rounded to the nearest power of ``ratio`` (in log space)."""
    return float(ratio ** round(math.log(value) / math.log(ratio)))


def bucket_load(load: LoadStats, ratio: float, min_rate_rps: float) -> LoadStats:
    """The representative load of ``load``'s cache bucket."""
    return LoadStats(
        arrival_rate_rps=bucket(max(load.arrival_rate_rps, min_rate_rps), ratio),
        mean_prompt_tokens=bucket(max(load.mean_prompt_tokens, 1.0), ratio),
        mean_output_tokens=bucket(max(load.mean_output_tokens, 1.0), ratio),
    )


def slos_for(targets: SLOTargets, scale: float = 1.0, headroom: float = 0.0) -> list[Slo]:
    """The core profiler's SLOs for the targets, limits x (1 - headroom) / ``scale``."""
    out = []
    for metric, value in targets.items():
        kind, stat = metric.split("-")
        limit = value * (1.0 - headroom) / scale
        out.append(
            Slo.model_validate({"metric": kind, "stat": stat, "limit_s": limit, "tolerance": None})
        )
    return out


def sample_horizon(rate_rps: float, params: SimSearchParams) -> float:
    """Seconds of sample: ``horizon_s``, longer for ``min_online_requests``, capped."""
    wanted = params.min_online_requests / max(rate_rps, 1e-9)
    return min(params.max_horizon_s, max(params.horizon_s, wanted))


def synthesize(load: LoadStats, params: SimSearchParams, rate_scale: float = 1.0) -> Workload:
    """A seeded workload sample for ``load`` (see the module docstring)."""
    rng = np.random.default_rng(params.seed)
    rate = max(load.arrival_rate_rps, params.min_rate_rps) * rate_scale
    horizon = sample_horizon(rate, params)
    gaps = rng.exponential(1.0 / rate, size=int(rate * horizon * 1.5) + 16)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < horizon]
    sigma = params.length_sigma

    def lengths(mean: float, n: int) -> list[int]:
        mu = math.log(max(mean, 1.0)) - sigma * sigma / 2
        return [max(1, int(x)) for x in rng.lognormal(mu, sigma, size=n)]

    n = len(arrivals)
    prompts = lengths(load.mean_prompt_tokens, n)
    outputs = lengths(load.mean_output_tokens, n)
    online = tuple(
        SimRequest(f"on-{i}", RequestClass.ONLINE, float(t), prompts[i], outputs[i])
        for i, t in enumerate(arrivals)
    )
    offline = tuple(
        SimRequest(
            f"off-{i}",
            RequestClass.OFFLINE,
            0.0,
            params.offline_prompt_tokens,
            params.offline_output_tokens,
        )
        for i in range(params.offline_requests)
    )
    return Workload(online, offline, offline_backlog=True, horizon_s=horizon, name="budget-sample")


def _worst(observed: Observed, slos: Sequence[Slo], scale: float) -> str:
    rows = [(observed.get(s.key, math.nan) / (s.limit_s or 1.0), s) for s in slos]
    _, slo = max(rows, key=lambda r: -1.0 if math.isnan(r[0]) else r[0])
    value = observed.get(slo.key, math.nan) * scale
    limit = (slo.limit_s or 0.0) * scale
    name = f"{slo.metric}-{slo.stat}"
    if math.isnan(value):
        return f"{name} unobserved"
    return f"{name} {value * 1000:.0f}ms/{limit * 1000:.0f}ms"


@dataclass(frozen=True, slots=True)
class SimulatedSearch:
    """Budget search by simulator trials for one (model, GPU) profile and calibration scale.

    ``model`` is the latency model in force, uncalibrated (a profile as shipped, fitted on
    the engine model, or a learned one); ``scale`` the calibration factor in force (see the
    module docstring); ``mode`` the simulator's mode (``SimConfig.mode``): ``in-engine`` for
    a service whose budget the scheduler plugin enforces. ``timed_by_model``: ``model``
    times the simulated steps too (``SimConfig.timing_model``; ``engine`` then gives the KV
    blocks and the spread as ``noise_cv``), for a (model, GPU) without a GPU profile.
    """

    model: LinearLatencyModel
    engine: EngineConfig
    params: SimSearchParams = field(default_factory=SimSearchParams)
    scale: float = 1.0
    mode: Literal["sidecar", "in-engine"] = "sidecar"
    timed_by_model: bool = False

    def __call__(self, targets: SLOTargets, load: LoadStats) -> SearchResult:
        calibrated = scaled(self.model, self.scale)
        analytic = AnalyticSearch(calibrated, self.engine.limits())(targets, load)
        slos = slos_for(targets, self.scale, self.params.headroom)
        if not slos:
            return analytic
        s = self.scale
        lo, hi = analytic.floor_s / s, analytic.ceiling_s / s
        workload = synthesize(load, self.params, rate_scale=s)
        deadline = time.monotonic() + self.params.max_wall_s
        records: list[TrialRecord] = []

        def trial(budget_s: float, idle_s: float | None = None) -> Observed:
            if time.monotonic() > deadline:
                raise SearchTimeoutError(f"past {self.params.max_wall_s:g} s")
            config = SimConfig(
                engine=self.engine,
                policy="budget",
                budget_s=budget_s,
                seed=self.params.seed,
                max_steps=self.params.max_steps,
                backlog_depth=self.params.offline_requests,
                dispatcher=DispatcherConfig(idle_budget_s=idle_s),
                mode=self.mode,
                timing_model=self.model if self.timed_by_model else None,
            )
            observed = simulate(workload, config, latency_model=self.model).observed()
            met = all(observed.get(x.key, math.nan) <= (x.limit_s or 0.0) for x in slos)
            idle = None if idle_s is None else idle_s * s
            records.append(TrialRecord(budget_s * s, met, _worst(observed, slos, s), idle))
            return observed

        idle: float | None = None
        try:
            if self.params.search_idle:
                # First knob: the idle budget, the online budget held at the cheapest step
                # (no offline work next to online work); then the online budget with it.
                cheapest = self.model.predict([BatchItem(Phase.DECODE, 1, 1)])
                idle_found = search_budget(
                    lambda b: trial(cheapest, b), slos, lo, hi, iterations=self.params.iterations
                )
                idle = idle_found.value
                lo = min(lo, cheapest)
            found = search_budget(
                lambda b: trial(b, idle), slos, lo, hi, iterations=self.params.iterations
            )
        except SearchTimeoutError as exc:
            logger.warning("simulated budget search stopped after %d trials: %s", len(records), exc)
            return SearchResult(
                analytic.budget_s,
                analytic.floor_s,
                analytic.ceiling_s,
                source="analytic",
                trials=tuple(records),
                note=f"simulation stopped after {len(records)} trials, {exc}",
            )
        feasible = found.value is not None
        # Unattainable: the online-only budget (the analytic floor), also with two knobs,
        # whose online search starts below it.
        budget = found.value * s if found.value is not None else analytic.floor_s
        rate = max(load.arrival_rate_rps, self.params.min_rate_rps)
        return SearchResult(
            budget_s=budget,
            floor_s=analytic.floor_s,
            ceiling_s=analytic.ceiling_s,
            source="simulated",
            feasible=feasible,
            trials=tuple(records),
            idle_budget_s=None if idle is None else idle * s,
            note=f"{rate:.3g} rps, prompt {load.mean_prompt_tokens:.0f}, "
            f"output {load.mean_output_tokens:.0f} tokens, {workload.horizon_s or 0:.0f} s "
            f"sample, {self.params.headroom:.0%} headroom{self._timing_note()}",
        )

    def _timing_note(self) -> str:
        if not self.timed_by_model:
            return ""
        return (f", steps timed by the latency model ({self.engine.noise_cv:.1%} spread, "
                f"{self.engine.num_gpu_blocks} KV blocks)")
