"""Errors of the engine model and its GPU timing model.

::

    EngineError
     +-- RequestError            (a request the engine cannot take: duplicate id, bad lengths)
     +-- ProfileError
          +-- ProfileNotFoundError  (no shipped profile for this model and GPU)
          +-- ProfileFormatError    (a profile document we cannot read)

Deliberately left out: errors of the callers (the simulator, the HTTP server).
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of the engine model's errors."""


class RequestError(EngineError):
    """A request the engine model refuses; carries its id and the reason."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason


class ProfileError(EngineError):
    """Base of the GPU-profile errors."""


class ProfileNotFoundError(ProfileError):
    """No shipped profile file of that name."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"no GPU profile {name!r} in slipstream_scheduler.engine.profiles "
            "(write it with `slipstream profile gpu`)"
        )
        self.name = name


class ProfileFormatError(ProfileError):
    """A profile document that is not one this code can read."""
