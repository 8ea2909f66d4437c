"""Freezing the start-up heap: later collections skip it, and still reclaim new garbage."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest

from slipstream_sidecar.heap import freeze_startup_heap

pytestmark = pytest.mark.unit


class _Node:
    def __init__(self) -> None:
        self.peer: _Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # other tests' objects go back to the collector's generations


FREEZE = """
import gc
from slipstream_sidecar.heap import freeze_startup_heap

class Node:
    pass

assert gc.get_freeze_count() == 0
kept = [Node() for _ in range(1000)]
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count(), (frozen, gc.get_freeze_count())
assert frozen >= len(kept)
# What is frozen is no longer in any generation the collector walks.
assert not any(n is kept[0] for gen in range(3) for n in gc.get_objects(gen))
print("ok", frozen)
"""


def test_freeze_moves_the_live_heap_into_the_permanent_generation() -> None:
    """In a process of its own, as a sidecar calls it: in the test runner, whatever else is
    alive (other tests' threads and handlers) may freeze or free objects meanwhile."""
    out = subprocess.run([sys.executable, "-c", FREEZE], check=False, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok ")


def test_cycles_made_after_the_freeze_are_still_collected(unfrozen: None) -> None:
    freeze_startup_heap()
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    assert ref() is None
