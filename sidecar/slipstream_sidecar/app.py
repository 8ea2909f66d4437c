"""The sidecar process: engine client, dispatcher shell, HTTP proxy, shards, control state.

:class:`Sidecar` owns every long-lived object and the operations the control
API exposes (``configure``, ``assign``, ``revoke``, ``status``, ``drain``);
``grpc_server.py`` only translates them to and from protobuf. ``run`` starts
everything, waits for a stop signal and shuts down in order. Whenever the engine
answers ``/health`` after not answering (at start too), the sidecar reads the engine's
KV cache from its ``/metrics`` before it turns ready (``kvcache.py``).

Deliberately left out: argument parsing (``__main__.py``), protobuf types.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from slipstream_scheduler.enginecontrol import CumulativeHistogram
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.learning import Learned, LearnParams
from slipstream_scheduler.tailguard import max_wait_for
from slipstream_sidecar.brain import BrainConfig, apply, build_dispatcher, latency_model_from_spec
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.engine import EngineClient, Health
from slipstream_sidecar.enginechannel import EngineChannel, EngineReportCollector, control_document
from slipstream_sidecar.errors import EngineUnavailableError
from slipstream_sidecar.kvcache import (
    CACHE_CONFIG_INFO,
    EngineKv,
    KvCache,
    parse_cache_config,
    resolve,
)
from slipstream_sidecar.learner import EngineLearner, LearnerCollector, LearnerSnapshot
from slipstream_sidecar.metrics import ClassCounters, HistogramSnapshot, SidecarMetrics
from slipstream_sidecar.predictor import PromptLengths, make_embedder
from slipstream_sidecar.proxy import Proxy, ProxyState
from slipstream_sidecar.settings import SidecarSettings
from slipstream_sidecar.shards import EngineWatch, ShardProgress, ShardRunner, ShardSpec, ShardState
from slipstream_sidecar.startprofile import ProfiledModel
from slipstream_sidecar.startprofile import load as load_profile
from slipstream_sidecar.startprofile import profile as profile_engine
from slipstream_sidecar.state import StateDir

log = logging.getLogger(__name__)

_KV_READ_S = 2.0
"""How long the engine's ``/metrics`` may take to answer when its KV cache is read (s)."""


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_s: float | None = None
    ttft_mean_s: float | None = None
    tbt_p99_s: float | None = None
    tbt_mean_s: float | None = None


@dataclass(frozen=True, slots=True)
class ConfigUpdate:
    """A ``Configure`` call as a value (``None``: keep the current value)."""

    generation: int
    budget_s: float | None
    slo: Slo = field(default_factory=Slo)
    ordering: str = ""
    latency_kind: str = ""
    latency_coefficients: dict[str, float] = field(default_factory=dict, hash=False)
    latency_knee_tokens: int = 0
    # The context+chunk+curve set's token curve (phi at every curve_step_tokens) and spacing.
    latency_token_curve: tuple[float, ...] = ()
    latency_curve_step_tokens: int = 0
    # None: keep the idle budget in force; 0: none (the budget applies always);
    # seconds otherwise (inf: unbounded).
    idle_budget_s: float | None = None
    # The ordering's tail guard, seconds; 0: none; None: from the SLO (tailguard.max_wait_for).
    max_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class ClassStatus:
    queued: int
    in_flight: int
    admitted_total: int
    preempted_total: int


@dataclass(frozen=True, slots=True)
class SidecarStatus:
    generation: int
    online: ClassStatus
    offline: ClassStatus
    budget_s: float | None
    spare_capacity: float
    engine_ready: bool
    draining: bool
    shards: tuple[ShardProgress, ...]
    predicted_step_s: float
    observed_step_s: float
    ordering: str
    idle_budget_s: float | None = None
    latency_model: LinearLatencyModel | None = None  # the model in force (None: none)
    online_counters: ClassCounters | None = None  # /metrics' online series, now
    learned: Learned | None = None  # the model learned from the engine's steps (engine mode)
    learning: LearnerSnapshot | None = None  # how learning goes (engine mode)
    profiled: ProfiledModel | None = None  # the model profiled at start (profile_at_start_s)
    kv_cache: KvCache | None = None  # the engine's KV cache admission counts on


class Sidecar:
    """Everything one sidecar process runs."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.metrics = SidecarMetrics()
        self.state_dir = StateDir(settings.state_dir)
        self.engine = EngineClient(
            settings.engine,
            connections=settings.engine_connections,
            timeout_s=settings.engine_timeout_s,
            health_timeout_s=settings.engine_health_timeout_s,
        )
        model = None
        if settings.latency_model_file is not None:
            model = LinearLatencyModel.from_json(settings.latency_model_file.read_text())
        self.generation = 0
        self.slo = Slo()
        self._configured_idle: float | None = None  # last idle budget a Configure set
        self.brain = BrainConfig(
            settings.budget_s,
            settings.ordering,
            model,
            idle_budget_s=settings.idle_budget_s,
            max_wait_s=settings.max_wait_s or None,
        )
        self._restore_config()
        self.channel: EngineChannel | None = None
        if settings.engine_channel is not None:
            self.channel = EngineChannel(settings.engine_channel)
            self.metrics.registry.register(EngineReportCollector(self.channel))
            self._write_engine_control(restart=True)
        self.learner: EngineLearner | None = None
        if settings.engine_channel is not None and settings.learn_latency:
            self.learner = EngineLearner(settings.engine_channel,
                                         params=LearnParams(max_mape=settings.learn_max_mape))
            self.metrics.registry.register(LearnerCollector(self.learner))
        self.lengths = PromptLengths(
            make_embedder(settings.length_predictor),
            history=settings.length_history,
            embed_chars=settings.length_embed_chars,
            metrics=self.metrics,
        )
        # The engine's KV cache: the settings' (else the defaults) until the engine's
        # /metrics says otherwise (_read_engine_kv, whenever the engine comes up).
        self.kv = resolve(settings.kv_blocks, settings.block_size, None)
        self._kv_read = False  # read, or tried, since the engine last came up
        self._kv_unpublished_logged = False
        self.dispatcher = build_dispatcher(
            settings, self._dispatched(self.brain), self.lengths, kv=self.kv
        )
        self.controller = Controller(
            self.dispatcher,
            self.metrics,
            tick_s=settings.tick_s,
            sync_prefill_limit=settings.sync_prefill_limit,
        )
        self.controller.latency_model = self.brain.latency_model
        self.proxy_state = ProxyState()
        self.proxy = Proxy(
            self.engine,
            self.controller,
            self.metrics,
            self.proxy_state,
            tokenize=settings.online_prompt_tokens == "tokenize",
            lengths=self.lengths,
        )
        self.watch = EngineWatch()
        self.shards: dict[str, ShardRunner] = {}
        self._specs: dict[str, dict[str, Any]] = {}
        self._ready_task: asyncio.Task[None] | None = None
        # Profile at start (profile_at_start_s): the model profiled now or by an earlier start
        # with the same state directory; while profiling, /ready answers 503.
        self.profiled: ProfiledModel | None = None
        if settings.profile_at_start_s > 0 and settings.state_dir is not None:
            self.profiled = load_profile(settings.state_dir)
            if self.profiled is not None:
                log.info("profile at start: reusing %s (%d rows); not profiling again",
                         settings.state_dir, self.profiled.rows)
        self._profiling = settings.profile_at_start_s > 0 and self.profiled is None
        self._profile_task: asyncio.Task[None] | None = None
        self.metrics.budget.set(self.brain.budget_s or 0.0)
        self.metrics.generation.set(self.generation)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()
        self.controller.start()
        # One check before serving, so /ready and the ready line agree from the start.
        up = await self.engine.health()
        if up:
            await self._read_engine_kv()
        self._engine_health(up)
        loop = asyncio.get_running_loop()
        self._ready_task = loop.create_task(self._watch_engine())
        if self.learner is not None:
            self.learner.start()
        if self._profiling:
            # Saved shards resume after the profile: nothing else may share its steps.
            self._profile_task = loop.create_task(self._profile_at_start())
        else:
            self._restore_shards()

    def _restore_shards(self) -> None:
        for doc in (self.state_dir.load("shards") or {}).values():
            spec = ShardSpec(**doc)
            self.assign(spec, persist=False)

    async def stop(self) -> None:
        if self._profile_task is not None:
            self._profile_task.cancel()  # kills the profiling subprocess
            await asyncio.gather(self._profile_task, return_exceptions=True)
        for runner in list(self.shards.values()):
            await runner.revoke()
        if self._ready_task is not None:
            self._ready_task.cancel()
            await asyncio.gather(self._ready_task, return_exceptions=True)
        if self.learner is not None:
            await self.learner.stop()
        await self.controller.stop()
        await self.engine.close()
        self.lengths.close()

    async def _watch_engine(self) -> None:
        silent = 0  # checks in a row with no answer in time
        while True:
            ok = self.proxy_state.engine_ready or self._profiling
            await asyncio.sleep(self.settings.ready_poll_s if ok else 0.2)
            health = await self.engine.health_check()
            silent = silent + 1 if health is Health.SILENT else 0
            if health is Health.SILENT and 0 < silent < self.settings.engine_silent_checks:
                # A busy host can leave one check unanswered: a ready engine stays ready until
                # engine_silent_checks in a row go unanswered (a refusal counts at once).
                if self.proxy_state.engine_ready:
                    log.info("engine /health did not answer in time (%d of %d in a row)",
                             silent, self.settings.engine_silent_checks)
                continue
            up = health is Health.UP
            if up and not self._kv_read:
                await self._read_engine_kv()  # before readiness: a restarted engine may differ
            self._engine_health(up)

    def _engine_health(self, ok: bool) -> None:
        """Readiness follows the engine's /health, except while the engine is profiled."""
        if not ok:
            self._kv_read = False  # the engine that comes back is read again
        ok = ok and not self._profiling
        if ok != self.proxy_state.engine_ready:
            log.info("engine %s", "ready" if ok else "not ready")
        self.proxy_state.engine_ready = ok
        self.watch.set(ok)
        self.metrics.engine_ready.set(1 if ok else 0)
        self._refresh_shard_gauge()

    async def _read_engine_kv(self) -> None:
        """Read the engine's KV cache from its ``/metrics`` (``vllm:cache_config_info``) and
        admit with it where no setting is given. Once per engine life; at most
        ``_KV_READ_S`` of waiting, and the text is parsed off the event loop. An engine that
        does not answer in time keeps the KV cache in force; one that does not publish the
        family gets the settings' or the defaults (logged once)."""
        self._kv_read = True
        if self.settings.kv_blocks is not None and self.settings.block_size is not None:
            return  # both given: the engine's cannot change them
        try:
            status, body, _ = await asyncio.wait_for(self.engine.get("/metrics"), _KV_READ_S)
        except (EngineUnavailableError, TimeoutError) as exc:
            log.warning(
                "cannot read the engine's KV cache from its /metrics (%s); keeping %d "
                "blocks of %d tokens",
                str(exc) or "timed out",
                self.kv.kv_blocks,
                self.kv.block_size,
            )
            return
        engine: EngineKv | None = None
        if status == 200:
            text = body.decode("utf-8", "replace")
            try:
                engine = await asyncio.to_thread(parse_cache_config, text)
            except Exception:  # whatever the parser raises must not stop the readiness loop
                log.exception("cannot parse the engine's /metrics")
        self.use_engine_kv(engine)

    def use_engine_kv(self, engine: EngineKv | None) -> None:
        """Admit with the engine's KV cache (None: it publishes none) where no setting is
        given (``kvcache.resolve``).

        The block size changes only while the sidecar holds no request (held or in flight):
        the dispatcher is rebuilt for it. Otherwise the block size in force stays (the
        blocks of the requests held were counted in it) and the engine's blocks are
        converted to it, until the engine is next read with nothing held.
        """
        s = self.settings
        kv = resolve(s.kv_blocks, s.block_size, engine)
        if engine is None and not self._kv_unpublished_logged:
            self._kv_unpublished_logged = True
            log.warning(
                "the engine's /metrics has no %s (an older vLLM, or not vLLM): admitting with "
                "%d KV blocks of %d tokens; set --kv-blocks and --block-size to the engine's",
                CACHE_CONFIG_INFO,
                kv.kv_blocks,
                kv.block_size,
            )
        if kv.block_size != self.kv.block_size:
            c = self.controller
            if any(c.held.values()) or any(c.in_flight.values()):
                log.warning(
                    "the engine's KV blocks are of %d tokens, the sidecar's of %d: "
                    "requests are held, so its KV is counted in blocks of %d until "
                    "the engine is read again with none",
                    kv.block_size,
                    self.kv.block_size,
                    self.kv.block_size,
                )
                kv = replace(
                    resolve(s.kv_blocks, self.kv.block_size, engine),
                    block_size_source=self.kv.block_size_source,
                )
            else:
                self.dispatcher = build_dispatcher(
                    s, self._dispatched(self.brain), self.lengths, kv=kv
                )
                c.dispatcher = self.dispatcher
        self.dispatcher.kv_blocks = kv.kv_blocks
        if kv != self.kv:
            log.info(
                "KV cache: %d blocks (%s) of %d tokens (%s)",
                kv.kv_blocks,
                kv.kv_blocks_source,
                kv.block_size,
                kv.block_size_source,
            )
        self.kv = kv
        self.controller.changed()  # the front's allowance counts KV blocks

    @property
    def profiling(self) -> bool:
        """Whether the engine is being profiled at start (/ready answers 503 meanwhile)."""
        return self._profiling

    async def _profile_at_start(self) -> None:
        """Once the engine answers /health, profile it (``profile_at_start_s``), then let
        readiness follow the engine again, whatever the profile's outcome."""
        try:
            while not await self.engine.health():
                await asyncio.sleep(self.settings.ready_poll_s)
            model = await self._served_model()
            if model is not None:
                directory = self.settings.state_dir or Path(
                    tempfile.mkdtemp(prefix="slipstream-profile-"))
                self.profiled = await profile_engine(
                    self.settings.engine, model, directory, self.settings.profile_at_start_s,
                    max_streams=self.settings.max_num_seqs,
                    max_prompt_tokens=self.settings.max_num_batched_tokens,
                )
        except Exception:
            log.exception("profile at start failed; readiness follows the engine")
        finally:
            self._profiling = False
        self._engine_health(await self.engine.health())
        self._restore_shards()

    async def _served_model(self) -> str | None:
        """The model to profile: the ``model`` setting, else the engine's first
        ``/v1/models`` entry (None, logged, when it names none)."""
        if self.settings.model:
            return self.settings.model
        try:
            status, body, _ = await self.engine.get("/v1/models")
            data = json.loads(body).get("data") if status == 200 else None
            first = data[0].get("id") if isinstance(data, list) and data else None
        except (EngineUnavailableError, ValueError, AttributeError) as exc:
            log.error("profile at start: cannot read the engine's /v1/models: %s", exc)
            return None
        if not isinstance(first, str) or not first:
            log.error("profile at start: the engine's /v1/models names no model (HTTP %d)",
                      status)
            return None
        return first

    # -- configuration ------------------------------------------------------------------------

    def _restore_config(self) -> None:
        doc = self.state_dir.load("config")
        if not doc:
            return
        try:
            self._apply_update(ConfigUpdate(
                generation=int(doc["generation"]),
                budget_s=doc.get("budget_s"),
                slo=Slo(**doc.get("slo", {})),
                ordering=doc.get("ordering", ""),
                latency_kind=doc.get("latency_kind", ""),
                latency_coefficients=doc.get("latency_coefficients", {}),
                latency_knee_tokens=int(doc.get("latency_knee_tokens", 0)),
                latency_token_curve=tuple(float(v) for v in doc.get("latency_token_curve", ())),
                latency_curve_step_tokens=int(doc.get("latency_curve_step_tokens", 0)),
                idle_budget_s=doc.get("idle_budget_s"),
                max_wait_s=doc.get("max_wait_s"),
            ), live=False)
            self._configured_idle = doc.get("idle_budget_s")
        except (KeyError, TypeError, ValueError) as exc:
            log.error("ignoring unreadable saved configuration: %s", exc)

    def configure(self, update: ConfigUpdate) -> tuple[int, bool]:
        """Apply ``update`` if its generation is newer; returns (generation in force, applied)."""
        if update.generation <= self.generation:
            return self.generation, False
        self._apply_update(update, live=True)
        # An update without an idle budget keeps the one in force: persist the last one a
        # Configure set, so a restart restores it rather than the process setting.
        if update.idle_budget_s is not None:
            self._configured_idle = update.idle_budget_s
        self.state_dir.save(
            "config", asdict(replace(update, idle_budget_s=self._configured_idle))
        )
        self._write_engine_control()
        return self.generation, True

    def _dispatched(self, cfg: BrainConfig) -> BrainConfig:
        """What the sidecar's own dispatcher runs. In engine mode the plugin budgets every
        iteration and keeps offline work that does not fit waiting in the engine, so the
        dispatcher submits offline work without a budget (``naive``), up to the engine's
        limits; the configuration itself goes to the plugin."""
        if self.channel is None:
            return cfg
        return BrainConfig(None, cfg.ordering, None, max_wait_s=cfg.max_wait_s)

    def _write_engine_control(self, *, restart: bool = False) -> None:
        """Engine mode: hand the configuration in force to vLLM's scheduler plugin.

        At start (``restart``) a control document of a newer generation already on disk is
        kept: this process may have restarted without its state directory.
        """
        if self.channel is None:
            return
        doc = control_document(
            generation=self.generation,
            budget_s=self.brain.budget_s,
            idle_budget_s=self.brain.idle_budget_s,
            ordering=self.brain.ordering,
            max_wait_s=self.brain.max_wait_s,
            latency_model=(
                self.brain.latency_model.to_dict() if self.brain.latency_model else None
            ),
            slo={k: v for k, v in asdict(self.slo).items() if v is not None},
        )
        if restart:
            on_disk = self.channel.read_control()
            if on_disk is not None and on_disk.generation > doc.generation:
                log.warning(
                    "engine channel holds generation %d, newer than %d here; kept",
                    on_disk.generation, doc.generation,
                )
                return
        try:
            self.channel.write(doc)
        except OSError as exc:
            log.error("engine channel: cannot write %s: %s", self.channel.control_path, exc)

    def _apply_update(self, update: ConfigUpdate, *, live: bool) -> None:
        model = self.brain.latency_model
        if update.latency_coefficients:
            model = latency_model_from_spec(
                update.latency_kind,
                update.latency_coefficients,
                update.latency_knee_tokens,
                token_curve=update.latency_token_curve,
                curve_step_tokens=update.latency_curve_step_tokens,
            )
        idle = self.brain.idle_budget_s
        if update.idle_budget_s is not None:
            idle = update.idle_budget_s or None
        new = BrainConfig(
            update.budget_s,
            update.ordering or self.brain.ordering,
            model,
            idle_budget_s=idle,
            max_wait_s=max_wait_for(
                max_wait_s=update.max_wait_s,
                ttft_p99_s=update.slo.ttft_p99_s,
                ttft_mean_s=update.slo.ttft_mean_s,
            ),
        )
        if live:
            apply(self.dispatcher, self._dispatched(self.brain), self._dispatched(new))
            self.controller.latency_model = model
            self.controller._schedule_pump()
        self.brain = new
        self.slo = update.slo
        self.generation = update.generation
        self.metrics.budget.set(new.budget_s or 0.0)
        self.metrics.generation.set(self.generation)
        log.info(
            "configuration generation %d: budget=%s idle_budget=%s ordering=%s max_wait=%s "
            "latency_model=%s",
            self.generation, new.budget_s, new.idle_budget_s, new.ordering, new.max_wait_s,
            model.feature_set.value if model else "none",
        )

    # -- shards -------------------------------------------------------------------------------

    def assign(self, spec: ShardSpec, *, persist: bool = True) -> tuple[bool, ShardProgress]:
        known = self.shards.get(spec.shard_id)
        if known is not None and known.progress.state != ShardState.REVOKED:
            return True, known.snapshot()
        if self.proxy_state.draining:
            return False, ShardProgress(spec.shard_id, ShardState.PENDING, message="draining")
        if spec.line_end < spec.line_start:
            return False, ShardProgress(spec.shard_id, ShardState.FAILED, message="bad range")
        runner = ShardRunner(
            spec,
            controller=self.controller,
            engine=self.engine,
            metrics=self.metrics,
            watch=self.watch,
            window=self.settings.shard_window,
            max_retries=self.settings.offline_max_retries,
            staging_dir=self.settings.state_dir,
            storage_roots=self.settings.storage_roots,
            engine_xargs=self.channel.offline_xargs() if self.channel else None,
        )
        self.shards[spec.shard_id] = runner
        if persist:
            self._specs[spec.shard_id] = asdict(spec)
            self.state_dir.save("shards", self._specs)
        else:
            self._specs[spec.shard_id] = asdict(spec)
        runner.start()
        self._refresh_shard_gauge()
        return True, runner.snapshot()

    async def revoke(self, shard_id: str) -> tuple[bool, ShardProgress | None]:
        runner = self.shards.get(shard_id)
        if runner is None:
            return False, None
        await runner.revoke()
        self._specs.pop(shard_id, None)
        self.state_dir.save("shards", self._specs)
        self._refresh_shard_gauge()
        return True, runner.snapshot()

    def _refresh_shard_gauge(self) -> None:
        counts = {s.name.lower(): 0 for s in ShardState}
        for runner in self.shards.values():
            counts[runner.progress.state.name.lower()] += 1
        for state, n in counts.items():
            self.metrics.shards.labels(state).set(n)

    # -- status and drain ---------------------------------------------------------------------

    def status(self) -> SidecarStatus:
        c = self.controller
        stats = c.stats()
        limit = self.settings.max_num_seqs
        busy = c.in_flight["online"] + c.in_flight["offline"]
        spare = max(0.0, 1.0 - busy / limit)
        spare = min(spare, stats.est_free_kv_blocks / self.dispatcher.kv_blocks)
        predicted = c.predicted_step_s()
        return SidecarStatus(
            generation=self.generation,
            online=ClassStatus(c.held["online"], c.in_flight["online"],
                               c.admitted_total["online"], c.preempted_total["online"]),
            offline=ClassStatus(c.held["offline"], c.in_flight["offline"],
                                c.admitted_total["offline"], c.preempted_total["offline"]),
            budget_s=self.brain.budget_s if self.channel else self.dispatcher.budget_s,
            spare_capacity=spare,
            engine_ready=self.proxy_state.engine_ready,
            draining=self.proxy_state.draining,
            shards=tuple(r.snapshot() for r in self.shards.values()),
            predicted_step_s=predicted,
            observed_step_s=c.observed_step_s,
            ordering=self.brain.ordering,
            idle_budget_s=(self.brain.idle_budget_s if self.channel
                           else self.dispatcher.config.idle_budget_s),
            latency_model=self.brain.latency_model,
            online_counters=self._online_counters(),
            learned=self.learner.learned if self.learner is not None else None,
            learning=self.learner.snapshot() if self.learner is not None else None,
            profiled=self.profiled,
            kv_cache=self.kv,
        )

    def _online_counters(self) -> ClassCounters:
        """The online latency the operator reads: in engine mode no online byte crosses the
        sidecar, so it is the plugin's, measured inside vLLM (its last report)."""
        if self.channel is not None:
            rep = self.channel.report(fresh_only=False)
            if rep is not None and rep.online_counts.ttft.count > 0:
                c = rep.online_counts

                def hist(h: CumulativeHistogram) -> HistogramSnapshot:
                    return HistogramSnapshot(
                        tuple(zip(h.upper_bounds, h.cumulative_counts, strict=True)),
                        h.sum,
                        h.count,
                    )

                return ClassCounters(
                    hist(c.ttft), hist(c.tbt), c.admitted, c.finished_ok, c.output_tokens
                )
        return self.metrics.counters("online")

    async def drain(self, timeout_s: float) -> tuple[bool, int]:
        self.proxy_state.draining = True
        self.controller.changed()  # a compiled front's allowance drops to zero now
        for shard_id in list(self.shards):
            # Forgotten in the state dir too: the operator places them elsewhere.
            await self.revoke(shard_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.controller.in_flight["online"] + self.controller.held["online"] > 0:
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        left = self.controller.in_flight["online"] + self.controller.held["online"]
        return left == 0, left


def shard_spec_from_json(doc: dict[str, Any]) -> ShardSpec:
    return ShardSpec(**doc)

