"""Budget searches off the event loop, cached by (model, GPU, SLOs, load bucket).

:class:`BudgetSearches` hands the reconciler a :data:`BudgetSearch` per
:class:`SearchSubject` (a service's latency model, (model, GPU), engine limits,
calibration scale and enforcement mode). Called with (targets, load) it

* answers from its LRU cache when this (model, GPU, profile, scale, limits, mode,
  SLO targets, load bucket) was searched before: a steady service never
  searches twice;
* otherwise starts a :class:`~slipstream_operator.simsearch.SimulatedSearch` on
  its executor (one worker process by default, so searches run one at a time,
  never on the kopf event loop and never holding its GIL; ``worker: thread``
  runs them in a thread of the operator) and answers the analytic search's result
  marked *provisional*, which the budget policy replaces with the simulated
  result on a later reconcile once the worker has finished;
* answers the analytic search (not provisional) where simulation is not
  possible: disabled or no SLO target; and caches it with a note when the
  simulated search failed. A (model, GPU) without an engine-model GPU profile is
  simulated with the model in force timing the steps
  (:func:`~slipstream_operator.simsearch.simulated_engine`).

The worker's wall time is bounded by ``SimSearchParams.max_wall_s`` inside the
search (between trials); a thread cannot be killed, so a trial in progress
finishes (each is bounded by the sample's virtual horizon and ``max_steps``).

The worker process exits by itself within a second of the operator's death
(``_exit_with_parent``): an operator killed with SIGKILL cannot shut its pool
down, and a spawned worker would otherwise wait on its queue for ever.

Deliberately left out: persistence across operator restarts (a restarted
operator searches again, answering analytically meanwhile) and searching the
idle budget.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import (
    BrokenExecutor,
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from dataclasses import dataclass, field, replace
from typing import Literal

from slipstream_operator.budgets import (
    AnalyticSearch,
    BudgetSearch,
    LoadStats,
    SearchResult,
    SLOTargets,
)
from slipstream_operator.calibration import scaled
from slipstream_operator.simsearch import (
    SimSearchParams,
    SimulatedSearch,
    bucket_load,
    simulated_engine,
)
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.types import EngineLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SearchSubject:
    """What a budget is searched for: one service's latency model, engine, calibration and
    mode (where the budget is enforced: the sidecar in front of vLLM, or the plugin in it)."""

    model_name: str  # spec.model, e.g. meta-llama/Llama-2-7b-hf
    gpu: str  # spec.engine.gpuType, e.g. h100
    # Where the latency model came from, e.g. shipped:latency_x_h100.json, or a learned
    # model's pod and revision (learned:chat-0 r3): a new revision is a new search.
    profile: str
    model: LinearLatencyModel = field(compare=False)  # the model in force, uncalibrated
    scale: float = 1.0  # calibration factor in force
    limits: EngineLimits = field(default_factory=EngineLimits)
    mode: Literal["sidecar", "in-engine"] = "sidecar"  # SimConfig.mode of the trials
    # Where no GPU profile of (model_name, gpu) ships, the model in force times the simulated
    # steps, with this spread (its held-out error; None: SimSearchParams.timing_cv).
    timing_cv: float | None = None
    # The engine's KV blocks, of limits.block_size tokens (the pods' engines, else
    # --num-gpu-blocks-override; None: a GPU profile's memory sizing, else
    # SimSearchParams.kv_tokens).
    kv_blocks: int | None = None

    @property
    def calibrated(self) -> LinearLatencyModel:
        return scaled(self.model, self.scale)

    @property
    def key(self) -> tuple[Hashable, ...]:
        cv = None if self.timing_cv is None else round(self.timing_cv, 6)
        return (self.model_name, self.gpu.lower(), self.profile, round(self.scale, 6), self.limits,
                self.mode, cv, self.kv_blocks)


class BudgetSearches:
    """The operator's budget searches: simulated in the background, analytic meanwhile."""

    def __init__(self, params: SimSearchParams, executor: Executor | None = None) -> None:
        self.params = params
        self._executor = executor
        self._own_executor = executor is None
        self._cache: OrderedDict[tuple[Hashable, ...], SearchResult] = OrderedDict()
        self._running: dict[tuple[Hashable, ...], Future[SearchResult]] = {}
        self.searches_started = 0
        self.searches_superseded = 0

    def search_for(self, subject: SearchSubject) -> BudgetSearch:
        """The search the reconciler calls for ``subject``."""

        def search(targets: SLOTargets, load: LoadStats) -> SearchResult:
            return self._search(subject, targets, load)

        return search

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the searches in progress; True when none is left."""
        pending = list(self._running.values())
        if not pending:
            return True
        _, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    def close(self) -> None:
        """Stop the worker (a search in progress finishes first)."""
        if self._executor is not None and self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # ------------------------------------------------------------------ internals

    def _search(self, subject: SearchSubject, targets: SLOTargets, load: LoadStats) -> SearchResult:
        analytic = AnalyticSearch(subject.calibrated, subject.limits)
        if not self.params.enabled or not targets.items():
            return analytic(targets, load)
        sample = bucket_load(load, self.params.bucket_ratio, self.params.min_rate_rps)
        key = (*subject.key, targets, sample)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        running = self._running.get(key)
        if running is None:
            self._drop_superseded(key, (*subject.key, targets))
            engine, timed_by_model = simulated_engine(
                subject.model_name, subject.gpu, subject.limits, self.params,
                kv_blocks=subject.kv_blocks, timing_cv=subject.timing_cv,
            )
            job = SimulatedSearch(subject.model, engine, self.params, subject.scale,
                                  mode=subject.mode, timed_by_model=timed_by_model)
            running = self._submit(job, targets, sample)
            self._running[key] = running
            self.searches_started += 1
            logger.info(
                "simulated budget search queued for %s on %s at %.3g rps, prompt %.0f, "
                "output %.0f tokens, KV cache %s blocks of %d tokens%s",
                subject.model_name,
                subject.gpu,
                sample.arrival_rate_rps,
                sample.mean_prompt_tokens,
                sample.mean_output_tokens,
                engine.num_gpu_blocks or "GPU-memory-sized",
                engine.block_size,
                ", steps timed by the latency model (no GPU profile)" if timed_by_model else "",
            )
        if running.done():
            del self._running[key]
            try:
                result = running.result()
            except Exception as exc:  # any failure: the analytic answer stands
                logger.warning(
                    "simulated budget search for %s on %s failed: %s",
                    subject.model_name,
                    subject.gpu,
                    exc,
                )
                result = replace(
                    analytic(targets, load),
                    note=f"simulation failed: {type(exc).__name__}: {exc}"[:200],
                )
            self._store(key, result)
            return result
        return replace(analytic(targets, load), provisional=True, note="simulated search running")

    def _drop_superseded(self, key: tuple[Hashable, ...], owner: tuple[Hashable, ...]) -> None:
        """Cancel queued (not started) searches of ``owner`` for other load buckets.

        A service whose load ramps up moves through several buckets in a few reconciles;
        only the newest is worth searching. A search already running finishes and is cached.
        """
        width = len(owner)
        for other, future in list(self._running.items()):
            if other != key and other[:width] == owner and future.cancel():
                del self._running[other]
                self.searches_superseded += 1

    def _submit(
        self, job: SimulatedSearch, targets: SLOTargets, load: LoadStats
    ) -> Future[SearchResult]:
        if self._executor is None:
            self._executor = self._new_executor()
        try:
            return self._executor.submit(job, targets, load)
        except (BrokenExecutor, RuntimeError) as exc:  # a worker process died, or shut down
            if not self._own_executor:
                raise
            logger.warning("budget search worker unusable (%s); starting a new one", exc)
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            return self._executor.submit(job, targets, load)

    def _new_executor(self) -> Executor:
        """One worker: a child process (spawned, not forked from a loop with threads) unless
        the params ask for a thread."""
        if self.params.worker == "thread":
            return ThreadPoolExecutor(max_workers=1, thread_name_prefix="budget-search")
        return ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_exit_with_parent,
        )

    def _store(self, key: tuple[Hashable, ...], result: SearchResult) -> None:
        self._cache[key] = result
        self._cache.move_to_end(key)
        while len(self._cache) > self.params.cache_entries:
            self._cache.popitem(last=False)


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """In the worker: exit as soon as the process that started it is gone (it is then
    re-parented, so ``getppid`` changes). Polling rather than ``PR_SET_PDEATHSIG``,
    which fires when the *thread* that started the worker ends, not the process."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


SearchFactory = Callable[[SearchSubject], BudgetSearch]
"""What the reconciler gets: a search per subject."""
