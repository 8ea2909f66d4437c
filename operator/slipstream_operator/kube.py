"""Thin Kubernetes I/O for the handlers: server-side apply, one Secret read, watch views.

Blocking ``kubernetes`` client calls, run by the handlers on their own executor.
Children are applied with server-side apply (field manager
``slipstream-operator``, forced), so a re-apply is a no-op and a user's edit
of a field the operator owns is put back. :class:`AppliedChildren` remembers a
digest of what was last applied, so an unchanged child is not sent again until
``resync_s`` has passed (which bounds how long a deleted or edited child stays so).

Pods, InferenceServices and OfflineJobs are read from kopf indexes (watches kopf
keeps), not listed per tick; :func:`pod_info`, :func:`service_info` and
:func:`job_info` turn the watched bodies into the small values the handlers keep.

Deliberately left out: watches of the children themselves (the resync bounds drift
instead) and of Secrets (a token is read once per resync and kept in memory).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from slipstream_operator.api import GROUP, VERSION

logger = logging.getLogger(__name__)

FIELD_MANAGER = "slipstream-operator"
APPLY = "application/apply-patch+yaml"
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def apply(api: client.ApiClient, obj: dict[str, Any]) -> None:
    """Server-side apply of one namespaced Secret, ConfigMap, Service or Deployment."""
    meta = obj["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    kwargs: dict[str, Any] = {
        "field_manager": FIELD_MANAGER,
        "force": True,
        "_content_type": APPLY,
    }
    core = client.CoreV1Api(api)
    kind = obj["kind"]
    if kind == "Secret":
        core.patch_namespaced_secret(name, namespace, obj, **kwargs)
    elif kind == "ConfigMap":
        core.patch_namespaced_config_map(name, namespace, obj, **kwargs)
    elif kind == "Service":
        core.patch_namespaced_service(name, namespace, obj, **kwargs)
    elif kind == "Deployment":
        client.AppsV1Api(api).patch_namespaced_deployment(name, namespace, obj, **kwargs)
    else:
        raise ValueError(f"cannot apply kind {kind}")


def widen_connection_pool(api: client.ApiClient, size: int) -> None:
    """Let ``size`` threads share ``api`` without discarding connections.

    The client's urllib3 pool keeps 10 connections per host by default; with more threads
    every extra call would open (and then discard) its own TLS connection.
    """
    from kubernetes.client import rest

    configuration = api.configuration
    if (configuration.connection_pool_maxsize or 0) >= size:
        return
    configuration.connection_pool_maxsize = size
    api.rest_client = rest.RESTClientObject(configuration)


def read_secret_value(api: client.ApiClient, namespace: str, name: str, key: str) -> str | None:
    """A Secret's value for ``key`` (decoded), or None when the Secret or key is missing."""
    import base64

    try:
        secret = client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    raw = (secret.data or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None


@dataclass(frozen=True, slots=True)
class PodInfo:
    name: str
    ip: str
    running: bool
    labels: dict[str, str]


def list_pods(api: client.ApiClient, namespace: str, selector: str) -> list[PodInfo]:
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    out = []
    for pod in pods.items:
        status = pod.status or client.V1PodStatus()
        meta = pod.metadata or client.V1ObjectMeta()
        ip = status.pod_ip or ""
        running = status.phase == "Running" and meta.deletion_timestamp is None and bool(ip)
        out.append(PodInfo(meta.name or "", ip, running, dict(meta.labels or {})))
    return out


def list_custom(api: client.ApiClient, namespace: str, plural: str) -> list[dict[str, Any]]:
    result = client.CustomObjectsApi(api).list_namespaced_custom_object(
        GROUP, VERSION, namespace, plural
    )
    if not isinstance(result, dict):
        return []
    items: list[dict[str, Any]] = result.get("items", [])
    return items


def dialable(ip: str, loopback_only: bool) -> bool:
    """Whether the operator may dial ``ip``: any IP, or only 127.0.0.0/8 in loopback-only mode."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return address in LOOPBACK or not loopback_only


def pod_info(body: Mapping[str, Any]) -> PodInfo:
    """A watched Pod body as :class:`PodInfo` (running: phase Running, an IP, not deleting)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    ip = str(status.get("podIP") or "")
    running = status.get("phase") == "Running" and not meta.get("deletionTimestamp") and bool(ip)
    return PodInfo(str(meta.get("name") or ""), ip, running, dict(meta.get("labels") or {}))


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """What an OfflineJob tick needs to know about one InferenceService."""

    name: str
    uid: str
    model: str
    co_location: bool
    labels: tuple[tuple[str, str], ...]
    grpc_port: int


def service_info(body: Mapping[str, Any]) -> ServiceInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    return ServiceInfo(
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        model=str(spec.get("model") or ""),
        co_location=bool((spec.get("scheduling") or {}).get("coLocation", True)),
        labels=tuple(sorted((str(k), str(v)) for k, v in (meta.get("labels") or {}).items())),
        grpc_port=int((spec.get("sidecar") or {}).get("grpcPort", 9000)),
    )


@dataclass(frozen=True, slots=True)
class JobInfo:
    """An OfflineJob's name, uid and priority (what other jobs' ticks need)."""

    name: str
    uid: str
    priority: int


def job_info(body: Mapping[str, Any]) -> JobInfo:
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    return JobInfo(str(meta.get("name") or ""), str(meta.get("uid") or ""),
                   int(spec.get("priority", 0) or 0))


def child_key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return str(obj["kind"]), str(meta["namespace"]), str(meta["name"])


def child_digest(obj: Mapping[str, Any]) -> str:
    """A digest of the rendered object (canonical JSON), equal iff the objects are equal."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Applied:
    digest: str
    at_s: float


def phase(key: str, period_s: float) -> float:
    """A fixed offset in [0, ``period_s``) taken from a hash of ``key``: where on a shared
    period this object's work falls, so that many objects do not all fire at once."""
    return period_s * int.from_bytes(hashlib.sha256(key.encode()).digest()[4:8], "big") / 2**32


def spread(key: str, period_s: float) -> float:
    """``period_s`` stretched by a fixed fraction in [0, 0.5) taken from a hash of ``key``, so
    that periodic work of many objects started together does not stay in step."""
    fraction = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
    return period_s * (1.0 + 0.5 * fraction)


class AppliedChildren:
    """What was last applied per child (kind, namespace, name), and when.

    :meth:`changed` says whether a rendered child must be sent now: it never was, or it
    changed. :meth:`resync_due` says whether an unchanged child is due for a re-apply (which
    puts back a deleted child or a user's edit): ``resync_s`` seconds, stretched per child by
    :func:`spread`, have passed since it was applied. Record a child with :meth:`applied`
    only after the API server took it.
    """

    def __init__(self, resync_s: float) -> None:
        self.resync_s = resync_s
        self._last: dict[tuple[str, str, str], _Applied] = {}

    def changed(self, obj: Mapping[str, Any], digest: str | None = None) -> bool:
        """``digest``: ``child_digest(obj)`` when the caller has it already."""
        last = self._last.get(child_key(obj))
        return last is None or last.digest != (digest or child_digest(obj))

    def resync_due(self, obj: Mapping[str, Any], now_s: float) -> bool:
        key = child_key(obj)
        last = self._last.get(key)
        return last is None or now_s - last.at_s >= spread("/".join(key), self.resync_s)

    def due(self, obj: Mapping[str, Any], now_s: float) -> bool:
        """Changed, or due for a resync."""
        return self.changed(obj) or self.resync_due(obj, now_s)

    def applied(self, obj: Mapping[str, Any], now_s: float, digest: str | None = None) -> None:
        self._last[child_key(obj)] = _Applied(digest or child_digest(obj), now_s)

    def forget(self, namespace: str, names: set[str]) -> None:
        """Drop the records of these children (their owner is gone)."""
        for key in [k for k in self._last if k[1] == namespace and k[2] in names]:
            del self._last[key]

    def __len__(self) -> int:
        return len(self._last)
