"""The chart on a real API server: install, CRDs present and upgraded, RBAC exactly as needed.

``helm install`` into the local cluster (helm and kubectl from the cluster's bin dir); the
CRDs exist with the keep policy and serve both kinds; ``helm upgrade`` with a changed CRD
file (a new printer column, as a schema change would be) changes the CRD in the cluster;
``kubectl auth can-i --list`` for the chart's service account lists exactly the rules
``tests/unit/test_chart.py`` pins (NEEDED_*), both for the ClusterRole (watch all namespaces)
and for the namespaced Role, and with the operator sharded by namespace (two Deployments, one
ClusterRole that also lists namespaces); ``helm uninstall`` keeps the CRDs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from slipstream_testbed.cluster import LocalCluster
from unit.test_chart import NEEDED_CLUSTER_ONLY, NEEDED_NAMESPACED, NEEDED_SHARDED

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipstream"
CRDS = ("inferenceservices.slipstream.dev", "offlinejobs.slipstream.dev")


def run(cluster: LocalCluster, binary: Path, *args: str,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=str(cluster.admin_kubeconfig))
    result = subprocess.run([str(binary), *args], env=env, capture_output=True, text=True,
                            timeout=180, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{binary.name} {' '.join(args)}:\n{result.stderr}")
    return result


def can_i_list(cluster: LocalCluster, namespace: str, account: str,
               where: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the account may use in ``where``, resource rules only."""
    out = run(cluster, cluster.kubectl, "auth", "can-i", "--list", "-n", where,
              f"--as=system:serviceaccount:{namespace}:{account}").stdout
    granted: set[tuple[str, str, str]] = set()
    for line in out.splitlines()[1:]:
        # "Resources  Non-Resource URLs  Resource Names  Verbs": rows of non-resource URLs
        # (discovery, health; every account has them) leave the first column empty.
        if not line.strip() or line[0].isspace() or "[" not in line:
            continue
        resource = line.split()[0]
        verbs = line[line.rindex("[") + 1:line.rindex("]")].split()
        name, _, group = resource.partition(".")
        if "/" in group:  # "offlinejobs.slipstream.dev/status"
            group, _, sub = group.partition("/")
            name = f"{name}/{sub}"
        for verb in verbs:
            granted.add((group, name, verb))
    return granted


def adopt_crds(cluster: LocalCluster, release: str, namespace: str) -> list[str]:
    """Hand CRDs left by an earlier release (kept on uninstall) or by `kubectl apply` to
    ``release``: Helm's adoption annotations (docs/operations.md). Returns the adopted
    CRDs' names."""
    present = run(cluster, cluster.kubectl, "get", "crd", *CRDS, "-o", "name",
                  check=False).stdout.split()
    for crd in present:
        run(cluster, cluster.kubectl, "annotate", "--overwrite", crd,
            f"meta.helm.sh/release-name={release}",
            f"meta.helm.sh/release-namespace={namespace}")
        run(cluster, cluster.kubectl, "label", "--overwrite", crd,
            "app.kubernetes.io/managed-by=Helm")
    return present


BASELINE_ACCOUNT_RULES = {
    # Granted to every authenticated account by the default cluster roles.
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("certificates.k8s.io", "clustertrustbundles", "get"),
    ("certificates.k8s.io", "clustertrustbundles", "list"),
    ("certificates.k8s.io", "clustertrustbundles", "watch"),
}


@pytest.mark.parametrize("mode", ["all", "release", "sharded"])
def test_install_upgrade_rbac_uninstall(cluster: LocalCluster, namespace: str, mode: str,
                                        tmp_path: Path) -> None:
    release = f"slip-{mode}"
    chart = tmp_path / "slipstream"
    shutil.copytree(CHART, chart)
    sets = ["--set", f"operator.watchNamespaces={'all' if mode == 'sharded' else mode}",
            "--set", "operator.replicas=0"]
    operators = [f"{release}-slipstream-operator"]
    if mode == "sharded":
        sets += ["--set", f"operator.shards[0].namespaces[0]={namespace}",
                 "--set", f"operator.shards[1].namespaces[0]=!{namespace}"]
        operators = [f"{release}-slipstream-operator-0", f"{release}-slipstream-operator-1"]
    # Fields another manager set (a client-side `kubectl apply` of crds/, as other tests
    # do) conflict with Helm's server-side apply on upgrade: the documented adoption
    # takes them over once with --force-conflicts.
    force = ["--force-conflicts"] if adopt_crds(cluster, release, namespace) else []
    run(cluster, cluster.helm, "install", release, str(chart), "-n", namespace, *sets)
    try:
        crds = json.loads(run(cluster, cluster.kubectl, "get", "crd", *CRDS,
                              "-o", "json").stdout)["items"]
        assert {c["metadata"]["name"] for c in crds} == set(CRDS)
        for crd in crds:
            assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        run(cluster, cluster.kubectl, "get", "-n", namespace,
            "inferenceservices.slipstream.dev,offlinejobs")  # both kinds are served
        # The operator's metrics Service points at the Deployment's "metrics" port.
        svc = json.loads(run(cluster, cluster.kubectl, "get", "-n", namespace, "service",
                             f"{release}-slipstream-operator-metrics", "-o", "json").stdout)
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
        for operator in operators:
            deploy = json.loads(run(cluster, cluster.kubectl, "get", "-n", namespace,
                                    "deployment", operator, "-o", "json").stdout)
            (container,) = deploy["spec"]["template"]["spec"]["containers"]
            assert {"name": "metrics", "containerPort": 8080,
                    "protocol": "TCP"} in container["ports"]
            assert "--metrics-port=8080" in container["args"]

        # RBAC, as the API server evaluates it.
        account = f"{release}-slipstream"
        wanted = set(NEEDED_NAMESPACED)
        if mode != "release":
            wanted |= NEEDED_CLUSTER_ONLY
        if mode == "sharded":
            wanted |= NEEDED_SHARDED
        here = can_i_list(cluster, namespace, account, namespace) - BASELINE_ACCOUNT_RULES
        assert here == wanted, {"extra": here - wanted, "missing": wanted - here}
        elsewhere = can_i_list(cluster, namespace, account, "default") - BASELINE_ACCOUNT_RULES
        assert elsewhere == (set() if mode == "release" else wanted), elsewhere

        # Upgrade: a changed CRD file reaches the cluster (CRDs are templates, not crds/).
        path = chart / "files" / "crds" / "slipstream.dev_offlinejobs.yaml"
        doc = yaml.safe_load(path.read_text())
        doc["spec"]["versions"][0]["additionalPrinterColumns"].append(
            {"name": "Upgraded", "type": "string", "jsonPath": ".status.phase"})
        path.write_text(yaml.safe_dump(doc))
        run(cluster, cluster.helm, "upgrade", release, str(chart), "-n", namespace, *sets,
            *force)
        crd = json.loads(run(cluster, cluster.kubectl, "get", "crd", CRDS[1],
                             "-o", "json").stdout)
        columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
        assert "Upgraded" in columns
        # And back to the shipped one, so later tests see the real CRD.
        run(cluster, cluster.helm, "upgrade", release, str(CHART), "-n", namespace, *sets)
    finally:
        run(cluster, cluster.helm, "uninstall", release, "-n", namespace, check=False)
    # The CRDs (and everyone's objects) survive an uninstall.
    left = run(cluster, cluster.kubectl, "get", "crd", *CRDS, "-o", "name").stdout.split()
    assert sorted(left) == sorted(f"customresourcedefinition.apiextensions.k8s.io/{c}"
                                  for c in CRDS)
    assert run(cluster, cluster.kubectl, "get", "clusterrole", f"{release}-slipstream-operator",
               check=False).returncode != 0
