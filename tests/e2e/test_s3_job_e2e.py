"""An OfflineJob whose input and output are ``s3://`` objects, end to end on the local cluster.

An S3 server (moto's, the one s3fs's own suite tests against) listens on loopback. The
operator runs as a process with the job storage a platform would give it: a claim
(``jobStorage.pvc``), here a hostPath PersistentVolume of a folder of this host, and the S3
endpoint and credentials in its environment, as the chart sets them. The job reads its input
from the bucket while planning, the pods' sidecars (processes on the pods' IPs, as in
test_operator_e2e.py) run the shards from the staging folder on the claim, and the operator
uploads the merged output and error files to the bucket. Checked: the job Succeeded, every
``custom_id`` is in the uploaded objects exactly once, the staging folder lies in the job's
namespace folder on the claim, and a job whose output is ``s3://`` is refused with a message
naming the setting when the operator has no claim to stage on (a second operator process).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
from kubernetes import client
from moto.moto_server.threaded_moto_server import ThreadedMotoServer

from e2e.test_operator_e2e import (
    eventually,
    kubectl,
    mmlu_batch,
    prepared_examples,
    start_operator,
    start_pods,
)
from integration.helpers_procs import Proc
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "slipstream-test", "AWS_SECRET_ACCESS_KEY": "not-a-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def claim_folder() -> Iterator[Path]:
    """The claim's folder, which is also its mount path (the operator refuses one under /tmp,
    its pod's own scratch space): it lives in the user's cache."""
    folder = Path.home() / ".cache" / "slipstream" / "s3-e2e" / uuid.uuid4().hex[:8] / "jobs"
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder.parent, ignore_errors=True)


@contextlib.contextmanager
def bound_claim(core: client.CoreV1Api, namespace: str, folder: Path) -> Iterator[None]:
    """A hostPath PersistentVolume reserved for the namespace's ``jobs`` claim, and the claim
    (what a ReadWriteMany storage class would provision); the volume is removed after."""
    name = f"{namespace}-jobs"
    core.create_persistent_volume({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                 "claimRef": {"namespace": namespace, "name": "jobs"},
                 "hostPath": {"path": str(folder), "type": "Directory"}}})
    try:
        core.create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "jobs"},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "volumeName": name, "resources": {"requests": {"storage": "10Gi"}}}})
        yield
    finally:
        core.delete_persistent_volume(name)


def job_doc(name: str, namespace: str, output: str) -> dict[str, Any]:
    return {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": "llama-2-7b", "input": {"uri": f"s3://batch/{namespace}/in.jsonl"},
                 "output": {"uri": output},
                 "serviceSelector": {"matchLabels": {"slipstream.dev/pool": "shared"}},
                 "shardSize": 20},
    }


def status_of(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    doc = json.loads(
        kubectl(cluster, "get", "-n", namespace, "offlinejob", name, "-o", "json").stdout)
    result: dict[str, Any] = doc.get("status", {})
    return result


def test_an_s3_job_is_staged_on_the_claim_and_uploaded_exactly_once(
    cluster: LocalCluster,
    admin_api: client.ApiClient,
    namespace: str,
    tmp_path: Path,
    procs: list[Proc],
    s3_endpoint: str,
    claim_folder: Path,
) -> None:
    store = s3fs.S3FileSystem(key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                              secret=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                              endpoint_url=s3_endpoint)
    store.mkdir("batch")
    wanted = mmlu_batch(tmp_path / "in.jsonl", subjects=4, per_subject=20, max_tokens=16)
    store.put_file(str(tmp_path / "in.jsonl"), f"batch/{namespace}/in.jsonl")

    # Without a claim to stage on, the operator refuses the job and says what to set.
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    (tmp_path / "bare").mkdir()
    bare = start_operator(cluster, namespace, tmp_path / "bare", stall_s=30)
    procs.append(bare)
    refused = job_doc("refused", namespace, f"s3://batch/{namespace}/refused.jsonl")
    (tmp_path / "refused.json").write_text(json.dumps(refused))
    kubectl(cluster, "apply", "-f", str(tmp_path / "refused.json"))

    def not_admitted() -> dict[str, Any] | None:
        conds = {c["type"]: c for c in status_of(cluster, namespace, "refused")
                 .get("conditions", [])}
        admitted = conds.get("Admitted", {})
        return admitted if admitted.get("reason") == "NoStagingFolder" else None

    admitted = eventually("the s3:// job refused for want of a claim", not_admitted)
    assert admitted["status"] == "False" and "jobStorage.pvc" in admitted["message"]
    # Deleted while its operator runs (it holds the job's finalizer), then that one stops.
    kubectl(cluster, "delete", "-n", namespace, "offlinejob", "refused")
    bare.stop()
    procs.remove(bare)

    # With the claim and the store's endpoint, as the chart configures the operator.
    with bound_claim(client.CoreV1Api(admin_api), namespace, claim_folder):
        env = {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": s3_endpoint,
               "AWS_ENDPOINT_URL": s3_endpoint,
               "SLIPSTREAM_OPERATOR_JOB_STORAGE": json.dumps(
                   {"pvc": {"claim_name": "jobs", "mount_path": str(claim_folder)}})}
        procs.append(start_operator(cluster, namespace, tmp_path, stall_s=30, env=env))
        examples, _, _ = prepared_examples(tmp_path)
        kubectl(cluster, "apply", "-n", namespace, "-f", str(examples / "inferenceservice.yaml"))
        start_pods(admin_api, namespace, tmp_path, procs)
        output = f"s3://batch/{namespace}/results/out.jsonl"
        (tmp_path / "job.json").write_text(json.dumps(job_doc("staged", namespace, output)))
        kubectl(cluster, "apply", "-f", str(tmp_path / "job.json"))

        def finished() -> dict[str, Any] | None:
            st = status_of(cluster, namespace, "staged")
            assert st.get("phase") != "Failed", st
            return st if st.get("phase") == "Succeeded" else None

        final = eventually("the s3:// job to succeed", finished, timeout=300.0)
        store.invalidate_cache()
        out = [json.loads(x)["custom_id"]
               for x in store.cat_file(output[len("s3://"):]).decode().splitlines()]
        errors = store.cat_file(output[len("s3://"):-len(".jsonl")] + ".errors.jsonl")
        errs = [json.loads(x)["custom_id"] for x in errors.decode().splitlines()]
        assert sorted(out + errs) == sorted(wanted)  # every request exactly once
        assert len(out) == len(set(out)) and out
        assert final["requests"]["total"] == len(wanted)
        staging = list((claim_folder / namespace / ".slipstream").glob("staged-*"))
        assert len(staging) == 1 and (staging[0] / "plan.json").exists(), staging
        assert not list(tmp_path.rglob("out.jsonl"))  # nothing written beside a local path
        assert os.path.isdir(staging[0] / "shards")
