"""Slipstream sidecar: the in-pod enforcer in front of vLLM.

Online clients reach the engine only through its OpenAI-compatible HTTP
port, served by its compiled front (``slipstream-front``, ``front.py``); the
operator drives it over authenticated gRPC. Scheduling decisions
come from the core's ``Dispatcher``; this package is the asyncio shell that
feeds it events and carries out its decisions. See ``docs/sidecar.md``.
"""

from slipstream_sidecar.app import Sidecar
from slipstream_sidecar.controller import Controller
from slipstream_sidecar.errors import (
    AuthError,
    BatchLineError,
    DrainingError,
    EngineError,
    EngineUnavailableError,
    ShardError,
    ShardIOError,
    SidecarError,
)
from slipstream_sidecar.metrics import SidecarMetrics
from slipstream_sidecar.settings import SidecarSettings
from slipstream_sidecar.shards import ShardProgress, ShardSpec, ShardState

__all__ = [
    "AuthError",
    "BatchLineError",
    "Controller",
    "DrainingError",
    "EngineError",
    "EngineUnavailableError",
    "ShardError",
    "ShardIOError",
    "ShardProgress",
    "ShardSpec",
    "ShardState",
    "Sidecar",
    "SidecarError",
    "SidecarMetrics",
    "SidecarSettings",
]
