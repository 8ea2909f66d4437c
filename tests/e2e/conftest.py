"""Fixtures the e2e modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from integration.helpers_procs import Proc


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts; stopped in reverse order when it ends."""
    started: list[Proc] = []
    yield started
    for proc in reversed(started):
        proc.stop()
