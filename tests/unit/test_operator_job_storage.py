"""Job storage that reaches the pods: the operator's ``job_storage`` setting (a claim mounted
at the operator's path, S3 credentials from a Secret) in every sidecar it builds, its
validation, and the chart's ``jobStorage`` values followed from ``helm template`` through the
operator's settings down to the pods (``integration``: the helm binary)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from test_chart import CHART, by_kind, docs, helm_template, settings_from_env

from slipstream_operator.api import RESERVED_VOLUMES, InferenceServiceSpec, validate_semantics
from slipstream_operator.podspec import (
    JOB_STORAGE_RESERVED_PATHS,
    JOB_STORAGE_VOLUME,
    NO_JOB_STORAGE,
    JobStorage,
    job_storage_problems,
)
from slipstream_operator.reconcile_service import ObjectRef, children
from slipstream_operator.settings import OperatorSettings
from slipstream_scheduler.storage_scope import ScopeError, check_uri

REF = ObjectRef("chat", "team-a", "uid-1", 1)
PVC = {"pvc": {"claim_name": "jobs", "mount_path": "/data/jobs"}}
S3 = {"s3": {"credentials_secret": "s3-creds", "endpoint_url": "http://minio.storage:9000"}}


def spec(**fields: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": "llama-2-7b", "engine": {"image": "vllm/vllm-openai:v0.11.1"},
        "slo": {"ttft": {"p99": "2s"}}, **fields,
    })


def storage(**doc: Any) -> JobStorage:
    return JobStorage.model_validate(doc)


def pod_of(s: InferenceServiceSpec, job_storage: JobStorage = NO_JOB_STORAGE,
           roots: tuple[str, ...] = ()) -> dict[str, Any]:
    objs = {c["kind"]: c for c in children(REF, s, "token", None, storage_roots=roots,
                                           job_storage=job_storage)}
    pod: dict[str, Any] = objs["Deployment"]["spec"]["template"]["spec"]
    return pod


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# ---------------------------------------------------------------------------- the pods


@pytest.mark.unit
def test_without_job_storage_the_pod_gets_nothing_for_it() -> None:
    pod = pod_of(spec())
    assert JOB_STORAGE_VOLUME not in {v["name"] for v in pod["volumes"]}
    sidecar = containers(pod)["sidecar"]
    assert "envFrom" not in sidecar
    assert not {"FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"} & env_of(sidecar).keys()
    assert pod == pod_of(spec(), storage())


@pytest.mark.unit
def test_a_claim_is_mounted_into_the_sidecar_at_the_operators_path() -> None:
    pod = pod_of(spec(), storage(**PVC))
    (volume,) = [v for v in pod["volumes"] if v["name"] == JOB_STORAGE_VOLUME]
    assert volume == {"name": "job-storage", "persistentVolumeClaim": {"claimName": "jobs"}}
    sidecar, engine = containers(pod)["sidecar"], containers(pod)["vllm"]
    assert {"name": "job-storage", "mountPath": "/data/jobs"} in sidecar["volumeMounts"]
    # The operator's own mounts stay, first; vLLM never sees the job files.
    assert [m["name"] for m in sidecar["volumeMounts"]] == ["control-token", "config",
                                                             "sidecar-state", "job-storage"]
    assert JOB_STORAGE_VOLUME not in {m["name"] for m in engine.get("volumeMounts", [])}
    assert "envFrom" not in sidecar


@pytest.mark.unit
def test_a_read_only_claim_is_read_only_in_volume_and_mount() -> None:
    pod = pod_of(spec(), storage(pvc={**PVC["pvc"], "read_only": True}))
    (volume,) = [v for v in pod["volumes"] if v["name"] == JOB_STORAGE_VOLUME]
    assert volume["persistentVolumeClaim"] == {"claimName": "jobs", "readOnly": True}
    (mount,) = [m for m in containers(pod)["sidecar"]["volumeMounts"]
                if m["name"] == JOB_STORAGE_VOLUME]
    assert mount == {"name": "job-storage", "mountPath": "/data/jobs", "readOnly": True}


@pytest.mark.unit
def test_s3_credentials_are_the_sidecars_env_from_and_the_endpoint_its_env() -> None:
    pod = pod_of(spec(scheduling={"enforcement": "engine"}), storage(**S3))
    sidecar, engine = containers(pod)["sidecar"], containers(pod)["vllm"]
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    env = env_of(sidecar)
    assert env["FSSPEC_S3_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000"
    # No claim: no volume; the engine gets neither credentials nor endpoint.
    assert JOB_STORAGE_VOLUME not in {v["name"] for v in pod["volumes"]}
    assert "envFrom" not in engine and "AWS_ENDPOINT_URL" not in env_of(engine)
    # The operator's channel mount (engine mode) is untouched.
    assert [m["name"] for m in sidecar["volumeMounts"]] == ["control-token", "config",
                                                             "sidecar-state", "engine-channel"]


@pytest.mark.unit
def test_credentials_without_an_endpoint_set_no_endpoint() -> None:
    sidecar = containers(pod_of(spec(), storage(s3={"credentials_secret": "s3-creds"})))[
        "sidecar"]
    assert sidecar["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert not {"FSSPEC_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"} & env_of(sidecar).keys()


@pytest.mark.unit
def test_the_endpoint_reaches_fsspecs_s3_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSSPEC_S3_ENDPOINT_URL is what fsspec hands s3fs as ``endpoint_url``."""
    from fsspec.config import set_conf_env

    env = env_of(containers(pod_of(spec(), storage(**S3)))["sidecar"])
    conf: dict[str, dict[str, Any]] = {}
    set_conf_env(conf, {"FSSPEC_S3_ENDPOINT_URL": env["FSSPEC_S3_ENDPOINT_URL"]})
    assert conf == {"s3": {"endpoint_url": "http://minio.storage:9000"}}


@pytest.mark.unit
def test_claim_and_storage_roots_together_keep_the_namespace_scoping() -> None:
    roots = ("file:///data/jobs",)
    sidecar = containers(pod_of(spec(), storage(**PVC, **S3), roots))["sidecar"]
    assert env_of(sidecar)["SLIPSTREAM_SIDECAR_STORAGE_ROOTS"] == '["file:///data/jobs"]'
    assert {"name": "job-storage", "mountPath": "/data/jobs"} in sidecar["volumeMounts"]
    assert check_uri("file:///data/jobs/team-a/in.jsonl", namespace="team-a", roots=roots,
                     field="input_uri")
    with pytest.raises(ScopeError):
        check_uri("file:///data/jobs/team-b/in.jsonl", namespace="team-a", roots=roots,
                  field="input_uri")


@pytest.mark.unit
def test_each_mount_names_a_volume_and_no_path_is_mounted_twice() -> None:
    s = spec(scheduling={"enforcement": "engine"}, engine={"image": "vllm", "shmSize": "1Gi"},
             modelSource={"uri": "pvc://models/llama"},
             template={"spec": {"volumes": [{"name": "cache", "emptyDir": {}}]}})
    pod = pod_of(s, storage(**PVC, **S3))
    names = [v["name"] for v in pod["volumes"]]
    assert len(names) == len(set(names)) and JOB_STORAGE_VOLUME in names
    for container in pod["containers"]:
        paths = [m["mountPath"] for m in container.get("volumeMounts", [])]
        assert len(paths) == len(set(paths)), container["name"]
        assert {m["name"] for m in container.get("volumeMounts", [])} <= set(names)


@pytest.mark.unit
def test_the_job_storage_volume_name_is_the_operators() -> None:
    assert JOB_STORAGE_VOLUME in RESERVED_VOLUMES
    s = spec(template={"spec": {"volumes": [{"name": "job-storage", "emptyDir": {}}]}})
    assert any("job-storage is the operator's" in p for p in validate_semantics(s))


@pytest.mark.unit
def test_a_changed_job_storage_renders_the_children_again() -> None:
    from slipstream_operator.reconcile_service import ServiceObserved, _rendered

    observed = ServiceObserved(pods=(), token="t", window=None, latency_model=None, profile="")
    first = _rendered(REF, spec(), observed, None, None)
    assert _rendered(REF, spec(), observed, None, first) is first
    moved = ServiceObserved(pods=(), token="t", window=None, latency_model=None, profile="",
                            job_storage=storage(**PVC))
    again = _rendered(REF, spec(), moved, None, first)
    assert again is not first
    deployment = next(o for o in again.objects if o["kind"] == "Deployment")
    assert JOB_STORAGE_VOLUME in {v["name"] for v in
                                  deployment["spec"]["template"]["spec"]["volumes"]}


# ---------------------------------------------------------------------------- validation


@pytest.mark.unit
@pytest.mark.parametrize(("path", "message"), [
    ("data/jobs", "'data/jobs' is not an absolute path"),
    ("", "'' is not an absolute path"),
    ("/", "overlaps the operator's /var/run/slipstream"),
    ("/etc/slipstream", "overlaps the operator's /etc/slipstream"),
    ("/etc/slipstream/jobs", "overlaps the operator's /etc/slipstream"),
    ("/var/run", "overlaps the operator's /var/run/slipstream"),
    ("/var/run/slipstream/control/", "overlaps the operator's /var/run/slipstream"),
    ("/dev/shm", "overlaps the operator's /dev/shm"),
    ("/mnt/models/jobs", "overlaps the operator's /mnt/models"),
    ("/tmp", "overlaps the operator's /tmp"),
    ("/data/../etc/slipstream", "has . or .. segments"),
])
def test_a_bad_mount_path_is_refused_naming_the_setting(path: str, message: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError) as err:
        storage(pvc={"claim_name": "jobs", "mount_path": path})
    text = str(err.value)
    if path:  # the empty path is refused by the field's own minimum length first
        assert "job_storage.pvc.mount_path" in text and message in text, text
    # The operator refuses to start with it, naming the setting.
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_JOB_STORAGE",
                       json.dumps({"pvc": {"claim_name": "jobs", "mount_path": path}}))
    with pytest.raises(ValidationError) as err:
        OperatorSettings()
    assert "job_storage" in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("path", ["/data/jobs", "/mnt/jobs", "/var/lib/slipstream-jobs",
                                  "/etc/slipstream-jobs", "/data/jobs/"])
def test_good_mount_paths_are_accepted(path: str) -> None:
    assert job_storage_problems(storage(pvc={"claim_name": "jobs", "mount_path": path})) == []


@pytest.mark.unit
@pytest.mark.parametrize("doc", [
    {"pvc": {"claim_name": "Jobs_Claim"}},
    {"s3": {"credentials_secret": "not a name"}},
    {"s3": {"endpoint_url": "minio:9000"}},
    {"pvc": {"claim": "jobs"}},
])
def test_malformed_job_storage_is_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        storage(**doc)


@pytest.mark.unit
def test_settings_read_job_storage_from_json_or_nested_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("SLIPSTREAM_OPERATOR_")]:
        monkeypatch.delenv(key)
    assert OperatorSettings().job_storage == NO_JOB_STORAGE
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_JOB_STORAGE__PVC__CLAIM_NAME", "jobs")
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_JOB_STORAGE__S3__CREDENTIALS_SECRET", "s3-creds")
    got = OperatorSettings().job_storage
    assert (got.pvc.claim_name, got.pvc.mount_path, got.s3.credentials_secret) == (
        "jobs", "/data/jobs", "s3-creds")


@pytest.mark.unit
def test_the_chart_refuses_the_same_paths_as_the_operator() -> None:
    """The chart's deployment template lists the paths a job storage mount may not overlap;
    they are the operator's (podspec.JOB_STORAGE_RESERVED_PATHS)."""
    text = (CHART / "templates" / "deployment.yaml").read_text()
    found = re.search(r"\$reserved := list ((?:\"[^\"]+\" ?)+)", text)
    assert found is not None
    assert sorted(re.findall(r"\"([^\"]+)\"", found.group(1))) == sorted(
        JOB_STORAGE_RESERVED_PATHS)


@pytest.mark.unit
def test_the_chart_values_and_schema_carry_job_storage() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["jobStorage"]
    assert values == {"pvc": {"claimName": "", "mountPath": "/data/jobs", "readOnly": False},
                      "s3": {"credentialsSecret": "", "endpointUrl": ""}}
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["jobStorage"]
    assert set(schema["properties"]["pvc"]["properties"]) == set(values["pvc"])
    assert set(schema["properties"]["s3"]["properties"]) == set(values["s3"])


@pytest.mark.unit
def test_the_image_carries_s3fs() -> None:
    """The Containerfile installs the s3 extra, and its lock pins s3fs at fsspec's version
    (s3fs releases pin the fsspec of the same date)."""
    import tomllib

    root = CHART.parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.startswith("s3fs") for r in extras["s3"])
    install = re.search(r"'slipstream\[([a-z0-9,]+)\]'", (root / "Containerfile").read_text())
    assert install is not None and "s3" in install.group(1).split(",")
    lock = (root / "locks" / "image.txt").read_text()
    pins = dict(re.findall(r"^([a-z0-9_.-]+)==(\S+)", lock, re.M))
    assert pins["s3fs"] == pins["fsspec"]


# ---------------------------------------------------------------------------- the chart

JOB_VALUES = ("jobStorage.pvc.claimName=jobs", "jobStorage.pvc.mountPath=/srv/jobs",
              "jobStorage.s3.credentialsSecret=s3-creds",
              "jobStorage.s3.endpointUrl=http://minio.storage:9000",
              "operator.storageRoots[0]=file:///srv/jobs")


def _operator(*sets: str) -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = by_kind(docs(*sets), "Deployment")[0]
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


@pytest.mark.integration
def test_job_storage_values_reach_the_operator_and_the_pods_it_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """jobStorage -> the operator pod's volume, mount, envFrom and endpoint, and its settings
    -> the sidecar of every InferenceService: the same claim at the same path."""
    pod, container = _operator(*JOB_VALUES)
    assert {"name": "job-storage", "persistentVolumeClaim": {"claimName": "jobs"}} in pod[
        "volumes"]
    assert {"name": "job-storage", "mountPath": "/srv/jobs"} in container["volumeMounts"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["FSSPEC_S3_ENDPOINT_URL"] == env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000"
    settings = settings_from_env(
        {k: v for k, v in env.items() if k.startswith("SLIPSTREAM_OPERATOR_")}, monkeypatch)
    assert settings.job_storage == storage(
        pvc={"claim_name": "jobs", "mount_path": "/srv/jobs"},
        s3={"credentials_secret": "s3-creds", "endpoint_url": "http://minio.storage:9000"})
    sidecar_pod = pod_of(spec(), settings.job_storage, tuple(settings.storage_roots))
    sidecar = containers(sidecar_pod)["sidecar"]
    (mount,) = [m for m in sidecar["volumeMounts"] if m["name"] == JOB_STORAGE_VOLUME]
    (volume,) = [v for v in sidecar_pod["volumes"] if v["name"] == JOB_STORAGE_VOLUME]
    assert mount["mountPath"] == "/srv/jobs" == container["volumeMounts"][-1]["mountPath"]
    assert volume["persistentVolumeClaim"]["claimName"] == "jobs"
    assert sidecar["envFrom"] == container["envFrom"]
    assert env_of(sidecar)["SLIPSTREAM_SIDECAR_STORAGE_ROOTS"] == '["file:///srv/jobs"]'


@pytest.mark.integration
def test_without_job_storage_values_the_operator_pod_is_unchanged() -> None:
    pod, container = _operator()
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert "envFrom" not in container
    names = {e["name"] for e in container["env"]}
    assert not names & {"SLIPSTREAM_OPERATOR_JOB_STORAGE", "AWS_ENDPOINT_URL",
                        "FSSPEC_S3_ENDPOINT_URL"}


@pytest.mark.integration
def test_s3_alone_mounts_nothing() -> None:
    pod, container = _operator("jobStorage.s3.credentialsSecret=s3-creds")
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


@pytest.mark.integration
@pytest.mark.parametrize(("sets", "message"), [
    (("jobStorage.pvc.mountPath=data/jobs",), "/jobStorage/pvc/mountPath"),
    (("jobStorage.pvc.mountPath=/tmp/jobs",),
     "jobStorage.pvc.mountPath: /tmp/jobs overlaps the operator's /tmp"),
    (("jobStorage.pvc.mountPath=/etc",),
     "jobStorage.pvc.mountPath: /etc overlaps the operator's /etc/slipstream"),
    (("jobStorage.pvc.mountPath=/",), "jobStorage.pvc.mountPath: / overlaps"),
    (("jobStorage.pvc.claimName=Jobs",), "/jobStorage/pvc/claimName"),
    (("jobStorage.s3.endpointUrl=minio:9000",), "/jobStorage/s3/endpointUrl"),
    (("jobStorage.s3.secret=x",), "/jobStorage/s3"),
    (("jobStorage.pvc.claimName=jobs", "operator.extraVolumes[0].name=job-storage",
      "operator.extraVolumes[0].emptyDir.medium=Memory"),
     "operator.extraVolumes[0]: the name job-storage is jobStorage.pvc's"),
    (("jobStorage.pvc.claimName=jobs", "operator.extraVolumeMounts[0].name=x",
      "operator.extraVolumeMounts[0].mountPath=/data/jobs/"),
     "operator.extraVolumeMounts[0]: /data/jobs/ is jobStorage.pvc.mountPath"),
    (("jobStorage.s3.endpointUrl=http://minio:9000",
      "operator.extraEnv[0].name=AWS_ENDPOINT_URL", "operator.extraEnv[0].value=x"),
     "operator.extraEnv[0]: AWS_ENDPOINT_URL is set by the chart"),
    (("operator.extraEnv[0].name=SLIPSTREAM_OPERATOR_JOB_STORAGE",
      "operator.extraEnv[0].value=x"),
     "operator.extraEnv[0]: SLIPSTREAM_OPERATOR_JOB_STORAGE is set by the chart"),
])
def test_the_chart_refuses_bad_job_storage_values(sets: tuple[str, ...], message: str) -> None:
    result = helm_template(*sets, check=False)
    assert result.returncode != 0, f"{sets} was accepted"
    assert message in result.stderr, result.stderr
