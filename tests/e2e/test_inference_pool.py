"""``spec.gateway.inferencePool`` on the real local cluster, with the InferencePool CRD installed.

The InferencePool CRD is the Gateway API Inference Extension's own (``../shared/data/
gateway-api-inference-extension``), installed into the API server; the operator runs as a
process (``slipstream operator``). A service that asks for a pool gets one of its name, owned
by it, whose selector lists exactly the service's pods (checked by listing pods with it: the
service's Deployment pods, not another service's, not a pod that only borrows the service
label), whose target port is the sidecar's serving port and whose endpoint picker is the
spec's. Editing the spec edits the pool; turning it off deletes it; deleting the service
garbage-collects it. Without the CRD the service says so in its ``InferencePool`` condition
and its Deployment is made as always. With the chart's namespaced RBAC, run as its service
account, the operator makes the pool when ``gateway.inferencePool.enabled`` is on, and says
``Forbidden`` in the condition (making everything else) when it is off.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.test_operator_e2e import SLIPSTREAM, Proc, eventually, kubectl, start_operator
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
POOL_CRD = "inferencepools.inference.networking.k8s.io"
GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"


def crd_file(shared_data: Path) -> Path:
    return shared_data / "gateway-api-inference-extension" / f"{GROUP}_{PLURAL}.yaml"


def install_pool_crd(cluster: LocalCluster, admin_api: client.ApiClient, path: Path) -> None:
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(path))
    kubectl(cluster, "wait", "--for=condition=Established", "--timeout=60s", f"crd/{POOL_CRD}")
    objects = client.CustomObjectsApi(admin_api)

    def served() -> bool | None:
        try:
            objects.get_api_resources(GROUP, VERSION)
        except client.ApiException:
            return None
        return True

    eventually("inference.networking.k8s.io/v1 served", served, timeout=60)


def remove_pool_crd(cluster: LocalCluster, admin_api: client.ApiClient) -> None:
    kubectl(cluster, "delete", "crd", POOL_CRD, "--ignore-not-found", "--wait=true")
    objects = client.CustomObjectsApi(admin_api)

    def gone() -> bool | None:
        try:
            objects.get_api_resources(GROUP, VERSION)
        except client.ApiException as exc:
            return True if exc.status == 404 else None
        return None

    eventually("inference.networking.k8s.io/v1 no longer served", gone, timeout=60)


@pytest.fixture
def operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pods here run no sidecar: the deletion drain has nothing to wait for.
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_DELETE_DRAIN_TIMEOUT_S", "0")


def service(name: str, *, pool: dict[str, Any] | None, replicas: int = 2) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": "llama-2-7b",
        "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpuType": "h100"},
        "replicas": replicas,
        "slo": {"tbt": {"p99": "150ms"}},
    }
    if pool is not None:
        spec["gateway"] = {"inferencePool": pool}
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}


PICKER = {"name": "chat-epp", "port": {"number": 9002}}


def create(objects: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> str:
    made: Any = objects.create_namespaced_custom_object("slipstream.dev", "v1alpha1", namespace,
                                                   "inferenceservices", body)
    return str(made["metadata"]["uid"])


def read_pool(objects: client.CustomObjectsApi, namespace: str,
              name: str) -> dict[str, Any] | None:
    try:
        pool = objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    assert isinstance(pool, dict)
    return pool


def condition(objects: client.CustomObjectsApi, namespace: str, name: str,
              type_: str) -> dict[str, Any] | None:
    svc: Any = objects.get_namespaced_custom_object("slipstream.dev", "v1alpha1", namespace,
                                               "inferenceservices", name)
    for cond in (svc.get("status") or {}).get("conditions") or ():
        if cond.get("type") == type_:
            return dict(cond)
    return None


def running_pods(core: client.CoreV1Api, namespace: str, selector: str) -> set[str]:
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return {str(p.metadata.name) for p in pods
            if p.metadata is not None and p.metadata.deletion_timestamp is None}


def test_pool_follows_the_service(
    cluster: LocalCluster, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    shared_data: Path, procs: list[Proc], operator_env: None,
) -> None:
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    install_pool_crd(cluster, admin_api, crd_file(shared_data))
    objects = client.CustomObjectsApi(admin_api)
    core = client.CoreV1Api(admin_api)
    uid = create(objects, namespace, service("chat", pool={"enabled": True,
                                                           "endpointPickerRef": PICKER}))
    create(objects, namespace, service("other", pool=None))
    # A pod that carries the service label but is not the operator's.
    core.create_namespaced_pod(namespace, client.V1Pod(
        metadata=client.V1ObjectMeta(name="borrowed", labels={"slipstream.dev/service": "chat"}),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="busybox")])))
    procs.append(start_operator(cluster, namespace, tmp_path, stall_s=60))

    pool = eventually("the chat InferencePool", lambda: read_pool(objects, namespace, "chat"))
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002},
        "failureMode": "FailClose"}
    owners = pool["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"], o["controller"]) for o in owners] == [
        ("InferenceService", "chat", uid, True)]
    assert read_pool(objects, namespace, "other") is None

    # The selector picks the chat Deployment's pods: not other's, not the borrowed one.
    match = pool["spec"]["selector"]["matchLabels"]
    selector = ",".join(f"{k}={v}" for k, v in sorted(match.items()))

    def both_services_up() -> bool | None:
        chat = running_pods(core, namespace, "slipstream.dev/service=chat")
        other = running_pods(core, namespace, "slipstream.dev/service=other")
        return True if len(chat) == 3 and len(other) == 2 else None

    eventually("the services' pods", both_services_up)
    apps = client.AppsV1Api(admin_api)
    deployment: Any = apps.read_namespaced_deployment("chat", namespace)
    assert deployment.metadata.owner_references[0].uid == uid
    all_pods: Any = core.list_namespaced_pod(namespace).items
    owned_by_chat = {
        str(p.metadata.name) for p in all_pods
        if any(o.kind == "ReplicaSet" and o.name.startswith("chat-")
               for o in p.metadata.owner_references or ())
    }
    assert len(owned_by_chat) == 2
    assert running_pods(core, namespace, selector) == owned_by_chat
    assert "borrowed" not in running_pods(core, namespace, selector)

    applied = eventually("InferencePool condition",
                         lambda: condition(objects, namespace, "chat", "InferencePool"))
    assert (applied["status"], applied["reason"]) == ("True", "Applied"), applied
    assert condition(objects, namespace, "other", "InferencePool") is None

    # A spec change reaches the pool: the serving port and the picker.
    objects.patch_namespaced_custom_object(
        "slipstream.dev", "v1alpha1", namespace, "inferenceservices", "chat",
        {"spec": {"sidecar": {"httpPort": 8100},
                  "gateway": {"inferencePool": {"endpointPickerRef": {
                      "name": "chat-epp-v2", "port": {"number": 9003},
                      "failureMode": "FailOpen"}}}}})

    def updated() -> dict[str, Any] | None:
        now = read_pool(objects, namespace, "chat")
        return now if now and now["spec"]["targetPorts"] == [{"number": 8100}] else None

    pool = eventually("the pool on port 8100", updated)
    assert pool["spec"]["endpointPickerRef"]["name"] == "chat-epp-v2"
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9003}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"

    # Off: the pool goes and so does the condition.
    objects.patch_namespaced_custom_object(
        "slipstream.dev", "v1alpha1", namespace, "inferenceservices", "chat",
        {"spec": {"gateway": {"inferencePool": {"enabled": False}}}})
    eventually("the pool deleted",
               lambda: True if read_pool(objects, namespace, "chat") is None else None)
    eventually("the condition removed",
               lambda: True if condition(objects, namespace, "chat", "InferencePool") is None
               else None)

    # On again, then the service is deleted: the garbage collector takes the pool.
    objects.patch_namespaced_custom_object(
        "slipstream.dev", "v1alpha1", namespace, "inferenceservices", "chat",
        {"spec": {"gateway": {"inferencePool": {"enabled": True}}}})
    eventually("the pool back", lambda: read_pool(objects, namespace, "chat"))
    objects.delete_namespaced_custom_object("slipstream.dev", "v1alpha1", namespace,
                                            "inferenceservices", "chat")
    eventually("the pool garbage-collected",
               lambda: True if read_pool(objects, namespace, "chat") is None else None,
               timeout=120)


def test_condition_when_the_crd_is_absent(
    cluster: LocalCluster, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    shared_data: Path, procs: list[Proc], operator_env: None,
) -> None:
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    remove_pool_crd(cluster, admin_api)
    objects = client.CustomObjectsApi(admin_api)
    try:
        create(objects, namespace, service("chat", replicas=1,
                                           pool={"enabled": True, "endpointPickerRef": PICKER}))
        procs.append(start_operator(cluster, namespace, tmp_path, stall_s=60))
        missing = eventually("InferencePool condition",
                             lambda: condition(objects, namespace, "chat", "InferencePool"))
        assert (missing["status"], missing["reason"]) == ("False", "CRDNotInstalled"), missing
        assert "InferencePool CRD" in missing["message"]
        # The rest of the service is made and reported as always.
        apps = client.AppsV1Api(admin_api)
        eventually("the Deployment",
                   lambda: apps.read_namespaced_deployment("chat", namespace))
        eventually("the Ready condition",
                   lambda: condition(objects, namespace, "chat", "Ready"))
    finally:
        install_pool_crd(cluster, admin_api, crd_file(shared_data))


def test_the_api_server_refuses_a_pool_without_a_picker(
    cluster: LocalCluster, namespace: str, tmp_path: Path,
) -> None:
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    path = tmp_path / "no-picker.yaml"
    path.write_text(yaml.safe_dump(service("chat", pool={"enabled": True})))
    rejected = kubectl(cluster, "apply", "-n", namespace, "-f", str(path), check=False)
    assert rejected.returncode != 0
    assert "endpointPickerRef is required when enabled" in rejected.stderr


def operator_as(cluster: LocalCluster, namespace: str, kubeconfig: Path, log: Path) -> Proc:
    """``slipstream operator`` with ``kubeconfig``'s account, watching ``namespace`` only."""
    proc = Proc("operator", [*SLIPSTREAM, "-v", "operator", "--kubeconfig", str(kubeconfig),
                             "-n", namespace, "--loopback-only", "--interval", "1"], log, 0)
    with log.open("ab") as out:
        proc.popen = subprocess.Popen(proc.args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                      start_new_session=True)
    return proc


@pytest.mark.parametrize("granted", [True, False], ids=["pools-granted", "pools-not-granted"])
def test_the_charts_rbac_is_what_the_pool_needs(
    cluster: LocalCluster, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    shared_data: Path, procs: list[Proc], operator_env: None, granted: bool,
) -> None:
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    install_pool_crd(cluster, admin_api, crd_file(shared_data))
    rendered = subprocess.run(
        [str(cluster.helm), "template", "rel", str(REPO / "charts" / "slipstream"), "-n",
         namespace, "--set", "operator.watchNamespaces=release", "--set", "operator.replicas=0",
         "--set", f"gateway.inferencePool.enabled={str(granted).lower()}"],
        capture_output=True, text=True, check=True, timeout=120).stdout
    rbac = [d for d in yaml.safe_load_all(rendered)
            if d and d["kind"] in ("Role", "RoleBinding", "ServiceAccount")]
    (tmp_path / "rbac.yaml").write_text(yaml.safe_dump_all(rbac))
    kubectl(cluster, "apply", "-n", namespace, "-f", str(tmp_path / "rbac.yaml"))
    sa = next(d["metadata"]["name"] for d in rbac if d["kind"] == "ServiceAccount")
    kubeconfig = cluster.service_account_kubeconfig(namespace, sa, tmp_path / "sa.kubeconfig")
    objects = client.CustomObjectsApi(admin_api)
    create(objects, namespace, service("chat", replicas=1,
                                       pool={"enabled": True, "endpointPickerRef": PICKER}))
    procs.append(operator_as(cluster, namespace, kubeconfig, tmp_path / "operator.log"))

    said = eventually("InferencePool condition",
                      lambda: condition(objects, namespace, "chat", "InferencePool"))
    if granted:
        assert (said["status"], said["reason"]) == ("True", "Applied"), said
        assert read_pool(objects, namespace, "chat") is not None
        # Off again: the account may delete the pool it made.
        objects.patch_namespaced_custom_object(
            "slipstream.dev", "v1alpha1", namespace, "inferenceservices", "chat",
            {"spec": {"gateway": {"inferencePool": {"enabled": False}}}})
        eventually("the pool deleted",
                   lambda: True if read_pool(objects, namespace, "chat") is None else None)
    else:
        assert (said["status"], said["reason"]) == ("False", "Forbidden"), said
        assert "gateway.inferencePool.enabled" in said["message"]
        assert read_pool(objects, namespace, "chat") is None
        apps = client.AppsV1Api(admin_api)
        eventually("the Deployment", lambda: apps.read_namespaced_deployment("chat", namespace))
