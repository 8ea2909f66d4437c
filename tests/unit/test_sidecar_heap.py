"""Freezing the start-up heap: later collections skip it, and still reclaim new garbage."""

from __future__ import annotations

import gc
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


def test_freeze_moves_the_live_heap_into_the_permanent_generation(unfrozen: None) -> None:
    assert gc.get_freeze_count() == 0
    kept = [_Node() for _ in range(1000)]
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count()
    assert frozen >= len(kept)
    # What is frozen is no longer in any generation the collector walks.
    assert not any(n is kept[0] for gen in range(3) for n in gc.get_objects(gen))


def test_cycles_made_after_the_freeze_are_still_collected(unfrozen: None) -> None:
    freeze_startup_heap()
    a, b = _Node(), _Node()
    a.peer, b.peer = b, a
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    assert ref() is None
