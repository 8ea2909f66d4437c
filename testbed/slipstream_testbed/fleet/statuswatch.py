"""Stamp InferenceService status changes as their watch events arrive (the bench's lag probe).

The fleet bench measures status freshness: the time from a change on the fake pods to the
CR's status showing it. Polling with LIST loses resolution as the fleet grows: one LIST of
500 services with full status is about 2.2 MB and took seconds on the loaded host, and a
status written just after a LIST began is only seen by the next one. :class:`StatusWatch`
instead keeps one watch per scope (cluster-wide, or one per namespace) open in a daemon
thread and records, for every service, when each new ``status.observed.samples`` value
arrived. Two times are kept for each new value:

* **arrival**: the bench's clock when the event (or a LIST holding the object) was read. It
  includes the API server's watch delivery and the bench's own delays in reading, and after
  a watch ends (the server's time-out, a dropped connection) it is the return of the LIST
  that re-opens it, which on a loaded API server can be tens of seconds after the write.
* **stamp** (what :meth:`StatusWatch.reached` reports): the API server's own time of the
  last write to the object's ``status`` subresource (``metadata.managedFields[].time`` of
  the ``status`` entries, which the server sets when a write changes a value the writer
  owns), plus one second because that time is truncated to the second, capped at the
  arrival. The status was visible to every reader from that write on, so the stamp measures
  the operator, not the probe. An object without such an entry is stamped at its arrival.

Deliberately left out: any other status field, and bookmarks. A watch that ends is
re-opened from a fresh LIST of the API server's watch cache. A watch that stays open but
goes quiet (on an overloaded API server a watcher can stop receiving events without the
stream ending) is covered by the bench: while services are waiting and no event has
arrived for a while, it reads the watch cache with one LIST and feeds the items to
:meth:`StatusWatch.refresh`, which stamps them the same way (by the server's write time, so
a late read does not lengthen the lag).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from typing import Any

from slipstream_testbed.cluster import ApiError, ClusterError, Rest

logger = logging.getLogger(__name__)

PATH = "/apis/slipstream.dev/v1alpha1{where}/inferenceservices"


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def _samples(obj: dict[str, Any]) -> int:
    return int(((obj.get("status") or {}).get("observed") or {}).get("samples", 0))


def status_written(obj: dict[str, Any]) -> float | None:
    """The server's time (epoch seconds, truncated to the second) of the last write that
    changed the object's ``status`` subresource; None when no managed-fields entry says."""
    latest: float | None = None
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("subresource") != "status" or not entry.get("time"):
            continue
        try:
            at = datetime.fromisoformat(str(entry["time"]).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        latest = at if latest is None else max(latest, at)
    return latest


ETCD_PREFIX = "/registry/slipstream.dev/inferenceservices/"
"""Where the API server keeps InferenceServices in etcd (its default ``--etcd-prefix``; custom
resources are stored as JSON)."""


def etcd_statuses(etcd_url: str, *, timeout_s: float = 30.0,
                  prefix: str = ETCD_PREFIX) -> dict[str, tuple[int, float | None]]:
    """Each InferenceService's ``(samples, status write time)`` as etcd holds it now.

    Read through etcd's JSON gateway (``POST /v3/kv/range``), bypassing the API server and
    its watch cache: the ground truth the probe's watch and cached LISTs trail. On a loaded
    API server a consistent LIST of 500 services timed out; this read does not go through it.
    Raises ``OSError`` (``urllib.error.URLError``) or ``ValueError`` when etcd cannot be read.
    """
    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    key = prefix.encode()
    end = key[:-1] + bytes([key[-1] + 1])  # every key that starts with the prefix
    request = urllib.request.Request(
        etcd_url.rstrip("/") + "/v3/kv/range", method="POST",
        data=json.dumps({"key": b64(key), "range_end": b64(end)}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        answer = json.loads(resp.read())
    return parse_etcd_range(answer, prefix)


def parse_etcd_range(answer: dict[str, Any],
                     prefix: str = ETCD_PREFIX) -> dict[str, tuple[int, float | None]]:
    """``namespace/name -> (samples, status write time)`` from a ``/v3/kv/range`` reply."""
    out: dict[str, tuple[int, float | None]] = {}
    for kv in answer.get("kvs") or ():
        name = base64.b64decode(kv["key"]).decode()
        if not name.startswith(prefix):
            raise ValueError(f"etcd key {name!r} is not under {prefix!r}")
        obj = json.loads(base64.b64decode(kv.get("value", "")))
        out[name[len(prefix):]] = (_samples(obj), status_written(obj))
    return out


class StatusWatch:
    """Per-service history of ``(stamp, samples, arrival)``, one entry per new value."""

    def __init__(self, rest: Rest, namespaces: list[str] | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.rest = rest
        self.scopes = [f"/namespaces/{ns}" for ns in namespaces] if namespaces else [""]
        self.clock = clock
        self._lock = threading.Lock()
        self._history: dict[str, list[tuple[float, int, float]]] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.events = 0
        self.reopened = 0
        self.refreshed = 0  # LISTs fed in by refresh() while the watch was quiet
        self.last_event_at = clock()  # the bench's clock at the last event or LIST read
        self._open: dict[str, threading.Event] = {w: threading.Event() for w in self.scopes}

    def start(self) -> None:
        for where in self.scopes:
            thread = threading.Thread(target=self._run, args=(where,), daemon=True,
                                      name=f"statuswatch{where or '-all'}")
            thread.start()
            self._threads.append(thread)

    def wait_open(self, timeout_s: float) -> bool:
        """Block until every scope's watch has been opened once (its first LIST done).

        Start the watch well before the change it is to time: a LIST of hundreds of services
        can take tens of seconds on a loaded API server, and changes made meanwhile would be
        stamped when the LIST or the watch's replay delivers them, not when they happened.
        """
        deadline = time.monotonic() + timeout_s
        return all(e.wait(max(0.0, deadline - time.monotonic())) for e in self._open.values())

    def stop(self) -> None:
        self._stop.set()  # the threads are daemons blocked on a read: they end with the process

    def record(self, obj: dict[str, Any], at: float) -> None:
        key, samples = _key(obj), _samples(obj)
        written = status_written(obj)
        stamp = at if written is None else min(at, written + 1.0)
        with self._lock:
            seen = self._history.setdefault(key, [])
            if not seen or seen[-1][1] != samples:
                seen.append((stamp, samples, at))

    def refresh(self, items: list[dict[str, Any]], at: float) -> None:
        """Record the items of a LIST read at ``at`` (the watch was quiet: see the module
        docstring); each is stamped as a watch event would be."""
        for item in items:
            self.record(item, at)
        self.refreshed += 1
        self.last_event_at = max(self.last_event_at, at)

    def latest(self, key: str) -> int | None:
        """The last samples count seen for ``key`` (None: never seen)."""
        with self._lock:
            seen = self._history.get(key)
            return seen[-1][1] if seen else None

    def reached(self, key: str, want: int, since: float, *,
                arrival: bool = False) -> float | None:
        """When ``key`` first showed ``samples >= want`` at or after ``since`` (None: not yet):
        its stamp, or with ``arrival`` when the bench read it.

        A value that was already reached before ``since`` counts from ``since``.
        """
        with self._lock:
            for stamp, samples, at in self._history.get(key, ()):
                if samples >= want:
                    return max(at if arrival else stamp, since)
        return None

    def _run(self, where: str) -> None:
        while not self._stop.is_set():
            try:
                version = self._list(where)
                self._watch(where, version)
            except (ApiError, ClusterError, urllib.error.URLError, OSError, ValueError) as exc:
                # A loaded API server answers LIST with 504 now and then: list again.
                logger.warning("status watch %s: %s; reopening", where or "(all)", exc)
                time.sleep(1.0)
            self.reopened += 1

    def _list(self, where: str) -> str:
        # From the watch cache (resourceVersion=0): a consistent LIST of 500 services timed
        # out (504) again and again on an overloaded API server, and the watch never reopened.
        answer = self.rest.request("GET", PATH.format(where=where) + "?resourceVersion=0",
                                   timeout=120.0)
        at = self.clock()
        for item in answer.get("items", []):
            self.record(item, at)
        self.last_event_at = at
        return str((answer.get("metadata") or {}).get("resourceVersion", ""))

    def _watch(self, where: str, version: str) -> None:
        url = (self.rest.server + PATH.format(where=where)
               + f"?watch=1&resourceVersion={version}&timeoutSeconds=3600")
        request = urllib.request.Request(url)
        request.add_header("Accept", "application/json")
        if self.rest.token:
            request.add_header("Authorization", f"Bearer {self.rest.token}")
        with urllib.request.urlopen(request, context=self.rest.context, timeout=600) as stream:
            self._open[where].set()
            for line in stream:
                if self._stop.is_set():
                    return
                at = self.clock()
                self.last_event_at = at
                event = json.loads(line)
                kind = event.get("type")
                if kind == "ERROR":  # e.g. 410 Gone: the version is too old; list again
                    return
                if kind in ("ADDED", "MODIFIED"):
                    self.events += 1
                    self.record(event.get("object") or {}, at)
