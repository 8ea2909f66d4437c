"""The sidecar's end of the in-pod channel to Slipstream's vLLM scheduler plugin (engine mode).

The schema lives in :mod:`slipstream_scheduler.enginecontrol`; this module is the file I/O:

* :meth:`EngineChannel.token` is the pod's offline secret, created once in ``offline.token``
  (mode 0600, exclusive create, so two racing writers agree on one) and reused when present;
* :meth:`EngineChannel.write` replaces ``control.json`` atomically (a temporary file in the
  same directory, flushed, then ``os.replace``), so the plugin never reads half a document;
* :meth:`EngineChannel.report` reads the plugin's ``status.json`` (None when absent,
  unreadable, or older than ``stale_after_s``).

:class:`EngineReportCollector` serves the report in the sidecar's ``/metrics`` as
``slipstream_engine_*`` gauges, read from ``status.json`` at every scrape.

Deliberately left out: any polling loop (callers read the report when they need it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from slipstream_scheduler.enginecontrol import (
    CONTROL_FILE,
    OFFLINE_TOKEN_ARG,
    OFFLINE_TOKEN_FILE,
    STATUS_FILE,
    ControlFormatError,
    EngineControl,
    EngineReport,
    decode_control,
    decode_report,
)
from slipstream_scheduler.ordering import ORDERINGS

log = logging.getLogger(__name__)

__all__ = ["STALE_AFTER_S", "EngineChannel", "EngineReportCollector", "control_document"]

STALE_AFTER_S = 10.0
"""A status document older than this (seconds, by its ``written_at``) is not reported."""


class EngineChannel:
    """``control.json``, ``status.json`` and ``offline.token`` in one shared directory."""

    def __init__(
        self,
        directory: Path,
        *,
        stale_after_s: float = STALE_AFTER_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._stale_after_s = stale_after_s
        self.clock = clock
        self.token = self._ensure_token()

    @property
    def control_path(self) -> Path:
        return self.directory / CONTROL_FILE

    @property
    def status_path(self) -> Path:
        return self.directory / STATUS_FILE

    @property
    def token_path(self) -> Path:
        return self.directory / OFFLINE_TOKEN_FILE

    def _ensure_token(self) -> str:
        path = self.token_path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            token = path.read_text().strip()
            if token:
                return token
            # An empty file (a writer died between create and write): replace it whole.
            token = secrets.token_hex(32)
            self._atomic_write(path, token + "\n", mode=0o600)
            return token
        token = secrets.token_hex(32)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        return token

    def offline_xargs(self) -> dict[str, str]:
        """What an offline request's ``vllm_xargs`` must carry."""
        return {OFFLINE_TOKEN_ARG: self.token}

    def _atomic_write(self, path: Path, text: str, *, mode: int = 0o644) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def read_control(self) -> EngineControl | None:
        """The control document on disk, or None when absent or unreadable."""
        try:
            return decode_control(self.control_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ControlFormatError) as exc:
            log.warning("engine channel: unreadable %s: %s", self.control_path, exc)
            return None

    def write(self, control: EngineControl) -> None:
        """Replace ``control.json`` with ``control`` (atomically).

        Encoded with :func:`json.dumps`, not pydantic's JSON encoder, which writes an unbounded
        idle budget (+inf) as ``null`` (which would mean "the budget applies always"); the
        plugin's :func:`json.loads` reads ``Infinity`` back as +inf.
        """
        self._atomic_write(self.control_path, json.dumps(control.model_dump(), sort_keys=True))

    def report(self, *, fresh_only: bool = True) -> EngineReport | None:
        """The plugin's last status, or None when absent, unreadable or (``fresh_only``) stale.

        The plugin rewrites its status about twice a second, idle or not, so a stale report
        means an engine process that is down.
        """
        try:
            doc = decode_report(self.status_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ControlFormatError) as exc:
            log.warning("engine channel: unreadable %s: %s", self.status_path, exc)
            return None
        if fresh_only and not self.fresh(doc):
            return None
        return doc

    def fresh(self, report: EngineReport) -> bool:
        return self.clock() - report.written_at <= self._stale_after_s


def control_document(
    *,
    generation: int,
    budget_s: float | None,
    idle_budget_s: float | None,
    ordering: str,
    latency_model: dict[str, Any] | None,
    slo: dict[str, float],
    max_wait_s: float | None = None,
) -> EngineControl:
    """The control document of one sidecar configuration.

    The policy is ``budget`` when both a latency model and a budget are in force (the planner
    then sizes offline work to the budget), else ``naive`` (classes and order kept, offline
    work not budgeted). The ordering's parameters are :func:`engine_ordering_params`.
    """
    policy = "budget" if latency_model is not None and budget_s is not None else "naive"
    return EngineControl(
        generation=generation,
        policy=policy,
        budget_s=budget_s,
        idle_budget_s=idle_budget_s,
        latency_model=latency_model,
        ordering=ordering,
        ordering_params=engine_ordering_params(ordering, max_wait_s),
        slo=slo,
    )


def engine_ordering_params(ordering: str, max_wait_s: float | None = None) -> dict[str, Any]:
    """The ordering's parameters inside vLLM: SageSched's memory cost ``O²/2 + I·O`` for every
    size-based ordering. Inside the engine KV blocks bound the batch, and there the memory
    cost gave 31-40 % lower mean TTLT than the output cost at load 0.9 for SJF, TRAIL-like and
    Gittins alike (``docs/benchmarks/ordering.md``, "Inside vLLM"); the core's default for
    the preemptive orderings, ``output``, was chosen behind the sidecar's slot cap. With the
    tail guard ``max_wait_s`` (``tailguard.py``) where the ordering takes one."""
    model = ORDERINGS.get(ordering)
    if model is None or "cost" not in model[0].model_fields:
        return {}
    params: dict[str, Any] = {"cost": "memory"}
    if max_wait_s is not None and "max_wait_s" in model[0].model_fields:
        params["max_wait_s"] = max_wait_s
    return params


class EngineReportCollector(Collector):
    """The plugin's :class:`EngineReport` as ``slipstream_engine_*`` gauges, read per scrape.

    ``slipstream_engine_up`` is 1 while a fresh report is on disk (the plugin rewrites it
    while vLLM is idle too, so 0 means the engine process is down); the other families are
    present whenever a report is, with ``slipstream_engine_report_age_seconds``. Totals
    (steps, preemptions, tokens) are the plugin process's own and restart from zero with it,
    hence gauges.
    """

    def __init__(self, channel: EngineChannel) -> None:
        self.channel = channel

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rep = self.channel.report(fresh_only=False)
        yield GaugeMetricFamily(
            "slipstream_engine_up",
            "1 when vLLM's Slipstream scheduler plugin wrote a fresh status.json.",
            value=1.0 if rep is not None and self.channel.fresh(rep) else 0.0,
        )
        if rep is None:
            return
        yield GaugeMetricFamily(
            "slipstream_engine_report_age_seconds",
            "Seconds since the plugin last wrote status.json.",
            value=max(0.0, self.channel.clock() - rep.written_at),
        )

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily | None:
            if value is None:
                return None
            return GaugeMetricFamily(f"slipstream_engine_{name}", doc, value=float(value))

        singles = (
            gauge("generation", "Control generation in force in the plugin (-1: none).",
                  rep.generation),
            gauge("budget_seconds", "Budget the plugin's last plan ran under (s).", rep.budget_s),
            gauge("steps", "Iterations the plugin scheduled.", rep.steps),
            gauge("fallback_steps", "Iterations left to vLLM's own walk.", rep.fallback_steps),
            gauge("offline_deferred_chunks", "Offline prefill chunks held back for online work.",
                  rep.offline_deferred_chunks),
            gauge("max_offline_over_budget_seconds",
                  "Largest predicted step minus budget over steps with offline work (s).",
                  rep.max_offline_over_budget_s),
            gauge("forged_offline_tags",
                  "Requests that claimed the offline class without the pod's token.",
                  rep.forged_offline_tags),
        )
        yield from (g for g in singles if g is not None)
        faults = GaugeMetricFamily(
            "slipstream_engine_faults",
            "Exceptions in the plugin's own code, per part; each piece of work ran vLLM's way.",
            labels=["part"],
        )
        for part, n in sorted(rep.faults.items()):
            faults.add_metric([part], n)
        yield faults
        yield GaugeMetricFamily(
            "slipstream_engine_fault_steps",
            "Steps that ran vLLM's own walk because of a fault in the plugin's planning.",
            value=rep.fault_steps,
        )
        yield GaugeMetricFamily(
            "slipstream_engine_failsafe",
            "1 while repeated faults hold the pod on vLLM's own policy (until a new generation).",
            value=1.0 if rep.failsafe else 0.0,
        )
        info = GaugeMetricFamily(
            "slipstream_engine_info", "The plugin's policy, ordering and vLLM version.",
            labels=["policy", "ordering", "vllm_version"],
        )
        info.add_metric([rep.policy, rep.ordering, rep.vllm_version], 1.0)
        yield info
        queue = GaugeMetricFamily(
            "slipstream_engine_requests", "Requests in the engine, per class and state.",
            labels=["class", "state"],
        )
        queue.add_metric(["online", "waiting"], rep.online_waiting)
        queue.add_metric(["online", "running"], rep.online_running)
        queue.add_metric(["offline", "waiting"], rep.offline_waiting)
        queue.add_metric(["offline", "running"], rep.offline_running)
        yield queue
        step = GaugeMetricFamily(
            "slipstream_engine_step_seconds",
            "Mean step time over the plugin's recent window: predicted and measured (s).",
            labels=["source"],
        )
        for source, value in (("predicted", rep.predicted_step_s),
                              ("measured", rep.measured_step_s)):
            if value is not None:
                step.add_metric([source], value)
        yield step
        preempt = GaugeMetricFamily(
            "slipstream_engine_preemptions", "Preemptions in the engine, per class.",
            labels=["class"],
        )
        preempt.add_metric(["online"], rep.online_preemptions)
        preempt.add_metric(["offline"], rep.offline_preemptions)
        yield preempt
        yield GaugeMetricFamily(
            "slipstream_engine_online_displacements",
            "Online requests the plugin preempted for a better-ranked waiting one.",
            value=rep.online_displacements,
        )
        yield GaugeMetricFamily(
            "slipstream_engine_online_displaced_tokens",
            "Computed tokens those displacements dropped (recomputed or re-found on resume).",
            value=rep.online_displaced_tokens,
        )
        tokens = GaugeMetricFamily(
            "slipstream_engine_output_tokens", "Output tokens the engine produced, per class.",
            labels=["class"],
        )
        tokens.add_metric(["online"], rep.online_tokens)
        tokens.add_metric(["offline"], rep.offline_tokens)
        yield tokens
        ttft = GaugeMetricFamily(
            "slipstream_engine_ttft_seconds",
            "TTFT measured in the engine over a recent window, per class and statistic (s).",
            labels=["class", "stat"],
        )
        tbt = GaugeMetricFamily(
            "slipstream_engine_tbt_seconds",
            "TBT measured in the engine over a recent window, per class and statistic (s).",
            labels=["class", "stat"],
        )
        for cls, lat in (("online", rep.online), ("offline", rep.offline)):
            for fam, mean, p99 in ((ttft, lat.ttft_mean_s, lat.ttft_p99_s),
                                   (tbt, lat.tbt_mean_s, lat.tbt_p99_s)):
                if mean is not None:
                    fam.add_metric([cls, "mean"], mean)
                if p99 is not None:
                    fam.add_metric([cls, "p99"], p99)
        yield ttft
        yield tbt
