"""Keeping the garbage collector's pauses off the request path.

CPython's oldest-generation collection walks every tracked object. A serving
process imports aiohttp, grpc, pydantic, numpy and prometheus-client and
builds its application before it takes a request: about 70,000 objects that
live as long as the process. Walking them took 15–48 ms per collection in the
sidecar and the engine model under load (``docs/benchmarks/sidecar.md``), a
stall of every stream in flight. :func:`freeze_startup_heap` moves them into
the permanent generation once start-up is done, so later collections walk
only what was allocated since. vLLM does the same after its warm-up.

Deliberately left out: disabling the collector or raising its thresholds
(reference cycles made while serving must still be reclaimed).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from later collections.

    Call it when the process is ready to serve (imports done, application
    built). Returns the number of objects now frozen.
    """
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d start-up objects out of the garbage collector's walks", frozen)
    return frozen
