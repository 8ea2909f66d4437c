"""Smoke test of the local control plane: CRDs, GPU scheduling onto kwok nodes, loopback pod
IPs a real process can bind, and RBAC refusing the restricted service account."""

from __future__ import annotations

import ipaddress
import json
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from slipstream_testbed.cluster import POD_NETWORK, LocalCluster

pytestmark = pytest.mark.cluster

LOOPBACK_NET = ipaddress.ip_network("127.0.0.0/8")
T = TypeVar("T")


def wire(obj: Any) -> dict[str, Any]:
    """A kubernetes model as its JSON form (camelCase keys), for indexing without Optionals."""
    return dict(obj.to_dict(serialize=True))


def eventually(what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


def test_components_healthy_and_loopback_only(
    cluster: LocalCluster, admin_api: client.ApiClient
) -> None:
    assert all(s.healthy for s in cluster.status()), cluster.status()
    kubeconfig = json.loads(cluster.admin_kubeconfig.read_text())
    assert kubeconfig["clusters"][0]["cluster"]["server"].startswith("https://127.0.0.1:")
    nodes = client.CoreV1Api(admin_api).list_node(label_selector="type=kwok").items
    assert len(nodes) == cluster.config.nodes
    for node in map(wire, nodes):
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(cluster.config.gpus_per_node)
        internal = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
        assert len(internal) == 1 and ipaddress.ip_address(internal[0]) in LOOPBACK_NET
        for cidr in node["spec"]["podCIDRs"]:
            assert ipaddress.IPv4Network(cidr).subnet_of(POD_NETWORK)


def test_cluster_ips_are_loopback(admin_api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(admin_api)
    service = client.V1Service(
        metadata=client.V1ObjectMeta(name="engine"),
        spec=client.V1ServiceSpec(
            selector={"app": "engine"}, ports=[client.V1ServicePort(port=8000)]
        ),
    )
    created = wire(core.create_namespaced_service(namespace, service))
    assert ipaddress.ip_address(created["spec"]["clusterIP"]) in LOOPBACK_NET
    builtin = wire(core.read_namespaced_service("kubernetes", "default"))
    assert ipaddress.ip_address(builtin["spec"]["clusterIP"]) in LOOPBACK_NET


def test_custom_resource_definition(admin_api: client.ApiClient, namespace: str) -> None:
    ext = client.ApiextensionsV1Api(admin_api)
    group, plural = "smoke.slipstream.dev", "widgets"
    crd: dict[str, Any] = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["gpus"],
                                    "properties": {"gpus": {"type": "integer", "minimum": 0}},
                                },
                                "status": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                },
                            },
                        }
                    },
                }
            ],
        },
    }
    try:
        ext.create_custom_resource_definition(cast(Any, crd))  # dict bodies are accepted
    except ApiException as exc:
        if exc.status != 409:
            raise

    def established() -> bool | None:
        got = wire(ext.read_custom_resource_definition(f"{plural}.{group}"))
        conds = {c["type"]: c["status"] for c in got.get("status", {}).get("conditions") or []}
        return True if conds.get("Established") == "True" else None

    eventually("CRD Established", established)
    custom = client.CustomObjectsApi(admin_api)
    body: dict[str, Any] = {
        "apiVersion": f"{group}/v1",
        "kind": "Widget",
        "metadata": {"name": "w1"},
        "spec": {"gpus": 2},
    }
    eventually("CR create", lambda: _create_when_served(custom, group, namespace, plural, body))
    got: Any = custom.get_namespaced_custom_object(group, "v1", namespace, plural, "w1")
    assert got["spec"]["gpus"] == 2
    bad = {**body, "metadata": {"name": "w2"}, "spec": {"gpus": -1}}
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object(group, "v1", namespace, plural, bad)
    assert refused.value.status == 422  # schema validation runs server side


def _create_when_served(
    custom: client.CustomObjectsApi, group: str, namespace: str, plural: str, body: dict[str, Any]
) -> bool | None:
    try:
        custom.create_namespaced_custom_object(group, "v1", namespace, plural, body)
    except ApiException as exc:
        if exc.status == 404:  # discovery of a fresh CRD lags Established by a moment
            return None
        raise
    return True


def _gpu_deployment(name: str, replicas: int, gpus: int) -> client.V1Deployment:
    labels = {"app": name}
    container = client.V1Container(
        name="engine",
        image="registry.invalid/slipstream/fake-vllm:0",
        resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(gpus)}),
    )
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1DeploymentSpec(
            replicas=replicas,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels),
                spec=client.V1PodSpec(containers=[container]),
            ),
        ),
    )


def test_gpu_deployment_runs_on_fake_nodes_with_loopback_ips(
    admin_api: client.ApiClient, namespace: str
) -> None:
    apps, core = client.AppsV1Api(admin_api), client.CoreV1Api(admin_api)
    apps.create_namespaced_deployment(namespace, _gpu_deployment("engine", 2, 1))

    def running_pods() -> list[dict[str, Any]] | None:
        pods = map(wire, core.list_namespaced_pod(namespace, label_selector="app=engine").items)
        ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return ok if len(ok) == 2 else None

    pods = eventually("2 Running engine pods", running_pods, timeout=90)
    for pod in pods:
        node_name = pod["spec"]["nodeName"]
        assert node_name.startswith("gpu-node-")
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        ip = ipaddress.IPv4Address(pod["status"]["podIP"])
        assert ip in LOOPBACK_NET and ip in POD_NETWORK, ip
        node = wire(core.read_node(node_name))
        assert ip in ipaddress.IPv4Network(node["spec"]["podCIDR"])
        _serve_and_connect(str(ip))

    def available() -> dict[str, Any] | None:
        status = wire(apps.read_namespaced_deployment("engine", namespace))["status"]
        return status if status.get("availableReplicas") == 2 else None

    assert eventually("deployment available", available)["readyReplicas"] == 2


def _serve_and_connect(ip: str) -> None:
    """A real TCP listener on the pod's IP, and a client that reaches it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((ip, 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection((ip, port), timeout=5) as conn:
            accepted, _ = server.accept()
            with accepted:
                conn.sendall(b"ping")
                assert accepted.recv(4) == b"ping"
                accepted.sendall(b"pong")
                assert conn.recv(4) == b"pong"


def test_scheduler_honours_gpu_capacity(
    cluster: LocalCluster, admin_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(admin_api)
    too_many = cluster.config.gpus_per_node + 1
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="greedy"),
        spec=client.V1PodSpec(
            containers=[
                client.V1Container(
                    name="engine",
                    image="registry.invalid/x:0",
                    resources=client.V1ResourceRequirements(
                        limits={"nvidia.com/gpu": str(too_many)}
                    ),
                )
            ]
        ),
    )
    core.create_namespaced_pod(namespace, pod)

    def unschedulable() -> str | None:
        got = wire(core.read_namespaced_pod("greedy", namespace))
        for cond in got["status"].get("conditions") or []:
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                return str(cond.get("message"))
        return None

    message = eventually("FailedScheduling", unschedulable)
    assert "nvidia.com/gpu" in message
    assert wire(core.read_namespaced_pod("greedy", namespace))["spec"].get("nodeName") is None


def test_restricted_service_account_is_least_privilege(
    cluster: LocalCluster, restricted_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(restricted_api)
    own = cluster.restricted_namespace
    # Granted by its Role: read pods, write configmaps in its own namespace.
    core.list_namespaced_pod(own)
    name = f"cm-{namespace[-6:]}"
    core.create_namespaced_config_map(
        own, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name), data={"k": "v"})
    )
    core.delete_namespaced_config_map(name, own)
    # Not granted: secrets in its namespace, anything in another namespace, cluster scope.
    refused: list[Callable[[], object]] = [
        lambda: core.list_namespaced_secret(own),
        lambda: core.list_namespaced_pod(namespace),
        core.list_node,
        lambda: core.create_namespaced_pod(
            own,
            client.V1Pod(
                metadata=client.V1ObjectMeta(name="nope"),
                spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="x")]),
            ),
        ),
    ]
    for call in refused:
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403, denied.value.body
        assert "forbidden" in str(denied.value.body).lower()
