"""The engine model: one vLLM v1 engine without a GPU, in virtual time.

``EngineModel`` schedules like vLLM (continuous batching, chunked prefill,
priority/FCFS, KV blocks, preemption by recompute, prefix caching) and times
each step with ``GpuTimingModel``, built from real GPU measurements and shipped
as JSON profiles. See ``docs/design/engine-model.md`` for the contract and
``docs/concepts/engine-model.md`` for the derivation and its measured error.
"""

from slipstream_scheduler.engine.errors import (
    EngineError,
    ProfileError,
    ProfileFormatError,
    ProfileNotFoundError,
    RequestError,
)
from slipstream_scheduler.engine.gpu import (
    Calibration,
    Curve,
    GpuProfile,
    GpuTimingModel,
    Hardware,
    ModelArch,
    available_profiles,
    load_profile,
)
from slipstream_scheduler.engine.model import (
    EngineConfig,
    EngineModel,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestState,
    RequestView,
    StepResult,
)

__all__ = [
    "Calibration",
    "Curve",
    "EngineConfig",
    "EngineError",
    "EngineModel",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "GpuProfile",
    "GpuTimingModel",
    "Hardware",
    "ModelArch",
    "ProfileError",
    "ProfileFormatError",
    "ProfileNotFoundError",
    "RequestError",
    "RequestState",
    "RequestView",
    "StepResult",
    "available_profiles",
    "load_profile",
]
