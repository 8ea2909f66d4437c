"""Builds the core's :class:`Dispatcher` for one sidecar and applies ``Configure`` to it.

Everything here is construction: the admission policy (``budget`` when a
latency model is known, else ``naive``) in ADMISSION mode, the online queue of
the configured ordering, the offline queue, the engine limits. The decisions
themselves are the dispatcher's. The engine's KV cache (blocks and block size) comes from
``kvcache.py``.

Orderings come from the core's registry (``slipstream_scheduler.ordering``);
the online length predictor is the sidecar's prompt-text history
(``predictor.py``), fed by every finished online request through the
dispatcher.

Deliberately left out: gRPC types (``grpc_server.py`` converts them) and I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slipstream_scheduler.admission import build_planner
from slipstream_scheduler.dispatcher import (
    Dispatcher,
    DispatcherConfig,
    OrderingQueue,
    PsmOfflineQueue,
)
from slipstream_scheduler.latency import (
    FEATURE_NAMES,
    FeatureSet,
    LinearLatencyModel,
    ModelFormatError,
)
from slipstream_scheduler.lengths import InputLengthHistoryPredictor
from slipstream_scheduler.ordering import (
    ORDERINGS,
    Ordering,
    UnknownOrderingError,
    make_ordering,
)
from slipstream_scheduler.planner import PlannerMode
from slipstream_scheduler.protocols import LengthPredictor
from slipstream_scheduler.psm import PsmParams, PsmQueue
from slipstream_scheduler.types import EngineLimits
from slipstream_sidecar.kvcache import KvCache, resolve
from slipstream_sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class BrainConfig:
    """What the operator may change at run time (the ``Configure`` call)."""

    budget_s: float | None
    ordering: str
    latency_model: LinearLatencyModel | None
    idle_budget_s: float | None = None  # seconds (inf: unbounded); None: budget_s always
    max_wait_s: float | None = None  # the ordering's tail guard (tailguard.py); None: none


def latency_model_from_spec(
    kind: str,
    coefficients: Mapping[str, float],
    knee_tokens: int = 0,
    *,
    token_curve: Sequence[float] = (),
    curve_step_tokens: int = 0,
) -> LinearLatencyModel:
    """A linear model from a feature-set name, ``{feature name: seconds per unit}``, the
    hinge's knee (tokens per step; 0 for sets without a hinge) and, for the
    ``context+chunk+curve`` set, the token curve and its knot spacing (tokens).

    Raises ``ValueError`` naming the ``LatencyModelSpec`` field at fault (the gRPC layer
    turns it into ``INVALID_ARGUMENT``).
    """
    unknown = set(coefficients) - set(FEATURE_NAMES)
    if unknown:
        raise ValueError(f"unknown latency-model features: {sorted(unknown)}")
    try:
        feature_set = FeatureSet(kind or FeatureSet.CONTEXT.value)
    except ValueError:
        known = ", ".join(fs.value for fs in FeatureSet)
        raise ValueError(f"latency_model.kind {kind!r} is not one of: {known}") from None
    try:
        return LinearLatencyModel(
            feature_set,
            tuple(float(coefficients.get(name, 0.0)) for name in FEATURE_NAMES),
            knee_tokens=knee_tokens,
            token_curve=tuple(float(v) for v in token_curve),
            curve_step_tokens=curve_step_tokens,
        )
    except ModelFormatError as exc:
        name = exc.field_name or "kind"
        field_name = name if name in _SPEC_FIELDS else f"coefficients[{name!r}]"
        raise ValueError(f"latency_model.{field_name}: {exc}") from exc


_SPEC_FIELDS = ("kind", "coefficients", "knee_tokens", "token_curve", "curve_step_tokens")


def sidecar_ordering(name: str, max_wait_s: float | None = None) -> Ordering:
    """The named ordering as the sidecar runs it: keys only, never displacement, with the
    tail guard ``max_wait_s`` where the ordering takes one (``tailguard.py``).

    NOTE: policy is bent here on purpose. TRAIL-like and Gittins may displace an
    in-flight online request (abort and resume); the proxy cannot stitch a
    client's stream across an abort, so the sidecar runs them with a preemption
    cap of 0. `bench ordering` measures this variant as `gittins-np`: level with the
    other orderings at 70-80 % load and 2.3 % behind preemptive Gittins at 90 %
    (docs/benchmarks/ordering.md).
    """
    try:
        params_model, _ = ORDERINGS[name]
    except KeyError:
        raise ValueError(f"unknown ordering {name!r}; known: {', '.join(ORDERINGS)}") from None
    params: dict[str, object] = (
        {"max_preemptions": 0} if "max_preemptions" in params_model.model_fields else {}
    )
    if max_wait_s is not None and "max_wait_s" in params_model.model_fields:
        params["max_wait_s"] = max_wait_s
    try:
        return make_ordering(name, params)
    except UnknownOrderingError:
        raise ValueError(f"unknown ordering {name!r}; known: {', '.join(ORDERINGS)}") from None


def build_online_queue(
    name: str, predictor: LengthPredictor, max_wait_s: float | None = None
) -> OrderingQueue:
    """The core's online queue (the simulator's too) in the sidecar's ordering."""
    return OrderingQueue(sidecar_ordering(name, max_wait_s), predictor)


def build_offline_queue() -> PsmOfflineQueue:
    """PSM order over the prompts' 16-token block hashes, as the simulator's ``budget-psm``."""
    return PsmOfflineQueue(PsmQueue(PsmParams(block_size=1)))


def build_dispatcher(
    settings: SidecarSettings,
    cfg: BrainConfig,
    predictor: LengthPredictor | None = None,
    *,
    kv: KvCache | None = None,
) -> Dispatcher:
    """The dispatcher of ``cfg``; the online length predictor defaults to the input-length
    history (the sidecar passes its :class:`~slipstream_sidecar.predictor.PromptLengths`).
    ``kv`` is the engine's KV cache (the sidecar's, as read from the engine); None: the
    settings', else the defaults (``kvcache.resolve`` without the engine)."""
    if predictor is None:
        predictor = InputLengthHistoryPredictor()
    if kv is None:
        kv = resolve(settings.kv_blocks, settings.block_size, None)
    limits = EngineLimits(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=kv.block_size,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
    )
    return Dispatcher(
        DispatcherConfig(
            offline_priority=settings.offline_priority, idle_budget_s=cfg.idle_budget_s
        ),
        build_planner(
            "budget" if cfg.latency_model is not None else "naive",
            latency_model=cfg.latency_model,
            mode=PlannerMode.ADMISSION,
        ),
        online_queue=build_online_queue(cfg.ordering, predictor, cfg.max_wait_s),
        offline_queue=build_offline_queue(),
        length_predictor=predictor,
        limits=limits,
        kv_blocks=kv.kv_blocks,
        budget_s=cfg.budget_s,
    )


def apply(dispatcher: Dispatcher, old: BrainConfig, new: BrainConfig) -> None:
    """Reconfigure a live dispatcher: budget, idle budget, planner (latency model), ordering."""
    if new.idle_budget_s != old.idle_budget_s:
        # Validated like the settings field (positive; inf allowed).
        dispatcher.config = DispatcherConfig.model_validate(
            dispatcher.config.model_dump() | {"idle_budget_s": new.idle_budget_s}
        )
    if new.latency_model != old.latency_model:
        dispatcher.planner = build_planner(
            "budget" if new.latency_model is not None else "naive",
            latency_model=new.latency_model,
            mode=PlannerMode.ADMISSION,
        )
    if new.ordering != old.ordering or new.max_wait_s != old.max_wait_s:
        queue = dispatcher.online_queue
        if not isinstance(queue, OrderingQueue):
            raise ValueError("the online queue cannot change its ordering")
        try:
            queue.set_ordering(sidecar_ordering(new.ordering, new.max_wait_s))
        except UnknownOrderingError:
            raise ValueError(f"unknown ordering {new.ordering!r}") from None
    dispatcher.set_budget(new.budget_s)
