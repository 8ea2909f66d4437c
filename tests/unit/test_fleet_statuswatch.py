"""The bench's status watch: when each service first showed a samples count."""

from __future__ import annotations

from typing import Any

import pytest

from slipstream_cli.cluster import Rest
from slipstream_cli.fleet.statuswatch import StatusWatch

pytestmark = pytest.mark.unit


def service(name: str, samples: int | None) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"namespace": "t", "name": name}}
    if samples is not None:
        obj["status"] = {"observed": {"samples": samples}}
    return obj


def test_first_arrival_of_each_count_is_kept_and_reached_is_measured_from_the_bump() -> None:
    rest = Rest.__new__(Rest)  # never dialled: only the bookkeeping is used here
    watch = StatusWatch(rest, ["t"])
    watch.record(service("a", None), 10.0)
    watch.record(service("a", 4), 12.0)
    watch.record(service("a", 4), 13.0)  # same count again (another status key changed)
    watch.record(service("a", 8), 20.0)
    watch.record(service("b", 4), 11.0)
    assert watch.reached("t/a", 4, since=11.5) == 12.0
    assert watch.reached("t/a", 8, since=15.0) == 20.0
    assert watch.reached("t/a", 12, since=15.0) is None
    assert watch.reached("t/c", 4, since=0.0) is None
    # Reached before the bump (cannot happen for a real bump): counted from the bump.
    assert watch.reached("t/b", 4, since=11.5) == 11.5
    assert watch.scopes == ["/namespaces/t"]


def test_wait_open_is_false_until_every_scope_has_opened() -> None:
    watch = StatusWatch(Rest.__new__(Rest), ["t", "u"])
    assert not watch.wait_open(0.01)  # never started: no scope opened
