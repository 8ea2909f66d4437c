"""Upgrading the CRDs with ``helm upgrade`` keeps existing objects valid (docs/operations.md).

The case pinned here is ``spec.sidecar.image`` going from defaulted (the CRD filled in
``ghcr.io/slipstream-dev/slipstream:0.1.0``) to optional (unset: the operator's
``sidecar_image`` setting, the chart's ``sidecar.image``). A chart whose CRD still carries the
old default is installed, an InferenceService created under it, then ``helm upgrade`` applies
the shipped CRD on a real API server: the old object stays readable, parseable and patchable
and keeps the image the old default wrote into it (the API server persisted it on create), a
new object stores no image, the documented JSON patch hands an old object over to the
operator's default, and a rollback to the old CRD defaults the image again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.test_chart_install import CHART, adopt_crds, run
from slipstream_operator.api import DEFAULT_SIDECAR_IMAGE, InferenceServiceSpec
from slipstream_testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.e2e]

CRD_FILE = "slipstream.dev_inferenceservices.yaml"
KIND = "inferenceservices.slipstream.dev"


def manifest(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "slipstream.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": "m", "engine": {"image": "vllm"}, "replicas": 0,
                 "slo": {"ttft": {"p99": "2s"}}},
    }


def create(cluster: LocalCluster, tmp_path: Path, name: str, namespace: str) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(manifest(name, namespace)))
    run(cluster, cluster.kubectl, "create", "-f", str(path))


def stored_spec(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    obj = json.loads(run(cluster, cluster.kubectl, "get", KIND, name, "-n", namespace,
                         "-o", "json").stdout)
    spec: dict[str, Any] = obj["spec"]
    return spec


def test_sidecar_image_from_defaulted_to_optional_upgrades_in_place(
    cluster: LocalCluster, namespace: str, tmp_path: Path,
) -> None:
    release = "slip-crd-upgrade"
    old_chart = tmp_path / "old" / "slipstream"
    shutil.copytree(CHART, old_chart)
    crd_path = old_chart / "files" / "crds" / CRD_FILE
    crd = yaml.safe_load(crd_path.read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["sidecar"]["properties"]
    assert "default" not in props["image"], "the shipped CRD defaults the image again"
    props["image"]["default"] = DEFAULT_SIDECAR_IMAGE  # the previous release's CRD
    crd_path.write_text(yaml.safe_dump(crd))
    sets = ["--set", "operator.watchNamespaces=release", "--set", "operator.replicas=0",
            "--set", "grafana.dashboard.enabled=false"]
    force = ["--force-conflicts"] if adopt_crds(cluster, release, namespace) else []
    run(cluster, cluster.helm, "install", release, str(old_chart), "-n", namespace, *sets)
    upgraded = False
    try:
        create(cluster, tmp_path, "old", namespace)
        assert stored_spec(cluster, "old", namespace)["sidecar"]["image"] == DEFAULT_SIDECAR_IMAGE

        run(cluster, cluster.helm, "upgrade", release, str(CHART), "-n", namespace, *sets,
            *force)
        upgraded = True
        served = json.loads(run(cluster, cluster.kubectl, "get", "crd", KIND, "-o",
                                "json").stdout)["spec"]["versions"][0]["schema"]
        image = served["openAPIV3Schema"]["properties"]["spec"]["properties"]["sidecar"][
            "properties"]["image"]
        assert "default" not in image

        # The old object: unchanged, still valid for the new schema and for the operator.
        old = stored_spec(cluster, "old", namespace)
        assert old["sidecar"]["image"] == DEFAULT_SIDECAR_IMAGE
        assert InferenceServiceSpec.model_validate(old).sidecar.image == DEFAULT_SIDECAR_IMAGE
        run(cluster, cluster.kubectl, "patch", KIND, "old", "-n", namespace, "--type=merge",
            "-p", '{"spec": {"replicas": 1}}')
        assert stored_spec(cluster, "old", namespace)["replicas"] == 1

        # A new object stores no image: the operator's default applies to it.
        create(cluster, tmp_path, "new", namespace)
        new = stored_spec(cluster, "new", namespace)
        assert "image" not in new["sidecar"] and new["sidecar"]["grpcPort"] == 9000
        assert InferenceServiceSpec.model_validate(new).sidecar.image is None

        # docs/operations.md: drop the written-in default to follow the operator's.
        run(cluster, cluster.kubectl, "patch", KIND, "old", "-n", namespace, "--type=json",
            "-p", '[{"op": "remove", "path": "/spec/sidecar/image"}]')
        assert "image" not in stored_spec(cluster, "old", namespace)["sidecar"]
        # An empty image is refused, not taken for "unset".
        bad = run(cluster, cluster.kubectl, "patch", KIND, "new", "-n", namespace,
                  "--type=merge", "-p", '{"spec": {"sidecar": {"image": ""}}}', check=False)
        assert bad.returncode != 0 and "spec.sidecar.image" in bad.stderr

        # Rolling back to the old CRD: the API server defaults the image again on read.
        upgraded = False
        run(cluster, cluster.helm, "upgrade", release, str(old_chart), "-n", namespace, *sets)
        assert stored_spec(cluster, "new", namespace)["sidecar"]["image"] == DEFAULT_SIDECAR_IMAGE
        run(cluster, cluster.helm, "upgrade", release, str(CHART), "-n", namespace, *sets)
        upgraded = True
        assert "image" not in stored_spec(cluster, "new", namespace)["sidecar"]
    finally:
        if not upgraded:  # never leave the old CRD behind (kept on uninstall) for later tests
            run(cluster, cluster.helm, "upgrade", release, str(CHART), "-n", namespace, *sets,
                *force, check=False)
        run(cluster, cluster.helm, "uninstall", release, "-n", namespace, check=False)
