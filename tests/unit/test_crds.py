"""CRD generation: drift against crds/, structural-schema rules, names and printer columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from slipstream_operator import crdgen

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TAKEN_SHORT_NAMES = {
    "isvc",
    "llmisvc",
    "cq",
    "lq",
    "queue",
    "kwl",
    "wpc",
    "infpool",
    "dgd",
    "dgdr",
    "va",
    "vr",
}


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for key in ("properties",):
            for name, sub in node.get(key, {}).items():
                out.extend(_walk(sub, f"{path}.{name}"))
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                out.extend(_walk(node[key], f"{path}[]"))
    return out


@pytest.mark.parametrize("kind", sorted(crdgen.CRD_META))
def test_committed_crds_match_the_models(kind: str) -> None:
    path = REPO / "crds" / crdgen.file_name(kind)
    assert path.read_text() == crdgen.render(kind), (
        f"{path} is stale: run python -m slipstream_operator.crdgen"
    )


def test_check_mode_reports_drift(tmp_path: Path) -> None:
    assert crdgen.main(["--out", str(tmp_path)]) == 0
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 0
    victim = tmp_path / crdgen.file_name("OfflineJob")
    victim.write_text(victim.read_text().replace("soj", "xyz"))
    assert crdgen.main(["--out", str(tmp_path), "--check"]) == 1


@pytest.mark.parametrize("kind", sorted(crdgen.CRD_META))
def test_schema_is_structural(kind: str) -> None:
    doc = yaml.safe_load(crdgen.render(kind))
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(schema)
    assert "$ref" not in text and "anyOf" not in text and "allOf" not in text
    assert "nullable" not in text and "title" not in text.split(":")[0]
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        # Kubernetes' OpenAPI v3.0: an exclusive bound is a boolean beside minimum/maximum
        # (a number here, as JSON Schema 2020 writes it, fails the API server's apply).
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if key in node:
                assert node[key] is True and bound in node, (path, key)
        if node.get("type") == "object" and "properties" in node:
            for req in node.get("required", ()):
                assert req in node["properties"], (path, req)
    spec_nodes = [n for p, n in _walk(schema["properties"]["spec"])]
    assert all("description" in n for n in spec_nodes[1:] if "properties" in n or "enum" in n)


@pytest.mark.parametrize("kind", sorted(crdgen.CRD_META))
def test_names_printer_columns_and_subresource(kind: str) -> None:
    doc = yaml.safe_load(crdgen.render(kind))
    names = doc["spec"]["names"]
    assert not set(names["shortNames"]) & TAKEN_SHORT_NAMES
    assert names["categories"] == ["slipstream"]
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert doc["metadata"]["name"] == f"{names['plural']}.slipstream.dev"
    columns = [
        c["name"].upper() for c in version["additionalPrinterColumns"] if c.get("priority", 0) == 0
    ]
    expected = {
        "InferenceService": [
            "READY",
            "TTFT-P99",
            "TBT-P99",
            "SLO",
            "BUDGET",
            "OFFLINE-TOK/S",
            "AGE",
        ],
        "OfflineJob": ["PHASE", "PROGRESS", "TOK/S", "ETA", "AGE"],
    }[kind]
    assert columns == expected


def test_cel_rules_are_where_the_issue_wants_them() -> None:
    svc = yaml.safe_load(crdgen.render("InferenceService"))
    spec = svc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    slo_rules = [r["rule"] for r in spec["properties"]["slo"]["x-kubernetes-validations"]]
    assert "has(self.ttft) || has(self.tbt)" in slo_rules
    ttft_rules = [
        r["rule"]
        for r in spec["properties"]["slo"]["properties"]["ttft"]["x-kubernetes-validations"]
    ]
    assert any("duration(self.p99) >= duration(self.mean)" in r for r in ttft_rules)
    job = yaml.safe_load(crdgen.render("OfflineJob"))
    jspec = job["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["rule"] for r in jspec["x-kubernetes-validations"])
    assert "self.input.uri != self.output.uri" in rules
    assert "duration(self.completionWindow)" in rules
    assert jspec["properties"]["completionWindow"]["pattern"].startswith("^")


def test_conditions_are_a_map_list_keyed_by_type() -> None:
    for kind in crdgen.CRD_META:
        doc = yaml.safe_load(crdgen.render(kind))
        status = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        cond = status["properties"]["conditions"]
        assert cond["x-kubernetes-list-type"] == "map"
        assert cond["x-kubernetes-list-map-keys"] == ["type"]
        assert cond["maxItems"] == 8
        assert "lastTransitionTime" in cond["items"]["required"]


def test_optional_spec_objects_default_to_empty_so_nested_defaults_apply() -> None:
    doc = yaml.safe_load(crdgen.render("InferenceService"))
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["sidecar"]["default"] == {}
    assert spec["properties"]["sidecar"]["properties"]["grpcPort"]["default"] == 9000
    assert "default" not in spec["properties"]["engine"]  # has a required member
    ttft = spec["properties"]["slo"]["properties"]["ttft"]
    assert "default" not in ttft  # an empty target would fail its own CEL rule
