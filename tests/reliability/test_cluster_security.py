"""Security on a real API server: least-privilege RBAC, namespace isolation, CR validation.

* **RBAC, derived from the code.** The permissions the operator needs are read
  off its source: every Kubernetes client call (``<verb>_namespaced_<kind>``;
  a server-side apply also needs ``create``), every kopf handler's resource
  (kopf lists, watches and patches it and patches its ``status``
  subresource), ``kopf.event`` (events ``create``) and owner references with
  ``blockOwnerDeletion`` (the owner's ``finalizers`` ``update``). The chart's
  RBAC (namespaced mode) is applied to the API server and ``kubectl auth
  can-i --list`` for its service account must equal that set: nothing extra
  (least privilege), nothing missing; nothing at all in another namespace.
  Then the operator runs *as that service account* and takes a job to
  ``Succeeded``; the only ``Forbidden`` calls in its log are kopf's
  cluster-wide scans (CRDs, namespaces), which the chart leaves out on purpose
  in namespaced mode (the set is sufficient).
* **Namespace isolation.** An OfflineJob in ``team-a`` whose input is a file of
  ``team-b`` must be refused naming ``spec.input.uri`` (the namespace-root
  rule of ``slipstream_scheduler.storage_scope``); the operator applies it
  with ``--storage-root`` (before that it staged b's file into a's output
  folder).
* **Invalid CR specs** are rejected by the API server with a message naming
  the field.
* **The chart ships a NetworkPolicy** that admits only the operator's pods to
  the sidecars' control port; the API server accepts it.

Deliberately left out: enforcing the NetworkPolicy (the local cluster has no
CNI; the policy's shape and acceptance are what can be checked here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from rel_cluster import (
    Launched,
    cleanup_namespace,
    eventually,
    kubectl,
    mmlu_job_input,
    start_world,
)

from integration.helpers_procs import MODEL, SLIPSTREAM
from slipstream_operator.api import ENGINE_PORT
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipstream"
OPERATOR_SRC = REPO / "operator" / "slipstream_operator"

KIND_GROUP = {"secret": "", "config_map": "", "service": "", "pod": "", "event": "",
              "deployment": "apps", "stateful_set": "apps", "lease": "coordination.k8s.io"}
VERB = {"patch": "patch", "read": "get", "get": "get", "list": "list", "create": "create",
        "delete": "delete", "replace": "update", "watch": "watch"}
# Custom objects of another API group, by the constant the calls pass as their group: needed
# only with the chart value that grants them (slipstream_operator.gateway's InferencePools).
OPTIONAL_GROUPS = {"POOL_GROUP": ("inference.networking.k8s.io", "inferencepools",
                                  "gateway.inferencePool.enabled")}
BASELINE = {  # every authenticated account has these
    ("authentication.k8s.io", "selfsubjectreviews", "create"),
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
    ("certificates.k8s.io", "clustertrustbundles", "get"),
    ("certificates.k8s.io", "clustertrustbundles", "list"),
    ("certificates.k8s.io", "clustertrustbundles", "watch"),
}


def plural(kind: str) -> str:
    return kind.replace("_", "") + "s"


def needed_from_code(optional: frozenset[str] = frozenset()) -> set[tuple[str, str, str]]:
    """What the operator's code calls; ``optional``: the chart values (``OPTIONAL_GROUPS``)
    whose calls count."""
    needs: set[tuple[str, str, str]] = set()
    all_sources = "\n".join(p.read_text() for p in sorted(OPERATOR_SRC.glob("*.py")))
    for path in sorted(OPERATOR_SRC.glob("*.py")):
        text = path.read_text()
        ssa = "apply-patch+yaml" in text or "APPLY" in text
        for call in re.finditer(
            r"\.(patch|read|get|list|create|delete|replace|watch)_namespaced_(\w+?)\(", text
        ):
            verb, kind = call.groups()
            group_arg = text[call.end():call.end() + 40].split(",")[0].strip()
            if kind == "custom_object" and group_arg in OPTIONAL_GROUPS:
                group, resource, value = OPTIONAL_GROUPS[group_arg]
                if value in optional:
                    needs.add((group, resource, VERB[verb]))
                    if verb == "patch" and ssa:
                        needs.add((group, resource, "create"))
                continue
            if kind == "custom_object":
                # The plural is a parameter: every caller's literal plural is needed (list).
                callers = re.findall(r"list_custom\([^)]*?\"(\w+)\"\)", all_sources)
                assert verb == "list", f"{path.name}: {verb} of custom objects is not mapped"
                needs |= {("slipstream.dev", p, "list") for p in callers}
                continue
            assert kind in KIND_GROUP, f"{path.name}: unknown kind {kind}; extend KIND_GROUP"
            needs.add((KIND_GROUP[kind], plural(kind), VERB[verb]))
            if verb == "patch" and ssa:
                needs.add((KIND_GROUP[kind], plural(kind), "create"))  # apply creates
        for resource in re.findall(r"kopf\.(?:timer|on\.\w+|daemon|index)\(\s*GROUP,\s*VERSION,"
                                   r"\s*\"(\w+)\"", text):
            for verb in ("list", "watch", "patch"):
                needs.add(("slipstream.dev", resource, verb))
            needs.add(("slipstream.dev", f"{resource}/status", "patch"))
        # Watch-only kopf handlers on core resources (indexes): list and watch, no patch.
        for resource in re.findall(r"kopf\.(?:index|on\.event)\(\s*\"\",\s*\"v1\","
                                   r"\s*\"(\w+)\"", text):
            needs |= {("", resource, "list"), ("", resource, "watch")}
        if "kopf.event(" in text:
            needs.add(("", "events", "create"))
        if re.search(r"\"blockOwnerDeletion\":\s*True", text):
            assert "InferenceService" in text, f"{path.name}: owner kind unknown"
            needs.add(("slipstream.dev", "inferenceservices/finalizers", "update"))
    return needs


def can_i(cluster: LocalCluster, sa_ns: str, sa: str, where: str) -> set[tuple[str, str, str]]:
    out = kubectl(cluster, "auth", "can-i", "--list", "-n", where,
                  f"--as=system:serviceaccount:{sa_ns}:{sa}").stdout
    granted: set[tuple[str, str, str]] = set()
    for line in out.splitlines()[1:]:
        if not line.strip() or line[0].isspace() or "[" not in line:
            continue
        resource = line.split()[0]
        verbs = line[line.rindex("[") + 1 : line.rindex("]")].split()
        name, _, group = resource.partition(".")
        if "/" in group:
            group, _, sub = group.partition("/")
            name = f"{name}/{sub}"
        granted |= {(group, name, v) for v in verbs}
    return granted - BASELINE


def helm_template(cluster: LocalCluster, namespace: str, *sets: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [str(cluster.helm), "template", "rel", str(CHART), "-n", namespace, *sets],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_operator_rbac_is_exactly_what_its_code_calls(
    private_cluster: LocalCluster, tmp_path: Path, shared_data: Path
) -> None:
    cluster = private_cluster
    ns = f"rel-rbac-{os.getpid() % 10000}"
    kubectl(cluster, "create", "namespace", ns)
    try:
        docs = helm_template(cluster, ns, "--set", "operator.watchNamespaces=release",
                             "--set", "operator.replicas=0")
        rbac = [d for d in docs if d.get("kind") in ("Role", "RoleBinding", "ServiceAccount")]
        assert {d["kind"] for d in rbac} == {"Role", "RoleBinding", "ServiceAccount"}
        (tmp_path / "rbac.yaml").write_text(yaml.safe_dump_all(rbac))
        kubectl(cluster, "apply", "-n", ns, "-f", str(tmp_path / "rbac.yaml"))
        sa = next(str(d["metadata"]["name"]) for d in rbac  # type: ignore[index]
                  if d["kind"] == "ServiceAccount")

        needed = needed_from_code()
        granted = can_i(cluster, ns, sa, ns)
        print(f"\nneeded by the code ({len(needed)}): {sorted(needed)}")
        assert granted == needed, {"extra": granted - needed, "missing": needed - granted}
        assert can_i(cluster, ns, sa, "default") == set(), "rights outside its namespace"
        for verb, what in (("delete", "deployments"), ("create", "pods"), ("get", "nodes"),
                           ("list", "secrets"), ("delete", "offlinejobs")):
            out = kubectl(cluster, "auth", "can-i", verb, what, "-n", ns,
                          f"--as=system:serviceaccount:{ns}:{sa}", check=False)
            assert out.stdout.strip() == "no", (verb, what)

        # Sufficient: the operator, as this service account, runs a job to Succeeded.
        kubeconfig = cluster.service_account_kubeconfig(ns, sa, tmp_path / "sa.kubeconfig")
        world = start_world(cluster, ns, tmp_path, operator_kubeconfig=kubeconfig,
                            create_namespace=False)
        try:
            wanted = mmlu_job_input(shared_data, tmp_path / "in.jsonl", 120)
            job = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
                   "metadata": {"name": "as-sa"},
                   "spec": {"model": MODEL, "input": {"uri": f"file://{tmp_path}/in.jsonl"},
                            "output": {"uri": f"file://{tmp_path}/out/as-sa.jsonl"},
                            "shardSize": 40}}
            (tmp_path / "job.json").write_text(json.dumps(job))
            kubectl(cluster, "apply", "-n", ns, "-f", str(tmp_path / "job.json"))

            def done() -> dict[str, object] | None:
                st = json.loads(kubectl(cluster, "get", "-n", ns, "offlinejob", "as-sa", "-o",
                                        "json").stdout).get("status", {})
                assert st.get("phase") != "Failed", st
                return st if st.get("phase") == "Succeeded" else None

            eventually("the job run by the service account", done, timeout=300)
        finally:
            world.stop()
        out_ids = [json.loads(x)["custom_id"]
                   for x in (tmp_path / "out" / "as-sa.jsonl").read_text().splitlines()]
        assert sorted(out_ids) == sorted(wanted)
        # kopf's cluster-wide scanning (CRDs, namespaces) is forbidden in namespaced mode, by
        # design of the chart (kopf retries, then carries on without it); anything else
        # forbidden would be a missing rule.
        forbidden = [ln for ln in world.operator.log_path.read_text().splitlines()
                     if "Forbidden" in ln or " 403" in ln]
        scanning = [ln for ln in forbidden
                    if "/customresourcedefinitions" in ln or "/api/v1/namespaces ->" in ln]
        print(f"operator log: {len(scanning)} forbidden cluster-scope scans by kopf, "
              f"{len(forbidden) - len(scanning)} other forbidden calls")
        assert forbidden == scanning, [ln[:300] for ln in forbidden if ln not in scanning][:3]
    finally:
        cleanup_namespace(cluster, ns)


def test_a_job_cannot_read_another_namespaces_file(
    private_cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster = private_cluster
    suffix = os.getpid() % 10000
    a, b = f"rel-team-a-{suffix}", f"rel-team-b-{suffix}"
    root = tmp_path / "storage"
    (root / b).mkdir(parents=True)
    (root / a).mkdir()
    secret = root / b / "private.jsonl"
    secret.write_text(json.dumps({"custom_id": "b-secret", "method": "POST",
                                  "url": "/v1/completions",
                                  "body": {"model": MODEL, "prompt": "team b's data"}}) + "\n")
    for ns in (a, b):
        kubectl(cluster, "create", "namespace", ns)
    operator = Launched(
        [*SLIPSTREAM, "-v", "operator", "--kubeconfig", str(cluster.admin_kubeconfig), "-n", a,
         "-n", b, "--loopback-only", "--interval", "1", "--storage-root", f"file://{root}"],
        tmp_path / "operator.log",
    ).start()
    staged = root / a / "out.jsonl.slipstream" / "input.psm.jsonl"
    try:
        job = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "OfflineJob",
               "metadata": {"name": "steal"},
               "spec": {"model": MODEL, "input": {"uri": f"file://{secret}"},
                        "output": {"uri": f"file://{root / a}/out.jsonl"}}}
        (tmp_path / "job.json").write_text(json.dumps(job))
        kubectl(cluster, "apply", "-n", a, "-f", str(tmp_path / "job.json"))

        def outcome() -> str | None:
            st = json.loads(kubectl(cluster, "get", "-n", a, "offlinejob", "steal", "-o",
                                    "json").stdout).get("status", {})
            for cond in st.get("conditions", []):
                if cond.get("status") == "False" and "spec.input.uri" in cond.get("message", ""):
                    return "refused"
            if staged.exists() or (st.get("requests") or {}).get("total"):
                return "planned"
            return None

        result = eventually("the operator's verdict on the job", outcome, timeout=90)
    finally:
        operator.stop()
        for ns in (a, b):
            cleanup_namespace(cluster, ns)
    assert result == "refused", (
        f"team-a's job planned team-b's file (staged copy: {staged.exists()})")


_OK = {"model": "m", "engine": {"image": "x"}, "slo": {"ttft": {"p99": "2s"}}}
INVALID = [
    ("InferenceService", {"model": "m", "engine": {"image": "x"}, "replicas": -1},
     "spec.replicas"),
    ("InferenceService", {"model": "m", "engine": {"image": "x"}, "replicas": "two"},
     "spec.replicas"),
    ("InferenceService", {"engine": {"image": "x"}}, "spec.model"),
    ("InferenceService", {"model": "m", "engine": {"image": "x"},
                          "slo": {"ttft": {"p99": "soon"}}}, "spec.slo.ttft.p99"),
    ("InferenceService", {"model": "m", "engine": {"image": "x"},
                          "slo": {"tbt": {"mean": "200ms", "p99": "150ms"}}}, "spec.slo.tbt.p99"),
    # The pod's reserved parts (the CEL rules; slipstream_operator.api.pod_problems has all).
    ("InferenceService", {**_OK, "engine": {"image": "x", "env": [
        {"name": "SLIPSTREAM_CHANNEL_DIR", "value": "/x"}]}}, "spec.engine.env[0].name"),
    ("InferenceService", {**_OK, "template": {"spec": {"volumes": [
        {"name": "control-token", "emptyDir": {}}]}}}, "spec.template.spec.volumes"),
    ("InferenceService", {**_OK, "template": {"metadata": {"labels": {
        "slipstream.dev/service": "other"}}}}, "spec.template.metadata.labels"),
    ("InferenceService", {**_OK, "sidecar": {"httpPort": 8001}}, "spec.sidecar"),
    ("InferenceService", {**_OK, "modelSource": {"uri": "s3://b/m"}}, "spec.modelSource.uri"),
    ("InferenceService", {**_OK, "modelSource": {"uri": "pvc://w", "hfTokenSecret": {
        "name": "t"}}}, "spec.modelSource.uri"),
    ("OfflineJob", {"model": "m", "input": {"uri": "http://x/in.jsonl"},
                    "output": {"uri": "file:///o.jsonl"}}, "spec.input.uri"),
    ("OfflineJob", {"model": "m", "input": {"uri": "file:///a.jsonl"},
                    "output": {"uri": "file:///a.jsonl"}}, "spec.output.uri"),
    ("OfflineJob", {"model": "m", "input": {"uri": "file:///a.jsonl"}}, "spec.output"),
    ("OfflineJob", {"model": "m", "input": {"uri": "file:///a.jsonl"},
                    "output": {"uri": "file:///b.jsonl"}, "shardSize": 0}, "spec.shardSize"),
    ("OfflineJob", {"model": "m", "input": {"uri": "file:///a.jsonl"},
                    "output": {"uri": "file:///b.jsonl"}, "completionWindow": "tomorrow"},
     "spec.completionWindow"),
    ("OfflineJob", {"model": "m", "input": {"uri": "file:///a.jsonl"},
                    "output": {"uri": "file:///b.jsonl"}, "surprise": 1}, "surprise"),
]


def test_invalid_specs_are_rejected_naming_the_field(
    private_cluster: LocalCluster, tmp_path: Path
) -> None:
    ns = f"rel-invalid-{os.getpid() % 10000}"
    kubectl(private_cluster, "create", "namespace", ns)
    try:
        failures = []
        for i, (kind, spec, field) in enumerate(INVALID):
            doc = {"apiVersion": "slipstream.dev/v1alpha1", "kind": kind,
                   "metadata": {"name": f"bad-{i}"}, "spec": spec}
            path = tmp_path / f"bad-{i}.json"
            path.write_text(json.dumps(doc))
            out = kubectl(private_cluster, "apply", "--validate=strict", "-n", ns, "-f",
                          str(path), check=False)
            if out.returncode == 0 or field not in out.stderr:
                failures.append((kind, spec, field, out.returncode, out.stderr.strip()[:300]))
        assert not failures, failures
    finally:
        cleanup_namespace(private_cluster, ns)


def test_chart_ships_a_network_policy_for_the_control_port(
    private_cluster: LocalCluster, tmp_path: Path
) -> None:
    ns = f"rel-netpol-{os.getpid() % 10000}"
    docs = helm_template(private_cluster, ns, "--set", "networkPolicy.enabled=true")
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    assert policies, "the chart renders no NetworkPolicy"
    pol = policies[0]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    grpc_port, http_port = values["sidecar"]["grpcPort"], values["sidecar"]["httpPort"]
    rules = pol["spec"]["ingress"]  # type: ignore[index]
    control = [r for r in rules if any(p["port"] == grpc_port for p in r.get("ports", []))]
    assert control and all(r.get("from") for r in control), "control port open to everyone"
    for rule in control:
        for peer in rule["from"]:
            assert peer.get("podSelector", {}).get("matchLabels"), peer  # the operator's pods
    # Serving: the sidecar's HTTP port, and vLLM's where engine mode sends online traffic.
    serving = [r for r in rules if any(p["port"] == http_port for p in r.get("ports", []))]
    assert serving and all(ENGINE_PORT in {p["port"] for p in r["ports"]} for r in serving)
    assert all(p["port"] in (grpc_port, http_port, ENGINE_PORT)
               for r in rules for p in r.get("ports", []))
    kubectl(private_cluster, "create", "namespace", ns)
    try:
        (tmp_path / "np.yaml").write_text(yaml.safe_dump(pol))
        kubectl(private_cluster, "apply", "-n", ns, "-f", str(tmp_path / "np.yaml"))
    finally:
        cleanup_namespace(private_cluster, ns)
    time.sleep(0)
