"""The pod runner reads a pod's volumes and environment from a real API server, as a kubelet.

Secrets, ConfigMaps, a hostPath PersistentVolume bound to a claim by the real controller
manager, and pods as the API serves them: each container's mounts become local folders (a
claim's the folder of the hostPath volume it is bound to), its ``env``/``envFrom`` resolved.
What a kubelet would refuse (a missing Secret or key, an unbound or missing claim, a volume no
host folder stands for) is an error naming the reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from slipstream_testbed.podmaterials import MaterialError, PodMaterials

pytestmark = pytest.mark.cluster


def wait_for(what: str, cond: Callable[[], Any], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while (got := cond()) is None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def pod_with(namespace: str, name: str, volumes: list[dict[str, Any]],
             container: dict[str, Any]) -> dict[str, Any]:
    """A pod created on the API server, as it serves it back (JSON field names)."""
    core_body = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": name, "namespace": namespace,
                              "labels": {"app": "materials", "tier": "test"}},
                 "spec": {"volumes": volumes,
                          "containers": [{"name": "c", "image": "none", **container}]}}
    return core_body


@pytest.fixture
def core(admin_api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(admin_api)


def created(core: client.CoreV1Api, admin_api: client.ApiClient, body: dict[str, Any]) -> Any:
    pod = core.create_namespaced_pod(body["metadata"]["namespace"], body)
    return admin_api.sanitize_for_serialization(pod)  # type: ignore[no-untyped-call]


def hostpath_claim(core: client.CoreV1Api, namespace: str, name: str, folder: Path,
                   *, source: dict[str, Any] | None = None) -> str:
    """A PersistentVolume (a hostPath of ``folder``, or ``source``) and a claim of ``name``
    bound to it by the controller manager; returns the volume's name."""
    pv_name = f"{namespace}-{name}"
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv_name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "claimRef": {"namespace": namespace, "name": name},
                 **(source or {"hostPath": {"path": str(folder), "type": "Directory"}})}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                 "volumeName": pv_name, "resources": {"requests": {"storage": "1Gi"}}}})
    wait_for(f"claim {name} bound", lambda: True if (
        core.read_namespaced_persistent_volume_claim(name, namespace).status.phase == "Bound"
    ) else None)
    return pv_name


def test_volumes_become_the_folders_a_kubelet_would_mount(
    core: client.CoreV1Api, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
) -> None:
    weights = tmp_path / "store"
    (weights / "tiny").mkdir(parents=True)
    (weights / "tiny" / "config.json").write_text("{}")
    pv = hostpath_claim(core, namespace, "weights", weights)
    core.create_namespaced_secret(namespace, {"metadata": {"name": "tok"},
                                              "stringData": {"token": "s3cret"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"},
                                                  "data": {"a.yaml": "x: 1"}})
    made = tmp_path / "host" / "made"
    try:
        pod = created(core, admin_api, pod_with(namespace, "p", [
            {"name": "weights", "persistentVolumeClaim": {"claimName": "weights",
                                                         "readOnly": True}},
            {"name": "tok", "secret": {"secretName": "tok"}},
            {"name": "cfg", "configMap": {"name": "cfg"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "made", "hostPath": {"path": str(made), "type": "DirectoryOrCreate"}},
        ], {"volumeMounts": [
            {"name": "weights", "mountPath": "/mnt/models", "readOnly": True},
            {"name": "weights", "mountPath": "/mnt/tiny", "subPath": "tiny"},
            {"name": "tok", "mountPath": "/var/run/tok"},
            {"name": "cfg", "mountPath": "/etc/cfg"},
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "made", "mountPath": "/made"},
        ]}))
        materials = PodMaterials(core, pod, tmp_path / "pod")
        mounts = materials.volumes(pod["spec"]["containers"][0])
        assert mounts["/mnt/models"] == weights  # the bound volume's own folder
        assert (mounts["/mnt/tiny"] / "config.json").read_text() == "{}"
        assert (mounts["/var/run/tok"] / "token").read_text() == "s3cret"
        assert (mounts["/etc/cfg"] / "a.yaml").read_text() == "x: 1"
        assert mounts["/scratch"].is_dir() and mounts["/scratch"].parent.parent == tmp_path / "pod"
        assert mounts["/made"] == made and made.is_dir()
        # The API server's own service account volume (kube-api-access-*, projected): a token
        # of the pod's account, the cluster's CA and the namespace, as the kubelet writes them.
        sa = mounts["/var/run/secrets/kubernetes.io/serviceaccount"]
        assert (sa / "namespace").read_text() == namespace
        assert (sa / "ca.crt").read_text().startswith("-----BEGIN CERTIFICATE-----")
        review = client.AuthenticationV1Api(admin_api).create_token_review(
            client.V1TokenReview(spec=client.V1TokenReviewSpec(token=(sa / "token").read_text())))
        assert review.status.authenticated
        assert review.status.user.username == f"system:serviceaccount:{namespace}:default"
    finally:
        core.delete_persistent_volume(pv)


def test_claims_and_volumes_a_kubelet_would_refuse_name_the_reference(
    core: client.CoreV1Api, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
) -> None:
    pv = hostpath_claim(core, namespace, "nfs", tmp_path,
                        source={"nfs": {"server": "nfs.storage.example", "path": "/exports"}})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "pending"},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "none-such",
                 "resources": {"requests": {"storage": "1Gi"}}}})
    try:
        cases = {
            "missing": ({"persistentVolumeClaim": {"claimName": "missing"}},
                        "persistentvolumeclaim 'missing' not found"),
            "pending": ({"persistentVolumeClaim": {"claimName": "pending"}},
                        "persistentvolumeclaim 'pending' is not bound"),
            "nfs": ({"persistentVolumeClaim": {"claimName": "nfs"}},
                    f"persistentvolume '{pv}' is neither hostPath nor local"),
            "gone": ({"hostPath": {"path": str(tmp_path / "absent"), "type": "Directory"}},
                     "is not a folder on this host"),
            "share": ({"nfs": {"server": "nfs.storage.example", "path": "/x"}},
                      "nfs is not run here"),
            "sec": ({"secret": {"secretName": "absent"}}, "Secret 'absent' not found"),
        }
        for i, (name, (source, message)) in enumerate(cases.items()):
            pod = created(core, admin_api, pod_with(
                namespace, f"bad-{i}", [{"name": name, **source}],
                {"volumeMounts": [{"name": name, "mountPath": "/v"}]}))
            with pytest.raises(MaterialError, match=message.replace("(", r"\(")):
                PodMaterials(core, pod, tmp_path / name).volumes(pod["spec"]["containers"][0])
        # An optional Secret that is absent is an empty folder, as for the kubelet.
        pod = created(core, admin_api, pod_with(
            namespace, "optional", [{"name": "o", "secret": {"secretName": "absent",
                                                             "optional": True}}],
            {"volumeMounts": [{"name": "o", "mountPath": "/o"}]}))
        mounts = PodMaterials(core, pod, tmp_path / "o").volumes(pod["spec"]["containers"][0])
        assert list(mounts["/o"].iterdir()) == []
    finally:
        core.delete_persistent_volume(pv)


def test_environment_is_resolved_from_secrets_configmaps_and_the_pod(
    core: client.CoreV1Api, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
) -> None:
    core.create_namespaced_secret(namespace, {"metadata": {"name": "hf-token"},
                                              "stringData": {"HF_TOKEN": "hf_abc"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "s3"}, "stringData": {
        "AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "shh", "1st": "x"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "tuning"},
                                                  "data": {"LEVEL": "debug", "HF_HOME": "/c"}})
    pod = created(core, admin_api, pod_with(namespace, "env", [], {
        "envFrom": [{"secretRef": {"name": "s3"}},
                    {"configMapRef": {"name": "tuning"}, "prefix": "APP_"}],
        "env": [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                               "key": "HF_TOKEN"}}},
            {"name": "HOME_DIR", "valueFrom": {"configMapKeyRef": {"name": "tuning",
                                                                  "key": "HF_HOME"}}},
            {"name": "MAYBE", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k",
                                                            "optional": True}}},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "TIER", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['tier']"}}},
            {"name": "APP_LEVEL", "value": "info"},  # env wins over envFrom
        ]}))
    env = PodMaterials(core, pod, tmp_path).environment(pod["spec"]["containers"][0])
    assert env == {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "shh",
                   "APP_LEVEL": "info", "APP_HF_HOME": "/c", "HF_TOKEN": "hf_abc",
                   "HOME_DIR": "/c", "POD": "env", "TIER": "test"}
    for i, (entry, message) in enumerate((
        ({"secretKeyRef": {"name": "hf-token", "key": "TOKEN"}},
         "env X: key 'TOKEN' not in Secret 'hf-token'"),
        ({"secretKeyRef": {"name": "absent", "key": "k"}}, "Secret 'absent' not found"),
        ({"configMapKeyRef": {"name": "tuning", "key": "nope"}},
         "env X: key 'nope' not in ConfigMap 'tuning'"),
        ({"resourceFieldRef": {"resource": "limits.cpu"}}, "env X: valueFrom"),
    )):
        bad = created(core, admin_api, pod_with(namespace, f"bad-env-{i}", [], {
            "env": [{"name": "X", "valueFrom": entry}]}))
        with pytest.raises(MaterialError, match=message):
            PodMaterials(core, bad, tmp_path).environment(bad["spec"]["containers"][0])
