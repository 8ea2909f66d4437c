"""Slipstream's plugin with faults injected, for ``vllm serve --scheduler-cls`` in the tests.

``SLIPSTREAM_TEST_FAULTS`` names the parts that raise on every call (comma-separated):
``control``, ``ordering``, ``planner``, ``psm``, ``predictor``. Loaded from this folder (the
test puts it on the server's ``PYTHONPATH``); nothing in the product knows of it.
"""

from __future__ import annotations

import os
from typing import Any

from slipstream_vllm.scheduler import SlipstreamScheduler


class InjectedFaultError(RuntimeError):
    pass


class _BrokenPredictor:
    def predict(self, *_: Any) -> Any:
        raise InjectedFaultError("predictor")

    def observe(self, *_: Any) -> None:
        raise InjectedFaultError("predictor")


class FaultyScheduler(SlipstreamScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.faults = set(filter(None, os.environ.get("SLIPSTREAM_TEST_FAULTS", "").split(",")))
        super().__init__(*args, **kwargs)
        if "predictor" in self.faults:
            self._predictor = _BrokenPredictor()

    def _fault(self, part: str) -> None:
        if part in getattr(self, "faults", ()):
            raise InjectedFaultError(part)

    def _poll_control(self) -> None:
        self._fault("control")
        super()._poll_control()

    def _ordered_queues(self, waiting: list[Any]) -> Any:
        self._fault("ordering")
        return super()._ordered_queues(waiting)

    def _snapshot(self, online_q: list[Any], offline_q: list[Any]) -> Any:
        self._fault("planner")
        return super()._snapshot(online_q, offline_q)

    def _psm_queue(self, offline: list[Any]) -> list[Any]:
        self._fault("psm")
        return super()._psm_queue(offline)
