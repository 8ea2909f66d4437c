"""The Helm chart: CRD drift, lint, rendering under several value sets, least-privilege RBAC,
the operator's arguments and environment (sidecar defaults followed down to the pods the
operator builds), schema rejections, the dashboard's queries and the SLO alert rules (checked
and unit-tested by a real promtool).

Tests that run the helm (or promtool) binary carry ``integration``; the binaries come from the
cluster build (``make cluster-build``: helm in the cache bin dir) and Debian's ``prometheus``
package (``make system-deps``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from slipstream_testbed.cluster import default_bin_dir

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipstream"

# What the operator calls (read from slipstream_operator.kube / handlers and kopf), as
# (apiGroup, resource, verb). tests/e2e/test_chart_install.py checks the same set against
# `kubectl auth can-i --list` on a real API server.
NEEDED_NAMESPACED: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("slipstream.dev", "inferenceservices", "list"),
        ("slipstream.dev", "inferenceservices", "watch"),
        ("slipstream.dev", "inferenceservices", "patch"),
        ("slipstream.dev", "offlinejobs", "list"),
        ("slipstream.dev", "offlinejobs", "watch"),
        ("slipstream.dev", "offlinejobs", "patch"),
        ("slipstream.dev", "inferenceservices/status", "patch"),
        ("slipstream.dev", "offlinejobs/status", "patch"),
        ("slipstream.dev", "inferenceservices/finalizers", "update"),
        ("apps", "deployments", "create"),
        ("apps", "deployments", "patch"),
        ("", "configmaps", "create"),
        ("", "configmaps", "patch"),
        ("", "services", "create"),
        ("", "services", "patch"),
        ("", "secrets", "get"),
        ("", "secrets", "create"),
        ("", "secrets", "patch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "events", "create"),
    }
)
NEEDED_CLUSTER_ONLY: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
)
ALL_MONITORING = [
    "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.force=true",
    "metrics.podMonitor.enabled=true", "metrics.podMonitor.force=true",
    "metrics.prometheusRule.enabled=true", "metrics.prometheusRule.force=true",
]


def expand(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


# ---------------------------------------------------------------------------- no binaries


@pytest.mark.unit
def test_chart_crds_are_a_copy_of_the_generated_ones() -> None:
    generated = {p.name: p.read_bytes() for p in sorted((REPO / "crds").glob("*.yaml"))}
    shipped = {p.name: p.read_bytes() for p in sorted((CHART / "files" / "crds").glob("*.yaml"))}
    assert generated, "crds/ is empty"
    assert shipped == generated, "charts/slipstream/files/crds is stale: hack/sync-chart-crds.sh"


@pytest.mark.unit
def test_sync_script_detects_drift(tmp_path: Path) -> None:
    fake = tmp_path / "repo"
    (fake / "hack").mkdir(parents=True)
    shutil.copy(REPO / "hack" / "sync-chart-crds.sh", fake / "hack")
    shutil.copytree(REPO / "crds", fake / "crds")
    script = ["bash", str(fake / "hack" / "sync-chart-crds.sh")]
    assert subprocess.run([*script, "--check"], check=False, capture_output=True).returncode == 1
    assert subprocess.run(script, check=False, capture_output=True).returncode == 0
    assert subprocess.run([*script, "--check"], check=False, capture_output=True).returncode == 0
    victim = next((fake / "charts" / "slipstream" / "files" / "crds").glob("*.yaml"))
    victim.write_text(victim.read_text() + "# edited\n")
    assert subprocess.run([*script, "--check"], check=False, capture_output=True).returncode == 1


@pytest.mark.unit
def test_network_policy_names_the_port_engine_mode_serves_on() -> None:
    """Without helm: the template admits the operator's vLLM port, which the Service targets
    in engine mode (the rendered policy is checked below and on a real API server in
    tests/reliability/test_cluster_security.py)."""
    from slipstream_operator.api import ENGINE_PORT

    text = (CHART / "templates" / "networkpolicy.yaml").read_text()
    assert f"{{protocol: TCP, port: {ENGINE_PORT}}}" in text


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CHART / "dashboards" / "slipstream.json").read_text())
    return data


def _exported_sidecar_metrics() -> set[str]:
    from slipstream_sidecar.metrics import SidecarMetrics

    return _names(SidecarMetrics().registry.collect())


def _exported_operator_metrics() -> set[str]:
    from slipstream_operator.metrics import OperatorMetrics

    return _names(OperatorMetrics().registry.collect())


def _names(families: Any) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


@pytest.mark.unit
def test_dashboard_queries_use_only_metrics_that_exist() -> None:
    exported = _exported_sidecar_metrics()
    operator = _exported_operator_metrics()
    assert not exported & operator
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    recorded = set(re.findall(r"record: ([a-z_:]+?)(?:\{\{|\n)", helpers))
    recorded |= {f"slipstream:slo_violation_ratio:rate{w}" for w in ("5m", "30m", "1h", "6h")}
    known = exported | operator | recorded
    dash = _dashboard()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b((?:slipstream_|slipstream:)[a-zA-Z0-9_:]+)", expr))
    unknown = names - known - {"slipstream_dev_service"}  # a label, not a metric
    assert not unknown, f"dashboard queries name metrics nobody exports: {sorted(unknown)}"
    # Every family the issue asks for is on the dashboard; per-job panels read the operator's.
    for family in ("slipstream_ttft_seconds_bucket", "slipstream_tbt_seconds_bucket",
                   "slipstream_budget_seconds", "slipstream_output_tokens_total",
                   "slipstream_preemptions_total", "slipstream_offlinejob_finished_requests",
                   "slipstream_offlinejob_input_requests", "slipstream_offlinejob_eta_seconds",
                   "slipstream_inferenceservice_slo_met"):
        assert family in names, family
    job_exprs = [t["expr"] for p in dash["panels"] if "Job" in p["title"]
                 for t in p.get("targets", [])]
    assert job_exprs and all("slipstream_offlinejob_" in e for e in job_exprs)
    assert not any("offlinejob}}" in t.get("legendFormat", "") for p in dash["panels"]
                   for t in p.get("targets", [])), "the job label is `name` now"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.unit
def test_schema_thresholds_are_the_sidecars_bucket_bounds() -> None:
    from slipstream_sidecar.metrics import SidecarMetrics

    text = SidecarMetrics().render().decode()
    schema = json.loads((CHART / "values.schema.json").read_text())
    rule = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"]
    for key, family in (("ttftThreshold", "slipstream_ttft_seconds"),
                        ("tbtThreshold", "slipstream_tbt_seconds")):
        les = set(re.findall(family + r'_bucket\{class="online",le="([^"]+)"\}', text)) - {"+Inf"}
        assert set(rule[key]["enum"]) == les, key
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["metrics"]["prometheusRule"]["ttftThreshold"] in rule["ttftThreshold"]["enum"]


# ---------------------------------------------------------------------------- helm


def _helm() -> Path:
    helm = default_bin_dir() / "helm"
    if not helm.exists():
        pytest.fail(f"{helm} is missing: run `make cluster-build`", pytrace=False)
    return helm


def helm_template(*sets: str, namespace: str = "slipstream", check: bool = True,
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    args = [str(_helm()), "template", "rel", str(CHART), "--namespace", namespace, *extra]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=check)


def docs(*sets: str, namespace: str = "slipstream") -> list[dict[str, Any]]:
    out = helm_template(*sets, namespace=namespace).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.integration
@pytest.mark.parametrize("sets", [(), tuple(ALL_MONITORING), ("operator.watchNamespaces=release",)])
def test_helm_lint_passes(sets: tuple[str, ...]) -> None:
    args = [str(_helm()), "lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    result = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


VALUE_SETS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "all-monitoring": tuple(ALL_MONITORING),
    "namespaced": ("operator.watchNamespaces=release", "operator.logLevel=debug"),
    "minimal": ("crds.install=false", "grafana.dashboard.enabled=false",
                "networkPolicy.enabled=false", "metrics.service.enabled=false",
                "serviceAccount.create=false", "serviceAccount.name=existing"),
    "sharded": ("operator.shards[0].namespaces[0]=team-a-*",
                "operator.shards[0].namespaces[1]=batch",
                "operator.shards[1].namespaces[0]=!team-a-*\\,!batch"),
    "prometheus": ("operator.prometheusUrl=http://prometheus.monitoring:9090",
                   "operator.logLevel=warning", "image.tag=dev"),
    "sidecar-defaults": ("sidecar.image.repository=registry.local:5000/team/slipstream-sidecar",
                         "sidecar.image.tag=v7", "sidecar.resources.requests.cpu=500m",
                         "sidecar.resources.requests.memory=512Mi",
                         "sidecar.resources.limits.memory=1Gi",
                         "operator.profilesDir=/etc/slipstream/profiles"),
    "extra-env": ("operator.extraEnv[0].name=SLIPSTREAM_OPERATOR_GC_FREEZE_INTERVAL_S",
                  "operator.extraEnv[0].value=300",
                  "operator.extraEnv[1].name=SLIPSTREAM_OPERATOR_BUDGET_SEARCH__WORKER",
                  "operator.extraEnv[1].value=thread"),
    "gateway": ("gateway.inferencePool.enabled=true",),
    "gateway-namespaced": ("gateway.inferencePool.enabled=true",
                           "operator.watchNamespaces=release"),
}
# The namespaces each operator Deployment is given, per value set (default: all).
SHARD_NAMESPACES: dict[str, list[list[str] | None]] = {
    "namespaced": [["slipstream"]],
    "gateway-namespaced": [["slipstream"]],
    "sharded": [["team-a-*", "batch"], ["!team-a-*,!batch"]],
}
# What a namespaced kopf lists and watches to match its names and globs (sharded only).
NEEDED_SHARDED: frozenset[tuple[str, str, str]] = frozenset(
    {("", "namespaces", "list"), ("", "namespaces", "watch")})
# What slipstream_operator.gateway calls, with gateway.inferencePool.enabled only.
NEEDED_GATEWAY: frozenset[tuple[str, str, str]] = frozenset(
    ("inference.networking.k8s.io", "inferencepools", verb)
    for verb in ("get", "create", "patch", "delete"))
# The image the operator gives sidecars that name none, per value set: sidecar.image, else the
# operator's own image (repository and tag).
SIDECAR_IMAGES = {
    "prometheus": "ghcr.io/slipstream-dev/slipstream:dev",
    "sidecar-defaults": "registry.local:5000/team/slipstream-sidecar:v7",
}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    name = request.param
    yield name, docs(*VALUE_SETS[name])


@pytest.mark.integration
def test_every_object_is_named_labelled_and_namespaced(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, objs = rendered
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), names
    for obj in objs:
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "rel", obj["kind"]
        if obj["kind"] in cluster_scoped:
            assert "namespace" not in meta
        else:
            assert meta["namespace"] == "slipstream", (obj["kind"], meta["name"])


@pytest.mark.integration
def test_rbac_is_exactly_what_the_operator_calls(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objs = rendered
    namespaced = "watchNamespaces=release" in " ".join(VALUE_SETS[name])
    role_kind = "Role" if namespaced else "ClusterRole"
    roles = by_kind(objs, role_kind)
    assert len(roles) == 1
    assert not by_kind(objs, "ClusterRole" if namespaced else "Role")
    granted = expand(roles[0]["rules"])
    wanted = NEEDED_NAMESPACED | (frozenset() if namespaced else NEEDED_CLUSTER_ONLY)
    if name == "sharded":
        wanted |= NEEDED_SHARDED
    if name.startswith("gateway"):
        wanted |= NEEDED_GATEWAY
    assert granted == wanted, {"extra": granted - wanted, "missing": wanted - granted}
    assert not any("*" in part for rule in granted for part in rule)
    binding = by_kind(objs, role_kind + "Binding")[0]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                  "name": roles[0]["metadata"]["name"]}
    deployment = by_kind(objs, "Deployment")[0]
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa,
                                    "namespace": "slipstream"}]
    if name == "minimal":
        assert sa == "existing" and not by_kind(objs, "ServiceAccount")
    else:
        assert [s["metadata"]["name"] for s in by_kind(objs, "ServiceAccount")] == [sa]


def settings_from_env(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """OperatorSettings as the operator reads them from the container's environment."""
    from slipstream_operator.settings import OperatorSettings

    for key in [k for k in os.environ if k.startswith("SLIPSTREAM_OPERATOR_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return OperatorSettings()


@pytest.mark.integration
def test_operator_args_and_env_are_real_flags_and_settings(
    rendered: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, objs = rendered
    deployments = by_kind(objs, "Deployment")
    shards = SHARD_NAMESPACES.get(name, [None])
    assert len(deployments) == len(shards)
    for deployment, namespaces in zip(deployments, shards, strict=True):
        _check_operator_deployment(name, deployment, namespaces, monkeypatch)


def _check_operator_deployment(name: str, deployment: dict[str, Any],
                               namespaces: list[str] | None,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream_cli.main import build_parser
    from slipstream_operator.settings import OperatorSettings

    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    (container,) = pod["spec"]["containers"]
    args = [str(a) for a in container["args"]]
    parser, chosen = build_parser(args)
    assert chosen == "operator"
    parsed = parser.parse_args(args)  # SystemExit on an unknown flag
    assert isinstance(parsed, argparse.Namespace)
    assert parsed.namespaces == namespaces
    assert parsed.liveness.endswith(":8081/healthz")
    assert parsed.metrics_port == 8080
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == parsed.metrics_port != ports["health"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(parsed.metrics_port)
    expected_verbosity = {"namespaced": 2, "prometheus": 0}.get(name, 1)
    assert parsed.verbose == expected_verbosity
    env = {e["name"]: e["value"] for e in container["env"]}
    assert len(env) == len(container["env"]), "an environment variable is set twice"
    fields = {f"SLIPSTREAM_OPERATOR_{f.upper()}" for f in OperatorSettings.model_fields}
    # A nested setting's variable is its field's name, "__", and the member's.
    unknown = {k for k in env if k.split("__")[0] not in fields}
    assert not unknown, unknown
    settings = settings_from_env(env, monkeypatch)
    if name == "extra-env":
        assert settings.gc_freeze_interval_s == 300.0
        assert settings.budget_search.worker == "thread"
    else:
        assert settings.gc_freeze_interval_s == OperatorSettings.model_fields[
            "gc_freeze_interval_s"].default
        assert settings.budget_search.worker == "process"
    assert settings.reconcile_interval_s == 5.0
    assert settings.sidecar_image == SIDECAR_IMAGES.get(
        name, "ghcr.io/slipstream-dev/slipstream:0.1.0")
    if name == "sidecar-defaults":
        assert settings.sidecar_resources.wire() == {
            "requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}
        assert settings.profiles_dir == Path("/etc/slipstream/profiles")
    else:
        assert "SLIPSTREAM_OPERATOR_SIDECAR_RESOURCES" not in env
        assert settings.profiles_dir is None
    if name == "prometheus":
        assert settings.prometheus_url == "http://prometheus.monitoring:9090"
        assert container["image"] == "ghcr.io/slipstream-dev/slipstream:dev"
    else:
        assert settings.prometheus_url is None
        assert container["image"] == "ghcr.io/slipstream-dev/slipstream:0.1.0"
    probe_port = container["livenessProbe"]["httpGet"]["port"]
    assert probe_port in {p["name"] for p in container["ports"]}


@pytest.mark.integration
def test_crds_render_unchanged_with_keep_policy(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objs = rendered
    crds = by_kind(objs, "CustomResourceDefinition")
    if name == "minimal":
        assert crds == []
        return
    source = {}
    for path in (CHART / "files" / "crds").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text())
        source[doc["metadata"]["name"]] = doc
    assert {c["metadata"]["name"] for c in crds} == set(source)
    for crd in crds:
        original = source[crd["metadata"]["name"]]
        assert crd["spec"] == original["spec"]
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@pytest.mark.integration
def test_selectors_match_the_pods_the_operator_creates(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    from slipstream_operator.api import InferenceServiceSpec
    from slipstream_operator.reconcile_service import ObjectRef, children

    spec = InferenceServiceSpec.model_validate({
        "model": "m", "engine": {"image": "vllm"}, "slo": {"ttft": {"p99": "2s"}},
    })
    kids = children(ObjectRef("chat", "slipstream", "uid", 1), spec, "token", None)
    pod = next(k for k in kids if k["kind"] == "Deployment")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    name, objs = rendered
    selectors = []
    for policy in by_kind(objs, "NetworkPolicy"):
        selectors.append(policy["spec"]["podSelector"]["matchLabels"])
    for svc in by_kind(objs, "Service"):
        if svc["metadata"]["name"].endswith("-operator-metrics"):
            continue  # the operator's own: test_operator_metrics_are_scraped_once
        selectors.append(svc["spec"]["selector"])
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    for monitor in by_kind(objs, "PodMonitor"):
        if monitor["metadata"]["name"].endswith("-operator"):
            continue
        selectors.append(monitor["spec"]["selector"]["matchLabels"])
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names
        assert monitor["spec"]["podTargetLabels"] == ["slipstream.dev/service"]
    if name in ("defaults", "all-monitoring"):
        assert selectors
    for selector in selectors:
        assert selector.items() <= labels.items(), selector


@pytest.mark.integration
@pytest.mark.parametrize("serving_from", [False, True])
@pytest.mark.parametrize("enforcement", ["sidecar", "engine"])
def test_network_policy_admits_online_traffic_in_either_mode(enforcement: str,
                                                             serving_from: bool) -> None:
    """The port the operator's Service sends online traffic to (the sidecar's, or vLLM's in
    engine mode) is admitted by the same rule as the serving port: to the same peers, never
    only to the operator."""
    from slipstream_operator.api import InferenceServiceSpec
    from slipstream_operator.reconcile_service import ObjectRef, children

    spec = InferenceServiceSpec.model_validate({
        "model": "m", "engine": {"image": "vllm"}, "slo": {"ttft": {"p99": "2s"}},
        "scheduling": {"enforcement": enforcement},
    })
    kids = {k["kind"]: k for k in children(ObjectRef("chat", "slipstream", "uid", 1), spec,
                                             "token", None)}
    pod = kids["Deployment"]["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    online = {ports[p["targetPort"]] for p in kids["Service"]["spec"]["ports"]}
    sets = (("networkPolicy.servingFrom[0].podSelector.matchLabels.app=gateway",)
            if serving_from else ())
    (policy,) = by_kind(docs(*sets), "NetworkPolicy")
    rules = policy["spec"]["ingress"]
    (serving,) = [r for r in rules if any(p["port"] == ports["http"] for p in r["ports"])]
    assert online <= {p["port"] for p in serving["ports"]}, (online, serving)
    if serving_from:
        assert {"podSelector": {"matchLabels": {"app": "gateway"}}} in serving["from"]
    else:
        assert "from" not in serving
    (control,) = [r for r in rules if any(p["port"] == ports["grpc"] for p in r["ports"])]
    assert not online & {p["port"] for p in control["ports"]}


@pytest.mark.integration
@pytest.mark.parametrize("monitors", ["service", "pod", "both"])
def test_operator_metrics_are_scraped_once_with_honor_labels(monitors: str) -> None:
    sets = {"service": ALL_MONITORING[:2], "pod": ALL_MONITORING[2:4],
            "both": ALL_MONITORING[:4]}[monitors]
    objs = docs(*sets, "operator.metricsPort=9102")
    deployment = by_kind(objs, "Deployment")[0]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert "--metrics-port=9102" in container["args"]
    assert {"name": "metrics", "containerPort": 9102} in container["ports"]
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"].endswith(
        "-operator-metrics")]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9102, "targetPort": "metrics"}]
    scrapes = [(m["kind"], e) for m in objs if m["kind"] in ("ServiceMonitor", "PodMonitor")
               for e in m["spec"].get("endpoints", m["spec"].get("podMetricsEndpoints", []))
               if e["port"] == "metrics"]
    assert len(scrapes) == 1, scrapes  # never twice: duplicate series would double sums
    kind, endpoint = scrapes[0]
    assert kind == ("PodMonitor" if monitors == "pod" else "ServiceMonitor")
    assert endpoint["honorLabels"] is True
    if kind == "ServiceMonitor":
        (monitor,) = [m for m in by_kind(objs, "ServiceMonitor")
                      if m["metadata"]["name"].endswith("-operator")]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"][
            "labels"].items()
    else:
        (monitor,) = [m for m in by_kind(objs, "PodMonitor")
                      if m["metadata"]["name"].endswith("-operator")]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"][
            "labels"].items()


@pytest.mark.integration
def test_no_unread_sidecar_defaults_are_shipped() -> None:
    objs = docs()
    assert not [o for o in objs if o["metadata"]["name"].endswith(("-sidecar-defaults",
                                                                    "-ksm-offlinejobs"))]


@pytest.mark.integration
def test_sidecar_values_reach_the_pods_the_operator_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sidecar.image / sidecar.resources -> the operator's environment -> its settings -> the
    sidecar container of an InferenceService that sets neither; one that sets them keeps its
    own (the handler passes the two settings to ``children`` through ServiceObserved)."""
    from slipstream_operator.api import InferenceServiceSpec
    from slipstream_operator.reconcile_service import ObjectRef, children

    deployment = by_kind(docs(*VALUE_SETS["sidecar-defaults"]), "Deployment")[0]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    settings = settings_from_env({e["name"]: e["value"] for e in container["env"]}, monkeypatch)

    def sidecar(**own: Any) -> dict[str, Any]:
        spec = InferenceServiceSpec.model_validate({
            "model": "m", "engine": {"image": "vllm"}, "slo": {"ttft": {"p99": "2s"}},
            "sidecar": own,
        })
        kids = children(ObjectRef("chat", "team-a", "uid", 1), spec, "token", None,
                        sidecar_image=settings.sidecar_image,
                        sidecar_resources=settings.sidecar_resources)
        pod = next(k for k in kids if k["kind"] == "Deployment")["spec"]["template"]
        (found,) = [c for c in pod["spec"]["containers"] if c["name"] == "sidecar"]
        return found

    default = sidecar()
    assert default["image"] == "registry.local:5000/team/slipstream-sidecar:v7"
    assert default["resources"] == {"requests": {"cpu": "500m", "memory": "512Mi"},
                                    "limits": {"memory": "1Gi"}}
    pinned = sidecar(image="team-a.local/sidecar:debug", resources={"requests": {"cpu": "2"}})
    assert pinned["image"] == "team-a.local/sidecar:debug"
    assert pinned["resources"] == {"requests": {"cpu": "2"}, "limits": {}}


@pytest.mark.integration
def test_monitoring_objects_render_only_when_asked() -> None:
    kinds = {o["kind"] for o in docs()}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    # Enabled but not forced, and the API is not there: still nothing.
    enabled = [s for s in ALL_MONITORING if s.endswith("enabled=true")]
    assert not {o["kind"] for o in docs(*enabled)} & {"PodMonitor", "PrometheusRule"}
    api = helm_template(*enabled, extra=("--api-versions", "monitoring.coreos.com/v1")).stdout
    kinds = {d["kind"] for d in yaml.safe_load_all(api) if d}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds


@pytest.mark.integration
def test_dashboard_configmap_carries_the_json() -> None:
    objs = docs("grafana.dashboard.namespace=monitoring")
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith(
        "-dashboard"))
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["slipstream.json"]) == _dashboard()


BAD_VALUES = {
    "operator.replicas=2": "maximum",
    "operator.watchNamespaces=some": "watchNamespaces",
    "operator.logLevel=trace": "logLevel",
    "metrics.prometheusRule.ttftThreshold=1.7": "ttftThreshold",
    "metrics.prometheusRule.errorBudget=1.5": "errorBudget",
    "metrics.podMonitor.interval=soon": "interval",
    "sidecar.grpcPort=70000": "grpcPort",
    "operator.prometheusUrl=prometheus:9090": "prometheusUrl",
    "operator.profilesDir=profiles": "profilesDir",
    "unknownKey=1": "unknownKey",
    "operator.metricsPort=8081": "must differ",
    "operator.shards[0].namespaces[0]=Team_A": "/operator/shards/0/namespaces/0",
    "operator.shards[0].other=1": "/operator/shards/0",
    "operator.metricsPort=0": "metricsPort",
    # An object (repository, tag) like the operator's image, not one string.
    "sidecar.image=registry.local/slipstream:1": "/sidecar/image",
    "sidecar.image.tag=bad:tag": "/sidecar/image/tag",
    "sidecar.image.repository=Registry/X": "/sidecar/image/repository",
    "sidecar.resources.cpu=1": "/sidecar/resources",
    "sidecar.resources.limits.memory=1GB": "/sidecar/resources/limits/memory",
    "operator.extraEnv[0].value=1": "/operator/extraEnv/0",
    "operator.extraEnv[0].name=not a name": "/operator/extraEnv/0/name",
}


@pytest.mark.integration
@pytest.mark.parametrize("bad", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(bad: str) -> None:
    result = helm_template(bad, check=False)
    assert result.returncode != 0, f"{bad} was accepted"
    assert BAD_VALUES[bad] in result.stderr, result.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("operator.extraEnv[0].name=SLIPSTREAM_OPERATOR_WINDOW_S",
          "operator.extraEnv[0].value=60"),
         "operator.extraEnv[0]: SLIPSTREAM_OPERATOR_WINDOW_S is set by the chart"),
        (("operator.extraEnv[0].name=SLIPSTREAM_OPERATOR_GC_YOUNG_THRESHOLD",
          "operator.extraEnv[0].value=0",
          "operator.extraEnv[1].name=SLIPSTREAM_OPERATOR_GC_YOUNG_THRESHOLD",
          "operator.extraEnv[1].value=700"),
         "operator.extraEnv[1]: SLIPSTREAM_OPERATOR_GC_YOUNG_THRESHOLD is listed twice"),
    ],
)
def test_extra_env_cannot_override_or_repeat(sets: tuple[str, ...], message: str) -> None:
    result = helm_template(*sets, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.integration
def test_shards_need_every_namespace_watchable() -> None:
    result = helm_template("operator.watchNamespaces=release",
                           "operator.shards[0].namespaces[0]=team-a", check=False)
    assert result.returncode != 0
    assert "operator.shards needs operator.watchNamespaces=all" in result.stderr


@pytest.mark.integration
def test_operator_shards_have_their_own_deployments_and_share_the_metrics_objects() -> None:
    objs = docs(*VALUE_SETS["sharded"], *ALL_MONITORING[:2])  # Service + ServiceMonitor
    deployments = by_kind(objs, "Deployment")
    assert [d["metadata"]["name"] for d in deployments] == ["rel-slipstream-operator-0",
                                                           "rel-slipstream-operator-1"]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in deployments]
    selectors = [d["spec"]["selector"]["matchLabels"] for d in deployments]
    for i, selector in enumerate(selectors):
        # Each Deployment owns only its own shard's pods (a shared selector would make two
        # ReplicaSets fight over pods).
        assert [selector.items() <= p.items() for p in pods] == [j == i for j in range(2)]
    (svc,) = [s for s in by_kind(objs, "Service")
              if s["metadata"]["name"].endswith("-operator-metrics")]
    (monitor,) = [m for m in by_kind(docs(*VALUE_SETS["sharded"], *ALL_MONITORING[2:4]),
                                      "PodMonitor") if m["metadata"]["name"].endswith("-operator")]
    peers = [rule["podSelector"]["matchLabels"]
             for policy in by_kind(objs, "NetworkPolicy")
             for ingress in policy["spec"].get("ingress", [])
             for rule in ingress.get("from", []) if "podSelector" in rule]
    assert peers  # the sidecars' control port admits the operator's pods
    for labels in pods:  # every shard is scraped and may reach the sidecars
        assert svc["spec"]["selector"].items() <= labels.items()
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert any(peer.items() <= labels.items() for peer in peers)


# ---------------------------------------------------------------------------- promtool


def rules_file(tmp_path: Path) -> Path:
    """The PrometheusRule's groups as a plain Prometheus rules file."""
    objs = docs("metrics.prometheusRule.enabled=true", "metrics.prometheusRule.force=true")
    (rule,) = by_kind(objs, "PrometheusRule")
    path = tmp_path / "slipstream.rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def _promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: run `make system-deps` (Debian package prometheus)",
                    pytrace=False)
    return tool


def _series(name: str, labels: dict[str, str], step: float, n: int) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{body}}}", "values": f"0+{step:g}x{n}"}


@pytest.mark.integration
def test_slo_rules_pass_promtool_and_fire_only_on_a_real_burn(tmp_path: Path) -> None:
    rules = rules_file(tmp_path)
    check = subprocess.run([_promtool(), "check", "rules", str(rules)], check=False,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    # Per minute: "hot" 100 requests, 10 % slower than 2 s (10x the 1 % budget); "blazing"
    # 20 % slow (20x); "ok" 0.5 % slow; "quiet" no traffic at all (0/0 must not alert).
    base = {"class": "online", "namespace": "ns"}
    series = []
    for svc, slow in (("hot", 10), ("blazing", 20), ("ok", 0.5), ("quiet", 0)):
        lab = {**base, "slipstream_dev_service": svc}
        rate = 0 if svc == "quiet" else 100
        series.append(_series("slipstream_ttft_seconds_count", lab, rate, 240))
        series.append(_series("slipstream_ttft_seconds_bucket", {**lab, "le": "2.0"},
                              rate - slow, 240))

    def alert(svc: str, severity: str, pct: str, factor: str, window: str) -> dict[str, Any]:
        return {
            "exp_labels": {"metric": "ttft", "namespace": "ns", "threshold": "2.0",
                           "severity": severity, "slipstream_dev_service": svc},
            "exp_annotations": {
                "summary": f"{svc}: online ttft is burning its error budget {factor}x too fast",
                "description": f"{pct}% of online ttft samples of ns/{svc} exceeded 2.0s over "
                + window + ("." if severity == "warning" else
                            ". Offline work on these pods is throttled by the budget; check "
                            "the InferenceService's SLOMet and BudgetReady conditions and the "
                            "online load."),
            },
        }

    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [{
                "expr": "round(slipstream:slo_violation_ratio:rate5m, 0.0001) >= 0",  # NaN drops
                "eval_time": "30m",
                "exp_samples": [
                    {"labels": f'{{metric="ttft",namespace="ns",slipstream_dev_service="{svc}",'
                     'threshold="2.0"}', "value": value}
                    for svc, value in (("hot", 0.1), ("blazing", 0.2), ("ok", 0.005))
                ],
            }],
            "alert_rule_test": [
                {"eval_time": "3h", "alertname": "SlipstreamSLOFastBurn", "exp_alerts": [
                    alert("blazing", "critical", "20", "14", "the last hour")]},
                {"eval_time": "3h", "alertname": "SlipstreamSLOSlowBurn", "exp_alerts": [
                    alert("blazing", "warning", "20", "6", "the last 6 hours"),
                    alert("hot", "warning", "10", "6", "the last 6 hours")]},
                # Fast burn waits for its 2 minutes: not yet 1 minute into the burn.
                {"eval_time": "1m", "alertname": "SlipstreamSLOFastBurn", "exp_alerts": []},
            ],
        }],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([_promtool(), "test", "rules", str(path)], check=False,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.integration
def test_operator_alerts_fire_on_a_failed_job_and_missing_replicas(tmp_path: Path) -> None:
    rules = rules_file(tmp_path)
    obj = {"namespace": "team-a", "name": "x"}
    phases = [_series("slipstream_offlinejob_phase", {**obj, "phase": p}, 0, 30)
              for p in ("Running", "Failed")]
    phases[0]["values"] = "1x10 0x20"
    phases[1]["values"] = "0x10 1x20"
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                *phases,
                {"series": 'slipstream_inferenceservice_spec_replicas{namespace="team-a",'
                 'name="x"}', "values": "2x40"},
                {"series": 'slipstream_inferenceservice_ready_replicas{namespace="team-a",'
                 'name="x"}', "values": "2x10 1x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "SlipstreamOfflineJobFailed", "exp_alerts": []},
                {"eval_time": "13m", "alertname": "SlipstreamOfflineJobFailed", "exp_alerts": [
                    {"exp_labels": {**obj, "phase": "Failed", "severity": "warning"},
                     "exp_annotations": {
                         "summary": "OfflineJob team-a/x failed",
                         "description": "The job's phase is Failed; `kubectl describe offlinejob "
                         "-n team-a x` shows the condition that says why."}}]},
                {"eval_time": "20m", "alertname": "SlipstreamReplicasNotReady",
                 "exp_alerts": []},  # short for 10 minutes: not yet 15
                {"eval_time": "27m", "alertname": "SlipstreamReplicasNotReady", "exp_alerts": [
                    {"exp_labels": {**obj, "severity": "warning"},
                     "exp_annotations": {
                         "summary": "InferenceService team-a/x has fewer ready pods than asked "
                         "for",
                         "description": "1 ready pods for 15 minutes, fewer than spec.replicas: "
                         "online capacity and the offline work on these pods are short."}}]},
            ],
        }],
    }
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run([_promtool(), "test", "rules", str(path)], check=False,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
