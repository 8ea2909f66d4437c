"""Watch the cluster's Slipstream pods and keep the stand-in's fake pods in step.

The pod runner for :mod:`slipstream_testbed.fleet.standin`: a thread lists, then
watches, pods labelled ``slipstream.dev/service`` in all namespaces; each
Running pod with an IP (in the chosen namespaces, or any) becomes a fake
sidecar on that IP, with the control token read once per service from the
operator's ``<service>-control-token`` Secret; a pod that stops running or
is deleted is removed. Calls into the stand-in are handed to its event loop.

Deliberately left out: anything but pods and those Secrets (the operator owns
every other object) and retries beyond re-listing after a broken watch.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client, watch

from slipstream_testbed.fleet.standin import Standin, StandinError

logger = logging.getLogger(__name__)

SERVICE_LABEL = "slipstream.dev/service"
TOKEN_KEY = "token"


@dataclass(frozen=True, slots=True)
class PodEvent:
    """What the watcher needs of one pod event."""

    namespace: str
    name: str
    service: str
    ip: str
    running: bool


def pod_event(kind: str, pod: Any) -> PodEvent | None:
    """Reduce a watch event to a :class:`PodEvent` (None for pods without the label)."""
    meta, status = pod.metadata, pod.status
    labels = dict(meta.labels or {}) if meta else {}
    service = labels.get(SERVICE_LABEL)
    if meta is None or not service:
        return None
    ip = (status.pod_ip if status else None) or ""
    running = (
        kind != "DELETED" and status is not None and status.phase == "Running"
        and meta.deletion_timestamp is None and bool(ip)
    )
    return PodEvent(meta.namespace or "default", meta.name or "", service, ip, running)


class PodWatcher:
    """Feeds pod events to a :class:`Standin` running on ``loop``."""

    def __init__(self, api: client.ApiClient, standin: Standin,
                 loop: asyncio.AbstractEventLoop, namespaces: frozenset[str] = frozenset()) -> None:
        self.api = api
        self.namespaces = namespaces  # empty: every namespace
        self.standin = standin
        self.loop = loop
        self._tokens: dict[tuple[str, str], str] = {}
        self._by_pod: dict[tuple[str, str], str] = {}  # (namespace, pod) -> ip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="podwatch", daemon=True)
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _token(self, namespace: str, service: str) -> str | None:
        key = (namespace, service)
        if key not in self._tokens:
            try:
                secret = client.CoreV1Api(self.api).read_namespaced_secret(
                    f"{service}-control-token", namespace)
            except client.ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            raw = (secret.data or {}).get(TOKEN_KEY)
            if not raw:
                return None
            self._tokens[key] = base64.b64decode(raw).decode()
        return self._tokens[key]

    def _submit(self, make: Callable[[], Any]) -> None:
        future = asyncio.run_coroutine_threadsafe(make(), self.loop)
        try:
            future.result(timeout=30)
        except StandinError as exc:
            self.errors += 1
            logger.warning("%s", exc)

    def handle(self, event: PodEvent) -> None:
        if self.namespaces and event.namespace not in self.namespaces:
            return  # someone else's pod (e.g. a test's real sidecar on a shared cluster)
        key = (event.namespace, event.name)
        known_ip = self._by_pod.get(key)
        if event.running:
            token = self._token(event.namespace, event.service)
            if token is None:
                logger.info("no control token yet for %s/%s", event.namespace, event.service)
                return
            if known_ip and known_ip != event.ip:
                self._submit(lambda: self.standin.remove_pod(known_ip))
            self._by_pod[key] = event.ip
            self._submit(lambda: self.standin.add_pod(event.name, event.ip, token))
        elif known_ip:
            del self._by_pod[key]
            self._submit(lambda: self.standin.remove_pod(known_ip))

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        pending: list[PodEvent] = []
        while not self._stop.is_set():
            try:
                listing = core.list_pod_for_all_namespaces(label_selector=SERVICE_LABEL)
                events = [pod_event("ADDED", p) for p in listing.items]
                pending = [e for e in [*pending, *events] if e is not None]
                version = listing.metadata.resource_version if listing.metadata else None
                stream = watch.Watch()  # type: ignore[no-untyped-call]
                items = stream.stream(  # type: ignore[no-untyped-call]
                    core.list_pod_for_all_namespaces, label_selector=SERVICE_LABEL,
                    resource_version=version, timeout_seconds=30)
                for item in items:
                    event = pod_event(item["type"], item["object"])
                    if event is not None:
                        pending.append(event)
                    pending = self._drain(pending)
                    if self._stop.is_set():
                        stream.stop()  # type: ignore[no-untyped-call]
                        break
                pending = self._drain(pending)
            except (client.ApiException, OSError) as exc:
                self.errors += 1
                logger.warning("pod watch broke: %s; listing again", exc)
                self._stop.wait(1.0)

    def _drain(self, pending: list[PodEvent]) -> list[PodEvent]:
        """Handle events; keep those whose token is not there yet (retried on the next one)."""
        waiting = []
        for event in pending:
            if event.running and self._token(event.namespace, event.service) is None:
                waiting.append(event)
                continue
            self.handle(event)
        return waiting
