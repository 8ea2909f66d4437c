"""The control channel between the sidecar and the plugin.

The sidecar writes ``control.json`` in the channel directory (the env var
``SLIPSTREAM_CHANNEL_DIR`` or ``additional_config["slipstream_channel_dir"]``); it is polled
every :data:`CONTROL_POLL_S` and applied only when its generation is newer. The plugin writes
``status.json`` (an ``EngineReport``) every :data:`STATUS_EVERY_S` while it schedules; while
vLLM is idle (no step, so no call into the plugin) a heartbeat thread rewrites the last report
with a new ``written_at`` at the same pace, so a fresh report means a live engine, busy or
not (the heartbeat touches no scheduler state). Without a channel, or
before the first control document, the plugin runs the ``naive`` policy: classes and order
still hold, offline work is not budgeted.

Here: the channel thread (:func:`_channel_main`, :func:`_stop_channel`), reading the offline
token and the control document and building a :class:`_Config` from it off the scheduling
thread (:class:`ChannelMixin`), installing it at the next step, writing ``status.json``, and
:func:`write_control` / :func:`read_report` for tools and tests.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.enginecontrol import (
    CONTROL_FILE,
    OFFLINE_TOKEN_FILE,
    STATUS_FILE,
    ControlFormatError,
    EngineControl,
    EngineReport,
    decode_control,
)
from slipstream_scheduler.latency import LinearLatencyModel
from slipstream_scheduler.ordering import Ordering, make_ordering
from slipstream_scheduler.planner import PlannerMode, TwoPhasePlanner
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_vllm.state import _OFFLINE, _State

# The plugin logs under one name, whichever of its modules speaks.
logger = logging.getLogger("slipstream_vllm.scheduler")

CHANNEL_JOIN_S = 5.0
"""How long shutdown and interpreter exit wait for the channel thread's round to end."""
CONTROL_POLL_S = 0.2
STATUS_EVERY_S = 0.5


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


class ChannelMixin(_State):
    """The scheduler's side of the control channel.

    The channel thread polls ``control.json`` and writes ``status.json``; the scheduling
    thread only takes a finished configuration (one attribute read per step) and records
    counts. Nothing here does I/O or parsing on vLLM's scheduling thread while it serves.
    """

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

    def _write_report(self, rep: EngineReport) -> None:
        if self.channel_dir is None:
            return
        try:
            _atomic_write(self.channel_dir / STATUS_FILE, rep.model_dump_json())
        except OSError as exc:
            if self.channel_dir.is_dir():  # a folder removed meanwhile is no fault here
                logger.warning("slipstream: cannot write %s: %s", STATUS_FILE, exc)


def _channel_main(ref: weakref.ReferenceType[ChannelMixin], stop: threading.Event) -> None:
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


def write_control(channel_dir: Path, doc: EngineControl) -> None:
    """Write ``control.json`` atomically (for tools and tests; the sidecar has its own writer)."""
    _atomic_write(channel_dir / CONTROL_FILE, doc.encode())


def read_report(channel_dir: Path) -> EngineReport | None:
    try:
        return EngineReport.model_validate(json.loads((channel_dir / STATUS_FILE).read_text()))
    except (FileNotFoundError, ValueError):
        return None
