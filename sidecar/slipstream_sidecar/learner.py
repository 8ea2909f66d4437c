"""Learning the pod's latency model from its own engine (engine mode).

The plugin inside vLLM writes every step it ran (composition and measured time) as JSON-lines
segments under ``steps/`` in the channel directory (``slipstream_vllm.steps``).
:class:`EngineLearner` reads the segments it has not read yet, feeds the records to the
core's :class:`~slipstream_scheduler.learning.StepLearner`, and, when a fit is due, fits
and validates it in a worker thread (tens of milliseconds for a few thousand rows), so the
event loop never waits on numpy. The model in force is :attr:`EngineLearner.learned`;
the sidecar reports it to the operator (``StatusResponse.learned_model``) and in
``/metrics`` (``slipstream_learned_*``).

The sidecar does not put a learned model in force itself: the operator decides which model
the budget search and the plugin use (a shipped or profiled one first), and sends it back
through ``Configure``.

Deliberately left out: learning in sidecar mode from token gaps (a step there cannot be
attributed to a batch composition the sidecar sees; ``slipstream profile engine`` profiles
such an engine through its API instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from slipstream_scheduler.enginecontrol import STEPS_DIR
from slipstream_scheduler.latency import LatencyModelMeta
from slipstream_scheduler.learning import (
    FitOutcome,
    Learned,
    LearnParams,
    StepLearner,
    StepRecord,
    read_records,
)

log = logging.getLogger(__name__)

__all__ = ["EngineLearner", "LearnerCollector", "LearnerSnapshot", "SegmentReader"]

POLL_S = 1.0
"""How often the step folder is read (seconds)."""


class SegmentReader:
    """The segments of ``<channel>/steps/`` not read yet, oldest first."""

    def __init__(self, channel_dir: Path) -> None:
        self.folder = channel_dir / STEPS_DIR
        self._read: set[str] = set()
        self.bad_lines = 0

    def read_new(self) -> list[StepRecord]:
        try:
            names = sorted(p.name for p in self.folder.iterdir() if p.suffix == ".jsonl")
        except FileNotFoundError:
            return []
        fresh = [n for n in names if n not in self._read]
        self._read.intersection_update(names)  # forget what the plugin pruned
        out: list[StepRecord] = []
        for name in fresh:
            try:
                text = (self.folder / name).read_text()
            except FileNotFoundError:
                continue  # pruned between the listing and the read
            recs, errors = read_records(text.splitlines())
            for err in errors[:3]:
                log.warning("steps/%s: %s", name, err)
            self.bad_lines += len(errors)
            out.extend(recs)
            self._read.add(name)
        return out


@dataclass(frozen=True, slots=True)
class LearnerSnapshot:
    """What the learner has done, for status and metrics."""

    seen: int
    reservoir: int
    regimes: dict[str, int]
    fits: int
    rejected: int
    last: FitOutcome | None
    learned: Learned | None


class EngineLearner:
    """Reads the plugin's step records and keeps a validated model (see the module docstring)."""

    def __init__(self, channel_dir: Path, *, params: LearnParams | None = None,
                 meta: LatencyModelMeta | None = None, poll_s: float = POLL_S) -> None:
        self.reader = SegmentReader(channel_dir)
        self.learner = StepLearner(params or LearnParams(),
                                   meta or LatencyModelMeta(source="learned from engine steps"))
        self.poll_s = poll_s
        self.fits = 0
        self.last: FitOutcome | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def learned(self) -> Learned | None:
        return self.learner.current

    def snapshot(self) -> LearnerSnapshot:
        lr = self.learner
        return LearnerSnapshot(lr.seen, len(lr.reservoir), lr.reservoir.regimes(), self.fits,
                               lr.rejected, self.last, lr.current)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def step(self) -> FitOutcome | None:
        """Read new records and fit if due (one round of the loop)."""
        recs = await asyncio.to_thread(self.reader.read_new)
        self.learner.extend(recs)
        if not self.learner.due():
            return None
        outcome = await asyncio.to_thread(self.learner.refit, time.time())
        self.fits += 1
        self.last = outcome
        cur = self.learner.current
        if outcome.accepted and cur is not None:
            log.info("latency model learned (revision %d, %s): %d steps, held-out MAPE %.2f%%, "
                     "features %s", cur.revision, outcome.reason, cur.fit_steps,
                     100 * cur.heldout_mape, cur.model.feature_set.value)
        elif not outcome.accepted and outcome.reason != "same":
            log.info("latency fit not used (%s): %s", outcome.reason, outcome.message)
        return outcome

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # a bad fit must never stop the sidecar
                log.exception("learning from engine steps failed; retrying")
            await asyncio.sleep(self.poll_s)


class LearnerCollector(Collector):
    """The learner's state as ``slipstream_learned_*`` gauges, read per scrape."""

    def __init__(self, learner: EngineLearner) -> None:
        self.learner = learner

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.learner.snapshot()

        def g(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"slipstream_learned_{name}", doc, value=value)

        yield g("steps_seen", "Engine steps recorded by the plugin and read by the sidecar.",
                float(s.seen))
        regimes = GaugeMetricFamily("slipstream_learned_reservoir_steps",
                                    "Steps kept to fit on, per regime.", labels=["regime"])
        for regime in ("prefill", "decode", "mixed"):
            regimes.add_metric([regime], float(s.regimes.get(regime, 0)))
        yield regimes
        yield g("fits", "Fits tried since the sidecar started.", float(s.fits))
        yield g("fits_rejected", "Fits not used (failed validation on held-out steps).",
                float(s.rejected))
        if s.last is not None and s.last.heldout_mape is not None:
            yield g("last_fit_heldout_mape", "Held-out error (fraction) of the last fit tried, "
                    "used or not.", s.last.heldout_mape)
        if s.learned is not None:
            yield g("revision", "Revision of the learned model (increases with each accepted "
                    "refit).", float(s.learned.revision))
            yield g("heldout_mape", "Mean absolute percentage error (fraction) of the learned "
                    "model on recent held-out steps.", s.learned.heldout_mape)
            yield g("fit_steps", "Steps the learned model was fitted on.",
                    float(s.learned.fit_steps))
