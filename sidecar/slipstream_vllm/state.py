"""What the plugin's parts share: the per-request record :class:`_Meta`, the two classes, and
:class:`_State`, the attributes every part of :class:`~slipstream_vllm.scheduler._Slipstream`
reads or sets (vLLM's and the plugin's), declared once for the type checker.

The parts are mixins over :class:`_State` (:mod:`~slipstream_vllm.channel`,
:mod:`~slipstream_vllm.ordering`, :mod:`~slipstream_vllm.snapshot`,
:mod:`~slipstream_vllm.steering`, :mod:`~slipstream_vllm.stats`); ``_Slipstream.__init__``
sets every attribute. For the type checker ``_State`` stands on vLLM's ``Scheduler`` (so the
mixins see vLLM's attributes and ``super().schedule``); at run time it is a plain class and
vLLM's scheduler comes after every mixin in the method resolution order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream_scheduler.types import EngineLimits, RequestClass

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler as _Base
    from vllm.v1.request import Request

    from slipstream_scheduler.enginecontrol import EngineControl
    from slipstream_scheduler.lengths import (
        GlobalDistributionPredictor,
        HashingEmbedder,
        SemanticHistoryPredictor,
    )
    from slipstream_scheduler.ordering import GlobalFallback, Ordering
    from slipstream_scheduler.planner import TwoPhasePlanner
    from slipstream_scheduler.psm import PsmQueue
    from slipstream_scheduler.types import StepPlan
    from slipstream_vllm.channel import _Config
    from slipstream_vllm.failsafe import FaultGuard
    from slipstream_vllm.stats import _ClassStats, _Window
    from slipstream_vllm.steps import Counts, StepRecorder
else:
    _Base = object

_ONLINE = RequestClass.ONLINE
_OFFLINE = RequestClass.OFFLINE


@dataclass(slots=True)
class _Meta:
    """What the plugin keeps per request beside vLLM's ``Request``."""

    cls: RequestClass
    vector: Any = None
    key: float = 0.0
    keyed_at: int = -1
    lengths: Any = None
    request: Request | None = None
    """vLLM's request (its counts are read after vLLM has let it go, at its finish)."""
    first_token_s: float | None = None
    last_token_s: float | None = None
    """When its last token came out, written only when it misses a step's outputs: while it
    has a token in each step's, that time is the last step's (``_State._prev_tokens_s``)."""


class _State(_Base):  # type: ignore[misc]
    """The attributes the plugin's parts share (annotations only: nothing here at run time)."""

    # vLLM's attributes this class rearranges around each walk (typed for mypy).
    running: list[Request]
    waiting: Any
    max_num_scheduled_tokens: int

    # The plugin's own, set in the start-up parts of ``_Slipstream.__init__`` (described there).
    async_scheduling: bool
    channel_dir: Path | None
    limits: EngineLimits
    _guard: FaultGuard
    clock: Callable[[], float]
    _meta: dict[str, _Meta]
    _offline_ids: set[str]
    online_only_path: bool
    online_only_steps: int
    _embedder: HashingEmbedder
    _predictor: SemanticHistoryPredictor
    _global: GlobalDistributionPredictor
    _fallback: GlobalFallback
    _psm: PsmQueue
    _psm_cache: tuple[tuple[int, int, int], float, tuple[str, ...]] | None
    _token: str | None
    _token_stat: tuple[int, int] | None
    _control_stat: tuple[int, int, int] | None
    _pending: _Config | None
    _report_now: bool
    _queue_counts: tuple[int, int, int, int]
    _counted_at: float
    _channel_stop: threading.Event
    _channel_thread: threading.Thread | None
    control: EngineControl | None
    planner: TwoPhasePlanner
    ordering: Ordering
    offline_order: str
    budget_s: float | None
    idle_budget_s: float | None
    _budget_in_force: float | None
    steps: int
    fallback_steps: int
    fault_steps: int
    _stage: str
    _walking: bool
    offline_deferred_chunks: int
    offline_preemptions: int
    online_preemptions: int
    online_displacements: int
    online_displaced_tokens: int
    forged_offline_tags: int
    max_offline_over_budget_s: float | None
    _predicted: _Window
    _measured: _Window
    _stats: dict[RequestClass, _ClassStats]
    _last_plan: StepPlan | None
    _inflight: deque[tuple[int, float, float | None, Counts]]
    step_records: StepRecorder
    _last_output_s: float
    _last_predicted: float | None
    _prev_tokens: frozenset[str]
    _prev_tokens_s: float
    _prev_token_ids: list[str]
