"""Token counting and TBT sampling against the streams of three engines.

``tests/fixtures/sse`` holds one streamed answer per file, written from the shapes
of the engine model, vLLM and llm-d-inference-sim. The same files drive the
compiled front's counter (``sidecar/front/sse_fixtures_test.go``), and the
sidecar end to end (``tests/integration/test_sidecar_front_sse.py``). Here they go
through :class:`EventScanner`, which reads the offline shards' streams.
"""

from __future__ import annotations

import pytest

from fixtures.sse_streams import NAMES, load, stream
from slipstream_sidecar.sse import EventScanner

pytestmark = pytest.mark.unit


def test_there_are_streams_of_three_engines() -> None:
    assert {n.split("_")[0] for n in NAMES} >= {"engine", "vllm", "llm"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
def test_the_scanner_counts_each_recorded_stream(name: str, step: int) -> None:
    fx = load(name)
    data = stream(fx)
    sc = EventScanner()
    events = []
    for i in range(0, len(data), step):
        events += sc.feed(data[i : i + step])
    assert sum(e.tokens for e in events) == fx["tokens"]
    assert sum(e.content for e in events) == fx["content_events"]
    usage = [e.usage["completion_tokens"] for e in events if e.usage is not None]
    assert usage == ([] if fx["usage_tokens"] is None else [fx["usage_tokens"]])
    assert events[-1].done
