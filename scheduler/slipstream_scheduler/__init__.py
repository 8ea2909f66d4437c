"""Slipstream's pure scheduling core.

No network, no Kubernetes, no wall clock, no unseeded randomness: every
function takes the time and the state it needs. The sidecar, the operator,
the simulator and the benchmarks all run this same code.

Modules, in the order a request meets them:

* ``lengths``    output-length distribution predictors (SageSched) and embedders
* ``gittins``    the cost model C = O²/2 + I·O and the Gittins rank
* ``ordering``   online orderings (FCFS, SJF, TRAIL-like, Gittins) and their queue
* ``psm``        the prefix-sharing (PSM) offline queue with anti-starvation
* ``latency``    HyGen's batch-latency model
* ``planner``    HyGen's two-phase planner; ``admission`` names its policies
* ``dispatcher`` the sidecar's admission layer (also driven by the simulator)
* ``engine``     the vLLM engine model; ``sim`` the discrete-event simulator
* ``budget``     the SLO-aware budget search; ``profiler`` the latency-model fit
* ``storage_scope`` which storage URIs an OfflineJob of a namespace may name
* ``textgen``    the engine model's deterministic tokenizer and text

The MiniLM embedder (``embedders_semantic``) is deliberately not imported
here: it pulls in torch, which only the ``semantic`` extra installs.
"""

from slipstream_scheduler.admission import (
    ADMISSION_POLICIES,
    AdmissionError,
    AdmissionPolicy,
    BudgetParams,
    NaiveParams,
    OfflineOnlyParams,
    OnlineOnlyParams,
    PolicyConfigError,
    PolicyParams,
    StaticCapParams,
    UnknownPolicyError,
    build_planner,
)
from slipstream_scheduler.budget import (
    SearchResult,
    Slo,
    bisect_largest,
    parse_slo,
    search_budget,
)
from slipstream_scheduler.dispatcher import (
    Abort,
    Decisions,
    Dispatcher,
    DispatcherConfig,
    DispatcherStats,
    FifoQueue,
    Incoming,
    OrderingQueue,
    PsmOfflineQueue,
    Submit,
)
from slipstream_scheduler.gittins import gittins_rank, request_cost
from slipstream_scheduler.latency import (
    BatchFeatures,
    FeatureSet,
    FitError,
    FitResult,
    FitStats,
    LatencyModelError,
    LatencyModelMeta,
    LinearLatencyModel,
    ModelFormatError,
    SchemaVersionError,
    fit,
    kfold_mape,
)
from slipstream_scheduler.lengths import (
    GlobalDistributionPredictor,
    HashingEmbedder,
    HistoryParams,
    InputLengthHistoryPredictor,
    InputLengthParams,
    SemanticHistoryParams,
    SemanticHistoryPredictor,
)
from slipstream_scheduler.ordering import (
    ORDERINGS,
    KeyedQueue,
    Ordering,
    RequestView,
    make_ordering,
)
from slipstream_scheduler.planner import FillRules, PlannerMode, TwoPhasePlanner
from slipstream_scheduler.protocols import Embedder, LatencyModel, LengthPredictor, Planner
from slipstream_scheduler.psm import PsmParams, PsmPick, PsmQueue
from slipstream_scheduler.storage_scope import ScopeError, check_resolved_path, check_uri
from slipstream_scheduler.textgen import (
    TextGenConfig,
    TokenGenerator,
    Tokenizer,
    block_hashes,
    render_chat,
)
from slipstream_scheduler.types import (
    Admission,
    BatchItem,
    EngineLimits,
    Phase,
    QueuedRequest,
    RequestClass,
    RunningRequest,
    Snapshot,
    StepPlan,
)

__all__ = [
    "ADMISSION_POLICIES",
    "ORDERINGS",
    "Abort",
    "Admission",
    "AdmissionError",
    "AdmissionPolicy",
    "BatchFeatures",
    "BatchItem",
    "BudgetParams",
    "Decisions",
    "Dispatcher",
    "DispatcherConfig",
    "DispatcherStats",
    "Embedder",
    "EngineLimits",
    "FeatureSet",
    "FifoQueue",
    "FillRules",
    "FitError",
    "FitResult",
    "FitStats",
    "GlobalDistributionPredictor",
    "HashingEmbedder",
    "HistoryParams",
    "Incoming",
    "InputLengthHistoryPredictor",
    "InputLengthParams",
    "KeyedQueue",
    "LatencyModel",
    "LatencyModelError",
    "LatencyModelMeta",
    "LengthPredictor",
    "LinearLatencyModel",
    "ModelFormatError",
    "NaiveParams",
    "OfflineOnlyParams",
    "OnlineOnlyParams",
    "Ordering",
    "OrderingQueue",
    "Phase",
    "Planner",
    "PlannerMode",
    "PolicyConfigError",
    "PolicyParams",
    "PsmOfflineQueue",
    "PsmParams",
    "PsmPick",
    "PsmQueue",
    "QueuedRequest",
    "RequestClass",
    "RequestView",
    "RunningRequest",
    "SchemaVersionError",
    "ScopeError",
    "SearchResult",
    "SemanticHistoryParams",
    "SemanticHistoryPredictor",
    "Slo",
    "Snapshot",
    "StaticCapParams",
    "StepPlan",
    "Submit",
    "TextGenConfig",
    "TokenGenerator",
    "Tokenizer",
    "TwoPhasePlanner",
    "UnknownPolicyError",
    "bisect_largest",
    "block_hashes",
    "build_planner",
    "check_resolved_path",
    "check_uri",
    "fit",
    "gittins_rank",
    "kfold_mape",
    "make_ordering",
    "parse_slo",
    "render_chat",
    "request_cost",
    "search_budget",
]
