"""The real operator, authenticated as the chart's service account, does its whole job.

``tests/e2e/test_chart_install.py`` pins the chart's rules to a list (``NEEDED_*``); this test
shows that list is enough. The chart is installed watching its release namespace only (a Role;
the operator replica count 0), a token of the chart's ServiceAccount is requested, and
``slipstream operator`` runs as a process with that kubeconfig. An InferenceService and an
OfflineJob are applied; the operator must create the service's Secret, ConfigMap, Deployment
and Service, see its pod (kwok), write both objects' status, on deletion release both
finalizers and post the drain's Event, all without one Forbidden answer in its log. Left out:
cluster-wide mode (its extra CRD list/watch is kopf's scanning; watching every namespace of a
shared test cluster would reconcile other tests' objects).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.test_chart_install import CHART, adopt_crds, run
from e2e.test_operator_e2e import eventually
from integration.helpers_procs import SLIPSTREAM, Proc, free_port
from slipstream_cli.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

RELEASE = "slip-rbac"
ACCOUNT = f"{RELEASE}-slipstream"


def objects(namespace: str, job_input: Path, job_output: Path) -> list[dict[str, Any]]:
    meta = {"namespace": namespace}
    return [
        {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
         "metadata": {"name": "chat", "labels": {"slipstream.dev/pool": "shared"}, **meta},
         "spec": {"model": "llama-2-7b", "replicas": 1,
                  "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpuType": "h100"},
                  "slo": {"ttft": {"p99": "2s"}, "tbt": {"p99": "150ms"}}}},
        {"apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
         "metadata": {"name": "batch", **meta},
         "spec": {"model": "llama-2-7b", "input": {"uri": f"file://{job_input}"},
                  "output": {"uri": f"file://{job_output}"},
                  "serviceSelector": {"matchLabels": {"slipstream.dev/pool": "shared"}},
                  "shardSize": 2}},
    ]


@pytest.fixture
def installed(cluster: LocalCluster, namespace: str) -> Iterator[str]:
    force = ["--force-conflicts"] if adopt_crds(cluster, RELEASE, namespace) else []
    run(cluster, cluster.helm, "upgrade", "--install", RELEASE, str(CHART), "-n", namespace,
        "--set", "operator.watchNamespaces=release", "--set", "operator.replicas=0",
        "--set", "grafana.dashboard.enabled=false", *force)
    yield namespace
    run(cluster, cluster.helm, "uninstall", RELEASE, "-n", namespace, check=False)


def get(cluster: LocalCluster, namespace: str, *what: str) -> dict[str, Any] | None:
    result = run(cluster, cluster.kubectl, "get", "-n", namespace, *what, "-o", "json",
                 check=False)
    if result.returncode != 0:
        return None
    obj: dict[str, Any] = json.loads(result.stdout)
    return obj


def test_the_operator_runs_on_exactly_the_charts_rbac(
    cluster: LocalCluster, installed: str, tmp_path: Path,
) -> None:
    namespace = installed
    kubeconfig = cluster.service_account_kubeconfig(namespace, ACCOUNT, tmp_path / "sa.yaml",
                                                    expiration_seconds=3600)
    # The account really is the chart's: it may not even read pods in another namespace.
    denied = run(cluster, cluster.kubectl, "--kubeconfig", str(kubeconfig), "get", "pods",
                 "-n", "default", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()

    job_input = tmp_path / "input.jsonl"
    job_input.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "llama-2-7b", "max_tokens": 4,
                             "messages": [{"role": "user", "content": f"question {i}"}]}})
        + "\n" for i in range(4)))
    manifests = tmp_path / "objects.yaml"
    manifests.write_text(yaml.safe_dump_all(objects(namespace, job_input,
                                                    tmp_path / "output.jsonl")))

    health = free_port()
    operator = Proc(
        "operator",
        [*SLIPSTREAM, "-v", "operator", "--kubeconfig", str(kubeconfig), "-n", namespace,
         "--loopback-only", "--interval", "1", "--window", "30",
         f"--liveness=http://127.0.0.1:{health}/healthz", "--metrics-port", str(free_port()),
         "--metrics-address", "127.0.0.1"],
        tmp_path / "operator.log",
        health,
        env=dict(os.environ, SLIPSTREAM_OPERATOR_DELETE_DRAIN_TIMEOUT_S="2"),
    )
    operator.start(ready_path="/healthz", timeout_s=90)
    try:
        run(cluster, cluster.kubectl, "apply", "-f", str(manifests))

        def children() -> bool | None:
            kinds = ("deployment/chat", "service/chat", "configmap/chat-slipstream",
                     "secret/chat-control-token")
            return True if all(get(cluster, namespace, k) for k in kinds) else None

        eventually("the InferenceService's children", children)

        def service_status() -> dict[str, Any] | None:
            obj = get(cluster, namespace, "inferenceservices.slipstream.dev", "chat")
            status = (obj or {}).get("status") or {}
            return status if status.get("replicas", 0) >= 1 and status.get("conditions") \
                else None

        status = eventually("the InferenceService's status with its pod", service_status)
        assert {c["type"] for c in status["conditions"]} >= {"Ready", "SLOMet", "BudgetReady"}

        def job_status() -> dict[str, Any] | None:
            obj = get(cluster, namespace, "offlinejobs.slipstream.dev", "batch")
            status = (obj or {}).get("status") or {}
            return status if status.get("phase") and status.get("conditions") else None

        eventually("the OfflineJob's status", job_status)

        run(cluster, cluster.kubectl, "delete", "-n", namespace, "--wait=false",
            "offlinejobs.slipstream.dev/batch", "inferenceservices.slipstream.dev/chat")

        def gone() -> bool | None:
            left = run(cluster, cluster.kubectl, "get", "-n", namespace, "-o", "name",
                       "offlinejobs.slipstream.dev,inferenceservices.slipstream.dev").stdout
            return True if not left.strip() else None

        eventually("both finalizers released", gone)

        def drained() -> list[str] | None:
            listed = get(cluster, namespace, "events") or {"items": []}
            reasons = [e.get("reason", "") for e in listed["items"]
                       if e.get("involvedObject", {}).get("kind") == "InferenceService"]
            return reasons if {"Drained", "DrainIncomplete"} & set(reasons) else None

        eventually("the deletion's Drained Event", drained, timeout=30)
        assert operator.popen is not None and operator.popen.poll() is None, \
            operator.log_tail()
    finally:
        operator.stop()
    log = operator.log_path.read_text(errors="replace")
    refused = [line for line in log.splitlines()
               if "forbidden" in line.lower() or " 403" in line]
    assert not refused, "\n".join(refused[:20])

