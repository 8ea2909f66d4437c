"""Slipstream inside vLLM: a ``--scheduler-cls`` that runs the core's planner every iteration.

``SlipstreamScheduler`` subclasses vLLM's v1 ``AsyncScheduler``. Everything that is not a scheduling
*choice* stays vLLM's: the KV manager and prefix cache, block allocation, the scheduler output,
outputs, stop handling, aborts, stats. Each ``schedule()``:

1. builds a :class:`~slipstream_scheduler.types.Snapshot` of vLLM's state: running requests,
   the online waiting queue in the configured ordering (Gittins over predicted output-length
   distributions by default in Slipstream's charts; past the tail guard's deadline, in
   deadline order ahead of the ranked ones, ``slipstream_scheduler.tailguard``), the offline
   waiting queue in PSM order over token-id blocks, each queued request's prefix-cache hit,
   the free KV blocks, and the budget in force (the idle budget when no online request is in
   the engine);
2. asks the planner (``TwoPhasePlanner`` in ``PlannerMode.ITERATION``, the very code the
   simulator's in-engine mode runs) for the iteration: online decodes and chunks first, then
   offline decodes and budget-sized offline chunks while the predicted step fits the budget;
   offline requests preempted for an online request's KV or slot;
3. steers vLLM's own walk to that plan: the plan's preemptions are made with vLLM's
   ``_preempt_request`` (recompute: the request keeps every token it produced and resumes);
   running offline requests the plan leaves out are hidden from the walk for this iteration
   (they keep their KV); the waiting queue the walk sees holds exactly the plan's admissions,
   online first, in plan order; the token budget is the plan's token total; and vLLM's
   ``schedule()`` then allocates blocks and builds the output as always.

Classes. A request is offline only if ``vllm_xargs`` carries the pod's token under
``slipstream_offline`` (the sidecar puts it there; see
:mod:`slipstream_scheduler.enginecontrol`). Everything else is online, whatever it claims; a
forged tag is counted and ignored. Priorities are clamped to the class: offline requests run
at :data:`OFFLINE_PRIORITY` or below, online requests never below it, so a client-supplied
``priority`` never lifts a request above its class (vLLM's own preemption, which picks the
largest ``(priority, arrival)``, therefore always takes offline work first).

The predictor. The scheduler sees token ids, not text, so the online length predictor embeds
the prompt's token ids: the core's ``HashingEmbedder`` over the decimal ids (signed hashing of
id unigrams and bigrams, first :data:`EMBED_TOKENS` ids), which makes prompts that share a
template or system prompt neighbours. It is fed by every request that finishes in the engine.

Control. The sidecar writes ``control.json`` in the channel directory (the env var
``SLIPSTREAM_CHANNEL_DIR`` or ``additional_config["slipstream_channel_dir"]``); it is polled
every :data:`CONTROL_POLL_S` and applied only when its generation is newer. The plugin writes
``status.json`` (an ``EngineReport``) every :data:`STATUS_EVERY_S` while it schedules; while
vLLM is idle (no step, so no call into the plugin) a heartbeat thread rewrites the last report
with a new ``written_at`` at the same pace, so a fresh report means a live engine, busy or
not (the heartbeat touches no scheduler state). Without a channel, or
before the first control document, the plugin runs the ``naive`` policy: classes and order
still hold, offline work is not budgeted.

Approximations (NOTE: where this bends the plan):

* when the plan admits an online request, running offline prefill chunks are held back for
  that iteration (vLLM walks running requests before waiting ones, so an offline chunk would
  otherwise take the online request's tokens); counted as ``offline_deferred_chunks``;
* a plan that schedules nothing while there is work (KV exhausted, or an idle budget below the
  cheapest offline step) falls back to vLLM's own walk for that iteration, as the simulator's
  in-engine mode does (``fallback_steps``);
* chunk sizes follow from the token total and the walk's order, so vLLM's per-request
  ``long_prefill_token_threshold`` rules (off when one request is eligible) still apply.

Async scheduling. vLLM schedules step N+1 while step N runs by default (``AsyncScheduler``):
a decoding request then has a token in flight (an output placeholder) when it is planned again.
The snapshot counts that token as computed, as vLLM's walk does, so the request is the decode it
is; each step is timed from its own scheduler output. :class:`SlipstreamScheduler` sits on
``AsyncScheduler``, :class:`SlipstreamSyncScheduler` on ``Scheduler`` for vLLM started with
``--no-async-scheduling``; both share every line of :class:`_Slipstream`.

Faults. Every part of the plugin's own work runs under a :class:`~slipstream_vllm.failsafe.
FaultGuard`: a fault makes that piece of work vLLM's, never an engine crash.
:mod:`slipstream_vllm.compat` checks at start that vLLM has every internal used here.

Supported vLLM: the pinned versions in ``docs/plugin.md`` (the scheduler interface is not
public). Deliberately left out: speculative decoding, KV connectors and pipeline parallelism.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import hmac
import itertools
import json
import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.enginecontrol import (
    CONTROL_FILE,
    OFFLINE_TOKEN_ARG,
    OFFLINE_TOKEN_FILE,
    STATUS_FILE,
    TBT_BUCKETS_S,
    TTFT_BUCKETS_S,
    ClassCounts,
    ClassLatency,
    ControlFormatError,
    CumulativeHistogram,
    EngineControl,
    EngineReport,
    decode_control,
)
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    SemanticHistoryPredictor,
)
from slipstream_scheduler.ordering import Ordering, RequestView, make_ordering
from slipstream_scheduler.planner import PlannerMode, TwoPhasePlanner
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_scheduler.tailguard import GUARD_MAX_DISPLACEMENTS, unguarded_rank
from slipstream_scheduler.types import (
    EngineLimits,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
    StepPlan,
)
from slipstream_vllm import compat
from slipstream_vllm.failsafe import FaultGuard
from slipstream_vllm.steps import Counts, StepRecorder

logger = logging.getLogger(__name__)

CHANNEL_JOIN_S = 5.0
"""How long shutdown and interpreter exit wait for the channel thread's round to end."""

__all__ = ["OFFLINE_PRIORITY", "SlipstreamScheduler", "SlipstreamSyncScheduler"]

OFFLINE_PRIORITY = 1 << 20
"""Offline requests run at this vLLM priority or below (larger is later); online above it."""
CONTROL_POLL_S = 0.2
STATUS_EVERY_S = 0.5
EMBED_TOKENS = 512
LATENCY_WINDOW = 2048
"""Samples kept per class and metric for the report's mean and p99."""
FALLBACK_EVERY = 64
"""The outliving fallback (the global length distribution) is refreshed every this many
finishes."""
PSM_ORDER_TTL_S = 0.5
"""How long an unchanged PSM queue's order is reused (the fairness rule ages in minutes)."""

_ONLINE = RequestClass.ONLINE
_NO_COUNTS: Counts = (0, 0, 0, 0, 0, 0, 0)
_OFFLINE = RequestClass.OFFLINE
_NO_LENGTHS = np.zeros(0, dtype=np.float64)


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover - vllm always has it
        return ""


def _atomic_write(path: Path, text: str) -> None:
    # Unique per write: two schedulers of one process (a restart in-process) and a
    # heartbeat thread never share a temporary file.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True, slots=True)
class _Config:
    """A control document with everything it needs built (off the scheduling thread)."""

    doc: EngineControl
    planner: TwoPhasePlanner
    ordering: Ordering
    psm: PsmParams


@dataclass(slots=True)
class _Meta:
    """What the plugin keeps per request beside vLLM's ``Request``."""

    cls: RequestClass
    vector: Any = None
    key: float = 0.0
    keyed_at: int = -1
    lengths: Any = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    seen_tokens: int = 0


@dataclass(slots=True)
class _Window:
    """Recent samples of one latency metric (mean and p99 for the report)."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))

    def add(self, v: float) -> None:
        self.values.append(v)

    # The channel thread reads while the scheduling thread appends: tuple() copies the deque
    # in one step under the GIL.
    def mean(self) -> float | None:
        values = tuple(self.values)
        return float(np.mean(values)) if values else None

    def p99(self) -> float | None:
        values = tuple(self.values)
        return float(np.quantile(np.asarray(values), 0.99)) if values else None


class _Cumulative:
    """A cumulative histogram over fixed bounds (the last bucket is +inf)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        self.count = 0

    def add(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> CumulativeHistogram:
        return CumulativeHistogram(
            upper_bounds=self.bounds,
            cumulative_counts=tuple(float(c) for c in itertools.accumulate(self.counts)),
            sum=self.sum,
            count=float(self.count),
        )


class _ClassStats:
    def __init__(self) -> None:
        self.ttft = _Window()
        self.tbt = _Window()
        self.tokens = 0
        self.ttft_hist = _Cumulative(TTFT_BUCKETS_S)
        self.tbt_hist = _Cumulative(TBT_BUCKETS_S)
        self.admitted = 0
        self.finished_ok = 0

    def counts(self) -> ClassCounts:
        return ClassCounts(
            ttft=self.ttft_hist.snapshot(),
            tbt=self.tbt_hist.snapshot(),
            admitted=float(self.admitted),
            finished_ok=float(self.finished_ok),
            output_tokens=float(self.tokens),
        )

    def report(self) -> ClassLatency:
        return ClassLatency(
            ttft_mean_s=self.ttft.mean(),
            ttft_p99_s=self.ttft.p99(),
            tbt_mean_s=self.tbt.mean(),
            tbt_p99_s=self.tbt.p99(),
            samples=len(self.ttft.values),
        )


def _pending(req: Request) -> int:
    """Tokens the request has yet to compute, counting a token in flight (async scheduling)
    as computed, as vLLM's walk does."""
    return int(req.num_tokens + getattr(req, "num_output_placeholders", 0)
               - req.num_computed_tokens)


def _carry_notices(first: SchedulerOutput, second: SchedulerOutput) -> None:
    """Two walks in one step: the second output carries what the first one told the
    workers (requests finished or preempted since the last step, encoder cache frees),
    which vLLM clears after each walk."""
    second.finished_req_ids |= first.finished_req_ids
    if first.preempted_req_ids:
        second.preempted_req_ids = set(second.preempted_req_ids or ()) | first.preempted_req_ids
    second.free_encoder_mm_hashes = [
        *first.free_encoder_mm_hashes,
        *second.free_encoder_mm_hashes,
    ]


class _Slipstream(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler with Slipstream's planner choosing each iteration (module note); the
    two classes vLLM loads (:class:`SlipstreamScheduler`, :class:`SlipstreamSyncScheduler`)
    put it on vLLM's async or synchronous scheduler."""

    # vLLM's attributes this class rearranges around each walk (typed for mypy).
    running: list[Request]
    waiting: Any
    max_num_scheduled_tokens: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        problems = compat.check(self, Request)
        version = _vllm_version()
        if problems:
            raise compat.IncompatibleVllmError(version, problems)
        if not compat.tested(version):
            logger.warning(
                "slipstream: vLLM %s is not among the tested versions (%s); every internal "
                "the plugin uses is present, run the vllm test tier against it",
                version, ", ".join(compat.TESTED_VERSIONS),
            )
        self.async_scheduling = bool(getattr(self.scheduler_config, "async_scheduling", False))
        if isinstance(self, AsyncScheduler) != self.async_scheduling:
            logger.warning(
                "slipstream: %s with async scheduling %s; the matching class is %s",
                type(self).__name__, "on" if self.async_scheduling else "off",
                "SlipstreamScheduler" if self.async_scheduling else "SlipstreamSyncScheduler",
            )
        extra = self.vllm_config.additional_config
        chan = extra.get("slipstream_channel_dir") if isinstance(extra, dict) else None
        chan = chan or os.environ.get("SLIPSTREAM_CHANNEL_DIR")
        self.channel_dir: Path | None = Path(chan) if chan else None
        self.limits = EngineLimits(
            max_num_seqs=self.max_num_running_reqs,
            max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            block_size=self.block_size,
            long_prefill_token_threshold=self.scheduler_config.long_prefill_token_threshold,
            reserve_full_sequence=bool(self.scheduler_reserve_full_isl),
        )
        self._guard = FaultGuard()
        self.clock: Callable[[], float] = time.time
        """The clock of requests' ``arrival_time`` (the tail guard's deadlines); a harness
        stepping vLLM on a virtual clock sets its own."""
        self._meta: dict[str, _Meta] = {}
        self._embedder = HashingEmbedder()
        self._predictor = SemanticHistoryPredictor(self._embedder.dim)
        self._global = GlobalDistributionPredictor()
        self._global_finished = 0
        self._fallback: tuple[int, Any] | None = None
        self._psm = PsmQueue(PsmParams(block_size=self.block_size))
        self._psm_cache: tuple[tuple[int, int, int], float, tuple[str, ...]] | None = None
        self._token: str | None = None
        self._token_stat: tuple[int, int] | None = None
        self._control_stat: tuple[int, int, int] | None = None
        self._pending: _Config | None = None
        """A control document the channel thread read and built, for the next step to take."""
        self._report_now = False
        self._queue_counts = (0, 0, 0, 0)
        """(online waiting, offline waiting, online running, offline running) at the last
        step: the channel thread reports these, never vLLM's queues."""
        self._counted_at = 0.0
        self._channel_stop = threading.Event()
        self.control: EngineControl | None = None
        self.planner: TwoPhasePlanner = build_planner("naive", mode=PlannerMode.ITERATION)
        self.ordering: Ordering = make_ordering("fcfs")
        self.offline_order = "psm"
        self.budget_s: float | None = None
        self.idle_budget_s: float | None = None
        self._budget_in_force: float | None = None
        # Counters and windows for the report.
        self.steps = 0
        self.fallback_steps = 0
        self.fault_steps = 0
        self._stage = "ordering"
        self._walking = False
        self.offline_deferred_chunks = 0
        self.offline_preemptions = 0
        self.online_preemptions = 0
        self.online_displacements = 0
        self.online_displaced_tokens = 0
        self.forged_offline_tags = 0
        self.max_offline_over_budget_s: float | None = None
        self._predicted = _Window()
        self._measured = _Window()
        self._stats = {_ONLINE: _ClassStats(), _OFFLINE: _ClassStats()}
        self._last_plan: StepPlan | None = None
        # (id of a scheduler output, when schedule() returned it, its predicted step time),
        # oldest first: with async scheduling the next step is scheduled before the last
        # one's output arrives.
        self._inflight: deque[tuple[int, float, float | None, Counts]] = deque(maxlen=8)
        self.step_records = StepRecorder()
        """Each step's composition and measured time, for the sidecar to learn from."""
        self._last_output_s = 0.0
        self._last_predicted: float | None = None
        with self._guard.part("control"):
            self._poll_control()
            self._take_config()
        self._channel_thread: threading.Thread | None = None
        if self.channel_dir is not None:
            # The thread holds the scheduler weakly (it ends when the scheduler is collected)
            # and is stopped and joined at interpreter exit: a daemon thread still running
            # when Python finalises is ended by pthread_exit wherever it is, and ending it
            # inside C++ code (numpy's sorts, which release the GIL) aborts the process
            # ("terminate called without an active exception").
            thread = threading.Thread(
                target=_channel_main,
                args=(weakref.ref(self), self._channel_stop),
                name="slipstream-channel",
                daemon=True,
            )
            self._channel_thread = thread
            thread.start()
            atexit.register(_stop_channel, self._channel_stop, thread)

    # ------------------------------------------------------------------ control
    #
    # The channel thread polls ``control.json`` and writes ``status.json``; the scheduling
    # thread only takes a finished configuration (one attribute read per step) and records
    # counts. Nothing here does I/O or parsing on vLLM's scheduling thread while it serves.

    def _channel_tick(self, next_report: float) -> float | None:
        """One round of the channel thread: poll control, flush step records, report when
        due. Returns when the next report is due; None when the channel is gone."""
        if self.channel_dir is None or not self.channel_dir.is_dir():
            return None  # the channel is gone (the pod's emptyDir, a test's folder)
        with self._guard.part("control"):
            self._poll_control()
        if self.step_records.pending():
            with self._guard.part("report"):
                self.step_records.flush(self.channel_dir)
        now = time.monotonic()
        if self._report_now or now >= next_report:
            self._report_now = False
            next_report = now + STATUS_EVERY_S
            with self._guard.part("report"):
                self._write_report(self.report())
        return next_report

    def _take_config(self) -> None:
        cfg = self._pending
        if cfg is not None:
            self._pending = None
            self._install(cfg)

    def _read_token(self) -> None:
        if self.channel_dir is None:
            return
        path = self.channel_dir / OFFLINE_TOKEN_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            self._token, self._token_stat = None, None
            return
        key = (st.st_mtime_ns, st.st_ino)
        if key == self._token_stat:
            return
        token = path.read_text().strip()
        self._token = token or None
        self._token_stat = key

    def _poll_control(self) -> None:
        """Read the token and, if it changed, the control document, and build it for the next
        step (the channel thread; once at start)."""
        if self.channel_dir is None:
            return
        self._read_token()
        path = self.channel_dir / CONTROL_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        key = (st.st_mtime_ns, st.st_ino, st.st_size)
        if key == self._control_stat:
            return
        self._control_stat = key
        try:
            doc = decode_control(path.read_text())
        except (OSError, ControlFormatError) as exc:
            logger.error(
                "slipstream: %s: %s; keeping generation %s",
                path,
                exc,
                self.control.generation if self.control else None,
            )
            return
        cfg = self._build(doc)
        if cfg is not None:
            self._pending = cfg

    def set_offline_token(self, token: str) -> None:
        """Use ``token`` as the pod's secret (in-process use; a pod reads ``offline.token``)."""
        self._token = token
        self._token_stat = (-1, -1)

    def apply(self, doc: EngineControl) -> bool:
        """Apply a control document now if it is newer than the one in force; True if applied
        (in-process use; in a pod the channel thread builds it and the next step takes it)."""
        cfg = self._build(doc)
        if cfg is None:
            return False
        self._install(cfg)
        return True

    def _build(self, doc: EngineControl) -> _Config | None:
        """Everything a control document needs built, or None if it is not newer than the one
        in force (or pending) or does not build."""
        newest = max(
            self.control.generation if self.control is not None else -1,
            self._pending.doc.generation if self._pending is not None else -1,
        )
        if doc.generation <= newest:
            return None
        try:
            model = (
                LinearLatencyModel.from_dict(doc.latency_model)
                if doc.latency_model is not None
                else None
            )
            planner = build_planner(
                doc.policy, doc.policy_params, latency_model=model, mode=PlannerMode.ITERATION
            )
            ordering = make_ordering(doc.ordering, doc.ordering_params or None)
            psm = PsmParams.model_validate({"block_size": self.block_size, **doc.psm_params})
        except Exception as exc:  # a bad document must never take the engine down
            logger.error("slipstream: control generation %s refused: %s", doc.generation, exc)
            return None
        return _Config(doc, planner, ordering, psm)

    def _install(self, cfg: _Config) -> None:
        doc, psm = cfg.doc, cfg.psm
        if self.control is not None and doc.generation <= self.control.generation:
            return
        self.planner, self.ordering = cfg.planner, cfg.ordering
        self.budget_s, self.idle_budget_s = doc.budget_s, doc.idle_budget_s
        if psm != self._psm.params or doc.offline_order != self.offline_order:
            self._rebuild_psm(psm)
        self.offline_order = doc.offline_order
        self.control = doc
        self._guard.reset()
        for meta in self._meta.values():
            meta.keyed_at = -1  # re-key under the new ordering
        logger.info(
            "slipstream: control generation %s applied (policy %s, ordering %s, budget %s)",
            doc.generation,
            doc.policy,
            doc.ordering,
            doc.budget_s,
        )

    def _rebuild_psm(self, params: PsmParams) -> None:
        old = self._psm
        self._psm = PsmQueue(params)
        for req in self._waiting_requests():
            meta = self._meta.get(req.request_id)
            if meta is not None and meta.cls is _OFFLINE and req.request_id in old:
                self._psm.push(req.request_id, req.prompt_token_ids or [], time.monotonic())

    # ------------------------------------------------------------------ requests

    def _classify(self, request: Request) -> RequestClass:
        args = request.sampling_params.extra_args if request.sampling_params else None
        if not args or OFFLINE_TOKEN_ARG not in args:
            return _ONLINE
        tag = args.pop(OFFLINE_TOKEN_ARG)
        if self._token is None:
            self._read_token()
        if isinstance(tag, str) and self._token and hmac.compare_digest(tag, self._token):
            return _OFFLINE
        self.forged_offline_tags += 1
        logger.warning(
            "slipstream: request %s carried an offline tag without the pod's token; "
            "served as online",
            request.request_id,
        )
        return _ONLINE

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:
            guard = self._guard
            cls = _ONLINE  # NOTE: a request the classifier failed on is served as online
            with guard.part("classify"):
                cls = self._classify(request)
            if cls is _OFFLINE:
                request.priority = max(int(request.priority), 0) + OFFLINE_PRIORITY
            else:
                request.priority = min(int(request.priority), OFFLINE_PRIORITY - 1)
            meta = _Meta(cls)
            ids = request.prompt_token_ids or []
            if cls is _ONLINE and not guard.tripped:
                with guard.part("predictor"):
                    meta.vector = self._embedder.embed_one(
                        " ".join(map(str, ids[:EMBED_TOKENS]))
                    )
            self._meta[request.request_id] = meta
            self._stats[cls].admitted += 1
            super().add_request(request)
            if cls is _OFFLINE and self.offline_order == "psm" and not guard.tripped:
                with guard.part("psm"):
                    self._psm.push(request.request_id, ids, time.monotonic())
            return
        super().add_request(request)

    def _class_of(self, request: Request) -> RequestClass:
        meta = self._meta.get(request.request_id)
        return meta.cls if meta is not None else _ONLINE

    def _waiting_requests(self) -> list[Request]:
        return [*self.kv_holding_waiting, *self.waiting]

    # ------------------------------------------------------------------ ordering

    def _online_view(self, req: Request, meta: _Meta) -> RequestView:
        """What the ordering sees of an online request now (its predicted lengths are drawn
        once, on first sight; the outliving fallback is the global distribution)."""
        if meta.lengths is None:
            meta.lengths = self._predict(meta, req.num_prompt_tokens)
        return RequestView(
            req.request_id,
            req.arrival_time,
            req.num_prompt_tokens,
            meta.lengths,
            req.num_output_tokens,
            self._global_fallback(),
            meta.keyed_at,
            int(getattr(req, "num_preemptions", 0)),
        )

    def _predict(self, meta: _Meta, prompt_tokens: int) -> Any:
        """The request's predicted output lengths, sorted; the global distribution when it has
        no embedding or the predictor faults (counted under ``predictor``)."""
        if meta.vector is not None:
            try:
                lengths = self._predictor.predict(meta.vector, prompt_tokens)
                return np.sort(np.asarray(lengths, dtype=np.float64))
            except Exception as exc:
                self._guard.record("predictor", exc)
        return self._global_fallback()

    def _global_fallback(self) -> Any:
        """The global length distribution, sorted, refreshed every ``FALLBACK_EVERY`` finishes."""
        n = self._global_finished
        if self._fallback is None or n - self._fallback[0] >= FALLBACK_EVERY:
            sample = np.asarray(self._global.predict(None, 0), dtype=np.float64)
            self._fallback = (n, np.sort(sample))
        return self._fallback[1]

    def _online_key(self, req: Request, meta: _Meta) -> float:
        """The request's ordering key, recomputed only when the ordering asks (a new request,
        or one that crossed its re-ranking bucket of output tokens)."""
        generated = req.num_output_tokens
        if meta.keyed_at >= 0 and (generated == meta.keyed_at or not self.ordering.refresh_needed(
            RequestView(req.request_id, req.arrival_time, req.num_prompt_tokens, _NO_LENGTHS,
                        generated, _NO_LENGTHS, meta.keyed_at)
        )):
            return meta.key
        meta.key = self.ordering.key(self._online_view(req, meta))
        meta.keyed_at = generated
        return meta.key

    def _rank(self, req: Request, meta: _Meta, now: float) -> tuple[int, float, float]:
        """The request's place in the online order: the ordering's key, and past the tail
        guard's deadline, deadline order ahead of every key (``tailguard.py``)."""
        key = self._online_key(req, meta)
        guard = self.ordering.guard
        if guard is None:
            return unguarded_rank(key, req.arrival_time)
        return guard.rank(key, req.arrival_time, now)

    def _overdue(self, req: Request, now: float) -> bool:
        guard = self.ordering.guard
        return guard is not None and guard.overdue(req.arrival_time, now)

    def _ordered_queues(self, waiting: list[Request]) -> tuple[list[Request], list[Request]]:
        online: list[tuple[tuple[int, float, float], Request]] = []
        offline: list[Request] = []
        now = self.clock()
        for req in waiting:
            meta = self._meta.get(req.request_id)
            if meta is None or meta.cls is _ONLINE:
                if meta is None:
                    meta = self._meta[req.request_id] = _Meta(_ONLINE)
                online.append((self._rank(req, meta, now), req))
            else:
                offline.append(req)
        online.sort(key=lambda t: t[0])
        if self.offline_order == "psm" and offline:
            try:
                offline = self._psm_queue(offline)
            except Exception as exc:  # NOTE: PSM at fault: offline work in vLLM's order
                self._guard.record("psm", exc)
                offline.sort(key=lambda r: (r.priority, r.arrival_time))
        else:
            offline.sort(key=lambda r: (r.priority, r.arrival_time))
        return [t[1] for t in online], offline

    def _psm_queue(self, offline: list[Request]) -> list[Request]:
        by_id = {r.request_id: r for r in offline}
        for r in offline:  # a preempted offline request comes back into the trie
            if r.request_id not in self._psm:
                self._psm.push(r.request_id, r.prompt_token_ids or [], time.monotonic())
        order = self._psm_order(min(self.planner.rules.queue_window, len(self._psm)))
        picked = [by_id[rid] for rid in order if rid in by_id]
        in_order = set(order)
        rest = sorted(
            (r for r in offline if r.request_id not in in_order),
            key=lambda r: (r.priority, r.arrival_time),
        )
        return picked + rest

    def _psm_order(self, n: int) -> tuple[str, ...]:
        """The PSM queue's next ``n`` picks, reused while the queue is unchanged and for at
        most ``PSM_ORDER_TTL_S`` (the fairness rule ages waiting requests in seconds): a walk
        of the trie costs O(picks x prompt blocks), too much for every step of a long queue."""
        now = time.monotonic()
        key = (id(self._psm), self._psm.version, n)
        cached = self._psm_cache
        if cached is not None and cached[0] == key and now - cached[1] < PSM_ORDER_TTL_S:
            return cached[2]
        order = self._psm.peek_order(n, now)
        self._psm_cache = (key, now, order)
        return order

    # ------------------------------------------------------------------ snapshot

    def _cached_tokens(self, req: Request) -> int:
        if req.num_computed_tokens > 0 or not self.cache_config.enable_prefix_caching:
            return int(req.num_computed_tokens)
        try:
            found = self.kv_cache_manager.coordinator.find_longest_cache_hit(
                req.block_hashes, req.num_tokens - 1
            )
            hit: int = found[1]
        except Exception:  # NOTE: a layout this lookup does not cover: assume no hit
            return 0
        return int(hit)

    def _running_view(self, r: Request, cls: RequestClass) -> RunningRequest:
        # With async scheduling a step may be in flight: its tokens are placeholders, already
        # counted in num_computed_tokens but not yet in num_tokens (vLLM's walk adds them back).
        inflight = int(getattr(r, "num_output_placeholders", 0))
        outputs = r.num_output_tokens + inflight
        if outputs >= 1 and r.num_tokens + inflight - r.num_computed_tokens == 1:  # decoding
            return RunningRequest(
                r.request_id,
                cls,
                r.num_prompt_tokens,
                r.num_prompt_tokens,
                outputs - 1,
                r.max_tokens,
                r.arrival_time,
                r.priority,
            )
        return RunningRequest(  # prefilling, or recomputing after a preemption
            r.request_id,
            cls,
            r.num_tokens + inflight,
            r.num_computed_tokens,
            0,
            r.max_tokens,
            r.arrival_time,
            r.priority,
        )

    def _queued_view(self, r: Request, cls: RequestClass) -> QueuedRequest:
        return QueuedRequest(
            r.request_id,
            cls,
            r.num_tokens,
            max(r.max_tokens - r.num_output_tokens, 1),
            r.arrival_time,
            cached_tokens=self._cached_tokens(r),
            already_generated=r.num_output_tokens,
        )

    def _snapshot(self, online_q: list[Request], offline_q: list[Request]) -> Snapshot:
        running = tuple(self._running_view(r, self._class_of(r)) for r in self.running)
        window = self.planner.rules.queue_window
        online = tuple(self._queued_view(r, _ONLINE) for r in online_q[:window])
        offline = tuple(self._queued_view(r, _OFFLINE) for r in offline_q[:window])
        budget = self.budget_s
        if not online and all(q.cls is _OFFLINE for q in running) and self.idle_budget_s:
            budget = None if math.isinf(self.idle_budget_s) else self.idle_budget_s
        self._budget_in_force = budget
        return Snapshot(
            time.time(),
            running,
            online,
            offline,
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            self.limits,
            budget,
        )

    # ------------------------------------------------------------------ the step

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        guard = self._guard
        if self._pending is not None:
            with guard.part("control"):
                self._take_config()
        if guard.tripped:  # repeated faults: vLLM's own policy until a new generation
            return self._vllm_walk(throttle_prefills)
        if self.kv_holding_waiting:  # connector KV loads: not steered, vLLM's walk
            self.fallback_steps += 1
            return self._vllm_walk(throttle_prefills)
        self._walking = False
        try:
            return self._slipstream_step(throttle_prefills)
        except Exception as exc:
            if self._walking:  # vLLM's own walk raised: its fault, as without the plugin
                raise
            guard.record(self._stage, exc)
            self.fault_steps += 1
            return self._vllm_walk(throttle_prefills)

    def _slipstream_step(self, throttle_prefills: bool) -> SchedulerOutput:
        """One step the planner's way (module note). An exception out of here, unless raised
        in vLLM's walk (``self._walking``), leaves vLLM's queues as vLLM keeps them, and the
        step is vLLM's own (``schedule``)."""
        self._stage = "ordering"
        waiting = list(self.waiting)
        online_q, offline_q = self._ordered_queues(waiting)
        self._stage = "planner"
        snap = self._snapshot(online_q, offline_q)
        online_r = sum(1 for q in snap.running if q.cls is _ONLINE)
        self._queue_counts = (len(online_q), len(offline_q), online_r, len(snap.running) - online_r)
        plan = self.planner.plan(snap)
        if online_q and (self.ordering.preemptive or self.ordering.guard is not None):
            self._stage = "ordering"
            if self._displace_for(online_q[0], snap, plan):
                waiting = list(self.waiting)
                online_q, offline_q = self._ordered_queues(waiting)
                self._stage = "planner"
                snap = self._snapshot(online_q, offline_q)
                plan = self.planner.plan(snap)
        self._stage = "steer"
        self.steps += 1
        if not plan.scheduled and not plan.admitted and not plan.preempted:
            if self.planner.rules.offline_step_tokens == 0 and not online_q and not any(
                self._class_of(r) is _ONLINE for r in self.running
            ):
                # A per-step offline cap of 0 holds offline work back on purpose: an empty
                # step, not vLLM's own walk (which would run it all).
                out = self._steer(plan, snap, waiting, throttle_prefills)
                return self._finish_schedule(out, plan)
            if self.running or waiting:
                self.fallback_steps += 1
            return self._own_walk(throttle_prefills)
        out = self._steer(plan, snap, waiting, throttle_prefills)
        if not out.num_scheduled_tokens and (self.running or self.waiting):
            # vLLM refused every piece of the plan (a gate the planner does not model):
            # an empty step would leave the engine spinning with nothing changed, so
            # vLLM's own walk runs this step instead.
            self.fallback_steps += 1
            refused = self._finish_schedule(out, plan)  # counts the walk's own preemptions
            out = self._own_walk(throttle_prefills)
            _carry_notices(refused, out)
            return out
        return self._finish_schedule(out, plan)

    def _own_walk(self, throttle_prefills: bool) -> SchedulerOutput:
        """vLLM's own walk for this step, running online requests ranked by the ordering."""
        with self._ranked_online():
            self._walking = True
            out = super().schedule(throttle_prefills)
            self._walking = False
        return self._finish_schedule(out, None)

    def _vllm_walk(self, throttle_prefills: bool) -> SchedulerOutput:
        """vLLM's own walk with nothing of Slipstream's in it but the bookkeeping, which
        cannot change the output (the report's queue counts are refreshed twice a second)."""
        now = time.monotonic()
        if now - self._counted_at >= STATUS_EVERY_S:
            self._counted_at = now
            with self._guard.part("bookkeeping"):
                self._count_queues()
        out = super().schedule(throttle_prefills)
        return self._finish_schedule(out, None)

    def _count_queues(self) -> None:
        online_w = offline_w = online_r = offline_r = 0
        for r in self._waiting_requests():
            if self._class_of(r) is _OFFLINE:
                offline_w += 1
            else:
                online_w += 1
        for r in self.running:
            if self._class_of(r) is _OFFLINE:
                offline_r += 1
            else:
                online_r += 1
        self._queue_counts = (online_w, offline_w, online_r, offline_r)

    # ------------------------------------------------------------------ online preemption

    def _displace_for(self, head: Request, snap: Snapshot, plan: StepPlan) -> bool:
        """A preemptive ordering's displacement: when the best waiting online request is held
        out by KV blocks or slots (not by this step's tokens), preempt the running online
        requests it outranks (``Ordering.may_preempt``, worst key first) if together they free
        enough for its first chunk; recompute, as vLLM preempts. True if any was preempted."""
        rid = head.request_id
        if any(a.request_id == rid for a in plan.admitted) or not snap.online_queue:
            return False
        q = snap.online_queue[0]
        if q.request_id != rid:
            return False
        bs = self.block_size
        ctx0 = min(q.cached_tokens, q.prompt_tokens - 1)
        limit = self.limits.long_prefill_token_threshold or self.limits.max_num_batched_tokens
        chunk = min(q.prompt_tokens - ctx0, limit, self.limits.max_num_batched_tokens)
        need = -(-(ctx0 + chunk) // bs) - ctx0 // bs
        free = snap.free_kv_blocks
        slot_short = len(self.running) >= self.max_num_running_reqs
        if free >= need and not slot_short:
            return False  # held back by the step's tokens or budget: it runs soon anyway
        meta = self._meta.get(rid)
        now_g = self.clock()
        overdue = self._overdue(head, now_g)
        if meta is None or not (overdue or self.ordering.preemptive):
            return False
        head_key = self._online_key(head, meta)
        ranked = sorted(
            (
                (self._online_key(r, m), r, m)
                for r in self.running
                if (m := self._meta.get(r.request_id)) is not None and m.cls is _ONLINE
                and not self._overdue(r, now_g)
            ),
            key=lambda t: (-t[0], -t[1].arrival_time),
        )
        victims: list[Request] = []
        freed = 0
        for key, r, m in ranked:
            if free + freed >= need and (victims or not slot_short):
                break
            if overdue:  # the guard's displacement: any request not past its own deadline,
                if int(getattr(r, "num_preemptions", 0)) >= GUARD_MAX_DISPLACEMENTS:
                    continue  # at most once each
            elif not self.ordering.may_preempt(head_key, self._online_view(r, m), key):
                continue
            victims.append(r)
            freed += -(-r.num_computed_tokens // bs)
        if not victims or free + freed < need:
            return False
        now = time.monotonic()
        for r in victims:
            self.online_displaced_tokens += int(r.num_computed_tokens)
            self.running.remove(r)
            self._preempt_request(r, now)
            self.online_displacements += 1
        return True

    @contextlib.contextmanager
    def _ranked_online(self, *, plan_fits: bool = False) -> Iterator[None]:
        """For one walk of vLLM's, running online requests carry their rank in the ordering
        as their priority (client priority first, then key, then arrival), so the request
        vLLM preempts when KV runs out (the largest priority) is the ordering's last, and the
        walk gives blocks in rank order. Priorities are restored afterwards.

        ``plan_fits``: the walk's token cap is the plan's own total, so every running request
        gets its tokens in any order; then the ranking matters only if the walk can run out
        of KV blocks, and is skipped when the free blocks cover the most this walk can take
        (a block per request plus the cap's tokens in blocks)."""
        if plan_fits:
            most = (self.max_num_scheduled_tokens // self.block_size + len(self.running)
                    + len(self.waiting) + 1)
            if self.kv_cache_manager.block_pool.get_num_free_blocks() >= most:
                yield
                return
        try:
            now = self.clock()
            online = [
                (int(r.priority), self._rank(r, m, now), r)
                for r in self.running
                if (m := self._meta.get(r.request_id)) is not None and m.cls is _ONLINE
            ]
        except Exception as exc:  # NOTE: the ordering at fault: vLLM's order for this walk
            self._guard.record("ordering", exc)
            online = []
        if len(online) < 2:
            yield
            return
        online.sort(key=lambda t: t[:2])
        saved = [(r, r.priority) for *_, r in online]
        rank_of = {id(r): i for i, (*_, r) in enumerate(online)}
        for i, (*_, r) in enumerate(online):
            r.priority = i
        self.running.sort(key=lambda r: rank_of.get(id(r), len(rank_of)))
        try:
            yield
        finally:
            for r, p in saved:
                r.priority = p

    def _steer(
        self, plan: StepPlan, snap: Snapshot, waiting: list[Request], throttle: bool
    ) -> SchedulerOutput:
        now = time.monotonic()
        by_id = {r.request_id: r for r in self.running}
        for rid in plan.preempted:
            req = by_id.pop(rid, None)
            if req is None:
                continue
            self.running.remove(req)
            self._preempt_request(req, now)
            self.offline_preemptions += 1
        waiting_by_id = {r.request_id: r for r in self.waiting}
        admitted = [
            waiting_by_id[a.request_id] for a in plan.admitted if a.request_id in waiting_by_id
        ]
        online_admit = any(self._class_of(r) is _ONLINE for r in admitted)
        planned = {a.request_id: a.tokens for a in plan.scheduled}
        cap = sum(planned.values()) + sum(a.tokens for a in plan.admitted)
        online_run: list[Request] = []
        off_decode: list[Request] = []
        off_prefill: list[Request] = []
        hidden: list[Request] = []
        for req in self.running:
            if self._class_of(req) is _ONLINE:
                online_run.append(req)
                continue
            n = planned.get(req.request_id)
            if n is None:
                hidden.append(req)
            elif _pending(req) <= 1:
                off_decode.append(req)
            elif online_admit:
                hidden.append(req)
                cap -= n
                self.offline_deferred_chunks += 1
            else:
                off_prefill.append(req)
        queue = FCFSRequestQueue()
        for req in admitted:
            queue.add_request(req)
        admitted_ids = {a.request_id for a in plan.admitted}
        rest = [r for r in waiting if r.request_id not in admitted_ids]
        saved_waiting, saved_cap = self.waiting, self.max_num_scheduled_tokens
        # A lone online request may be planned a chunk past the threshold (the planner lifts
        # it as vLLM does for a request with nobody to starve); vLLM would cut it back as soon
        # as offline work shares the step, so the threshold follows the plan for this walk.
        sc = self.scheduler_config
        saved_threshold = sc.long_prefill_token_threshold
        widest = max(
            (
                a.tokens
                for a in (*plan.scheduled, *plan.admitted)
                if self._is_online_id(a.request_id)
            ),
            default=0,
        )
        # From here to the walk's end vLLM's queues are rearranged; the finally undoes it.
        self.running = online_run + off_decode + off_prefill
        self.waiting = queue
        self.max_num_scheduled_tokens = max(min(cap, saved_cap), 1)
        try:
            if 0 < saved_threshold < widest:
                sc.long_prefill_token_threshold = widest
            with self._ranked_online(plan_fits=True):
                self._walking = True
                out = super().schedule(throttle)
                self._walking = False
        finally:
            # Whatever happened in the walk, vLLM's queues hold every request again.
            left = list(self.waiting)  # admissions not taken, and the walk's own preemptions
            self.waiting = saved_waiting
            self.max_num_scheduled_tokens = saved_cap
            sc.long_prefill_token_threshold = saved_threshold
            self.running.extend(hidden)
            self._rebuild_waiting(left, rest)
        with self._guard.part("psm"):
            for req in out.num_scheduled_tokens:
                self._psm_taken(req)
        return out

    def _is_online_id(self, request_id: str) -> bool:
        meta = self._meta.get(request_id)
        return meta is None or meta.cls is _ONLINE

    def _psm_taken(self, request_id: str) -> None:
        if request_id in self._psm:
            self._psm.take(request_id)

    def _rebuild_waiting(self, left: list[Request], rest: list[Request]) -> None:
        q = create_request_queue(self.policy)
        seen: set[str] = set()
        for req in [*left, *rest, *self.waiting]:
            if req.request_id in seen or req.status == RequestStatus.RUNNING:
                continue
            if req.is_finished():
                continue
            seen.add(req.request_id)
            q.add_request(req)
        self.waiting = q

    def _finish_schedule(self, out: SchedulerOutput, plan: StepPlan | None) -> SchedulerOutput:
        counts: Counts = _NO_COUNTS
        with self._guard.part("bookkeeping"):
            self._note_schedule(out, plan)
            counts = StepRecorder.compose(out.num_scheduled_tokens, self.requests)
        self._inflight.append((id(out), time.monotonic(), self._last_predicted, counts))
        return out

    def _note_schedule(self, out: SchedulerOutput, plan: StepPlan | None) -> None:
        for rid in out.num_scheduled_tokens:
            self._psm_taken(rid)
        for rid in out.preempted_req_ids or ():
            if plan is not None and rid in plan.preempted:
                continue
            meta = self._meta.get(rid)
            if meta is not None and meta.cls is _OFFLINE:
                self.offline_preemptions += 1
            else:
                self.online_preemptions += 1
        self._last_plan = plan
        model = self.planner.model
        self._last_predicted = None
        if plan is not None and model is not None and plan.predicted_step_s > 0:
            self._last_predicted = plan.predicted_step_s
            budget = self._budget_in_force
            if budget is not None and self._ran_offline(out):
                over = plan.predicted_step_s - budget
                cur = self.max_offline_over_budget_s
                self.max_offline_over_budget_s = over if cur is None else max(cur, over)

    def _ran_offline(self, out: SchedulerOutput) -> bool:
        for rid in out.num_scheduled_tokens:
            meta = self._meta.get(rid)
            if meta is not None and meta.cls is _OFFLINE:
                return True
        return False

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        with self._guard.part("bookkeeping"):
            self._time_step(id(scheduler_output))
        # Finished requests leave self.requests inside vLLM's update: look them up first.
        reqs = {
            rid: req
            for rid in scheduler_output.num_scheduled_tokens
            if (req := self.requests.get(rid)) is not None
        }
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        finished = False
        with self._guard.part("bookkeeping"):
            finished = self._note_outputs(reqs, outputs)
        if finished:  # a finish may leave the engine idle: the channel thread reports it next
            if not self.requests:
                self._queue_counts = (0, 0, 0, 0)
            self._report_now = True
        result: dict[int, EngineCoreOutputs] = outputs
        return result

    def _time_step(self, out_id: int) -> None:
        """A step's measured time: from when it could start (its schedule() returned and the
        step before it finished; one step runs at a time) to its output."""
        now = time.monotonic()
        while self._inflight:
            oid, done_s, predicted, counts = self._inflight.popleft()
            if oid != out_id:
                continue  # an output vLLM never delivered (an empty step)
            took = now - max(done_s, self._last_output_s)
            self._measured.add(took)
            self.step_records.record(took, counts)
            if predicted is not None:
                self._predicted.add(predicted)
            break
        self._last_output_s = now

    def _note_outputs(
        self, reqs: dict[str, Request], outputs: dict[int, EngineCoreOutputs]
    ) -> bool:
        """Token times and finishes of one step's outputs; True if a request finished."""
        now = time.time()
        for req in reqs.values():
            meta = self._meta.get(req.request_id)
            if meta is not None:
                self._note_tokens(req, meta, now)
        finished = False
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    finished = True
                    ok = getattr(o.finish_reason, "name", "") in ("STOP", "LENGTH")
                    self._finished(o.request_id, reqs, ok=ok)
        if len(self._meta) > 2 * len(self.requests) + 256:
            self._meta = {k: v for k, v in self._meta.items() if k in self.requests}
        return finished

    def _note_tokens(self, req: Request, meta: _Meta, now: float) -> None:
        n = req.num_output_tokens
        if n <= meta.seen_tokens:
            return
        stats = self._stats[meta.cls]
        stats.tokens += n - meta.seen_tokens
        if meta.first_token_s is None:
            meta.first_token_s = now
            ttft = max(now - req.arrival_time, 0.0)
            stats.ttft.add(ttft)
            stats.ttft_hist.add(ttft)
        elif meta.last_token_s is not None:
            tbt = (now - meta.last_token_s) / (n - meta.seen_tokens)
            stats.tbt.add(tbt)
            stats.tbt_hist.add(tbt)
        meta.last_token_s = now
        meta.seen_tokens = n

    def _finished(self, request_id: str, reqs: dict[str, Request], *, ok: bool) -> None:
        meta = self._meta.pop(request_id, None)
        with self._guard.part("psm"):
            if request_id in self._psm:
                self._psm.remove(request_id)
        if meta is None or meta.seen_tokens <= 0:
            return
        if ok:
            self._stats[meta.cls].finished_ok += 1
        req = reqs.get(request_id)
        inp = req.num_prompt_tokens if req is not None else 0
        if meta.vector is not None:
            with self._guard.part("predictor"):
                self._predictor.observe(meta.vector, inp, meta.seen_tokens)
        self._global.observe(None, inp, meta.seen_tokens)
        self._global_finished += 1

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> Any:
        ids = (
            [request_ids]
            if isinstance(request_ids, str)
            else (list(request_ids) if request_ids is not None else list(self.requests))
        )
        out = super().finish_requests(ids, finished_status)
        with self._guard.part("psm"):
            for rid in ids:
                if rid in self._psm:
                    self._psm.remove(rid)
        for rid in ids:
            self._meta.pop(rid, None)
        return out

    # ------------------------------------------------------------------ report

    def report(self) -> EngineReport:
        """The plugin's state; safe on any thread (it reads counters and copies of the
        windows, never vLLM's queues)."""
        online_w, offline_w, online_r, offline_r = self._queue_counts
        c = self.control
        return EngineReport(
            generation=c.generation if c is not None else -1,
            policy=self.planner.name,
            ordering=c.ordering if c is not None else "fcfs",
            budget_s=self._budget_in_force,
            written_at=time.time(),
            pid=os.getpid(),
            vllm_version=_vllm_version(),
            async_scheduling=self.async_scheduling,
            online_waiting=online_w,
            offline_waiting=offline_w,
            online_running=online_r,
            offline_running=offline_r,
            steps=self.steps,
            fallback_steps=self.fallback_steps,
            offline_deferred_chunks=self.offline_deferred_chunks,
            predicted_step_s=self._predicted.mean(),
            measured_step_s=self._measured.mean(),
            max_offline_over_budget_s=self.max_offline_over_budget_s,
            offline_preemptions=self.offline_preemptions,
            online_preemptions=self.online_preemptions,
            online_displacements=self.online_displacements,
            online_displaced_tokens=self.online_displaced_tokens,
            forged_offline_tags=self.forged_offline_tags,
            faults={k: v for k, v in self._guard.counts.items() if v},
            fault_steps=self.fault_steps,
            failsafe=self._guard.tripped_reason,
            online=self._stats[_ONLINE].report(),
            offline=self._stats[_OFFLINE].report(),
            online_tokens=self._stats[_ONLINE].tokens,
            offline_tokens=self._stats[_OFFLINE].tokens,
            online_counts=self._stats[_ONLINE].counts(),
            offline_counts=self._stats[_OFFLINE].counts(),
        )

    def _write_report(self, rep: EngineReport) -> None:
        if self.channel_dir is None:
            return
        try:
            _atomic_write(self.channel_dir / STATUS_FILE, rep.model_dump_json())
        except OSError as exc:
            if self.channel_dir.is_dir():  # a folder removed meanwhile is no fault here
                logger.warning("slipstream: cannot write %s: %s", STATUS_FILE, exc)

    def shutdown(self) -> None:
        thread = self._channel_thread
        _stop_channel(self._channel_stop, thread)
        with self._guard.part("report"):
            self._write_report(self.report())
        super().shutdown()


def _channel_main(ref: weakref.ReferenceType[_Slipstream], stop: threading.Event) -> None:
    """The channel thread: a tick every ``CONTROL_POLL_S`` until stopped, the channel is
    gone, or the scheduler is collected."""
    next_report = 0.0
    while not stop.wait(CONTROL_POLL_S):
        sched = ref()
        if sched is None:
            return
        due = sched._channel_tick(next_report)
        del sched
        if due is None:
            return
        next_report = due


def _stop_channel(stop: threading.Event, thread: threading.Thread | None) -> None:
    """Stop the channel thread and wait for its round to end (not from the thread itself)."""
    stop.set()
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join(timeout=CHANNEL_JOIN_S)


class SlipstreamScheduler(_Slipstream, AsyncScheduler):  # type: ignore[misc]
    """The plugin on vLLM's ``AsyncScheduler``, vLLM's default: the next step is scheduled
    while the last one runs (``--scheduler-cls slipstream_vllm.scheduler.SlipstreamScheduler``)."""


class SlipstreamSyncScheduler(_Slipstream):
    """The plugin on vLLM's synchronous ``Scheduler``, for vLLM started with
    ``--no-async-scheduling``."""


def write_control(channel_dir: Path, doc: EngineControl) -> None:
    """Write ``control.json`` atomically (for tools and tests; the sidecar has its own writer)."""
    _atomic_write(channel_dir / CONTROL_FILE, doc.encode())


def read_report(channel_dir: Path) -> EngineReport | None:
    try:
        return EngineReport.model_validate(json.loads((channel_dir / STATUS_FILE).read_text()))
    except (FileNotFoundError, ValueError):
        return None
