"""The in-pod channel between the sidecar and Slipstream's vLLM scheduler plugin (engine mode).

In engine mode the sidecar no longer sits on the online path: vLLM's own scheduler, replaced by
``slipstream_vllm.scheduler.SlipstreamScheduler``, composes every batch. The sidecar still owns
the control API (gRPC ``Configure``), so it hands each configuration to the plugin, and the
plugin hands its state back, through three files in a directory both containers mount (an
``emptyDir``):

``control.json``
    An :class:`EngineControl`, written by the sidecar by atomic replacement (write a temporary
    file, then ``rename``). Versioned by ``generation``: the plugin applies a document only if
    its generation is newer than the one in force, so rewriting the same document is a no-op
    and a stale writer cannot roll the plugin back. Both sides survive a restart of the other:
    the file outlives either process.
``status.json``
    An :class:`EngineReport`, rewritten by the plugin about twice a second.
``offline.token``
    The pod's secret, created once by the sidecar (mode 0600). An offline request proves that
    the pod's own sidecar sent it by carrying this token in ``vllm_xargs`` under
    :data:`OFFLINE_TOKEN_ARG`; every other request is online.

This module is the schema and the pure encode/decode of those documents; the file I/O lives at
the two edges (the sidecar and the plugin).

Errors::

    ControlFormatError(field)

Deliberately left out: transport security beyond the filesystem (the directory is private to
the pod), and any clock.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = [
    "CONTROL_FILE",
    "CONTROL_VERSION",
    "OFFLINE_TOKEN_ARG",
    "OFFLINE_TOKEN_FILE",
    "STATUS_FILE",
    "STEPS_DIR",
    "STEP_RECORDS_BUFFERED",
    "STEP_SEGMENTS_KEPT",
    "STEP_SEGMENT_RECORDS",
    "TBT_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "ClassCounts",
    "ClassLatency",
    "ControlFormatError",
    "CumulativeHistogram",
    "EngineControl",
    "EngineReport",
    "decode_control",
    "decode_report",
]

CONTROL_VERSION: Literal[1] = 1
CONTROL_FILE = "control.json"
STATUS_FILE = "status.json"
OFFLINE_TOKEN_FILE = "offline.token"
OFFLINE_TOKEN_ARG = "slipstream_offline"
"""The ``vllm_xargs`` key an offline request's proof travels under."""
STEPS_DIR = "steps"
"""Folder of the channel where the plugin writes its step records
(:class:`slipstream_scheduler.learning.StepRecord`, JSON lines), one segment file at a time."""
STEP_RECORDS_BUFFERED = 8192
"""Most step records the plugin holds between two writes; older ones are dropped."""
STEP_SEGMENT_RECORDS = 1024
"""Most records in one segment file."""
STEP_SEGMENTS_KEPT = 64
"""Segments the plugin keeps in the folder (the newest); the sidecar reads them as they come."""


class ControlFormatError(ValueError):
    """A control or status document that does not parse; ``field`` names the culprit."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class EngineControl(BaseModel):
    """One configuration for the plugin (the sidecar's ``Configure``, as a document)."""

    # +inf (an unbounded idle budget) is written as JSON's Infinity, not null.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    version: Literal[1] = CONTROL_VERSION
    generation: int = Field(ge=0, description="Monotone; a document not newer is ignored.")
    policy: str = Field(
        default="budget",
        description="Admission policy of the planner (slipstream_scheduler.admission).",
    )
    policy_params: dict[str, Any] = Field(default_factory=dict)
    budget_s: float | None = Field(
        default=None, gt=0.0, description="Per-iteration latency budget; None: unbounded."
    )
    idle_budget_s: float | None = Field(
        default=None,
        description="Budget while no online request is in the engine: None, the budget "
        "applies always; +inf, unbounded.",
    )
    latency_model: dict[str, Any] | None = Field(
        default=None, description="LinearLatencyModel.to_dict(); needed by the budget policy."
    )
    ordering: str = Field(default="fcfs", description="Online ordering (ordering.ORDERINGS).")
    ordering_params: dict[str, Any] = Field(default_factory=dict)
    offline_order: Literal["psm", "fcfs"] = "psm"
    psm_params: dict[str, Any] = Field(default_factory=dict)
    slo: dict[str, float] = Field(
        default_factory=dict, description="The service's SLO, for the report (seconds)."
    )

    @field_validator("idle_budget_s")
    @classmethod
    def _idle(cls, v: float | None) -> float | None:
        if v is not None and not (v > 0.0 or math.isinf(v)):
            raise ValueError("must be positive or +inf")
        return v

    def encode(self) -> str:
        return self.model_dump_json()


class ClassLatency(BaseModel):
    """Latency of one request class measured inside the engine over a recent window (seconds)."""

    model_config = ConfigDict(frozen=True)

    ttft_mean_s: float | None = None
    ttft_p99_s: float | None = None
    tbt_mean_s: float | None = None
    tbt_p99_s: float | None = None
    samples: int = 0


TTFT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TBT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
"""Upper bounds of the report's histograms: the sidecar's own TTFT and TBT buckets."""


class CumulativeHistogram(BaseModel):
    """Observations since the engine started, as ``/metrics`` exports a histogram: counts at
    or below each bound (ascending; the last is +inf), their sum and count."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    upper_bounds: tuple[float, ...] = ()
    cumulative_counts: tuple[float, ...] = ()
    sum: float = 0.0
    count: float = 0.0


class ClassCounts(BaseModel):
    """One class's cumulative latency histograms and counters, measured in the engine: what
    the sidecar's ``Status`` carries as ``online_counters`` in engine mode."""

    model_config = ConfigDict(frozen=True)

    ttft: CumulativeHistogram = CumulativeHistogram()
    tbt: CumulativeHistogram = CumulativeHistogram()
    admitted: float = 0.0
    finished_ok: float = 0.0
    output_tokens: float = 0.0


class EngineReport(BaseModel):
    """The plugin's state, as the sidecar serves it in ``Status`` and ``/metrics``."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")

    version: Literal[1] = CONTROL_VERSION
    generation: int = -1
    """Generation in force (-1: none received; the plugin runs its defaults)."""
    policy: str = ""
    ordering: str = ""
    budget_s: float | None = None
    """The budget the last plan ran under (the idle budget when no online work was present)."""
    written_at: float = 0.0
    """Wall-clock time of the write (seconds since the epoch)."""
    pid: int = 0
    vllm_version: str = ""
    async_scheduling: bool = False
    """Whether vLLM schedules the next step while the last one runs (the plugin's class
    follows it: ``SlipstreamScheduler`` on, ``SlipstreamSyncScheduler`` off)."""
    online_waiting: int = 0
    offline_waiting: int = 0
    online_running: int = 0
    offline_running: int = 0
    steps: int = 0
    fallback_steps: int = 0
    offline_deferred_chunks: int = 0
    predicted_step_s: float | None = None
    """Mean predicted step time over the recent window (planned steps with a latency model)."""
    measured_step_s: float | None = None
    """Mean measured step time over the same window (schedule to output)."""
    max_offline_over_budget_s: float | None = None
    """Largest (predicted step − budget) over steps that ran offline work (≤ 0: within)."""
    offline_preemptions: int = 0
    online_preemptions: int = 0
    online_displacements: int = 0
    """Online requests preempted by the plugin for a better-ranked waiting one (a preemptive
    ordering's displacement; also counted in ``online_preemptions``)."""
    online_displaced_tokens: int = 0
    """Computed tokens those displacements dropped (recomputed, or found in the prefix cache,
    when the request resumes)."""
    forged_offline_tags: int = 0
    """Requests that carried an offline tag without the pod's token (served as online)."""
    faults: dict[str, int] = {}
    """Exceptions raised in the plugin's own code, per part (``control``, ``classify``,
    ``ordering``, ``predictor``, ``psm``, ``planner``, ``steer``, ``bookkeeping``, ``report``);
    each made that piece of work vLLM's way instead (docs/plugin.md, failure behaviour)."""
    fault_steps: int = 0
    """Steps that ran vLLM's own walk because of a fault in the plugin's planning."""
    failsafe: str = ""
    """Non-empty while repeated faults hold the pod on vLLM's own policy: why. Cleared by the
    next control generation."""
    online: ClassLatency = ClassLatency()
    offline: ClassLatency = ClassLatency()
    online_tokens: int = 0
    offline_tokens: int = 0
    online_counts: ClassCounts = ClassCounts()
    offline_counts: ClassCounts = ClassCounts()


def _decode(model: type[BaseModel], text: str, what: str) -> Any:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ControlFormatError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ControlFormatError(f"{what} must be a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        raise ControlFormatError(err["msg"], field=loc) from exc


def decode_control(text: str) -> EngineControl:
    """Parse ``control.json``; :class:`ControlFormatError` names the bad field."""
    out: EngineControl = _decode(EngineControl, text, "control document")
    return out


def decode_report(text: str) -> EngineReport:
    """Parse ``status.json``; :class:`ControlFormatError` names the bad field."""
    out: EngineReport = _decode(EngineReport, text, "status document")
    return out
