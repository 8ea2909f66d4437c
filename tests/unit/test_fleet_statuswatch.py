"""The bench's status watch: when each service first showed a samples count."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from slipstream_testbed.cluster import Rest
from slipstream_testbed.fleet.statuswatch import ETCD_PREFIX, StatusWatch, parse_etcd_range

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


def written(obj: dict[str, Any], *times: str, subresource: str = "status") -> dict[str, Any]:
    obj["metadata"]["managedFields"] = [
        {"manager": "kopf", "operation": "Update", "subresource": subresource, "time": t}
        for t in times
    ]
    return obj


def test_the_stamp_is_the_servers_status_write_time_capped_at_the_arrival() -> None:
    from datetime import datetime

    from slipstream_testbed.fleet.statuswatch import status_written

    watch = StatusWatch(Rest.__new__(Rest), ["t"])
    at = datetime.fromisoformat("2026-11-30T16:04:10+00:00").timestamp()
    # Written at 16:04:10 (truncated to the second), read 30 s later after a re-LIST: the
    # stamp is the write's second plus one, the arrival stays what the bench saw.
    late = written(service("a", 4), "2026-11-30T16:03:00Z", "2026-11-30T16:04:10Z")
    assert status_written(late) == at
    watch.record(late, at + 30.0)
    assert watch.reached("t/a", 4, since=at - 5.0) == at + 1.0
    assert watch.reached("t/a", 4, since=at - 5.0, arrival=True) == at + 30.0
    # Read within the second of the write: never stamped later than it arrived.
    watch.record(written(service("b", 4), "2026-11-30T16:04:10Z"), at + 0.3)
    assert watch.reached("t/b", 4, since=at - 5.0) == at + 0.3
    # Only the status subresource's entries count; without one, the arrival is the stamp.
    spec_only = written(service("c", 4), "2026-11-30T16:04:10Z", subresource="")
    assert status_written(spec_only) is None
    watch.record(spec_only, at + 30.0)
    assert watch.reached("t/c", 4, since=at - 5.0) == at + 30.0
    bad = written(service("d", 4), "yesterday")
    assert status_written(bad) is None


def test_a_list_read_while_the_watch_is_quiet_is_stamped_like_its_events() -> None:
    from datetime import datetime

    clock = iter([100.0]).__next__
    watch = StatusWatch(Rest.__new__(Rest), ["t"], clock=clock)
    assert watch.last_event_at == 100.0
    at = datetime.fromisoformat("2026-11-30T16:04:10+00:00").timestamp()
    items = [written(service("a", 8), "2026-11-30T16:04:10Z"), service("b", 4)]
    watch.refresh(items, at + 40.0)
    assert watch.refreshed == 1
    assert watch.last_event_at == at + 40.0
    # The write time, not the late read, stamps a; b (no write time) is stamped at the read.
    assert watch.reached("t/a", 8, since=at - 3.0) == at + 1.0
    assert watch.reached("t/b", 4, since=at - 3.0) == at + 40.0


def test_an_etcd_range_reply_gives_each_services_samples_and_status_write_time() -> None:
    def kv(key: str, obj: dict[str, Any]) -> dict[str, str]:
        return {"key": base64.b64encode(key.encode()).decode(),
                "value": base64.b64encode(json.dumps(obj).encode()).decode()}

    written = {"metadata": {"managedFields": [
        {"subresource": "status", "time": "2026-12-01T08:00:00Z"}]},
        "status": {"observed": {"samples": 8}}}
    answer = {"kvs": [kv(ETCD_PREFIX + "team-a/svc-1", written),
                      kv(ETCD_PREFIX + "team-b/svc-2", {"metadata": {}})]}
    held = parse_etcd_range(answer)
    assert held["team-a/svc-1"] == (8, 1796112000.0)
    assert held["team-b/svc-2"] == (0, None)  # no status yet
    assert parse_etcd_range({"count": "0"}) == {}  # etcd leaves kvs out when none match
    with pytest.raises(ValueError, match="not under"):
        parse_etcd_range({"kvs": [kv("/registry/pods/x/y", {})]})
