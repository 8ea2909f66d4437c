"""The plugin's fail-safe: a fault in Slipstream's code never stops vLLM's engine.

vLLM's engine core calls the plugin on its scheduling thread; an exception that escaped
``schedule()`` or ``update_from_output()`` would end the engine and fail every request on the
pod. So each part of Slipstream's work in a step runs under :meth:`FaultGuard.part`: a fault
there is counted under the part's name, logged once (with its traceback) and then at most
once per :data:`LOG_EVERY_S` per part with the count since, and the step goes on the way vLLM
would run it (the scheduler decides what "vLLM's way" is for each part; see
``slipstream_vllm.scheduler``).

Repeated faults trip the guard: :data:`TRIP_FAULTS` faults within :data:`TRIP_WINDOW_S` switch
the pod to vLLM's own policy (classes and priorities still hold; no planning, ordering or
prediction) until the next control generation is applied, and the report says so. A pod
without a control channel stays on vLLM's policy until it restarts.

Leaves out: exceptions raised by vLLM's own code. Those end the engine as they would without
the plugin; the scheduler only makes sure that its own rearrangements of vLLM's queues are
undone first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

__all__ = ["LOG_EVERY_S", "PARTS", "TRIP_FAULTS", "TRIP_WINDOW_S", "FaultGuard"]

PARTS = (
    "control",
    "classify",
    "ordering",
    "predictor",
    "psm",
    "planner",
    "steer",
    "bookkeeping",
    "report",
)
"""The parts of the plugin a fault is counted under (``slipstream_engine_faults{part}``)."""
TRIP_FAULTS = 5
TRIP_WINDOW_S = 60.0
LOG_EVERY_S = 60.0


class FaultGuard:
    """Counts faults per part, logs them rate-limited, and trips after repeated ones."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.counts: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.tripped = False
        self.tripped_reason = ""
        self._recent: deque[float] = deque(maxlen=TRIP_FAULTS)
        self._logged: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()  # the scheduling thread and the channel thread record

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Run the body; an ``Exception`` in it is recorded under ``name`` and swallowed."""
        try:
            yield
        except Exception as exc:
            self.record(name, exc)

    def record(self, name: str, exc: BaseException) -> None:
        with self._lock:
            self._record(name, exc)

    def _record(self, name: str, exc: BaseException) -> None:
        now = self.clock()
        self.counts[name] = self.counts.get(name, 0) + 1
        self._log(name, exc, now)
        self._recent.append(now)
        if (
            not self.tripped
            and len(self._recent) == TRIP_FAULTS
            and now - self._recent[0] <= TRIP_WINDOW_S
        ):
            self.tripped = True
            self.tripped_reason = f"{TRIP_FAULTS} faults within {TRIP_WINDOW_S:g} s (last: {name})"
            logger.error(
                "slipstream: %s; running vLLM's own policy until the next control generation",
                self.tripped_reason,
            )

    def reset(self) -> None:
        """A new control generation: Slipstream's policy again (counts are kept)."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        if self.tripped:
            logger.info("slipstream: new control generation; Slipstream's policy resumes")
        self.tripped = False
        self.tripped_reason = ""
        self._recent.clear()

    def _log(self, name: str, exc: BaseException, now: float) -> None:
        last = self._logged.get(name)
        if last is None:
            logger.error("slipstream: fault in %s; this step runs vLLM's way", name,
                         exc_info=exc)
            self._logged[name] = (now, self.counts[name])
        elif now - last[0] >= LOG_EVERY_S:
            logger.error(
                "slipstream: %d more faults in %s in the last %.0f s (latest: %s: %s)",
                self.counts[name] - last[1], name, now - last[0], type(exc).__name__, exc,
            )
            self._logged[name] = (now, self.counts[name])

    @property
    def total(self) -> int:
        return sum(self.counts.values())
