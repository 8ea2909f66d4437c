"""The pod an InferenceService renders: model source, the spec's pod fields added to the
operator's, placement by gpuType, and the reserved parts refused with the field named."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from slipstream_operator.api import InferenceServiceSpec, validate_semantics
from slipstream_operator.errors import SpecError
from slipstream_operator.handlers import ParsedSpecs
from slipstream_operator.podspec import DEFAULT_PLACEMENT, GpuPlacement, placement_problems
from slipstream_operator.reconcile_service import ObjectRef, children
from slipstream_operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

REF = ObjectRef("chat", "team-a", "uid-1", 1)
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def spec(*, engine: dict[str, Any] | None = None, **fields: Any) -> InferenceServiceSpec:
    """A valid service (one H100) with ``engine`` merged into its engine and ``fields`` set."""
    doc: dict[str, Any] = {
        "model": "llama-2-7b",
        "engine": {"image": "vllm/vllm-openai:v0.11.1", **(engine or {})},
        "slo": {"ttft": {"p99": "2s"}},
        **fields,
    }
    return InferenceServiceSpec.model_validate(doc)


def template(**pod: Any) -> dict[str, Any]:
    """``spec.template`` with ``labels``/``annotations`` in metadata, the rest in spec."""
    meta = {k: pod.pop(k) for k in ("labels", "annotations") if k in pod}
    return {"metadata": meta, "spec": pod}


def pod_of(s: InferenceServiceSpec, placement: GpuPlacement = DEFAULT_PLACEMENT
           ) -> dict[str, Any]:
    objs = {c["kind"]: c for c in children(REF, s, "token", None, placement=placement)}
    tpl: dict[str, Any] = objs["Deployment"]["spec"]["template"]
    return tpl


def containers(tpl: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in tpl["spec"]["containers"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def problems(s: InferenceServiceSpec) -> list[str]:
    return validate_semantics(s)


# ---------------------------------------------------------------------------- model source


def test_without_a_source_vllm_loads_and_serves_the_model_name() -> None:
    args = containers(pod_of(spec()))["vllm"]["args"]
    assert flag(args, "--model") == "llama-2-7b"
    assert flag(args, "--served-model-name") == "llama-2-7b"


def test_a_hugging_face_source_loads_the_id_with_the_token_from_its_secret() -> None:
    s = spec(modelSource={"uri": "hf://meta-llama/Llama-2-7b-hf", "revision": "main",
                          "hfTokenSecret": {"name": "hf-token"}},
             engine={"env": [{"name": "HF_HOME", "value": "/cache"}]})
    vllm = containers(pod_of(s))["vllm"]
    assert flag(vllm["args"], "--model") == "meta-llama/Llama-2-7b-hf"
    assert flag(vllm["args"], "--served-model-name") == "llama-2-7b"  # what jobs name
    assert flag(vllm["args"], "--revision") == "main"
    assert vllm["env"] == [  # the operator's first, then the spec's
        {"name": "HF_TOKEN",
         "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}},
        {"name": "HF_HOME", "value": "/cache"},
    ]
    assert problems(s) == []


def test_a_pvc_source_mounts_the_claim_read_only_and_loads_the_path_in_it() -> None:
    s = spec(modelSource={"uri": "pvc://llama-weights/models/llama-2-7b"})
    tpl = pod_of(s)
    vllm = containers(tpl)["vllm"]
    assert flag(vllm["args"], "--model") == "/mnt/models/models/llama-2-7b"
    assert {"name": "model-store", "mountPath": "/mnt/models", "readOnly": True} \
        in vllm["volumeMounts"]
    assert {"name": "model-store", "persistentVolumeClaim": {
        "claimName": "llama-weights", "readOnly": True}} in tpl["spec"]["volumes"]
    assert "env" not in vllm  # no token: nothing to add
    whole = spec(modelSource={"uri": "pvc://llama-weights"})
    assert flag(containers(pod_of(whole))["vllm"]["args"], "--model") == "/mnt/models"


def test_a_path_source_is_loaded_as_it_is_from_the_specs_own_volume() -> None:
    s = spec(modelSource={"uri": "/models/llama-2-7b"},
             engine={"volumeMounts": [{"name": "weights", "mountPath": "/models",
                                       "readOnly": True}]},
             template=template(volumes=[{"name": "weights", "hostPath": {"path": "/data"}}]))
    tpl = pod_of(s)
    vllm = containers(tpl)["vllm"]
    assert flag(vllm["args"], "--model") == "/models/llama-2-7b"
    assert vllm["volumeMounts"] == [{"name": "weights", "mountPath": "/models",
                                     "readOnly": True}]
    assert tpl["spec"]["volumes"][-1] == {"name": "weights", "hostPath": {"path": "/data"}}
    assert problems(s) == []


@pytest.mark.parametrize("uri", ["s3://bucket/m", "hf://", "pvc://Bad_Claim/x", "models/x"])
def test_a_source_uri_of_another_form_is_refused_by_the_schema(uri: str) -> None:
    with pytest.raises(ValidationError, match="uri"):
        spec(modelSource={"uri": uri})


def test_token_and_revision_need_a_hugging_face_source() -> None:
    s = spec(modelSource={"uri": "pvc://w", "revision": "v1", "hfTokenSecret": {"name": "t"}})
    assert problems(s) == ["spec.modelSource.revision: needs an hf:// uri",
                           "spec.modelSource.hfTokenSecret: needs an hf:// uri"]


# ---------------------------------------------------------------------------- added fields


def test_the_specs_pod_fields_are_added_to_the_operators_pod() -> None:
    s = spec(
        engine={"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "envFrom": [{"secretRef": {"name": "s3-creds"}, "prefix": "AWS_"}],
                "volumeMounts": [{"name": "cache", "mountPath": "/root/.cache/huggingface"}],
                "resources": {"requests": {"cpu": "8", "memory": "64Gi"},
                              "limits": {"memory": "80Gi"}},
                "shmSize": "8Gi", "gpus": 2},
        template=template(
            labels={"team": "search"}, annotations={"sidecar.istio.io/inject": "false"},
            nodeSelector={"topology.kubernetes.io/zone": "eu-1a"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists",
                          "effect": "NoSchedule"}],
            affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            volumes=[{"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}],
            imagePullSecrets=[{"name": "registry"}], serviceAccountName="vllm",
            priorityClassName="online-high"),
    )
    assert problems(s) == []
    tpl = pod_of(s)
    pod, vllm = tpl["spec"], containers(tpl)["vllm"]
    assert vllm["env"][0] == {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}
    assert vllm["env"][1]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert vllm["envFrom"] == [{"prefix": "AWS_", "secretRef": {"name": "s3-creds"}}]
    assert vllm["resources"] == {"requests": {"cpu": "8", "memory": "64Gi"},
                                 "limits": {"memory": "80Gi", "nvidia.com/gpu": "2"}}
    assert vllm["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/root/.cache/huggingface"},
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert list(volumes) == ["control-token", "config", "sidecar-state", "dshm", "cache"]
    assert volumes["dshm"] == {"name": "dshm",
                               "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert pod["nodeSelector"] == {"topology.kubernetes.io/zone": "eu-1a", **H100}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert "podAntiAffinity" in pod["affinity"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["serviceAccountName"] == "vllm" and pod["priorityClassName"] == "online-high"
    labels, annotations = tpl["metadata"]["labels"], tpl["metadata"]["annotations"]
    assert labels["team"] == "search" and labels["slipstream.dev/service"] == "chat"
    assert annotations["sidecar.istio.io/inject"] == "false"
    assert annotations["prometheus.io/port"] == "8000"
    # The sidecar is the operator's alone.
    sidecar = containers(tpl)["sidecar"]
    assert all(e["name"].startswith("SLIPSTREAM_SIDECAR_") for e in sidecar["env"])
    assert {m["name"] for m in sidecar["volumeMounts"]} == {"control-token", "config",
                                                               "sidecar-state"}


def test_an_empty_template_adds_nothing() -> None:
    tpl = pod_of(spec(engine={"gpus": 0}))
    assert set(tpl["spec"]) == {"containers", "volumes"}
    vllm = containers(tpl)["vllm"]
    assert set(vllm) == {"name", "image", "args", "resources"} and vllm["resources"] == {}


def test_the_sidecar_keeps_its_state_in_an_empty_dir_that_outlives_its_restarts() -> None:
    pod = pod_of(spec())
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["sidecar-state"] == {"name": "sidecar-state", "emptyDir": {}}
    sidecar, engine = containers(pod)["sidecar"], containers(pod)["vllm"]
    assert {"name": "sidecar-state", "mountPath": "/var/run/slipstream/state"} in (
        sidecar["volumeMounts"])
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["SLIPSTREAM_SIDECAR_STATE_DIR"] == "/var/run/slipstream/state"
    # The sidecar's shards and configuration are its own: vLLM does not mount them.
    assert all(m["name"] != "sidecar-state" for m in engine.get("volumeMounts", []))


def test_engine_mode_keeps_the_operators_channel_first() -> None:
    s = spec(scheduling={"enforcement": "engine"}, engine={
        "env": [{"name": "VLLM_USE_V1", "value": "1"}], "shmSize": "1Gi"})
    vllm = containers(pod_of(s))["vllm"]
    assert [e["name"] for e in vllm["env"]] == ["SLIPSTREAM_CHANNEL_DIR", "VLLM_USE_V1"]
    assert [m["name"] for m in vllm["volumeMounts"]] == ["engine-channel", "dshm"]
    assert vllm["ports"] == [{"name": "engine", "containerPort": 8001}]


# ---------------------------------------------------------------------------- placement


def test_gpu_type_places_the_pods_by_the_gpu_feature_discovery_label() -> None:
    assert pod_of(spec())["spec"]["nodeSelector"] == H100
    a100 = pod_of(spec(engine={"gpuType": "A100"}))["spec"]["nodeSelector"]
    assert a100 == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    # No GPUs, a type the map does not name, or placement turned off: no label.
    assert "nodeSelector" not in pod_of(spec(engine={"gpus": 0}))["spec"]
    assert "nodeSelector" not in pod_of(spec(engine={"gpuType": "l40s"}))["spec"]
    assert "nodeSelector" not in pod_of(spec(), GpuPlacement.of("", {}))["spec"]


def test_the_placement_label_and_values_come_from_the_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LABEL", "VALUES"):
        monkeypatch.delenv(f"SLIPSTREAM_OPERATOR_GPU_NODE_{name}", raising=False)
    defaults = OperatorSettings()
    assert defaults.gpu_node_label == "nvidia.com/gpu.product"
    assert defaults.gpu_node_values["h100"] == H100["nvidia.com/gpu.product"]
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_GPU_NODE_LABEL", "cloud.google.com/gke-accelerator")
    monkeypatch.setenv("SLIPSTREAM_OPERATOR_GPU_NODE_VALUES", '{"H100": "nvidia-h100-80gb"}')
    settings = OperatorSettings()
    placement = GpuPlacement.of(settings.gpu_node_label, settings.gpu_node_values)
    assert pod_of(spec(), placement)["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}


def test_a_node_selector_that_contradicts_the_gpu_type_is_refused() -> None:
    same = spec(template=template(nodeSelector=dict(H100)))
    assert placement_problems(same, GpuPlacement()) == []
    assert pod_of(same)["spec"]["nodeSelector"] == H100
    other = spec(template=template(nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A10G"}))
    (problem,) = placement_problems(other, GpuPlacement())
    assert problem.startswith("spec.template.spec.nodeSelector['nvidia.com/gpu.product']: ")
    assert "gpuType h100" in problem
    with pytest.raises(SpecError, match="contradicts gpuType"):
        pod_of(other)
    assert placement_problems(other, GpuPlacement.of("", {})) == []


def test_the_operator_reports_a_contradicting_node_selector_as_an_invalid_spec() -> None:
    raw = spec(template=template(nodeSelector={"nvidia.com/gpu.product": "x"})).wire()
    _, found = ParsedSpecs(GpuPlacement()).parse("uid-1", raw, InferenceServiceSpec)
    assert len(found) == 1 and "contradicts gpuType h100" in found[0]
    _, unchecked = ParsedSpecs().parse("uid-1", raw, InferenceServiceSpec)
    assert unchecked == ()


# ---------------------------------------------------------------------------- reserved


@pytest.mark.parametrize(("fields", "expected"), [
    ({"engine": {"args": ["--port", "9999"]}}, "spec.engine.args[0]: --port is set by"),
    ({"engine": {"args": ["--max-num-seqs", "8", "--served-model-name=x"]}},
     "spec.engine.args[2]: --served-model-name is set by"),
    ({"engine": {"env": [{"name": "SLIPSTREAM_CHANNEL_DIR", "value": "/x"}]}},
     "spec.engine.env[0].name: SLIPSTREAM_CHANNEL_DIR"),
    ({"engine": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
     "spec.engine.env[1].name: A is set twice"),
    ({"engine": {"env": [{"name": "HF_TOKEN", "value": "hf_x"}]},
      "modelSource": {"uri": "hf://org/m", "hfTokenSecret": {"name": "t"}}},
     "spec.engine.env[0].name: HF_TOKEN comes from spec.modelSource.hfTokenSecret"),
    ({"engine": {"env": [{"name": "A", "value": "1",
                          "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
     "spec.engine.env[0].valueFrom: set value or valueFrom, not both"),
    ({"engine": {"env": [{"name": "A", "valueFrom": {}}]}},
     "spec.engine.env[0].valueFrom: set exactly one"),
    ({"engine": {"envFrom": [{"prefix": "X_"}]}}, "spec.engine.envFrom[0]: set exactly one"),
    ({"engine": {"resources": {"limits": {"nvidia.com/gpu": "4"}}}},
     "spec.engine.resources.limits['nvidia.com/gpu']: set spec.engine.gpus instead"),
    ({"template": template(labels={"slipstream.dev/service": "other"})},
     "spec.template.metadata.labels['slipstream.dev/service']: set by the operator"),
    ({"template": template(annotations={"prometheus.io/port": "1"})},
     "spec.template.metadata.annotations['prometheus.io/port']: set by the operator"),
    ({"template": template(volumes=[{"name": "config", "emptyDir": {}}])},
     "spec.template.spec.volumes[0].name: config is the operator's"),
    ({"template": template(volumes=[{"name": "sidecar-state", "emptyDir": {}}])},
     "spec.template.spec.volumes[0].name: sidecar-state is the operator's"),
    ({"template": template(volumes=[{"name": "a", "emptyDir": {}},
                                    {"name": "a", "emptyDir": {}}])},
     "spec.template.spec.volumes[1].name: a is named twice"),
    ({"template": template(volumes=[{"name": "a"}])},
     "spec.template.spec.volumes[0]: set exactly one volume source"),
    ({"engine": {"volumeMounts": [{"name": "nope", "mountPath": "/data"}]}},
     "spec.engine.volumeMounts[0].name: nope is not a volume of spec.template.spec.volumes"),
    ({"engine": {"volumeMounts": [{"name": "control-token", "mountPath": "/t"}]}},
     "spec.engine.volumeMounts[0].name: control-token is not a volume"),
    ({"engine": {"volumeMounts": [{"name": "a", "mountPath": "/dev/shm"}]},
      "template": template(volumes=[{"name": "a", "emptyDir": {"medium": "Memory"}}])},
     "spec.engine.volumeMounts[0].mountPath: /dev/shm overlaps the operator's /dev/shm; "
     "set spec.engine.shmSize"),
    ({"engine": {"volumeMounts": [{"name": "a", "mountPath": "/var/run/slipstream/x"}]},
      "template": template(volumes=[{"name": "a", "emptyDir": {}}])},
     "spec.engine.volumeMounts[0].mountPath: /var/run/slipstream/x overlaps"),
    ({"engine": {"volumeMounts": [{"name": "a", "mountPath": "/mnt/models/"}]},
      "template": template(volumes=[{"name": "a", "emptyDir": {}}]),
      "modelSource": {"uri": "pvc://w"}},
     "spec.engine.volumeMounts[0].mountPath: /mnt/models/ overlaps the operator's /mnt/models"),
    ({"engine": {"volumeMounts": [{"name": "a", "mountPath": "/d"},
                                  {"name": "a", "mountPath": "/d/"}]},
      "template": template(volumes=[{"name": "a", "emptyDir": {}}])},
     "spec.engine.volumeMounts[1].mountPath: /d/ is mounted twice"),
    ({"sidecar": {"httpPort": 8001}}, "spec.sidecar.httpPort: 8001 is vLLM's port"),
    ({"sidecar": {"grpcPort": 8001}}, "spec.sidecar.grpcPort: 8001 is vLLM's port"),
])
def test_what_the_operator_owns_cannot_be_overridden(fields: dict[str, Any],
                                                     expected: str) -> None:
    found = problems(spec(**fields))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_a_mount_at_models_is_the_users_without_a_pvc_source() -> None:
    s = spec(engine={"volumeMounts": [{"name": "a", "mountPath": "/mnt/models"}]},
             template=template(volumes=[{"name": "a", "emptyDir": {}}]))
    assert problems(s) == []


@pytest.mark.parametrize("fields", [
    {"template": {"spec": {"serviceAccountName": "Not_A_Name"}}},
    {"template": {"spec": {"tolerations": [{"effect": "Sometimes"}]}}},
    {"engine": {"shmSize": "lots"}},
    {"engine": {"env": [{"name": "1=2", "value": "x"}]}},
    {"engine": {"volumeMounts": [{"name": "a", "mountPath": "relative"}]}},
    {"template": {"spec": {"volumes": [{"name": "UPPER", "emptyDir": {}}]}}},
    {"template": {"spec": {"hostNetwork": True}}},  # not offered: unknown fields are refused
])
def test_malformed_pod_fields_are_refused_by_the_schema(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        spec(**fields)
