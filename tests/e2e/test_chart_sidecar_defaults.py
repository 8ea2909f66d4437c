"""The chart's sidecar defaults reach the Deployments the real operator creates.

``helm template`` with ``sidecar.image`` and ``sidecar.resources`` set gives the operator
container's environment; ``slipstream operator`` runs as a process with exactly that
environment, watching one namespace. Two InferenceServices are applied: one that leaves
``spec.sidecar`` alone must get the chart's image and resources, one that names its own image
and resources keeps them. (``tests/unit/test_chart.py`` follows the same values through the
settings into ``reconcile_service.children``; this test adds the handler between them.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.test_chart_install import CHART, run
from e2e.test_operator_e2e import eventually
from integration.helpers_procs import SLIPSTREAM, Proc, free_port
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.local:5000/platform/slipstream-sidecar:e2e"
RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "768Mi"}}


def operator_env(cluster: LocalCluster) -> dict[str, str]:
    sets = ["--set", "sidecar.image.repository=registry.local:5000/platform/slipstream-sidecar",
            "--set", "sidecar.image.tag=e2e",
            "--set", "sidecar.resources.requests.cpu=250m",
            "--set", "sidecar.resources.requests.memory=256Mi",
            "--set", "sidecar.resources.limits.memory=768Mi"]
    out = run(cluster, cluster.helm, "template", "rel", str(CHART), *sets).stdout
    (deployment,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: str(e["value"]) for e in container["env"]}


def service(name: str, namespace: str, sidecar: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": "llama-2-7b", "replicas": 0,
                     "engine": {"image": "vllm/vllm-openai:v0.11.0", "gpuType": "h100"},
                     "slo": {"ttft": {"p99": "2s"}}, "sidecar": sidecar}}


def test_chart_sidecar_defaults_reach_the_operators_deployments(
    cluster: LocalCluster, namespace: str, tmp_path: Path,
) -> None:
    env = operator_env(cluster)
    assert env["SLIPSTREAM_OPERATOR_SIDECAR_IMAGE"] == IMAGE
    assert json.loads(env["SLIPSTREAM_OPERATOR_SIDECAR_RESOURCES"]) == RESOURCES
    run(cluster, cluster.kubectl, "apply", "-f", str(REPO / "crds"))
    manifests = tmp_path / "services.yaml"
    pinned = {"image": "team.local/sidecar:debug", "resources": {"requests": {"cpu": "2"}}}
    manifests.write_text(yaml.safe_dump_all([service("plain", namespace, {}),
                                             service("pinned", namespace, pinned)]))
    health = free_port()
    operator = Proc(
        "operator",
        [*SLIPSTREAM, "operator", "-n", namespace, "--loopback-only", "--interval", "1",
         f"--liveness=http://127.0.0.1:{health}/healthz", "--metrics-port", str(free_port()),
         "--metrics-address", "127.0.0.1"],
        tmp_path / "operator.log",
        health,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_OPERATOR_")},
             **env, "KUBECONFIG": str(cluster.admin_kubeconfig)},
    )
    operator.start(ready_path="/healthz", timeout_s=90)
    try:
        run(cluster, cluster.kubectl, "apply", "-f", str(manifests))

        def sidecars() -> dict[str, dict[str, Any]] | None:
            found = {}
            for name in ("plain", "pinned"):
                got = run(cluster, cluster.kubectl, "get", "deployment", name, "-n", namespace,
                          "-o", "json", check=False)
                if got.returncode != 0:
                    return None
                containers = json.loads(got.stdout)["spec"]["template"]["spec"]["containers"]
                found[name] = next(c for c in containers if c["name"] == "sidecar")
            return found

        found = eventually("both Deployments", sidecars)
    finally:
        operator.stop()
    assert found["pinned"]["image"] == "team.local/sidecar:debug"
    assert found["pinned"]["resources"] == {"requests": {"cpu": "2"}}
    assert found["plain"]["image"] == IMAGE
    assert found["plain"]["resources"] == RESOURCES
