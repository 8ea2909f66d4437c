"""Builds the core's :class:`Dispatcher` for one sidecar and applies ``Configure`` to it.

Everything here is construction: the admission policy (``budget`` when a
latency model is known, else ``naive``) in ADMISSION mode, the online queue of
the configured ordering, the offline queue, the engine limits. The decisions
themselves are the dispatcher's.

Orderings come from the core's registry (``slipstream_scheduler.ordering``);
the online length predictor is the input-length history predictor (no prompt
embeddings in the sidecar: that would need the ``[semantic]`` extra), fed by
every finished online request through the dispatcher.

Deliberately left out: gRPC types (``grpc_server.py`` converts them) and I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.dispatcher import Dispatcher, DispatcherConfig, FifoQueue, Incoming
from slipstream_scheduler.latency import FEATURE_NAMES, FeatureSet, LinearLatencyModel
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.ordering import (
    ORDERINGS,
    KeyedQueue,
    Ordering,
    RequestView,
    UnknownOrderingError,
    make_ordering,
)
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.protocols import LengthPredictor
from slipstream_scheduler.types import EngineLimits
from slipstream_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class BrainConfig:
    """What the operator may change at run time (the ``Configure`` call)."""

    budget_s: float | None
    ordering: str
    latency_model: LinearLatencyModel | None


def latency_model_from_spec(
    kind: str, coefficients: Mapping[str, float], knee_tokens: int = 0
) -> LinearLatencyModel:
    """A linear model from a feature-set name, ``{feature name: seconds per unit}`` and the
    hinge's knee (tokens per step; 0 for sets without a hinge)."""
    unknown = set(coefficients) - set(FEATURE_NAMES)
    if unknown:
        raise ValueError(f"unknown latency-model features: {sorted(unknown)}")
    return LinearLatencyModel(
        FeatureSet(kind or FeatureSet.CONTEXT.value),
        tuple(float(coefficients.get(name, 0.0)) for name in FEATURE_NAMES),
        knee_tokens=knee_tokens,
    )


def _length_predictor() -> LengthPredictor:
    return InputLengthHistoryPredictor()


class OrderingQueue:
    """The dispatcher's online ``RequestQueue`` in a core ``Ordering``'s order.

    NOTE: glue only, until the core ships its own adapter: the key is the
    ordering's, computed once at arrival from the length predictor's sample
    (online requests are never preempted by the dispatcher, so the bucket
    refresh of running requests does not arise here). ``set_ordering`` re-keys
    the held requests when ``Configure`` changes the ordering.
    """

    def __init__(self, ordering: Ordering, predictor: LengthPredictor) -> None:
        self.ordering = ordering
        self._predictor = predictor
        self._q = KeyedQueue()
        self._held: dict[str, Incoming] = {}

    def _key(self, req: Incoming) -> float:
        sample = self._predictor.predict(req.vector, req.prompt_tokens)
        view = RequestView.create(req.request_id, req.arrival_s, req.prompt_tokens, sample)
        return self.ordering.key(view)

    def push(self, request: Incoming) -> None:
        self._held[request.request_id] = request
        self._q.push(request.request_id, self._key(request))

    def head(self, n: int, now_s: float) -> list[str]:
        return [rid for rid, _ in self._q.smallest(n)]

    def take(self, request_id: str, now_s: float) -> None:
        self.remove(request_id)

    def remove(self, request_id: str) -> None:
        if request_id in self._q:
            self._q.remove(request_id)
        self._held.pop(request_id, None)

    def set_ordering(self, ordering: Ordering) -> None:
        self.ordering = ordering
        for req in list(self._held.values()):
            self._q.push(req.request_id, self._key(req))

    def __len__(self) -> int:
        return len(self._q)


def build_online_queue(name: str, predictor: LengthPredictor) -> OrderingQueue:
    try:
        ordering = make_ordering(name)
    except UnknownOrderingError:
        raise ValueError(f"unknown ordering {name!r}; known: {', '.join(ORDERINGS)}") from None
    return OrderingQueue(ordering, predictor)


def build_dispatcher(settings: SidecarSettings, cfg: BrainConfig) -> Dispatcher:
    predictor = _length_predictor()
    limits = EngineLimits(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
    )
    return Dispatcher(
        DispatcherConfig.model_validate({"offline_priority": settings.offline_priority}),
        build_planner(
            "budget" if cfg.latency_model is not None else "naive",
            latency_model=cfg.latency_model,
            mode=PlannerMode.ADMISSION,
        ),
        online_queue=build_online_queue(cfg.ordering, predictor),
        offline_queue=FifoQueue(),
        length_predictor=predictor,
        limits=limits,
        kv_blocks=settings.kv_blocks,
        budget_s=cfg.budget_s,
    )


def apply(dispatcher: Dispatcher, old: BrainConfig, new: BrainConfig) -> None:
    """Reconfigure a live dispatcher: budget, planner (latency model), online ordering."""
    if new.latency_model != old.latency_model:
        dispatcher.planner = build_planner(
            "budget" if new.latency_model is not None else "naive",
            latency_model=new.latency_model,
            mode=PlannerMode.ADMISSION,
        )
    if new.ordering != old.ordering:
        queue = dispatcher.online_queue
        if not isinstance(queue, OrderingQueue):
            raise ValueError("the online queue cannot change its ordering")
        try:
            queue.set_ordering(make_ordering(new.ordering))
        except UnknownOrderingError:
            raise ValueError(f"unknown ordering {new.ordering!r}") from None
    dispatcher.set_budget(new.budget_s)
