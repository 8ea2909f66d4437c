"""Cluster tier: the resync's check of a child against the real API server.

At a resync the operator reads each child from the API server's watch cache and applies it
again only when it is gone or was written since the operator's own apply
(``kube.read_version`` and ``AppliedChildren.unchanged_since_applied``). This runs that
check on a real kube-apiserver: an unchanged child is recognised (no apply needed), and a
child another writer edited, or deleted, is not, and the apply puts it back.

Deliberately left out: the handler's scheduling of resyncs (unit tier,
tests/unit/test_fleet_operator_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from slipstream_operator import kube

pytestmark = pytest.mark.cluster


def _config_map(namespace: str, value: str = "1") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "svc-config", "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "slipstream"}},
            "data": {"budget": value}}


def _until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """The cached read may trail a write by a moment: wait for ``check``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_only_a_child_written_or_deleted_since_the_apply_needs_applying(
    admin_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(admin_api)
    child = _config_map(namespace)
    applied = kube.AppliedChildren(resync_s=60.0)
    assert kube.read_version(admin_api, child) is None  # not there yet
    version = kube.apply(admin_api, child)
    assert version is not None and version.uid and version.resource_version
    applied.applied(child, 0.0, version)
    _until("the cache to hold the apply", lambda: kube.read_version(admin_api, child) == version)
    assert applied.unchanged_since_applied(child, kube.read_version(admin_api, child))
    # Applying the same object again writes nothing: the version stays.
    assert kube.apply(admin_api, child) == version
    # A new rendering is never "unchanged", whatever the live object is.
    assert not applied.unchanged_since_applied(_config_map(namespace, "2"), version)

    # Another writer edits a field the operator owns: the check sees the write ...
    core.patch_namespaced_config_map("svc-config", namespace, {"data": {"budget": "edited"}})
    _until("the edit to reach the cache",
           lambda: kube.read_version(admin_api, child) != version)
    assert not applied.unchanged_since_applied(child, kube.read_version(admin_api, child))
    # ... and the apply puts the operator's value back.
    again = kube.apply(admin_api, child)
    assert again is not None and again != version
    assert core.read_namespaced_config_map("svc-config", namespace).data == {"budget": "1"}
    applied.applied(child, 1.0, again)

    # Deleted: gone from the cache, not unchanged, and the apply creates it anew.
    core.delete_namespaced_config_map("svc-config", namespace)
    _until("the delete to reach the cache", lambda: kube.read_version(admin_api, child) is None)
    assert not applied.unchanged_since_applied(child, None)
    recreated = kube.apply(admin_api, child)
    assert recreated is not None and recreated.uid != again.uid


def test_every_kind_the_operator_applies_can_be_read_back(
    admin_api: client.ApiClient, namespace: str
) -> None:
    labels = {"app": "svc"}
    children: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Secret",
         "metadata": {"name": "svc-token", "namespace": namespace},
         "stringData": {"token": "t"}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "svc", "namespace": namespace},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": "svc", "namespace": namespace},
         "spec": {"replicas": 0, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels},
                               "spec": {"containers": [{"name": "c", "image": "x"}]}}}},
    ]
    for child in children:
        version = kube.apply(admin_api, child)
        assert version is not None, child["kind"]
        _until(f"the {child['kind']} in the cache",
               lambda child=child: kube.read_version(admin_api, child) is not None)
        live = kube.read_version(admin_api, child)
        assert live is not None and live.uid == version.uid, child["kind"]
    with pytest.raises(ValueError, match="cannot read kind Pod"):
        kube.read_version(admin_api, {"kind": "Pod", "metadata": {"name": "p",
                                                                   "namespace": namespace}})
