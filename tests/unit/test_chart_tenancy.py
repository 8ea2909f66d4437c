"""The chart on a shared cluster: the tenants' roles, aggregated into Kubernetes' built-in
admin, edit and view (and never writing status), the NetworkPolicy rendered in every namespace
that holds InferenceServices, and docs/reference/chart-values.md explaining every value of
values.yaml.

Tests that run helm carry ``integration`` (the binary comes from the cluster build, as in
tests/unit/test_chart.py, whose helpers render the chart here).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from unit.test_chart import CHART, REPO, by_kind, expand, helm_template
from unit.test_chart import docs as render

GROUP = "slipstream.dev"
KINDS = ("inferenceservices", "offlinejobs")
STATUS = tuple(f"{kind}/status" for kind in KINDS)
READ = ("get", "list", "watch")
WRITE = ("create", "update", "patch", "delete")
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"

# What each tenant role grants, as (apiGroup, resource, verb): whole on its own (it can be bound
# directly), status readable and never writable.
TENANT_VIEW = frozenset(
    {(GROUP, kind, verb) for kind in KINDS for verb in READ}
    | {(GROUP, status, "get") for status in STATUS})
TENANT_EDIT = TENANT_VIEW | {(GROUP, kind, verb) for kind in KINDS for verb in WRITE}
# The built-in roles each tenant role is aggregated into.
AGGREGATED_INTO = {"tenant-edit": {"admin", "edit"}, "tenant-view": {"admin", "edit", "view"}}


def tenant_roles(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The tenant ClusterRoles by suffix (``tenant-edit``, ``tenant-view``)."""
    roles = {}
    for role in by_kind(objs, "ClusterRole"):
        name = role["metadata"]["name"]
        for suffix in AGGREGATED_INTO:
            if name == f"rel-slipstream-{suffix}":
                roles[suffix] = role
    return roles


def aggregated_into(role: dict[str, Any]) -> set[str]:
    labels: dict[str, str] = role["metadata"]["labels"]
    return {key.removeprefix(AGGREGATE) for key, value in labels.items()
            if key.startswith(AGGREGATE) and value == "true"}


# ---------------------------------------------------------------------------- tenant RBAC


@pytest.mark.integration
def test_tenant_roles_are_opt_in() -> None:
    objs = render()
    assert tenant_roles(objs) == {}
    assert not any(aggregated_into(r) for r in by_kind(objs, "ClusterRole"))
    assert not tenant_roles(render("rbac.aggregateToTenantRoles=false"))


@pytest.mark.integration
@pytest.mark.parametrize("watch", ["all", "release"])
def test_tenant_roles_aggregate_into_admin_edit_and_view(watch: str) -> None:
    objs = render("rbac.aggregateToTenantRoles=true", f"operator.watchNamespaces={watch}")
    roles = tenant_roles(objs)
    assert set(roles) == set(AGGREGATED_INTO)
    for suffix, role in roles.items():
        assert aggregated_into(role) == AGGREGATED_INTO[suffix], suffix
        assert "namespace" not in role["metadata"]
        assert role["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"
        assert "aggregationRule" not in role  # aggregated into the built-ins, not aggregating
    assert expand(roles["tenant-view"]["rules"]) == TENANT_VIEW
    assert expand(roles["tenant-edit"]["rules"]) == TENANT_EDIT
    # The operator's own role is unchanged beside them, and nothing binds the tenant roles.
    operator_kind = "ClusterRole" if watch == "all" else "Role"
    assert [r["metadata"]["name"] for r in by_kind(objs, operator_kind)
            if r["metadata"]["name"].endswith("-operator")] == ["rel-slipstream-operator"]
    for binding in by_kind(objs, "ClusterRoleBinding") + by_kind(objs, "RoleBinding"):
        assert binding["roleRef"]["name"] == "rel-slipstream-operator"


@pytest.mark.integration
def test_tenants_never_write_status_or_finalizers() -> None:
    roles = tenant_roles(render("rbac.aggregateToTenantRoles=true"))
    for suffix, role in roles.items():
        granted = expand(role["rules"])
        assert not any("*" in part for rule in granted for part in rule), suffix
        assert all(group == GROUP for group, _, _ in granted), suffix
        for _, resource, verb in granted:
            if "/" in resource:
                assert resource in STATUS and verb == "get", (suffix, resource, verb)
    # Reading status is granted (kubectl get shows it with the object; the subresource too).
    assert {(GROUP, s, "get") for s in STATUS} <= expand(roles["tenant-view"]["rules"])


@pytest.mark.integration
@pytest.mark.parametrize(("bad", "message"), [
    ("rbac.aggregateToTenantRoles=yes", "/rbac/aggregateToTenantRoles"),
    ("rbac.tenants=true", "/rbac"),
    ("networkPolicy.namespaces={Team_A}", "/networkPolicy/namespaces/0"),
    ("networkPolicy.namespaces={team-*}", "/networkPolicy/namespaces/0"),
    ("networkPolicy.namespaces={a,a}", "/networkPolicy/namespaces"),
    ("networkPolicy.namespaces=team-a", "/networkPolicy/namespaces"),
])
def test_schema_rejects_bad_tenancy_values(bad: str, message: str) -> None:
    """The schema refuses a bad tenant-roles switch or policy namespace, naming the value."""
    result = helm_template(bad, check=False)
    assert result.returncode != 0, f"{bad} was accepted"
    assert message in result.stderr, result.stderr


# ---------------------------------------------------------------------------- NetworkPolicy


def policies_by_namespace(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    policies = by_kind(objs, "NetworkPolicy")
    spaces = [p["metadata"]["namespace"] for p in policies]
    assert len(spaces) == len(set(spaces)), f"a namespace holds two policies: {spaces}"
    return {p["metadata"]["namespace"]: p for p in policies}


def ports_of(rule: dict[str, Any]) -> set[int]:
    assert {p["protocol"] for p in rule["ports"]} == {"TCP"}
    return {int(p["port"]) for p in rule["ports"]}


@pytest.fixture(scope="module", params=[(), ("sidecar.httpPort=8080", "sidecar.grpcPort=9090")],
                ids=["default-ports", "own-ports"])
def per_namespace(request: pytest.FixtureRequest) -> Iterator[tuple[tuple[str, ...],
                                                                    list[dict[str, Any]]]]:
    ports: tuple[str, ...] = request.param
    # The release namespace listed again, between two others: rendered once.
    objs = render("networkPolicy.namespaces={team-a,slipstream,team-b}",
                  "networkPolicy.servingFrom[0].podSelector.matchLabels.app=gateway", *ports)
    yield ports, objs


@pytest.mark.integration
def test_network_policy_is_rendered_once_in_every_listed_namespace(
    per_namespace: tuple[tuple[str, ...], list[dict[str, Any]]],
) -> None:
    _, objs = per_namespace
    policies = policies_by_namespace(objs)
    assert set(policies) == {"slipstream", "team-a", "team-b"}
    names = {p["metadata"]["name"] for p in policies.values()}
    assert names == {"rel-slipstream-sidecar-control"}
    specs = [yaml.safe_dump(p["spec"], sort_keys=True) for p in policies.values()]
    assert len(set(specs)) == 1, "the policy differs between namespaces"
    for policy in policies.values():
        assert policy["metadata"]["labels"]["app.kubernetes.io/instance"] == "rel"


@pytest.mark.integration
def test_each_namespace_admits_the_operator_and_both_serving_ports(
    per_namespace: tuple[tuple[str, ...], list[dict[str, Any]]],
) -> None:
    from slipstream_operator.api import ENGINE_PORT

    ports, objs = per_namespace
    http, grpc = (8080, 9090) if ports else (8000, 9000)
    operator_peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "slipstream"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                        "app.kubernetes.io/instance": "rel",
                                        "app.kubernetes.io/name": "slipstream"}},
    }
    for namespace, policy in policies_by_namespace(objs).items():
        spec = policy["spec"]
        assert spec["podSelector"] == {
            "matchLabels": {"app.kubernetes.io/managed-by": "slipstream-operator"}}, namespace
        assert spec["policyTypes"] == ["Ingress"]
        control, serving = spec["ingress"]
        # The control port: only the operator's pods, in the release namespace.
        assert ports_of(control) == {grpc}
        assert control["from"] == [operator_peer], namespace
        # The serving ports: the sidecar's and vLLM's (engine mode), to the operator and the
        # listed peers (pods of the policy's own namespace), never to the control rule's peers
        # alone.
        assert ports_of(serving) == {http, ENGINE_PORT}
        assert serving["from"] == [operator_peer,
                                   {"podSelector": {"matchLabels": {"app": "gateway"}}}]


@pytest.mark.integration
def test_without_namespaces_only_the_release_namespace_and_off_means_none() -> None:
    assert set(policies_by_namespace(render())) == {"slipstream"}
    assert set(policies_by_namespace(render("operator.watchNamespaces=release",
                                            "networkPolicy.namespaces={slipstream}"))) == {
        "slipstream"}
    assert by_kind(render("networkPolicy.enabled=false",
                          "networkPolicy.namespaces={team-a}"), "NetworkPolicy") == []


@pytest.mark.integration
def test_namespaces_beyond_the_release_need_the_cluster_wide_operator() -> None:
    result = helm_template("operator.watchNamespaces=release",
                           "networkPolicy.namespaces={team-a}", check=False)
    assert result.returncode != 0
    assert "networkPolicy.namespaces: team-a is not watched" in result.stderr, result.stderr


@pytest.mark.integration
def test_helm_lint_passes_with_tenancy_values() -> None:
    from unit.test_chart import _helm

    args = [str(_helm()), "lint", "--strict", str(CHART),
            "--set", "rbac.aggregateToTenantRoles=true",
            "--set", "networkPolicy.namespaces={team-a,team-b}"]
    result = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- docs

# Values that are one Kubernetes object (a ResourceRequirements), explained whole.
EXPLAINED_WHOLE = frozenset({"operator.resources"})


def leaf_keys(tree: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of values.yaml's leaves: scalars, lists, empty maps, and the maps
    explained whole."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in EXPLAINED_WHOLE:
            yield from leaf_keys(value, f"{path}.")
        else:
            yield path


@pytest.mark.unit
def test_leaf_keys_walk_the_tree() -> None:
    tree = {"a": {"b": 1, "c": {}, "d": {"e": []}}, "operator": {"resources": {"x": {"y": 1}}}}
    assert list(leaf_keys(tree)) == ["a.b", "a.c", "a.d.e", "operator.resources"]


@pytest.mark.unit
def test_chart_values_page_explains_every_chart_value() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = (REPO / "docs" / "reference" / "chart-values.md").read_text()
    keys = list(leaf_keys(values))
    assert len(keys) > 40, keys
    # The full dotted path, not a suffix of a longer one ("image.tag" in "sidecar.image.tag").
    missing = [key for key in keys
               if not re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", text)]
    assert not missing, (
        f"docs/reference/chart-values.md does not name these values.yaml keys: {missing}"
    )


# ---------------------------------------------------------------------------- images
def install_notes(*sets: str) -> str:
    """NOTES.txt as `helm install` prints it (rendered client-side, no cluster)."""
    from unit.test_chart import _helm

    args = [str(_helm()), "install", "rel", str(CHART), "--dry-run=client"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    return out.split("\nNOTES:\n", 1)[1]


@pytest.mark.integration
def test_notes_warn_that_the_default_image_is_not_published_and_name_real_examples() -> None:
    default = install_notes()
    assert "WARNING: image.repository is the chart's default" in default
    assert "WARNING" not in install_notes("image.repository=registry.example.com/slipstream")
    for path in re.findall(r"-f (examples/\S+)", default):
        assert (REPO / path).exists(), path
    assert "https://" not in default
