"""Deleting an InferenceService moves its offline shards to another service, exactly once.

On the real local cluster: two services of the same pool (``chat`` and
``spare``, one pod each, each pod a real engine model and sidecar on the pod's
loopback IP), an OfflineJob spread over both, and the operator as a process.
Once ``chat``'s sidecar runs a shard, ``chat`` is deleted: the operator's
finalizer drains the pod (its sidecar reports ``draining`` and no shard), the
InferenceService goes away, a ``Drained`` event is recorded, and the job
finishes on ``spare`` with every ``custom_id`` exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.test_operator_e2e import (
    REPO,
    SLIPSTREAM,
    PodProc,
    Proc,
    engine_proc,
    eventually,
    kubectl,
    mmlu_batch,
    start_operator,
)
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]


def service(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "slipstream.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "labels": {"slipstream.dev/pool": "shared"}},
        "spec": {
            "model": "llama-2-7b",
            "engine": {"image": "vllm/vllm-openai:v0.11.0", "args": ["--max-num-seqs", "64"],
                       "gpuType": "h100"},
            "replicas": 1,
            "slo": {"tbt": {"p99": "150ms"}},
        },
    }


def token_of(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    import base64

    try:
        secret = core.read_namespaced_secret(f"{name}-control-token", namespace)
    except client.ApiException:
        return None
    raw = (secret.data or {}).get("token")
    return base64.b64decode(raw).decode() if raw else None


def start_pod(core: client.CoreV1Api, namespace: str, name: str, tmp_path: Path,
              procs: list[Proc]) -> tuple[str, str]:
    """A real engine model and sidecar on the service's pod IP; returns (ip, token)."""

    def pod_ip() -> str | None:
        pods = core.list_namespaced_pod(namespace,
                                        label_selector=f"slipstream.dev/service={name}")
        ips = [p.status.pod_ip for p in pods.items
               if p.status is not None and p.status.phase == "Running" and p.status.pod_ip]
        return ips[0] if len(ips) == 1 else None

    ip = eventually(f"the running pod of {name}", pod_ip)
    token = eventually(f"the control token of {name}", lambda: token_of(core, namespace, name))
    token_file = tmp_path / f"{name}.token"
    token_file.write_text(token)
    engine = engine_proc(tmp_path, name=f"engine-{name}", mean_output_tokens=16)
    procs.append(engine.start())
    sidecar = PodProc(
        f"sidecar-{name}",
        [*SLIPSTREAM, "sidecar", "--engine", engine.url, "--host", ip, "--http-port", "8000",
         "--grpc-port", "9000", "--auth-token-file", str(token_file), "--state-dir",
         str(tmp_path / f"state-{name}"), "--max-num-seqs", "64", "--kv-blocks", "4096"],
        tmp_path / f"sidecar-{name}.log",
        8000,
        host=ip,
    )
    procs.append(sidecar.start())
    return ip, token


def sidecar_status(ip: str, token: str) -> Any:
    import grpc

    from slipstream_sidecar.proto import sidecar_pb2, sidecar_pb2_grpc

    with grpc.insecure_channel(f"{ip}:9000") as channel:
        stub = sidecar_pb2_grpc.SidecarStub(channel)
        try:
            return stub.Status(sidecar_pb2.StatusRequest(),
                               metadata=(("authorization", f"Bearer {token}"),), timeout=5)
        except grpc.RpcError:
            return None


def test_deleting_a_service_moves_its_shards_and_the_job_finishes_exactly_once(
    cluster: LocalCluster,
    admin_api: client.ApiClient,
    namespace: str,
    tmp_path: Path,
    procs: list[Proc],
) -> None:
    from slipstream_sidecar.proto import sidecar_pb2

    core = client.CoreV1Api(admin_api)
    kubectl(cluster, "apply", "-f", str(REPO / "crds"))
    procs.append(start_operator(cluster, namespace, tmp_path, stall_s=60))
    for name in ("chat", "spare"):
        (tmp_path / f"{name}.json").write_text(json.dumps(service(name)))
        kubectl(cluster, "apply", "-n", namespace, "-f", str(tmp_path / f"{name}.json"))
    chat_ip, chat_token = start_pod(core, namespace, "chat", tmp_path, procs)
    start_pod(core, namespace, "spare", tmp_path, procs)

    wanted = mmlu_batch(tmp_path / "big.jsonl", subjects=8, per_subject=40, max_tokens=24)
    job = {
        "apiVersion": "slipstream.dev/v1alpha1",
        "kind": "OfflineJob",
        "metadata": {"name": "mover"},
        "spec": {
            "model": "llama-2-7b",
            "input": {"uri": f"file://{tmp_path}/big.jsonl"},
            "output": {"uri": f"file://{tmp_path}/out/mover.jsonl"},
            "serviceSelector": {"matchLabels": {"slipstream.dev/pool": "shared"}},
            "shardSize": 20,
        },
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    kubectl(cluster, "apply", "-n", namespace, "-f", str(tmp_path / "job.json"))

    def chat_busy() -> str | None:
        reply = sidecar_status(chat_ip, chat_token)
        if reply is None:
            return None
        running = [s.shard_id for s in reply.shards
                   if s.state == sidecar_pb2.SHARD_STATE_RUNNING
                   and s.completed + s.failed < s.total]
        return running[0] if running else None

    eventually("a shard running on chat's pod", chat_busy, timeout=120.0)
    kubectl(cluster, "delete", "-n", namespace, "inferenceservice.slipstream.dev", "chat",
            "--wait=false")

    def gone() -> bool | None:
        got = kubectl(cluster, "get", "-n", namespace, "inferenceservice.slipstream.dev", "chat",
                      check=False)
        return True if got.returncode != 0 and "NotFound" in got.stderr else None

    eventually("chat to be deleted once drained", gone, timeout=120.0)
    drained = sidecar_status(chat_ip, chat_token)
    assert drained is not None and drained.draining
    assert not [s for s in drained.shards
                if s.state in (sidecar_pb2.SHARD_STATE_PENDING, sidecar_pb2.SHARD_STATE_RUNNING)]
    events = kubectl(cluster, "get", "events", "-n", namespace, "--field-selector",
                     "involvedObject.name=chat").stdout
    assert "Drained" in events, events

    def finished() -> dict[str, Any] | None:
        doc = json.loads(kubectl(cluster, "get", "-n", namespace, "offlinejob", "mover", "-o",
                                 "json").stdout)
        st: dict[str, Any] = doc.get("status", {})
        assert st.get("phase") != "Failed", st
        return st if st.get("phase") == "Succeeded" else None

    final = eventually("the job to succeed on spare", finished, timeout=300.0)
    out = [json.loads(x)["custom_id"]
           for x in (tmp_path / "out" / "mover.jsonl").read_text().splitlines()]
    errs = [json.loads(x)["custom_id"]
            for x in (tmp_path / "out" / "mover.errors.jsonl").read_text().splitlines()]
    assert sorted(out + errs) == sorted(wanted)  # every request exactly once
    assert final["requests"]["completed"] + final["requests"]["failed"] == len(wanted)
    assert final["shards"]["reassigned"] >= 1
