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

Where the code lives (the way vLLM splits ``vllm/v1/core/sched/``): this module keeps the
entry points vLLM calls (``__init__``, ``add_request``, ``schedule``, ``update_from_output``,
``finish_requests``, ``shutdown``) and the two classes vLLM loads; the rest are mixins of
:class:`_Slipstream`, one concern each:

* :mod:`slipstream_vllm.channel`: the control channel (``control.json``, the offline token,
  ``status.json``, the channel thread) and installing a control document;
* :mod:`slipstream_vllm.ordering`: classes (offline only with the pod's token), the online
  ordering and its length predictor, the offline PSM order;
* :mod:`slipstream_vllm.snapshot`: the planner's view of vLLM's state;
* :mod:`slipstream_vllm.steering`: vLLM's walk steered to the plan, online displacement, and
  the approximations where this bends the plan;
* :mod:`slipstream_vllm.online_only`: the steps whose plan is vLLM's own walk, taken without
  a snapshot or a plan;
* :mod:`slipstream_vllm.stats`: each step's and output's bookkeeping, latency windows and
  histograms, the ``EngineReport``;
* :mod:`slipstream_vllm.state`: the per-request record and the attributes the parts share.

The names tools and tests import from here (:func:`write_control`, :func:`read_report`,
:data:`CONTROL_POLL_S`, :data:`STATUS_EVERY_S`, ``STATUS_FILE``, ...) are re-exported.

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
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.enginecontrol import STATUS_FILE, EngineControl
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    SemanticHistoryPredictor,
)
from slipstream_scheduler.ordering import GlobalFallback, Ordering, make_ordering
from slipstream_scheduler.planner import PlannerMode, TwoPhasePlanner
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_scheduler.types import EngineLimits, StepPlan
from slipstream_vllm import compat
from slipstream_vllm.channel import (
    CHANNEL_JOIN_S,
    CONTROL_POLL_S,
    STATUS_EVERY_S,
    ChannelMixin,
    _channel_main,
    _Config,
    _stop_channel,
    read_report,
    write_control,
)
from slipstream_vllm.failsafe import FaultGuard
from slipstream_vllm.online_only import OnlineOnlyMixin
from slipstream_vllm.ordering import PSM_ORDER_TTL_S, OrderingMixin
from slipstream_vllm.snapshot import SnapshotMixin
from slipstream_vllm.state import _OFFLINE, _ONLINE, _Meta
from slipstream_vllm.stats import LATENCY_WINDOW, StatsMixin, _ClassStats, _vllm_version, _Window
from slipstream_vllm.steering import SteeringMixin
from slipstream_vllm.steps import Counts, StepRecorder

logger = logging.getLogger(__name__)

# With the plugin's public names, those tools and tests import from here (defined in the
# modules the plugin is split into).
__all__ = [
    "CHANNEL_JOIN_S",
    "CONTROL_POLL_S",
    "EMBED_TOKENS",
    "LATENCY_WINDOW",
    "OFFLINE_PRIORITY",
    "PSM_ORDER_TTL_S",
    "STATUS_EVERY_S",
    "STATUS_FILE",
    "SlipstreamScheduler",
    "SlipstreamSyncScheduler",
    "read_report",
    "write_control",
]

OFFLINE_PRIORITY = 1 << 20
"""Offline requests run at this vLLM priority or below (larger is later); online above it."""
EMBED_TOKENS = 512


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


class _Slipstream(
    ChannelMixin, OrderingMixin, SnapshotMixin, SteeringMixin, OnlineOnlyMixin, StatsMixin,
    Scheduler,  # type: ignore[misc]
):
    """vLLM's scheduler with Slipstream's planner choosing each iteration (module note); the
    two classes vLLM loads (:class:`SlipstreamScheduler`, :class:`SlipstreamSyncScheduler`)
    put it on vLLM's async or synchronous scheduler. Its parts are mixins (the modules listed
    in the module note); vLLM's scheduler comes after all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's scheduler, then every attribute :class:`~slipstream_vllm.state._State`
        declares, each set (and described) in the part below for its concern, in this order;
        then the first control document, and the channel thread."""
        super().__init__(*args, **kwargs)
        self._check_vllm()
        self._read_engine_config()
        self._guard = FaultGuard()
        self.clock: Callable[[], float] = time.time
        """The clock of requests' ``arrival_time`` (the tail guard's deadlines); a harness
        stepping vLLM on a virtual clock sets its own."""
        self._init_ordering_state()
        self._init_channel_state()
        self._init_planner_state()
        self._init_report_state()
        with self._guard.part("control"):
            self._poll_control()
            self._take_config()
        self._start_channel_thread()

    # ------------------------------------------------------------------ start-up

    def _check_vllm(self) -> None:
        """The start-up check (:mod:`slipstream_vllm.compat`): refuses a vLLM missing an
        internal the plugin uses; warns for a version outside the tested ones."""
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

    def _read_engine_config(self) -> None:
        """What the plugin reads of vLLM's configuration: async scheduling (warned about when
        it does not match the class), the channel directory, the engine's limits."""
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

    def _init_ordering_state(self) -> None:
        """The per-request records, the online ordering's length predictors and the offline
        PSM order (:mod:`slipstream_vllm.ordering`)."""
        self._meta: dict[str, _Meta] = {}
        self._offline_ids: set[str] = set()
        """Offline requests vLLM may still hold (ids are dropped when they finish or are
        aborted; one vLLM no longer holds is found and the set cleared by
        :meth:`_online_only`)."""
        self._embedder = HashingEmbedder()
        self._predictor = SemanticHistoryPredictor(self._embedder.dim)
        self._global = GlobalDistributionPredictor()
        self._fallback = GlobalFallback(self._global)
        self._psm = PsmQueue(PsmParams(block_size=self.block_size))
        self._psm_cache: tuple[tuple[int, int, int], float, tuple[str, ...]] | None = None

    def _init_channel_state(self) -> None:
        """The control channel's state (:mod:`slipstream_vllm.channel`)."""
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

    def _init_planner_state(self) -> None:
        """What a control document sets, at its defaults until the first one is taken: the
        planner, the online ordering, the offline order, the budgets."""
        self.control: EngineControl | None = None
        self.planner: TwoPhasePlanner = build_planner("naive", mode=PlannerMode.ITERATION)
        self.ordering: Ordering = make_ordering("fcfs")
        self.offline_order = "psm"
        self.budget_s: float | None = None
        self.idle_budget_s: float | None = None
        self._budget_in_force: float | None = None

    def _init_report_state(self) -> None:
        """The steps' bookkeeping (:mod:`slipstream_vllm.stats`)."""
        # Counters and windows for the report.
        self.steps = 0
        self.fallback_steps = 0
        self.fault_steps = 0
        self.online_only_steps = 0
        self.online_only_path = True
        """Steps with no offline request in the engine and KV and slots to spare go straight
        to vLLM's walk (:meth:`_online_only_step`); off, every step is planned."""
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
        self._prev_tokens: frozenset[str] = frozenset()
        """The requests with a token in the last step's outputs, which came out at
        ``_prev_tokens_s`` (:meth:`~slipstream_vllm.stats.StatsMixin._note_tokens`)."""
        self._prev_tokens_s = 0.0
        self._prev_token_ids: list[str] = []
        """``_prev_tokens`` in the outputs' order."""

    def _start_channel_thread(self) -> None:
        """The channel thread (:func:`~slipstream_vllm.channel._channel_main`), when there is
        a channel directory."""
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

    # ------------------------------------------------------------------ requests

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
            meta = _Meta(cls, request=request)
            ids = request.prompt_token_ids or []
            if cls is _ONLINE and not guard.tripped:
                with guard.part("predictor"):
                    meta.vector = self._embedder.embed_ids(ids[:EMBED_TOKENS])
            self._meta[request.request_id] = meta
            if cls is _OFFLINE:
                self._offline_ids.add(request.request_id)
            self._stats[cls].admitted += 1
            super().add_request(request)
            if cls is _OFFLINE and self.offline_order == "psm" and not guard.tripped:
                with guard.part("psm"):
                    self._psm.push(request.request_id, ids, time.monotonic())
            return
        super().add_request(request)

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
            self._stage = "steer"
            if self.online_only_path and self._online_only():
                return self._online_only_step(throttle_prefills)
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

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        with self._guard.part("bookkeeping"):
            self._time_step(id(scheduler_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        finished = False
        with self._guard.part("bookkeeping"):
            finished = self._note_outputs(outputs)
        if finished:  # a finish may leave the engine idle: the channel thread reports it next
            if not self.requests:
                self._queue_counts = (0, 0, 0, 0)
            self._report_now = True
        result: dict[int, EngineCoreOutputs] = outputs
        return result

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
            self._offline_ids.discard(rid)
        return out

    def shutdown(self) -> None:
        thread = self._channel_thread
        _stop_channel(self._channel_stop, thread)
        with self._guard.part("report"):
            self._write_report(self.report())
        super().shutdown()


class SlipstreamScheduler(_Slipstream, AsyncScheduler):  # type: ignore[misc]
    """The plugin on vLLM's ``AsyncScheduler``, vLLM's default: the next step is scheduled
    while the last one runs (``--scheduler-cls slipstream_vllm.scheduler.SlipstreamScheduler``)."""


class SlipstreamSyncScheduler(_Slipstream):
    """The plugin on vLLM's synchronous ``Scheduler``, for vLLM started with
    ``--no-async-scheduling``."""
