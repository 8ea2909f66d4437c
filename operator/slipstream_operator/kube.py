"""Thin Kubernetes I/O for the handlers: server-side apply, lists, one Secret read.

Blocking ``kubernetes`` client calls, run by the handlers in a worker thread.
Children are applied with server-side apply (field manager
``slipstream-operator``, forced), so a re-apply is a no-op and a user's edit
of a field the operator owns is put back.

Deliberately left out: watches (kopf owns them) and caching.
"""

from __future__ import annotations

import ipaddress
import logging
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
