"""Slipstream's pure scheduling core.

No network, no Kubernetes, no wall clock, no unseeded randomness: every
function takes the time and the state it needs. The sidecar, the operator,
the simulator and the benchmarks all run this same code.
"""

from slipstream_scheduler.protocols import Embedder, LatencyModel, LengthPredictor, Planner
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
    "Admission",
    "BatchItem",
    "Embedder",
    "EngineLimits",
    "LatencyModel",
    "LengthPredictor",
    "Phase",
    "Planner",
    "QueuedRequest",
    "RequestClass",
    "RunningRequest",
    "Snapshot",
    "StepPlan",
]
