"""Discrete-event trace replay: the sidecar's dispatcher in front of the engine model.

This simulates the deployment Slipstream ships (``docs/concepts/simulator.md``):
the engine model runs vLLM's own scheduler (priority policy) and the admission
layer in front of it is the sidecar's :class:`~slipstream_scheduler.dispatcher.Dispatcher`,
which sees only what a client sees (tokens as they stream, finishes). Time is
virtual: each engine iteration advances the clock by its modelled duration;
when the engine is idle the clock jumps to the next arrival.

Loop, per event::

    deliver arrivals up to now -> dispatcher.decide(now) -> abort / submit on the engine,
    repeated until a decide returns nothing (the sidecar's loop plans again in its next
    turn, well within an engine step) -> engine.step() -> now += duration
    -> tokens, finishes to the recorder and the dispatcher

Named policies (:data:`POLICIES`) bind an admission policy of the planner
(``slipstream_scheduler.admission``) to an offline order (FCFS or PSM).

``SimConfig.mode="in-engine"`` swaps in :class:`~slipstream_scheduler.sim.inengine.PlannedEngine`
(the planner's ITERATION mode picks every iteration's batch inside the engine,
as HyGen does in Sarathi-Serve): what an engine plugin would add, reported
beside the sidecar, never as a sidecar figure.

Deliberately left out: file I/O (workloads come in as values) and wall-clock
reads (the caller times the run).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from slipstream_scheduler.admission import ADMISSION_POLICIES, build_planner
from slipstream_scheduler.dispatcher import (
    Dispatcher,
    DispatcherConfig,
    DispatcherStats,
    FifoQueue,
    Incoming,
    PsmOfflineQueue,
    RequestQueue,
)
from slipstream_scheduler.engine.model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    EngineStats,
    RequestView,
    StepResult,
)
from slipstream_scheduler.latency import DEFAULT_FEATURE_SETS, FeatureSet, LinearLatencyModel, fit
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.protocols import LengthPredictor
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_scheduler.sim.inengine import PlannedEngine
from slipstream_scheduler.sim.metrics import Recorder, SimMetrics
from slipstream_scheduler.sim.workload import SimRequest, Workload
from slipstream_scheduler.types import BatchItem, Phase, RequestClass

logger = logging.getLogger(__name__)

_MAX_DECIDE_ROUNDS = 64
"""Dispatcher decisions carried out between two engine steps, at most (a safety bound)."""


class _Pool(Protocol):
    @property
    def num_blocks(self) -> int: ...


class SimEngine(Protocol):
    """What the simulator drives: :class:`EngineModel`'s request and step interface."""

    @property
    def pool(self) -> _Pool: ...

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self, now_s: float = 0.0) -> StepResult: ...

    def has_work(self) -> bool: ...

    def inspect(self, request_id: str) -> RequestView | None: ...

    def stats(self) -> EngineStats: ...


EngineFactory = Callable[[EngineConfig, int], SimEngine]
"""``(engine config, seed) -> engine``: what chooses every batch (default :class:`EngineModel`;
``slipstream sim --engine vllm`` passes vLLM's own scheduler, run in-process)."""


@dataclass(frozen=True, slots=True)
class InEngineSpec:
    """What an in-engine scheduler is configured with (the sidecar's ``Configure``)."""

    latency_model: LinearLatencyModel
    params: dict[str, Any]
    budget_s: float | None
    idle_budget_s: float | None
    offline_priority: int
    policy: str = "budget"
    """The admission policy the in-engine planner runs (``budget`` or ``static-cap``)."""


InEngineFactory = Callable[[EngineConfig, int, InEngineSpec], SimEngine]
"""``(engine config, seed, spec) -> engine`` for ``mode="in-engine"``: default the engine
model under the planner (:class:`PlannedEngine`); ``--engine vllm`` passes vLLM's scheduler
under Slipstream's plugin (``slipstream_testbed.vllm.simplugin.PluginEngine``)."""


class SimError(Exception):
    """A simulation cannot be set up or run; ``policy`` names the policy when relevant."""

    def __init__(self, message: str, policy: str | None = None) -> None:
        super().__init__(message)
        self.policy = policy


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A named co-location policy: planner admission policy + offline order + classes served."""

    admission: str
    offline_order: Literal["fcfs", "psm"]
    serves_online: bool
    serves_offline: bool
    summary: str


POLICIES: dict[str, PolicySpec] = {
    "online-only": PolicySpec("online-only", "fcfs", True, False, "online work only"),
    "offline-only": PolicySpec("offline-only", "fcfs", False, True, "offline work only"),
    "naive": PolicySpec("naive", "fcfs", True, True, "Sarathi++: offline fills, no budget"),
    "static-cap": PolicySpec("static-cap", "fcfs", True, True, "HyGen*: fixed offline cap"),
    "budget": PolicySpec("budget", "fcfs", True, True, "HyGen: offline fills the budget"),
    "budget-psm": PolicySpec("budget", "psm", True, True, "HyGen with PSM offline order"),
}
"""The six policies of ``slipstream sim --policy`` and ``slipstream bench colocation``."""


class SimConfig(BaseModel):
    """One replay's settings. Resolved once before the loop."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="The engine model (llama-2-7b on a100)."
    )
    policy: str = Field(default="budget", description="A name in POLICIES; default budget.")
    budget_s: float | None = Field(
        default=None,
        gt=0,
        description="Per-iteration budget, seconds (budget policies); None: unbounded.",
    )
    static_cap: int = Field(
        default=16,
        ge=0,
        description="static-cap: offline requests in flight at most (in-engine mode: offline "
        "tokens per step at most); default 16.",
    )
    dispatcher: DispatcherConfig = Field(
        default_factory=DispatcherConfig, description="The sidecar's dispatcher knobs."
    )
    planner_params: dict[str, Any] = Field(
        default_factory=dict, description="Extra params of the admission policy (pydantic)."
    )
    psm: PsmParams = Field(
        default_factory=lambda: PsmParams(block_size=1),
        description="PSM queue knobs (block_size 1: the trie is over 16-token block hashes).",
    )
    mode: Literal["sidecar", "in-engine"] = Field(
        default="sidecar",
        description="sidecar (default): the dispatcher in front of vLLM's scheduler, what "
        "Slipstream ships. in-engine: the planner's ITERATION mode picks each iteration's "
        "batch inside the engine, the budget while online work is in it and the dispatcher's "
        "idle_budget_s otherwise (what an engine plugin would add; budget and static-cap "
        "policies only; never a sidecar figure).",
    )
    in_engine_offline_window: int | None = Field(
        default=None,
        ge=1,
        description="in-engine mode: offline requests the dispatcher keeps in the engine at "
        "most; None (default): as the sidecar does in engine mode, as many as its KV "
        "estimate and the engine's sequence slots allow.",
    )
    offline_order: Literal["fcfs", "psm"] | None = Field(
        default=None, description="Override the policy's offline order (None: the policy's)."
    )
    backlog_depth: int = Field(
        default=512,
        ge=1,
        description="Offline requests kept queued when the backlog never runs dry.",
    )
    ttft_target_s: float | None = Field(
        default=None, description="Per-request TTFT target, seconds."
    )
    tbt_target_s: float | None = Field(default=None, description="Per-request TBT target, seconds.")
    seed: int = Field(default=0, description="Seed of the engine's step-time noise.")
    timing_model: LinearLatencyModel | None = Field(
        default=None,
        description="Time every engine step with this batch-latency model instead of the "
        "GPU profile of (engine.model, engine.gpu), so any learned or fitted model can be "
        "simulated; engine.noise_cv is then its residual spread and engine.num_gpu_blocks "
        "must be set. The engine model only (no engine factory). None (default): the GPU "
        "profile.",
    )
    max_steps: int | None = Field(
        default=None, ge=1, description="Stop after this many steps (safety)."
    )


@dataclass(frozen=True, slots=True)
class SimResult:
    """A replay's metrics plus the counters of the dispatcher and the engine."""

    policy: str
    metrics: SimMetrics
    dispatcher: DispatcherStats
    engine: EngineStats
    budget_s: float | None
    offline_output_by_request: dict[str, int] = field(default_factory=dict, repr=False)
    in_engine: dict[str, float | None] = field(default_factory=dict)
    """In-engine mode only: the planned engine's counters (plans, fallback_steps,
    skipped_offline, max_offline_step_over_budget_s); empty in sidecar mode."""

    def observed(self) -> dict[str, float]:
        """Online latencies keyed for :mod:`slipstream_scheduler.budget` (``tbt_p99_s``, ...)."""
        on = self.metrics.online
        out: dict[str, float] = {}
        for name, d in (("ttft", on.ttft), ("tbt", on.tbt), ("ttlt", on.ttlt)):
            out[f"{name}_mean_s"] = d.mean
            out[f"{name}_p50_s"] = d.p50
            out[f"{name}_p99_s"] = d.p99
        return out


Progress = Callable[[float], None]
"""Called now and then with the virtual time reached (for a progress bar)."""


def profile_latency_model(
    engine: EngineConfig, *, samples: int = 1500, seed: int = 0, curve: bool = False
) -> LinearLatencyModel:
    """Fit the planner's latency model on random batches timed by the engine's GPU model.

    This is the simulator's stand-in for profiling a real GPU: batches mix
    decodes (contexts up to 4k) and prefill chunks under the engine's token cap.
    ``curve``: the token-curve feature set is a candidate too (``slipstream profile
    latency --curve``), which follows the GPU's step-wise cost of small batches.
    """
    timing = EngineModel(engine, seed=seed).timing
    rng = random.Random(seed)
    cap = engine.max_num_batched_tokens
    rows: list[tuple[list[BatchItem], float]] = []
    for _ in range(samples):
        batch: list[BatchItem] = []
        n_dec = rng.choice((0, 1, 4, 16, 32, 64, 128, 256))
        n_dec = min(n_dec, engine.max_num_seqs)
        for _ in range(n_dec):
            batch.append(BatchItem(Phase.DECODE, 1, rng.randint(16, 4096)))
        left = cap - n_dec
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            if left <= 0:
                break
            c = rng.randint(1, left)
            batch.append(BatchItem(Phase.PREFILL, c, rng.choice((0, 0, rng.randint(0, 4096)))))
            left -= c
        if not batch:
            batch.append(BatchItem(Phase.DECODE, 1, rng.randint(16, 4096)))
        rows.append((batch, timing.predict(batch)))
    sets = [*DEFAULT_FEATURE_SETS, FeatureSet.CONTEXT_CHUNK_CURVE] if curve else None
    return fit(rows, seed=seed, feature_sets=sets).model


def online_only_step_s(engine: EngineConfig, model: LinearLatencyModel) -> float:
    """Predicted time of a small decode-only step: the low end of a budget search."""
    return model.predict([BatchItem(Phase.DECODE, 1, 1024)] * 8)


def floor_step_s(engine: EngineConfig, model: LinearLatencyModel) -> float:
    """Predicted time of the cheapest step (one decode, tiny context).

    As an online budget it leaves offline work no room next to any online work
    (every step with online work predicts longer), so offline work runs only
    while no online request is in flight: the safe end of the two-knob search.
    """
    return model.predict([BatchItem(Phase.DECODE, 1, 1)])


def full_step_s(engine: EngineConfig, model: LinearLatencyModel) -> float:
    """Predicted time of a full token-cap prefill step: the high end of a budget search."""
    return model.predict([BatchItem(Phase.PREFILL, engine.max_num_batched_tokens, 0)])


@dataclass(slots=True)
class _Live:
    """What the simulator knows of one request (the dispatcher keeps its own view)."""

    req: SimRequest
    submissions: int = 0
    engine_id: str = ""
    produced: int = 0  # tokens emitted over all submissions
    sub_produced: int = 0  # tokens emitted by the current submission
    keys: tuple[Hashable, ...] = ()  # block keys of prompt + produced so far


class Simulator:
    """One replay. Build, then :meth:`run` once."""

    def __init__(
        self,
        workload: Workload,
        config: SimConfig,
        *,
        latency_model: LinearLatencyModel | None = None,
        length_predictor: LengthPredictor | None = None,
        online_queue: RequestQueue | None = None,
        engine_factory: EngineFactory | None = None,
        in_engine_factory: InEngineFactory | None = None,
    ) -> None:
        spec = POLICIES.get(config.policy)
        if spec is None:
            raise SimError(f"unknown policy; known: {sorted(POLICIES)}", config.policy)
        self.spec = spec
        self.workload = workload
        self.config = config
        params: dict[str, Any] = dict(config.planner_params)
        in_engine = config.mode == "in-engine"
        if spec.admission == "static-cap" and in_engine:
            # Inside the engine the static cap is per step: offline tokens, no model.
            params.setdefault("max_offline_step_tokens", config.static_cap)
            params.setdefault("max_offline_in_flight", None)
        elif spec.admission == "static-cap":
            params.setdefault("max_offline_in_flight", config.static_cap)
        needs_model = ADMISSION_POLICIES[spec.admission].needs_latency_model or in_engine
        timing_model = config.timing_model
        if timing_model is not None and (engine_factory or in_engine_factory):
            raise SimError("a timing model times the engine model only", config.policy)
        if needs_model and latency_model is None:
            latency_model = timing_model or profile_latency_model(config.engine, seed=config.seed)
        admission = spec.admission
        dispatcher_budget = config.budget_s if spec.admission == "budget" else None
        self.engine: SimEngine
        if config.mode == "in-engine":
            if engine_factory is not None and in_engine_factory is None:
                raise SimError("in-engine mode runs the engine model's planner", config.policy)
            if spec.admission not in ("budget", "static-cap") or latency_model is None:
                raise SimError("in-engine mode needs a budget or static-cap policy", config.policy)
            step_budget = config.budget_s if spec.admission == "budget" else None
            # The real planner in ITERATION mode picks each iteration's batch inside
            # the engine. In front of it the dispatcher does what the sidecar does in
            # engine mode: offline work without a budget, online work straight through.
            if in_engine_factory is not None:
                self.engine = in_engine_factory(
                    config.engine,
                    config.seed,
                    InEngineSpec(
                        latency_model,
                        dict(params),
                        step_budget,
                        config.dispatcher.idle_budget_s if step_budget is not None else None,
                        config.dispatcher.offline_priority,
                        spec.admission,
                    ),
                )
            else:
                inner = build_planner(
                    spec.admission,
                    params or None,
                    latency_model=latency_model,
                    mode=PlannerMode.ITERATION,
                )
                self.engine = PlannedEngine(
                    config.engine,
                    config.seed,
                    planner=inner,
                    budget_s=step_budget,
                    idle_budget_s=(
                        config.dispatcher.idle_budget_s if step_budget is not None else None
                    ),
                    offline_priority=config.dispatcher.offline_priority,
                    timing_model=timing_model,
                )
            # A per-step cap of 0 holds every offline request back: the sidecar sends none.
            window = config.in_engine_offline_window
            if spec.admission == "static-cap" and params.get("max_offline_step_tokens") == 0:
                window = 0
            admission, needs_model, dispatcher_budget = "static-cap", False, None
            params = {"max_offline_in_flight": window}
        elif engine_factory is not None:
            self.engine = engine_factory(config.engine, config.seed)
        else:
            self.engine = EngineModel(config.engine, seed=config.seed, timing_model=timing_model)
        planner = build_planner(
            admission,
            params or None,
            latency_model=latency_model if needs_model else None,
            mode=PlannerMode.ADMISSION,
        )
        offline_q: RequestQueue
        if (config.offline_order or spec.offline_order) == "psm":
            offline_q = PsmOfflineQueue(PsmQueue(config.psm))
        else:
            offline_q = FifoQueue()
        dcfg = config.dispatcher
        if config.mode == "in-engine":
            dcfg = dcfg.model_copy(update={"online_passthrough": True})
        if not spec.serves_offline:
            dcfg = dcfg.model_copy(update={"admit_offline": False})
        self.dispatcher = Dispatcher(
            dcfg,
            planner,
            online_queue=online_queue,
            offline_queue=offline_q,
            length_predictor=length_predictor,
            limits=config.engine.limits(),
            kv_blocks=self.engine.pool.num_blocks,
            budget_s=dispatcher_budget,
        )
        self.recorder = Recorder()
        self._live: dict[str, _Live] = {}
        self._by_engine_id: dict[str, _Live] = {}
        self._lap = 0
        self._backlog_next = 0
        self._offline_pending = 0
        self._dispatcher_preemptions = 0
        self._offline_done_tokens: dict[str, int] = {}
        self._ran = False

    # ------------------------------------------------------------------ setup helpers

    def _arrive(self, req: SimRequest, now_s: float) -> None:
        live = _Live(req, keys=req.block_hashes)
        self._live[req.request_id] = live
        self.recorder.arrived(req.request_id, req.cls, req.arrival_s, req.prompt_tokens)
        self.dispatcher.arrive(
            Incoming(
                req.request_id,
                req.cls,
                req.prompt_tokens,
                req.max_tokens,
                req.arrival_s,
                vector=req.vector,
                block_hashes=req.block_hashes,
            ),
            now_s,
        )
        if req.cls is RequestClass.OFFLINE:
            self._offline_pending += 1

    def _top_up_backlog(self, now_s: float) -> None:
        """Keep ``backlog_depth`` offline requests queued (cycling the dataset, fresh ids)."""
        offline = self.workload.offline
        want = self.config.backlog_depth
        while self._offline_pending < want:
            base = offline[self._backlog_next]
            rid = f"{base.request_id}~{self._lap}" if self._lap else base.request_id
            keys = base.block_hashes
            if self._lap:
                # A fresh request of the same shape: it must not hit the cache of
                # an earlier lap's copy; prefixes shared within a lap stay shared.
                lap = self._lap
                keys = tuple(hash((h, lap)) for h in keys)
            req = SimRequest(
                rid,
                RequestClass.OFFLINE,
                now_s,
                base.prompt_tokens,
                base.output_tokens,
                keys,
                base.max_tokens,
                base.group,
                base.vector,
            )
            self._arrive(req, now_s)
            self._backlog_next += 1
            if self._backlog_next == len(offline):
                self._backlog_next = 0
                self._lap += 1

    # ------------------------------------------------------------------ the loop

    def run(self, progress: Progress | None = None) -> SimResult:
        if self._ran:
            raise SimError("a Simulator runs once")
        self._ran = True
        cfg, spec, wl = self.config, self.spec, self.workload
        eng, disp, rec = self.engine, self.dispatcher, self.recorder
        online = wl.online if spec.serves_online else ()
        finite_offline: tuple[SimRequest, ...] = ()
        if spec.serves_offline and not wl.offline_backlog:
            finite_offline = tuple(sorted(wl.offline, key=lambda r: r.arrival_s))
        backlog = spec.serves_offline and wl.offline_backlog
        horizon = wl.horizon_s if wl.horizon_s is not None else math.inf
        i_on = i_off = 0
        n_on, n_off = len(online), len(finite_offline)
        now = 0.0
        steps = 0
        next_progress = 0.0
        by_eid = self._by_engine_id
        live_map = self._live
        online_cls = RequestClass.ONLINE
        while now < horizon:
            while i_on < n_on and online[i_on].arrival_s <= now:
                self._arrive(online[i_on], now)
                i_on += 1
            while i_off < n_off and finite_offline[i_off].arrival_s <= now:
                self._arrive(finite_offline[i_off], now)
                i_off += 1
            if backlog:
                self._top_up_backlog(now)
            # The sidecar plans again in its next loop turn while a decision was
            # carried out (well within one engine step): decide until quiet.
            for _ in range(_MAX_DECIDE_ROUNDS):
                dec = disp.decide(now)
                if not dec:
                    break
                for ab in dec.abort:
                    lv = live_map[ab.request_id]
                    view = eng.inspect(lv.engine_id)
                    eng.abort(lv.engine_id)
                    del by_eid[lv.engine_id]
                    disp.aborted(ab.request_id, now)
                    lost = view.computed_tokens + view.generated_tokens if view else 0
                    rec.aborted(ab.request_id, lost)
                    self._dispatcher_preemptions += 1
                    self._after_abort(lv)
                for sub in dec.submit:
                    self._submit(
                        live_map[sub.request_id], sub.priority, sub.resume_from_tokens, now
                    )
            if not eng.has_work():
                nxt = min(
                    online[i_on].arrival_s if i_on < n_on else math.inf,
                    finite_offline[i_off].arrival_s if i_off < n_off else math.inf,
                )
                if nxt == math.inf:
                    st_d = disp.stats()
                    stuck = st_d.online_queued or (
                        st_d.offline_queued and disp.config.admit_offline
                    )
                    if stuck and horizon == math.inf:
                        raise SimError("requests are queued but nothing can be admitted")
                    if stuck:
                        logger.info("nothing admissible until the horizon (%d queued)", stuck)
                    break
                now = min(nxt, horizon)
                continue
            res = eng.step(now)
            steps += 1
            end = now + res.duration_s
            emitted = res.emitted
            if emitted:
                rec.step(end, res.duration_s, emitted)
                for eid, n in emitted:
                    got = by_eid.get(eid)
                    if got is None:
                        continue
                    got.produced += n
                    got.sub_produced += n
                    disp.progress(got.req.request_id, got.sub_produced, end)
            else:
                rec.step(end, res.duration_s, [])
            for eid in res.preempted:
                got = by_eid.get(eid)
                if got is not None:
                    rec.preempted(got.req.request_id)
            for eid, reason in res.finished:
                got = by_eid.pop(eid, None)
                if got is None:
                    continue  # an abort we asked for
                rid = got.req.request_id
                if reason == "abort":
                    disp.failed(rid, end)
                    continue
                disp.finished(rid, got.sub_produced, end)
                rec.finished(rid, end)
                del live_map[rid]
                if got.req.cls is not online_cls:
                    self._offline_pending -= 1
                    self._offline_done(got)
            now = end
            if progress is not None and now >= next_progress:
                progress(now)
                next_progress = now + 10.0
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                break
        duration = horizon if horizon != math.inf else now
        if progress is not None:
            progress(duration)
        st = eng.stats()
        hit = st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else 0.0
        metrics = rec.summary(
            duration,
            prefix_hit_rate=hit,
            engine_preemptions=st.preemptions,
            dispatcher_preemptions=self._dispatcher_preemptions,
            prefill_tokens_computed=st.computed_prefill_tokens,
            ttft_target_s=cfg.ttft_target_s,
            tbt_target_s=cfg.tbt_target_s,
        )
        logger.info(
            "sim policy=%s steps=%d t=%.1fs online_tok/s=%.1f offline_tok/s=%.1f busy=%.3f",
            cfg.policy,
            steps,
            duration,
            metrics.online.tokens_per_s,
            metrics.offline.tokens_per_s,
            metrics.busy_fraction,
        )
        return SimResult(
            cfg.policy,
            metrics,
            disp.stats(),
            st,
            cfg.budget_s if cfg.mode == "in-engine" else disp.budget_s,
            self._offline_done_tokens,
            self._in_engine_counters(),
        )

    def _in_engine_counters(self) -> dict[str, float | None]:
        eng = self.engine
        counters = getattr(eng, "in_engine_counters", None)
        if callable(counters):
            out: dict[str, float | None] = counters()
            return out
        if not isinstance(eng, PlannedEngine):
            return {}
        return {
            "plans": eng.plans,
            "fallback_steps": eng.fallback_steps,
            "skipped_offline": eng.skipped_offline,
            "max_offline_step_over_budget_s": (
                None
                if math.isinf(eng.max_offline_step_over_budget_s)
                else eng.max_offline_step_over_budget_s
            ),
        }

    # ------------------------------------------------------------------ per request

    def _offline_done(self, lv: _Live) -> None:
        self._offline_done_tokens[lv.req.request_id] = lv.produced

    def _submit(self, lv: _Live, priority: int, resume_from: int, now_s: float) -> None:
        req = lv.req
        if resume_from != lv.produced:
            raise SimError(
                f"{req.request_id}: resume from {resume_from} but {lv.produced} produced"
            )
        eid = f"{req.request_id}#{lv.submissions}" if lv.submissions else req.request_id
        if lv.submissions:
            self.recorder.alias[eid] = req.request_id
        lv.submissions += 1
        lv.engine_id = eid
        lv.sub_produced = 0
        self._by_engine_id[eid] = lv
        self.engine.add(
            EngineRequest(
                eid,
                req.prompt_tokens + resume_from,
                req.max_tokens - resume_from,
                priority,
                req.arrival_s,
                lv.keys,
                req.output_tokens - resume_from,
            )
        )

    def _after_abort(self, lv: _Live) -> None:
        """Block keys of the continuation: the engine keyed blocks past the hashes by its id."""
        bs = self.config.engine.block_size
        full = (lv.req.prompt_tokens + lv.produced) // bs
        keys = list(lv.keys)
        eid = lv.engine_id
        keys.extend((eid, j) for j in range(len(keys), full))
        lv.keys = tuple(keys[:full])


def simulate(
    workload: Workload,
    config: SimConfig,
    *,
    latency_model: LinearLatencyModel | None = None,
    length_predictor: LengthPredictor | None = None,
    online_queue: RequestQueue | None = None,
    progress: Progress | None = None,
    engine_factory: EngineFactory | None = None,
    in_engine_factory: InEngineFactory | None = None,
) -> SimResult:
    """Replay ``workload`` under ``config`` and measure it (see :class:`Simulator`)."""
    sim = Simulator(
        workload,
        config,
        latency_model=latency_model,
        length_predictor=length_predictor,
        online_queue=online_queue,
        engine_factory=engine_factory,
        in_engine_factory=in_engine_factory,
    )
    return sim.run(progress)
