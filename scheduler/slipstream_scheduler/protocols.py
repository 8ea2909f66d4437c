"""The core's extension points, as small Protocols.

Each Protocol's docstring is its contract. Implementations live in their own
modules and are listed in explicit registries (``policies.py``), never
registered by import side effects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from slipstream_scheduler.types import BatchItem, Snapshot, StepPlan


@runtime_checkable
class LatencyModel(Protocol):
    """Predicts the wall time of one engine iteration from its batch composition.

    Contract: ``predict`` is pure, cheap (a few microseconds), and
    monotone non-decreasing when an item is added to the batch.
    """

    def predict(self, batch: Sequence[BatchItem]) -> float:
        """Seconds for one iteration over ``batch``."""
        ...


@runtime_checkable
class Planner(Protocol):
    """Turns a snapshot into a step plan (admission policy + mechanism).

    Contract: pure function of the snapshot; online work first; never admits
    beyond ``limits`` or free KV blocks; only offline requests are preempted.
    """

    name: str

    def plan(self, snapshot: Snapshot) -> StepPlan: ...


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to L2-normalised vectors (rows) of a fixed dimension."""

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]: ...


@runtime_checkable
class LengthPredictor(Protocol):
    """Predicts a distribution of output lengths for a prompt.

    ``predict`` returns the sample of output lengths (tokens) the distribution
    is made of; every sample is equally likely. ``observe`` feeds back a
    finished request. ``vector`` is the prompt's embedding (or None for
    predictors that do not use one).
    """

    def predict(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int
    ) -> npt.NDArray[np.float64]: ...

    def observe(
        self, vector: npt.NDArray[np.float32] | None, input_tokens: int, output_tokens: int
    ) -> None: ...
