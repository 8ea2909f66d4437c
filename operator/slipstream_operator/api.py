"""The ``slipstream.dev/v1alpha1`` API: InferenceService and OfflineJob, as pydantic models.

These models are the single source of truth. ``crdgen`` turns them into the
CRD manifests under ``crds/`` (structural OpenAPI schema, CEL rules, printer
columns), ``apidocs`` into ``docs/reference/api.md``, and the operator parses
every object it reads through them. Field descriptions are what
``kubectl explain inferenceservices.slipstream.dev.spec`` prints.

Conventions: camelCase on the wire (Python names are snake_case with aliases);
optional fields are omitted rather than null (dump with ``exclude_none``);
durations are strings in Go's ``time.ParseDuration`` form restricted to
``ms``/``s``/``m``/``h`` (``600ms``, ``2s``, ``1h30m``) so that CEL's
``duration()`` can compare them on the API server; :func:`parse_duration`
reads them here.

Rules a schema cannot state are CEL (``x-kubernetes-validations``) attached
with :func:`_cel` and checked by the API server; :func:`validate_semantics`
repeats them in Python so that the pure code never trusts an object that
bypassed admission.

Deliberately left out: conversion between versions (there is only v1alpha1),
defaulting webhooks (schema defaults suffice), and per-request overrides of
a service's class or priority (both come from the objects, never a client).
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

GROUP = "slipstream.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "slipstream"

DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
"""A Go duration limited to ms, s, m, h units: ``600ms``, ``2s``, ``1.5s``, ``1h30m``."""

_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

URI_PATTERN = r"^(file|s3|gs|az|memory)://.+$"
CAMEL_REASON_PATTERN = r"^[A-Z][A-Za-z0-9]*$"

Duration = Annotated[str, StringConstraints(pattern=DURATION_PATTERN, max_length=32)]
Uri = Annotated[str, StringConstraints(pattern=URI_PATTERN, min_length=8, max_length=2048)]
Quantity = int | str

DEFAULT_SIDECAR_IMAGE = "ghcr.io/slipstream-dev/slipstream:0.1.0"
"""The sidecar image when neither ``spec.sidecar.image`` nor the operator's setting names one."""


def parse_duration(text: str) -> float:
    """Seconds in a duration string (``"600ms"`` -> 0.6). Raises ValueError on bad input."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"not a duration (want e.g. 600ms, 2s, 1h30m): {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in _DURATION_PART.findall(text))


def format_duration(seconds: float) -> str:
    """A short duration string that :func:`parse_duration` reads back.

    Below 10 s: whole milliseconds (``"45ms"``, ``"2500ms"``); below an hour:
    ``"1m30s"``; else ``"2h5m"``. Negative values clamp to ``"0ms"``.
    """
    if seconds < 10.0:
        return f"{max(0, round(seconds * 1000))}ms"
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _cel(*rules: tuple[str, str, str | None]) -> dict[str, Any]:
    """``json_schema_extra`` carrying CEL rules: (rule, message, fieldPath or None)."""
    out = []
    for rule, message, field_path in rules:
        entry: dict[str, str] = {"rule": rule, "message": message}
        if field_path is not None:
            entry["fieldPath"] = field_path
        out.append(entry)
    return {"x-kubernetes-validations": out}


class ApiModel(BaseModel):
    """Base of every API model: frozen, camelCase aliases, unknown fields rejected."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=False,
    )

    def wire(self) -> dict[str, Any]:
        """The object as it goes to the API server (camelCase, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- shared


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observation of an object's state (metav1.Condition)."""

    type: str = Field(
        description="Condition type in CamelCase, e.g. Ready, SLOMet, BudgetReady.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(
        description="Why the condition has its status, one CamelCase word, e.g. WithinTarget.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    message: str = Field(
        default="", description="Human-readable detail. Default: empty.", max_length=2048
    )
    last_transition_time: datetime = Field(
        description="When status last changed (RFC 3339); unchanged while status stays the same."
    )
    observed_generation: int = Field(
        default=0,
        description="metadata.generation the condition was computed for. Default: 0.",
        ge=0,
    )


class LabelSelectorRequirement(ApiModel):
    """One set-based requirement of a label selector."""

    key: str = Field(description="Label key.", max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In, NotIn, Exists or DoesNotExist."
    )
    values: list[Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=list,
        description="Values for In/NotIn; must be empty for Exists/DoesNotExist. Default: empty.",
        max_length=64,
    )


class LabelSelector(ApiModel):
    """A Kubernetes label selector; an empty selector matches every object."""

    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels that must all be present with these values."
    )
    match_expressions: list[LabelSelectorRequirement] = Field(
        default_factory=list,
        description="Set-based requirements, all of which must hold.",
        max_length=16,
    )

    def matches(self, labels: dict[str, str]) -> bool:
        """Whether an object with ``labels`` is selected."""
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            present = req.key in labels
            if req.operator == "Exists" and not present:
                return False
            if req.operator == "DoesNotExist" and present:
                return False
            if req.operator == "In" and labels.get(req.key) not in req.values:
                return False
            if req.operator == "NotIn" and present and labels[req.key] in req.values:
                return False
        return True


# --------------------------------------------------------------------------- InferenceService


class LatencyTarget(ApiModel):
    """Targets for one latency metric; set the mean, the P99, or both."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.mean) || has(self.p99)", "set at least one of mean and p99", None),
            (
                "!has(self.mean) || !has(self.p99) || duration(self.p99) >= duration(self.mean)",
                "p99 must be at least the mean",
                ".p99",
            ),
        )
    )

    mean: Duration | None = Field(
        default=None,
        description="Target for the mean over the status window, e.g. 600ms. Unset: none.",
    )
    p99: Duration | None = Field(
        default=None, description="Target for the 99th percentile over the status window, e.g. 2s."
    )


class SLOSpec(ApiModel):
    """Latency SLOs of the online traffic; every target set is enforced."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.ttft) || has(self.tbt)", "set at least one SLO (ttft or tbt)", None)
        )
    )

    ttft: LatencyTarget | None = Field(
        default=None, description="Time to first token (queueing included)."
    )
    tbt: LatencyTarget | None = Field(
        default=None, description="Time between tokens of one stream."
    )


class ResourceRequirements(ApiModel):
    """Container resource requests and limits (Kubernetes quantities)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Minimum resources.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Maximum resources.")


# --------------------------------------------------------------------------- the pod

ENGINE_PORT = 8001
"""vLLM's port in every pod (127.0.0.1 in sidecar mode, 0.0.0.0 in engine mode)."""
MODEL_MOUNT = "/mnt/models"
"""Where a ``pvc://`` model source's claim is mounted (read-only) in the engine container."""
SHM_MOUNT = "/dev/shm"

# What the operator owns in the pod it renders. Setting any of it is a validation error that
# names the field; everything else of spec.template and spec.engine is added to the pod.
RESERVED_VOLUMES = (
    "control-token", "config", "engine-channel", "dshm", "model-store", "job-storage",
    "sidecar-state",
)
RESERVED_MOUNT_PREFIXES = ("/var/run/slipstream", "/etc/slipstream")
RESERVED_LABELS = ("slipstream.dev/service", "app.kubernetes.io/managed-by")
RESERVED_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port")
RESERVED_ENV_PREFIX = "SLIPSTREAM_"
RESERVED_ENGINE_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--scheduling-policy", "--scheduler-cls",
)
GPU_RESOURCE = "nvidia.com/gpu"

QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
MODEL_URI_PATTERN = (
    r"^(hf://[A-Za-z0-9][-_.A-Za-z0-9]*(/[-_.A-Za-z0-9]+)?"
    r"|pvc://[a-z0-9]([-.a-z0-9]*[a-z0-9])?(/[^\s]*)?"
    r"|/[^\s]*)$"
)
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
DNS_NAME_PATTERN = r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"

Name = Annotated[str, StringConstraints(min_length=1, max_length=253)]
LabelValue = Annotated[str, StringConstraints(max_length=63)]


class SecretKeySelector(ApiModel):
    """A key of a Secret in the service's namespace."""

    name: str = Field(description="Secret name.", min_length=1, max_length=253)
    key: str = Field(description="Key in the Secret.", min_length=1, max_length=253)
    optional: bool | None = Field(
        default=None, description="Start the container even if the Secret or key is missing."
    )


class ConfigMapKeySelector(ApiModel):
    """A key of a ConfigMap in the service's namespace."""

    name: str = Field(description="ConfigMap name.", min_length=1, max_length=253)
    key: str = Field(description="Key in the ConfigMap.", min_length=1, max_length=253)
    optional: bool | None = Field(
        default=None, description="Start the container even if the ConfigMap or key is missing."
    )


class ObjectFieldSelector(ApiModel):
    """A field of the pod (the downward API), e.g. metadata.name or status.podIP."""

    field_path: str = Field(description="Path of the field, e.g. status.podIP.", max_length=256)
    api_version: str | None = Field(default=None, description="Version of the path's schema.")


class ResourceFieldSelector(ApiModel):
    """A resource request or limit of the container, e.g. limits.memory."""

    resource: str = Field(description="e.g. limits.memory.", max_length=64)
    container_name: str | None = Field(default=None, description="Container; default: this.")
    divisor: Quantity | None = Field(default=None, description="Unit of the value, e.g. 1Mi.")


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from; set exactly one."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "(has(self.secretKeyRef) ? 1 : 0) + (has(self.configMapKeyRef) ? 1 : 0) + "
                "(has(self.fieldRef) ? 1 : 0) + (has(self.resourceFieldRef) ? 1 : 0) == 1",
                "set exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef",
                None,
            ),
        )
    )

    secret_key_ref: SecretKeySelector | None = Field(
        default=None, description="A key of a Secret, e.g. the Hugging Face token."
    )
    config_map_key_ref: ConfigMapKeySelector | None = Field(
        default=None, description="A key of a ConfigMap."
    )
    field_ref: ObjectFieldSelector | None = Field(default=None, description="A pod field.")
    resource_field_ref: ResourceFieldSelector | None = Field(
        default=None, description="A resource of the container."
    )


class EnvVar(ApiModel):
    """An environment variable of the engine container (corev1.EnvVar)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.value) || !has(self.valueFrom)", "set value or valueFrom, not both",
             ".valueFrom"),
            ("!self.name.startsWith('SLIPSTREAM_')", "names starting with SLIPSTREAM_ are the "
             "operator's", ".name"),
        )
    )

    name: str = Field(description="Variable name; not SLIPSTREAM_*.", min_length=1,
                      max_length=256, pattern=ENV_NAME_PATTERN)
    value: str | None = Field(default=None, description="Literal value.", max_length=32768)
    value_from: EnvVarSource | None = Field(
        default=None, description="Value from a Secret, ConfigMap or the pod."
    )


class EnvSourceRef(ApiModel):
    """A Secret or ConfigMap whose keys all become environment variables."""

    name: str = Field(description="Object name.", min_length=1, max_length=253)
    optional: bool | None = Field(default=None, description="Start even if it is missing.")


class EnvFromSource(ApiModel):
    """Environment variables from every key of a Secret or ConfigMap (corev1.EnvFromSource)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.secretRef) != has(self.configMapRef)",
             "set exactly one of secretRef and configMapRef", None),
        )
    )

    prefix: str | None = Field(default=None, description="Prefix added to every key.",
                               max_length=256)
    secret_ref: EnvSourceRef | None = Field(default=None, description="The Secret.")
    config_map_ref: EnvSourceRef | None = Field(default=None, description="The ConfigMap.")


class VolumeMount(ApiModel):
    """A volume of spec.template.spec.volumes mounted into the engine container."""

    name: str = Field(description="Name of a volume in spec.template.spec.volumes.",
                      min_length=1, max_length=63)
    mount_path: str = Field(description="Absolute path in the container; not /dev/shm, "
                            "/var/run/slipstream, /etc/slipstream, nor /mnt/models with a pvc:// "
                            "model source.", min_length=1, max_length=1024, pattern=r"^/")
    sub_path: str | None = Field(default=None, description="Path inside the volume.",
                                 max_length=1024)
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class Volume(ApiModel):
    """A pod volume (corev1.Volume): a name and one source, e.g. persistentVolumeClaim,
    emptyDir, hostPath, secret, configMap, nfs, csi, ephemeral. The source is passed to the pod
    as written; the API server checks it when the operator applies the Deployment."""

    model_config = ConfigDict(extra="allow",
                              json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    name: str = Field(description="Volume name (a DNS label); not one of the operator's: "
                      + ", ".join(RESERVED_VOLUMES) + ".",
                      min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

    def source_keys(self) -> list[str]:
        """The volume source fields set (a valid volume has exactly one)."""
        return sorted((self.model_extra or {}).keys())


class Toleration(ApiModel):
    """A taint the pods tolerate (corev1.Toleration)."""

    key: str | None = Field(default=None, description="Taint key; empty with Exists: all.",
                            max_length=317)
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal. Default: Equal."
    )
    value: str | None = Field(default=None, description="Taint value (Equal).", max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="NoSchedule, PreferNoSchedule or NoExecute; unset: all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="With NoExecute: seconds the pod stays after the taint."
    )


class LocalObjectReference(ApiModel):
    """An object of the service's namespace, by name."""

    name: str = Field(description="Object name.", min_length=1, max_length=253)


class PodMetadata(ApiModel):
    """Labels and annotations added to every pod."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.labels) || !('slipstream.dev/service' in self.labels || "
             "'app.kubernetes.io/managed-by' in self.labels)",
             "labels slipstream.dev/service and app.kubernetes.io/managed-by are the operator's",
             ".labels"),
        )
    )

    labels: dict[str, LabelValue] = Field(
        default_factory=dict, description="Pod labels; not " + ", ".join(RESERVED_LABELS) + "."
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Pod annotations; not " + ", ".join(RESERVED_ANNOTATIONS) + ".",
    )


class PodOverrides(ApiModel):
    """Pod-level fields added to the pod the operator renders (a PodSpec without containers)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.volumes) || self.volumes.all(v, !(v.name in "
             + "[" + ", ".join(f"'{v}'" for v in RESERVED_VOLUMES) + "]))",
             "volume names " + ", ".join(RESERVED_VOLUMES) + " are the operator's", ".volumes"),
        )
    )

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict,
        description="Node labels the pods require; merged with the gpuType placement label "
        "(a different value for that label is an error).",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints tolerated, e.g. nvidia.com/gpu:NoSchedule.",
        max_length=32,
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Pod affinity (corev1.Affinity: nodeAffinity, podAffinity, "
        "podAntiAffinity), passed as written.",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        description="Volumes the engine container can mount (spec.engine.volumeMounts), e.g. a "
        "PersistentVolumeClaim holding weights or a model cache.",
        max_length=32,
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the engine and sidecar images.",
        max_length=16,
    )
    service_account_name: str | None = Field(
        default=None, description="Service account of the pods. Unset: the namespace's default.",
        min_length=1, max_length=253, pattern=DNS_NAME_PATTERN,
    )
    priority_class_name: str | None = Field(
        default=None, description="PriorityClass of the pods.", min_length=1, max_length=253,
        pattern=DNS_NAME_PATTERN,
    )


class PodTemplate(ApiModel):
    """What the pods add to the operator's own shape (docs/install.md, "The merge rule"):
    everything here is added; what the operator sets itself is reserved."""

    metadata: PodMetadata = Field(
        default_factory=lambda: PodMetadata.model_validate({}),
        description="Pod labels and annotations.",
    )
    spec: PodOverrides = Field(
        default_factory=lambda: PodOverrides.model_validate({}),
        description="Placement, volumes, pull secrets, service account, priority class.",
    )


class TokenSecretRef(ApiModel):
    """A key of a Secret (same namespace) holding a Hugging Face access token."""

    name: str = Field(description="Secret name.", min_length=1, max_length=253)
    key: str = Field(default="HF_TOKEN", description="Key in the Secret. Default: HF_TOKEN.",
                     min_length=1, max_length=253)


class ModelSource(ApiModel):
    """Where vLLM loads the weights from; spec.model stays the served name."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("self.uri.startsWith('hf://') || (!has(self.hfTokenSecret) && !has(self.revision))",
             "hfTokenSecret and revision need an hf:// uri", ".uri"),
        )
    )

    uri: str = Field(
        description="hf://<org>/<name> (a Hugging Face model id), pvc://<claim>[/<path>] (the "
        f"claim is mounted read-only at {MODEL_MOUNT}, vLLM loads <path> in it), or an "
        "absolute path on a volume of spec.template mounted by spec.engine.volumeMounts.",
        min_length=2, max_length=1024, pattern=MODEL_URI_PATTERN,
    )
    revision: str | None = Field(
        default=None, description="Hugging Face revision (branch, tag or commit): vLLM's "
        "--revision.", min_length=1, max_length=256,
    )
    hf_token_secret: TokenSecretRef | None = Field(
        default=None, description="The Hugging Face token for a gated model, given to vLLM as "
        "HF_TOKEN from this Secret.",
    )

    def vllm_model(self) -> str:
        """What vLLM's ``--model`` gets: the id, or the path in the container."""
        if self.uri.startswith("hf://"):
            return self.uri[len("hf://"):]
        if self.uri.startswith("pvc://"):
            _, _, path = self.uri[len("pvc://"):].partition("/")
            return f"{MODEL_MOUNT}/{path}".rstrip("/")
        return self.uri

    def claim(self) -> str | None:
        """The PersistentVolumeClaim of a ``pvc://`` source."""
        if not self.uri.startswith("pvc://"):
            return None
        return self.uri[len("pvc://"):].partition("/")[0]


class EngineSpec(ApiModel):
    """The vLLM engine container of each replica."""

    image: str = Field(description="vLLM container image.", min_length=1, max_length=512)
    args: list[str] = Field(
        default_factory=list,
        description="Extra vLLM arguments. The operator adds --scheduling-policy priority, "
        "--host 127.0.0.1 (0.0.0.0 with enforcement engine) and --port 8001 itself, and "
        "with enforcement engine --scheduler-cls (the plugin on vLLM's async scheduler; "
        "with --no-async-scheduling here, on its synchronous one). Default: none.",
        max_length=64,
    )
    gpus: int = Field(
        default=1, description="GPUs per replica (nvidia.com/gpu). Default: 1.", ge=0, le=16
    )
    gpu_type: str = Field(
        default="h100",
        description="GPU family; picks the shipped latency profile latency_<model>_<gpuType>.json "
        "and, with gpus above 0, the node label the pods require (the operator's "
        "gpuNodeLabel/gpuNodeValues settings; by default nvidia.com/gpu.product). "
        "Default: h100.",
        max_length=32,
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment of the vLLM container (e.g. HF_HOME, VLLM_* settings, a "
        "value from a Secret); names starting with SLIPSTREAM_ are the operator's. Default: none.",
        max_length=64,
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        description="Secrets and ConfigMaps whose keys all become environment variables of "
        "the vLLM container. Default: none.",
        max_length=16,
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        description="Volumes of spec.template.spec.volumes mounted into the vLLM container, "
        "e.g. a model cache. Default: none.",
        max_length=32,
    )
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements.model_validate({}),
        description="Requests and limits of the vLLM container (cpu, memory, ...); the "
        "operator adds limits nvidia.com/gpu from gpus, so nvidia.com/gpu is not set here. "
        "Default: none.",
    )
    shm_size: str | None = Field(
        default=None,
        description="Size of a memory-backed /dev/shm (an emptyDir, medium Memory) for vLLM's "
        "worker processes, e.g. 2Gi; needed with tensor parallelism (gpus above 1). Unset: "
        "the container runtime's default (often 64Mi).",
        max_length=32,
        pattern=QUANTITY_PATTERN,
    )


class Ordering(StrEnum):
    FCFS = "fcfs"
    SJF = "sjf"
    TRAIL = "trail"
    GITTINS = "gittins"


class Enforcement(StrEnum):
    SIDECAR = "sidecar"
    ENGINE = "engine"


class LatencyModelPolicy(StrEnum):
    AUTO = "auto"
    PROFILE = "profile"
    NONE = "none"


PROFILE_AT_START_MIN_S = 10.0
PROFILE_AT_START_MAX_S = 3600.0
"""``spec.scheduling.profileAtStart``, when not 0: between these (seconds)."""


class SchedulingSpec(ApiModel):
    """How each pod's sidecar orders and co-locates work."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "!has(self.profileAtStart) || duration(self.profileAtStart) == duration('0s')"
                " || (duration(self.profileAtStart) >= duration('10s')"
                " && duration(self.profileAtStart) <= duration('1h'))",
                "profileAtStart must be 0s (off) or a duration between 10s and 1h, e.g. 90s",
                ".profileAtStart",
            ),
        )
    )

    ordering: Ordering = Field(
        default=Ordering.GITTINS,
        description="Online queue order: fcfs, sjf, trail or gittins. Default: gittins.",
    )
    co_location: bool = Field(
        default=True, description="Run offline work on this service's pods. Default: true."
    )
    enforcement: Enforcement = Field(
        default=Enforcement.SIDECAR,
        description="Where the latency budget is enforced. sidecar: online traffic enters "
        "the sidecar, which admits every request into a stock vLLM. engine: vLLM runs "
        "Slipstream's scheduler plugin (--scheduler-cls; engine.image must include it, see "
        "docs/plugin.md), online traffic goes straight to vLLM's port and the sidecar keeps "
        "the control API and the offline shards. Default: sidecar.",
    )
    latency_model: LatencyModelPolicy = Field(
        default=LatencyModelPolicy.AUTO,
        description="Which latency model budgets the offline work. auto: the profile for "
        "(model, gpuType) if there is one, else the model the pods learn from their engine "
        "(docs/concepts/learned-latency-model.md). profile: profiles only. none: no model "
        "and no budget, offline work fills free capacity (naive co-location). Default: auto.",
    )
    profile_at_start: Duration | None = Field(
        default=None,
        description="Profile each pod's engine for this long when the pod starts, before it "
        "reports ready (slipstream profile engine, run by the sidecar; 10s to 1h, e.g. 90s). "
        "With latencyModel auto and no profile file for (model, gpuType), the operator uses "
        "the profiled model under the same bar as a learned one "
        "(docs/concepts/learned-latency-model.md). A profile that fails or runs over never "
        "keeps the pod unready. Unset or 0s: off.",
    )

    max_wait: Duration | None = Field(
        default=None,
        description="Tail guard of the size-based orderings (sjf, trail, gittins): an online "
        "request that has waited this long is served in arrival (deadline) order ahead of the "
        "ranked ones, so the ordering cannot starve it (docs/concepts/ordering-and-prefix.md). "
        "Unset: the TTFT p99 target, else 4x the TTFT mean target, else 30s. 0s: no guard.",
    )

    def max_wait_s(self) -> float | None:
        """``max_wait`` in seconds; None when unset (the pod derives it from the SLO)."""
        return None if self.max_wait is None else parse_duration(self.max_wait)

    def profile_at_start_s(self) -> float:
        """``profile_at_start`` in seconds; 0 when off."""
        return 0.0 if self.profile_at_start is None else parse_duration(self.profile_at_start)


class SidecarSpec(ApiModel):
    """The Slipstream sidecar container of each replica."""

    image: str | None = Field(
        default=None,
        description="Sidecar image. Unset: the operator's default (the chart's sidecar.image, "
        "env SLIPSTREAM_OPERATOR_SIDECAR_IMAGE; " + DEFAULT_SIDECAR_IMAGE + " unless "
        "changed), so one setting moves every service that does not name its own.",
        min_length=1,
        max_length=512,
    )
    http_port: int = Field(
        default=8000,
        description="OpenAI-compatible HTTP port (the pod's serving port). Default: 8000.",
        ge=1,
        le=65535,
    )
    grpc_port: int = Field(
        default=9000,
        description="Control gRPC port the operator dials. Default: 9000.",
        ge=1,
        le=65535,
    )
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description="Sidecar container resources. Empty (no requests and no limits): the "
        "operator's default (the chart's sidecar.resources, env "
        "SLIPSTREAM_OPERATOR_SIDECAR_RESOURCES; none unless set).",
    )


class PortNumber(ApiModel):
    """A port by number (the Gateway API Inference Extension's ``Port``)."""

    number: int = Field(description="Port number, 1 to 65535.", ge=1, le=65535)


class EndpointPickerRef(ApiModel):
    """The endpoint picker (EPP) the InferencePool names; copied into the pool as it is."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("self.kind != 'Service' || has(self.port)",
             "port is required when kind is Service", ".port"),
        )
    )

    group: str = Field(
        default="",
        description="API group of the picker object; empty is the core group. Default: empty.",
        max_length=253,
        pattern=r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    )
    kind: str = Field(
        default="Service",
        description="Kind of the picker object. Default: Service.",
        min_length=1,
        max_length=63,
        pattern=r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$",
    )
    name: str = Field(
        description="Name of the picker object (same namespace), e.g. the EPP's Service.",
        min_length=1,
        max_length=253,
    )
    port: PortNumber | None = Field(
        default=None,
        description="The picker Service's port (its service port, e.g. 9002); required when "
        "kind is Service.",
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the picker does not answer: FailOpen or "
        "FailClose. Default: FailClose.",
    )


class InferencePoolSpec(ApiModel):
    """An InferencePool (inference.networking.k8s.io/v1) for this service's pods."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!self.enabled || has(self.endpointPickerRef)",
             "endpointPickerRef is required when enabled", ".endpointPickerRef"),
        )
    )

    enabled: bool = Field(
        default=False,
        description="Create and own an InferencePool of the same name whose selector matches "
        "exactly this service's pods and whose target port is the one online traffic enters. "
        "Needs the InferencePool CRD (a condition InferencePool says when it is missing) and, "
        "with the chart, gateway.inferencePool.enabled. Default: false.",
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        default=None,
        description="The endpoint picker that routes to the pool; required when enabled.",
    )


class GatewaySpec(ApiModel):
    """How an inference gateway (Gateway API Inference Extension, llm-d) reaches the pods."""

    inference_pool: InferencePoolSpec = Field(
        default_factory=lambda: InferencePoolSpec.model_validate({}),
        description="The InferencePool for this service. Default: none.",
    )


class InferenceServiceSpec(ApiModel):
    """Desired state of an online LLM service whose pods may also run offline work."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.sidecar.httpPort != self.sidecar.grpcPort",
                "sidecar httpPort and grpcPort must differ",
                ".sidecar.grpcPort",
            ),
            (
                f"self.sidecar.httpPort != {ENGINE_PORT} && self.sidecar.grpcPort != {ENGINE_PORT}",
                f"sidecar ports must differ from vLLM's port {ENGINE_PORT}",
                ".sidecar",
            ),
        )
    )

    model: str = Field(
        description="Served model name: what OfflineJobs (spec.model) and clients (the "
        "request's model) use, given to vLLM as --served-model-name. Without modelSource it "
        "is also what vLLM loads (--model), e.g. meta-llama/Llama-2-7b-hf.",
        min_length=1,
        max_length=256,
    )
    model_source: ModelSource | None = Field(
        default=None,
        description="Where vLLM loads the weights from (a Hugging Face id with its token "
        "Secret, a PersistentVolumeClaim, or a path on a volume). Unset: vLLM loads spec.model.",
    )
    engine: EngineSpec = Field(description="The vLLM engine container.")
    template: PodTemplate = Field(
        default_factory=lambda: PodTemplate.model_validate({}),
        description="Labels, annotations, placement, volumes, pull secrets, service account "
        "and priority class of the pods, added to the operator's own (reserved names are "
        "refused). Default: none.",
    )
    replicas: int = Field(default=1, description="Number of pods. Default: 1.", ge=0, le=1000)
    slo: SLOSpec = Field(description="Latency SLOs; at least one target.")
    scheduling: SchedulingSpec = Field(
        default_factory=lambda: SchedulingSpec.model_validate({}),
        description="Ordering and co-location.",
    )
    sidecar: SidecarSpec = Field(
        default_factory=lambda: SidecarSpec.model_validate({}), description="Sidecar container."
    )
    gateway: GatewaySpec = Field(
        default_factory=lambda: GatewaySpec.model_validate({}),
        description="Inference-gateway integration (an InferencePool). Default: none.",
    )


class ObservedLatency(ApiModel):
    """Online latency measured over the window (durations)."""

    ttft_mean: Duration | None = Field(default=None, description="Mean time to first token.")
    ttft_p99: Duration | None = Field(default=None, description="P99 time to first token.")
    tbt_mean: Duration | None = Field(default=None, description="Mean time between tokens.")
    tbt_p99: Duration | None = Field(default=None, description="P99 time between tokens.")
    window: Duration = Field(default="5m", description="Window the statistics cover. Default: 5m.")
    samples: int = Field(default=0, description="Online requests in the window. Default: 0.", ge=0)
    source: Literal["sidecar", "prometheus", "none"] = Field(
        default="none", description="Where the numbers came from: sidecar, prometheus or none."
    )


class BudgetStatus(ApiModel):
    """The per-iteration latency budget pushed to the pods."""

    iteration: Duration = Field(description="Predicted-iteration-time cap in force, e.g. 45ms.")
    searched: Duration | None = Field(
        default=None, description="Budget the SLO-aware search found for the current load and SLOs."
    )
    computed_at: datetime = Field(description="When the budget was last changed.")
    reason: str = Field(
        description="Why it has this value: Searched, Tightened, Loosened, Held.",
        pattern=CAMEL_REASON_PATTERN,
        max_length=64,
    )
    config_generation: int = Field(
        default=0, description="Generation of the Configure call that carried it. Default: 0.", ge=0
    )
    profile: str = Field(
        default="", description="Latency profile used, e.g. shipped:llama-2-7b-hf_h100."
    )


class LatencyModelStatus(ApiModel):
    """The latency model the budget search and the pods use."""

    source: Literal["shipped", "user", "profiled", "learned", "none"] = Field(
        default="none",
        description="Where it came from: shipped (a profile shipped with Slipstream), user "
        "(a profile from the operator's profile folder), profiled (a profile timed on the real "
        "engine by slipstream profile engine), learned (fitted by a pod's sidecar from its own "
        "engine's steps), none (no model good enough yet: see the BudgetReady condition).",
    )
    name: str = Field(
        default="",
        description="The profile file, e.g. shipped:latency_llama-2-7b_h100.json, or the pod "
        "whose learned model is in force.",
        max_length=512,
    )
    steps: int | None = Field(
        default=None, description="Learned models: engine steps the fit used.", ge=0
    )
    heldout_mape: float | None = Field(
        default=None,
        alias="heldoutMAPE",
        description="Learned models: mean absolute percentage error (fraction) on recent steps "
        "the fit did not see.",
        ge=0,
    )
    revision: int | None = Field(
        default=None,
        description="Learned models: the pod's revision; each refit that replaces the model "
        "increases it and makes a new budget search.",
        ge=0,
    )
    held: str | None = Field(
        default=None,
        description="Learned models: set while no ready pod reports an acceptable model (its "
        "pod restarting or not ready, or its newest fit not passing): the model last in force "
        "and its budget stay, and this says why it is held.",
        max_length=1024,
    )
    scale: float | None = Field(
        default=None,
        description="Profiles: the calibration factor on every coefficient, when not 1 "
        "(refitted from the pods' observed step times).",
        gt=0,
    )


class KvCacheStatus(ApiModel):
    """The engine's KV cache, as the budget search simulates it."""

    blocks: int = Field(description="KV blocks of one pod's engine.", ge=1)
    block_size: int = Field(description="Tokens per KV block.", ge=1)
    source: Literal["engine", "args"] = Field(
        description="Where it came from: engine (the ready pods' sidecars read vLLM's "
        "num_gpu_blocks and block_size from its /metrics; the smallest KV where they differ) "
        "or args (--num-gpu-blocks-override and --block-size in spec.engine.args)."
    )


class OfflineStatus(ApiModel):
    """Offline work running on this service's pods."""

    tokens_per_second: float = Field(
        default=0.0, description="Offline output tokens per second over all pods. Default: 0.", ge=0
    )
    active_shards: int = Field(
        default=0, description="Offline shards assigned now. Default: 0.", ge=0
    )


class InferenceServiceStatus(ApiModel):
    """Observed state of an InferenceService, written by the operator."""

    observed_generation: int = Field(
        default=0, description="Last metadata.generation acted on.", ge=0
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, SLOMet, BudgetReady and, with spec.gateway.inferencePool, "
        "InferencePool.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    replicas: int = Field(default=0, description="Pods that exist.", ge=0)
    ready_replicas: int = Field(default=0, description="Pods whose sidecar reports ready.", ge=0)
    observed: ObservedLatency | None = Field(default=None, description="Measured online latency.")
    budget: BudgetStatus | None = Field(default=None, description="Budget in force.")
    latency_model: LatencyModelStatus | None = Field(
        default=None, description="The latency model in force and where it came from."
    )
    offline: OfflineStatus | None = Field(
        default=None, description="Offline throughput on these pods."
    )
    kv_cache: KvCacheStatus | None = Field(
        default=None,
        description="The engine's KV cache the budget search simulates; absent while neither "
        "the pods nor spec.engine.args say (the search then sizes it from GPU memory, or from "
        "budget_search.kv_tokens where the latency model times the steps).",
    )
    slo_summary: str = Field(
        default="", description="Observed vs target for the tightest SLO, e.g. ttft-p99 1.2s/2s."
    )


class InferenceService(ApiModel):
    """An online LLM service with latency SLOs whose pods also run offline work."""

    api_version: Literal["slipstream.dev/v1alpha1"] = Field(
        default="slipstream.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None


# --------------------------------------------------------------------------- OfflineJob


class InputSpec(ApiModel):
    """Where the job's requests are (OpenAI Batch API JSONL)."""

    uri: Uri = Field(description="file:// or s3:// URI of the input JSONL file.")


class OutputSpec(ApiModel):
    """Where results go (OpenAI Batch API output JSONL)."""

    uri: Uri = Field(
        description="file:// or s3:// URI of the output JSONL file, written whole at the end "
        "(a non-file:// output is staged on the operator's job-storage claim)."
    )
    error_uri: Uri | None = Field(
        default=None, description="URI of the error JSONL file (file:// or s3://, like uri). "
        "Default: <uri> with .errors.jsonl."
    )

    @property
    def errors(self) -> str:
        if self.error_uri is not None:
            return self.error_uri
        base = self.uri[: -len(".jsonl")] if self.uri.endswith(".jsonl") else self.uri
        return f"{base}.errors.jsonl"


class RequestDefaults(ApiModel):
    """Body fields added to each request that does not set them."""

    max_tokens: int | None = Field(
        default=None, description="Default max_tokens.", ge=1, le=1_000_000
    )
    temperature: float | None = Field(default=None, description="Default temperature.", ge=0, le=2)

    def body_fields(self) -> dict[str, Any]:
        """The defaults as OpenAI request-body fields (``max_tokens``, not ``maxTokens``)."""
        return self.model_dump(by_alias=False, exclude_none=True, mode="json")


class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class OfflineJobSpec(ApiModel):
    """Desired state of a batch of OpenAI Batch API requests run on spare capacity."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "self.input.uri != self.output.uri",
                "input and output URIs must differ",
                ".output.uri",
            ),
            (
                "!has(self.output.errorUri) || (self.output.errorUri != self.output.uri"
                " && self.output.errorUri != self.input.uri)",
                "output.errorUri must differ from the input and output URIs",
                ".output.errorUri",
            ),
            (
                "duration(self.completionWindow) >= duration('1m')"
                " && duration(self.completionWindow) <= duration('720h')",
                "completionWindow must be a duration between 1m and 720h, e.g. 24h",
                ".completionWindow",
            ),
        )
    )

    model: str = Field(
        description="Model name; must equal the hosting services' spec.model.",
        min_length=1,
        max_length=256,
    )
    input: InputSpec = Field(description="Input JSONL.")
    output: OutputSpec = Field(description="Output and error JSONL.")
    service_selector: LabelSelector = Field(
        default_factory=LabelSelector,
        description="Labels of the InferenceServices (same namespace) that may host the job. "
        "Default: every service of the same model.",
    )
    priority: int = Field(
        default=0,
        description="Higher runs first among jobs sharing pods. Default: 0.",
        ge=-1000,
        le=1000,
    )
    completion_window: Duration = Field(
        default="24h",
        description="Time from start after which unfinished requests fail. Default: 24h.",
    )
    suspend: bool = Field(
        default=False, description="Stop assigning work and revoke running shards."
    )
    request_defaults: RequestDefaults = Field(
        default_factory=lambda: RequestDefaults.model_validate({}),
        description="Defaults for request bodies.",
    )
    shard_size: int = Field(
        default=256,
        description="Requests per shard (the unit of placement). Default: 256.",
        ge=1,
        le=100_000,
    )


class RequestCounts(ApiModel):
    """Request counts (OpenAI Batch request_counts)."""

    total: int = Field(default=0, description="Lines in the input.", ge=0)
    completed: int = Field(
        default=0, description="Requests with a result in the output file.", ge=0
    )
    failed: int = Field(default=0, description="Requests with a record in the error file.", ge=0)


class ShardCounts(ApiModel):
    """Shard bookkeeping."""

    total: int = Field(default=0, description="Shards planned.", ge=0)
    assigned: int = Field(default=0, description="Shards running on a pod now.", ge=0)
    done: int = Field(default=0, description="Shards whose every request has a record.", ge=0)
    reassigned: int = Field(default=0, description="Times a shard moved to another pod.", ge=0)


class OfflineJobStatus(ApiModel):
    """Observed state of an OfflineJob, written by the operator."""

    observed_generation: int = Field(
        default=0, description="Last metadata.generation acted on.", ge=0
    )
    phase: Phase = Field(
        default=Phase.PENDING, description="Pending, Running, Suspended, Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Admitted, Running, Suspended, Complete, Failed.",
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    requests: RequestCounts = Field(
        default_factory=lambda: RequestCounts.model_validate({}), description="Request counts."
    )
    shards: ShardCounts = Field(
        default_factory=lambda: ShardCounts.model_validate({}), description="Shard counts."
    )
    progress: str = Field(default="", description="done/total requests, e.g. 120/1000.")
    tokens_per_second: float = Field(
        default=0.0, description="Offline output tokens/s of this job.", ge=0
    )
    eta: str = Field(
        default="", description="Estimated time to completion at the current rate, e.g. 5m0s."
    )
    start_time: datetime | None = Field(
        default=None, description="When the first shard was assigned."
    )
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    output_uri: str = Field(default="", description="Where the merged output is, once Succeeded.")


class OfflineJob(ApiModel):
    """A batch of OpenAI Batch API requests run on the spare capacity of InferenceServices."""

    api_version: Literal["slipstream.dev/v1alpha1"] = Field(
        default="slipstream.dev/v1alpha1", alias="apiVersion"
    )
    kind: Literal["OfflineJob"] = "OfflineJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: OfflineJobSpec
    status: OfflineJobStatus | None = None


# --------------------------------------------------------------------------- semantics


def validate_semantics(spec: InferenceServiceSpec | OfflineJobSpec) -> list[str]:
    """The CEL rules, in Python, and for an InferenceService the pod's merge rule
    (:func:`pod_problems`): messages naming the field, empty when the spec is valid."""
    problems: list[str] = []
    if isinstance(spec, InferenceServiceSpec):
        if spec.slo.ttft is None and spec.slo.tbt is None:
            problems.append("spec.slo: set at least one SLO (ttft or tbt)")
        for name, target in (("ttft", spec.slo.ttft), ("tbt", spec.slo.tbt)):
            if target is None:
                continue
            if target.mean is None and target.p99 is None:
                problems.append(f"spec.slo.{name}: set at least one of mean and p99")
            if (
                target.mean is not None
                and target.p99 is not None
                and parse_duration(target.p99) < parse_duration(target.mean)
            ):
                problems.append(f"spec.slo.{name}.p99: p99 must be at least the mean")
        profile_s = spec.scheduling.profile_at_start_s()
        if profile_s and not PROFILE_AT_START_MIN_S <= profile_s <= PROFILE_AT_START_MAX_S:
            problems.append("spec.scheduling.profileAtStart: must be 0s (off) or between 10s "
                            "and 1h")
        if spec.sidecar.http_port == spec.sidecar.grpc_port:
            problems.append("spec.sidecar.grpcPort: sidecar httpPort and grpcPort must differ")
        pool = spec.gateway.inference_pool
        if pool.enabled and pool.endpoint_picker_ref is None:
            problems.append("spec.gateway.inferencePool.endpointPickerRef: required when enabled")
        ref = pool.endpoint_picker_ref
        if ref is not None and ref.kind == "Service" and ref.port is None:
            problems.append("spec.gateway.inferencePool.endpointPickerRef.port: required when "
                            "kind is Service")
        problems += pod_problems(spec)
    else:
        if spec.input.uri == spec.output.uri:
            problems.append("spec.output.uri: input and output URIs must differ")
        if spec.output.error_uri is not None and spec.output.error_uri in (
            spec.output.uri,
            spec.input.uri,
        ):
            problems.append("spec.output.errorUri: must differ from the input and output URIs")
        window = parse_duration(spec.completion_window)
        if not 60.0 <= window <= 720 * 3600.0:
            problems.append("spec.completionWindow: must be between 1m and 720h")
    return problems


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def pod_problems(spec: InferenceServiceSpec) -> list[str]:
    """What of ``spec.engine``, ``spec.template`` and ``spec.modelSource`` would override the
    operator's own part of the pod (the merge rule: everything else is added as written),
    or cannot make a pod; one message per problem, naming the field."""
    problems: list[str] = []
    for port_field, port in (("httpPort", spec.sidecar.http_port),
                             ("grpcPort", spec.sidecar.grpc_port)):
        if port == ENGINE_PORT:
            problems.append(f"spec.sidecar.{port_field}: {ENGINE_PORT} is vLLM's port")
    for i, arg in enumerate(spec.engine.args):
        if _flag(arg) in RESERVED_ENGINE_FLAGS:
            problems.append(f"spec.engine.args[{i}]: {_flag(arg)} is set by the operator "
                            "(spec.model, spec.modelSource, the pod's ports)")
    problems += _env_problems(spec)
    gpu_keys = [f"spec.engine.resources.{part}[{GPU_RESOURCE!r}]"
                for part, values in (("requests", spec.engine.resources.requests),
                                     ("limits", spec.engine.resources.limits))
                if GPU_RESOURCE in values]
    problems += [f"{key}: set spec.engine.gpus instead" for key in gpu_keys]
    meta = spec.template.metadata
    problems += [f"spec.template.metadata.labels[{k!r}]: set by the operator"
                 for k in RESERVED_LABELS if k in meta.labels]
    problems += [f"spec.template.metadata.annotations[{k!r}]: set by the operator"
                 for k in RESERVED_ANNOTATIONS if k in meta.annotations]
    problems += _volume_problems(spec)
    source = spec.model_source
    if source is not None and not source.uri.startswith("hf://"):
        for name, value in (("revision", source.revision),
                            ("hfTokenSecret", source.hf_token_secret)):
            if value is not None:
                problems.append(f"spec.modelSource.{name}: needs an hf:// uri")
    return problems


def _env_problems(spec: InferenceServiceSpec) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    token = spec.model_source.hf_token_secret if spec.model_source is not None else None
    for i, env in enumerate(spec.engine.env):
        where = f"spec.engine.env[{i}]"
        if env.name.startswith(RESERVED_ENV_PREFIX):
            problems.append(f"{where}.name: {env.name}: names starting with "
                            f"{RESERVED_ENV_PREFIX} are the operator's")
        if env.name == "HF_TOKEN" and token is not None:
            problems.append(f"{where}.name: HF_TOKEN comes from spec.modelSource.hfTokenSecret")
        if env.name in seen:
            problems.append(f"{where}.name: {env.name} is set twice")
        seen.add(env.name)
        if env.value is not None and env.value_from is not None:
            problems.append(f"{where}.valueFrom: set value or valueFrom, not both")
        source = env.value_from
        if source is not None and sum(x is not None for x in (
                source.secret_key_ref, source.config_map_key_ref, source.field_ref,
                source.resource_field_ref)) != 1:
            problems.append(f"{where}.valueFrom: set exactly one of secretKeyRef, "
                            "configMapKeyRef, fieldRef, resourceFieldRef")
    for i, env_from in enumerate(spec.engine.env_from):
        if (env_from.secret_ref is None) == (env_from.config_map_ref is None):
            problems.append(f"spec.engine.envFrom[{i}]: set exactly one of secretRef and "
                            "configMapRef")
    return problems


def _volume_problems(spec: InferenceServiceSpec) -> list[str]:
    problems: list[str] = []
    names: set[str] = set()
    for i, volume in enumerate(spec.template.spec.volumes):
        where = f"spec.template.spec.volumes[{i}]"
        if volume.name in RESERVED_VOLUMES:
            problems.append(f"{where}.name: {volume.name} is the operator's (reserved: "
                            f"{', '.join(RESERVED_VOLUMES)})")
        elif volume.name in names:
            problems.append(f"{where}.name: {volume.name} is named twice")
        names.add(volume.name)
        if len(volume.source_keys()) != 1:
            problems.append(f"{where}: set exactly one volume source (persistentVolumeClaim, "
                            f"emptyDir, hostPath, ...), not {volume.source_keys() or 'none'}")
    reserved_paths = [SHM_MOUNT, *RESERVED_MOUNT_PREFIXES]
    if spec.model_source is not None and spec.model_source.claim() is not None:
        reserved_paths.append(MODEL_MOUNT)
    paths: set[str] = set()
    for i, mount in enumerate(spec.engine.volume_mounts):
        where = f"spec.engine.volumeMounts[{i}]"
        if mount.name not in names or mount.name in RESERVED_VOLUMES:
            problems.append(f"{where}.name: {mount.name} is not a volume of "
                            "spec.template.spec.volumes")
        path = mount.mount_path.rstrip("/") or "/"
        clash = [r for r in reserved_paths if path == r or path.startswith(r + "/")]
        if clash:
            hint = "; set spec.engine.shmSize" if SHM_MOUNT in clash else ""
            problems.append(f"{where}.mountPath: {mount.mount_path} overlaps the operator's "
                            f"{clash[0]}{hint}")
        elif path in paths:
            problems.append(f"{where}.mountPath: {mount.mount_path} is mounted twice")
        paths.add(path)
    return problems


KINDS: dict[str, tuple[type[ApiModel], type[ApiModel], type[ApiModel]]] = {
    "InferenceService": (InferenceService, InferenceServiceSpec, InferenceServiceStatus),
    "OfflineJob": (OfflineJob, OfflineJobSpec, OfflineJobStatus),
}
"""kind -> (object model, spec model, status model)."""
